//! Scheduler recovery against real processes: a scheduler killed with SIGKILL mid-run and
//! started again on the same address with the same `--state-dir` recovers the job; the
//! servers and workers reattach, the workers keep iterating while it is down (data traffic
//! does not go through it), a barrier called while it is down is answered by the restarted
//! one, and the job ends with exactly the expected parameters.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use elasticps_core::model::TensorSpec;

use crate::common::cluster::{self, JobSpec};
use crate::common::{self, Proc, models};

const WORKERS: u32 = 2;
const CLOCKS: u32 = 80;
const LEN: usize = 24;
/// The clock at which the scheduler is killed.
const KILL_AT: u32 = 15;
/// The workers wait in a barrier before this clock: a scheduler call made while it is
/// down, retried on the restarted one.
const BARRIER_AT: u32 = 30;

fn model() -> Vec<TensorSpec> {
    models::zeros(&[("w", LEN)])
}

/// Worker `rank`'s gradient at clock `t`: small integers (exact in f32, summed in any
/// order), different per rank, clock and element, so a lost or doubled push shows.
fn gradient(rank: u32, t: u32, i: usize) -> f32 {
    ((rank + 1) * (t % 4 + 1)) as f32 * ((i % 3) + 1) as f32
}

/// The parameters after `CLOCKS` clocks of bsp, sgd with lr 1, no aggregation: every
/// push applied once, `w -= g`.
fn expected() -> Vec<f32> {
    models::sgd_from_zeros(gradient, WORKERS, CLOCKS, LEN)
}

fn start_scheduler(name: &str, addr: &str, state: &str) -> Proc {
    let args = JobSpec::exact(2, WORKERS, "bsp").with(&["--state-dir", state]).args();
    common::start_scheduler_at(name, addr, &common::refs(&args)).0
}

#[test]
fn a_scheduler_killed_and_restarted_with_its_state_dir_lets_the_job_complete_exactly() {
    let dir = common::scratch_dir("scheduler-restart");
    let state = dir.join("state");
    let s = state.to_str().unwrap();
    let addr = common::free_local_addr();
    let mut sched = start_scheduler("scheduler", &addr, s);
    let mut servers: Vec<Proc> = (0..2).map(|_| common::start_server(&addr, &[])).collect();
    let clocks: Arc<Vec<AtomicU32>> = Arc::new((0..WORKERS).map(|_| AtomicU32::new(0)).collect());

    let rt = common::tokio_rt();
    let progress = clocks.clone();
    let workers = rt.block_on(async {
        cluster::spawn_workers(WORKERS, &addr, &model(), move |mut c| async move {
            let rank = c.rank();
            let mut params = cluster::pulled(&mut c, 0).await;
            for t in 0..CLOCKS {
                if t == BARRIER_AT {
                    c.barrier().await.expect("a barrier across the scheduler's restart");
                }
                tokio::time::sleep(Duration::from_millis(40)).await;
                let grads = models::gradients(&model(), gradient, rank, t);
                c.push_pull(t, &grads, &mut params).await.unwrap_or_else(|e| panic!("clock {t}: {e}"));
                progress[rank as usize].store(t + 1, Ordering::SeqCst);
            }
            c.finish().await.expect("finish");
            params
        })
    });

    let slowest = || clocks.iter().map(|c| c.load(Ordering::SeqCst)).min().unwrap_or(0);
    let reached = common::poll_until(Duration::from_secs(60), || (slowest() >= KILL_AT).then_some(()));
    assert!(reached.is_some(), "the workers did not reach clock {KILL_AT} within 60 s\n{}", sched.log_tail(20));
    assert!(state.join("scheduler-state.json").exists(), "the scheduler saved its state");

    // kill -9: no Shutdown, no goodbye.
    sched.kill();
    let at_kill = slowest();
    std::thread::sleep(Duration::from_millis(1500));
    let while_down = slowest();
    assert!(
        while_down > at_kill + 5,
        "the workers kept iterating while the scheduler was down (clock {at_kill} at the kill, {while_down} 1.5 s later)"
    );
    assert!(while_down <= BARRIER_AT, "the barrier waits for the scheduler");

    let started = Instant::now();
    let mut restarted = start_scheduler("restarted scheduler", &addr, s);
    let finals = rt.block_on(common::join_workers(workers));
    let recovered_in = started.elapsed();
    for params in &finals {
        assert_eq!(params[0], expected(), "every push applied exactly once across the restart");
    }
    restarted.assert_success(common::EXIT_TIMEOUT);
    for s in &mut servers {
        s.assert_success(common::EXIT_TIMEOUT);
    }
    let log = restarted.log();
    assert!(log.contains("scheduler restarted from its saved state"), "{}", restarted.log_tail(30));
    assert!(log.contains("recovery complete"), "{}", restarted.log_tail(30));
    assert!(!state.join("scheduler-state.json").exists(), "a job that ended leaves no state to recover");
    eprintln!(
        "scheduler restart: killed at clock {at_kill}, {while_down} after 1.5 s down, job done {:.1} s after the restart",
        recovered_in.as_secs_f64()
    );
    let _ = std::fs::remove_dir_all(&dir);
}
