//! The crate's single error type.

use std::path::PathBuf;

/// Everything that can go wrong in `elasticps-train`. Each message says what failed and
/// how to fix it.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A dataset file is missing (neither the plain nor the `.gz` name exists).
    #[error("{dataset} not found at {}(.gz); {hint}", path.display())]
    NotFound {
        /// Human name of the dataset, e.g. `MNIST`.
        dataset: String,
        /// The path tried, without the `.gz` suffix.
        path: PathBuf,
        /// What to do about it.
        hint: String,
    },

    /// A file exists but could not be read.
    #[error("cannot read {}: {source}; check the file's permissions", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// An IDX file does not start with the expected magic number.
    #[error(
        "{file}: not an IDX {expected_kind} file (magic 0x{found:08x}, expected 0x{expected:08x}); \
         pass the right file, or delete it and run scripts/fetch-data again"
    )]
    BadMagic {
        /// The file (path or embedded name).
        file: String,
        /// `images` or `labels`.
        expected_kind: &'static str,
        /// The magic number found.
        found: u32,
        /// The magic number expected.
        expected: u32,
    },

    /// An IDX file is truncated, too long, or otherwise corrupt.
    #[error("{file}: {reason}; the file is truncated or corrupt: delete it and run scripts/fetch-data again")]
    CorruptIdx {
        /// The file (path or embedded name).
        file: String,
        /// What is wrong with it.
        reason: String,
    },

    /// Images and labels (or train and test sets) do not fit together.
    #[error("inconsistent {dataset} dataset: {reason}; make sure all four files come from the same dataset")]
    Inconsistent {
        /// Human name of the dataset.
        dataset: String,
        /// What does not match.
        reason: String,
    },

    /// An unknown `--dataset` value.
    #[error("unknown dataset {0:?}; expected one of: mnist-subset (default), mnist, fashion-mnist")]
    UnknownDataset(String),

    /// An unknown `--model` value (or synthetic profile name).
    #[error(
        "unknown model {0:?}; expected one of: mlp (default), synthetic:resnet56, synthetic:resnet50, \
         synthetic:vgg16, synthetic:bert-base"
    )]
    UnknownModel(String),

    /// An MLP description or a parameter set that does not fit the MLP.
    #[error("invalid MLP: {0}")]
    InvalidModel(String),

    /// A batcher that cannot produce batches (empty dataset, zero batch size, bad shard).
    #[error("invalid batching: {0}")]
    InvalidBatching(String),

    /// A bad `--worker-jitter` value.
    #[error("--worker-jitter {0}; expected P:MS (slow by MS milliseconds with probability P), e.g. 0.1:80")]
    InvalidJitter(String),

    /// A `--worker-delay` whose normal distribution cannot be drawn from.
    #[error("--worker-delay N({mean_ms} ms, {sd_ms} ms): {reason}; give a mean and a standard deviation >= 0")]
    InvalidDelay {
        /// The mean, ms.
        mean_ms: f64,
        /// The standard deviation, ms.
        sd_ms: f64,
        /// Why it cannot be drawn from.
        reason: String,
    },
}
