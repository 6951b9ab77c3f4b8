//! The worker's training loop: the MLP on real data, or a synthetic profile with random
//! gradients and a fixed compute time, with optional straggler injection.
//!
//! Iteration t: compute the gradient on the parameters of clock t, (straggler delay),
//! then one overlapped round trip that pushes clock t and pulls clock t + 1 from each
//! server as soon as that server acknowledged the push.

use std::time::{Duration, Instant};

use anyhow::Context;
use elasticps_core::stats::Histogram;
use elasticps_runtime::client::{Client, ClientOptions};
use elasticps_train::synthetic::{GradientSource, ModelKind};
use elasticps_train::{Batcher, Dataset, Mlp, as_slices, load};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, Normal};

use crate::events::{Emitter, Event};
use elasticps_launch::args::{DataArgs, StragglerSpec};
use elasticps_report::WorkerReport;

/// What computes gradients.
// One value per worker process, built once and never moved on the hot path: its size is
// irrelevant.
#[allow(clippy::large_enum_variant)]
enum Workload {
    Mlp { mlp: Mlp, batches: Batcher, test: Dataset },
    Synthetic { grads: GradientSource, compute: Duration, jitter: StdRng },
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
    let tensors = match d.model {
        ModelKind::Mlp => Mlp::default().tensor_specs(),
        ModelKind::Synthetic(p) => p.tensors(),
    };
    client.register_model(tensors.clone()).await.context("registering the model")?;

    let (mut work, iterations) = match data {
        Some((train, test)) => {
            // Every worker runs the same number of iterations, from the smallest shard.
            let per_worker = train.len() / world as usize;
            anyhow::ensure!(per_worker > 0, "{} training examples cannot feed {world} workers", train.len());
            let full_batches = (per_worker / d.batch_size).max(1);
            let iterations = d.iterations.unwrap_or((d.epochs * full_batches) as u32);
            let batches =
                Batcher::new(train.shard(rank as usize, world as usize), d.batch_size, d.data_seed + u64::from(rank))?;
            (Workload::Mlp { mlp: Mlp::default(), batches, test }, iterations)
        }
        None => {
            let seed = d.data_seed + u64::from(rank);
            let grads = GradientSource::new(&tensors, seed);
            let compute = Duration::from_secs_f64(d.compute_ms.max(0.0) / 1e3);
            (Workload::Synthetic { grads, compute, jitter: StdRng::seed_from_u64(seed) }, d.iterations.unwrap_or(200))
        }
    };
    let mut straggle = straggler(d.worker_delay.as_ref(), rank, d.data_seed)?;

    let mut params = client.zeros();
    let mut grads = client.zeros();
    let mut stats = Tally::new(client.layout().map_or(0, |l| l.servers.len()));
    let (mut samples, mut loss) = (0u64, f32::NAN);
    let mut last_progress = Instant::now();
    tracing::info!(rank, iterations, model = %d.model, "training starts");
    let training = Instant::now();
    let started = Instant::now();
    client.pull(0, &mut params).await.with_context(|| format!("worker {rank} pulling clock 0"))?;
    stats.comm += started.elapsed();
    stats.start();
    for t in 0..iterations {
        match &mut work {
            Workload::Mlp { mlp, batches, test } => {
                let batches_per_epoch = batches.batches_per_epoch();
                if rank == 0 && d.eval_every > 0 && t % d.eval_every == 0 {
                    let e = mlp.evaluate(&as_slices(&params), test);
                    tracing::info!(rank, iteration = t, accuracy = e.accuracy, loss = e.loss, "test evaluation");
                    emitter.emit(&Event::Eval { rank, iteration: t, accuracy: e.accuracy, loss: e.loss });
                }
                // Full batches only (drop the last partial batch of an epoch, like
                // PyTorch's drop_last): a 2-image batch would take a full, noisy step.
                let mut batch = batches.next_batch();
                if batch.y.len() < d.batch_size && batches_per_epoch > 1 {
                    batch = batches.next_batch();
                }
                samples += batch.y.len() as u64;
                loss = mlp.loss_and_grad_into(&as_slices(&params), batch.x, batch.y, &mut grads);
            }
            Workload::Synthetic { grads: source, compute, jitter } => {
                source.next(&mut grads);
                samples += d.batch_size as u64;
                loss = 0.0;
                // Compute time as a sleep (like a GPU step: it does not load the CPU),
                // with +-10% seeded jitter.
                let factor = 0.9 + 0.2 * rand::Rng::random::<f64>(jitter);
                tokio::time::sleep(compute.mul_f64(factor)).await;
            }
        }
        if let Some((dist, rng)) = straggle.as_mut() {
            let ms = dist.sample(rng).max(0.0);
            tokio::time::sleep(Duration::from_secs_f64(ms / 1e3)).await;
        }
        let comm = Instant::now();
        // The last iteration of worker 0 also pulls the final model (clock `iterations`).
        if t + 1 < iterations || rank == 0 {
            client.push_pull(t, &grads, &mut params).await.with_context(|| format!("worker {rank} at clock {t}"))?;
        } else {
            client.push(t, &grads).await.with_context(|| format!("worker {rank} pushing clock {t}"))?;
        }
        stats.comm += comm.elapsed();
        stats.record(&client.last_waits().per_server);
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
    emitter.emit(&Event::WorkerDone(stats.finish(rank, iterations, samples, loss, train_s)));
    client.finish().await.context("telling the scheduler this worker is done")?;
    Ok(())
}

/// The delay distribution of this rank, if `--worker-delay` names it.
fn straggler(spec: Option<&StragglerSpec>, rank: u32, seed: u64) -> anyhow::Result<Option<(Normal<f64>, StdRng)>> {
    let Some(spec) = spec.filter(|s| s.ranks.contains(&rank)) else { return Ok(None) };
    let dist = Normal::new(spec.mean_ms, spec.sd_ms).context("--worker-delay: invalid normal distribution")?;
    Ok(Some((dist, StdRng::seed_from_u64(seed ^ 0x5EED ^ u64::from(rank)))))
}

/// Per-iteration timings of one worker.
///
/// Iteration k lasts from the end of iteration k - 1 (or from [`Tally::start`]) to the end
/// of its push/pull, so the durations tile the training loop without gaps: iteration k
/// ends `sum(iter_ms[..=k])` after `started_unix_ms`, which lets a benchmark line them up
/// with the scheduler's clock (migrations, scaling events).
struct Tally {
    iterations: Histogram,
    iter_total: Duration,
    comm: Duration,
    per_server: Vec<Duration>,
    /// Where the current iteration started.
    mark: Instant,
    /// Wall-clock time of the first iteration's start, ms since the Unix epoch.
    started_unix_ms: f64,
    /// Every iteration's duration, ms, in order.
    iter_ms: Vec<f32>,
}

impl Tally {
    fn new(servers: usize) -> Self {
        Self {
            iterations: Histogram::default(),
            iter_total: Duration::ZERO,
            comm: Duration::ZERO,
            per_server: vec![Duration::ZERO; servers],
            mark: Instant::now(),
            started_unix_ms: unix_ms(),
            iter_ms: Vec::new(),
        }
    }

    /// The first iteration starts now.
    fn start(&mut self) {
        self.mark = Instant::now();
        self.started_unix_ms = unix_ms();
    }

    /// The current iteration ended now; `waits` is how long each server took in its round.
    fn record(&mut self, waits: &[Duration]) {
        let now = Instant::now();
        let iteration = now.saturating_duration_since(self.mark);
        self.mark = now;
        self.iterations.record(iteration.as_micros() as u64);
        self.iter_total += iteration;
        // Microsecond resolution, written as a short decimal in report.json.
        self.iter_ms.push(iteration.as_micros() as f32 / 1e3);
        for (total, w) in self.per_server.iter_mut().zip(waits) {
            *total += *w;
        }
    }

    fn finish(&self, rank: u32, iterations: u32, samples: u64, final_loss: f32, train_s: f64) -> WorkerReport {
        let per_iter = |d: Duration| if iterations == 0 { 0.0 } else { d.as_secs_f64() * 1e3 / f64::from(iterations) };
        WorkerReport {
            rank,
            iterations: iterations.into(),
            samples,
            wait_ms: self.comm.as_secs_f64() * 1e3,
            final_loss: final_loss.into(),
            train_s,
            iter_ms_mean: per_iter(self.iter_total),
            iter_ms_p99: self.iterations.quantile(0.99) as f64 / 1e3,
            comm_ms_per_iter: per_iter(self.comm),
            wait_ms_by_server: self.per_server.iter().map(|d| d.as_secs_f64() * 1e3).collect(),
            started_unix_ms: self.started_unix_ms,
            iter_ms: self.iter_ms.clone(),
        }
    }
}

/// Milliseconds since the Unix epoch, now (0 if the clock is before 1970).
fn unix_ms() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64() * 1e3)
}
