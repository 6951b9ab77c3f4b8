//! elasticps-harness: a deterministic in-memory cluster: virtual time, a simulated network
//! with latency, bandwidth and seeded faults, and the real
//! [`Scheduler`](elasticps_node::scheduler::Scheduler) with any roles plugged in, in the
//! style of raft-rs's `harness/` crate beside its `RawNode`.
//!
//! It sits beside the tokio runtime (`elasticps-runtime`) and drives the same node machines
//! with the same constants ([`elasticps_node::timing`]): the scheduler, the server, the
//! worker's round and every node's [`Session`](elasticps_node::session::Session) with the
//! scheduler. Each role adapter only carries out what its machine returns, wakes it at its
//! `poll_timeout()` ([`wake`]) and models what production does with sockets and processes,
//! so a race seen between real processes is replayed here from a seed. `elasticps sim` runs
//! whole jobs on it at thousands of nodes.
//!
//! - [`queue`]: the event queue, ordered by (time, sequence number): equal times are
//!   FIFO, so one seed is one run.
//! - [`net`]: [`Network`]: nodes ([`NodeId`]), connections ([`ConnId`](elasticps_node::ConnId),
//!   one per ordered pair as the roles see them), per-node latency and upload/download
//!   bandwidth shared by a node's connections in turn (`port`, as the real shaper shares
//!   it), FIFO connections, the nominal size of a message ([`SizeHook`]), connection drops,
//!   crashes, jitter, a digest of the run.
//! - [`cluster`]: [`Cluster`]: the scheduler ([`SchedulerRole`]) and the roles, each a
//!   small [`Role`] adapter that handles deliveries and acts through an [`Outbox`]
//!   (send, close, connect, timers, ask for a server, finish).
//! - [`server`], [`worker`]: the adapters of the real server state machine and of a
//!   training loop on the real round plan; [`link`]: a node's session with the
//!   scheduler on the simulated network (both adapters'); [`wake`]: one timer per machine's
//!   `poll_timeout()`; [`job`]: a whole job ([`SimJob`]) from birth
//!   to its end, what the proptests and `elasticps sim` run.
//! - [`agent`]: the host agent's adapter ([`AgentRole`], the real
//!   [`Agent`](elasticps_node::agent::Agent)): [`SimJob::across_hosts`] runs a job across
//!   simulated hosts, each on its own IP address, as `elasticps launch --rdzv` does; the
//!   scheduler's host rules decide what starts where and what restarts after a host is
//!   lost ([`SimJob::lose_host`]).
//!
//! A role plugs in like this (the server's and the worker's adapters look the same):
//!
//! ```
//! use elasticps_harness::{Cluster, ClusterConfig, LinkSpec, LostWhy, NodeKind, Outbox, Role};
//! use elasticps_node::ConnId;
//! use elasticps_wire::{Control, Message};
//! # use elasticps_core::{block::ShardConfig, placement::PlacementKind, sync::SyncPolicy};
//! # use elasticps_core::optimizer::{OptimizerConfig, OptimizerKind};
//! # let job = elasticps_node::scheduler::JobConfig {
//! #     servers: 1, workers: 1, block_bytes: 16, placement: PlacementKind::Range,
//! #     shard: ShardConfig { sync: SyncPolicy::Bsp, workers: 1,
//! #         optimizer: OptimizerConfig { kind: OptimizerKind::Sgd, lr: 0.1, aggregate: false, weight_decay: 0.0 } },
//! #     server_sync: vec![], seed: 1, inject: vec![], balance: Default::default(), balance_compress: None, max_servers: 1, min_servers: 1,
//! #     checkpoint: None, rejoin_wait_us: 0, replicas: 1 };
//!
//! /// Registers as a worker and remembers its rank.
//! struct Joiner { rank: Option<u32> }
//!
//! impl Role for Joiner {
//!     fn on_start(&mut self, out: &mut Outbox<'_>) {
//!         let conn = out.connect(out.scheduler());
//!         out.send(conn, 1, Control::RegisterWorker.into());
//!     }
//!     fn on_message(&mut self, _: &mut Outbox<'_>, _: ConnId, _: u64, msg: Message) {
//!         if let Message::Control(Control::Welcome { node_id, .. }) = msg {
//!             self.rank = Some(node_id);
//!         }
//!     }
//!     fn on_lost(&mut self, _: &mut Outbox<'_>, _: ConnId, _: LostWhy) {}
//! }
//!
//! let mut cluster: Cluster<Joiner> = Cluster::new(ClusterConfig::new(job));
//! let w = cluster.add(NodeKind::Worker(0), LinkSpec::default(), Joiner { rank: None });
//! cluster.run(1_000, 100);
//! assert_eq!(cluster.role(w).unwrap().rank, Some(0));
//! assert_eq!(cluster.network().now_us(), 1_000);
//! ```

pub mod agent;
pub mod cluster;
pub mod job;
pub mod link;
pub mod net;
mod port;
pub mod queue;
pub mod server;
pub mod wake;
pub mod worker;

pub use agent::AgentRole;
pub use cluster::{Cluster, ClusterConfig, Outbox, Role, SchedulerRole, Stop};
pub use job::{HostSpec, JobEnd, JobRole, JobSetup, SimJob};
pub use net::{
    Delivery, LinkSpec, LostWhy, NetStats, Network, NodeId, NodeKind, NodeTraffic, SizeHook, TraceEntry, Weigh,
    frame_bytes, nominal_sizes, transfer_ns,
};
pub use queue::EventQueue;
pub use server::{BoundViolation, ServerModel, ServerRole};
pub use worker::{Stage, TableTraining, TrainingLoop, WorkerRecord, WorkerRole};
