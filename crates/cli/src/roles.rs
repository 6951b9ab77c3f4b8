//! The three roles as commands: `scheduler`, `server`, `worker`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use elasticps_runtime::client::{Client, ClientOptions};
use elasticps_runtime::scheduler::{self, SchedulerOptions};
use elasticps_runtime::server::{self, ServerOptions};
use elasticps_train::{Batcher, Mlp, as_slices, load};

use crate::args::{DataArgs, JobArgs, NetArgs};
use crate::events::{Emitter, Event};

/// `elasticps scheduler`: membership, layout, heartbeats, the end of the job.
#[derive(Args, Clone, Debug)]
pub struct SchedulerCmd {
    /// Address to listen on.
    #[arg(long, env = "ELASTICPS_LISTEN", default_value = "127.0.0.1:7000")]
    pub listen: String,
    /// The job.
    #[command(flatten)]
    pub job: JobArgs,
    /// Transport settings.
    #[command(flatten)]
    pub net: NetArgs,
    /// Give up if the cluster is not complete within this many seconds.
    #[arg(long, env = "ELASTICPS_JOIN_TIMEOUT", default_value_t = 300)]
    pub join_timeout_s: u64,
    /// Print JSON events on stdout.
    #[arg(long, env = "ELASTICPS_EVENTS")]
    pub events: bool,
}

/// `elasticps server`: owns blocks, applies pushes, answers pulls.
#[derive(Args, Clone, Debug)]
pub struct ServerCmd {
    /// The scheduler's address.
    #[arg(long, env = "ELASTICPS_SCHEDULER", default_value = "127.0.0.1:7000")]
    pub scheduler: String,
    /// Address to listen on for workers (port 0: any free port).
    #[arg(long, env = "ELASTICPS_LISTEN", default_value = "127.0.0.1:0")]
    pub listen: String,
    /// Address workers should dial, if not the listen address (e.g. when listening on 0.0.0.0).
    #[arg(long, env = "ELASTICPS_ADVERTISE")]
    pub advertise: Option<String>,
    /// Write one JSON line per answered pull to this file (for checking sync semantics).
    #[arg(long, env = "ELASTICPS_TRACE")]
    pub trace: Option<PathBuf>,
    /// Transport settings.
    #[command(flatten)]
    pub net: NetArgs,
    /// Print JSON events on stdout.
    #[arg(long, env = "ELASTICPS_EVENTS")]
    pub events: bool,
}

/// `elasticps worker`: trains the MLP on its shard of the data through the client library.
#[derive(Args, Clone, Debug)]
pub struct WorkerCmd {
    /// The scheduler's address.
    #[arg(long, env = "ELASTICPS_SCHEDULER", default_value = "127.0.0.1:7000")]
    pub scheduler: String,
    /// Data and schedule.
    #[command(flatten)]
    pub data: DataArgs,
    /// Transport settings.
    #[command(flatten)]
    pub net: NetArgs,
    /// Print JSON events on stdout.
    #[arg(long, env = "ELASTICPS_EVENTS")]
    pub events: bool,
}

/// Runs the scheduler until the job ends.
pub async fn scheduler(cmd: SchedulerCmd) -> anyhow::Result<()> {
    let emitter = Emitter::new(cmd.events);
    let opts = SchedulerOptions {
        listen: cmd.listen.clone(),
        job: cmd.job.job_config()?,
        codec: cmd.net.codec(),
        join_timeout: Duration::from_secs(cmd.join_timeout_s),
    };
    let reason = scheduler::run(opts, |addr| {
        tracing::info!(%addr, "scheduler listening");
        emitter.emit(&Event::Listening { addr: addr.to_string() });
    })
    .await?;
    tracing::info!(%reason, "scheduler done");
    Ok(())
}

/// Runs a server until the scheduler ends the job.
pub async fn server(cmd: ServerCmd) -> anyhow::Result<()> {
    let emitter = Emitter::new(cmd.events);
    let opts = ServerOptions {
        scheduler: cmd.scheduler,
        listen: cmd.listen,
        advertise: cmd.advertise,
        codec: cmd.net.codec(),
        trace: cmd.trace,
    };
    let stats = server::run(opts).await?;
    tracing::info!(
        server = stats.server_id,
        pushes = stats.totals.pushes,
        pulls = stats.totals.pulls,
        held = stats.totals.pulls_held,
        "server done"
    );
    emitter.emit(&Event::ServerStats(stats));
    Ok(())
}

/// Runs the MLP training job of one worker.
pub async fn worker(cmd: WorkerCmd) -> anyhow::Result<()> {
    let emitter = Emitter::new(cmd.events);
    let d = &cmd.data;
    anyhow::ensure!(d.batch_size > 0, "--batch-size must be at least 1");
    // Load the data before joining, so a missing file fails fast with its own message.
    let (train, test) = load(d.dataset, d.data_dir.as_deref())?;
    let mut opts = ClientOptions::new(&cmd.scheduler);
    opts.codec = cmd.net.codec();
    opts.request_timeout = d.request_timeout();
    let mut client = Client::connect(opts).await.context("joining the job")?;
    let (rank, world) = (client.rank(), client.num_workers());
    let mlp = Mlp::default();
    client.register_model(mlp.tensor_specs()).await.context("registering the model")?;

    // Every worker runs the same number of iterations, from the smallest shard.
    let per_worker = train.len() / world as usize;
    anyhow::ensure!(per_worker > 0, "{} training examples cannot feed {world} workers", train.len());
    let iterations = match d.iterations {
        Some(n) => n,
        None => (d.epochs * per_worker.div_ceil(d.batch_size)) as u32,
    };
    let mut batches =
        Batcher::new(train.shard(rank as usize, world as usize), d.batch_size, d.data_seed + u64::from(rank))?;
    let mut params = client.zeros();
    let mut grads = client.zeros();
    let (mut wait, mut samples, mut loss) = (Duration::ZERO, 0u64, f32::NAN);
    let mut last_progress = Instant::now();
    tracing::info!(rank, iterations, "training starts");
    let training = Instant::now();
    for t in 0..iterations {
        let started = Instant::now();
        client.pull(t, &mut params).await.with_context(|| format!("worker {rank} pulling clock {t}"))?;
        wait += started.elapsed();
        if rank == 0 && d.eval_every > 0 && t % d.eval_every == 0 {
            let e = mlp.evaluate(&as_slices(&params), &test);
            tracing::info!(rank, iteration = t, accuracy = e.accuracy, loss = e.loss, "test evaluation");
            emitter.emit(&Event::Eval { rank, iteration: t, accuracy: e.accuracy, loss: e.loss });
        }
        let batch = batches.next_batch();
        samples += batch.y.len() as u64;
        loss = mlp.loss_and_grad_into(&as_slices(&params), batch.x, batch.y, &mut grads);
        let started = Instant::now();
        client.push(t, &grads).await.with_context(|| format!("worker {rank} pushing clock {t}"))?;
        wait += started.elapsed();
        if last_progress.elapsed() >= Duration::from_millis(100) || t + 1 == iterations {
            last_progress = Instant::now();
            emitter.emit(&Event::Progress { rank, iteration: t + 1, total: iterations, loss });
        }
    }
    let train_s = training.elapsed().as_secs_f64();
    if rank == 0 {
        // The final model: every worker's last push is in (under bsp and ssp alike).
        client.pull(iterations, &mut params).await.context("pulling the final model")?;
        let e = mlp.evaluate(&as_slices(&params), &test);
        tracing::info!(rank, accuracy = e.accuracy, loss = e.loss, "final test evaluation");
        emitter.emit(&Event::Eval { rank, iteration: iterations, accuracy: e.accuracy, loss: e.loss });
    }
    emitter.emit(&Event::WorkerDone {
        rank,
        iterations,
        samples,
        wait_ms: wait.as_secs_f64() * 1e3,
        final_loss: loss,
        train_s,
    });
    client.finish().await.context("telling the scheduler this worker is done")?;
    Ok(())
}
