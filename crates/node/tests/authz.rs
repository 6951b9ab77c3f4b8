//! The authorization table enforced (issue 19, DESIGN.md §10, docs/PROTOCOL.md §7.1): every
//! message kind sent from every class of sender to every receiver, on a registered server
//! (a primary, a backup, the target of a migration) and on a scheduler running a job
//! across hosts.
//!
//! A message is refused with `Forbidden` exactly where the table says its sender's class
//! may not send it, with `BadRequest` where the receiver takes it from no one, and is never
//! refused `Forbidden` where the table allows it. The checks beyond the table are forged
//! too: a copy of a block from a server that is not its primary, a snapshot from a server
//! that does not own the block, a delta from a server other than its snapshot's, a rank
//! that is not the connection's own, a credential that does not hold. After every refusal
//! the receiver's state is what it was: the values, the clocks and the placement epoch
//! (compared field by field), and everything else it holds (compared as its `Debug`).
//!
//! The expected verdicts come from [`TABLE`] read here, not from `authz::check`, so a
//! check switched off in the code fails this test even if `authz::check` is the one
//! changed. Proptest chooses the sequences of (class, message) pairs; a failing case
//! prints as its steps. `PROPTEST_CASES=N` raises the count.
//!
//! A connection a receiver closes after a refusal (the scheduler closes a connection that
//! sends data frames) is used again by later steps: the state machine has not seen it
//! close, and what it does with the next message is still decided by the table.

use elasticps_core::block::{Block, BlockState, LoggedPush, ShardConfig};
use elasticps_core::model::{BlockId, Init, Partition, TensorSpec};
use elasticps_core::optimizer::{OptState, OptimizerConfig, OptimizerKind, TensorOptimizer};
use elasticps_core::placement::{Placement, PlacementKind, ServerId};
use elasticps_core::sync::{Clock, SyncPolicy};
use elasticps_node::ConnId;
use elasticps_node::authz::{self, Class, Receiver, TABLE, Verdict};
use elasticps_node::scheduler::hosts::HostsConfig;
use elasticps_node::scheduler::{self, JobConfig, SavedState, Scheduler};
use elasticps_node::server::{self, Owned, Phase, Server, Slot};
use elasticps_wire::{
    Assignment, CheckpointPlan, ClusterStatus, Control, Credential, ErrorCode, ErrorReply, HostOffer, Injection, KeyId,
    Layout, Message, MigrationReport, NodeRole, PeerRole, RowIds, ScaleRequest, ServerAddr, ServerLoad, ServerStats,
    Values, WorkerLoad,
};
use proptest::prelude::*;

/// The cluster secret of these jobs.
const SECRET: &[u8] = b"the cluster secret";
/// The job id in their credentials.
const JOB: u64 = 0x0b5e_55ed;
/// Values per block.
const LEN: usize = 4;
/// Workers of the server's job.
const WORKERS: u32 = 2;
/// The server under test: the primary of block 0, the backup of block 2 (whose primary is
/// server 2); block 1 is server 1's.
const ME: ServerId = 0;
/// The epoch of the migration of block 1 to this server that the table's samples play.
const MOVE_EPOCH: u64 = 5;

/// Workers of the scheduler's job: ranks 0 and 1 send, rank 2 never does (the rank the
/// forgeries name, and the one that keeps the job running).
const SCHED_WORKERS: u32 = 3;

/// The credential a scheduler with [`SECRET`] issues `role` `id` in [`JOB`].
fn cred(role: PeerRole, id: u32) -> Credential {
    Credential::issue(SECRET, JOB, role, id)
}

fn model() -> Vec<TensorSpec> {
    vec![TensorSpec { name: "w".into(), shape: vec![3 * LEN], init: Init::Constant(1.0) }]
}

fn shard_config(workers: u32) -> ShardConfig {
    ShardConfig {
        sync: SyncPolicy::Asp,
        optimizer: OptimizerConfig { kind: OptimizerKind::Sgd, lr: 1.0, aggregate: false, weight_decay: 0.0 },
        workers,
    }
}

/// The model, its placement on 3 servers with 2 copies of every block, and each block's
/// initial state.
struct Model {
    partition: Partition,
    placement: Placement,
    states: Vec<BlockState>,
}

impl Model {
    fn new() -> Model {
        let partition = Partition::new(model(), LEN * 4).expect("a partition");
        let placement = Placement::initial(PlacementKind::Range, &partition, 3)
            .and_then(|p| p.with_replicas(2, 3))
            .expect("a placement");
        assert_eq!(placement.owners, [0, 1, 2], "block b on server b");
        assert_eq!(placement.backups_of(2), [0], "server 0 backs block 2 up");
        let states = (0..3)
            .map(|b| {
                let spec = *partition.block(b).expect("a block");
                let values = partition.init_values(b, 7).expect("initial values");
                Block::<()>::new(spec, values, &shard_config(WORKERS)).expect("a block").state()
            })
            .collect();
        Model { partition, placement, states }
    }

    fn assignment(&self, id: ServerId) -> Assignment {
        Assignment {
            server_id: id,
            partition: self.partition.clone(),
            placement: self.placement.clone(),
            config: shard_config(WORKERS),
            seed: 7,
            inject: Injection::default(),
        }
    }

    fn servers(&self) -> Vec<ServerAddr> {
        (0..3).map(|id| ServerAddr { id, addr: format!("addr{id}") }).collect()
    }

    /// Block `b`'s state with every value replaced by `v` (a forged copy).
    fn forged_state(&self, b: BlockId, v: f32) -> BlockState {
        let mut s = self.states[b as usize].clone();
        s.values.iter_mut().for_each(|x| *x = v);
        s
    }
}

/// The identities a sample names as its sender's own, and the clock it carries.
#[derive(Clone, Copy, Debug)]
struct Own {
    rank: u32,
    server: ServerId,
    clock: Clock,
}

fn values(v: f32) -> Values {
    Values::from_vec(vec![v; LEN])
}

/// One message of kind `name`, as a well-behaved sender `own` would send it: data for
/// block 0 (the server's own), copies of block 2 (which it backs up), the migration of
/// block 1 to it at [`MOVE_EPOCH`]; ranks and server ids its sender's own. Every kind of
/// [`authz::all_names`] has one.
fn sample(name: &str, own: Own, m: &Model) -> Message {
    let Own { rank, server, clock } = own;
    let optimizer = TensorOptimizer { kind: OptimizerKind::Sgd, lr: 0.5, weight_decay: 0.0 };
    let report = MigrationReport {
        block: 0,
        from: server,
        to: 1 - server.min(1),
        epoch: m.placement.epoch + 1,
        bytes: 0,
        freeze_us: 0,
        total_us: 0,
        held: 0,
        error: Some("a sample".into()),
    };
    let status = ClusterStatus { balance: "static".into(), epoch: 0, migrations: 0, servers: vec![], workers: vec![] };
    let control = match name {
        "RegisterServer" => Control::RegisterServer { data_addr: "10.0.0.1:7100".into() },
        "RegisterWorker" => Control::RegisterWorker,
        "Welcome" => {
            Control::Welcome { node_id: 0, num_workers: 2, num_servers: 3, credential: cred(PeerRole::Worker, 0) }
        }
        "DefineModel" => Control::DefineModel { tensors: model(), optimizers: vec![], tables: Vec::new() },
        "GetLayout" => Control::GetLayout,
        "Layout" => Control::Layout(Layout {
            partition: m.partition.clone(),
            placement: m.placement.clone(),
            servers: m.servers(),
            seed: 7,
            wire: Vec::new(),
        }),
        "Assign" => Control::Assign(Box::new(m.assignment(ME))),
        "AssignDone" => Control::AssignDone { server_id: server },
        "Heartbeat" => Control::Heartbeat,
        "WorkerDone" => Control::WorkerDone { rank },
        "RemoveWorker" => Control::RemoveWorker { rank: 0 },
        "Shutdown" => Control::Shutdown { reason: "a sample".into() },
        "Hello" => Control::Hello { credential: cred(PeerRole::Worker, 1) },
        "Ok" => Control::Ok,
        "Moved" => Control::Moved { block: 0, owner: 1, epoch: 9 },
        "GetStats" => Control::GetStats,
        "Stats" => Control::Stats(ServerStats {
            server_id: 1,
            sync: "asp".into(),
            blocks: 1,
            bytes: 16,
            totals: Default::default(),
            hold_p99_us: 0,
        }),
        "Migrate" => Control::Migrate { block: 0, to: 1, to_addr: "addr1".into(), epoch: 9 },
        "BlockSnapshot" => Control::BlockSnapshot { epoch: MOVE_EPOCH, state: m.states[1].clone() },
        "BlockDelta" => {
            Control::BlockDelta { block: 1, epoch: MOVE_EPOCH, pushes: vec![LoggedPush::dense(0, 0, vec![0.25; LEN])] }
        }
        "MigrateDone" => Control::MigrateDone(report),
        "ServerLoad" => Control::ServerLoad(ServerLoad { server_id: server, ..Default::default() }),
        "WorkerLoad" => Control::WorkerLoad(WorkerLoad { rank, clock, ..Default::default() }),
        "GetStatus" => Control::GetStatus,
        "Status" => Control::Status(status),
        "Scale" => Control::Scale(ScaleRequest::MoveBlock { block: 0, to: 1 }),
        "Barrier" => Control::Barrier,
        "SetOptimizer" => Control::SetOptimizer { tensor: 0, optimizer },
        "Settled" => Control::Settled { block: 1, epoch: MOVE_EPOCH, owner: ME },
        "Checkpointing" => Control::Checkpointing(CheckpointPlan { dir: "/nowhere".into(), every: 0, resume: None }),
        "CheckpointWritten" => Control::CheckpointWritten { clock: 1, blocks: vec![] },
        "GetStartClock" => Control::GetStartClock,
        "StartClock" => Control::StartClock { clock: 0 },
        // A rank the job does not have: a live rank would be taken over (see the report).
        "RejoinWorker" => Control::RejoinWorker { rank: 7 },
        "AddWorker" => Control::AddWorker { rank: 0 },
        "WorkerAdded" => Control::WorkerAdded { rank: 0, clock: 0 },
        "OptimizerSet" => Control::OptimizerSet { tensor: 0 },
        "Replicate" => Control::Replicate {
            block: 2,
            init: false,
            push: LoggedPush::dense(rank.min(WORKERS - 1), clock, vec![0.5; LEN]),
        },
        "Replicas" => Control::Replicas { placement: m.placement.clone(), servers: m.servers() },
        "ReplicaSnapshot" => Control::ReplicaSnapshot(m.states[2].clone()),
        "ReattachServer" => Control::ReattachServer {
            server_id: server,
            credential: cred(PeerRole::Server, server),
            data_addr: format!("10.0.0.1:{}", 7000 + server),
            blocks: vec![],
        },
        "ReattachWorker" => Control::ReattachWorker { rank, credential: cred(PeerRole::Worker, rank) },
        "JoinHost" => Control::JoinHost(HostOffer {
            name: "b".into(),
            addr: "10.0.0.2".into(),
            servers: 0,
            workers: 0,
            server_slots: 1,
            worker_slots: 1,
        }),
        "HostWelcome" => Control::HostWelcome { host: 0 },
        "StartNode" => Control::StartNode { slot: 0, role: NodeRole::Server, workers: 2 },
        "NodeExited" => Control::NodeExited { slot: 999, ok: true, status: "exit status: 0".into(), rank: None },
        "HostEvent" => Control::HostEvent { line: "{\"event\":\"sample\"}".into() },
        "SplitBlock" => Control::SplitBlock { block: 1, at: 1, epoch: MOVE_EPOCH, recorded: true },
        "SplitDone" => Control::SplitDone { block: 1, at: 1, epoch: MOVE_EPOCH, error: None },
        "GetOptState" => Control::GetOptState { block: 0 },
        "OptState" => Control::OptState { block: 0, state: OptState::default() },
        "SetOptState" => Control::SetOptState { block: 0, state: OptState::default() },
        "SetValues" => Control::SetValues { block: 0, values: vec![0.0; 4] },
        "ExportBlock" => Control::ExportBlock { block: 0, since: None, after: None },
        "ExportedBlock" => Control::ExportedBlock {
            block: 0,
            steps: 0,
            ids: vec![],
            values: vec![0.0; 4],
            deleted: vec![],
            more: false,
        },
        "Push" => return Message::Push { block: 0, clock, values: values(0.5) },
        "PushAck" => return Message::PushAck { block: 0, clock },
        "Pull" => return Message::Pull { block: 0, clock, reply: elasticps_wire::Dtype::F32 },
        "PullReply" => return Message::PullReply { block: 0, clock, values: values(1.0) },
        "Error" => return Message::Error(ErrorReply { code: ErrorCode::NotReady, message: "a sample".into() }),
        "Init" => return Message::Init { block: 0, values: values(1.0) },
        "PushPull" => {
            return Message::PushPull { block: 0, clock, values: values(0.5), reply: elasticps_wire::Dtype::F32 };
        }
        "Forward" => {
            let worker = rank.min(WORKERS - 1);
            return Message::Forward { block: 2, clock, worker, init: false, values: values(0.5) };
        }
        "PullRows" => {
            return Message::PullRows {
                block: 0,
                clock,
                ids: RowIds::from_vec(vec![0]),
                reply: elasticps_wire::Dtype::F32,
            };
        }
        "PullRowsReply" => return Message::PullRowsReply { block: 0, clock, values: values(1.0) },
        "PushRows" => {
            return Message::PushRows {
                block: 0,
                clock,
                dim: 1,
                ids: RowIds::from_vec(vec![0]),
                grads: Values::from_vec(vec![0.5]),
            };
        }
        other => panic!("no sample of message {other}: add one (every kind of authz::all_names has one)"),
    };
    control.into()
}

/// The verdict of the table for `name` from `from` at `to`, read from [`TABLE`] itself.
fn table(to: Receiver, from: Class, name: &str) -> Verdict {
    match TABLE.iter().find(|(n, r, _)| *n == name && *r == to) {
        None => Verdict::NotTaken,
        Some((_, _, classes)) if classes.contains(&from) => Verdict::Allowed,
        Some(_) => Verdict::Forbidden,
    }
}

/// The classes that can send to `to`: a host agent dials only the scheduler; no connection
/// is of the class `scheduler` (what the scheduler sends a server comes on the server's own
/// control connection, not through this table).
fn classes_of(to: Receiver) -> &'static [Class] {
    match to {
        Receiver::Server => &[Class::Anon, Class::AnonWorker, Class::Worker, Class::Server],
        Receiver::Scheduler => &[Class::Anon, Class::AnonWorker, Class::Worker, Class::Server, Class::Agent],
    }
}

/// A message forged beyond what the table decides by kind: checked against the
/// receiver's own state (its placement, the snapshot it holds, the connection's rank) or
/// a credential's MAC.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Forgery {
    /// `Replicate` of block 0 (this server's own) from server 2.
    ReplicateOfOwnBlock,
    /// `ReplicaSnapshot` of block 0 (this server's own), forged values, from server 2.
    ReplicaSnapshotOfOwnBlock,
    /// `BlockSnapshot` of block 2 from server 1 (its owner is server 2).
    SnapshotFromNonOwner,
    /// `BlockSnapshot` of block 0 (this server's own) from server 1.
    SnapshotOfOwnBlock,
    /// `BlockDelta` of block 1 from server 2, after server 1 sent its snapshot.
    DeltaFromAnotherServer,
    /// `Hello` with a credential MACed with another secret.
    HelloWrongSecret,
    /// `Hello` with a credential of another job.
    HelloOtherJob,
    /// `Hello` of worker 99 (a valid MAC, a rank the job does not have).
    HelloNoSuchRank,
    /// `Hello` with a (valid) server credential on a worker-secret connection.
    HelloServerOnWorkerKey,
    /// `WorkerDone` of rank 2 from worker 0 or 1.
    WorkerDoneOfAnother,
    /// `WorkerLoad` of rank 2 from worker 0 or 1.
    WorkerLoadOfAnother,
    /// `ReattachWorker` of rank 0 with the credential of rank 1.
    ReattachWithAnothersCredential,
    /// `ReattachServer` of server 0 with a credential MACed with another secret.
    ReattachWithWrongSecret,
    /// `MigrateDone` of a migration from the other server.
    MigrateDoneOfAnother,
}

const FORGERIES: [Forgery; 14] = [
    Forgery::ReplicateOfOwnBlock,
    Forgery::ReplicaSnapshotOfOwnBlock,
    Forgery::SnapshotFromNonOwner,
    Forgery::SnapshotOfOwnBlock,
    Forgery::DeltaFromAnotherServer,
    Forgery::HelloWrongSecret,
    Forgery::HelloOtherJob,
    Forgery::HelloNoSuchRank,
    Forgery::HelloServerOnWorkerKey,
    Forgery::WorkerDoneOfAnother,
    Forgery::WorkerLoadOfAnother,
    Forgery::ReattachWithAnothersCredential,
    Forgery::ReattachWithWrongSecret,
    Forgery::MigrateDoneOfAnother,
];

/// One step of a sequence.
#[derive(Clone, Debug)]
enum Step {
    /// Message `name` from a connection of `class` to `to`; `alt` picks which of two
    /// senders of the class (two workers, two servers), `clock` the clock it carries.
    Table { to: Receiver, class: Class, name: &'static str, alt: bool, clock: Clock },
    /// A forged message; `alt` picks the sender where there are two.
    Forged { forgery: Forgery, alt: bool },
}

/// One slot as a refusal must leave it: (block, phase, the slot's epoch, values, done
/// clock, clocks).
type SlotState = (BlockId, &'static str, u64, Vec<f32>, Clock, String);

/// The server's values, clocks and placement epoch, as a refusal must leave them.
#[derive(Debug, PartialEq)]
struct ServerState {
    epoch: u64,
    owners: Vec<ServerId>,
    /// Every slot.
    blocks: Vec<SlotState>,
    /// (block, values, done clock, clocks) of every backup copy.
    copies: Vec<(BlockId, Vec<f32>, Clock, String)>,
    optimizers: Vec<Option<TensorOptimizer>>,
}

impl ServerState {
    fn of(s: &Server) -> ServerState {
        let shard = s.shard().expect("the server is assigned");
        let mut blocks = Vec::new();
        let mut copies = Vec::new();
        for b in 0..3 {
            if let Some(slot) = s.slot(b) {
                let (phase, epoch, block) = match slot {
                    Slot::Owned(Owned { phase, epoch, block, .. }) => {
                        let name = match phase {
                            Phase::Serving => "serving",
                            Phase::Copying { .. } => "copying",
                            Phase::Frozen { .. } => "frozen",
                            Phase::Arrived { .. } => "arrived",
                        };
                        (name, *epoch, Some(block))
                    }
                    Slot::Gone { .. } => ("gone", 0, None),
                };
                let (values, done, clocks) = block.map_or((vec![], 0, String::new()), |k| {
                    (k.values().to_vec(), k.done(), format!("{:?}", k.clocks()))
                });
                blocks.push((b, phase, epoch, values, done, clocks));
            }
            if let Some(copy) = s.backup_copy(b) {
                copies.push((b, copy.values().to_vec(), copy.done(), format!("{:?}", copy.clocks())));
            }
        }
        ServerState {
            epoch: shard.placement.epoch,
            owners: shard.placement.owners.clone(),
            blocks,
            copies,
            optimizers: shard.tensor_optimizers.clone(),
        }
    }
}

/// The scheduler's job as a refusal must leave it.
#[derive(Debug, PartialEq)]
struct SchedState {
    saved: SavedState,
    /// As `elasticps status` shows it (`Debug`: a worker without a report has NaN times).
    status: String,
    waiting: Option<String>,
}

impl SchedState {
    fn of(m: &Scheduler) -> SchedState {
        SchedState { saved: m.saved_state(), status: format!("{:?}", m.status()), waiting: m.waiting_for() }
    }
}

/// The server under test, and the scheduler of a job across hosts, with their open
/// connections.
struct World {
    model: Model,
    server: Server,
    now_us: u64,
    sched: Scheduler,
    next_conn: ConnId,
    next_request: u64,
    /// What was sent and refused, for the coverage checks: (receiver, class, name, verdict).
    seen: Vec<(Receiver, Class, &'static str, Verdict)>,
}

/// Server connections: workers 0 (cluster key) and 1 (worker key), servers 1 and 2.
const W0: ConnId = 1;
const W1: ConnId = 2;
const S1: ConnId = 51;
const S2: ConnId = 52;
/// Scheduler connections: the host agent, servers 0 and 1, workers 0 (cluster key), 1
/// (worker key) and 2 (silent).
const AGENT: ConnId = 100;
const SCHED_S: [ConnId; 2] = [10, 11];
const SCHED_W: [ConnId; 3] = [1, 2, 3];

/// The replies to `(conn, request_id)` in `acts`.
fn server_replies(acts: &[server::Action], conn: ConnId, request_id: u64) -> Vec<&Message> {
    acts.iter()
        .filter_map(|a| match a {
            server::Action::Reply { conn: c, request_id: r, msg } if (*c, *r) == (conn, request_id) => Some(msg),
            _ => None,
        })
        .collect()
}

fn sched_replies(acts: &[scheduler::Action], conn: ConnId, request_id: u64) -> Vec<&Message> {
    acts.iter()
        .filter_map(|a| match a {
            scheduler::Action::Send { conn: c, request_id: r, msg } if (*c, *r) == (conn, request_id) => Some(msg),
            _ => None,
        })
        .collect()
}

fn code(msg: &Message) -> Option<ErrorCode> {
    match msg {
        Message::Error(e) => Some(e.code),
        _ => None,
    }
}

impl World {
    fn new() -> World {
        let model = Model::new();
        let server = Self::server(&model);
        let sched = Self::scheduler();
        World { model, server, now_us: 1_000, sched, next_conn: 1_000, next_request: 100, seen: Vec::new() }
    }

    /// Server 0, registered and assigned, knowing its peers; workers 0 and 1 and servers
    /// 1 and 2 said Hello; the backup copy of block 2 came from its primary.
    fn server(m: &Model) -> Server {
        let mut s = Server::new("addr0").with_secret(SECRET);
        let call = match &s.start(0)[..] {
            [server::Action::ToScheduler { request_id, msg: Message::Control(Control::RegisterServer { .. }) }] => {
                *request_id
            }
            other => panic!("a server starts by registering: {other:?}"),
        };
        let welcome = Control::Welcome {
            node_id: ME,
            num_workers: WORKERS,
            num_servers: 3,
            credential: cred(PeerRole::Server, ME),
        };
        s.handle(0, server::Event::FromScheduler { request_id: call, msg: welcome.into() });
        s.handle(
            0,
            server::Event::FromScheduler { request_id: 0, msg: Control::Assign(Box::new(m.assignment(ME))).into() },
        );
        let replicas = Control::Replicas { placement: m.placement.clone(), servers: m.servers() };
        s.handle(0, server::Event::FromScheduler { request_id: 0, msg: replicas.into() });
        for (conn, key, role, id) in [
            (W0, KeyId::Cluster, PeerRole::Worker, 0),
            (W1, KeyId::Worker, PeerRole::Worker, 1),
            (S1, KeyId::Cluster, PeerRole::Server, 1),
            (S2, KeyId::Cluster, PeerRole::Server, 2),
        ] {
            s.handle(0, server::Event::Opened { conn, key });
            let hello = Control::Hello { credential: cred(role, id) }.into();
            let r = s.handle(0, server::Event::Received { conn, request_id: 1, msg: hello });
            assert_eq!(server_replies(&r, conn, 1), [&Message::Control(Control::Ok)], "Hello of {role:?} {id}");
        }
        let copy = Control::ReplicaSnapshot(m.states[2].clone()).into();
        let r = s.handle(0, server::Event::Received { conn: S2, request_id: 2, msg: copy });
        assert_eq!(server_replies(&r, S2, 2), [&Message::Control(Control::Ok)], "the copy of block 2");
        assert!(s.backup_copy(2).is_some(), "server 0 holds a copy of block 2");
        assert_eq!(s.owned(), [0]);
        s
    }

    /// A scheduler with one host (its agent on connection 100) of 2 servers and 3
    /// workers, every node registered and the model placed.
    fn scheduler() -> Scheduler {
        let config = JobConfig {
            servers: 2,
            workers: SCHED_WORKERS,
            block_bytes: LEN * 4,
            placement: PlacementKind::Range,
            shard: shard_config(SCHED_WORKERS),
            server_sync: Vec::new(),
            seed: 7,
            inject: Vec::new(),
            balance: Default::default(),
            balance_compress: None,
            max_servers: 2,
            min_servers: 2,
            checkpoint: None,
            rejoin_wait_us: 0,
            replicas: 1,
        };
        let hosts = HostsConfig { min_hosts: 1, max_hosts: 2, restart_workers: 0, restart_servers: 0 };
        let mut m = Scheduler::new(config, 10_000_000).with_credentials(SECRET, JOB).with_hosts(hosts);
        let connect = |m: &mut Scheduler, conn, key| {
            m.handle(0, scheduler::Event::Connected { conn, peer: "10.0.0.1".into(), key });
        };
        let recv = |m: &mut Scheduler, conn, msg: Control| {
            m.handle(0, scheduler::Event::Received { conn, request_id: 1, msg: msg.into() })
        };
        connect(&mut m, AGENT, KeyId::Cluster);
        let offer = HostOffer {
            name: "a".into(),
            addr: "10.0.0.1".into(),
            servers: 2,
            workers: SCHED_WORKERS,
            server_slots: 2,
            worker_slots: SCHED_WORKERS,
        };
        let r = recv(&mut m, AGENT, Control::JoinHost(offer));
        assert!(
            matches!(sched_replies(&r, AGENT, 1)[..], [Message::Control(Control::HostWelcome { host: 0 })]),
            "{r:?}"
        );
        for (i, conn) in SCHED_S.into_iter().enumerate() {
            connect(&mut m, conn, KeyId::Cluster);
            let r = recv(&mut m, conn, Control::RegisterServer { data_addr: format!("10.0.0.1:{}", 7000 + i) });
            assert!(matches!(sched_replies(&r, conn, 1)[..], [Message::Control(Control::Welcome { .. })]), "{r:?}");
        }
        for (rank, conn) in SCHED_W.into_iter().enumerate() {
            connect(&mut m, conn, if rank == 1 { KeyId::Worker } else { KeyId::Cluster });
            let r = recv(&mut m, conn, Control::RegisterWorker);
            assert!(
                matches!(sched_replies(&r, conn, 1)[..], [Message::Control(Control::Welcome { node_id, .. })] if *node_id == rank as u32),
                "{r:?}"
            );
        }
        recv(&mut m, SCHED_W[0], Control::DefineModel { tensors: model(), optimizers: vec![], tables: Vec::new() });
        for (id, conn) in SCHED_S.into_iter().enumerate() {
            recv(&mut m, conn, Control::AssignDone { server_id: id as u32 });
        }
        assert_eq!(m.waiting_for(), None, "the job runs");
        assert!(m.placement().is_some());
        m
    }

    fn fresh_conn(&mut self) -> ConnId {
        self.next_conn += 1;
        self.next_conn
    }

    fn request(&mut self) -> u64 {
        self.next_request += 1;
        self.next_request
    }

    /// A connection of `class` to the server, and who it is: a new one for the anonymous
    /// classes; for a server, the sender the sample needs (the primary of block 2 for its
    /// copies, the owner of block 1 for its migration).
    fn server_conn(&mut self, class: Class, name: &str, alt: bool) -> (ConnId, Own) {
        let own = |rank, server| Own { rank, server, clock: 0 };
        match class {
            Class::Anon | Class::AnonWorker => {
                let conn = self.fresh_conn();
                let key = if class == Class::Anon { KeyId::Cluster } else { KeyId::Worker };
                self.server.handle(self.now_us, server::Event::Opened { conn, key });
                (conn, own(0, 1))
            }
            Class::Worker => {
                if alt {
                    (W1, own(1, 1))
                } else {
                    (W0, own(0, 1))
                }
            }
            Class::Server => match name {
                "Replicate" | "ReplicaSnapshot" | "Forward" => (S2, own(0, 2)),
                "BlockSnapshot" | "BlockDelta" => (S1, own(0, 1)),
                _ if alt => (S2, own(0, 2)),
                _ => (S1, own(0, 1)),
            },
            Class::Agent => unreachable!("a host agent does not dial a server"),
            Class::Scheduler => unreachable!("the scheduler does not dial a server's data port"),
        }
    }

    /// A connection of `class` to the scheduler, and who it is.
    fn sched_conn(&mut self, class: Class, alt: bool) -> (ConnId, Own) {
        let own = |rank, server| Own { rank, server, clock: 0 };
        let anon = |w: &mut World, key| {
            let conn = w.fresh_conn();
            w.sched.handle(0, scheduler::Event::Connected { conn, peer: "10.0.0.9".into(), key });
            (conn, own(0, 0))
        };
        match class {
            Class::Anon => anon(self, KeyId::Cluster),
            Class::AnonWorker => anon(self, KeyId::Worker),
            Class::Worker => (SCHED_W[usize::from(alt)], own(u32::from(alt), 0)),
            Class::Server => (SCHED_S[usize::from(alt)], own(0, u32::from(alt))),
            Class::Agent => (AGENT, own(0, 0)),
            Class::Scheduler => unreachable!("the scheduler does not dial itself"),
        }
    }

    fn run(&mut self, step: &Step) {
        self.now_us += 1_000;
        match *step {
            Step::Table { to, class, name, alt, clock } => self.table_step(to, class, name, alt, clock),
            Step::Forged { forgery, alt } => self.forged(forgery, alt),
        }
        assert!(!self.server.exited(), "the server exited after {step:?}");
    }

    fn table_step(&mut self, to: Receiver, class: Class, name: &'static str, alt: bool, clock: Clock) {
        let verdict = table(to, class, name);
        self.seen.push((to, class, name, verdict));
        let what = format!("{name} from {} to the {}", class.name(), to.name());
        match to {
            Receiver::Server => {
                let (conn, own) = self.server_conn(class, name, alt);
                let msg = sample(name, Own { clock, ..own }, &self.model);
                assert_eq!(authz::name_of(&msg), name, "the sample of {name}");
                self.send_to_server(conn, msg, verdict, &what);
            }
            Receiver::Scheduler => {
                let (conn, own) = self.sched_conn(class, alt);
                let msg = sample(name, Own { clock, ..own }, &self.model);
                assert_eq!(authz::name_of(&msg), name, "the sample of {name}");
                self.send_to_scheduler(conn, msg, verdict, &what);
            }
        }
    }

    /// Sends `msg` on `conn` to the server and checks its answer against `verdict`.
    fn send_to_server(&mut self, conn: ConnId, msg: Message, verdict: Verdict, what: &str) {
        let rid = self.request();
        let (state, whole) = (ServerState::of(&self.server), format!("{:?}", self.server));
        let acts = self.server.handle(self.now_us, server::Event::Received { conn, request_id: rid, msg });
        let replies = server_replies(&acts, conn, rid);
        let refused = match verdict {
            Verdict::Allowed => {
                assert!(
                    replies.iter().all(|m| !matches!(code(m), Some(ErrorCode::Forbidden | ErrorCode::Unauthenticated))),
                    "{what}: the table allows it, the server refused it: {replies:?}"
                );
                assert!(!acts.contains(&server::Action::Close { conn }), "{what}: allowed, but the connection closed");
                return;
            }
            Verdict::Forbidden => ErrorCode::Forbidden,
            Verdict::NotTaken => ErrorCode::BadRequest,
        };
        match &acts[..] {
            [server::Action::Reply { conn: c, request_id: r, msg: Message::Error(e) }]
                if (*c, *r) == (conn, rid) && e.code == refused => {}
            other => panic!("{what}: expected one {refused:?} error and nothing else, got {other:?}"),
        }
        self.server_unchanged(&state, &whole, what);
    }

    fn server_unchanged(&self, state: &ServerState, whole: &str, what: &str) {
        assert_eq!(&ServerState::of(&self.server), state, "{what}: refused, but the values, clocks or epoch changed");
        assert_eq!(format!("{:?}", self.server), whole, "{what}: refused, but the server's state changed");
    }

    /// Sends `msg` on `conn` to the scheduler and checks its answer against `verdict`.
    fn send_to_scheduler(&mut self, conn: ConnId, msg: Message, verdict: Verdict, what: &str) {
        let rid = self.request();
        let (state, whole) = (SchedState::of(&self.sched), format!("{:?}", self.sched));
        // The scheduler takes control frames only: a refused data frame also closes.
        let data_frame = !matches!(msg, Message::Control(_));
        let acts = self.sched.handle(0, scheduler::Event::Received { conn, request_id: rid, msg });
        let replies = sched_replies(&acts, conn, rid);
        let refused = match verdict {
            Verdict::Allowed => {
                assert!(
                    replies.iter().all(|m| !matches!(code(m), Some(ErrorCode::Forbidden))),
                    "{what}: the table allows it, the scheduler refused it: {replies:?}"
                );
                return;
            }
            Verdict::Forbidden => ErrorCode::Forbidden,
            Verdict::NotTaken => ErrorCode::BadRequest,
        };
        // A refusal is one error; a refused data frame (never Forbidden) also closes.
        let closes = verdict == Verdict::NotTaken && data_frame;
        let close = [scheduler::Action::Close(conn)];
        match &acts[..] {
            [scheduler::Action::Send { conn: c, request_id: r, msg: Message::Error(e) }, rest @ ..]
                if (*c, *r) == (conn, rid) && e.code == refused && rest == if closes { &close[..] } else { &[] } => {}
            other => panic!("{what}: expected one {refused:?} error (and a close: {closes}), got {other:?}"),
        }
        self.sched_unchanged(&state, &whole, what);
    }

    fn sched_unchanged(&self, state: &SchedState, whole: &str, what: &str) {
        assert_eq!(&SchedState::of(&self.sched), state, "{what}: refused, but the job changed");
        assert_eq!(format!("{:?}", self.sched), whole, "{what}: refused, but the scheduler's state changed");
    }

    /// Sends a forged message and checks it is refused with `code` (and the connection
    /// closed if `closes`), nothing changed.
    fn forged_to_server(&mut self, conn: ConnId, msg: Message, code: ErrorCode, closes: bool, what: &str) {
        let rid = self.request();
        let (state, whole) = (ServerState::of(&self.server), format!("{:?}", self.server));
        let acts = self.server.handle(self.now_us, server::Event::Received { conn, request_id: rid, msg });
        let ok = match &acts[..] {
            [server::Action::Reply { conn: c, request_id: r, msg: Message::Error(e) }] => {
                (*c, *r) == (conn, rid) && e.code == code && !closes
            }
            [
                server::Action::Reply { conn: c, request_id: r, msg: Message::Error(e) },
                server::Action::Close { conn: d },
            ] => (*c, *r, *d) == (conn, rid, conn) && e.code == code && closes,
            _ => false,
        };
        assert!(ok, "{what}: expected a {code:?} error{}, got {acts:?}", if closes { " and the close" } else { "" });
        if closes {
            // The closed connection is gone from the server's state; nothing else changed.
            assert!(!self.server.introduced(conn), "{what}: the connection proved nothing");
            assert_eq!(
                ServerState::of(&self.server),
                state,
                "{what}: refused, but the values, clocks or epoch changed"
            );
        } else {
            self.server_unchanged(&state, &whole, what);
        }
    }

    fn forged_to_scheduler(&mut self, conn: ConnId, msg: Message, code: ErrorCode, what: &str) {
        let rid = self.request();
        let (state, whole) = (SchedState::of(&self.sched), format!("{:?}", self.sched));
        let acts = self.sched.handle(0, scheduler::Event::Received { conn, request_id: rid, msg });
        // A forbidden message closes nothing; a refused credential closes the connection.
        let close = [scheduler::Action::Close(conn)];
        let after: &[scheduler::Action] = if code == ErrorCode::Forbidden { &[] } else { &close };
        match &acts[..] {
            [scheduler::Action::Send { conn: c, request_id: r, msg: Message::Error(e) }, rest @ ..]
                if (*c, *r) == (conn, rid) && e.code == code && rest == after => {}
            other => panic!("{what}: expected a {code:?} error (then {after:?}), got {other:?}"),
        }
        if code == ErrorCode::Forbidden {
            self.sched_unchanged(&state, &whole, what);
        } else {
            // Closed after an error: the connection may be forgotten, the job is the same.
            assert_eq!(SchedState::of(&self.sched), state, "{what}: refused, but the job changed");
        }
    }

    fn forged(&mut self, forgery: Forgery, alt: bool) {
        let what = format!("forged: {forgery:?}");
        let push = |block, v| Control::Replicate { block, init: false, push: LoggedPush::dense(0, 0, vec![v; LEN]) };
        let hello = |credential| Message::from(Control::Hello { credential });
        let anon = |w: &mut World, key| {
            let conn = w.fresh_conn();
            w.server.handle(w.now_us, server::Event::Opened { conn, key });
            conn
        };
        let forbidden = ErrorCode::Forbidden;
        let unauth = ErrorCode::Unauthenticated;
        match forgery {
            Forgery::ReplicateOfOwnBlock => self.forged_to_server(S2, push(0, 100.0).into(), forbidden, false, &what),
            Forgery::ReplicaSnapshotOfOwnBlock => {
                let msg = Control::ReplicaSnapshot(self.model.forged_state(0, 100.0)).into();
                self.forged_to_server(S2, msg, forbidden, false, &what)
            }
            Forgery::SnapshotFromNonOwner | Forgery::SnapshotOfOwnBlock => {
                let b = if forgery == Forgery::SnapshotFromNonOwner { 2 } else { 0 };
                let msg = Control::BlockSnapshot { epoch: self.now_us, state: self.model.forged_state(b, 100.0) };
                self.forged_to_server(S1, msg.into(), forbidden, false, &what)
            }
            Forgery::DeltaFromAnotherServer => {
                // Server 1, block 1's owner, starts moving it here (at an epoch of its own).
                let epoch = self.now_us;
                let rid = self.request();
                let snapshot = Control::BlockSnapshot { epoch, state: self.model.states[1].clone() }.into();
                let r = self
                    .server
                    .handle(self.now_us, server::Event::Received { conn: S1, request_id: rid, msg: snapshot });
                assert_eq!(server_replies(&r, S1, rid), [&Message::Control(Control::Ok)], "{what}: the real snapshot");
                let pushes = vec![LoggedPush::dense(0, 0, vec![100.0; LEN])];
                let msg = Control::BlockDelta { block: 1, epoch, pushes }.into();
                self.forged_to_server(S2, msg, forbidden, false, &what)
            }
            Forgery::HelloWrongSecret => {
                let conn = anon(self, KeyId::Cluster);
                let c = Credential::issue(b"another secret", JOB, PeerRole::Worker, u32::from(alt));
                self.forged_to_server(conn, hello(c), unauth, true, &what)
            }
            Forgery::HelloOtherJob => {
                let conn = anon(self, KeyId::Cluster);
                let c = Credential::issue(SECRET, JOB + 1, PeerRole::Worker, u32::from(alt));
                self.forged_to_server(conn, hello(c), unauth, true, &what)
            }
            Forgery::HelloNoSuchRank => {
                let conn = anon(self, if alt { KeyId::Worker } else { KeyId::Cluster });
                self.forged_to_server(conn, hello(cred(PeerRole::Worker, 99)), unauth, true, &what)
            }
            Forgery::HelloServerOnWorkerKey => {
                let conn = anon(self, KeyId::Worker);
                self.forged_to_server(conn, hello(cred(PeerRole::Server, 1 + u32::from(alt))), unauth, true, &what)
            }
            Forgery::WorkerDoneOfAnother => {
                let conn = SCHED_W[usize::from(alt)];
                self.forged_to_scheduler(conn, Control::WorkerDone { rank: 2 }.into(), forbidden, &what);
                assert!(!self.sched.saved_state().finished_workers.contains(&2), "{what}: worker 2 is not done");
            }
            Forgery::WorkerLoadOfAnother => {
                let conn = SCHED_W[usize::from(alt)];
                let load = WorkerLoad { rank: 2, clock: 50, iterations: 50, ..Default::default() };
                self.forged_to_scheduler(conn, Control::WorkerLoad(load).into(), forbidden, &what);
            }
            Forgery::ReattachWithAnothersCredential => {
                let (conn, _) = self.sched_conn(if alt { Class::AnonWorker } else { Class::Anon }, false);
                let msg = Control::ReattachWorker { rank: 0, credential: cred(PeerRole::Worker, 1) };
                self.forged_to_scheduler(conn, msg.into(), unauth, &what);
            }
            Forgery::ReattachWithWrongSecret => {
                let (conn, _) = self.sched_conn(Class::Anon, false);
                let msg = Control::ReattachServer {
                    server_id: 0,
                    credential: Credential::issue(b"another secret", JOB, PeerRole::Server, 0),
                    data_addr: "10.0.0.1:7000".into(),
                    blocks: vec![],
                };
                self.forged_to_scheduler(conn, msg.into(), unauth, &what);
            }
            Forgery::MigrateDoneOfAnother => {
                let (me, other) = if alt { (1, 0) } else { (0, 1) };
                let own = Own { rank: 0, server: other, clock: 0 };
                let msg = sample("MigrateDone", own, &self.model);
                let rid = self.request();
                let state = SchedState::of(&self.sched);
                let conn = SCHED_S[me];
                let acts = self.sched.handle(0, scheduler::Event::Received { conn, request_id: rid, msg });
                assert!(
                    matches!(&acts[..], [scheduler::Action::Send { conn: c, msg: Message::Error(_), .. }] if *c == conn),
                    "{what}: server {me} reported a migration of server {other}: {acts:?}"
                );
                assert_eq!(SchedState::of(&self.sched), state, "{what}: refused, but the job changed");
            }
        }
    }
}

/// Every (receiver, class, message) once, in order.
fn every_pair() -> Vec<Step> {
    let mut steps = Vec::new();
    for to in [Receiver::Server, Receiver::Scheduler] {
        for &class in classes_of(to) {
            for name in authz::all_names() {
                steps.push(Step::Table { to, class, name, alt: false, clock: 0 });
                steps.push(Step::Table { to, class, name, alt: true, clock: 1 });
            }
        }
    }
    steps
}

#[test]
fn every_message_from_every_class_to_every_receiver_is_refused_exactly_where_the_table_says() {
    let mut w = World::new();
    for step in every_pair() {
        w.run(&step);
    }
    for forgery in FORGERIES {
        for alt in [false, true] {
            w.run(&Step::Forged { forgery, alt });
        }
    }
    // Coverage: every kind, from every class, to both receivers; every row of the table.
    let names: Vec<&str> = authz::all_names().collect();
    assert_eq!(names.len(), Control::NAMES.len() + 11, "all_names: every control variant and the 11 data kinds");
    for to in [Receiver::Server, Receiver::Scheduler] {
        for &class in classes_of(to) {
            for name in &names {
                assert!(
                    w.seen.iter().any(|(r, c, n, _)| (*r, *c, *n) == (to, class, *name)),
                    "{name} from {class:?} to {to:?}"
                );
            }
        }
        for verdict in [Verdict::Allowed, Verdict::Forbidden, Verdict::NotTaken] {
            assert!(w.seen.iter().any(|(r, _, _, v)| *r == to && *v == verdict), "no {verdict:?} at the {to:?}");
        }
    }
    for (name, to, classes) in TABLE {
        assert!(names.contains(name), "TABLE names {name}, which is no message");
        if *classes == [Class::Scheduler] {
            // Sent by the scheduler on the server's control connection: forbidden to all here.
            continue;
        }
        assert!(w.seen.iter().any(|(r, _, n, v)| r == to && n == name && *v == Verdict::Allowed), "{name} at {to:?}");
    }
    // The table read here is the one authz::check reads.
    for to in [Receiver::Server, Receiver::Scheduler] {
        for class in Class::ALL {
            for name in &names {
                assert_eq!(authz::check(to, class, name), table(to, class, name), "{name} from {class:?} to {to:?}");
            }
        }
    }
}

fn step() -> impl Strategy<Value = Step> {
    let names: Vec<&'static str> = authz::all_names().collect();
    let table_step = (any::<bool>(), any::<prop::sample::Index>(), prop::sample::select(names), any::<bool>(), 0..4u32)
        .prop_map(|(sched, class, name, alt, clock)| {
            let to = if sched { Receiver::Scheduler } else { Receiver::Server };
            let class = *class.get(classes_of(to));
            Step::Table { to, class, name, alt, clock }
        });
    let forged = (prop::sample::select(FORGERIES.to_vec()), any::<bool>())
        .prop_map(|(forgery, alt)| Step::Forged { forgery, alt });
    prop_oneof![4 => table_step, 1 => forged]
}

/// `default` cases, or `PROPTEST_CASES` if set.
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(256), ..ProptestConfig::default() })]

    /// Random sequences of (class, message) pairs and forgeries against one server and one
    /// scheduler: refusals exactly where the table says, and nothing changed by them.
    #[test]
    fn any_sequence_of_messages_is_refused_exactly_where_the_table_says(steps in prop::collection::vec(step(), 1..48)) {
        let mut w = World::new();
        for s in &steps {
            w.run(s);
        }
    }
}
