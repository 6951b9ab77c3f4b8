//! Live migration, proven against real processes: workers push known integer-valued
//! updates while blocks migrate continuously back and forth between servers, and every
//! final parameter value is exact (no update lost, none applied twice); the same while
//! the sync policy holds pulls at the old owner.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use elasticps_core::model::TensorSpec;
use elasticps_runtime::session::SchedLink;
use elasticps_wire::{Codec, Control, Message, ScaleRequest};

use crate::common::cluster::{self, Cluster, JobSpec};
use crate::common::{self, models};

const WORKERS: u32 = 2;
const NO_LAUNCHER: &[&str] = &["--launcher", "none"];
/// No launcher, and an operator may remove servers down to 1 (`--min-servers` is
/// `--servers` by default).
const REMOVABLE: &[&str] = &["--launcher", "none", "--min-servers", "1"];
const LEN: usize = 40;

fn model() -> Vec<TensorSpec> {
    models::a_and_b(LEN)
}

/// Worker `rank`'s gradient at any clock: element i of every tensor gets -(rank + 1) * (i % 5 + 1).
/// With sgd and lr 1, after `t` clocks of every worker element i is t * 3 * (i % 5 + 1)
/// (sum over ranks 0 and 1 of rank + 1), an exact integer in f32.
fn gradient(rank: u32, _t: u32, i: usize) -> f32 {
    -((rank + 1) as f32) * ((i % 5) + 1) as f32
}

fn expected(t: u32, len: usize) -> Vec<f32> {
    (0..len).map(|i| (t * 3) as f32 * ((i % 5) + 1) as f32).collect()
}

/// Starts a scheduler and `servers` servers; blocks of 16 bytes (4 values), placed by
/// range (every server holds several blocks).
fn cluster(sync: &str, servers: u32, extra: &[&str]) -> Cluster {
    JobSpec::exact(servers, WORKERS, sync).with(&["--placement", "range"]).with(extra).start()
}

/// Asks the scheduler to move blocks round and round between `servers` servers until
/// `stop` is set or `max_moves` were requested; returns how many were accepted.
async fn keep_moving(addr: String, servers: u32, blocks: u32, stop: Arc<AtomicBool>) -> u32 {
    let peer = operator(&addr).await;
    let mut accepted = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut i = 0u32;
    while !stop.load(Ordering::Relaxed) && Instant::now() < deadline && i < 400 {
        let block = (i * 7) % blocks;
        // Cycle every block through every server: back and forth, continuously.
        let to = (block + 1 + i / blocks) % servers;
        i += 1;
        let req = Control::Scale(ScaleRequest::MoveBlock { block, to });
        match peer.call(req.into(), Duration::from_secs(10), || "the scheduler to queue a move".into()).await {
            Ok(Message::Control(Control::Ok)) => accepted += 1,
            Ok(other) => panic!("unexpected reply to MoveBlock: {other:?}"),
            // Already there, or the job just ended.
            Err(_) => {}
        }
        tokio::time::sleep(Duration::from_millis(15)).await;
    }
    accepted
}

/// A connection to the scheduler, as `elasticps scale` opens one.
async fn operator(addr: &str) -> SchedLink {
    let codec = Codec::new(b"", elasticps_wire::DEFAULT_MAX_PAYLOAD);
    SchedLink::operator(addr, codec).await.expect("operator connects").0
}

/// Sends one scale request; panics unless the scheduler accepts it.
async fn scale(addr: &str, req: ScaleRequest) {
    let peer = operator(addr).await;
    match peer.call(Control::Scale(req).into(), Duration::from_secs(10), || "the scheduler to accept".into()).await {
        Ok(Message::Control(Control::Ok)) => {}
        other => panic!("{req:?} refused: {other:?}"),
    }
}

/// What the operator does while the workers train: (scheduler address, stop flag) ->
/// number of requests accepted.
type Operator = fn(String, Arc<AtomicBool>) -> futures::future::BoxFuture<'static, u32>;

/// Moves every block round and round between 3 servers.
fn moving(addr: String, stop: Arc<AtomicBool>) -> futures::future::BoxFuture<'static, u32> {
    Box::pin(keep_moving(addr, 3, (LEN / 4 + 1) as u32, stop))
}

/// Runs `clocks` clocks on each worker (worker 1 sleeping `straggle` per clock, worker 0
/// `pace`) on `servers` servers while `op` acts; checks every value exactly; returns
/// (requests accepted, the scheduler and the servers).
fn run_while(
    sync: &str,
    (servers, extra): (u32, &[&str]),
    clocks: u32,
    (pace, straggle): (Duration, Duration),
    op: Operator,
) -> (u32, Cluster) {
    // A pull at clocks + s sees every push of clocks < clocks under ssp:s (s = 0: bsp).
    let staleness: u32 = sync.strip_prefix("ssp:").map_or(0, |s| s.parse().expect("ssp:S"));
    let job = cluster(sync, servers, extra);
    let addr = job.addr.clone();
    let rt = common::tokio_rt();
    let moves = rt.block_on(async {
        let stop = Arc::new(AtomicBool::new(false));
        let workers = cluster::spawn_workers(WORKERS, &addr, &model(), move |mut c| async move {
            let rank = c.rank();
            let grads = models::gradients(&model(), gradient, rank, 0);
            let mut params = cluster::pulled(&mut c, 0).await;
            for t in 0..clocks {
                tokio::time::sleep(if rank == 1 { straggle } else { pace }).await;
                c.push_pull(t, &grads, &mut params).await.unwrap_or_else(|e| panic!("clock {t}: {e}"));
            }
            // Sees every push of every worker, once the other worker is done too.
            c.pull(clocks + staleness, &mut params).await.expect("final pull");
            c.finish().await.expect("finish");
            params
        });
        // Moves start once the model is placed (the first worker's register_model).
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mover = tokio::spawn(op(addr.clone(), stop.clone()));
        let results = common::join_workers(workers).await;
        stop.store(true, Ordering::Relaxed);
        let moves =
            tokio::time::timeout(Duration::from_secs(30), mover).await.expect("mover timed out").expect("mover");
        for params in &results {
            assert_eq!(params[0], expected(clocks, LEN), "tensor a after {clocks} clocks");
            assert_eq!(params[1], expected(clocks, 3), "tensor b after {clocks} clocks");
        }
        moves
    });
    (moves, job)
}

/// The scheduler's balance log and the servers' final counters, once the job ended.
fn collect(mut job: Cluster) -> (serde_json::Value, u64) {
    job.assert_success();
    let balance =
        job.sched.events_named("balance").first().map(|v| (*v).clone()).expect("the scheduler printed its balance log");
    let mut pushes = 0;
    for s in &job.servers {
        let stats = s.server_stats();
        pushes += stats["totals"]["pushes"].as_u64().expect("pushes");
    }
    (balance, pushes)
}

#[test]
fn every_update_is_applied_exactly_once_while_blocks_migrate_back_and_forth() {
    const CLOCKS: u32 = 300;
    let pace = Duration::from_millis(5);
    let (moves, job) = run_while("ssp:2", (3, NO_LAUNCHER), CLOCKS, (pace, pace), moving);
    let (balance, pushes) = collect(job);
    let migrations = balance["migrations"].as_array().expect("migrations");
    let done = migrations.iter().filter(|m| m["error"].is_null()).count();
    assert!(moves >= 20, "the operator's moves were accepted ({moves})");
    assert!(done >= 20, "blocks really migrated during training: {done} migrations\n{balance}");
    // Every push applied once on exactly one server: W workers x clocks x blocks.
    let blocks = (LEN / 4 + 1) as u64;
    assert_eq!(pushes, u64::from(WORKERS) * u64::from(CLOCKS) * blocks, "pushes applied over all servers");
}

#[test]
fn pulls_held_by_ssp_at_the_old_owner_are_answered_by_the_new_owner() {
    const CLOCKS: u32 = 40;
    // bsp with a straggler: worker 0's pulls wait at the servers most of the time.
    let straggle = (Duration::ZERO, Duration::from_millis(40));
    let (_moves, job) = run_while("bsp", (3, NO_LAUNCHER), CLOCKS, straggle, moving);
    let (balance, pushes) = collect(job);
    let migrations = balance["migrations"].as_array().expect("migrations");
    let held: u64 = migrations.iter().filter_map(|m| m["held"].as_u64()).sum();
    assert!(migrations.len() >= 10, "blocks migrated: {}", migrations.len());
    assert!(held > 0, "some migrations froze a block with pulls held there\n{balance}");
    let blocks = (LEN / 4 + 1) as u64;
    assert_eq!(pushes, u64::from(WORKERS) * u64::from(CLOCKS) * blocks);
}

#[test]
fn a_removed_server_drains_first_and_loses_nothing() {
    const CLOCKS: u32 = 150;
    fn remove(addr: String, _stop: Arc<AtomicBool>) -> futures::future::BoxFuture<'static, u32> {
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            scale(&addr, ScaleRequest::RemoveServer(1)).await;
            1
        })
    }
    let pace = Duration::from_millis(5);
    let (_, job) = run_while("ssp:1", (3, REMOVABLE), CLOCKS, (pace, pace), remove);
    // Server 1 (the second to register) stopped by itself, cleanly, before the others.
    let (balance, pushes) = collect(job);
    let actions: Vec<&str> =
        balance["scaling"].as_array().expect("scaling").iter().filter_map(|e| e["action"].as_str()).collect();
    assert_eq!(actions, ["scale-in", "removed"], "{balance}");
    // Range placement of 11 blocks on 3 servers gives server 1 blocks 4..=7: each leaves once.
    let mut moved_off_1: Vec<u64> = balance["migrations"]
        .as_array()
        .expect("migrations")
        .iter()
        .filter(|m| m["from"] == 1 && m["error"].is_null())
        .filter_map(|m| m["block"].as_u64())
        .collect();
    moved_off_1.sort();
    assert_eq!(moved_off_1, [4, 5, 6, 7], "server 1's blocks were drained: {balance}");
    let blocks = (LEN / 4 + 1) as u64;
    assert_eq!(pushes, u64::from(WORKERS) * u64::from(CLOCKS) * blocks);
}

#[test]
fn workers_that_compute_long_between_rounds_find_the_blocks_of_a_removed_server() {
    // 150 ms of "compute" per clock: the drain happens while the workers compute, and
    // their next round must find the blocks at their new owners, exactly once.
    const CLOCKS: u32 = 14;
    fn remove(addr: String, _stop: Arc<AtomicBool>) -> futures::future::BoxFuture<'static, u32> {
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(400)).await;
            scale(&addr, ScaleRequest::RemoveServer(2)).await;
            1
        })
    }
    let pace = Duration::from_millis(150);
    let started = Instant::now();
    let (_, job) = run_while("bsp", (3, REMOVABLE), CLOCKS, (pace, pace), remove);
    let (balance, pushes) = collect(job);
    assert!(started.elapsed() < Duration::from_secs(30), "no worker waited for a timeout");
    let actions: Vec<&str> =
        balance["scaling"].as_array().expect("scaling").iter().filter_map(|e| e["action"].as_str()).collect();
    assert_eq!(actions, ["scale-in", "removed"], "{balance}");
    let blocks = (LEN / 4 + 1) as u64;
    assert_eq!(pushes, u64::from(WORKERS) * u64::from(CLOCKS) * blocks);
}

#[test]
fn an_added_server_is_started_by_the_launcher_and_receives_blocks() {
    const CLOCKS: u32 = 200;
    fn add(addr: String, _stop: Arc<AtomicBool>) -> futures::future::BoxFuture<'static, u32> {
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            scale(&addr, ScaleRequest::AddServer).await;
            1
        })
    }
    let dir = common::scratch_dir("scale-out");
    let logs = dir.display().to_string();
    let extra = ["--max-servers", "3", "--launcher", "local", "--log-dir", logs.as_str()];
    let pace = Duration::from_millis(5);
    let (_, job) = run_while("ssp:1", (2, &extra), CLOCKS, (pace, pace), add);
    let Cluster { mut sched, servers, .. } = job;
    sched.assert_success(common::EXIT_TIMEOUT);
    let balance = sched.events_named("balance").first().map(|v| (*v).clone()).expect("balance log");
    let actions: Vec<&str> =
        balance["scaling"].as_array().expect("scaling").iter().filter_map(|e| e["action"].as_str()).collect();
    assert_eq!(actions, ["scale-out", "joined"], "{balance}");
    let to_new = balance["migrations"].as_array().expect("migrations").iter().filter(|m| m["to"] == 2).count();
    assert!(to_new >= 2, "the new server received about a third of the blocks: {balance}");
    // The launched server's final counters reach the scheduler's event stream.
    let stats = sched.events_named("server_stats");
    assert!(stats.iter().any(|s| s["server_id"] == 2), "the new server reported its counters: {stats:?}");
    drop(servers);
}
