//! The slots a host agent offered and the nodes it runs in them: the bound on what it
//! starts. An order (`StartNode`) is taken only for a slot that runs nothing here, and
//! only while fewer nodes of its kind run than the host offered slots for; the rest is
//! refused ([`Refusal`]).

use std::collections::BTreeMap;

use elasticps_wire::{HostOffer, NodeRole};

use super::NodeId;

/// A node this host runs (or is starting) in one slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Local {
    /// The scheduler's slot.
    pub slot: u32,
    /// True for a server, false for a worker.
    pub server: bool,
    /// The worker's rank, once known (ordered for a restart, or read from its events).
    pub rank: Option<u32>,
    /// The process, once the driver started it.
    pub node: Option<NodeId>,
    /// How it is named in logs and messages: `worker slot 4 (rank 1)`.
    pub label: String,
}

/// Why an order starts nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The slot already runs a node here: the order is a duplicate, the node runs on.
    Running(String),
    /// Every slot of the kind runs a node: nothing more starts here.
    Full(String),
    /// The job is over: nothing starts any more.
    Over(String),
}

/// The slots of one host.
#[derive(Debug)]
pub(super) struct Slots {
    server_slots: u32,
    worker_slots: u32,
    by_slot: BTreeMap<u32, Local>,
}

/// The name of a node in `slot`: `server slot 3`, `worker slot 4 (rank 1)`.
pub(super) fn label(slot: u32, role: NodeRole) -> String {
    match role {
        NodeRole::Server => format!("server slot {slot}"),
        NodeRole::Worker { rank: Some(r) } => format!("worker slot {slot} (rank {r})"),
        NodeRole::Worker { rank: None } => format!("worker slot {slot}"),
    }
}

impl Slots {
    /// The slots `offer` makes: its `*_slots`, at least what it starts itself.
    pub fn new(offer: &HostOffer) -> Self {
        Self {
            server_slots: offer.server_slots.max(offer.servers),
            worker_slots: offer.worker_slots.max(offer.workers),
            by_slot: BTreeMap::new(),
        }
    }

    /// Takes the order to start `role` in `slot`, or says why not.
    pub fn admit(&mut self, slot: u32, role: NodeRole) -> Result<&Local, Refusal> {
        if let Some(l) = self.by_slot.get(&slot) {
            return Err(Refusal::Running(format!("slot {slot} already runs {} here", l.label)));
        }
        let server = role == NodeRole::Server;
        let (cap, kind) = if server { (self.server_slots, "server") } else { (self.worker_slots, "worker") };
        let busy: Vec<&str> = self.by_slot.values().filter(|l| l.server == server).map(|l| l.label.as_str()).collect();
        if busy.len() as u32 >= cap {
            return Err(Refusal::Full(format!(
                "this host offered {cap} {kind} slots and runs {} ({})",
                busy.len(),
                if busy.is_empty() { "none".to_string() } else { busy.join(", ") }
            )));
        }
        let rank = match role {
            NodeRole::Worker { rank } => rank,
            NodeRole::Server => None,
        };
        let local = Local { slot, server, rank, node: None, label: label(slot, role) };
        Ok(self.by_slot.entry(slot).or_insert(local))
    }

    /// The driver started `slot`'s node as `node`.
    pub fn spawned(&mut self, slot: u32, node: NodeId) {
        if let Some(l) = self.by_slot.get_mut(&slot) {
            l.node = Some(node);
        }
    }

    /// `slot`'s node could not start: the slot is free again.
    pub fn failed(&mut self, slot: u32) -> Option<Local> {
        self.by_slot.remove(&slot)
    }

    /// `node` exited: its slot is free again.
    pub fn exited(&mut self, node: NodeId) -> Option<Local> {
        let slot = self.by_slot.values().find(|l| l.node == Some(node))?.slot;
        self.by_slot.remove(&slot)
    }

    /// The node `node` runs, if it is one of this host's.
    pub fn get_mut(&mut self, node: NodeId) -> Option<&mut Local> {
        self.by_slot.values_mut().find(|l| l.node == Some(node))
    }

    /// True if no node runs (or is starting).
    pub fn is_empty(&self) -> bool {
        self.by_slot.is_empty()
    }

    /// The names of the nodes that run, by slot.
    pub fn labels(&self) -> Vec<String> {
        self.by_slot.values().map(|l| l.label.clone()).collect()
    }
}
