//! Your own training loop on elasticps: a linear model fitted by two workers through a
//! parameter server cluster.
//!
//! For a self-contained demo this starts the scheduler and two servers inside the same
//! process (on 127.0.0.1, free ports); in production they are separate processes
//! (`elasticps scheduler`, `elasticps server`) and only the worker part below is yours.
//!
//! Run: `cargo run -p elasticps-runtime --example custom_loop`

use std::time::Duration;

use elasticps_core::block::ShardConfig;
use elasticps_core::model::{Init, TensorSpec};
use elasticps_core::optimizer::{OptimizerConfig, OptimizerKind};
use elasticps_core::placement::PlacementKind;
use elasticps_core::sync::SyncPolicy;
use elasticps_runtime::client::{Client, ClientOptions};
use elasticps_runtime::scheduler::{self, JobConfig, SchedulerOptions};
use elasticps_runtime::server::{self, ServerOptions};
use elasticps_wire::Codec;

const WORKERS: u32 = 2;
const DIM: usize = 8;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // --- the cluster (normally: separate processes on separate hosts) ---
    let codec = Codec::new(b"", elasticps_wire::DEFAULT_MAX_PAYLOAD);
    let job = JobConfig {
        servers: 2,
        workers: WORKERS,
        block_bytes: 16, // small blocks so the model spreads over both servers
        placement: PlacementKind::RoundRobin,
        shard: ShardConfig {
            sync: SyncPolicy::Ssp(1),
            optimizer: OptimizerConfig { kind: OptimizerKind::Sgd, lr: 0.1, aggregate: false, weight_decay: 0.0 },
            workers: WORKERS,
        },
        seed: 1,
        server_sync: Vec::new(), // every server runs the job's policy
        inject: Vec::new(),
        balance: Default::default(),
        balance_compress: None, // psld never narrows a block's wire dtype (--balance-compress)
        max_servers: 2,
        min_servers: 2,
        checkpoint: None,  // no checkpoints (--checkpoint-dir)
        rejoin_wait_us: 0, // a lost worker is not waited for
        replicas: 1,       // no backup copies
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    let sched_opts = SchedulerOptions {
        listen: "127.0.0.1:0".into(),
        job,
        codec: codec.clone(),
        frame_timeout: elasticps_runtime::conn::FRAME_STALL_TIMEOUT,
        join_timeout: Duration::from_secs(30),
        metrics: None,
        state_dir: None, // no recoverable state (--state-dir)
        hosts: None,     // one host: no agents (elasticps launch --nnodes)
        relay: None,
    };
    let scheduler = tokio::spawn(scheduler::run(sched_opts, move |addr| {
        let _ = tx.send(addr);
    }));
    let addr = rx.await?.to_string();
    for _ in 0..2 {
        let opts = ServerOptions {
            scheduler: addr.clone(),
            listen: "127.0.0.1:0".into(),
            advertise: None,
            codec: codec.clone(),
            frame_timeout: elasticps_runtime::conn::FRAME_STALL_TIMEOUT,
            trace: None,
            metrics: None,
            scheduler_retry: Duration::ZERO, // the scheduler is in this process: no redial
            max_clock_lead: server::MAX_CLOCK_LEAD,
        };
        tokio::spawn(server::run(opts));
    }

    // --- the workers: this is the part a user writes ---
    let workers: Vec<_> = (0..WORKERS).map(|_| tokio::spawn(worker(addr.clone()))).collect();
    for w in workers {
        let loss = w.await??;
        println!("final loss {loss:.6}");
    }
    println!("scheduler: {}", scheduler.await??);
    Ok(())
}

/// Fits y = 2 * x_0 - x_1 + 0.5 on this worker's share of a synthetic data set.
async fn worker(scheduler: String) -> Result<f32, elasticps_runtime::RuntimeError> {
    let mut client = Client::connect(ClientOptions::new(scheduler)).await?;
    let tensors = vec![
        TensorSpec { name: "w".into(), shape: vec![DIM], init: Init::Zeros },
        TensorSpec { name: "b".into(), shape: vec![1], init: Init::Zeros },
    ];
    client.register_model(tensors).await?;
    let rank = client.rank() as usize;
    let xs: Vec<[f32; DIM]> =
        (0..64).map(|i| std::array::from_fn(|j| (((i * 2 + rank) * 31 + j * 17) % 13) as f32 / 6.5 - 1.0)).collect();
    let target = |x: &[f32; DIM]| 2.0 * x[0] - x[1] + 0.5;
    let mut params = client.zeros();
    let mut loss = 0.0;
    for t in 0..200 {
        client.pull(t, &mut params).await?;
        let (mut gw, mut gb) = (vec![0f32; DIM], 0f32);
        loss = 0.0;
        for x in &xs {
            let err = x.iter().zip(&params[0]).map(|(a, w)| a * w).sum::<f32>() + params[1][0] - target(x);
            loss += err * err / xs.len() as f32;
            gw.iter_mut().zip(x).for_each(|(g, a)| *g += err * a / xs.len() as f32);
            gb += err / xs.len() as f32;
        }
        client.push(t, &[gw, vec![gb]]).await?;
    }
    println!("worker {rank}: w[0..2] = {:?}, b = {:.3}", &params[0][..2], params[1][0]);
    client.finish().await?;
    Ok(loss)
}
