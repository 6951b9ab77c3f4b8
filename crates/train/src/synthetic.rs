//! Synthetic models with the tensor sizes of real networks, for throughput experiments.
//!
//! The parameter server's cost depends on how many tensors a model has, how large they
//! are and in which order they come, not on what the values mean. A [`Profile`] gives
//! the exact parameter tensors (names and shapes, layer by layer, in the network's
//! natural order, which is the order `named_parameters()` yields them in PyTorch) of a
//! well-known network; a worker pushes random gradients from a [`GradientSource`] and
//! waits a configurable compute time per iteration instead of computing anything.
//! Accuracy is not the point.
//!
//! Where the shapes come from:
//!
//! - [`Profile::ResNet56`]: ResNet-56 for CIFAR-10, He et al., *Deep Residual Learning
//!   for Image Recognition* (CVPR 2016), §4.2: a 3x3 stem conv with 16 filters, then 3
//!   stages of 9 basic blocks (two 3x3 convs each) with 16, 32 and 64 channels, convs
//!   without bias, batch norm (gamma and beta) after each conv, option A shortcuts
//!   (identity with zero padding, no parameters), global average pooling and a 64 -> 10
//!   fully connected layer with bias. Names follow the usual PyTorch port
//!   (`conv1`, `bn1`, `layer1.0.conv1`, ..., `fc`). 853,018 parameters (0.85M, as in the
//!   paper's Table 6; the 855,770 sometimes quoted counts option B projection shortcuts).
//! - [`Profile::ResNet50`]: `torchvision.models.resnet50` (ImageNet, 1000 classes):
//!   bottleneck blocks `[3, 4, 6, 3]`, a `downsample` 1x1 conv + batch norm in the first
//!   block of each stage. Names and shapes are those of its `state_dict()` without the
//!   batch-norm buffers (running statistics are not parameters). 25,557,032 parameters.
//! - [`Profile::Vgg16`]: `torchvision.models.vgg16` (configuration D of Simonyan and
//!   Zisserman 2015, without batch norm): 13 3x3 convs with bias (`features.N`, numbered
//!   as in the `nn.Sequential`, counting ReLUs and max-pools), then the classifier
//!   25088 -> 4096 -> 4096 -> 1000 with biases (`classifier.0`, `.3`, `.6`).
//!   138,357,544 parameters.
//! - [`Profile::BertBase`]: Hugging Face `transformers.BertModel` with the
//!   `bert-base-uncased` configuration (vocabulary 30522, hidden size 768, 12 layers,
//!   intermediate size 3072, 512 positions, 2 token types): embeddings and their
//!   LayerNorm, 12 encoder layers (query, key, value, attention output, attention
//!   LayerNorm, intermediate, output, output LayerNorm) and the pooler. Linear weights
//!   are `[out, in]` as in PyTorch. 109,482,240 parameters.
//!
//! Initial values: [`Init::Uniform`] in `[-0.05, 0.05)` for weights and embeddings,
//! [`Init::Zeros`] for biases and batch-norm beta / LayerNorm bias, and
//! [`Init::Constant`]`(1.0)` for batch-norm gamma / LayerNorm weight.
//!
//! ```
//! use elasticps_train::synthetic::{GradientSource, ModelKind, Profile};
//!
//! let kind: ModelKind = "synthetic:resnet56".parse()?;
//! assert_eq!(kind, ModelKind::Synthetic(Profile::ResNet56));
//! let tensors = Profile::ResNet56.tensors();
//! assert_eq!(Profile::ResNet56.num_params(), 853_018);
//! let mut grads = vec![Vec::new(); tensors.len()];
//! let mut source = GradientSource::new(&tensors, 7);
//! source.next(&mut grads); // one iteration's gradients, every tensor filled
//! assert!(grads.iter().zip(&tensors).all(|(g, t)| g.len() == t.len()));
//! # Ok::<(), elasticps_train::TrainError>(())
//! ```

use std::fmt;
use std::str::FromStr;

use elasticps_core::model::{Init, TensorSpec};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::TrainError;

/// Initial range of weights and embeddings: uniform in `[-WEIGHT_INIT, WEIGHT_INIT)`.
pub const WEIGHT_INIT: f32 = 0.05;

/// Range of synthetic gradients: uniform in `[-GRADIENT_SCALE, GRADIENT_SCALE)`.
pub const GRADIENT_SCALE: f32 = 1e-3;

/// Number of random values a [`GradientSource`] draws once and rotates into every tensor
/// (a power of two).
pub const GRADIENT_BUFFER_LEN: usize = 1 << 16;

/// A real network whose parameter tensors a synthetic model reproduces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Profile {
    /// ResNet-56 for CIFAR-10 (He et al. 2016, §4.2), 853,018 parameters.
    ResNet56,
    /// torchvision ResNet-50 for ImageNet, 25,557,032 parameters.
    ResNet50,
    /// torchvision VGG-16 (no batch norm) for ImageNet, 138,357,544 parameters.
    Vgg16,
    /// Hugging Face BERT-base uncased (`BertModel`), 109,482,240 parameters.
    BertBase,
}

impl Profile {
    /// Every profile, in CLI order.
    pub const ALL: [Profile; 4] = [Profile::ResNet56, Profile::ResNet50, Profile::Vgg16, Profile::BertBase];

    /// The name used after `synthetic:` on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Profile::ResNet56 => "resnet56",
            Profile::ResNet50 => "resnet50",
            Profile::Vgg16 => "vgg16",
            Profile::BertBase => "bert-base",
        }
    }

    /// Human name used in reports.
    pub fn title(self) -> &'static str {
        match self {
            Profile::ResNet56 => "ResNet-56 (CIFAR-10)",
            Profile::ResNet50 => "ResNet-50 (ImageNet)",
            Profile::Vgg16 => "VGG-16 (ImageNet)",
            Profile::BertBase => "BERT-base uncased",
        }
    }

    /// Every parameter tensor of the network, in its natural (PyTorch registration)
    /// order, with unique names.
    pub fn tensors(self) -> Vec<TensorSpec> {
        let mut b = Builder::default();
        match self {
            Profile::ResNet56 => resnet56(&mut b),
            Profile::ResNet50 => resnet50(&mut b),
            Profile::Vgg16 => vgg16(&mut b),
            Profile::BertBase => bert_base(&mut b),
        }
        b.tensors
    }

    /// Total number of parameters (f32 values) of the network.
    pub fn num_params(self) -> usize {
        self.tensors().iter().map(TensorSpec::len).sum()
    }
}

impl fmt::Display for Profile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Profile {
    type Err = TrainError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL.into_iter().find(|p| p.as_str() == s).ok_or_else(|| TrainError::UnknownModel(s.to_owned()))
    }
}

/// The model a worker trains, as given by `--model`: `mlp` (the default, a real MLP on
/// MNIST-like data) or `synthetic:NAME` with NAME one of the [`Profile`]s.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ModelKind {
    /// The ndarray [`Mlp`](crate::Mlp) on a real dataset.
    #[default]
    Mlp,
    /// A synthetic model with a real network's tensors and random gradients.
    Synthetic(Profile),
}

impl ModelKind {
    /// Prefix of the synthetic models' CLI values.
    pub const SYNTHETIC_PREFIX: &'static str = "synthetic:";

    /// Every accepted value, `mlp` first.
    pub fn all() -> impl Iterator<Item = ModelKind> {
        std::iter::once(ModelKind::Mlp).chain(Profile::ALL.into_iter().map(ModelKind::Synthetic))
    }
}

impl fmt::Display for ModelKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ModelKind::Mlp => f.write_str("mlp"),
            ModelKind::Synthetic(p) => write!(f, "{}{p}", Self::SYNTHETIC_PREFIX),
        }
    }
}

impl FromStr for ModelKind {
    type Err = TrainError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "mlp" {
            return Ok(ModelKind::Mlp);
        }
        s.strip_prefix(Self::SYNTHETIC_PREFIX)
            .and_then(|name| name.parse::<Profile>().ok())
            .map(ModelKind::Synthetic)
            .ok_or_else(|| TrainError::UnknownModel(s.to_owned()))
    }
}

/// Random gradients for a synthetic model, deterministic for a given seed.
///
/// Generating fresh random numbers for 100M parameters every iteration would make the
/// worker, not the parameter server, the bottleneck. Instead, the source draws
/// [`GRADIENT_BUFFER_LEN`] values uniform in `[-GRADIENT_SCALE, GRADIENT_SCALE)` once,
/// and each iteration copies that buffer, rotated, into every tensor: tensor `t` starts
/// at offset `(start_t + k * step_t) mod GRADIENT_BUFFER_LEN` at iteration `k`, where
/// `start_t` and the odd `step_t` are drawn from the seed. Filling is a sequence of
/// `memcpy`s, and two consecutive iterations never use the same offset for a tensor.
#[derive(Clone, Debug)]
pub struct GradientSource {
    lens: Vec<usize>,
    starts: Vec<u64>,
    steps: Vec<u64>,
    buffer: Vec<f32>,
    iteration: u64,
}

impl GradientSource {
    /// A source for `tensors`, seeded by `seed`.
    pub fn new(tensors: &[TensorSpec], seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let buffer = (0..GRADIENT_BUFFER_LEN).map(|_| rng.random_range(-GRADIENT_SCALE..GRADIENT_SCALE)).collect();
        let starts = tensors.iter().map(|_| rng.random::<u64>()).collect();
        let steps = tensors.iter().map(|_| rng.random::<u64>() | 1).collect();
        Self { lens: tensors.iter().map(TensorSpec::len).collect(), starts, steps, buffer, iteration: 0 }
    }

    /// Number of times [`next`](Self::next) has been called.
    pub fn iteration(&self) -> u64 {
        self.iteration
    }

    /// Overwrites `grads` with the next iteration's gradients: `grads[t]` is resized to
    /// the length of tensor `t` (no allocation after the first call if the vectors are
    /// reused) and every element is written.
    ///
    /// # Panics
    ///
    /// If `grads` does not hold one vector per tensor.
    pub fn next(&mut self, grads: &mut [Vec<f32>]) {
        assert_eq!(
            grads.len(),
            self.lens.len(),
            "GradientSource::next: {} gradient vectors for a model of {} tensors",
            grads.len(),
            self.lens.len()
        );
        let mask = GRADIENT_BUFFER_LEN as u64 - 1;
        for (t, grad) in grads.iter_mut().enumerate() {
            grad.resize(self.lens[t], 0.0);
            let mut pos = (self.starts[t].wrapping_add(self.iteration.wrapping_mul(self.steps[t])) & mask) as usize;
            let mut rest = grad.as_mut_slice();
            while !rest.is_empty() {
                let n = rest.len().min(GRADIENT_BUFFER_LEN - pos);
                let (head, tail) = rest.split_at_mut(n);
                head.copy_from_slice(&self.buffer[pos..pos + n]);
                rest = tail;
                pos = 0;
            }
        }
        self.iteration += 1;
    }
}

/// Accumulates tensor specs with consistent names and initialisations.
#[derive(Default)]
struct Builder {
    tensors: Vec<TensorSpec>,
}

impl Builder {
    fn push(&mut self, name: String, shape: Vec<usize>, init: Init) {
        self.tensors.push(TensorSpec { name, shape, init });
    }

    /// A weight (or embedding) tensor, uniform in `[-WEIGHT_INIT, WEIGHT_INIT)`.
    fn weight(&mut self, name: String, shape: Vec<usize>) {
        self.push(name, shape, Init::Uniform { low: -WEIGHT_INIT, high: WEIGHT_INIT });
    }

    /// A bias, zeros.
    fn bias(&mut self, name: String, len: usize) {
        self.push(name, vec![len], Init::Zeros);
    }

    /// A 2-D convolution `prefix.weight` `[out, in, k, k]`, and `prefix.bias` if `bias`.
    fn conv(&mut self, prefix: &str, out: usize, inp: usize, k: usize, bias: bool) {
        self.weight(format!("{prefix}.weight"), vec![out, inp, k, k]);
        if bias {
            self.bias(format!("{prefix}.bias"), out);
        }
    }

    /// A batch norm or LayerNorm: `prefix.weight` (gamma, ones) and `prefix.bias` (beta, zeros).
    fn norm(&mut self, prefix: &str, channels: usize) {
        self.push(format!("{prefix}.weight"), vec![channels], Init::Constant(1.0));
        self.bias(format!("{prefix}.bias"), channels);
    }

    /// A linear layer: `prefix.weight` `[out, in]` and `prefix.bias` `[out]`.
    fn linear(&mut self, prefix: &str, out: usize, inp: usize) {
        self.weight(format!("{prefix}.weight"), vec![out, inp]);
        self.bias(format!("{prefix}.bias"), out);
    }
}

/// ResNet-56 for CIFAR-10: 3 stages of 9 basic blocks, option A shortcuts.
fn resnet56(b: &mut Builder) {
    const BLOCKS: usize = 9;
    b.conv("conv1", 16, 3, 3, false);
    b.norm("bn1", 16);
    let mut inp = 16;
    for (stage, width) in [16, 32, 64].into_iter().enumerate() {
        for block in 0..BLOCKS {
            let p = format!("layer{}.{block}", stage + 1);
            b.conv(&format!("{p}.conv1"), width, inp, 3, false);
            b.norm(&format!("{p}.bn1"), width);
            b.conv(&format!("{p}.conv2"), width, width, 3, false);
            b.norm(&format!("{p}.bn2"), width);
            inp = width;
        }
    }
    b.linear("fc", 10, 64);
}

/// torchvision ResNet-50: bottleneck blocks [3, 4, 6, 3], expansion 4.
fn resnet50(b: &mut Builder) {
    const EXPANSION: usize = 4;
    b.conv("conv1", 64, 3, 7, false);
    b.norm("bn1", 64);
    let mut inp = 64;
    for (stage, (blocks, width)) in [(3, 64), (4, 128), (6, 256), (3, 512)].into_iter().enumerate() {
        let out = width * EXPANSION;
        for block in 0..blocks {
            let p = format!("layer{}.{block}", stage + 1);
            b.conv(&format!("{p}.conv1"), width, inp, 1, false);
            b.norm(&format!("{p}.bn1"), width);
            b.conv(&format!("{p}.conv2"), width, width, 3, false);
            b.norm(&format!("{p}.bn2"), width);
            b.conv(&format!("{p}.conv3"), out, width, 1, false);
            b.norm(&format!("{p}.bn3"), out);
            if block == 0 {
                b.conv(&format!("{p}.downsample.0"), out, inp, 1, false);
                b.norm(&format!("{p}.downsample.1"), out);
            }
            inp = out;
        }
    }
    b.linear("fc", 1000, 512 * EXPANSION);
}

/// torchvision VGG-16 (configuration D, no batch norm).
fn vgg16(b: &mut Builder) {
    // `None` is a max-pool; each conv is followed by a ReLU, so it takes two indices
    // of the `features` Sequential.
    const CFG: [Option<usize>; 18] = [
        Some(64),
        Some(64),
        None,
        Some(128),
        Some(128),
        None,
        Some(256),
        Some(256),
        Some(256),
        None,
        Some(512),
        Some(512),
        Some(512),
        None,
        Some(512),
        Some(512),
        Some(512),
        None,
    ];
    let mut index = 0;
    let mut inp = 3;
    for layer in CFG {
        match layer {
            Some(out) => {
                b.conv(&format!("features.{index}"), out, inp, 3, true);
                inp = out;
                index += 2;
            }
            None => index += 1,
        }
    }
    // Adaptive average pooling to 7x7, then Linear, ReLU, Dropout (x2), Linear.
    b.linear("classifier.0", 4096, 512 * 7 * 7);
    b.linear("classifier.3", 4096, 4096);
    b.linear("classifier.6", 1000, 4096);
}

/// Hugging Face `BertModel`, bert-base-uncased configuration.
fn bert_base(b: &mut Builder) {
    const VOCAB: usize = 30522;
    const HIDDEN: usize = 768;
    const LAYERS: usize = 12;
    const INTERMEDIATE: usize = 3072;
    const POSITIONS: usize = 512;
    const TOKEN_TYPES: usize = 2;
    b.weight("embeddings.word_embeddings.weight".into(), vec![VOCAB, HIDDEN]);
    b.weight("embeddings.position_embeddings.weight".into(), vec![POSITIONS, HIDDEN]);
    b.weight("embeddings.token_type_embeddings.weight".into(), vec![TOKEN_TYPES, HIDDEN]);
    b.norm("embeddings.LayerNorm", HIDDEN);
    for layer in 0..LAYERS {
        let p = format!("encoder.layer.{layer}");
        for proj in ["query", "key", "value"] {
            b.linear(&format!("{p}.attention.self.{proj}"), HIDDEN, HIDDEN);
        }
        b.linear(&format!("{p}.attention.output.dense"), HIDDEN, HIDDEN);
        b.norm(&format!("{p}.attention.output.LayerNorm"), HIDDEN);
        b.linear(&format!("{p}.intermediate.dense"), INTERMEDIATE, HIDDEN);
        b.linear(&format!("{p}.output.dense"), HIDDEN, INTERMEDIATE);
        b.norm(&format!("{p}.output.LayerNorm"), HIDDEN);
    }
    b.linear("pooler.dense", HIDDEN, HIDDEN);
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use elasticps_core::model::Partition;

    use super::*;

    #[test]
    fn parameter_counts_match_the_reference_implementations() {
        assert_eq!(Profile::ResNet56.num_params(), 853_018);
        assert_eq!(Profile::ResNet50.num_params(), 25_557_032);
        assert_eq!(Profile::Vgg16.num_params(), 138_357_544);
        assert_eq!(Profile::BertBase.num_params(), 109_482_240);
    }

    #[test]
    fn tensor_counts_and_landmarks() {
        // ResNet-56: stem conv + bn (3), 27 blocks x (2 convs + 2 bns = 6), fc (2).
        let r56 = Profile::ResNet56.tensors();
        assert_eq!(r56.len(), 3 + 27 * 6 + 2);
        assert_eq!(r56[0].name, "conv1.weight");
        assert_eq!(r56[0].shape, vec![16, 3, 3, 3]);
        let find = |ts: &[TensorSpec], name: &str| ts.iter().find(|t| t.name == name).unwrap().clone();
        assert_eq!(find(&r56, "layer2.0.conv1.weight").shape, vec![32, 16, 3, 3]);
        assert_eq!(find(&r56, "layer3.8.bn2.weight").init, Init::Constant(1.0));
        assert_eq!(r56.last().unwrap().name, "fc.bias");

        // torchvision resnet50 has 161 parameter tensors.
        let r50 = Profile::ResNet50.tensors();
        assert_eq!(r50.len(), 161);
        assert_eq!(find(&r50, "layer1.0.conv1.weight").shape, vec![64, 64, 1, 1]);
        assert_eq!(find(&r50, "layer4.0.downsample.0.weight").shape, vec![2048, 1024, 1, 1]);
        assert_eq!(find(&r50, "fc.weight").shape, vec![1000, 2048]);

        // torchvision vgg16: 16 layers with weight and bias.
        let vgg = Profile::Vgg16.tensors();
        assert_eq!(vgg.len(), 32);
        assert_eq!(find(&vgg, "features.28.weight").shape, vec![512, 512, 3, 3]);
        assert_eq!(find(&vgg, "classifier.0.weight").shape, vec![4096, 25088]);
        assert_eq!(find(&vgg, "classifier.6.bias").init, Init::Zeros);

        // HF BertModel: 5 embedding tensors, 16 per layer, 2 pooler tensors.
        let bert = Profile::BertBase.tensors();
        assert_eq!(bert.len(), 5 + 12 * 16 + 2);
        assert_eq!(bert[0].shape, vec![30522, 768]);
        assert_eq!(find(&bert, "encoder.layer.11.intermediate.dense.weight").shape, vec![3072, 768]);
        assert_eq!(find(&bert, "encoder.layer.0.output.LayerNorm.weight").init, Init::Constant(1.0));
        assert_eq!(bert.last().unwrap().name, "pooler.dense.bias");
    }

    #[test]
    fn tensors_are_unique_non_empty_and_partitionable() {
        for p in Profile::ALL {
            let tensors = p.tensors();
            let names: HashSet<_> = tensors.iter().map(|t| t.name.as_str()).collect();
            assert_eq!(names.len(), tensors.len(), "{p}: duplicate tensor names");
            assert!(tensors.iter().all(|t| !t.is_empty()), "{p}: empty tensor");
            for t in &tensors {
                let expected = if t.name.ends_with(".bias") {
                    Init::Zeros
                } else if t.shape.len() == 1 {
                    Init::Constant(1.0)
                } else {
                    Init::Uniform { low: -WEIGHT_INIT, high: WEIGHT_INIT }
                };
                assert_eq!(t.init, expected, "{p}: {}", t.name);
            }
            let partition = Partition::new(tensors, 4 << 20).unwrap();
            assert_eq!(partition.total_len(), p.num_params());
        }
    }

    #[test]
    fn profile_and_model_kind_parse_and_print() {
        for p in Profile::ALL {
            assert_eq!(p.to_string().parse::<Profile>().unwrap(), p);
        }
        let kinds: Vec<_> = ModelKind::all().collect();
        assert_eq!(kinds.len(), 1 + Profile::ALL.len());
        for k in kinds {
            assert_eq!(k.to_string().parse::<ModelKind>().unwrap(), k);
        }
        assert_eq!(ModelKind::default(), ModelKind::Mlp);
        assert_eq!("mlp".parse::<ModelKind>().unwrap(), ModelKind::Mlp);
        assert_eq!("synthetic:bert-base".parse::<ModelKind>().unwrap(), ModelKind::Synthetic(Profile::BertBase));
        assert_eq!(ModelKind::Synthetic(Profile::Vgg16).to_string(), "synthetic:vgg16");
    }

    #[test]
    fn unknown_models_are_rejected_with_the_accepted_values() {
        for bad in ["synthetic:resnet9", "resnet56", "synthetic:", "MLP", ""] {
            let err = bad.parse::<ModelKind>().unwrap_err();
            assert!(matches!(&err, TrainError::UnknownModel(s) if s == bad), "{bad}: {err:?}");
            let msg = err.to_string();
            for k in ModelKind::all() {
                assert!(msg.contains(&k.to_string()), "{msg:?} does not list {k}");
            }
        }
        let msg = "synthetic:resnet9".parse::<ModelKind>().unwrap_err().to_string();
        assert!(msg.contains("\"synthetic:resnet9\""), "{msg}");
        assert!("resnet9".parse::<Profile>().is_err());
    }

    fn small_model() -> Vec<TensorSpec> {
        let t = |name: &str, shape: Vec<usize>| TensorSpec { name: name.into(), shape, init: Init::Zeros };
        vec![
            t("one", vec![1]),
            t("small", vec![10]),
            t("exact", vec![GRADIENT_BUFFER_LEN]),
            t("big", vec![3, GRADIENT_BUFFER_LEN + 17]),
        ]
    }

    #[test]
    fn gradients_fill_every_element_and_are_deterministic() {
        for tensors in [small_model(), Profile::ResNet56.tensors()] {
            let mut a = vec![Vec::new(); tensors.len()];
            // Pre-filled with NaN at the right length: every element must be overwritten.
            let mut b: Vec<Vec<f32>> = tensors.iter().map(|t| vec![f32::NAN; t.len()]).collect();
            let mut sa = GradientSource::new(&tensors, 42);
            let mut sb = GradientSource::new(&tensors, 42);
            for _ in 0..3 {
                sa.next(&mut a);
                sb.next(&mut b);
                assert_eq!(a, b);
                for (g, t) in a.iter().zip(&tensors) {
                    assert_eq!(g.len(), t.len(), "{}", t.name);
                    assert!(g.iter().all(|v| (-GRADIENT_SCALE..GRADIENT_SCALE).contains(v)), "{}", t.name);
                }
            }
            assert_eq!(sa.iteration(), 3);

            let mut c = vec![Vec::new(); tensors.len()];
            GradientSource::new(&tensors, 43).next(&mut c);
            let mut first = vec![Vec::new(); tensors.len()];
            GradientSource::new(&tensors, 42).next(&mut first);
            assert_ne!(c, first, "different seeds give different gradients");
        }
    }

    #[test]
    fn gradients_differ_between_iterations() {
        for tensors in [small_model(), Profile::ResNet56.tensors()] {
            let mut source = GradientSource::new(&tensors, 5);
            let mut prev = vec![Vec::new(); tensors.len()];
            source.next(&mut prev);
            for _ in 0..4 {
                let mut cur = prev.clone();
                source.next(&mut cur);
                for ((p, c), t) in prev.iter().zip(&cur).zip(&tensors) {
                    assert_ne!(p, c, "{} did not change between iterations", t.name);
                }
                prev = cur;
            }
        }
    }

    #[test]
    #[should_panic(expected = "gradient vectors for a model of")]
    fn gradients_need_one_vector_per_tensor() {
        GradientSource::new(&small_model(), 1).next(&mut [Vec::new()]);
    }
}
