//! Control messages: the postcard-encoded payload of `Control` frames.
//!
//! postcard writes an enum as the varint index of its variant followed by the variant's
//! fields in declaration order, so **the order of the variants of [`Control`] is part of
//! the protocol**: new variants are only ever appended, and existing ones never change
//! their fields without a protocol version bump. docs/PROTOCOL.md lists the indices.

use elasticps_core::block::{BlockStats, ShardConfig};
use elasticps_core::model::{BlockId, Partition, TensorSpec};
use elasticps_core::placement::{Placement, ServerId};
use serde::{Deserialize, Serialize};

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
    },
    /// Tag 3: Worker -> scheduler: the model. The first definition wins; later ones must be
    /// equal (else an `Error` with `BadRequest`). Reply: [`Control::Layout`] once every
    /// server holds its blocks.
    DefineModel {
        /// The tensors, in order.
        tensors: Vec<TensorSpec>,
    },
    /// Tag 4: Node -> scheduler: send me the current layout. Reply: [`Control::Layout`]
    /// (or an `Error` with `NotReady` before the model is defined and assigned).
    GetLayout,
    /// Tag 5: Scheduler -> node: the model's blocks, who owns them and where to reach them.
    Layout(Layout),
    /// Tag 6: Scheduler -> server: the blocks to hold and how to treat them.
    /// Reply: [`Control::AssignDone`].
    Assign(Assignment),
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
    /// Tag 12: Worker -> server, first message on a data connection. Reply: [`Control::Ok`].
    Hello {
        /// The worker's rank.
        rank: u32,
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
