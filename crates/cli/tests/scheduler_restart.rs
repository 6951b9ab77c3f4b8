//! Scheduler recovery against real processes: a scheduler killed with SIGKILL mid-run and
//! started again on the same address with the same `--state-dir` recovers the job; the
//! servers and workers reattach, the workers keep iterating while it is down (data traffic
//! does not go through it), a barrier called while it is down is answered by the restarted
//! one, and the job ends with exactly the expected parameters. The same when it is killed
//! right after it asked the owner of a hot row block to split (issue 33).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use elasticps_core::model::{TableSpec, TensorSpec};
use elasticps_core::rows::{RowInit, SparseOptimizer};
use elasticps_runtime::client::{Client, ClientOptions};

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

/// A scheduler restarted on a state file that does not parse cannot recover the job: the
/// servers and workers redialling it hear why within seconds (not after their 60 s retry
/// window, saying only that it did not come back), and every process exits, failed,
/// naming the state file.
#[test]
fn a_scheduler_that_cannot_recover_tells_every_node_why_within_seconds() {
    let dir = common::scratch_dir("scheduler-unrecoverable");
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
                tokio::time::sleep(Duration::from_millis(40)).await;
                let grads = models::gradients(&model(), gradient, rank, t);
                if let Err(e) = c.push_pull(t, &grads, &mut params).await {
                    return e.to_string();
                }
                progress[rank as usize].store(t + 1, Ordering::SeqCst);
            }
            "every clock done: the job did not fail".to_string()
        })
    });
    let slowest = || clocks.iter().map(|c| c.load(Ordering::SeqCst)).min().unwrap_or(0);
    let reached = common::poll_until(Duration::from_secs(60), || (slowest() >= 5).then_some(()));
    assert!(reached.is_some(), "the workers did not reach clock 5 within 60 s\n{}", sched.log_tail(20));
    sched.kill();
    let file = state.join("scheduler-state.json");
    std::fs::write(&file, b"{ not json").unwrap();
    let started = Instant::now();
    let mut restarted = start_scheduler("restarted scheduler", &addr, s);
    let status = restarted.wait_exit(Duration::from_secs(60)).expect("the restarted scheduler exits within 60 s");
    assert!(!status.success(), "a scheduler that cannot recover fails\n{}", restarted.log_tail(20));
    assert!(restarted.log().contains("could not recover"), "{}", restarted.log_tail(20));
    for server in &mut servers {
        let status = server.wait_exit(Duration::from_secs(60)).expect("each server exits");
        assert!(!status.success(), "{}", server.log_tail(20));
        assert!(
            server.log().contains("could not recover the job") && server.log().contains("scheduler-state.json"),
            "the server says why, naming the state file\n{}",
            server.log_tail(20)
        );
    }
    let told_in = started.elapsed();
    for why in rt.block_on(common::join_workers(workers)) {
        assert!(why.contains("could not recover the job"), "each worker says why: {why}");
    }
    // Well within the nodes' 60 s retry window (the scheduler says so for 10 s).
    assert!(told_in < Duration::from_secs(50), "every node told and gone in {told_in:?}");
    assert_eq!(std::fs::read(&file).unwrap(), b"{ not json", "the state is left as it was, for the operator");
    let _ = std::fs::remove_dir_all(&dir);
}

// ---- killed in a split ----------------------------------------------------------------

/// Rows of the hot-row job's table, values per row, rows per block (8 blocks of 2 KiB).
const TABLE_ROWS: u64 = 512;
const DIM: usize = 8;
const ROWS_PER_BLOCK: u64 = 64;
/// Steps a hot-row worker takes at most (a bound: the test stops them well before).
const MAX_STEPS: u32 = 20_000;

/// The rows worker `rank` pushes at step `t`: rows 0 to 5 always (all in the first block,
/// three quarters of the rows pushed: psld splits it) and two others.
fn hot_ids(rank: u32, t: u32) -> Vec<u64> {
    let mut ids: Vec<u64> = (0..6).collect();
    for k in 0..2u64 {
        let x = (u64::from(rank) << 40 | u64::from(t) << 8 | k).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 33;
        ids.push(6 + x % (TABLE_ROWS - 6));
    }
    ids.sort_unstable();
    ids.dedup();
    ids
}

fn hot_scheduler(name: &str, addr: &str, state: &str) -> Proc {
    let block = (ROWS_PER_BLOCK * DIM as u64 * 4).to_string();
    let flags = ["--balance", "psld", "--min-servers", "2", "--max-servers", "2", "--state-dir", state];
    let args = JobSpec::exact(2, WORKERS, "asp").block_bytes(block.parse().unwrap()).with(&flags).args();
    common::start_scheduler_at(name, addr, &common::refs(&args)).0
}

/// A hot-row worker: pushes 1.0 to the rows of each step until `stop`; returns its client
/// (not finished) and how many times it pushed each row.
async fn hot_worker(addr: String, stop: Arc<AtomicBool>, steps: Arc<AtomicU32>) -> (Client, Vec<u32>, u32) {
    let mut c = Client::connect(ClientOptions::new(addr)).await.expect("connect");
    let table = TableSpec::new("emb", TABLE_ROWS, DIM as u32)
        .with_init(RowInit::Constant(0.0))
        .with_optimizer(SparseOptimizer::Sgd { lr: 1.0 });
    c.register_model_with_tables(Vec::new(), Vec::new(), vec![table]).await.expect("register the table");
    let (table, _) = c.table("emb").expect("the table in the layout");
    let rank = c.rank();
    let mut counts = vec![0u32; TABLE_ROWS as usize];
    let mut t = 0;
    while t < MAX_STEPS && !stop.load(Ordering::SeqCst) {
        let ids = hot_ids(rank, t);
        let mut out = vec![0.0f32; ids.len() * DIM];
        c.pull_rows(t, table, &ids, &mut out).await.unwrap_or_else(|e| panic!("pull_rows at step {t}: {e}"));
        let grads = vec![1.0f32; ids.len() * DIM];
        c.push_rows(t, table, &ids, &grads).await.unwrap_or_else(|e| panic!("push_rows at step {t}: {e}"));
        for id in &ids {
            counts[*id as usize] += 1;
        }
        t += 1;
        steps.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    (c, counts, t)
}

/// Issue 33: a scheduler SIGKILLed right after it logs `split starts` (the split saved,
/// its `SplitBlock` maybe sent, its `SplitDone` never heard) and started again on the same
/// `--state-dir` recovers the job: the workers go on over the split table and every row
/// ends holding exactly its pushes.
///
/// Whether the kill lands inside the split is a race the test cannot steer (the owner's
/// `SplitDone` may be heard and saved first): each run checks the job exact, and the
/// scenario is run again, up to 4 times, until one kill landed inside the split.
#[test]
fn a_scheduler_killed_right_after_split_starts_recovers_the_hot_row_job_exactly() {
    for attempt in 0..4 {
        if kill_in_a_split(attempt) {
            return;
        }
    }
    panic!("in 4 runs the scheduler was never killed inside the split");
}

/// One run of the scenario above, checked exact; true if the kill landed inside the split.
fn kill_in_a_split(attempt: u32) -> bool {
    let dir = common::scratch_dir(&format!("scheduler-restart-split-{attempt}"));
    let state = dir.join("state");
    let s = state.to_str().unwrap();
    let addr = common::free_local_addr();
    let mut sched = hot_scheduler("scheduler", &addr, s);
    let mut servers: Vec<Proc> = (0..2).map(|_| common::start_server(&addr, &[])).collect();
    let (stop, steps) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU32::new(0)));
    let rt = common::tokio_rt();
    let workers: Vec<_> =
        (0..WORKERS).map(|_| rt.spawn(hot_worker(addr.clone(), stop.clone(), steps.clone()))).collect();

    // Every millisecond, until the balancer asks the hot block's owner to split; then
    // without a pause until the owner says it split: the scheduler is killed before its
    // state on disk records the split done (its `SplitDone` unheard, or still being saved).
    let deadline = Instant::now() + Duration::from_secs(60);
    while !sched.log().contains("split starts") {
        assert!(Instant::now() < deadline, "no split within 60 s\n{}", sched.log_tail(30));
        std::thread::sleep(Duration::from_millis(1));
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while !servers.iter().any(|s| s.log().contains("row block split")) && Instant::now() < deadline {
        std::thread::yield_now();
    }
    sched.kill();
    let at_kill = steps.load(Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(1000));
    let mut restarted = hot_scheduler("restarted scheduler", &addr, s);
    let reached = common::poll_until(Duration::from_secs(60), || {
        (restarted.log().contains("recovery complete") && steps.load(Ordering::SeqCst) >= at_kill + 100).then_some(())
    });
    assert!(reached.is_some(), "the job did not go on after the restart\n{}", restarted.log_tail(30));
    stop.store(true, Ordering::SeqCst);

    let mut done = rt.block_on(common::join_workers(workers));
    let mut counts = vec![0u32; TABLE_ROWS as usize];
    for (_, c, _) in &done {
        for (all, n) in counts.iter_mut().zip(c) {
            *all += n;
        }
    }
    let (w0, _, clock) = &mut done[0];
    let (table, _) = w0.table("emb").expect("the table");
    let live = w0.layout().map_or(0, |l| l.partition.table_blocks(table).len());
    let rows: Vec<u64> = (0..TABLE_ROWS).collect();
    let mut values = vec![0.0f32; rows.len() * DIM];
    rt.block_on(w0.pull_rows(*clock, table, &rows, &mut values)).expect("pulling every row");
    for (row, v) in rows.iter().zip(values.chunks_exact(DIM)) {
        let want = -(counts[*row as usize] as f32);
        assert!(v.iter().all(|x| *x == want), "row {row} holds {v:?}, expected {want}: each push once");
    }
    for (c, _, _) in done {
        rt.block_on(c.finish()).expect("finish");
    }
    restarted.assert_success(common::EXIT_TIMEOUT);
    for s in &mut servers {
        s.assert_success(common::EXIT_TIMEOUT);
    }
    let log = restarted.log();
    assert!(log.contains("scheduler restarted from its saved state"), "{}", restarted.log_tail(30));
    let recorded = "the split in flight at the restart was done by its owner: recorded";
    if !log.contains(recorded) {
        eprintln!("run {attempt}: the scheduler was killed outside the split; again");
        let _ = std::fs::remove_dir_all(&dir);
        return false;
    }
    assert!(live > (TABLE_ROWS / ROWS_PER_BLOCK) as usize, "the table was split: {live} live blocks");
    eprintln!(
        "scheduler killed in a split: step {at_kill} at the kill, {} live blocks at the end, {}",
        live,
        log.lines().find(|l| l.contains("the split in flight")).unwrap_or_default()
    );
    let _ = std::fs::remove_dir_all(&dir);
    true
}
