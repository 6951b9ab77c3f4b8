//! Replicas against real processes (`--replicas 2`): a server killed with kill -9 in the
//! middle of training (the primary of some blocks, the backup of others) costs no
//! acknowledged update, under bsp and ssp; the scheduler reports the failover.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use elasticps_core::model::{Init, TensorSpec};
use elasticps_runtime::client::{Client, ClientOptions};

use crate::common;

const WORKERS: u32 = 2;
const CLOCKS: u32 = 60;
/// The clock both workers reach before the server is killed.
const KILL_AT: u32 = 15;
const LEN: usize = 40;

fn model() -> Vec<TensorSpec> {
    vec![
        TensorSpec { name: "a".into(), shape: vec![LEN], init: Init::Zeros },
        TensorSpec { name: "b".into(), shape: vec![3], init: Init::Zeros },
    ]
}

/// Worker `rank`'s gradient at clock `t`: small integers, so every sum is exact in f32
/// and a lost or doubled push shows in the final values.
fn gradient(rank: u32, t: u32, len: usize) -> Vec<f32> {
    (0..len).map(|i| ((rank * 7 + t * 3 + i as u32) % 9) as f32 - 4.0).collect()
}

/// SGD with lr 1 from zeros: minus the sum of every gradient of every worker.
fn expected(len: usize) -> Vec<f32> {
    let mut v = vec![0.0f32; len];
    for rank in 0..WORKERS {
        for t in 0..CLOCKS {
            for (x, g) in v.iter_mut().zip(gradient(rank, t, len)) {
                *x -= g;
            }
        }
    }
    v
}

/// Three servers with `--replicas 2` under `sync`; kill -9 server `victim` once both
/// workers passed clock [`KILL_AT`]; every worker must run every clock and end with the
/// exact parameters.
fn a_killed_server_loses_nothing(sync: &str, victim: usize) {
    let args = [
        "--servers",
        "3",
        "--workers",
        "2",
        "--sync",
        sync,
        "--optimizer",
        "sgd",
        "--lr",
        "1",
        "--block-bytes",
        "16",
        "--replicas",
        "2",
    ];
    let (mut sched, addr) = common::start_scheduler(&args);
    let mut servers: Vec<common::Proc> = (0..3).map(|_| common::start_server(&addr, &[])).collect();
    let rt = common::tokio_rt();
    let passed = Arc::new(AtomicU32::new(0));
    let finals = rt.block_on(async {
        let workers: Vec<_> = (0..WORKERS)
            .map(|_| {
                let (addr, passed) = (addr.clone(), passed.clone());
                tokio::spawn(async move {
                    let mut c = Client::connect(ClientOptions::new(addr)).await.expect("connect");
                    c.register_model(model()).await.expect("register");
                    let mut params = c.zeros();
                    let rank = c.rank();
                    c.pull(0, &mut params).await.expect("first pull");
                    for t in 0..CLOCKS {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        let grads = vec![gradient(rank, t, LEN), gradient(rank, t, 3)];
                        c.push_pull(t, &grads, &mut params)
                            .await
                            .unwrap_or_else(|e| panic!("worker {rank}, clock {t}: {e}"));
                        if t == KILL_AT {
                            passed.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    // Every push of every worker is in: the values at the last clock.
                    c.barrier().await.expect("barrier");
                    c.pull(CLOCKS, &mut params).await.expect("last pull");
                    c.finish().await.expect("finish");
                    params
                })
            })
            .collect();
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while passed.load(Ordering::SeqCst) < WORKERS && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(passed.load(Ordering::SeqCst), WORKERS, "the workers did not reach clock {KILL_AT} in 60 s");
        servers[victim].kill();
        common::join_workers(workers).await
    });
    for params in &finals {
        assert_eq!(params[0], expected(LEN), "tensor a under {sync}: every acknowledged push, once");
        assert_eq!(params[1], expected(3), "tensor b under {sync}");
    }
    sched.assert_success(common::EXIT_TIMEOUT);
    let log = sched.log();
    assert!(log.contains("server lost: its blocks fail over to their backups"), "{}", sched.log_tail(30));
    for (i, s) in servers.iter_mut().enumerate().filter(|(i, _)| *i != victim) {
        assert!(s.wait_success(common::EXIT_TIMEOUT), "server {i} failed\n{}", s.log_tail(20));
    }
}

#[test]
fn a_server_killed_under_bsp_with_two_replicas_loses_no_acknowledged_push() {
    a_killed_server_loses_nothing("bsp", 1);
}

#[test]
fn a_server_killed_under_ssp_with_two_replicas_loses_no_acknowledged_push() {
    a_killed_server_loses_nothing("ssp:2", 0);
}
