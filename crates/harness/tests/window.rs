//! The request window never deadlocks (issue 33): whole jobs on the harness whose workers
//! run the real window ([`TrainingLoop::window`], 1 to 64 requests per server), with more
//! blocks per server than the window, while blocks move between servers and new servers
//! join at random moments. Each worker then learns of a move at its own moment (a
//! `Moved` that names the owner, a layout refresh), so the workers order one server's
//! blocks differently; with held pulls counting against the window, each worker's window
//! fills with push_pulls the sync policy holds for pushes the other worker has queued
//! behind its own full window, and the job stops until the request timeout.
//!
//! Every run must end with the job ok, every worker through every iteration with every
//! pull answered once, and every final parameter exact on its owner.

use std::cell::RefCell;
use std::rc::Rc;

use elasticps_core::block::ShardConfig;
use elasticps_core::model::{BlockId, Init, TensorSpec};
use elasticps_core::optimizer::{OptimizerConfig, OptimizerKind};
use elasticps_core::placement::PlacementKind;
use elasticps_core::sync::{Clock, SyncPolicy};
use elasticps_harness::{
    ClusterConfig, JobEnd, JobSetup, LostWhy, Outbox, Role, ServerModel, SimJob, Stage, TrainingLoop,
};
use elasticps_node::ConnId;
use elasticps_node::scheduler::JobConfig;
use elasticps_node::server::{Phase, Slot};
use elasticps_wire::{Control, Message, ScaleRequest};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

/// Values per block.
const BLOCK_LEN: usize = 4;
/// The request timeout of the workers: a deadlock fails the job after it, µs.
const TIMEOUT_US: u64 = 20_000_000;
/// Virtual time a run may take at most, µs.
const HORIZON_US: u64 = 200_000_000;
/// Deliveries a run may take at most.
const MAX_EVENTS: u64 = 3_000_000;

/// One random job with a window and the moves made under it.
#[derive(Clone, Debug)]
pub struct WindowCase {
    /// Seed of the network's jitter and the compute times.
    pub seed: u64,
    /// Servers at the start.
    pub servers: u32,
    /// Workers.
    pub workers: u32,
    /// Blocks of the model (one tensor).
    pub blocks: u32,
    /// Requests of a round in flight to one server at most.
    pub window: usize,
    /// Sync policy of every server.
    pub sync: SyncPolicy,
    /// Push and next pull as one push_pull.
    pub fuse: bool,
    /// Iterations per worker.
    pub iterations: u32,
    /// Compute time of an iteration: `base + (hash % spread)`, µs.
    pub compute_us: (u64, u64),
    /// Extra delay per message, uniform in `[0, jitter_us]`.
    pub jitter_us: u64,
    /// The operator's requests: (when, what).
    pub ops: Vec<(u64, ScaleRequest)>,
}

impl WindowCase {
    fn job(&self) -> JobConfig {
        JobConfig {
            servers: self.servers,
            workers: self.workers,
            block_bytes: BLOCK_LEN * 4,
            placement: PlacementKind::Range,
            shard: ShardConfig {
                sync: self.sync,
                optimizer: OptimizerConfig { kind: OptimizerKind::Sgd, lr: 1.0, aggregate: false, weight_decay: 0.0 },
                workers: self.workers,
            },
            server_sync: Vec::new(),
            seed: self.seed,
            inject: Vec::new(),
            balance: Default::default(),
            balance_compress: None,
            max_servers: self.servers + 2,
            min_servers: self.servers,
            checkpoint: None,
            rejoin_wait_us: 0,
            replicas: 1,
        }
    }

    /// The exact final value of every element of `block` (SGD, lr 1, zeros, integer
    /// gradients): minus the sum of every gradient.
    fn final_value(&self, block: BlockId) -> f32 {
        -(0..self.iterations).flat_map(|t| (0..self.workers).map(move |r| grad(r, t, block))).sum::<f32>()
    }

    /// Pull replies worker `rank` accepts: clock 0, then clock t + 1 after each iteration
    /// t but the last (rank 0 pulls after the last too), every block.
    fn pulls_of(&self, rank: u32) -> u64 {
        let rounds = if rank == 0 { self.iterations + 1 } else { self.iterations };
        u64::from(rounds) * u64::from(self.blocks)
    }
}

/// Integer gradients (some negative), so every final value is exact in f32.
fn grad(rank: u32, clock: Clock, block: BlockId) -> f32 {
    ((rank * 7 + clock * 3 + block * 5 + 1) % 9) as f32 - 4.0
}

fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// A TEST DRIVER: an operator that sends its scale requests at their times and counts
/// the `Ok`s.
struct Operator {
    plan: Vec<(u64, ScaleRequest)>,
    conn: Option<ConnId>,
    oks: Rc<RefCell<u32>>,
}

impl Role for Operator {
    fn on_start(&mut self, out: &mut Outbox<'_>) {
        self.conn = Some(out.connect(out.scheduler()));
        for (i, (at, _)) in self.plan.iter().enumerate() {
            out.wake_at(*at, i as u64);
        }
    }

    fn on_message(&mut self, _: &mut Outbox<'_>, _: ConnId, _: u64, msg: Message) {
        if matches!(msg, Message::Control(Control::Ok)) {
            *self.oks.borrow_mut() += 1;
        }
    }

    fn on_lost(&mut self, _: &mut Outbox<'_>, _: ConnId, _: LostWhy) {
        self.conn = None;
    }

    fn on_timer(&mut self, out: &mut Outbox<'_>, token: u64) {
        let Some(conn) = self.conn else { return };
        out.send(conn, token + 1, Control::Scale(self.plan[token as usize].1).into());
    }
}

/// Runs `case` to its end: the job, how it ended, the operator requests answered `Ok`.
pub fn run(case: &WindowCase) -> (SimJob, Option<JobEnd>, u32) {
    let mut setup =
        JobSetup::new(ClusterConfig { seed: case.seed, jitter_us: case.jitter_us, ..ClusterConfig::new(case.job()) });
    setup.server_model = ServerModel { apply_bps: 0, check_bound: true, ..ServerModel::default() };
    let tensors =
        vec![TensorSpec { name: "w".into(), shape: vec![case.blocks as usize * BLOCK_LEN], init: Init::Zeros }];
    let (iterations, seed, (base, spread), fuse, window) =
        (case.iterations, case.seed, case.compute_us, case.fuse, case.window);
    let mut sim = SimJob::new(setup, move |_| TrainingLoop {
        tensors: tensors.clone(),
        iterations,
        compute_us: Box::new(move |rank, t| base + mix(seed ^ (u64::from(rank) << 32) ^ u64::from(t)) % spread.max(1)),
        grad,
        timeout_us: TIMEOUT_US,
        fuse,
        window,
        zero_as_no_gradient: false,
        table: None,
    });
    let oks = Rc::new(RefCell::new(0));
    sim.add_driver(Box::new(Operator { plan: case.ops.clone(), conn: None, oks: oks.clone() }));
    let end = sim.run(HORIZON_US, MAX_EVENTS);
    let oks = *oks.borrow();
    (sim, end, oks)
}

/// Every property of a finished run; the first one broken, in words.
pub fn check(case: &WindowCase, sim: &SimJob, end: Option<&JobEnd>) -> Result<(), String> {
    let stages = || sim.workers().map(|(_, w)| (w.rank(), w.stage().clone())).collect::<Vec<_>>();
    let Some(end) = end else {
        return Err(format!("the job did not end: workers {:?}", stages()));
    };
    if !end.ok {
        return Err(format!("the job failed: {}; workers {:?}", end.reason, stages()));
    }
    for (_, w) in sim.workers() {
        let rank = w.rank().ok_or("a worker never registered")?;
        if *w.stage() != Stage::Done {
            return Err(format!("worker {rank} ended in {:?}", w.stage()));
        }
        let rec = w.record();
        if rec.iteration_ends_us.len() != case.iterations as usize || rec.pulls_answered != case.pulls_of(rank) {
            return Err(format!(
                "worker {rank} ran {} iterations and accepted {} pull replies, expected {} and {}",
                rec.iteration_ends_us.len(),
                rec.pulls_answered,
                case.iterations,
                case.pulls_of(rank)
            ));
        }
    }
    let placement = sim.cluster().scheduler().placement().ok_or("the scheduler placed no model")?;
    for b in 0..case.blocks {
        let owner = placement.owner(b).ok_or(format!("the placement has no block {b}"))?;
        let want = case.final_value(b);
        // The owner the placement names, or a copy whose handover crossed the job's end.
        let copies: Vec<(u32, bool, Vec<f32>)> = sim
            .servers()
            .filter_map(|(_, s)| s.server())
            .filter_map(|s| match s.slot(b) {
                Some(Slot::Owned(o)) => {
                    Some((s.id()?, matches!(o.phase, Phase::Arrived { .. }), o.block.values().to_vec()))
                }
                _ => None,
            })
            .collect();
        let exact = copies.iter().any(|(id, arrived, v)| (*id == owner || *arrived) && v.iter().all(|x| *x == want));
        if !exact {
            return Err(format!("block {b}: no exact copy ({want}) on its owner {owner}: {copies:?}"));
        }
    }
    Ok(())
}

/// A random job: more blocks per server than the window (or about as many), a policy
/// that holds pulls, operator moves and scale-outs while it trains.
pub fn window_case() -> impl Strategy<Value = WindowCase> {
    (
        (2u32..=3, 2u32..=3, prop_oneof![3 => 1usize..=4, 1 => 1usize..=64], 1u32..=3),
        prop_oneof![3 => Just(SyncPolicy::Bsp), 1 => Just(SyncPolicy::Ssp(1))],
        (any::<bool>(), 4u32..=10, 200u64..=1_000, 1u64..=2_000, 0u64..=60, any::<u64>()),
    )
        .prop_flat_map(
            |((servers, workers, window, fill), sync, (fuse, iterations, base, spread, jitter, seed))| {
                // Up to three windows' worth of blocks per server.
                let blocks = (servers * window as u32 * fill / 2).clamp(2, 400);
                let span = u64::from(iterations) * (base + spread / 2);
                let op = prop_oneof![
                    6 => (0..blocks, 0..servers + 2).prop_map(|(block, to)| ScaleRequest::MoveBlock { block, to }),
                    1 => Just(ScaleRequest::AddServer),
                ];
                // Training starts after about 0.5 ms (register, define, connect).
                prop::collection::vec((300..300 + span, op), 1..=24).prop_map(move |ops| WindowCase {
                    seed,
                    servers,
                    workers,
                    blocks,
                    window,
                    sync,
                    fuse,
                    iterations,
                    compute_us: (base, spread),
                    jitter_us: jitter,
                    ops,
                })
            },
        )
}

fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(256),
        max_shrink_iters: 300,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct("tests/window.proptest-regressions"))),
        ..ProptestConfig::default()
    })]

    /// Any window size, any number of blocks per server, moves and scale-outs at random
    /// moments: the job finishes exactly.
    #[test]
    fn the_window_never_deadlocks(c in window_case()) {
        let (sim, end, _) = run(&c);
        check(&c, &sim, end.as_ref()).map_err(TestCaseError::fail)?;
    }
}

/// The deadlock as the harness first showed it (issue 33's "worker 0 waits for server 4
/// to answer push_pull(clock 22)" in real processes): a scale-out and two moves under a
/// window of 1, three workers that learn of them at different moments. With held pulls
/// counting against the window every worker timed out waiting for server 2 to answer
/// push_pull(clock 1) of block 2.
#[test]
fn a_scale_out_under_a_window_of_one_finishes() {
    let c = WindowCase {
        seed: 17676970001311086339,
        servers: 2,
        workers: 3,
        blocks: 24,
        window: 1,
        sync: SyncPolicy::Bsp,
        fuse: true,
        iterations: 10,
        compute_us: (294, 814),
        jitter_us: 45,
        ops: vec![
            (4911, ScaleRequest::AddServer),
            (3001, ScaleRequest::MoveBlock { block: 12, to: 1 }),
            (1956, ScaleRequest::MoveBlock { block: 13, to: 0 }),
        ],
    };
    let (sim, end, oks) = run(&c);
    assert_eq!(oks, 2, "the scale-out and one move were carried out (the other was refused)");
    assert_eq!(sim.servers().count(), 3);
    check(&c, &sim, end.as_ref()).unwrap();
}
