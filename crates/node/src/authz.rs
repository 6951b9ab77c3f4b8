//! Who may send what to whom: the authorization table of docs/PROTOCOL.md §7.1, and the
//! sender classes it is written in.
//!
//! A connection's class comes from what it proved: the key of its handshake (the cluster
//! secret or the worker secret) and, once it has one, the identity it proved (a `Hello`
//! with a credential on a server's data port; a registration on the scheduler). The
//! receivers look a message up in [`TABLE`] with [`check`] before anything else, so a
//! forged message changes nothing. The checks that need the receiver's state (a rank
//! field that must be the connection's own, a block's owner by the placement) are the
//! roles' own, beside their handlers; this table is the part that is the same for
//! every message of a kind.
//!
//! The table here and the one in PROTOCOL.md are the same: a test parses the document.

use elasticps_wire::{Control, KeyId, Message, PeerRole};

/// What a connection has proven about its sender.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Class {
    /// `anon`: authenticated with the cluster key, no identity yet.
    Anon,
    /// `anon-w`: authenticated with the worker key, no identity yet.
    AnonWorker,
    /// `worker`: proved a worker identity.
    Worker,
    /// `server`: proved a server identity.
    Server,
    /// `agent`: a host agent (it sent `JoinHost`).
    Agent,
    /// `scheduler`: the scheduler, on the control connection a server opened to it. No
    /// connection to a data port or to the scheduler is of this class: a row that lists
    /// only it says that a server takes the message from the scheduler alone, so anyone
    /// else's on a data connection is `Forbidden`.
    Scheduler,
}

impl Class {
    /// Every class, in the table's order.
    pub const ALL: [Class; 6] =
        [Class::Anon, Class::AnonWorker, Class::Worker, Class::Server, Class::Agent, Class::Scheduler];

    /// The class of a connection with this handshake key and (proven) role.
    pub fn of(key: KeyId, proven: Option<PeerRole>) -> Class {
        match (proven, key) {
            (Some(PeerRole::Worker), _) => Class::Worker,
            (Some(PeerRole::Server), _) => Class::Server,
            (None, KeyId::Cluster) => Class::Anon,
            (None, KeyId::Worker) => Class::AnonWorker,
        }
    }

    /// The class's name in PROTOCOL.md.
    pub fn name(self) -> &'static str {
        match self {
            Class::Anon => "anon",
            Class::AnonWorker => "anon-w",
            Class::Worker => "worker",
            Class::Server => "server",
            Class::Agent => "agent",
            Class::Scheduler => "scheduler",
        }
    }

    /// The class named `name` in PROTOCOL.md.
    pub fn from_name(name: &str) -> Option<Class> {
        Class::ALL.into_iter().find(|c| c.name() == name)
    }
}

/// Who receives a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Receiver {
    /// A server's data port.
    Server,
    /// The scheduler.
    Scheduler,
}

impl Receiver {
    /// The receiver's name in PROTOCOL.md.
    pub fn name(self) -> &'static str {
        match self {
            Receiver::Server => "server",
            Receiver::Scheduler => "scheduler",
        }
    }
}

/// The answer of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The receiver takes this message from this class.
    Allowed,
    /// The receiver takes this message, but not from this class (`Forbidden`).
    Forbidden,
    /// The receiver takes this message from no one (`BadRequest`).
    NotTaken,
}

use Class::{Agent, Anon, AnonWorker as AnonW, Scheduler as Sched, Server as Srv, Worker as Wrk};

/// The authorization table: (message, receiver, the classes it is taken from). A pair
/// not listed is not taken.
pub const TABLE: &[(&str, Receiver, &[Class])] = &[
    // A server's data port.
    ("Hello", Receiver::Server, &[Anon, AnonW]),
    ("GetStats", Receiver::Server, &[Anon, AnonW, Wrk, Srv]),
    ("Push", Receiver::Server, &[Wrk]),
    ("Pull", Receiver::Server, &[Wrk]),
    ("PushPull", Receiver::Server, &[Wrk]),
    ("Init", Receiver::Server, &[Wrk]),
    ("PullRows", Receiver::Server, &[Wrk]),
    ("PushRows", Receiver::Server, &[Wrk]),
    ("SetOptimizer", Receiver::Server, &[Sched]),
    ("GetOptState", Receiver::Server, &[Wrk]),
    ("SetOptState", Receiver::Server, &[Wrk]),
    ("SetValues", Receiver::Server, &[Wrk]),
    ("ExportBlock", Receiver::Server, &[Anon, AnonW, Wrk]),
    ("BlockSnapshot", Receiver::Server, &[Srv]),
    ("BlockDelta", Receiver::Server, &[Srv]),
    ("Replicate", Receiver::Server, &[Srv]),
    ("Forward", Receiver::Server, &[Srv]),
    ("ReplicaSnapshot", Receiver::Server, &[Srv]),
    // The scheduler.
    ("RegisterServer", Receiver::Scheduler, &[Anon]),
    ("RegisterWorker", Receiver::Scheduler, &[Anon, AnonW]),
    ("RejoinWorker", Receiver::Scheduler, &[Anon, AnonW]),
    ("ReattachWorker", Receiver::Scheduler, &[Anon, AnonW]),
    ("ReattachServer", Receiver::Scheduler, &[Anon]),
    ("JoinHost", Receiver::Scheduler, &[Anon]),
    ("Scale", Receiver::Scheduler, &[Anon]),
    ("GetStatus", Receiver::Scheduler, &[Anon, AnonW, Wrk, Srv]),
    ("DefineModel", Receiver::Scheduler, &[Wrk]),
    ("Barrier", Receiver::Scheduler, &[Wrk]),
    ("SetOptimizer", Receiver::Scheduler, &[Wrk]),
    ("WorkerDone", Receiver::Scheduler, &[Wrk]),
    ("WorkerLoad", Receiver::Scheduler, &[Wrk]),
    ("GetLayout", Receiver::Scheduler, &[Anon, AnonW, Wrk, Srv]),
    ("GetStartClock", Receiver::Scheduler, &[Wrk, Srv]),
    ("AssignDone", Receiver::Scheduler, &[Srv]),
    ("MigrateDone", Receiver::Scheduler, &[Srv]),
    ("SplitDone", Receiver::Scheduler, &[Srv]),
    ("ServerLoad", Receiver::Scheduler, &[Srv]),
    ("CheckpointWritten", Receiver::Scheduler, &[Srv]),
    ("WorkerAdded", Receiver::Scheduler, &[Srv]),
    ("OptimizerSet", Receiver::Scheduler, &[Srv]),
    ("Heartbeat", Receiver::Scheduler, &[Wrk, Srv, Agent]),
    ("NodeExited", Receiver::Scheduler, &[Agent]),
    ("HostEvent", Receiver::Scheduler, &[Agent]),
];

/// Every message name: the control variants, then the data kinds.
pub fn all_names() -> impl Iterator<Item = &'static str> {
    Control::NAMES.into_iter().chain([
        "Push",
        "PushAck",
        "Pull",
        "PullReply",
        "Error",
        "Init",
        "PushPull",
        "Forward",
        "PullRows",
        "PullRowsReply",
        "PushRows",
    ])
}

/// A message's name in the table: its control variant's, or its data kind's.
pub fn name_of(msg: &Message) -> &'static str {
    match msg {
        Message::Control(c) => c.name(),
        Message::Push { .. } => "Push",
        Message::PushAck { .. } => "PushAck",
        Message::Pull { .. } => "Pull",
        Message::PullReply { .. } => "PullReply",
        Message::Error(_) => "Error",
        Message::Init { .. } => "Init",
        Message::PushPull { .. } => "PushPull",
        Message::Forward { .. } => "Forward",
        Message::PullRows { .. } => "PullRows",
        Message::PullRowsReply { .. } => "PullRowsReply",
        Message::PushRows { .. } => "PushRows",
    }
}

/// Whether `to` takes message `name` from `from`.
pub fn check(to: Receiver, from: Class, name: &str) -> Verdict {
    match TABLE.iter().find(|(n, r, _)| *n == name && *r == to) {
        None => Verdict::NotTaken,
        Some((_, _, classes)) if classes.contains(&from) => Verdict::Allowed,
        Some(_) => Verdict::Forbidden,
    }
}

/// The identity a message claims for itself, for the log of a refusal beside the one the
/// connection proved: a rank or server id it names, a `Hello`'s credential, the sender a
/// copy or a block's state implies; "nothing" for a message that claims none.
pub fn claimed(msg: &Message) -> String {
    match msg {
        Message::Control(c) => match c {
            Control::Hello { credential } => credential.to_string(),
            Control::WorkerDone { rank } | Control::RejoinWorker { rank } => format!("worker {rank}"),
            Control::ReattachWorker { rank, credential } => format!("worker {rank} ({credential})"),
            Control::WorkerLoad(l) => format!("worker {}", l.rank),
            Control::ServerLoad(l) => format!("server {}", l.server_id),
            Control::AssignDone { server_id } => format!("server {server_id}"),
            Control::MigrateDone(r) => format!("server {} (the source of block {})", r.from, r.block),
            Control::ReattachServer { server_id, credential, .. } => format!("server {server_id} ({credential})"),
            Control::RegisterServer { .. } => "a new server".into(),
            Control::RegisterWorker => "a new worker".into(),
            Control::JoinHost(offer) => format!("host {}", offer.name),
            Control::Replicate { block, push, .. } => {
                format!("the primary of block {block}, forwarding a push of worker {}", push.worker)
            }
            Control::ReplicaSnapshot(state) => format!("the primary of block {}", state.spec.id),
            Control::BlockSnapshot { state, .. } => format!("the owner of block {}", state.spec.id),
            Control::BlockDelta { block, .. } => format!("the owner of block {block}"),
            _ => "nothing".into(),
        },
        Message::Forward { block, worker, .. } => {
            format!("the primary of block {block}, forwarding a push of worker {worker}")
        }
        _ => "nothing".into(),
    }
}

/// A proven identity, as logs and errors name it ("worker 3", "server 1", "no identity").
pub fn proven_name(proven: Option<(PeerRole, u32)>, key: KeyId) -> String {
    match (proven, key) {
        (Some((PeerRole::Worker, id)), _) => format!("worker {id}"),
        (Some((PeerRole::Server, id)), _) => format!("server {id}"),
        (None, KeyId::Cluster) => "no identity (cluster key)".into(),
        (None, KeyId::Worker) => "no identity (worker key)".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_row_names_a_message_once_per_receiver() {
        let names: Vec<_> = all_names().collect();
        for (i, (n, r, classes)) in TABLE.iter().enumerate() {
            assert!(names.contains(n), "{n} is no message");
            assert!(!classes.is_empty(), "{n}: a row with no class is a pair not taken");
            assert!(TABLE[..i].iter().all(|(m, s, _)| !(m == n && s == r)), "{n} twice for {r:?}");
        }
    }

    #[test]
    fn replies_and_server_steps_are_not_taken_from_anyone() {
        for name in ["PushAck", "PullReply", "Error", "Ok", "Welcome", "Settled", "Migrate"] {
            for c in Class::ALL {
                assert_eq!(check(Receiver::Server, c, name), Verdict::NotTaken, "{name}");
            }
        }
        assert_eq!(check(Receiver::Server, Class::Worker, "Replicate"), Verdict::Forbidden);
        assert_eq!(check(Receiver::Server, Class::Worker, "Forward"), Verdict::Forbidden);
        assert_eq!(check(Receiver::Server, Class::Server, "Forward"), Verdict::Allowed);
        assert_eq!(check(Receiver::Server, Class::AnonWorker, "BlockSnapshot"), Verdict::Forbidden);
        assert_eq!(check(Receiver::Scheduler, Class::AnonWorker, "RegisterServer"), Verdict::Forbidden);
        assert_eq!(check(Receiver::Scheduler, Class::Server, "WorkerDone"), Verdict::Forbidden);
        // A tensor's optimizer goes to the scheduler, which sends it on to every server.
        assert_eq!(check(Receiver::Server, Class::Worker, "SetOptimizer"), Verdict::Forbidden);
        assert_eq!(check(Receiver::Scheduler, Class::Worker, "SetOptimizer"), Verdict::Allowed);
        assert_eq!(check(Receiver::Scheduler, Class::Worker, "OptimizerSet"), Verdict::Forbidden);
    }

    #[test]
    fn an_export_is_read_by_an_operator_or_a_worker_and_written_by_no_one() {
        // `elasticps export` with the cluster secret, with the worker secret (a launched
        // script's), or a worker's own connection: it reads what a worker may pull.
        for c in [Class::Anon, Class::AnonWorker, Class::Worker] {
            assert_eq!(check(Receiver::Server, c, "ExportBlock"), Verdict::Allowed, "{c:?}");
            assert_eq!(check(Receiver::Scheduler, c, "GetLayout"), Verdict::Allowed, "{c:?}");
        }
        // Another server has no business exporting, and the reply is taken from no one.
        assert_eq!(check(Receiver::Server, Class::Server, "ExportBlock"), Verdict::Forbidden);
        assert_eq!(check(Receiver::Server, Class::Scheduler, "ExportBlock"), Verdict::Forbidden);
        assert_eq!(check(Receiver::Scheduler, Class::Anon, "ExportBlock"), Verdict::NotTaken);
        for c in Class::ALL {
            assert_eq!(check(Receiver::Server, c, "ExportedBlock"), Verdict::NotTaken, "{c:?}");
        }
    }
}
