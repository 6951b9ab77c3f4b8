//! Live migration, proven against real processes: workers push known integer-valued
//! updates while blocks migrate continuously back and forth between servers, and every
//! final parameter value is exact (no update lost, none applied twice); the same while
//! the sync policy holds pulls at the old owner.

use std::time::{Duration, Instant};

use elasticps_core::model::{Init, TensorSpec};
use elasticps_runtime::client::{Client, ClientOptions};
use elasticps_runtime::peer::Peer;
use elasticps_wire::{Codec, Control, Message, ScaleRequest};

use crate::common::{self, Proc};

const WORKERS: u32 = 2;
const LEN: usize = 40;

fn model() -> Vec<TensorSpec> {
    vec![
        TensorSpec { name: "a".into(), shape: vec![LEN], init: Init::Zeros },
        TensorSpec { name: "b".into(), shape: vec![3], init: Init::Zeros },
    ]
}

/// Worker `rank`'s gradient at any clock: element i of every tensor gets -(rank + 1) * (i % 5 + 1).
/// With sgd and lr 1, after `t` clocks of every worker element i is t * 3 * (i % 5 + 1)
/// (sum over ranks 0 and 1 of rank + 1), an exact integer in f32.
fn gradient(rank: u32, len: usize) -> Vec<f32> {
    (0..len).map(|i| -((rank + 1) as f32) * ((i % 5) + 1) as f32).collect()
}

fn expected(t: u32, len: usize) -> Vec<f32> {
    (0..len).map(|i| (t * 3) as f32 * ((i % 5) + 1) as f32).collect()
}

/// Starts a scheduler and `servers` servers; blocks of 16 bytes (4 values), round robin.
fn cluster(sync: &str, servers: u32) -> (Proc, String, Vec<Proc>) {
    let servers_s = servers.to_string();
    let workers_s = WORKERS.to_string();
    let args = [
        "--servers",
        servers_s.as_str(),
        "--workers",
        workers_s.as_str(),
        "--sync",
        sync,
        "--optimizer",
        "sgd",
        "--lr",
        "1",
        "--block-bytes",
        "16",
        "--placement",
        "roundrobin",
        "--launcher",
        "none",
    ];
    let (sched, addr) = common::start_scheduler(&args);
    let procs = (0..servers).map(|_| common::start_server(&addr, &[])).collect();
    (sched, addr, procs)
}

/// Asks the scheduler to move blocks round and round between `servers` servers until
/// `stop` is set or `max_moves` were requested; returns how many were accepted.
async fn keep_moving(addr: String, servers: u32, blocks: u32, stop: std::sync::Arc<std::sync::atomic::AtomicBool>) -> u32 {
    let codec = Codec::new(b"", elasticps_wire::DEFAULT_MAX_PAYLOAD);
    let (peer, _notes) = Peer::connect(&addr, codec, "scheduler").await.expect("operator connects");
    let mut accepted = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut i = 0u32;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) && Instant::now() < deadline && i < 400 {
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

/// Runs `clocks` clocks on each worker (worker 1 sleeping `straggle` per clock) while
/// blocks move; checks every value exactly; returns (moves accepted, the scheduler).
fn run_while_migrating(sync: &str, clocks: u32, pace: Duration, straggle: Duration) -> (u32, Proc, Vec<Proc>) {
    // A pull at clocks + s sees every push of clocks < clocks under ssp:s (s = 0: bsp).
    let staleness: u32 = sync.strip_prefix("ssp:").map_or(0, |s| s.parse().expect("ssp:S"));
    let (sched, addr, servers) = cluster(sync, 3);
    let rt = common::tokio_rt();
    let blocks = (LEN / 4 + 1) as u32;
    let moves = rt.block_on(async {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let workers: Vec<_> = (0..WORKERS)
            .map(|_| {
                let addr = addr.clone();
                tokio::spawn(async move {
                    let mut c = Client::connect(ClientOptions::new(addr)).await.expect("connect");
                    c.register_model(model()).await.expect("register");
                    let mut params = c.zeros();
                    let rank = c.rank();
                    let grads = vec![gradient(rank, LEN), gradient(rank, 3)];
                    c.pull(0, &mut params).await.expect("pull 0");
                    for t in 0..clocks {
                        tokio::time::sleep(if rank == 1 { straggle } else { pace }).await;
                        c.push_pull(t, &grads, &mut params).await.unwrap_or_else(|e| panic!("clock {t}: {e}"));
                    }
                    // Sees every push of every worker, once the other worker is done too.
                    c.pull(clocks + staleness, &mut params).await.expect("final pull");
                    c.finish().await.expect("finish");
                    params
                })
            })
            .collect();
        // Moves start once the model is placed (the first worker's register_model).
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mover = tokio::spawn(keep_moving(addr.clone(), 3, blocks, stop.clone()));
        let mut results = Vec::new();
        for w in workers {
            results.push(tokio::time::timeout(Duration::from_secs(120), w).await.expect("worker timed out").expect("worker panicked"));
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let moves = tokio::time::timeout(Duration::from_secs(30), mover).await.expect("mover timed out").expect("mover");
        for params in &results {
            assert_eq!(params[0], expected(clocks, LEN), "tensor a after {clocks} clocks");
            assert_eq!(params[1], expected(clocks, 3), "tensor b after {clocks} clocks");
        }
        moves
    });
    (moves, sched, servers)
}

/// The scheduler's balance log and the servers' final counters, once the job ended.
fn collect(mut sched: Proc, mut servers: Vec<Proc>) -> (serde_json::Value, u64) {
    sched.assert_success(common::EXIT_TIMEOUT);
    let balance = sched.events_named("balance").first().map(|v| (*v).clone()).expect("the scheduler printed its balance log");
    let mut pushes = 0;
    for s in &mut servers {
        s.assert_success(common::EXIT_TIMEOUT);
        let stats = s.events_named("server_stats");
        let stats = stats.first().unwrap_or_else(|| panic!("{} printed no stats", s.name));
        pushes += stats["totals"]["pushes"].as_u64().expect("pushes");
    }
    (balance, pushes)
}

#[test]
fn every_update_is_applied_exactly_once_while_blocks_migrate_back_and_forth() {
    const CLOCKS: u32 = 300;
    let pace = Duration::from_millis(5);
    let (moves, sched, servers) = run_while_migrating("ssp:2", CLOCKS, pace, pace);
    let (balance, pushes) = collect(sched, servers);
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
    let (_moves, sched, servers) = run_while_migrating("bsp", CLOCKS, Duration::ZERO, Duration::from_millis(40));
    let (balance, pushes) = collect(sched, servers);
    let migrations = balance["migrations"].as_array().expect("migrations");
    let held: u64 = migrations.iter().filter_map(|m| m["held"].as_u64()).sum();
    assert!(migrations.len() >= 10, "blocks migrated: {}", migrations.len());
    assert!(held > 0, "some migrations froze a block with pulls held there\n{balance}");
    let blocks = (LEN / 4 + 1) as u64;
    assert_eq!(pushes, u64::from(WORKERS) * u64::from(CLOCKS) * blocks);
}
