//! Control messages: the postcard-encoded payload of `Control` frames.
//!
//! postcard writes an enum as the varint index of its variant followed by the variant's
//! fields in declaration order, so **the order of the variants of [`Control`] is part of
//! the protocol**: new variants are only ever appended, and existing ones never change
//! their fields without a protocol version bump. docs/PROTOCOL.md lists the indices.

use elasticps_core::block::{BlockState, BlockStats, LoggedPush, ShardConfig};
use elasticps_core::dtype::Dtype;
use elasticps_core::model::{BlockId, Partition, TableSpec, TensorSpec};
use elasticps_core::optimizer::{OptState, TensorOptimizer};
use elasticps_core::placement::{Placement, ServerId};
use serde::{Deserialize, Serialize};

use crate::credential::Credential;

/// A control-plane message (scheduler <-> nodes, and the first message of a data
/// connection). Each variant's doc starts with its postcard tag (variant index).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Control {
    /// Tag 0: Server -> scheduler, first message on its control connection: "I serve data on
    /// `data_addr`" (`host:port` workers can reach). Reply: [`Control::Welcome`].
    RegisterServer {
        /// Address of the server's data listener.
        data_addr: String,
    },
    /// Tag 1: Worker -> scheduler, first message on its control connection.
    /// Reply: [`Control::Welcome`].
    RegisterWorker,
    /// Tag 2: Scheduler -> node: registration accepted.
    Welcome {
        /// The server id (for a server) or the worker rank (for a worker).
        node_id: u32,
        /// Workers in the job.
        num_workers: u32,
        /// Servers in the job (at registration time).
        num_servers: u32,
        /// The node's credential for its role and id: presented in the `Hello` of every
        /// data connection it opens, and when it reattaches.
        credential: Credential,
    },
    /// Tag 3: Worker -> scheduler: the model. The first definition wins; later ones must be
    /// equal (else an `Error` with `BadRequest`). Reply: [`Control::Layout`] once every
    /// server holds its blocks.
    DefineModel {
        /// The tensors, in order.
        tensors: Vec<TensorSpec>,
        /// Each tensor's own optimizer (a PyTorch parameter group's hyperparameters), or
        /// none (the job's `--optimizer`, `--lr`); empty when no tensor has one.
        optimizers: Vec<Option<TensorOptimizer>>,
        /// The embedding tables, in order (their blocks follow the tensors'); empty for a
        /// dense model.
        tables: Vec<TableSpec>,
    },
    /// Tag 4: Node -> scheduler: send me the current layout. Reply: [`Control::Layout`]
    /// (or an `Error` with `NotReady` before the model is defined and assigned).
    GetLayout,
    /// Tag 5: Scheduler -> node: the model's blocks, who owns them and where to reach them.
    Layout(Layout),
    /// Tag 6: Scheduler -> server: the blocks to hold and how to treat them.
    /// Reply: [`Control::AssignDone`].
    Assign(Box<Assignment>),
    /// Tag 7: Server -> scheduler: the assignment is in place, the server serves its blocks.
    AssignDone {
        /// The server that took the assignment.
        server_id: ServerId,
    },
    /// Tag 8: Node -> scheduler, every second; no reply. A node silent for the heartbeat
    /// timeout is considered dead.
    Heartbeat,
    /// Tag 9: Worker -> scheduler at the end of its run; no reply.
    WorkerDone {
        /// The worker's rank.
        rank: u32,
    },
    /// Tag 10: Scheduler -> servers: a worker left (finished or died); stop waiting for its
    /// pushes. No reply.
    RemoveWorker {
        /// The worker's rank.
        rank: u32,
    },
    /// Tag 11: Scheduler -> node: stop; the node closes its connections and exits.
    Shutdown {
        /// Why, for the log.
        reason: String,
    },
    /// Tag 12: Worker or server -> server, first message on a data connection: "I am the
    /// node of this credential". Reply: [`Control::Ok`], or an `Error` with
    /// `Unauthenticated` (a credential that does not hold) after which the server closes
    /// the connection.
    Hello {
        /// The dialer's credential (its `Welcome`'s).
        credential: Credential,
    },
    /// Tag 13: Generic acknowledgement.
    Ok,
    /// Tag 14: Server -> worker, the reply (same request id) to a Push or Pull for a block the
    /// server does not own: refresh the layout if `epoch` is newer and resend to `owner`.
    Moved {
        /// The block asked for.
        block: BlockId,
        /// Its owner as far as the answering server knows.
        owner: ServerId,
        /// The placement epoch of that knowledge.
        epoch: u64,
    },
    /// Tag 15: Anyone -> server: send your counters. Reply: [`Control::Stats`].
    GetStats,
    /// Tag 16: Server -> asker: the counters.
    Stats(ServerStats),
    /// Tag 17: Scheduler -> server (notification): move `block` to server `to`, whose data
    /// listener is `to_addr`; the placement becomes `epoch` once it is done. The server
    /// answers later with [`Control::MigrateDone`].
    Migrate {
        /// The block to move.
        block: BlockId,
        /// The new owner.
        to: ServerId,
        /// The new owner's data address.
        to_addr: String,
        /// The placement epoch after the move.
        epoch: u64,
    },
    /// Tag 18: Server -> server, on a data connection: the snapshot of a migrating block,
    /// taken while the old owner keeps serving it. Reply: [`Control::Ok`].
    BlockSnapshot {
        /// The placement epoch after the move.
        epoch: u64,
        /// Values, optimizer and clock state.
        state: BlockState,
    },
    /// Tag 19: Server -> server: the pushes the old owner applied after the snapshot, sent
    /// while the block is frozen there. The receiver replays them and from then on owns
    /// the block. Reply: [`Control::Ok`].
    BlockDelta {
        /// The block.
        block: BlockId,
        /// The placement epoch after the move.
        epoch: u64,
        /// The pushes, in the order they were applied.
        pushes: Vec<LoggedPush>,
    },
    /// Tag 20: Server -> scheduler: a migration it was asked for ended. Reply:
    /// [`Control::Ok`] once the scheduler's placement says so (only then does the old
    /// owner answer `Moved`).
    MigrateDone(MigrationReport),
    /// Tag 21: Server -> scheduler, every stats interval (notification): its load.
    ServerLoad(ServerLoad),
    /// Tag 22: Worker -> scheduler, every stats interval (notification): its iterations
    /// and what each server cost it.
    WorkerLoad(WorkerLoad),
    /// Tag 23: Anyone -> scheduler: the state of the cluster. Reply: [`Control::Status`].
    GetStatus,
    /// Tag 24: Scheduler -> asker: the state of the cluster.
    Status(ClusterStatus),
    /// Tag 25: Operator -> scheduler: add or remove a server. Reply: [`Control::Ok`] once
    /// it is under way, or an `Error`.
    Scale(ScaleRequest),
    /// Tag 26: Worker -> scheduler: wait for every other worker still in the job. Reply:
    /// [`Control::Ok`] once each worker not done or removed has sent `Barrier` (its
    /// next barrier then starts a new round).
    Barrier,
    /// Tag 27: Worker -> scheduler only: tensor `tensor` now uses `optimizer` (a
    /// learning-rate schedule's step, say). The scheduler records it (servers that join
    /// later get it in their `Assign`) and sends it on to every live server (scheduler ->
    /// server on the server's control connection, request id 0), each of which applies it
    /// to every push that arrives after it and answers [`Control::OptimizerSet`]. Reply to
    /// the worker: [`Control::Ok`] once every live server applied it. A server refuses it
    /// on a data connection (`Forbidden`).
    SetOptimizer {
        /// Index of the tensor in the model.
        tensor: u32,
        /// Its new rule and hyperparameters.
        optimizer: TensorOptimizer,
    },
    /// Tag 28: Scheduler -> the new owner of a migration (request id 0): the migration of
    /// `block` at `epoch` is settled, and `owner` owns the block: the new owner itself (the
    /// move was recorded: serve the copy) or the old owner (the move failed or was written
    /// off: drop the copy). A block that arrived by migration is not served before this.
    Settled {
        /// The block.
        block: BlockId,
        /// The migration's epoch (as in `Migrate` and `MigrateDone`).
        epoch: u64,
        /// Who owns the block now.
        owner: ServerId,
    },
    /// Tag 29: Scheduler -> server (request id 0), right before every [`Control::Assign`]
    /// of a job that checkpoints or resumes: where checkpoints go, how often, and the
    /// checkpoint the job starts from.
    Checkpointing(CheckpointPlan),
    /// Tag 30: Server -> scheduler (notification): blocks of checkpoint `clock` are on
    /// disk (written, fsynced). The scheduler writes the manifest once every block is.
    CheckpointWritten {
        /// The checkpoint's clock.
        clock: u32,
        /// The blocks written.
        blocks: Vec<CheckpointEntry>,
    },
    /// Tag 31: Worker -> scheduler: the clock the job starts at. Reply:
    /// [`Control::StartClock`].
    GetStartClock,
    /// Tag 32: Scheduler -> worker: the job starts at `clock` (0, or the clock of the
    /// checkpoint it resumed from: the worker pulls that clock first and pushes no
    /// initial values).
    StartClock {
        /// The first clock.
        clock: u32,
    },
    /// Tag 33: Worker -> scheduler, first message on its control connection instead of
    /// `RegisterWorker`: worker `rank`, lost earlier, restarted. Reply: [`Control::Welcome`]
    /// once every server took the rank back into its quorums (its first clock is then
    /// [`Control::GetStartClock`]'s answer), or an `Error`.
    RejoinWorker {
        /// The rank it had.
        rank: u32,
    },
    /// Tag 34: Scheduler -> server (notification): take worker `rank` back into the quorum
    /// of every block. The server then sends [`Control::WorkerAdded`].
    AddWorker {
        /// The worker's rank.
        rank: u32,
    },
    /// Tag 35: Server -> scheduler (notification), after `AddWorker`: the smallest clock
    /// the worker is to push next on this server's blocks (`u32::MAX` with none).
    WorkerAdded {
        /// The worker's rank.
        rank: u32,
        /// Its next clock here.
        clock: u32,
    },
    /// Tag 36: Primary -> backup server, on a data connection (`--replicas`): apply this
    /// push (or, with `init`, these initial values) to your copy of `block`. Reply:
    /// [`Control::Ok`] once applied (a duplicate is dropped by the copy's clock state and
    /// answered `Ok` too); the primary acknowledges the worker's push only after every
    /// backup did.
    Replicate {
        /// The block.
        block: BlockId,
        /// True for a worker's initial values (`grad` holds them), false for a push.
        init: bool,
        /// The push: worker, clock and gradient.
        push: LoggedPush,
    },
    /// Tag 37: Scheduler -> every server (request id 0): who holds which copy now, after a
    /// failover (a lost server's primaries promoted to their first backup) or a rebuilt
    /// copy. A server serves the blocks it was promoted for, and a primary sends its state
    /// ([`Control::ReplicaSnapshot`]) to each new backup. Also Scheduler -> every worker
    /// (request id 0) when a server is lost: the servers it does not list are gone, their
    /// connections are taken as closed (a lost host may be silent).
    Replicas {
        /// The placement with its backups.
        placement: Placement,
        /// Data addresses of the servers (primaries dial their backups there).
        servers: Vec<ServerAddr>,
    },
    /// Tag 38: Primary -> backup server, on a data connection: the whole state of a block
    /// (a new backup's first copy, or a resync after a failed [`Control::Replicate`]); the
    /// pushes replicated before it are dropped as duplicates. Reply: [`Control::Ok`].
    ReplicaSnapshot(BlockState),
    /// Tag 39: Server -> scheduler, first message on a new control connection after the
    /// scheduler restarted (`--state-dir`): server `server_id`, serving on `data_addr`,
    /// holds `blocks`. Reply: [`Control::Welcome`] (or an `Error`: the scheduler does not
    /// know this server, or is not recovering). The servers' view of block ownership wins
    /// over the scheduler's saved placement.
    ReattachServer {
        /// The id the scheduler gave it before the restart.
        server_id: ServerId,
        /// Its credential for that id (the restarted scheduler checks it).
        credential: Credential,
        /// Address of its data listener.
        data_addr: String,
        /// Every block it holds.
        blocks: Vec<HeldBlock>,
    },
    /// Tag 40: Worker -> scheduler, first message on a new control connection after the
    /// scheduler restarted: worker `rank`, never lost from the servers' view, goes on
    /// where it is (no quorum change, unlike [`Control::RejoinWorker`]). Reply:
    /// [`Control::Welcome`], or an `Error` (an unknown rank, or one removed from the
    /// quorums before the restart).
    ReattachWorker {
        /// Its rank.
        rank: u32,
        /// Its credential for that rank (the restarted scheduler checks it).
        credential: Credential,
    },
    /// Tag 41: Host agent (`elasticps launch` on a host) -> scheduler, first message on
    /// its control connection: this host and its slots. Reply: [`Control::HostWelcome`],
    /// or an `Error` (the job has its `--nnodes` MAX hosts, a host of that name or address
    /// is already in, a loopback address to a scheduler on another host). The agent then
    /// sends [`Control::Heartbeat`] every 500 ms; after 2 s without one (or when its
    /// connection closes) the host is lost.
    JoinHost(HostOffer),
    /// Tag 42: Scheduler -> agent: the host joined as `host`.
    HostWelcome {
        /// The host's id (join order, from 0).
        host: u32,
    },
    /// Tag 43: Scheduler -> agent (notification): start one node in slot `slot` (an id
    /// unique in the job); the agent reports its exit with [`Control::NodeExited`].
    StartNode {
        /// The slot.
        slot: u32,
        /// What to start.
        role: NodeRole,
        /// Workers in the job (a worker command's `ELASTICPS_WORKERS`).
        workers: u32,
    },
    /// Tag 44: Agent -> scheduler (notification): the node of `slot` exited.
    NodeExited {
        /// The slot of its [`Control::StartNode`].
        slot: u32,
        /// True if it exited with status 0.
        ok: bool,
        /// How it exited, for messages (`exit status: 1`, `signal: 9`).
        status: String,
        /// The worker's rank, if its events named one.
        rank: Option<u32>,
    },
    /// Tag 45: Agent -> scheduler (notification): one JSON event line of a node on its
    /// host (a worker's progress and final report, a server's counters), which the
    /// scheduler prints on its event stream for the launch that runs it (the job's report).
    HostEvent {
        /// The event line, as the node printed it.
        line: String,
    },
    /// Tag 46: Scheduler -> server, request id 0: split row block `block` at row `at`
    /// into the model's next two block ids (`elasticps_core::model::Partition::split_rows`)
    /// at placement `epoch`. Not `recorded`: to the block's owner, which splits it in
    /// place, answers requests naming `block` from then on `Moved` to no server
    /// ([`RETIRED`](elasticps_core::placement::RETIRED), `u32::MAX`) at `epoch`, and
    /// reports with [`Control::SplitDone`] (also when it cannot). `recorded`: to every
    /// other server once the scheduler recorded the split; it follows it in its model and
    /// placement.
    SplitBlock {
        /// The row block.
        block: BlockId,
        /// The first row of the second half.
        at: u64,
        /// The placement epoch after the split.
        epoch: u64,
        /// The scheduler recorded the split (a notification to follow it).
        recorded: bool,
    },
    /// Tag 47: Server -> scheduler, request id 0: the split of `SplitBlock` was done
    /// (`error` None) or refused, and why (migrating, checkpoint pending, backups).
    SplitDone {
        /// The row block.
        block: BlockId,
        /// The row it was split at.
        at: u64,
        /// The epoch of the `SplitBlock`.
        epoch: u64,
        /// Why it was not split, if it was not.
        error: Option<String>,
    },
    /// Tag 48: Worker -> server (data connection): the optimizer state of dense block
    /// `block` (a PyTorch optimizer's `state_dict`). Reply: [`Control::OptState`],
    /// `Moved` if the server does not serve the block, or an `Error` (a row block).
    GetOptState {
        /// The block.
        block: BlockId,
    },
    /// Tag 49: Server -> worker: the optimizer state of `block` answering `GetOptState`.
    OptState {
        /// The block.
        block: BlockId,
        /// Steps taken, momentum or first moment, second moment.
        state: OptState,
    },
    /// Tag 50: Worker -> server (data connection): replace the optimizer state of dense
    /// block `block` (a PyTorch optimizer's `load_state_dict`). Reply: `Ok`, `Moved` if the
    /// server does not serve the block, or an `Error` (a row block, wrong lengths).
    SetOptState {
        /// The block.
        block: BlockId,
        /// Its new optimizer state: `m` and `v` empty or as long as the block.
        state: OptState,
    },
    /// Tag 51: Worker -> server (data connection): overwrite the values of dense block
    /// `block` (a PyTorch model's buffers: rank 0 writes them before its push of the clock,
    /// every worker pulls them). Reply: `Ok`, `Moved`, or an `Error`.
    SetValues {
        /// The block.
        block: BlockId,
        /// Its new values, as many as the block holds.
        #[serde(with = "elasticps_core::f32s")]
        values: Vec<f32>,
    },
    /// Tag 52: Server -> scheduler (notification), after the scheduler's `SetOptimizer`
    /// (sent to every server, request id 0, in the order the scheduler recorded them): this
    /// server applied it (or holds no blocks yet: its `Assign` carries the record). The
    /// scheduler answers the worker's `SetOptimizer` once every live server sent this.
    OptimizerSet {
        /// The tensor whose optimizer was set.
        tensor: u32,
    },
    /// Tag 53: Operator or worker -> server (data connection), `elasticps export`: one page
    /// of block `block` for serving. A row block answers its rows pushed after its step
    /// `since` (all rows with `None`), in ascending id order, starting after id `after`
    /// (`None`: the first page); a dense block answers its whole values. Reply:
    /// [`Control::ExportedBlock`], `Moved` if the server does not own the block (to no
    /// server, [`RETIRED`](elasticps_core::placement::RETIRED), once it was split), or an
    /// `Error` with `BadRequest` (`since` is older than the evictions the block still
    /// remembers: take a full export).
    ExportBlock {
        /// The block.
        block: BlockId,
        /// The block's `steps` of the previous export (`ExportedBlock::steps`), or none
        /// for every row.
        since: Option<u64>,
        /// The last id of the previous page, or none for the first page.
        after: Option<u64>,
    },
    /// Tag 54: Server -> asker: one page of [`Control::ExportBlock`], at most
    /// `EXPORT_PAGE_ROWS` rows and about `EXPORT_PAGE_BYTES` of values (node crate).
    ExportedBlock {
        /// The block.
        block: BlockId,
        /// The block's step count when the first page was read: the `since` of the next
        /// export of this block (repeated on every page; 0 for a dense block).
        steps: u64,
        /// The rows' ids, ascending (empty for a dense block).
        ids: Vec<u64>,
        /// Their values, row-major (`ids.len() * dim`), or a dense block's whole values.
        #[serde(with = "elasticps_core::f32s")]
        values: Vec<f32>,
        /// Keys evicted since `since` that no longer exist (first page only).
        deleted: Vec<u64>,
        /// More pages follow: ask again with `after` set to the last id of this one.
        more: bool,
    },
    /// Tag 55: Worker -> its host group's leader, first on the group's loopback
    /// connection (one push per host, docs/PROTOCOL.md §6.15): "I am local rank
    /// `local_rank` of this host's group". Reply: [`Control::Ok`], or an `Error` and a
    /// closed connection.
    JoinGroup {
        /// Its local rank, `1..` the group's size (0 is the leader).
        local_rank: u32,
    },
}

impl Control {
    /// The variant's name, as docs/PROTOCOL.md names it (`"Hello"`, `"Replicate"`).
    pub fn name(&self) -> &'static str {
        match self {
            Control::RegisterServer { .. } => "RegisterServer",
            Control::RegisterWorker => "RegisterWorker",
            Control::JoinGroup { .. } => "JoinGroup",
            Control::Welcome { .. } => "Welcome",
            Control::DefineModel { .. } => "DefineModel",
            Control::GetLayout => "GetLayout",
            Control::Layout(_) => "Layout",
            Control::Assign(_) => "Assign",
            Control::AssignDone { .. } => "AssignDone",
            Control::Heartbeat => "Heartbeat",
            Control::WorkerDone { .. } => "WorkerDone",
            Control::RemoveWorker { .. } => "RemoveWorker",
            Control::Shutdown { .. } => "Shutdown",
            Control::Hello { .. } => "Hello",
            Control::Ok => "Ok",
            Control::Moved { .. } => "Moved",
            Control::GetStats => "GetStats",
            Control::Stats(_) => "Stats",
            Control::Migrate { .. } => "Migrate",
            Control::BlockSnapshot { .. } => "BlockSnapshot",
            Control::BlockDelta { .. } => "BlockDelta",
            Control::MigrateDone(_) => "MigrateDone",
            Control::ServerLoad(_) => "ServerLoad",
            Control::WorkerLoad(_) => "WorkerLoad",
            Control::GetStatus => "GetStatus",
            Control::Status(_) => "Status",
            Control::Scale(_) => "Scale",
            Control::Barrier => "Barrier",
            Control::SetOptimizer { .. } => "SetOptimizer",
            Control::Settled { .. } => "Settled",
            Control::Checkpointing(_) => "Checkpointing",
            Control::CheckpointWritten { .. } => "CheckpointWritten",
            Control::GetStartClock => "GetStartClock",
            Control::StartClock { .. } => "StartClock",
            Control::RejoinWorker { .. } => "RejoinWorker",
            Control::AddWorker { .. } => "AddWorker",
            Control::WorkerAdded { .. } => "WorkerAdded",
            Control::Replicate { .. } => "Replicate",
            Control::Replicas { .. } => "Replicas",
            Control::ReplicaSnapshot(_) => "ReplicaSnapshot",
            Control::ReattachServer { .. } => "ReattachServer",
            Control::ReattachWorker { .. } => "ReattachWorker",
            Control::JoinHost(_) => "JoinHost",
            Control::HostWelcome { .. } => "HostWelcome",
            Control::StartNode { .. } => "StartNode",
            Control::NodeExited { .. } => "NodeExited",
            Control::HostEvent { .. } => "HostEvent",
            Control::SplitBlock { .. } => "SplitBlock",
            Control::SplitDone { .. } => "SplitDone",
            Control::GetOptState { .. } => "GetOptState",
            Control::OptState { .. } => "OptState",
            Control::SetOptState { .. } => "SetOptState",
            Control::SetValues { .. } => "SetValues",
            Control::OptimizerSet { .. } => "OptimizerSet",
            Control::ExportBlock { .. } => "ExportBlock",
            Control::ExportedBlock { .. } => "ExportedBlock",
        }
    }

    /// Every variant's name, in tag order ([`Control::name`] of tag `i` is `NAMES[i]`).
    pub const NAMES: [&'static str; 55] = [
        "RegisterServer",
        "RegisterWorker",
        "Welcome",
        "DefineModel",
        "GetLayout",
        "Layout",
        "Assign",
        "AssignDone",
        "Heartbeat",
        "WorkerDone",
        "RemoveWorker",
        "Shutdown",
        "Hello",
        "Ok",
        "Moved",
        "GetStats",
        "Stats",
        "Migrate",
        "BlockSnapshot",
        "BlockDelta",
        "MigrateDone",
        "ServerLoad",
        "WorkerLoad",
        "GetStatus",
        "Status",
        "Scale",
        "Barrier",
        "SetOptimizer",
        "Settled",
        "Checkpointing",
        "CheckpointWritten",
        "GetStartClock",
        "StartClock",
        "RejoinWorker",
        "AddWorker",
        "WorkerAdded",
        "Replicate",
        "Replicas",
        "ReplicaSnapshot",
        "ReattachServer",
        "ReattachWorker",
        "JoinHost",
        "HostWelcome",
        "StartNode",
        "NodeExited",
        "HostEvent",
        "SplitBlock",
        "SplitDone",
        "GetOptState",
        "OptState",
        "SetOptState",
        "SetValues",
        "OptimizerSet",
        "ExportBlock",
        "ExportedBlock",
    ];
}

/// A host's offer to a job: part of [`Control::JoinHost`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostOffer {
    /// The host's name (its hostname, or `--node-name`).
    pub name: String,
    /// The IP address its nodes advertise and dial from.
    pub addr: String,
    /// Servers it starts when the job starts (`--servers-per-node`).
    pub servers: u32,
    /// Workers it starts when the job starts (`--workers-per-node`).
    pub workers: u32,
    /// Servers it may run at most (its initial ones, scale-outs and restarts).
    pub server_slots: u32,
    /// Workers it may run at most (its initial ones and restarted ones).
    pub worker_slots: u32,
}

/// What a host agent starts: part of [`Control::StartNode`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeRole {
    /// `elasticps server`, registering with the scheduler.
    Server,
    /// A worker (the launch's command): a new one, or rank `rank` restarted (it rejoins).
    Worker {
        /// The rank it rejoins as, for a restarted worker.
        rank: Option<u32>,
    },
}

/// One block a reattaching server holds: part of [`Control::ReattachServer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldBlock {
    /// The block.
    pub block: BlockId,
    /// The placement epoch at which it came to this server (0: the initial assignment;
    /// for an arrived block, the epoch of its migration).
    pub epoch: u64,
    /// True if it came by a migration that the scheduler has not settled yet (the server
    /// does not serve it until `Settled`); false if the server serves it.
    pub arrived: bool,
}

/// A job's checkpoints: part of [`Control::Checkpointing`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointPlan {
    /// The checkpoint directory (shared by every server and the scheduler).
    pub dir: String,
    /// A checkpoint at every multiple of this clock (0: none, only a resume).
    pub every: u32,
    /// The checkpoint the job resumes from, if it does.
    pub resume: Option<Restore>,
}

/// The checkpoint a job resumes from: its clock and every block's file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Restore {
    /// The checkpoint's clock: every block holds exactly the pushes of the clocks before it.
    pub clock: u32,
    /// Every block's file.
    pub blocks: Vec<CheckpointEntry>,
}

/// One block's file in a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointEntry {
    /// The block.
    pub block: BlockId,
    /// The file, relative to the checkpoint directory.
    pub file: String,
    /// Its length in bytes.
    pub len: u64,
    /// CRC-32 (IEEE) of its bytes.
    pub crc32: u32,
}

/// Server straggler injection, as in PSLD's experiments: part of a server's assignment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Injection {
    /// Cap on the server's socket bandwidth in bytes/s, each direction (0: none).
    pub bandwidth_bps: u64,
    /// The server spends this many times the normal CPU per byte handled (<= 1: none).
    pub interference: f32,
    /// Microseconds after the assignment at which the injection starts.
    pub at_us: u64,
}

/// How a migration went: one entry of the report's migration log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MigrationReport {
    /// The block.
    pub block: BlockId,
    /// The old owner (the reporting server).
    pub from: ServerId,
    /// The new owner.
    pub to: ServerId,
    /// The placement epoch after the move.
    pub epoch: u64,
    /// Bytes sent (snapshot and delta).
    pub bytes: u64,
    /// How long the block was frozen (no push or pull served), in microseconds.
    pub freeze_us: u64,
    /// From the request to the handover, in microseconds.
    pub total_us: u64,
    /// Pulls held by the sync policy when the block froze: the old owner answers them
    /// `Moved` and the workers re-issue them at the new owner.
    pub held: u32,
    /// Why it failed; `None` if the new owner now serves the block.
    pub error: Option<String>,
}

/// A server's load over one stats interval.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ServerLoad {
    /// The server.
    pub server_id: ServerId,
    /// Length of the interval, in microseconds.
    pub interval_us: u64,
    /// Payload bytes received.
    pub bytes_in: u64,
    /// Payload bytes sent.
    pub bytes_out: u64,
    /// Pushes and pulls handled.
    pub requests: u64,
    /// Time spent applying pushes and answering pulls (including injected work), in
    /// microseconds.
    pub busy_us: u64,
    /// Time frames waited for the bandwidth cap (queueing delay), in microseconds.
    pub shaped_us: u64,
    /// Blocks it holds now.
    pub blocks: u32,
    /// Bytes of values it holds now.
    pub bytes: u64,
    /// How fast its link delivered data: the payload bytes of the interval's pushes over
    /// the time each took to arrive, first byte to last, bytes/s; 0 if none.
    pub rx_bps: f64,
    /// The data frames `rx_bps` was measured from.
    pub rx_frames: u32,
    /// Each row block held here that was pushed or pulled in the interval: its requests
    /// and rows (what a hot row range costs, which its nominal size does not say).
    pub row_blocks: Vec<RowBlockLoad>,
}

/// One row block's traffic over a load interval: part of [`ServerLoad`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowBlockLoad {
    /// The block.
    pub block: BlockId,
    /// Row pushes applied (empty ones too; duplicates not).
    pub pushes: u64,
    /// Row pulls answered.
    pub pulls: u64,
    /// Rows pushed and pulled.
    pub rows: u64,
    /// Payload bytes of the pushes (ids and gradients).
    pub bytes_in: u64,
    /// Payload bytes of the pull replies.
    pub bytes_out: u64,
    /// The row to split the block at so that each half takes about half of the rows
    /// pushed to it since it came to this server; 0 for none.
    pub split_at: u64,
    /// Rows that exist in the block now (created and not evicted): its memory, with
    /// [`RowBlockLoad::row_bytes`] a row.
    pub live_rows: u64,
    /// Bytes one live row holds: its values and its optimizer state.
    pub row_bytes: u64,
    /// Rows the block's memory bound evicted over the interval.
    pub evicted: u64,
    /// Rows the block's expiry (TTL) evicted over the interval.
    pub expired: u64,
    /// Gradients of keys not admitted yet, dropped over the interval.
    pub refused_grads: u64,
    /// Reads of rows that did not exist (answered with initial values) over the interval.
    pub init_reads: u64,
}

impl RowBlockLoad {
    /// What a worker pushes to the block per push on average, bytes (at least 1): the
    /// block's weight in the load model, as a dense block's is its size.
    pub fn push_bytes(&self) -> u64 {
        self.bytes_in.checked_div(self.pushes).unwrap_or(1).max(1)
    }

    /// Bytes the block's live rows hold now (`live_rows * row_bytes`).
    pub fn live_bytes(&self) -> u64 {
        self.live_rows.saturating_mul(self.row_bytes)
    }
}

/// What one server cost one worker over a stats interval.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ServerSample {
    /// The server.
    pub server: ServerId,
    /// Rounds (push, pull or both) with this server.
    pub rounds: u32,
    /// Payload bytes pushed to it.
    pub push_bytes: u64,
    /// Time from the first push of a round to its last acknowledgement, summed, in
    /// microseconds: the server's service time (pushes are never held by a sync policy).
    pub push_us: u64,
    /// Time from a round's start until this server's last reply, summed, in microseconds
    /// (includes pulls held by the sync policy).
    pub wait_us: u64,
}

/// A worker's progress and per-server costs over one stats interval.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkerLoad {
    /// The worker.
    pub rank: u32,
    /// The last clock it pushed.
    pub clock: u32,
    /// Iterations completed in the interval.
    pub iterations: u32,
    /// Their summed duration, in microseconds.
    pub iter_us: u64,
    /// Per server.
    pub per_server: Vec<ServerSample>,
}

/// One server as `elasticps status` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServerStatus {
    /// Server id.
    pub id: ServerId,
    /// Data address.
    pub addr: String,
    /// `serving`, `joining`, `draining` or `gone`.
    pub state: String,
    /// Blocks it owns.
    pub blocks: u32,
    /// Bytes of the blocks it owns.
    pub bytes: u64,
    /// Estimated service rate in bytes/s (0: not measured yet).
    pub rate_bps: f64,
    /// Confidence of the estimate in [0, 1].
    pub confidence: f64,
    /// Estimated service time per iteration, in milliseconds.
    pub service_ms: f64,
    /// Its service time exceeds the median by more than the threshold.
    pub straggler: bool,
}

/// One worker as `elasticps status` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerStatus {
    /// Rank.
    pub rank: u32,
    /// The last clock it pushed.
    pub clock: u32,
    /// Mean iteration time over its last report, in milliseconds.
    pub iter_ms: f64,
    /// It finished (or died).
    pub done: bool,
}

/// The state of the cluster, answered to [`Control::GetStatus`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClusterStatus {
    /// `static` or `psld`.
    pub balance: String,
    /// The placement epoch.
    pub epoch: u64,
    /// Migrations completed.
    pub migrations: u32,
    /// The servers.
    pub servers: Vec<ServerStatus>,
    /// The workers.
    pub workers: Vec<WorkerStatus>,
}

/// An operator's scaling request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ScaleRequest {
    /// Tag 0: start one more server (through the scheduler's launcher) and move load to it.
    AddServer,
    /// Tag 1: drain this server's blocks to the others, then stop it.
    RemoveServer(ServerId),
    /// Tag 2: move one block to another server (manual rebalancing; queued behind the
    /// migrations already planned).
    MoveBlock {
        /// The block.
        block: BlockId,
        /// Its new owner.
        to: ServerId,
    },
}

/// Where the blocks live: everything a worker needs to push and pull.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Layout {
    /// The model cut into blocks.
    pub partition: Partition,
    /// Block -> server, with its epoch.
    pub placement: Placement,
    /// Data addresses of the servers.
    pub servers: Vec<ServerAddr>,
    /// Seed of the deterministic initial values.
    pub seed: u64,
    /// The wire dtype of each block, indexed by block id, as the balancer chose it
    /// (`--balance-compress`); a block past the end travels as its tensor's own choice.
    /// Empty (every block as its tensor's) is not encoded, so such a layout's bytes are
    /// those of a layout without the field, and one that ends before it decodes empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty", deserialize_with = "trailing_dtypes")]
    pub wire: Vec<Dtype>,
}

/// `Layout::wire`, the last field of the last value of its frame: a payload that ends
/// before it (a layout without compressed blocks, or from a node before the field) gives
/// none, so that no block is narrowed by mistake.
fn trailing_dtypes<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<Dtype>, D::Error> {
    Ok(Vec::<Dtype>::deserialize(d).unwrap_or_default())
}

/// A server's id and the address of its data listener.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerAddr {
    /// Server id.
    pub id: ServerId,
    /// `host:port` of its data listener.
    pub addr: String,
}

/// What the scheduler asks one server to hold.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Assignment {
    /// The server this is for.
    pub server_id: ServerId,
    /// The whole model (a server holds the blocks `placement` gives it).
    pub partition: Partition,
    /// Block -> server, with its epoch.
    pub placement: Placement,
    /// Sync policy, optimizer and worker count.
    pub config: ShardConfig,
    /// Seed of the deterministic initial values.
    pub seed: u64,
    /// Straggler injection for this server (experiments), none by default.
    pub inject: Injection,
}

/// A server's counters, answered to [`Control::GetStats`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerStats {
    /// The server.
    pub server_id: ServerId,
    /// Its sync policy, as text (`bsp`, `ssp:3`, ...).
    pub sync: String,
    /// Blocks it holds.
    pub blocks: u32,
    /// Bytes of values it holds.
    pub bytes: u64,
    /// Counters summed over its blocks.
    pub totals: BlockStats,
    /// 99th percentile of the time pulls were held, in microseconds.
    pub hold_p99_us: u64,
}
