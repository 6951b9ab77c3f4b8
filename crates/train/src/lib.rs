//! elasticps-train: the workloads that drive the parameter server.
//!
//! This crate knows nothing about servers, sockets or synchronization. It gives a worker
//! what it needs to compute gradients, and the experiments what they need to score a
//! model:
//!
//! - [`idx`]: a strict parser for the IDX files of MNIST and Fashion-MNIST, plain or gzip.
//! - [`dataset`]: [`Dataset`] (images as an `n x 784` matrix in `[0, 1]`, labels),
//!   [`load`] for the three [`DatasetKind`]s (`mnist-subset`, embedded in the binary;
//!   `mnist`, installed by `scripts/fetch-data`; `fashion-mnist`, from the Debian package),
//!   [`Dataset::shard`] to split the train set among workers, and [`Batcher`] for seeded,
//!   shuffled mini-batches, epoch after epoch.
//! - [`mlp`]: [`Mlp`], a ReLU multi-layer perceptron with a softmax cross-entropy head and
//!   a hand-written backward pass on ndarray. Its parameters are the flat tensors of
//!   [`Mlp::tensor_specs`], the same [`TensorSpec`](elasticps_core::model::TensorSpec)s the
//!   parameter server partitions into blocks, so a worker pulls the tensors, calls
//!   [`Mlp::loss_and_grad`] on its batch, and pushes the gradients back unchanged.
//! - [`synthetic`]: [`Profile`]s with the exact parameter tensors of ResNet-56, ResNet-50,
//!   VGG-16 and BERT-base, [`ModelKind`] (the `--model` value: `mlp` or `synthetic:NAME`),
//!   and [`GradientSource`], cheap seeded random gradients for throughput experiments.
//! - [`delays`]: [`Delays`], what an iteration costs besides its gradient (the synthetic
//!   compute time, `--worker-delay`, `--worker-jitter`'s [`Jitter`]), drawn the same way by
//!   the real worker and by the simulator.
//!
//! A worker's loop, without the parameter server (the runtime replaces `sgd_step` by a
//! push and a pull):
//!
//! ```
//! use elasticps_train::{Batcher, DatasetKind, Mlp, as_slices, load, sgd_step};
//!
//! let (train, test) = load(DatasetKind::MnistSubset, None)?;
//! let mlp = Mlp::default();
//! let mut params = mlp.init_params(42);
//! let mut batches = Batcher::new(train.shard(0, 4), 32, 7)?;
//! for _ in 0..10 {
//!     let batch = batches.next_batch();
//!     let (_loss, grads) = mlp.loss_and_grad(&as_slices(&params), batch.x, batch.y);
//!     sgd_step(&mut params, &grads, 0.1);
//! }
//! let eval = mlp.evaluate(&as_slices(&params), &test);
//! assert!(eval.accuracy > 0.2);
//! # Ok::<(), elasticps_train::TrainError>(())
//! ```
//!
//! Errors are one enum, [`TrainError`], whose messages say how to fix the problem.
//! Programming errors (a gradient for parameters of the wrong shape) panic with a message
//! naming the tensor instead.

#![warn(missing_docs)]

pub mod dataset;
pub mod delays;
pub mod error;
pub mod idx;
pub mod mlp;
pub mod synthetic;

pub use dataset::{Batch, Batcher, Dataset, DatasetKind, NUM_CLASSES, load};
pub use delays::{Delays, Draw, Jitter};
pub use error::TrainError;
pub use mlp::{Evaluation, Mlp, as_slices, sgd_step};
pub use synthetic::{GradientSource, ModelKind, Profile};
