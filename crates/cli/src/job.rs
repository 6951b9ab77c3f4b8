//! The worker's training loop: the MLP on real data, or a synthetic profile with random
//! gradients and a fixed compute time, with optional straggler injection (`--worker-delay`,
//! `--worker-jitter`, drawn by [`elasticps_train::Delays`] as the sim draws them).
//!
//! Iteration t: compute the gradient on the parameters of clock t, (straggler delay),
//! then one overlapped round trip that pushes clock t and pulls clock t + 1 from each
//! server as soon as that server acknowledged the push.

use std::time::{Duration, Instant};

use anyhow::Context;
use elasticps_run::tally::Tally;
use elasticps_runtime::client::{Client, ClientOptions};
use elasticps_train::synthetic::{GradientSource, ModelKind};
use elasticps_train::{Batcher, Dataset, Mlp, as_slices, load};

use crate::events::{Emitter, Event};
use elasticps_launch::args::DataArgs;

/// What computes gradients.
// One value per worker process, built once and never moved on the hot path: its size is
// irrelevant.
#[allow(clippy::large_enum_variant)]
enum Workload {
    Mlp { mlp: Mlp, batches: Batcher, test: Dataset },
    Synthetic { grads: GradientSource },
}

impl Workload {
    /// The worker's workload and how many iterations it runs: the MLP on this rank's
    /// shard of `data` (every worker runs as many iterations as the smallest shard
    /// feeds), or the synthetic profile's gradients.
    fn new(
        d: &DataArgs,
        data: Option<(Dataset, Dataset)>,
        tensors: &[elasticps_core::model::TensorSpec],
        rank: u32,
        world: u32,
    ) -> anyhow::Result<(Self, u32)> {
        Ok(match data {
            Some((train, test)) => {
                let per_worker = train.len() / world as usize;
                anyhow::ensure!(per_worker > 0, "{} training examples cannot feed {world} workers", train.len());
                let full_batches = (per_worker / d.batch_size).max(1);
                let iterations = d.iterations.unwrap_or((d.epochs * full_batches) as u32);
                let batches = Batcher::new(
                    train.shard(rank as usize, world as usize),
                    d.batch_size,
                    d.data_seed + u64::from(rank),
                )?;
                (Workload::Mlp { mlp: Mlp::default(), batches, test }, iterations)
            }
            None => {
                let grads = GradientSource::new(tensors, d.data_seed + u64::from(rank));
                (Workload::Synthetic { grads }, d.iterations.unwrap_or(200))
            }
        })
    }

    /// Iteration `t`'s gradient on `params` into `grads`, its compute time and straggler
    /// delay spent; returns the samples it took and its loss. Rank 0 evaluates the MLP
    /// every `--eval-every` iterations first.
    // The sleeps are the workload's simulated compute time and straggler delay (the
    // training step, not a rule of any process), so clippy.toml's ban does not apply.
    #[allow(clippy::too_many_arguments, clippy::disallowed_methods)]
    async fn gradient(
        &mut self,
        d: &DataArgs,
        t: u32,
        rank: u32,
        params: &[Vec<f32>],
        grads: &mut [Vec<f32>],
        draw: elasticps_train::Draw,
        emitter: &Emitter,
    ) -> (u64, f32) {
        match self {
            Workload::Mlp { mlp, batches, test } => {
                if rank == 0 && d.eval_every > 0 && t.is_multiple_of(d.eval_every) {
                    let e = mlp.evaluate(&as_slices(params), test);
                    tracing::info!(rank, iteration = t, accuracy = e.accuracy, loss = e.loss, "test evaluation");
                    emitter.emit(&Event::Eval { rank, iteration: t, accuracy: e.accuracy, loss: e.loss });
                }
                let batch = next_full_batch(batches);
                let samples = batch.y.len() as u64;
                let loss = mlp.loss_and_grad_into(&as_slices(params), batch.x, batch.y, grads);
                if draw.delay_ms > 0.0 {
                    tokio::time::sleep(Duration::from_secs_f64(draw.delay_ms / 1e3)).await;
                }
                (samples, loss)
            }
            Workload::Synthetic { grads: source } => {
                source.next(grads);
                // Compute time as a sleep (like a GPU step: it does not load the CPU),
                // with +-10% seeded jitter, and the straggler delays in the same sleep.
                tokio::time::sleep(Duration::from_secs_f64((draw.compute_ms + draw.delay_ms) / 1e3)).await;
                (d.batch_size as u64, 0.0)
            }
        }
    }
}

/// Runs one worker's whole job against the scheduler at `scheduler`.
pub async fn run(scheduler: &str, d: &DataArgs, opts: ClientOptions, emitter: Emitter) -> anyhow::Result<()> {
    anyhow::ensure!(d.batch_size > 0, "--batch-size must be at least 1");
    // Load the data before joining, so a missing file fails fast with its own message.
    let data = match d.model {
        ModelKind::Mlp => Some(load(d.dataset, d.data_dir.as_deref())?),
        ModelKind::Synthetic(_) => None,
    };
    let mut client = Client::connect(opts).await.with_context(|| format!("joining the job at {scheduler}"))?;
    let (rank, world) = (client.rank(), client.num_workers());
    emitter.emit(&Event::Joined { rank });
    let tensors = match d.model {
        ModelKind::Mlp => Mlp::default().tensor_specs(),
        ModelKind::Synthetic(p) => p.tensors(),
    };
    client.register_model(tensors.clone()).await.context("registering the model")?;
    // 0, or the clock of the checkpoint the job resumed from.
    let start = client.start_clock().await.context("asking the scheduler for the first clock")?;

    let (mut work, iterations) = Workload::new(d, data, &tensors, rank, world)?;
    // The compute time and the straggler delays of every iteration, as the sim draws them.
    let mut delays = d.delays(rank)?;

    let mut params = client.zeros();
    let mut grads = client.zeros();
    let mut stats = Tally::default();
    let (mut samples, mut loss) = (0u64, f32::NAN);
    let mut last_progress = Instant::now();
    if let Workload::Mlp { batches, .. } = &mut work {
        // The batches of the iterations before the checkpoint were used: a resumed job
        // goes on with the very batches the uninterrupted one would have.
        for _ in 0..start {
            next_full_batch(batches);
        }
    }
    tracing::info!(rank, iterations, start, model = %d.model, "training starts");
    let training = Instant::now();
    let started = Instant::now();
    client.pull(start, &mut params).await.with_context(|| format!("worker {rank} pulling clock {start}"))?;
    stats.communicated(started.elapsed(), &[]);
    stats.start();
    for t in start..iterations {
        let draw = delays.next(t);
        let (n, l) = work.gradient(d, t, rank, &params, &mut grads, draw, &emitter).await;
        samples += n;
        loss = l;
        let comm = Instant::now();
        // The last iteration of worker 0 also pulls the final model (clock `iterations`).
        if t + 1 < iterations || rank == 0 {
            client.push_pull(t, &grads, &mut params).await.with_context(|| format!("worker {rank} at clock {t}"))?;
        } else {
            client.push(t, &grads).await.with_context(|| format!("worker {rank} pushing clock {t}"))?;
        }
        stats.communicated(comm.elapsed(), &client.last_waits().per_server);
        stats.iteration_ends();
        if last_progress.elapsed() >= Duration::from_millis(100) || t + 1 == iterations {
            last_progress = Instant::now();
            emitter.emit(&Event::Progress { rank, iteration: t + 1, total: iterations, loss });
        }
    }
    let train_s = training.elapsed().as_secs_f64();
    if let (0, Workload::Mlp { mlp, test, .. }) = (rank, &work) {
        // The final model: every worker's last push is in (under bsp and ssp alike).
        let e = mlp.evaluate(&as_slices(&params), test);
        tracing::info!(rank, accuracy = e.accuracy, loss = e.loss, "final test evaluation");
        emitter.emit(&Event::Eval { rank, iteration: iterations, accuracy: e.accuracy, loss: e.loss });
    }
    emitter.emit(&Event::WorkerDone(stats.report(rank, samples, loss.into(), train_s)));
    client.finish().await.context("telling the scheduler this worker is done")?;
    Ok(())
}

/// The next batch, full ones only (the last partial batch of an epoch is dropped, like
/// PyTorch's `drop_last`): a 2-image batch would take a full, noisy step.
fn next_full_batch(batches: &mut Batcher) -> elasticps_train::Batch<'_> {
    if batches.next_is_short() && batches.batches_per_epoch() > 1 {
        batches.next_batch();
    }
    batches.next_batch()
}
