//! What the tests of this binary share: an in-process cluster.

use std::time::Duration;

use elasticps_core::block::ShardConfig;
use elasticps_core::optimizer::{OptimizerConfig, OptimizerKind};
use elasticps_core::placement::PlacementKind;
use elasticps_core::sync::SyncPolicy;
use elasticps_runtime::scheduler::{self, JobConfig, SchedulerOptions};
use elasticps_runtime::server::{self, ServerOptions};
use elasticps_wire::Codec;

/// A job of two servers (SGD, lr 1, bsp, `workers` workers, the clock's pushes summed
/// into one step when `aggregate`, 16-byte blocks placed round robin).
pub fn job(workers: u32, aggregate: bool) -> JobConfig {
    JobConfig {
        servers: 2,
        workers,
        block_bytes: 16,
        placement: PlacementKind::RoundRobin,
        shard: ShardConfig {
            sync: SyncPolicy::Bsp,
            optimizer: OptimizerConfig { kind: OptimizerKind::Sgd, lr: 1.0, aggregate, weight_decay: 0.0 },
            workers,
        },
        seed: 1,
        server_sync: Vec::new(),
        inject: Vec::new(),
        balance: Default::default(),
        balance_compress: None,
        max_servers: 2,
        min_servers: 2,
        checkpoint: None,
        rejoin_wait_us: 0,
        replicas: 1,
    }
}

/// An in-process scheduler of [`job`]'s cluster and two servers; the scheduler's address
/// and task.
pub async fn cluster(
    workers: u32,
    aggregate: bool,
) -> (String, tokio::task::JoinHandle<elasticps_runtime::Result<String>>) {
    start(job(workers, aggregate)).await
}

/// An in-process scheduler of `job` and its servers (as many as `job.servers`); the
/// scheduler's address and task.
pub async fn start(job: JobConfig) -> (String, tokio::task::JoinHandle<elasticps_runtime::Result<String>>) {
    let codec = Codec::new(b"", elasticps_wire::DEFAULT_MAX_PAYLOAD);
    let servers = job.servers;
    let (tx, rx) = tokio::sync::oneshot::channel();
    let sched_opts = SchedulerOptions {
        listen: "127.0.0.1:0".into(),
        job,
        codec: codec.clone(),
        frame_timeout: elasticps_runtime::conn::FRAME_STALL_TIMEOUT,
        join_timeout: Duration::from_secs(30),
        metrics: None,
        state_dir: None,
        hosts: None,
        relay: None,
    };
    let scheduler = tokio::spawn(scheduler::run(sched_opts, move |addr| {
        let _ = tx.send(addr);
    }));
    let addr = rx.await.unwrap().to_string();
    for _ in 0..servers {
        let opts = ServerOptions {
            scheduler: addr.clone(),
            listen: "127.0.0.1:0".into(),
            advertise: None,
            codec: codec.clone(),
            frame_timeout: elasticps_runtime::conn::FRAME_STALL_TIMEOUT,
            trace: None,
            metrics: None,
            scheduler_retry: Duration::ZERO,
            max_clock_lead: server::MAX_CLOCK_LEAD,
        };
        tokio::spawn(server::run(opts));
    }
    (addr, scheduler)
}
