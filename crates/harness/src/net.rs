//! The simulated network: nodes, connections between them, links with latency and
//! bandwidth, seeded faults, and the virtual clock they all run on.
//!
//! A message of B nominal bytes sent at `now` from node A on a connection to node B:
//! 1. waits in its connection's queue at A's uplink, which serves A's connections in
//!    turn, one whole message each (`Port`), and occupies it for B / up(A);
//! 2. travels the connection's latency (plus a seeded jitter, if any);
//! 3. waits in its connection's queue at B's downlink, served the same way, and occupies
//!    it for B / down(B);
//! 4. is delivered. Every connection is FIFO in each direction (TCP): jitter never
//!    reorders a link.
//!
//! Time is kept in nanoseconds inside (so 32-byte messages on a 10 Gbit/s link do not
//! round up to a microsecond each) and shown to roles in microseconds.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use elasticps_wire::{Dtype, HEADER_LEN, Message, Values};

use crate::port::{Key, Port, key, unkey};
use crate::queue::EventQueue;
use elasticps_node::ConnId;

/// What a message weighs on the wire, bytes (the sim's scale; the frame's size by default:
/// [`frame_bytes`]).
pub type Weigh = std::rc::Rc<dyn Fn(&Message) -> u64>;

/// A node of the simulated cluster: an index into the network's node table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeId(pub u32);

impl NodeId {
    /// The address under which the harness lists this node (e.g. a server's
    /// `data_addr`): `sim:<index>`. [`NodeId::from_addr`] reads it back.
    pub fn addr(self) -> String {
        format!("sim:{}", self.0)
    }

    /// The node an address names, if it is one: `sim:<index>` ([`NodeId::addr`]), or
    /// `<ip>:<index>`, the address of a node on a simulated host ([`Network::addr`]).
    pub fn from_addr(addr: &str) -> Option<NodeId> {
        if let Some(index) = addr.strip_prefix("sim:") {
            return index.parse().ok().map(NodeId);
        }
        let (ip, index) = addr.rsplit_once(':')?;
        ip.trim_matches(['[', ']']).parse::<std::net::IpAddr>().ok()?;
        index.parse().ok().map(NodeId)
    }
}

/// What a node is, for traces and for the cluster's owner; the network only treats the
/// scheduler's connections apart (unshaped control frames).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NodeKind {
    /// The scheduler.
    Scheduler,
    /// The harness's i-th server (the scheduler numbers servers itself, in the order
    /// they register).
    Server(u32),
    /// The harness's i-th worker.
    Worker(u32),
    /// Anything else (a test driver, an operator's `elasticps scale`).
    Other(u32),
}

/// A node's link to the network.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkSpec {
    /// One-way latency of this node's connections, in microseconds. A connection takes
    /// the larger of its two ends' latencies unless it has its own
    /// ([`Network::set_conn_latency`]).
    pub latency_us: u64,
    /// Upload bandwidth in bytes per second; 0 is unlimited.
    pub up_bps: u64,
    /// Download bandwidth in bytes per second; 0 is unlimited.
    pub down_bps: u64,
}

impl Default for LinkSpec {
    /// 50 us latency, unlimited bandwidth.
    fn default() -> Self {
        Self { latency_us: 50, up_bps: 0, down_bps: 0 }
    }
}

impl LinkSpec {
    /// Both directions capped at `mbps` megabytes per second (`--server-bandwidth IDX=MBPS`).
    pub fn capped_mbps(self, mbps: f64) -> Self {
        let bps = (mbps * 1e6).round().max(1.0) as u64;
        Self { up_bps: bps, down_bps: bps, ..self }
    }
}

/// The nominal size of a message on the wire, in bytes: what a link is charged.
pub type SizeHook = Box<dyn Fn(&Message) -> u64>;

/// The default [`SizeHook`]: the frame's header plus its payload ([`payload_bytes`]).
pub fn frame_bytes(msg: &Message) -> u64 {
    HEADER_LEN as u64 + payload_bytes(msg)
}

/// The payload bytes of `msg`'s frame, as its header's `payload_len` says. Tensor payloads
/// cost nothing to measure; a control message is encoded to learn its length.
pub fn payload_bytes(msg: &Message) -> u64 {
    let payload = match msg {
        Message::Push { values, .. }
        | Message::PullReply { values, .. }
        | Message::Init { values, .. }
        | Message::PushPull { values, .. }
        | Message::PullRowsReply { values, .. } => values.wire_len(),
        Message::PullRows { ids, .. } => ids.as_bytes().len(),
        Message::PushRows { ids, grads, .. } => {
            elasticps_wire::PUSH_ROWS_PREFIX + ids.as_bytes().len() + grads.as_bytes().len()
        }
        Message::Forward { values, .. } => elasticps_wire::FORWARD_PREFIX + values.wire_len(),
        Message::PushAck { .. } | Message::Pull { .. } => 0,
        Message::Control(_) | Message::Error(_) => msg.encode_payload().map_or(0, |b| b.len()),
    };
    payload as u64
}

/// A [`SizeHook`] for a simulation that carries tensor sizes, not bytes: a Push,
/// PullReply, Init or PushPull of block b costs the header plus `block_bytes[b]` (its nominal
/// size), whatever it holds; every other message costs [`frame_bytes`].
pub fn nominal_sizes(block_bytes: Vec<u64>) -> SizeHook {
    Box::new(move |msg| match msg {
        Message::Push { block, .. }
        | Message::PullReply { block, .. }
        | Message::Init { block, .. }
        | Message::PushPull { block, .. } => {
            let nominal = block_bytes.get(*block as usize).copied();
            nominal.map_or_else(|| frame_bytes(msg), |b| HEADER_LEN as u64 + b)
        }
        Message::Forward { block, .. } => {
            let nominal = block_bytes.get(*block as usize).copied();
            let prefix = elasticps_wire::FORWARD_PREFIX as u64;
            nominal.map_or_else(|| frame_bytes(msg), |b| HEADER_LEN as u64 + prefix + b)
        }
        _ => frame_bytes(msg),
    })
}

/// Why a connection was lost, as its end learns it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LostWhy {
    /// This node closed it.
    ClosedHere,
    /// The peer closed it (after the messages it had sent were delivered).
    ClosedByPeer,
    /// The network dropped it (a fault): what was in flight is gone.
    Dropped,
    /// The peer crashed.
    PeerCrashed,
}

impl LostWhy {
    /// In words, for the roles' `why`.
    pub fn as_str(self) -> &'static str {
        match self {
            LostWhy::ClosedHere => "closed by this node",
            LostWhy::ClosedByPeer => "closed the connection",
            LostWhy::Dropped => "connection dropped by the network",
            LostWhy::PeerCrashed => "the peer crashed",
        }
    }
}

/// What the network hands to a node.
// Returned and consumed at once: boxing the message would cost an allocation a delivery.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Delivery {
    /// A message arrived.
    Message {
        /// The receiving node.
        node: NodeId,
        /// The connection, as the receiver knows it.
        conn: ConnId,
        /// Its request id.
        request_id: u64,
        /// The message.
        msg: Message,
    },
    /// A connection of this node is gone.
    Lost {
        /// The node.
        node: NodeId,
        /// The connection.
        conn: ConnId,
        /// Why.
        why: LostWhy,
    },
    /// A timer the node set fired.
    Timer {
        /// The node.
        node: NodeId,
        /// The token it set the timer with.
        token: u64,
    },
}

/// Counters of a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NetStats {
    /// Messages accepted by [`Network::send`].
    pub sent: u64,
    /// Messages delivered to a live node.
    pub delivered: u64,
    /// Messages lost: in flight on a dropped connection, to a closed end or a dead node.
    pub lost: u64,
    /// Nominal bytes of the messages sent.
    pub bytes: u64,
    /// Timers fired.
    pub timers: u64,
}

/// Bytes through one node's link.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeTraffic {
    /// Nominal bytes sent.
    pub bytes_up: u64,
    /// Nominal bytes delivered to it.
    pub bytes_down: u64,
    /// Messages delivered to it.
    pub messages_in: u64,
}

#[derive(Debug)]
struct NodeState {
    kind: NodeKind,
    link: LinkSpec,
    alive: bool,
    /// Its limited uplink: messages (slots) and closes waiting to leave.
    up: Port<Outgoing>,
    /// Its limited downlink: messages (slots) arrived and waiting to come in.
    down: Port<u32>,
    conns: Vec<ConnId>,
    traffic: NodeTraffic,
    /// The IP address of its simulated host, if it runs on one.
    ip: Option<String>,
}

/// What waits at a node's uplink: a message (its slot), or a close sent after them.
#[derive(Debug)]
enum Outgoing {
    Message(u32),
    Fin,
}

#[derive(Debug)]
struct Conn {
    ends: [NodeId; 2],
    /// End i still sends and receives.
    open: [bool; 2],
    /// The connection carries anything at all (false once dropped or closed by both).
    alive: bool,
    latency_ns: Option<u64>,
    /// The latest arrival scheduled toward end i, to keep each direction FIFO.
    last_arrival_ns: [u64; 2],
    /// End i's messages sent to leave later (a busy CPU's replies) leave no earlier than
    /// this, to keep the connection FIFO.
    hold_until_ns: [u64; 2],
}

/// A message on its way; the events refer to it by slot, so it is moved once in and
/// once out whatever the route.
#[derive(Debug)]
struct InFlight {
    request_id: u64,
    bytes: u64,
    msg: Compact,
}

/// A message packed for the slab: the data-plane kinds inline (a slab entry of 72 bytes instead of
/// [`Message`]'s 200, which the control messages need), the rest boxed.
#[derive(Debug)]
enum Compact {
    Push { block: u32, clock: u32, values: Values },
    PushAck { block: u32, clock: u32 },
    Pull { block: u32, clock: u32, reply: Dtype },
    PullReply { block: u32, clock: u32, values: Values },
    PushPull { block: u32, clock: u32, values: Values, reply: Dtype },
    Other(Box<Message>),
}

impl From<Message> for Compact {
    fn from(m: Message) -> Self {
        match m {
            Message::Push { block, clock, values } => Compact::Push { block, clock, values },
            Message::PushAck { block, clock } => Compact::PushAck { block, clock },
            Message::Pull { block, clock, reply } => Compact::Pull { block, clock, reply },
            Message::PullReply { block, clock, values } => Compact::PullReply { block, clock, values },
            Message::PushPull { block, clock, values, reply } => Compact::PushPull { block, clock, values, reply },
            other => Compact::Other(Box::new(other)),
        }
    }
}

impl From<Compact> for Message {
    fn from(c: Compact) -> Self {
        match c {
            Compact::Push { block, clock, values } => Message::Push { block, clock, values },
            Compact::PushAck { block, clock } => Message::PushAck { block, clock },
            Compact::Pull { block, clock, reply } => Message::Pull { block, clock, reply },
            Compact::PullReply { block, clock, values } => Message::PullReply { block, clock, values },
            Compact::PushPull { block, clock, values, reply } => Message::PushPull { block, clock, values, reply },
            Compact::Other(m) => *m,
        }
    }
}

#[derive(Debug)]
enum Ev {
    /// A message sent to leave later joins its sender's (limited) uplink.
    Leave { conn: u32, from_end: u8, item: Outgoing },
    /// A node's (limited) uplink is free again.
    UpFree { node: NodeId },
    /// A message reaches the receiver's (limited) downlink.
    Arrive { conn: u32, to_end: u8, slot: u32 },
    /// A message is handed to the receiver (`shaped`: it comes off its limited downlink,
    /// which is free from now).
    Deliver { conn: u32, to_end: u8, slot: u32, shaped: bool },
    /// A graceful close reaches end `to_end` (after what was sent before it).
    Fin { conn: u32, to_end: u8 },
    /// A node learns a connection is gone.
    Lost { conn: u32, end: u8, why: LostWhy },
    /// A node's timer.
    Timer { node: NodeId, token: u64 },
}

/// One delivered event, kept when tracing is on ([`Network::set_trace`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceEntry {
    /// Virtual time, in nanoseconds.
    pub time_ns: u64,
    /// The receiving node.
    pub node: NodeId,
    /// What: `msg <kind> conn <c> req <r> block <b> clock <t> bytes <n>`, `lost ...`, `timer ...`.
    pub what: String,
}

/// The simulated network and its virtual clock.
pub struct Network {
    nodes: Vec<NodeState>,
    conns: Vec<Conn>,
    queue: EventQueue<Ev>,
    in_flight: Vec<Option<InFlight>>,
    free_slots: Vec<u32>,
    now_ns: u64,
    rng: StdRng,
    jitter_ns: u64,
    size_of: SizeHook,
    digest: u64,
    stats: NetStats,
    trace: Option<Vec<TraceEntry>>,
    /// How long the last delivered message occupied its receiver's downlink.
    last_transfer_ns: u64,
}

impl std::fmt::Debug for Network {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Network")
            .field("nodes", &self.nodes.len())
            .field("conns", &(self.conns.len() - 1))
            .field("now_ns", &self.now_ns)
            .field("queued", &self.queue.len())
            .field("stats", &self.stats)
            .finish()
    }
}

const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

fn mix(h: u64, x: u64) -> u64 {
    (h ^ x).wrapping_mul(FNV_PRIME).rotate_left(23)
}

/// Nanoseconds that `bytes` take at `bps` bytes per second (0: unlimited), rounded up.
pub fn transfer_ns(bytes: u64, bps: u64) -> u64 {
    if bps == 0 {
        return 0;
    }
    match bytes.checked_mul(1_000_000_000) {
        Some(x) => x.div_ceil(bps),
        None => (u128::from(bytes) * 1_000_000_000).div_ceil(u128::from(bps)) as u64,
    }
}

impl Network {
    /// An empty network at time 0 whose jitter (if any) draws from `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            nodes: Vec::new(),
            // Connection 0 is never handed out: ids start at 1, as in the runtime.
            conns: vec![Conn {
                ends: [NodeId(u32::MAX); 2],
                open: [false; 2],
                alive: false,
                latency_ns: None,
                last_arrival_ns: [0; 2],
                hold_until_ns: [0; 2],
            }],
            queue: EventQueue::new(),
            in_flight: Vec::new(),
            free_slots: Vec::new(),
            now_ns: 0,
            rng: StdRng::seed_from_u64(seed),
            jitter_ns: 0,
            size_of: Box::new(frame_bytes),
            digest: 0xcbf2_9ce4_8422_2325,
            stats: NetStats::default(),
            trace: None,
            last_transfer_ns: 0,
        }
    }

    /// Adds every message a uniform extra delay in `[0, jitter_us]`, drawn from the seed.
    pub fn set_jitter_us(&mut self, jitter_us: u64) {
        self.jitter_ns = jitter_us * 1_000;
    }

    /// Replaces the nominal size of a message (default [`frame_bytes`]); the simulator
    /// charges a block's nominal bytes for a payload of one or a few values
    /// ([`nominal_sizes`]).
    pub fn set_size_hook(&mut self, hook: impl Fn(&Message) -> u64 + 'static) {
        self.size_of = Box::new(hook);
    }

    /// Keeps every delivered event in a trace ([`Network::trace`]); off by default.
    pub fn set_trace(&mut self, on: bool) {
        self.trace = on.then(Vec::new);
    }

    /// The trace so far (empty unless [`Network::set_trace`] is on).
    pub fn trace(&self) -> &[TraceEntry] {
        self.trace.as_deref().unwrap_or(&[])
    }

    /// Adds a node with its link; it is alive and has no connection.
    pub fn add_node(&mut self, kind: NodeKind, link: LinkSpec) -> NodeId {
        self.nodes.push(NodeState {
            kind,
            link,
            alive: true,
            up: Port::default(),
            down: Port::default(),
            conns: Vec::new(),
            traffic: NodeTraffic::default(),
            ip: None,
        });
        NodeId(self.nodes.len() as u32 - 1)
    }

    /// Puts `node` on the simulated host of IP address `ip`: its connections come from
    /// that address, and it serves at [`Network::addr`] `<ip>:<index>`.
    pub fn set_ip(&mut self, node: NodeId, ip: &str) {
        if let Some(n) = self.nodes.get_mut(node.0 as usize) {
            n.ip = Some(ip.to_string());
        }
    }

    /// The IP address of `node`'s simulated host, if it runs on one.
    pub fn ip(&self, node: NodeId) -> Option<&str> {
        self.nodes.get(node.0 as usize)?.ip.as_deref()
    }

    /// The address `node` serves at: `<ip>:<index>` on a simulated host, else
    /// [`NodeId::addr`]; [`NodeId::from_addr`] reads both back.
    pub fn addr(&self, node: NodeId) -> String {
        match self.ip(node) {
            Some(ip) => format!("{ip}:{}", node.0),
            None => node.addr(),
        }
    }

    /// Changes a node's link from now on (a straggler appears or goes away).
    pub fn set_link(&mut self, node: NodeId, link: LinkSpec) {
        if let Some(n) = self.nodes.get_mut(node.0 as usize) {
            n.link = link;
        }
    }

    /// A node's link.
    pub fn link(&self, node: NodeId) -> Option<LinkSpec> {
        self.nodes.get(node.0 as usize).map(|n| n.link)
    }

    /// What `node` is.
    pub fn kind(&self, node: NodeId) -> Option<NodeKind> {
        self.nodes.get(node.0 as usize).map(|n| n.kind)
    }

    /// Number of nodes ever added.
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// True unless the node crashed.
    pub fn is_alive(&self, node: NodeId) -> bool {
        self.nodes.get(node.0 as usize).is_some_and(|n| n.alive)
    }

    /// The bytes through a node's link so far.
    pub fn traffic(&self, node: NodeId) -> NodeTraffic {
        self.nodes.get(node.0 as usize).map(|n| n.traffic).unwrap_or_default()
    }

    /// Opens a connection between `a` and `b` (no handshake: `b` learns of it with the
    /// first message). Both ends know it by the returned id.
    pub fn connect(&mut self, a: NodeId, b: NodeId) -> ConnId {
        let id = self.conns.len() as ConnId;
        let alive = self.is_alive(a) && self.is_alive(b);
        self.conns.push(Conn {
            ends: [a, b],
            open: [alive; 2],
            alive,
            latency_ns: None,
            last_arrival_ns: [0; 2],
            hold_until_ns: [0; 2],
        });
        for n in [a, b] {
            if let Some(n) = self.nodes.get_mut(n.0 as usize) {
                n.conns.push(id);
            }
        }
        id
    }

    /// The connections of `node` that still carry anything, with the peer at the other
    /// end (to pick one to drop).
    pub fn connections(&self, node: NodeId) -> Vec<(ConnId, NodeId)> {
        let Some(n) = self.nodes.get(node.0 as usize) else { return Vec::new() };
        n.conns
            .iter()
            .filter(|c| self.conns.get(**c as usize).is_some_and(|c| c.alive))
            .filter_map(|c| Some((*c, self.peer(node, *c)?)))
            .collect()
    }

    /// Gives one connection its own one-way latency.
    pub fn set_conn_latency(&mut self, conn: ConnId, latency_us: u64) {
        if let Some(c) = self.conns.get_mut(conn as usize) {
            c.latency_ns = Some(latency_us * 1_000);
        }
    }

    /// The other end of `conn` as `node` sees it.
    pub fn peer(&self, node: NodeId, conn: ConnId) -> Option<NodeId> {
        let c = self.conns.get(conn as usize).filter(|_| conn != 0)?;
        match c.ends {
            [a, b] if a == node => Some(b),
            [a, b] if b == node => Some(a),
            _ => None,
        }
    }

    /// True while `node` can send on `conn`.
    pub fn is_open(&self, node: NodeId, conn: ConnId) -> bool {
        self.end(node, conn).is_some_and(|e| {
            let c = &self.conns[conn as usize];
            c.alive && c.open[e]
        })
    }

    fn end(&self, node: NodeId, conn: ConnId) -> Option<usize> {
        let c = self.conns.get(conn as usize).filter(|_| conn != 0)?;
        c.ends.iter().position(|e| *e == node)
    }

    /// How long the message just delivered took to come in over its receiver's downlink,
    /// first byte to last, in nanoseconds (what a real server reads as a frame's time).
    pub fn last_transfer_ns(&self) -> u64 {
        self.last_transfer_ns
    }

    /// The virtual time, in microseconds.
    pub fn now_us(&self) -> u64 {
        self.now_ns / 1_000
    }

    /// The virtual time, in nanoseconds.
    pub fn now_ns(&self) -> u64 {
        self.now_ns
    }

    /// Counters so far.
    pub fn stats(&self) -> NetStats {
        self.stats
    }

    /// A digest of everything delivered so far (time, node, connection, kind, request id,
    /// block, clock, size, in order): two runs are the same run iff their digests match.
    pub fn digest(&self) -> u64 {
        self.digest
    }

    /// Events scheduled and not yet handled.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// The time of the next event, in nanoseconds.
    pub fn next_time_ns(&mut self) -> Option<u64> {
        self.queue.peek_time()
    }

    /// Sends `msg` from `from` on `conn`. Returns false (and sends nothing) if `from`
    /// is not an open end of `conn` or is dead.
    pub fn send(&mut self, from: NodeId, conn: ConnId, request_id: u64, msg: Message) -> bool {
        self.send_at(from, conn, request_id, msg, self.now_ns)
    }

    /// [`Network::send`], the message leaving no earlier than `at_ns` (a reply that a
    /// busy node's CPU finishes later; FIFO on the sender's uplink and on the connection).
    pub fn send_at(&mut self, from: NodeId, conn: ConnId, request_id: u64, msg: Message, at_ns: u64) -> bool {
        let Some(end) = self.end(from, conn) else { return false };
        let c = &self.conns[conn as usize];
        if !c.alive || !c.open[end] || !self.nodes[from.0 as usize].alive {
            return false;
        }
        let to = c.ends[1 - end];
        let bytes = (self.size_of)(&msg);
        let now = self.now_ns.max(at_ns);
        // The scheduler's connections carry small control frames and are not shaped (the
        // runtime's shaper caps a server's data sockets, not its scheduler connection): they
        // take the latency only, and never wait behind a node's data.
        let control = self.nodes[from.0 as usize].kind == NodeKind::Scheduler
            || self.nodes[to.0 as usize].kind == NodeKind::Scheduler;
        let sender = &mut self.nodes[from.0 as usize];
        sender.traffic.bytes_up += bytes;
        let (conn, end) = (conn as u32, end as u8);
        let k = key(conn, end);
        let shaped = (sender.link.up_bps != 0 && !control) || sender.up.holds(k).is_some();
        self.stats.sent += 1;
        self.stats.bytes += bytes;
        let flight = InFlight { request_id, bytes, msg: msg.into() };
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.in_flight[slot as usize] = Some(flight);
                slot
            }
            None => {
                self.in_flight.push(Some(flight));
                (self.in_flight.len() - 1) as u32
            }
        };
        let hold = &mut self.conns[conn as usize].hold_until_ns[end as usize];
        if !shaped {
            self.travel(conn, end, slot, now);
        } else if now > self.now_ns || waits_to_leave(*hold, self.now_ns) {
            *hold = (*hold).max(now);
            let at = *hold;
            self.queue.push(at, Ev::Leave { conn, from_end: end, item: Outgoing::Message(slot) });
        } else {
            self.queue_up(from, k, Outgoing::Message(slot));
        }
        true
    }

    /// Offers `item` to `node`'s uplink on connection `k`: it goes on the link now if the
    /// link is free and nothing waits, else it waits its turn ([`Port`]) and an event
    /// frees the link when its message is through.
    fn queue_up(&mut self, node: NodeId, k: Key, item: Outgoing) {
        let port = &mut self.nodes[node.0 as usize].up;
        match port.offer(self.now_ns, k, item) {
            Some(item) => {
                self.put_up(node, k, item);
            }
            None => {
                if let Some(at) = port.wake_at() {
                    self.queue.push(at, Ev::UpFree { node });
                }
            }
        }
    }

    /// Puts the next messages waiting at `node`'s free uplink on it, until one takes it.
    fn serve_uplink(&mut self, node: NodeId) {
        while let Some((k, item)) = self.nodes[node.0 as usize].up.next() {
            if self.put_up(node, k, item) {
                return;
            }
        }
    }

    /// `item` of connection `k` goes on `node`'s free uplink: a message occupies it until
    /// all of it is out, and leaves then (true); a close leaves at once without taking it,
    /// and a message of a connection gone meanwhile is lost (false).
    fn put_up(&mut self, node: NodeId, k: Key, item: Outgoing) -> bool {
        let (conn, end) = unkey(k);
        let slot = match item {
            Outgoing::Message(slot) => slot,
            Outgoing::Fin => {
                let to_end = 1 - end;
                let left = self.now_ns + self.latency_ns(conn);
                let last = &mut self.conns[conn as usize].last_arrival_ns[to_end as usize];
                let arrival = left.max(*last);
                *last = arrival;
                self.queue.push(arrival, Ev::Fin { conn, to_end });
                return false;
            }
        };
        if !self.conns[conn as usize].alive || !self.is_alive(node) {
            self.lose_flight(slot);
            return false;
        }
        let bytes = self.in_flight[slot as usize].as_ref().map_or(0, |f| f.bytes);
        let n = &mut self.nodes[node.0 as usize];
        let done = self.now_ns + transfer_ns(bytes, n.link.up_bps);
        // Only a link others wait for needs an event when it is free again.
        let wake = n.up.waiting();
        n.up.occupy(k, done, wake);
        if wake {
            self.queue.push(done, Ev::UpFree { node });
        }
        self.travel(conn, end, slot, done);
        true
    }

    /// The one-way latency of `conn`: its own, or the larger of its ends'.
    fn latency_ns(&self, conn: u32) -> u64 {
        let c = &self.conns[conn as usize];
        let l = |n: NodeId| self.nodes[n.0 as usize].link.latency_us;
        c.latency_ns.unwrap_or_else(|| l(c.ends[0]).max(l(c.ends[1])) * 1_000)
    }

    /// Message `slot`, all out of end `from_end` of `conn` at `left_ns`, travels the
    /// latency (and a jitter) to the other end's downlink, or to the node if that is not
    /// limited; never before what was sent before it on the connection.
    fn travel(&mut self, conn: u32, from_end: u8, slot: u32, left_ns: u64) {
        let to_end = 1 - from_end;
        let latency = self.latency_ns(conn);
        let jitter = if self.jitter_ns == 0 { 0 } else { self.rng.random_range(0..=self.jitter_ns) };
        let c = &mut self.conns[conn as usize];
        let arrival = (left_ns + latency + jitter).max(c.last_arrival_ns[to_end as usize]);
        c.last_arrival_ns[to_end as usize] = arrival;
        let [from, to] = if from_end == 0 { c.ends } else { [c.ends[1], c.ends[0]] };
        let control = [from, to].iter().any(|n| self.nodes[n.0 as usize].kind == NodeKind::Scheduler);
        let ev = if self.nodes[to.0 as usize].link.down_bps != 0 && !control {
            Ev::Arrive { conn, to_end, slot }
        } else {
            Ev::Deliver { conn, to_end, slot, shaped: false }
        };
        self.queue.push(arrival, ev);
    }

    fn take_flight(&mut self, slot: u32) -> Option<InFlight> {
        let f = self.in_flight.get_mut(slot as usize)?.take();
        self.free_slots.push(slot);
        f
    }

    /// Message `slot` is lost on the way (its connection or a node is gone).
    fn lose_flight(&mut self, slot: u32) {
        self.take_flight(slot);
        self.stats.lost += 1;
    }

    /// `node` closes `conn` gracefully: it learns at once ([`LostWhy::ClosedHere`]) and
    /// receives nothing more on it; the peer receives what was already sent, then
    /// learns the connection is gone ([`LostWhy::ClosedByPeer`]).
    pub fn close(&mut self, node: NodeId, conn: ConnId) {
        let Some(end) = self.end(node, conn) else { return };
        let now = self.now_ns;
        let c = &mut self.conns[conn as usize];
        if !c.alive || !c.open[end] {
            return;
        }
        c.open[end] = false;
        let (conn, end) = (conn as u32, end as u8);
        let hold = c.hold_until_ns[end as usize];
        self.queue.push(now, Ev::Lost { conn, end, why: LostWhy::ClosedHere });
        // After what this end sent before.
        if waits_to_leave(hold, now) {
            self.queue.push(hold, Ev::Leave { conn, from_end: end, item: Outgoing::Fin });
        } else {
            self.queue_up(node, key(conn, end), Outgoing::Fin);
        }
    }

    /// A fault: the network drops `conn`. What is in flight on it is lost, and both
    /// ends learn it now ([`LostWhy::Dropped`]).
    pub fn drop_conn(&mut self, conn: ConnId) {
        self.kill_conn(conn, None);
    }

    fn kill_conn(&mut self, conn: ConnId, crashed: Option<NodeId>) {
        let Some(c) = self.conns.get_mut(conn as usize).filter(|_| conn != 0) else { return };
        if !c.alive {
            return;
        }
        c.alive = false;
        let ends = c.ends;
        let mut waiting = Vec::new();
        for (end, node) in ends.iter().enumerate() {
            let k = key(conn as u32, end as u8);
            if let Some(n) = self.nodes.get_mut(node.0 as usize) {
                waiting.extend(n.up.drain(k).into_iter().filter_map(|o| match o {
                    Outgoing::Message(slot) => Some(slot),
                    Outgoing::Fin => None,
                }));
                waiting.extend(n.down.drain(k));
            }
        }
        for slot in waiting {
            self.lose_flight(slot);
        }
        let now = self.now_ns;
        let c = &mut self.conns[conn as usize];
        for end in 0..2 {
            if !std::mem::take(&mut c.open[end]) || Some(c.ends[end]) == crashed {
                continue;
            }
            let why = if crashed.is_some() { LostWhy::PeerCrashed } else { LostWhy::Dropped };
            self.queue.push(now, Ev::Lost { conn: conn as u32, end: end as u8, why });
        }
    }

    /// A fault: `node` crashes. It receives nothing more (messages, timers) and sends
    /// nothing. With `peers_notice` (a process dies, its OS resets its sockets) every
    /// connection of it drops and its peers learn it now ([`LostWhy::PeerCrashed`]);
    /// without (a machine vanishes) its peers notice nothing: what they send is lost,
    /// and only their timeouts find out.
    pub fn crash(&mut self, node: NodeId, peers_notice: bool) {
        let Some(n) = self.nodes.get_mut(node.0 as usize) else { return };
        n.alive = false;
        let conns = if peers_notice { std::mem::take(&mut n.conns) } else { Vec::new() };
        for conn in conns {
            self.kill_conn(conn, Some(node));
        }
    }

    /// `node`, crashed, is started again (a process restarted on the same address): it
    /// receives and sends again, on new connections only; every connection it had is
    /// gone (its peers that had not noticed learn it now, [`LostWhy::PeerCrashed`]).
    pub fn revive(&mut self, node: NodeId) {
        let Some(n) = self.nodes.get_mut(node.0 as usize) else { return };
        let conns = std::mem::take(&mut n.conns);
        for conn in conns {
            self.kill_conn(conn, Some(node));
        }
        if let Some(n) = self.nodes.get_mut(node.0 as usize) {
            n.alive = true;
        }
    }

    /// Wakes `node` at `at_us` (now, if that is past) with `token`.
    pub fn set_timer(&mut self, node: NodeId, at_us: u64, token: u64) {
        let at = at_us.saturating_mul(1_000).max(self.now_ns);
        self.queue.push(at, Ev::Timer { node, token });
    }

    /// Advances the clock to the next event for a live node and returns it, or `None`
    /// if nothing is scheduled. Events at or after `until_ns` stay queued (and `None`
    /// is returned; the clock moves to `until_ns`).
    pub fn next_before(&mut self, until_ns: u64) -> Option<Delivery> {
        loop {
            match self.queue.peek_time() {
                Some(t) if t < until_ns => {}
                _ => {
                    self.now_ns = self.now_ns.max(until_ns.min(self.queue.peek_time().unwrap_or(until_ns)));
                    return None;
                }
            }
            let (time, ev) = self.queue.pop()?;
            self.now_ns = time;
            if let Some(d) = self.handle(ev) {
                return Some(d);
            }
        }
    }

    /// [`Network::next_before`] with no limit.
    pub fn next_event(&mut self) -> Option<Delivery> {
        self.next_before(u64::MAX)
    }

    fn handle(&mut self, ev: Ev) -> Option<Delivery> {
        match ev {
            Ev::Leave { conn, from_end, item } => {
                let node = self.conns[conn as usize].ends[from_end as usize];
                self.queue_up(node, key(conn, from_end), item);
                None
            }
            Ev::UpFree { node } => {
                self.nodes[node.0 as usize].up.free();
                self.serve_uplink(node);
                None
            }
            Ev::Arrive { conn, to_end, slot } => {
                let c = &self.conns[conn as usize];
                let to = c.ends[to_end as usize];
                if !c.alive {
                    self.lose_flight(slot);
                    return None;
                }
                // Else it waits its turn: the message on the link frees it when delivered.
                let k = key(conn, to_end);
                if let Some(slot) = self.nodes[to.0 as usize].down.offer(self.now_ns, k, slot) {
                    self.put_down(to, k, slot);
                }
                None
            }
            Ev::Deliver { conn, to_end, slot, shaped } => {
                if shaped {
                    let to = self.conns[conn as usize].ends[to_end as usize];
                    self.nodes[to.0 as usize].down.free();
                    self.serve_downlink(to);
                }
                let InFlight { request_id, bytes, msg } = self.take_flight(slot)?;
                let msg = Message::from(msg);
                let c = &self.conns[conn as usize];
                let to = c.ends[to_end as usize];
                let n = &mut self.nodes[to.0 as usize];
                if !c.alive || !c.open[to_end as usize] || !n.alive {
                    self.stats.lost += 1;
                    return None;
                }
                n.traffic.bytes_down += bytes;
                n.traffic.messages_in += 1;
                self.last_transfer_ns = transfer_ns(bytes, n.link.down_bps);
                self.stats.delivered += 1;
                let (block, clock) = msg.block_clock();
                let mut h = mix(self.digest, self.now_ns);
                h = mix(h, u64::from(to.0) << 32 | u64::from(conn));
                h = mix(h, (msg.kind() as u64) << 56 ^ request_id);
                h = mix(h, u64::from(block) << 32 | u64::from(clock));
                self.digest = mix(h, bytes);
                let conn = ConnId::from(conn);
                if let Some(t) = self.trace.as_mut() {
                    let what = format!(
                        "msg {:?} conn {conn} req {request_id} block {block} clock {clock} bytes {bytes}",
                        msg.kind()
                    );
                    t.push(TraceEntry { time_ns: self.now_ns, node: to, what });
                }
                Some(Delivery::Message { node: to, conn, request_id, msg })
            }
            Ev::Fin { conn, to_end } => {
                let c = &self.conns[conn as usize];
                let to = c.ends[to_end as usize];
                if !c.alive {
                    return None;
                }
                // Behind what this connection still has on the receiver's downlink.
                if let Some(free_ns) = self.nodes[to.0 as usize].down.holds(key(conn, to_end)) {
                    self.queue.push(free_ns, Ev::Fin { conn, to_end });
                    return None;
                }
                let c = &mut self.conns[conn as usize];
                c.alive = false;
                if !std::mem::take(&mut c.open[to_end as usize]) {
                    return None;
                }
                self.lost(conn, to_end, LostWhy::ClosedByPeer)
            }
            Ev::Lost { conn, end, why } => self.lost(conn, end, why),
            Ev::Timer { node, token } => {
                if !self.is_alive(node) {
                    return None;
                }
                self.stats.timers += 1;
                self.digest = mix(mix(mix(self.digest, self.now_ns), u64::from(node.0)), token);
                if let Some(t) = self.trace.as_mut() {
                    t.push(TraceEntry { time_ns: self.now_ns, node, what: format!("timer {token}") });
                }
                Some(Delivery::Timer { node, token })
            }
        }
    }

    /// Puts the next messages waiting at `node`'s free downlink on it, until one takes it.
    fn serve_downlink(&mut self, node: NodeId) {
        while let Some((k, slot)) = self.nodes[node.0 as usize].down.next() {
            if self.put_down(node, k, slot) {
                return;
            }
        }
    }

    /// Message `slot` of connection `k` goes on `node`'s free downlink and is delivered
    /// when all of it is in, which frees the link (true); a message of a connection gone
    /// meanwhile is lost without taking it (false).
    fn put_down(&mut self, node: NodeId, k: Key, slot: u32) -> bool {
        let (conn, end) = unkey(k);
        if !self.conns[conn as usize].alive {
            self.lose_flight(slot);
            return false;
        }
        let bytes = self.in_flight[slot as usize].as_ref().map_or(0, |f| f.bytes);
        let n = &mut self.nodes[node.0 as usize];
        let done = self.now_ns + transfer_ns(bytes, n.link.down_bps);
        n.down.occupy(k, done, true);
        self.queue.push(done, Ev::Deliver { conn, to_end: end, slot, shaped: true });
        true
    }

    fn lost(&mut self, conn: u32, end: u8, why: LostWhy) -> Option<Delivery> {
        let node = self.conns[conn as usize].ends[end as usize];
        if !self.is_alive(node) {
            return None;
        }
        self.digest = mix(mix(mix(self.digest, self.now_ns), u64::from(node.0) << 32 | u64::from(conn)), why as u64);
        if let Some(t) = self.trace.as_mut() {
            t.push(TraceEntry { time_ns: self.now_ns, node, what: format!("lost conn {conn}: {}", why.as_str()) });
        }
        Some(Delivery::Lost { node, conn: ConnId::from(conn), why })
    }
}

/// True while a message an end sent may still wait to leave: its `Leave` is at `hold`
/// (0: none yet), maybe at this very time and not handled yet. What the end sends next
/// queues behind it (an event at `hold` or later, FIFO among equal times), so each end of
/// a connection stays FIFO.
fn waits_to_leave(hold_ns: u64, now_ns: u64) -> bool {
    hold_ns != 0 && hold_ns >= now_ns
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_packed_message_is_small_and_unpacks_to_itself() {
        assert!(std::mem::size_of::<InFlight>() <= 72, "{}", std::mem::size_of::<InFlight>());
        for m in [
            push(3, 4),
            Message::PushAck { block: 1, clock: 2 },
            Message::Pull { block: 1, clock: 2, reply: Dtype::F32 },
            Message::PullReply { block: 1, clock: 2, values: Values::from_vec(vec![1.0]) },
            Message::Init { block: 1, values: Values::from_vec(vec![1.0]) },
            Message::PushPull { block: 1, clock: 2, values: Values::from_vec(vec![1.0]), reply: Dtype::F32 },
            elasticps_wire::Control::Heartbeat.into(),
        ] {
            assert_eq!(Message::from(Compact::from(m.clone())), m);
        }
    }

    fn push(block: u32, clock: u32) -> Message {
        Message::Push { block, clock, values: Values::from_vec(vec![0.0; 1]) }
    }

    /// Every delivery until the queue is empty: (time in ns, node, conn, block, clock).
    fn drain(net: &mut Network) -> Vec<(u64, u32, ConnId, u32, u32)> {
        let mut out = Vec::new();
        for _ in 0..100_000 {
            match net.next_event() {
                Some(Delivery::Message { node, conn, msg, .. }) => {
                    let (b, c) = msg.block_clock();
                    out.push((net.now_ns(), node.0, conn, b, c));
                }
                Some(_) => {}
                None => return out,
            }
        }
        panic!("the network did not go quiet within 100000 events");
    }

    #[test]
    fn a_message_takes_the_latency_and_bytes_over_bandwidth_on_each_link() {
        let mut net = Network::new(1);
        net.set_size_hook(|m| if let Message::Push { block, .. } = m { 1_000 * (u64::from(*block) + 1) } else { 32 });
        // 1 MB/s up at a, 0.5 MB/s down at b; latency max(50, 20) us.
        let a = net.add_node(NodeKind::Worker(0), LinkSpec { latency_us: 50, up_bps: 1_000_000, down_bps: 0 });
        let b = net.add_node(NodeKind::Server(0), LinkSpec { latency_us: 20, up_bps: 0, down_bps: 500_000 });
        let c = net.connect(a, b);
        assert!(net.send(a, c, 0, push(0, 0))); // 1000 B: 1 ms up, 50 us, 2 ms down
        assert!(net.send(a, c, 0, push(1, 0))); // 2000 B: up 1..3 ms, arrives 3.05 ms, down 3.05..7.05 ms
        let got = drain(&mut net);
        assert_eq!(got, [(3_050_000, 1, c, 0, 0), (7_050_000, 1, c, 1, 0)]);
        assert_eq!(net.traffic(a).bytes_up, 3_000);
        assert_eq!(net.traffic(b).bytes_down, 3_000);
        assert_eq!(transfer_ns(1_000, 1_000_000), 1_000_000);
        assert_eq!(transfer_ns(32, 1_250_000_000), 26); // 25.6 ns rounded up
        assert_eq!(transfer_ns(u64::MAX / 4, 1 << 40), ((u128::from(u64::MAX / 4) * 1_000_000_000) >> 40) as u64 + 1);
    }

    #[test]
    fn a_connection_backlog_delays_another_connections_message_by_one_message_not_all() {
        let mut net = Network::new(1);
        net.set_size_hook(|m| if let Message::Push { block, .. } = m { 1_000 * u64::from(*block) + 32 } else { 32 });
        // A server whose uplink and downlink carry 1 MB/s: a message of block 1 takes ~1 ms.
        let slow = LinkSpec { latency_us: 0, up_bps: 1_000_000, down_bps: 1_000_000 };
        let s = net.add_node(NodeKind::Server(0), slow);
        let (a, b) = (net.add_node(NodeKind::Worker(0), slow), net.add_node(NodeKind::Worker(1), slow));
        let (ca, cb) = (net.connect(a, s), net.connect(b, s));
        for _ in 0..10 {
            net.send(s, ca, 0, push(1, 0)); // 10 replies to a: 10 ms of the server's uplink
            net.send(a, ca, 0, push(1, 1)); // 10 pushes of a: 10 ms of the server's downlink
        }
        net.send(s, cb, 0, push(0, 2)); // then an ack to b
        net.send(b, cb, 0, push(0, 3)); // and a pull of b
        let got = drain(&mut net);
        let at = |node: u32, clock: u32| got.iter().find(|d| d.1 == node && d.4 == clock).map(|d| d.0);
        // Each waits for the one message on the link, not for a's ten.
        assert!(at(b.0, 2).unwrap() < 2_200_000, "{got:?}");
        assert!(at(s.0, 3).unwrap() < 2_200_000, "{got:?}");
        // Each connection stays FIFO, and a's messages all arrive.
        assert_eq!(got.iter().filter(|d| d.2 == ca).count(), 20);
    }

    #[test]
    fn the_default_size_is_the_frame_and_nominal_sizes_charge_a_block_its_bytes() {
        assert_eq!(frame_bytes(&push(0, 0)), 32 + 4);
        assert_eq!(frame_bytes(&Message::Pull { block: 0, clock: 0, reply: Dtype::F32 }), 32);
        let hb: Message = elasticps_wire::Control::Heartbeat.into();
        assert_eq!(frame_bytes(&hb), 32 + hb.encode_payload().unwrap().len() as u64);
        let hook = nominal_sizes(vec![4_000_000, 512]);
        assert_eq!(hook(&push(0, 0)), 32 + 4_000_000);
        assert_eq!(hook(&Message::PullReply { block: 1, clock: 0, values: Values::from_vec(vec![1.0]) }), 32 + 512);
        assert_eq!(hook(&push(7, 0)), 36, "a block the hook does not know costs its frame");
        assert_eq!(hook(&Message::Pull { block: 0, clock: 0, reply: Dtype::F32 }), 32);
        let fused = Message::PushPull { block: 0, clock: 0, values: Values::from_vec(vec![1.0]), reply: Dtype::F32 };
        assert_eq!((frame_bytes(&fused), hook(&fused)), (36, 32 + 4_000_000), "a push_pull carries the gradient");
    }

    #[test]
    fn unlimited_links_cost_only_latency_and_a_link_override_wins() {
        let mut net = Network::new(1);
        let a = net.add_node(NodeKind::Worker(0), LinkSpec::default());
        let b = net.add_node(NodeKind::Server(0), LinkSpec { latency_us: 70, ..LinkSpec::default() });
        let c1 = net.connect(a, b);
        let c2 = net.connect(b, a);
        net.set_conn_latency(c2, 5);
        net.send(a, c1, 0, push(0, 0));
        net.send(a, c2, 0, push(1, 0));
        net.send(b, c1, 0, push(2, 0));
        assert_eq!(drain(&mut net), [(5_000, 1, c2, 1, 0), (70_000, 1, c1, 0, 0), (70_000, 0, c1, 2, 0)]);
        assert_eq!(net.peer(a, c1), Some(b));
        assert_eq!(net.peer(b, c2), Some(a));
        assert_eq!(NodeId::from_addr(&b.addr()), Some(b));
    }

    /// Found by `bench sim --suite` (seed 11): a busy server's `PushAck` leaves at the end
    /// of its CPU time, 1 us ahead; the pull's reply, sent in that very microsecond by an
    /// event scheduled before the ack's departure, overtook it, and the worker failed with
    /// "reply to no request of this round". What an end sent leaves in the order sent.
    #[test]
    fn a_message_sent_while_an_earlier_one_waits_to_leave_at_this_very_time_leaves_after_it() {
        let mut net = Network::new(1);
        let shaped = LinkSpec { latency_us: 5, up_bps: 1_000_000_000, down_bps: 0 };
        let s = net.add_node(NodeKind::Server(0), shaped);
        let w = net.add_node(NodeKind::Worker(0), LinkSpec::default());
        let c = net.connect(w, s);
        // Scheduled first: the event at 10 us on which the server sends its second message.
        net.set_timer(s, 10, 0);
        assert!(net.send_at(s, c, 0, push(0, 1), 10_000)); // leaves at 10 us (a busy CPU)
        assert!(matches!(net.next_event(), Some(Delivery::Timer { .. })));
        assert_eq!(net.now_ns(), 10_000);
        assert!(net.send_at(s, c, 0, push(0, 2), 0)); // now, in the same microsecond
        let clocks: Vec<u32> = drain(&mut net).iter().map(|d| d.4).collect();
        assert_eq!(clocks, [1, 2], "the second message overtook the first");
    }

    #[test]
    fn links_are_fifo_under_jitter_and_a_seed_is_one_run() {
        let run = |seed: u64| {
            let mut net = Network::new(seed);
            net.set_jitter_us(200);
            let a = net.add_node(NodeKind::Worker(0), LinkSpec::default());
            let b = net.add_node(NodeKind::Worker(1), LinkSpec::default());
            let s = net.add_node(NodeKind::Server(0), LinkSpec::default());
            let (ca, cb) = (net.connect(a, s), net.connect(b, s));
            for i in 0..200 {
                net.send(a, ca, 0, push(0, i));
                net.send(b, cb, 0, push(1, i));
            }
            let got = drain(&mut net);
            for block in 0..2 {
                let clocks: Vec<u32> = got.iter().filter(|d| d.3 == block).map(|d| d.4).collect();
                assert_eq!(clocks, (0..200).collect::<Vec<_>>(), "link of block {block} reordered");
            }
            let interleaving: Vec<u32> = got.iter().map(|d| d.3).collect();
            (net.digest(), interleaving)
        };
        let (d1, i1) = run(7);
        let (d2, i2) = run(7);
        let (d3, i3) = run(8);
        assert_eq!((d1, &i1), (d2, &i2));
        assert_ne!(d1, d3);
        assert_ne!(i1, i3, "jitter should interleave the two links differently");
    }

    #[test]
    fn a_dropped_connection_loses_what_is_in_flight_and_both_ends_learn_it() {
        let mut net = Network::new(1);
        let a = net.add_node(NodeKind::Worker(0), LinkSpec::default());
        let b = net.add_node(NodeKind::Server(0), LinkSpec::default());
        let c = net.connect(a, b);
        let other = net.connect(a, b);
        net.send(a, c, 0, push(0, 0));
        net.send(b, c, 0, push(1, 0));
        net.send(a, other, 0, push(2, 0));
        net.drop_conn(c);
        assert!(!net.send(a, c, 0, push(3, 0)), "a dropped connection takes nothing");
        let mut lost = Vec::new();
        let mut msgs = Vec::new();
        while let Some(d) = net.next_event() {
            match d {
                Delivery::Lost { node, conn, why } => lost.push((node, conn, why, net.now_ns())),
                Delivery::Message { msg, .. } => msgs.push(msg.block_clock().0),
                Delivery::Timer { .. } => {}
            }
        }
        assert_eq!(lost, [(a, c, LostWhy::Dropped, 0), (b, c, LostWhy::Dropped, 0)]);
        assert_eq!(msgs, [2], "only the other connection's message arrives");
        assert_eq!(net.stats().lost, 2);
    }

    #[test]
    fn a_graceful_close_delivers_what_was_sent_then_the_loss() {
        let mut net = Network::new(1);
        let a = net.add_node(NodeKind::Scheduler, LinkSpec::default());
        let b = net.add_node(NodeKind::Worker(0), LinkSpec { down_bps: 1_000_000, ..LinkSpec::default() });
        let c = net.connect(a, b);
        net.send(a, c, 0, push(0, 0));
        net.send(b, c, 0, push(1, 0)); // toward the closing end: lost
        net.close(a, c);
        let mut seen = Vec::new();
        while let Some(d) = net.next_event() {
            match d {
                Delivery::Lost { node, why, .. } => seen.push(format!("{} lost {why:?}", node.0)),
                Delivery::Message { node, msg, .. } => seen.push(format!("{} got {}", node.0, msg.block_clock().0)),
                Delivery::Timer { .. } => {}
            }
        }
        assert_eq!(seen, ["0 lost ClosedHere", "1 got 0", "1 lost ClosedByPeer"]);
    }

    #[test]
    fn a_crashed_node_receives_nothing_and_its_peers_learn_it_if_they_can() {
        let mut net = Network::new(1);
        let a = net.add_node(NodeKind::Worker(0), LinkSpec::default());
        let b = net.add_node(NodeKind::Server(0), LinkSpec::default());
        let s = net.add_node(NodeKind::Scheduler, LinkSpec::default());
        let (ab, bs) = (net.connect(a, b), net.connect(b, s));
        net.send(a, ab, 0, push(0, 0));
        net.set_timer(b, 10, 1);
        net.crash(b, true);
        assert!(!net.send(b, bs, 0, push(1, 0)));
        let mut seen = Vec::new();
        while let Some(d) = net.next_event() {
            seen.push(format!("{d:?}"));
        }
        assert_eq!(seen.len(), 2, "{seen:?}");
        assert!(seen.iter().all(|d| d.contains("PeerCrashed")), "{seen:?}");

        // Silently: the peer notices nothing and its messages vanish.
        let mut net = Network::new(1);
        let a = net.add_node(NodeKind::Worker(0), LinkSpec::default());
        let b = net.add_node(NodeKind::Server(0), LinkSpec::default());
        let ab = net.connect(a, b);
        net.crash(b, false);
        assert!(net.send(a, ab, 0, push(0, 0)));
        assert!(net.next_event().is_none());
        assert_eq!(net.stats().lost, 1);
    }

    #[test]
    fn next_before_stops_at_the_limit_and_moves_the_clock_there() {
        let mut net = Network::new(1);
        let a = net.add_node(NodeKind::Worker(0), LinkSpec::default());
        net.set_timer(a, 100, 7);
        assert!(net.next_before(50_000).is_none());
        assert_eq!(net.now_us(), 50);
        assert!(matches!(net.next_before(200_000), Some(Delivery::Timer { token: 7, .. })));
        assert_eq!(net.now_us(), 100);
        net.set_timer(a, 10, 8); // in the past: fires now
        assert!(matches!(net.next_event(), Some(Delivery::Timer { token: 8, .. })));
        assert_eq!(net.now_us(), 100);
    }
}
