//! Replicas against real processes (`--replicas 2`): a server killed with kill -9 in the
//! middle of training (the primary of some blocks, the backup of others) costs no
//! acknowledged update, under bsp and ssp; the scheduler reports the failover.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use elasticps_core::model::TensorSpec;

use crate::common::cluster::{self, Cluster, JobSpec};
use crate::common::{self, models};

const WORKERS: u32 = 2;
const CLOCKS: u32 = 60;
/// The clock both workers reach before the server is killed.
const KILL_AT: u32 = 15;
const LEN: usize = 40;

fn model() -> Vec<TensorSpec> {
    models::a_and_b(LEN)
}

/// Worker `rank`'s gradient at clock `t`: small integers, so every sum is exact in f32
/// and a lost or doubled push shows in the final values.
fn gradient(rank: u32, t: u32, i: usize) -> f32 {
    ((rank * 7 + t * 3 + i as u32) % 9) as f32 - 4.0
}

/// SGD with lr 1 from zeros: minus the sum of every gradient of every worker.
fn expected(len: usize) -> Vec<f32> {
    models::sgd_from_zeros(gradient, WORKERS, CLOCKS, len)
}

/// Three servers with `--replicas 2` under `sync`; kill -9 server `victim` once both
/// workers passed clock [`KILL_AT`]; every worker must run every clock and end with the
/// exact parameters.
fn a_killed_server_loses_nothing(sync: &str, victim: usize) {
    let Cluster { mut sched, addr, mut servers } = JobSpec::exact(3, WORKERS, sync).with(&["--replicas", "2"]).start();
    let rt = common::tokio_rt();
    let passed = Arc::new(AtomicU32::new(0));
    let finals = rt.block_on(async {
        let on_kill_clock = passed.clone();
        let workers = cluster::spawn_workers(WORKERS, &addr, &model(), move |mut c| async move {
            let rank = c.rank();
            let mut params = cluster::pulled(&mut c, 0).await;
            for t in 0..CLOCKS {
                tokio::time::sleep(Duration::from_millis(10)).await;
                let grads = models::gradients(&model(), gradient, rank, t);
                c.push_pull(t, &grads, &mut params).await.unwrap_or_else(|e| panic!("worker {rank}, clock {t}: {e}"));
                if t == KILL_AT {
                    on_kill_clock.fetch_add(1, Ordering::SeqCst);
                }
            }
            // Every push of every worker is in: the values at the last clock.
            c.barrier().await.expect("barrier");
            c.pull(CLOCKS, &mut params).await.expect("last pull");
            c.finish().await.expect("finish");
            params
        });
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
