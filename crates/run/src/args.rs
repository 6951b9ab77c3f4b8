//! The flags of a job, shared by the roles, `train`, `launch` and `sim`. Every flag also
//! reads an environment variable (`ELASTICPS_...`), so a launcher or a Kubernetes manifest
//! can configure a role without a command line. The transport's flags (`NetArgs`) stay
//! with the process launcher, which owns the sockets.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use crate::RunError;
use crate::error::ensure_flags;
use elasticps_core::block::ShardConfig;
use elasticps_core::compress::Sparsifier;
use elasticps_core::dtype::Dtype;
use elasticps_core::optimizer::{OptimizerConfig, OptimizerKind};
use elasticps_core::placement::PlacementKind;
use elasticps_core::sync::SyncPolicy;
use elasticps_node::scheduler::{BalanceMode, JobConfig};
use elasticps_train::DatasetKind;
use elasticps_train::delays::Jitter;
use elasticps_train::synthetic::ModelKind;
use elasticps_wire::{CheckpointPlan, Injection};

/// How a local run (`train`, `launch`) shows itself: report, progress bars, metrics.
#[derive(Args, Clone, Debug, Default)]
pub struct RunArgs {
    /// Write report.json, summary.md, curves.png (and every node's log) into this directory.
    #[arg(long, env = "ELASTICPS_REPORT")]
    pub report: Option<PathBuf>,
    /// Do not draw progress bars.
    #[arg(long, env = "ELASTICPS_QUIET")]
    pub quiet: bool,
    /// Serve Prometheus metrics on every node (a free port each) and print where to
    /// scrape them.
    #[arg(long, env = "ELASTICPS_METRICS")]
    pub metrics: bool,
    /// Restart a worker that dies (exits unsuccessfully) with its rank, at most N times in
    /// all: it rejoins the job at the clock the job is at. 0: a dead worker ends the job.
    #[arg(long, env = "ELASTICPS_RESTART_WORKERS", value_name = "N", default_value_t = 0)]
    pub restart_workers: u32,
    /// With --replicas 2 or more: start a new server when one dies, at most N times in
    /// all; it joins the job and takes blocks and backup copies. 0: the job goes on with
    /// one server fewer.
    #[arg(long, env = "ELASTICPS_RESTART_SERVERS", value_name = "N", default_value_t = 0)]
    pub restart_servers: u32,
}

/// What the scheduler needs to know about the job.
#[derive(Args, Clone, Debug, PartialEq)]
pub struct JobArgs {
    /// Number of servers.
    #[arg(long, env = "ELASTICPS_SERVERS", default_value_t = 2)]
    pub servers: u32,
    /// Number of workers.
    #[arg(long, env = "ELASTICPS_WORKERS", default_value_t = 2)]
    pub workers: u32,
    /// Synchronization policy of every server: bsp, asp, ssp:S, lazy:S, pssp:S:P,
    /// dpssp:S, adaptive or adaptive:MIN:MAX (see docs/MANUAL.md, "How it works").
    #[arg(long, env = "ELASTICPS_SYNC", default_value = "bsp", value_parser = parse_core::<SyncPolicy>)]
    pub sync: SyncPolicy,
    /// Override the sync policy of one server: IDX=POLICY (repeatable, e.g.
    /// `--server-sync 1=bsp`), so servers of one job can run different policies.
    #[arg(long = "server-sync", env = "ELASTICPS_SERVER_SYNC", value_delimiter = ',', value_parser = parse_server_sync)]
    pub server_sync: Vec<(u32, SyncPolicy)>,
    /// Server-side optimizer: sgd, momentum[:BETA], adam or adamw (the job's weight decay is
    /// 0: AdamW's decay comes with a per-tensor optimizer, e.g. from PyTorch).
    #[arg(long, env = "ELASTICPS_OPTIMIZER", default_value = "adam", value_parser = parse_core::<OptimizerKind>)]
    #[allow(rustdoc::broken_intra_doc_links)] // `momentum[:BETA]` is the flag's syntax, shown by --help
    pub optimizer: OptimizerKind,
    /// Learning rate of the server-side optimizer.
    #[arg(long, env = "ELASTICPS_LR", default_value_t = 0.001)]
    pub lr: f32,
    /// Sum the pushes of one clock from every worker and take one step with their mean
    /// (exact BSP, like BytePS, and DDP's arithmetic). `train` and the roles apply every
    /// push as it arrives unless this is set; `launch` sets it when every server runs bsp
    /// (`--no-aggregate` keeps per-push steps).
    #[arg(long, env = "ELASTICPS_AGGREGATE")]
    pub aggregate: bool,
    /// Initial placement of blocks: bestfit (size-balanced), range (ps-lite), hash
    /// (BytePS), roundrobin (TensorFlow) or skewed:IDX (at least 70% of the bytes on
    /// server IDX, the rest best-fit over the others).
    #[arg(long, env = "ELASTICPS_PLACEMENT", default_value = "bestfit", value_parser = parse_core::<PlacementKind>)]
    pub placement: PlacementKind,
    /// Largest block, in bytes (tensors are cut into blocks of at most this size).
    #[arg(long, env = "ELASTICPS_BLOCK_BYTES", default_value_t = 4 << 20)]
    pub block_bytes: usize,
    /// Seed of the initial parameters (and of the data order on workers).
    #[arg(long, env = "ELASTICPS_SEED", default_value_t = 42)]
    pub seed: u64,
    /// Straggler injection: cap server IDX's socket bandwidth, each direction, at MBPS
    /// megabytes (10^6 bytes) per second: IDX=MBPS (repeatable, e.g. `--server-bandwidth 0=12.5`).
    #[arg(
        long = "server-bandwidth",
        env = "ELASTICPS_SERVER_BANDWIDTH",
        value_name = "IDX=MBPS",
        value_delimiter = ',',
        value_parser = parse_server_bandwidth
    )]
    pub server_bandwidth: Vec<(u32, f64)>,
    /// Straggler injection: server IDX burns FACTOR times the CPU time of each request:
    /// IDX=FACTOR, FACTOR >= 1 (repeatable, e.g. `--server-interference 1=3`).
    #[arg(
        long = "server-interference",
        env = "ELASTICPS_SERVER_INTERFERENCE",
        value_name = "IDX=FACTOR",
        value_delimiter = ',',
        value_parser = parse_server_interference
    )]
    pub server_interference: Vec<(u32, f32)>,
    /// Seconds after a server gets its blocks at which its --server-bandwidth and
    /// --server-interference start.
    #[arg(
        long,
        env = "ELASTICPS_STRAGGLER_AT",
        value_name = "SECONDS",
        default_value_t = 0.0,
        value_parser = parse_straggler_at
    )]
    pub straggler_at: f64,
    /// Load balancing: static (keep the initial placement) or psld (move blocks off
    /// stragglers, scale servers out and in between --min-servers and --max-servers).
    #[arg(long, env = "ELASTICPS_BALANCE", default_value = "static")]
    pub balance: BalanceMode,
    /// With --balance psld: the dtype (bf16 or fp16) the balancer may send a
    /// bandwidth-bound straggler's blocks in instead of moving them, kept only if the
    /// iteration time improves. It changes those blocks' arithmetic: off unless given.
    #[arg(long, env = "ELASTICPS_BALANCE_COMPRESS", value_name = "DTYPE", value_parser = parse_core::<Dtype>)]
    pub balance_compress: Option<Dtype>,
    /// Most servers the balancer or an operator's add-server may scale out to [default: --servers].
    #[arg(long, env = "ELASTICPS_MAX_SERVERS")]
    pub max_servers: Option<u32>,
    /// Fewest servers the balancer or an operator's remove-server may scale in to [default: --servers].
    #[arg(long, env = "ELASTICPS_MIN_SERVERS")]
    pub min_servers: Option<u32>,
    /// Write a checkpoint of every block here (a directory every server and the
    /// scheduler can reach) every --checkpoint-every clocks.
    #[arg(long, env = "ELASTICPS_CHECKPOINT_DIR", value_name = "DIR")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Clocks between checkpoints (with --checkpoint-dir): each is taken at a multiple of
    /// this clock, and stops a worker for at most the time the slowest needs to get there.
    #[arg(long, env = "ELASTICPS_CHECKPOINT_EVERY", value_name = "N", default_value_t = 0)]
    pub checkpoint_every: u32,
    /// Start from the latest complete checkpoint in DIR: the same model, workers and
    /// --block-bytes, going on from its clock (new checkpoints go to --checkpoint-dir,
    /// DIR by default).
    #[arg(long, env = "ELASTICPS_RESUME", value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// Once every other worker is done, wait this long for lost workers to rejoin
    /// (restarted with their rank) before the job ends without them
    /// [default: 0; 60 with train/launch --restart-workers].
    #[arg(long, env = "ELASTICPS_REJOIN_WAIT_S", value_name = "SECONDS", default_value_t = 0.0)]
    pub rejoin_wait_s: f64,
    /// Copies of every block: a primary and R-1 backups on distinct servers. A push is
    /// acknowledged once every copy applied it; a lost server's blocks fail over to their
    /// backups (detected within 2 s) and training goes on. 1: a lost server ends the job.
    #[arg(long, env = "ELASTICPS_REPLICAS", value_name = "R", default_value_t = 1)]
    pub replicas: u32,
    /// Keep the scheduler's recoverable state (membership, model, placement, history) in
    /// DIR, rewritten atomically when it changes; a scheduler restarted on the same address
    /// with the same DIR recovers the job and its nodes reattach (docs/MANUAL.md, "Scheduler
    /// restart").
    #[arg(long, env = "ELASTICPS_STATE_DIR", value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
}

/// The job a command line with none of these flags describes (clap's defaults; a test
/// keeps the two equal): for code that builds a job, naming only what it sets.
impl Default for JobArgs {
    fn default() -> Self {
        JobArgs {
            servers: 2,
            workers: 2,
            sync: SyncPolicy::Bsp,
            server_sync: Vec::new(),
            // As clap's default_value: the parser holds Adam's betas and eps.
            optimizer: "adam".parse().unwrap_or(OptimizerKind::Sgd),
            lr: 0.001,
            aggregate: false,
            placement: PlacementKind::BestFit,
            block_bytes: 4 << 20,
            seed: 42,
            server_bandwidth: Vec::new(),
            server_interference: Vec::new(),
            straggler_at: 0.0,
            balance: BalanceMode::default(),
            balance_compress: None,
            max_servers: None,
            min_servers: None,
            checkpoint_dir: None,
            checkpoint_every: 0,
            resume: None,
            rejoin_wait_s: 0.0,
            replicas: 1,
            state_dir: None,
        }
    }
}

impl JobArgs {
    /// The scheduler's job configuration.
    pub fn job_config(&self) -> crate::Result<JobConfig> {
        ensure_flags!(self.servers > 0, "--servers must be at least 1");
        ensure_flags!(self.workers > 0, "--workers must be at least 1");
        ensure_flags!(self.block_bytes >= 4, "--block-bytes must be at least 4 (one f32)");
        ensure_flags!(self.lr.is_finite() && self.lr > 0.0, "--lr must be a positive number");
        if let Some((idx, _)) = self.server_sync.iter().find(|(i, _)| *i >= self.servers) {
            return Err(RunError::Flags(format!(
                "--server-sync names server {idx}, but the job has servers 0..{}",
                self.servers
            )));
        }
        let servers = self.servers;
        if let PlacementKind::Skewed(idx) = self.placement
            && idx >= servers
        {
            return Err(RunError::Flags(format!(
                "--placement skewed:{idx} names server {idx}, but the job starts with servers 0..{servers}"
            )));
        }
        let max_servers = self.max_servers.unwrap_or(servers);
        let min_servers = self.min_servers.unwrap_or(servers);
        ensure_flags!(max_servers >= servers, "--max-servers {max_servers} is below --servers {servers}");
        ensure_flags!(min_servers >= 1, "--min-servers must be at least 1");
        ensure_flags!(min_servers <= servers, "--min-servers {min_servers} is above --servers {servers}");
        ensure_flags!(self.replicas >= 1, "--replicas must be at least 1 (the primary copy)");
        if let Some(d) = self.balance_compress {
            ensure_flags!(d != Dtype::F32, "--balance-compress takes bf16 or fp16 (f32 compresses nothing)");
            ensure_flags!(self.balance == BalanceMode::Psld, "--balance-compress {d} needs --balance psld");
        }
        ensure_flags!(
            self.replicas <= servers,
            "--replicas {} needs at least {} servers (each copy of a block on its own server); the job has {servers}",
            self.replicas,
            self.replicas
        );
        ensure_flags!(
            self.rejoin_wait_s.is_finite() && self.rejoin_wait_s >= 0.0,
            "--rejoin-wait-s must be a non-negative number of seconds"
        );
        ensure_flags!(
            self.checkpoint_dir.is_none() || self.checkpoint_every > 0,
            "--checkpoint-dir needs --checkpoint-every N (clocks between checkpoints)"
        );
        ensure_flags!(
            self.checkpoint_every == 0 || self.checkpoint_dir.is_some() || self.resume.is_some(),
            "--checkpoint-every needs --checkpoint-dir DIR"
        );
        let checkpoint = self.checkpoint_dir.as_ref().or(self.resume.as_ref()).map(|dir| CheckpointPlan {
            dir: dir.display().to_string(),
            every: self.checkpoint_every,
            // Read by the scheduler ([`JobArgs::resume`]): the only role that needs it.
            resume: None,
        });
        Ok(JobConfig {
            servers,
            workers: self.workers,
            block_bytes: self.block_bytes,
            placement: self.placement,
            shard: ShardConfig {
                sync: self.sync,
                optimizer: OptimizerConfig {
                    kind: self.optimizer,
                    lr: self.lr,
                    aggregate: self.aggregate,
                    weight_decay: 0.0,
                },
                workers: self.workers,
            },
            seed: self.seed,
            server_sync: self.server_sync.clone(),
            inject: self.injections(max_servers)?,
            balance: self.balance,
            balance_compress: self.balance_compress,
            max_servers,
            min_servers,
            checkpoint,
            rejoin_wait_us: (self.rejoin_wait_s * 1e6) as u64,
            replicas: self.replicas,
        })
    }

    /// One injection per server named by --server-bandwidth or --server-interference (the
    /// last value of a server wins), in server order, all starting --straggler-at seconds
    /// after the server gets its blocks.
    fn injections(&self, max_servers: u32) -> crate::Result<Vec<(u32, Injection)>> {
        let named = self.server_bandwidth.iter().map(|(i, _)| (*i, "--server-bandwidth"));
        let named = named.chain(self.server_interference.iter().map(|(i, _)| (*i, "--server-interference")));
        for (idx, flag) in named {
            ensure_flags!(
                idx < max_servers,
                "{flag} names server {idx}, but the job has at most {max_servers} servers (0..{max_servers}, see \
                 --max-servers)"
            );
        }
        let base = Injection { at_us: (self.straggler_at * 1e6).round() as u64, ..Injection::default() };
        let mut by_server: BTreeMap<u32, Injection> = BTreeMap::new();
        for (idx, mbps) in &self.server_bandwidth {
            by_server.entry(*idx).or_insert(base).bandwidth_bps = (mbps * 1e6).round() as u64;
        }
        for (idx, factor) in &self.server_interference {
            by_server.entry(*idx).or_insert(base).interference = *factor;
        }
        Ok(by_server.into_iter().collect())
    }

    /// The flags that reproduce these settings on a child process.
    pub fn to_flags(&self) -> Vec<String> {
        let mut f = vec![
            "--servers".into(),
            self.servers.to_string(),
            "--workers".into(),
            self.workers.to_string(),
            "--sync".into(),
            self.sync.to_string(),
            "--optimizer".into(),
            self.optimizer.to_string(),
            "--lr".into(),
            self.lr.to_string(),
            "--placement".into(),
            self.placement.to_string(),
            "--block-bytes".into(),
            self.block_bytes.to_string(),
            "--seed".into(),
            self.seed.to_string(),
        ];
        if self.aggregate {
            f.push("--aggregate".into());
        }
        for (idx, policy) in &self.server_sync {
            f.extend(["--server-sync".into(), format!("{idx}={policy}")]);
        }
        for (idx, mbps) in &self.server_bandwidth {
            f.extend(["--server-bandwidth".into(), format!("{idx}={mbps}")]);
        }
        for (idx, factor) in &self.server_interference {
            f.extend(["--server-interference".into(), format!("{idx}={factor}")]);
        }
        f.extend([
            "--straggler-at".into(),
            self.straggler_at.to_string(),
            "--balance".into(),
            self.balance.to_string(),
        ]);
        if let Some(d) = self.balance_compress {
            f.extend(["--balance-compress".into(), d.to_string()]);
        }
        if let Some(n) = self.max_servers {
            f.extend(["--max-servers".into(), n.to_string()]);
        }
        if let Some(n) = self.min_servers {
            f.extend(["--min-servers".into(), n.to_string()]);
        }
        if let Some(d) = &self.checkpoint_dir {
            f.extend(["--checkpoint-dir".into(), d.display().to_string()]);
        }
        if self.checkpoint_every > 0 {
            f.extend(["--checkpoint-every".into(), self.checkpoint_every.to_string()]);
        }
        if let Some(d) = &self.resume {
            f.extend(["--resume".into(), d.display().to_string()]);
        }
        if self.rejoin_wait_s > 0.0 {
            f.extend(["--rejoin-wait-s".into(), self.rejoin_wait_s.to_string()]);
        }
        if self.replicas != 1 {
            f.extend(["--replicas".into(), self.replicas.to_string()]);
        }
        if let Some(d) = &self.state_dir {
            f.extend(["--state-dir".into(), d.display().to_string()]);
        }
        f
    }
}

/// `--worker-delay RANKS:MEAN_MS:SD_MS`: a normal delay (clipped at 0) added after each
/// iteration of the listed ranks, as in FluentPS's straggler experiments.
#[derive(Clone, Debug, PartialEq)]
pub struct StragglerSpec {
    /// Ranks that straggle.
    pub ranks: Vec<u32>,
    /// Mean delay, ms.
    pub mean_ms: f64,
    /// Standard deviation, ms.
    pub sd_ms: f64,
}

impl std::str::FromStr for StragglerSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = |why: &str| format!("--worker-delay {s:?}: {why}; expected RANKS:MEAN_MS:SD_MS, e.g. 0,4:50:10");
        let parts: Vec<&str> = s.split(':').collect();
        let [ranks, mean, sd] = parts[..] else { return Err(bad("three fields separated by ':'")) };
        let ranks = ranks
            .split(',')
            .map(|r| r.trim().parse::<u32>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| bad("bad rank"))?;
        let mean_ms: f64 = mean.parse().map_err(|_| bad("bad mean"))?;
        let sd_ms: f64 = sd.parse().map_err(|_| bad("bad standard deviation"))?;
        if !(mean_ms.is_finite() && sd_ms.is_finite() && mean_ms >= 0.0 && sd_ms >= 0.0) {
            return Err(bad("mean and standard deviation must be non-negative"));
        }
        Ok(Self { ranks, mean_ms, sd_ms })
    }
}

impl std::fmt::Display for StragglerSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ranks: Vec<String> = self.ranks.iter().map(u32::to_string).collect();
        write!(f, "{}:{}:{}", ranks.join(","), self.mean_ms, self.sd_ms)
    }
}

/// What a worker trains on and for how long.
#[derive(Args, Clone, Debug, PartialEq)]
pub struct DataArgs {
    /// Model: mlp (784-256-128-10 on the dataset) or synthetic:resnet56|resnet50|vgg16|bert-base
    /// (those networks' tensor sizes, random gradients, --compute-ms per iteration).
    #[arg(long, env = "ELASTICPS_MODEL", default_value = "mlp", value_parser = parse_model)]
    pub model: ModelKind,
    /// Compute time per iteration of a synthetic model, ms (+-10% seeded jitter).
    #[arg(long, env = "ELASTICPS_COMPUTE_MS", default_value_t = 20.0)]
    pub compute_ms: f64,
    /// Straggler injection: RANKS:MEAN_MS:SD_MS, e.g. 0,4:50:10.
    #[arg(long, env = "ELASTICPS_WORKER_DELAY")]
    pub worker_delay: Option<StragglerSpec>,
    /// Transient stragglers: P:MS, e.g. 0.1:80: at every iteration every worker is slow by
    /// MS ms with probability P, independently (seeded by --data-seed; adds to
    /// --worker-delay).
    #[arg(long, env = "ELASTICPS_WORKER_JITTER", value_name = "P:MS", value_parser = parse_jitter)]
    pub worker_jitter: Option<Jitter>,
    /// Dataset: mnist-subset (bundled), mnist, fashion-mnist.
    #[arg(long, env = "ELASTICPS_DATASET", default_value = "mnist-subset", value_parser = parse_dataset)]
    pub dataset: DatasetKind,
    /// Directory holding the dataset's IDX files (default: where scripts/fetch-data or
    /// the Debian package puts them).
    #[arg(long, env = "ELASTICPS_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Mini-batch size per worker.
    #[arg(long, env = "ELASTICPS_BATCH_SIZE", default_value_t = 32)]
    pub batch_size: usize,
    /// Passes over the training set (each worker covers its shard once per epoch).
    #[arg(long, env = "ELASTICPS_EPOCHS", default_value_t = 6)]
    pub epochs: usize,
    /// Run exactly this many iterations per worker instead of --epochs.
    #[arg(long, env = "ELASTICPS_ITERATIONS")]
    pub iterations: Option<u32>,
    /// Evaluate test accuracy (on worker 0) every this many iterations (0: only at the end).
    #[arg(long, env = "ELASTICPS_EVAL_EVERY", default_value_t = 50)]
    pub eval_every: u32,
    /// Seed of the data order.
    #[arg(long = "data-seed", env = "ELASTICPS_DATA_SEED", default_value_t = 7)]
    pub data_seed: u64,
    /// How long one push or pull may wait for its server, in seconds.
    #[arg(long, env = "ELASTICPS_REQUEST_TIMEOUT", default_value_t = 300)]
    pub request_timeout_s: u64,
    /// Send each block's push and the next iteration's pull as two requests (the pull once
    /// the server acknowledged the pushes) instead of one push_pull: to compare.
    #[arg(long = "no-fuse")]
    pub no_fuse: bool,
    /// The dtype gradients and pulled values travel in: f32, bf16 or fp16 (servers keep
    /// f32 values and optimizer state; initial values travel as f32).
    #[arg(long, env = "ELASTICPS_WIRE_DTYPE", default_value = "f32", value_parser = parse_core::<Dtype>)]
    pub wire_dtype: Dtype,
    /// Compress every gradient with error feedback: `topk:RATIO` (the largest RATIO of
    /// each tensor's entries) or `randomk:RATIO`; what is not sent joins the next step's
    /// gradient.
    #[arg(long, env = "ELASTICPS_COMPRESS", value_parser = parse_core::<Sparsifier>)]
    pub compress: Option<Sparsifier>,
}

/// The data a command line with none of these flags describes (clap's defaults; a test
/// keeps the two equal): for code that builds a job, naming only what it sets.
impl Default for DataArgs {
    fn default() -> Self {
        DataArgs {
            model: ModelKind::Mlp,
            compute_ms: 20.0,
            worker_delay: None,
            worker_jitter: None,
            dataset: DatasetKind::default(),
            data_dir: None,
            batch_size: 32,
            epochs: 6,
            iterations: None,
            eval_every: 50,
            data_seed: 7,
            request_timeout_s: 300,
            no_fuse: false,
            wire_dtype: Dtype::F32,
            compress: None,
        }
    }
}

impl DataArgs {
    /// The request timeout.
    pub fn request_timeout(&self) -> Duration {
        Duration::from_secs(self.request_timeout_s.max(1))
    }

    /// The flags that reproduce these settings on a child process.
    pub fn to_flags(&self) -> Vec<String> {
        let mut f = vec![
            "--model".into(),
            self.model.to_string(),
            "--compute-ms".into(),
            self.compute_ms.to_string(),
            "--dataset".into(),
            self.dataset.as_str().into(),
            "--batch-size".into(),
            self.batch_size.to_string(),
            "--epochs".into(),
            self.epochs.to_string(),
            "--eval-every".into(),
            self.eval_every.to_string(),
            "--data-seed".into(),
            self.data_seed.to_string(),
            "--request-timeout-s".into(),
            self.request_timeout_s.to_string(),
        ];
        if let Some(dir) = &self.data_dir {
            f.extend(["--data-dir".into(), dir.display().to_string()]);
        }
        if let Some(n) = self.iterations {
            f.extend(["--iterations".into(), n.to_string()]);
        }
        if let Some(d) = &self.worker_delay {
            f.extend(["--worker-delay".into(), d.to_string()]);
        }
        if let Some(j) = &self.worker_jitter {
            f.extend(["--worker-jitter".into(), j.to_string()]);
        }
        if self.no_fuse {
            f.push("--no-fuse".into());
        }
        if self.wire_dtype != Dtype::F32 {
            f.extend(["--wire-dtype".into(), self.wire_dtype.to_string()]);
        }
        if let Some(c) = self.compress {
            f.extend(["--compress".into(), c.to_string()]);
        }
        f
    }

    /// The draws of worker `rank` (compute time, `--worker-delay`, `--worker-jitter`),
    /// as every worker, real or simulated, draws them.
    pub fn delays(&self, rank: u32) -> crate::Result<elasticps_train::Delays> {
        let persistent = self.worker_delay.as_ref().filter(|d| d.ranks.contains(&rank)).map(|d| (d.mean_ms, d.sd_ms));
        elasticps_train::Delays::new(self.data_seed, rank, self.compute_ms, persistent, self.worker_jitter)
            .map_err(|e| RunError::Flags(e.to_string()))
    }
}

fn parse_core<T: std::str::FromStr<Err = elasticps_core::CoreError>>(s: &str) -> Result<T, String> {
    s.parse().map_err(|e: elasticps_core::CoreError| e.to_string())
}

fn parse_server_sync(s: &str) -> Result<(u32, SyncPolicy), String> {
    parse_per_server(s, "1=bsp", parse_core)
}

/// `IDX=VALUE` of a per-server flag; `value` parses and checks VALUE.
fn parse_per_server<T>(
    s: &str,
    example: &str,
    value: impl FnOnce(&str) -> Result<T, String>,
) -> Result<(u32, T), String> {
    let (idx, v) = s.split_once('=').ok_or_else(|| format!("{s:?}: expected IDX=VALUE, e.g. {example}"))?;
    let idx = idx.trim().parse::<u32>().map_err(|_| format!("{s:?}: {idx:?} is not a server index"))?;
    Ok((idx, value(v.trim()).map_err(|why| format!("{s:?}: {why}"))?))
}

fn parse_server_bandwidth(s: &str) -> Result<(u32, f64), String> {
    parse_per_server(s, "0=12.5 (MB/s)", |v| match v.parse::<f64>() {
        // At least one byte per second: 0 would mean no cap.
        Ok(mbps) if mbps.is_finite() && mbps * 1e6 >= 1.0 => Ok(mbps),
        _ => Err(format!("{v:?} is not a bandwidth in MB/s greater than 0 (1 MB = 10^6 bytes)")),
    })
}

fn parse_server_interference(s: &str) -> Result<(u32, f32), String> {
    parse_per_server(s, "1=3 (3 times the CPU)", |v| match v.parse::<f32>() {
        Ok(factor) if factor.is_finite() && factor >= 1.0 => Ok(factor),
        _ => Err(format!("{v:?} is not a CPU factor of at least 1")),
    })
}

fn parse_straggler_at(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(secs) if (0.0..1e9).contains(&secs) => Ok(secs),
        _ => Err(format!("{s:?} is not a number of seconds >= 0")),
    }
}

fn parse_model(s: &str) -> Result<ModelKind, String> {
    s.parse().map_err(|e: elasticps_train::TrainError| e.to_string())
}

fn parse_jitter(s: &str) -> Result<Jitter, String> {
    s.parse().map_err(|e: elasticps_train::TrainError| e.to_string())
}

fn parse_dataset(s: &str) -> Result<DatasetKind, String> {
    s.parse().map_err(|e: elasticps_train::TrainError| e.to_string())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        job: JobArgs,
    }

    fn parse(flags: &[&str]) -> Result<JobArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("elasticps").chain(flags.iter().copied())).map(|c| c.job)
    }

    fn config(flags: &[&str]) -> crate::Result<JobConfig> {
        parse(flags).map_err(|e| RunError::Flags(e.to_string()))?.job_config()
    }

    #[test]
    fn the_default_job_is_the_command_lines_without_flags() {
        assert_eq!(JobArgs::default().to_flags(), parse(&[]).unwrap().to_flags());
    }

    #[test]
    fn stragglers_and_balancing_default_to_none() {
        let c = config(&["--servers", "3"]).unwrap();
        assert!(c.inject.is_empty());
        assert_eq!(c.balance, BalanceMode::Static);
        assert_eq!((c.max_servers, c.min_servers), (3, 3));
    }

    #[test]
    fn injections_merge_per_server() {
        let c = config(&[
            "--servers",
            "3",
            "--max-servers",
            "5",
            "--server-bandwidth",
            "2=0.5,0=12.5",
            "--server-interference",
            "2=3",
            "--server-interference",
            "4=1.5",
            "--straggler-at",
            "2.5",
        ])
        .unwrap();
        let inj = |bandwidth_bps, interference| Injection { bandwidth_bps, interference, at_us: 2_500_000 };
        assert_eq!(c.inject, vec![(0, inj(12_500_000, 0.0)), (2, inj(500_000, 3.0)), (4, inj(0, 1.5))]);
        assert_eq!(c.injection(2), inj(500_000, 3.0));
        assert_eq!(c.injection(1), Injection::default());
    }

    #[test]
    fn refuses_bad_stragglers_and_server_bounds() {
        for bad in [
            &["--server-bandwidth", "0=0"][..],
            &["--server-bandwidth", "0=-1"],
            &["--server-bandwidth", "0=x"],
            &["--server-bandwidth", "0=inf"],
            &["--server-bandwidth", "12.5"],
            &["--server-bandwidth", "a=12.5"],
            &["--server-interference", "1=0.5"],
            &["--server-interference", "1=NaN"],
            &["--straggler-at", "-1"],
            &["--balance", "fast"],
            &["--placement", "skewed"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
        let err = |flags: &[&str]| config(flags).unwrap_err().to_string();
        assert!(err(&["--balance-compress", "bf16"]).contains("needs --balance psld"));
        assert!(err(&["--balance", "psld", "--balance-compress", "f32"]).contains("bf16 or fp16"));
        assert_eq!(config(&["--balance", "psld"]).unwrap().balance_compress, None, "off by default");
        assert!(err(&["--servers", "2", "--max-servers", "1"]).contains("--max-servers 1 is below --servers 2"));
        assert!(err(&["--servers", "2", "--min-servers", "3"]).contains("--min-servers 3 is above --servers 2"));
        assert!(err(&["--min-servers", "0"]).contains("--min-servers must be at least 1"));
        assert!(err(&["--servers", "2", "--placement", "skewed:2"]).contains("skewed:2 names server 2"));
        let e = err(&["--servers", "2", "--max-servers", "3", "--server-interference", "3=2"]);
        assert!(e.contains("--server-interference names server 3") && e.contains("0..3"), "{e}");
        assert!(err(&["--servers", "2", "--server-bandwidth", "2=1"]).contains("--server-bandwidth names server 2"));
        // A server the balancer may start later can be named.
        assert!(config(&["--servers", "2", "--max-servers", "3", "--server-bandwidth", "2=1"]).is_ok());
    }

    #[test]
    fn to_flags_round_trips() {
        let original = parse(&[
            "--servers",
            "3",
            "--workers",
            "4",
            "--sync",
            "ssp:2",
            "--server-sync",
            "1=bsp",
            "--placement",
            "skewed:1",
            "--aggregate",
            "--server-bandwidth",
            "0=12.5,2=0.125",
            "--server-interference",
            "1=2.5",
            "--straggler-at",
            "1.25",
            "--balance",
            "psld",
            "--balance-compress",
            "bf16",
            "--max-servers",
            "6",
            "--min-servers",
            "2",
        ])
        .unwrap();
        let flags = original.to_flags();
        let again = parse(&flags.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        assert_eq!(again.to_flags(), flags);
        assert_eq!(format!("{:?}", again.job_config().unwrap()), format!("{:?}", original.job_config().unwrap()));
        let c = again.job_config().unwrap();
        assert_eq!((c.balance, c.max_servers, c.min_servers), (BalanceMode::Psld, 6, 2));
        assert_eq!(c.balance_compress, Some(Dtype::Bf16));
        assert_eq!(c.placement, PlacementKind::Skewed(1));
        assert_eq!(c.inject.len(), 3);

        // Defaults round-trip too (max and min stay "= --servers").
        let defaults = parse(&[]).unwrap();
        let again = parse(&defaults.to_flags().iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        assert_eq!(again.to_flags(), defaults.to_flags());
        assert_eq!((again.max_servers, again.min_servers), (None, None));
    }

    #[derive(Parser, Debug)]
    struct DataCli {
        #[command(flatten)]
        data: DataArgs,
    }

    fn data(flags: &[&str]) -> Result<DataArgs, clap::Error> {
        DataCli::try_parse_from(std::iter::once("elasticps").chain(flags.iter().copied())).map(|c| c.data)
    }

    #[test]
    fn worker_jitter_parses_round_trips_and_refuses_bad_values() {
        let d = data(&["--worker-jitter", "0.1:80", "--worker-delay", "0,4:50:10", "--data-seed", "3"]).unwrap();
        assert_eq!(d.worker_jitter, Some(Jitter { p: 0.1, ms: 80.0 }));
        let flags = d.to_flags();
        let again = data(&flags.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        assert_eq!((again.worker_jitter, again.worker_delay.clone()), (d.worker_jitter, d.worker_delay.clone()));
        assert_eq!(again.to_flags(), flags);
        assert_eq!(data(&[]).unwrap().worker_jitter, None);
        for bad in ["0.1", "1.5:80", "-0.1:80", "0.1:-1", "p:80", "0.1:inf"] {
            let e = data(&[&format!("--worker-jitter={bad}")]).unwrap_err().to_string();
            assert!(e.contains("expected P:MS"), "{bad}: {e}");
        }
        // A worker's draws: --worker-delay only on its ranks, the jitter on every rank,
        // the same for the same rank and seed.
        let j = Jitter { p: 0.1, ms: 80.0 };
        let (mut r0, mut r1) = (d.delays(0).unwrap(), d.delays(1).unwrap());
        let mut r1_again = d.delays(1).unwrap();
        let mut delayed = 0.0;
        for t in 0..100 {
            let (a, b) = (r0.next(t), r1.next(t));
            assert_eq!(b, r1_again.next(t));
            assert_eq!(b.delay_ms, j.delay_ms(3, 1, t));
            delayed += a.delay_ms - j.delay_ms(3, 0, t);
        }
        assert!((3000.0..7000.0).contains(&delayed), "rank 0's --worker-delay: {delayed} ms over 100 iterations");
    }

    #[test]
    fn the_default_data_is_the_command_lines_without_flags() {
        assert_eq!(DataArgs::default(), data(&[]).unwrap());
        assert_eq!(JobArgs::default(), parse(&[]).unwrap());
    }

    /// A spec built from struct fields (as the benchmarks build their jobs) comes back
    /// equal from the flags it renders.
    #[test]
    fn typed_specs_round_trip_through_their_flags() {
        let job = JobArgs {
            servers: 4,
            workers: 8,
            sync: "pssp:3:0.5".parse().unwrap(),
            server_sync: vec![(1, SyncPolicy::Bsp)],
            optimizer: "sgd".parse().unwrap(),
            lr: 0.01,
            aggregate: true,
            placement: PlacementKind::Skewed(1),
            block_bytes: 1 << 20,
            seed: 3,
            server_bandwidth: vec![(0, 200.0), (1, 50.0)],
            server_interference: vec![(1, 32.0)],
            straggler_at: 8.5,
            balance: BalanceMode::Psld,
            balance_compress: None,
            max_servers: Some(5),
            min_servers: Some(4),
            checkpoint_dir: Some("ckpt".into()),
            checkpoint_every: 10,
            resume: Some("old".into()),
            rejoin_wait_s: 1.5,
            replicas: 2,
            state_dir: Some("state".into()),
        };
        let again = parse(&job.to_flags().iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        assert_eq!(again, job);
        let d = DataArgs {
            model: "synthetic:resnet56".parse().unwrap(),
            compute_ms: 12.5,
            worker_delay: Some("0,4:50:10".parse().unwrap()),
            worker_jitter: Some(Jitter { p: 0.2, ms: 150.0 }),
            dataset: "fashion-mnist".parse().unwrap(),
            data_dir: Some("data".into()),
            batch_size: 16,
            epochs: 2,
            iterations: Some(30),
            eval_every: 20,
            data_seed: 9,
            request_timeout_s: 60,
            no_fuse: true,
            wire_dtype: Dtype::Bf16,
            compress: Some("topk:0.01".parse().unwrap()),
        };
        assert_eq!(data(&d.to_flags().iter().map(String::as_str).collect::<Vec<_>>()).unwrap(), d);
        let defaults = DataArgs::default();
        assert_eq!(data(&defaults.to_flags().iter().map(String::as_str).collect::<Vec<_>>()).unwrap(), defaults);
    }
}
