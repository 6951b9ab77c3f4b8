//! Datasets (MNIST, Fashion-MNIST, the bundled MNIST subset), sharding and mini-batches.
//!
//! [`load`] returns a train and a test [`Dataset`] with pixels scaled to `[0, 1]`.
//! Each worker takes its [`Dataset::shard`] of the train set and draws shuffled,
//! seeded mini-batches from a [`Batcher`], epoch after epoch.

use std::borrow::Borrow;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use ndarray::{Array2, ArrayView2, Axis};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

use crate::TrainError;
use crate::idx::{self, IdxImages};

/// Number of classes of every supported dataset (digits or clothing types 0..=9).
pub const NUM_CLASSES: usize = 10;

/// Pixels per image of every supported dataset (28 x 28).
pub const PIXELS: usize = 28 * 28;

/// Base names of the four IDX files, in the order train images, train labels, test
/// images, test labels. Each may exist as is or with a `.gz` suffix.
pub const FILE_NAMES: [&str; 4] =
    ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"];

/// The bundled subset (first 10,000 train and first 2,000 test examples of MNIST),
/// embedded in the binary so it works from any directory without a download.
const SUBSET: [(&str, &[u8]); 4] = [
    (
        "train-images-idx3-ubyte.gz",
        include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/mnist-subset/train-images-idx3-ubyte.gz")),
    ),
    (
        "train-labels-idx1-ubyte.gz",
        include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/mnist-subset/train-labels-idx1-ubyte.gz")),
    ),
    (
        "t10k-images-idx3-ubyte.gz",
        include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/mnist-subset/t10k-images-idx3-ubyte.gz")),
    ),
    (
        "t10k-labels-idx1-ubyte.gz",
        include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/mnist-subset/t10k-labels-idx1-ubyte.gz")),
    ),
];

/// Labelled images in memory.
#[derive(Clone, Debug, PartialEq)]
pub struct Dataset {
    /// One image per row (`n x 784` for MNIST), pixels scaled from `0..=255` to `[0, 1]`.
    pub images: Array2<f32>,
    /// One label per image, each `< NUM_CLASSES`.
    pub labels: Vec<u8>,
}

impl Dataset {
    /// Builds a dataset from parsed IDX images and labels, checking that they agree and
    /// that every label is a class. `name` names the dataset in errors.
    pub fn from_idx(images: IdxImages, labels: Vec<u8>, name: &str) -> Result<Self, TrainError> {
        let inconsistent = |reason: String| TrainError::Inconsistent { dataset: name.to_owned(), reason };
        if images.count != labels.len() {
            return Err(inconsistent(format!("{} images but {} labels", images.count, labels.len())));
        }
        if let Some((i, l)) = labels.iter().enumerate().find(|&(_, &l)| usize::from(l) >= NUM_CLASSES) {
            return Err(inconsistent(format!("label {l} of example {i} is not a class 0..={}", NUM_CLASSES - 1)));
        }
        let per = images.pixels_per_image();
        let pixels: Vec<f32> = images.pixels.iter().map(|&p| f32::from(p) / 255.0).collect();
        let images = Array2::from_shape_vec((images.count, per), pixels).expect("IDX parser checked the length");
        Ok(Self { images, labels })
    }

    /// Number of examples.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// True if the dataset holds no example.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Number of input features (pixels) per example.
    pub fn features(&self) -> usize {
        self.images.ncols()
    }

    /// The examples `i` with `i % world == rank`, in order: worker `rank`'s share of a
    /// dataset split among `world` workers. Shards are disjoint, cover the dataset, and
    /// differ in size by at most one.
    ///
    /// # Panics
    /// If `world == 0` or `rank >= world`.
    pub fn shard(&self, rank: usize, world: usize) -> Dataset {
        assert!(world > 0 && rank < world, "shard {rank} of {world} does not exist (need rank < world)");
        let idx: Vec<usize> = (rank..self.len()).step_by(world).collect();
        Dataset { images: self.images.select(Axis(0), &idx), labels: idx.iter().map(|&i| self.labels[i]).collect() }
    }
}

/// Which dataset to train on; parses from and prints as the CLI values
/// `mnist-subset` (the default), `mnist` and `fashion-mnist`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DatasetKind {
    /// The first 10,000 train and 2,000 test examples of MNIST, embedded in the binary.
    #[default]
    MnistSubset,
    /// Full MNIST (60,000 + 10,000), installed by `scripts/fetch-data`.
    Mnist,
    /// Full Fashion-MNIST (60,000 + 10,000), from the Debian package `dataset-fashion-mnist`.
    FashionMnist,
}

impl DatasetKind {
    /// Every kind, in CLI order.
    pub const ALL: [DatasetKind; 3] = [DatasetKind::MnistSubset, DatasetKind::Mnist, DatasetKind::FashionMnist];

    /// The CLI value.
    pub fn as_str(self) -> &'static str {
        match self {
            DatasetKind::MnistSubset => "mnist-subset",
            DatasetKind::Mnist => "mnist",
            DatasetKind::FashionMnist => "fashion-mnist",
        }
    }

    /// Human name used in messages.
    pub fn title(self) -> &'static str {
        match self {
            DatasetKind::MnistSubset => "MNIST subset",
            DatasetKind::Mnist => "MNIST",
            DatasetKind::FashionMnist => "Fashion-MNIST",
        }
    }

    /// Where the files are looked for when no directory is given: `~/.cache/elasticps/mnist`
    /// for MNIST (where `scripts/fetch-data` installs it), `/usr/share/datasets/fashion-mnist`
    /// for Fashion-MNIST (the Debian package), `None` for the embedded subset, or for MNIST
    /// when `HOME` is not set.
    pub fn default_dir(self) -> Option<PathBuf> {
        match self {
            DatasetKind::MnistSubset => None,
            DatasetKind::Mnist => std::env::var_os("HOME")
                .filter(|h| !h.is_empty())
                .map(|h| PathBuf::from(h).join(".cache/elasticps/mnist")),
            DatasetKind::FashionMnist => Some(PathBuf::from("/usr/share/datasets/fashion-mnist")),
        }
    }

    fn install_hint(self) -> &'static str {
        match self {
            DatasetKind::FashionMnist => {
                "install it with scripts/fetch-data (or apt-get install dataset-fashion-mnist), or pass --data-dir"
            }
            _ => "run scripts/fetch-data or pass --data-dir",
        }
    }
}

impl fmt::Display for DatasetKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for DatasetKind {
    type Err = TrainError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL.into_iter().find(|k| k.as_str() == s).ok_or_else(|| TrainError::UnknownDataset(s.to_owned()))
    }
}

/// Finds `dir/name`, `dir/name.gz`, or the dotted spelling some mirrors use
/// (`train-images.idx3-ubyte`, with or without `.gz`).
fn find_file(kind: DatasetKind, dir: &Path, name: &str) -> Result<PathBuf, TrainError> {
    let dotted = name.replacen("-idx", ".idx", 1);
    [name.to_owned(), format!("{name}.gz"), dotted.clone(), format!("{dotted}.gz")]
        .into_iter()
        .map(|n| dir.join(n))
        .find(|p| p.is_file())
        .ok_or_else(|| TrainError::NotFound {
            dataset: kind.title().to_owned(),
            path: dir.join(name),
            hint: kind.install_hint().to_owned(),
        })
}

/// Loads the train and test sets of `kind`.
///
/// Files are read from `data_dir` if given, else from [`DatasetKind::default_dir`]; the
/// `mnist-subset` kind without a directory uses the copy embedded in the binary. In a
/// directory, each of [`FILE_NAMES`] may be plain or gzip-compressed.
pub fn load(kind: DatasetKind, data_dir: Option<&Path>) -> Result<(Dataset, Dataset), TrainError> {
    let name = kind.title();
    let dir = data_dir.map(Path::to_path_buf).or_else(|| kind.default_dir());
    let (train_images, train_labels, test_images, test_labels) = match dir {
        None if kind == DatasetKind::MnistSubset => {
            let file = |i: usize| format!("embedded data/mnist-subset/{}", SUBSET[i].0);
            (
                idx::parse_images(SUBSET[0].1, &file(0))?,
                idx::parse_labels(SUBSET[1].1, &file(1))?,
                idx::parse_images(SUBSET[2].1, &file(2))?,
                idx::parse_labels(SUBSET[3].1, &file(3))?,
            )
        }
        None => {
            return Err(TrainError::NotFound {
                dataset: name.to_owned(),
                path: PathBuf::from("$HOME/.cache/elasticps/mnist").join(FILE_NAMES[0]),
                hint: "HOME is not set; pass --data-dir".to_owned(),
            });
        }
        Some(dir) => {
            let [a, b, c, d] = FILE_NAMES.map(|n| find_file(kind, &dir, n));
            (idx::read_images(&a?)?, idx::read_labels(&b?)?, idx::read_images(&c?)?, idx::read_labels(&d?)?)
        }
    };
    if (train_images.rows, train_images.cols) != (test_images.rows, test_images.cols) {
        return Err(TrainError::Inconsistent {
            dataset: name.to_owned(),
            reason: format!(
                "train images are {}x{} but test images are {}x{}",
                train_images.rows, train_images.cols, test_images.rows, test_images.cols
            ),
        });
    }
    let train = Dataset::from_idx(train_images, train_labels, &format!("{name} train"))?;
    let test = Dataset::from_idx(test_images, test_labels, &format!("{name} test"))?;
    Ok((train, test))
}

/// One mini-batch, borrowed from the [`Batcher`] that made it.
#[derive(Clone, Copy, Debug)]
pub struct Batch<'a> {
    /// Epoch this batch belongs to, from 0.
    pub epoch: usize,
    /// Index of the batch within its epoch, from 0.
    pub index: usize,
    /// True for the last batch of its epoch.
    pub last_in_epoch: bool,
    /// Inputs, one example per row.
    pub x: ArrayView2<'a, f32>,
    /// Labels, one per row of `x`.
    pub y: &'a [u8],
}

/// Endless, seeded, shuffled mini-batches over a dataset.
///
/// Every epoch visits every example exactly once, in a fresh random order drawn from the
/// seed; the last batch of an epoch is smaller when the dataset size is not a multiple of
/// the batch size (no example is skipped). The same seed gives the same batches.
/// `D` is anything that borrows a [`Dataset`]: `Dataset`, `&Dataset` or `Arc<Dataset>`.
#[derive(Debug)]
pub struct Batcher<D: Borrow<Dataset> = Dataset> {
    data: D,
    batch_size: usize,
    rng: StdRng,
    order: Vec<usize>,
    pos: usize,
    epoch: usize,
    index: usize,
    x: Array2<f32>,
    y: Vec<u8>,
}

impl<D: Borrow<Dataset>> Batcher<D> {
    /// A batcher over `data` yielding batches of `batch_size` examples, shuffled by `seed`.
    pub fn new(data: D, batch_size: usize, seed: u64) -> Result<Self, TrainError> {
        let ds: &Dataset = data.borrow();
        if batch_size == 0 {
            return Err(TrainError::InvalidBatching("the batch size is 0; pass a batch size of at least 1".into()));
        }
        if ds.is_empty() {
            return Err(TrainError::InvalidBatching(
                "the dataset (shard) is empty; use fewer workers than examples".into(),
            ));
        }
        let (n, features) = (ds.len(), ds.features());
        let batch_size = batch_size.min(n);
        let mut rng = StdRng::seed_from_u64(seed);
        let mut order: Vec<usize> = (0..n).collect();
        order.shuffle(&mut rng);
        Ok(Self {
            data,
            batch_size,
            rng,
            order,
            pos: 0,
            epoch: 0,
            index: 0,
            x: Array2::zeros((batch_size, features)),
            y: Vec::with_capacity(batch_size),
        })
    }

    /// The dataset batches are drawn from.
    pub fn data(&self) -> &Dataset {
        self.data.borrow()
    }

    /// The batch size (capped at the dataset size).
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Batches per epoch (the last may be smaller).
    pub fn batches_per_epoch(&self) -> usize {
        self.order.len().div_ceil(self.batch_size)
    }

    /// The epoch the next batch belongs to, from 0.
    pub fn epoch(&self) -> usize {
        self.epoch
    }

    /// True if the next batch holds fewer than the batch size (the last of an epoch whose
    /// size the batch size does not divide).
    pub fn next_is_short(&self) -> bool {
        self.order.len() - self.pos < self.batch_size
    }

    /// The next batch; starts a new, reshuffled epoch after the last batch of an epoch.
    pub fn next_batch(&mut self) -> Batch<'_> {
        let ds: &Dataset = self.data.borrow();
        let n = self.order.len();
        let take = self.batch_size.min(n - self.pos);
        self.y.clear();
        for (row, &i) in self.order[self.pos..self.pos + take].iter().enumerate() {
            self.x.row_mut(row).assign(&ds.images.row(i));
            self.y.push(ds.labels[i]);
        }
        let (epoch, index) = (self.epoch, self.index);
        self.pos += take;
        self.index += 1;
        let last_in_epoch = self.pos == n;
        if last_in_epoch {
            self.order.shuffle(&mut self.rng);
            self.pos = 0;
            self.index = 0;
            self.epoch += 1;
        }
        Batch { epoch, index, last_in_epoch, x: self.x.slice(ndarray::s![..take, ..]), y: &self.y }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toy(n: usize) -> Dataset {
        Dataset {
            images: Array2::from_shape_fn((n, 3), |(i, j)| (i * 3 + j) as f32),
            labels: (0..n).map(|i| (i % NUM_CLASSES) as u8).collect(),
        }
    }

    #[test]
    fn kind_parses_and_prints() {
        for k in DatasetKind::ALL {
            assert_eq!(k.to_string().parse::<DatasetKind>().unwrap(), k);
        }
        assert_eq!(DatasetKind::default(), DatasetKind::MnistSubset);
        let err = "cifar".parse::<DatasetKind>().unwrap_err().to_string();
        assert!(err.contains("cifar") && err.contains("fashion-mnist"), "{err}");
    }

    #[test]
    fn embedded_subset_loads() {
        let (train, test) = load(DatasetKind::MnistSubset, None).unwrap();
        assert_eq!((train.len(), train.features()), (10_000, PIXELS));
        assert_eq!((test.len(), test.features()), (2_000, PIXELS));
        assert!(train.images.iter().all(|&p| (0.0..=1.0).contains(&p)));
        // The first MNIST training labels are 5, 0, 4, 1, 9; the first test labels 7, 2, 1, 0, 4.
        assert_eq!(&train.labels[..5], &[5, 0, 4, 1, 9]);
        assert_eq!(&test.labels[..5], &[7, 2, 1, 0, 4]);
        for c in 0..NUM_CLASSES as u8 {
            assert!(train.labels.iter().filter(|&&l| l == c).count() > 800, "class {c} underrepresented");
        }
    }

    #[test]
    fn missing_dir_names_the_file_and_the_fix() {
        let dir = std::env::temp_dir().join("elasticps-train-no-such-dir");
        let err = load(DatasetKind::Mnist, Some(&dir)).unwrap_err().to_string();
        assert!(err.contains("MNIST not found at") && err.contains("train-images-idx3-ubyte(.gz)"), "{err}");
        assert!(err.contains("scripts/fetch-data") && err.contains("--data-dir"), "{err}");
    }

    #[test]
    fn loads_from_a_directory_with_mixed_gz_and_plain_files() {
        let dir = std::env::temp_dir().join(format!("elasticps-train-dir-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (i, (name, bytes)) in SUBSET.iter().enumerate() {
            if i % 2 == 0 {
                std::fs::write(dir.join(name), bytes).unwrap();
            } else {
                let plain = idx::gunzip_if_needed(bytes, name).unwrap();
                std::fs::write(dir.join(name.trim_end_matches(".gz")), &*plain).unwrap();
            }
        }
        let from_dir = load(DatasetKind::Mnist, Some(&dir)).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(from_dir, load(DatasetKind::MnistSubset, None).unwrap());
    }

    #[test]
    fn mismatched_counts_are_rejected() {
        let images = IdxImages { count: 2, rows: 1, cols: 1, pixels: vec![0, 255] };
        let err = Dataset::from_idx(images.clone(), vec![1], "toy").unwrap_err().to_string();
        assert!(err.contains("2 images but 1 labels"), "{err}");
        let err = Dataset::from_idx(images, vec![1, 10], "toy").unwrap_err().to_string();
        assert!(err.contains("label 10"), "{err}");
    }

    #[test]
    fn shards_partition_the_dataset() {
        let d = toy(10);
        let shards: Vec<Dataset> = (0..3).map(|r| d.shard(r, 3)).collect();
        assert_eq!(shards.iter().map(Dataset::len).collect::<Vec<_>>(), vec![4, 3, 3]);
        assert_eq!(shards[1].images.row(0), d.images.row(1));
        assert_eq!(shards[2].images.row(2), d.images.row(8));
        assert_eq!(d.shard(0, 1), d);
    }

    #[test]
    fn batcher_covers_each_epoch_once_and_is_seeded() {
        let d = toy(10);
        let mut b = Batcher::new(&d, 4, 7).unwrap();
        assert_eq!(b.batches_per_epoch(), 3);
        let mut firsts = Vec::new();
        for epoch in 0..3 {
            let mut seen = Vec::new();
            for index in 0..3 {
                let batch = b.next_batch();
                assert_eq!((batch.epoch, batch.index, batch.last_in_epoch), (epoch, index, index == 2));
                assert_eq!(batch.x.nrows(), if index == 2 { 2 } else { 4 });
                assert_eq!(batch.x.nrows(), batch.y.len());
                for (row, &y) in batch.x.outer_iter().zip(batch.y) {
                    let i = (row[0] / 3.0) as usize;
                    assert_eq!(usize::from(y), i % NUM_CLASSES);
                    seen.push(i);
                }
            }
            firsts.push(seen.clone());
            seen.sort_unstable();
            assert_eq!(seen, (0..10).collect::<Vec<_>>());
        }
        assert_ne!(firsts[0], firsts[1], "each epoch is reshuffled");
        let first = |seed| Batcher::new(d.clone(), 4, seed).unwrap().next_batch().x.to_owned();
        assert_eq!(first(7), first(7));
        assert_ne!(first(7), first(8));
    }

    #[test]
    fn batcher_rejects_empty_input() {
        assert!(Batcher::new(toy(0), 4, 0).is_err());
        assert!(Batcher::new(toy(3), 0, 0).is_err());
    }
}
