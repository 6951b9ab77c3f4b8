//! One push per host, the runtime's side of [`elasticps_node::worker::group`]: the
//! leader's world (a loopback listener, its members' connections, their gradients and
//! the values it pulled) run by [`crate::driver::drive`] in a task of its own, and a
//! member's link to its leader.
//!
//! Rendezvous: `elasticps launch` gives the workers it starts together on one host of a
//! job across hosts a private directory (`ELASTICPS_HOST_GROUP`), the group's size
//! (`ELASTICPS_HOST_GROUP_SIZE`) and each its rank in the group
//! (`ELASTICPS_HOST_GROUP_RANK`; the "local rank" below). Local rank 0 listens on 127.0.0.1 and writes its address to `leader` in that directory
//! (written whole, then renamed); the others read it, dial it with the job's handshake
//! (the worker secret), and say `JoinGroup`. On the connection (docs/PROTOCOL.md §9) a
//! member sends `Push { block: tensor, clock, values }` (f32; empty for no gradient),
//! answered `PushAck` once the leader summed it, and `Pull { block: tensor, clock }`,
//! answered `PullReply` with the values the leader pulled at that clock or later.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use elasticps_core::sync::Clock;
use elasticps_node::ConnId;
use elasticps_node::timing::{GROUP_ADDRESS_POLL_US, GROUP_JOIN_TIMEOUT_US};
use elasticps_node::worker::PushOp;
use elasticps_node::worker::group::{Effect, Input, Leader};
use elasticps_wire::{Codec, Control, Dtype, ErrorCode, ErrorReply, KeyId, Message, Values};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};

use crate::conn::{FrameReader, Outbox};
use crate::driver::{self, World};
use crate::error::{Result, RuntimeError};
use crate::timer::Timer;
use crate::{Micros, handshake};

/// Where a worker stands in its host's group (from `elasticps launch`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupOptions {
    /// The group's private directory, where the leader writes its address.
    pub dir: PathBuf,
    /// Workers in the group, the leader included.
    pub size: u32,
    /// This worker's local rank: 0 leads.
    pub local_rank: u32,
}

/// The variables `elasticps launch` sets for a worker in a host group.
pub mod vars {
    /// The group's directory.
    pub const DIR: &str = "ELASTICPS_HOST_GROUP";
    /// How many workers the group has.
    pub const SIZE: &str = "ELASTICPS_HOST_GROUP_SIZE";
    /// The worker's rank in its group (0 leads).
    pub const RANK: &str = "ELASTICPS_HOST_GROUP_RANK";
}
use vars::{DIR as GROUP_DIR_VAR, RANK as GROUP_RANK_VAR, SIZE as GROUP_SIZE_VAR};

impl GroupOptions {
    /// The host group `elasticps launch` put this process in, if any: `None` without
    /// [`GROUP_DIR_VAR`] or for a group of one; an error for a size or local rank that
    /// does not parse or does not fit.
    pub fn from_env() -> Result<Option<Self>> {
        let Some(dir) = std::env::var_os(GROUP_DIR_VAR).filter(|d| !d.is_empty()) else { return Ok(None) };
        let num = |var: &str| -> Result<u32> {
            let v = std::env::var(var).unwrap_or_default();
            v.parse().map_err(|_| {
                RuntimeError::Usage(format!("{GROUP_DIR_VAR} is set, so {var} must be a number, not {v:?}"))
            })
        };
        let (size, local_rank) = (num(GROUP_SIZE_VAR)?, num(GROUP_RANK_VAR)?);
        if local_rank >= size {
            return Err(RuntimeError::Usage(format!(
                "{GROUP_RANK_VAR}={local_rank} is not below {GROUP_SIZE_VAR}={size}"
            )));
        }
        Ok((size > 1).then(|| GroupOptions { dir: dir.into(), size, local_rank }))
    }
}

/// A worker's part in its host group, once started.
pub(super) enum Group {
    /// Local rank 0: sums the group's gradients, shares what it pulled.
    Leader(LeaderHandle),
    /// Any other: its link to the leader.
    Member(Box<MemberLink>),
}

impl Group {
    /// Starts this worker's part: the leader listens and writes its address; a member
    /// dials it and joins.
    pub(super) async fn start(opts: &GroupOptions, codec: &Codec, lens: Vec<usize>) -> Result<Group> {
        if opts.local_rank == 0 {
            LeaderHandle::start(opts, codec, lens).await.map(Group::Leader)
        } else {
            MemberLink::join(opts, codec).await.map(|m| Group::Member(Box::new(m)))
        }
    }
}

/// The members' gradients of a gather: member by member in local rank order, tensor by
/// tensor as asked (empty: none).
type Gathered = Vec<Vec<Vec<f32>>>;

/// What the client asks of the leader's task.
enum Command {
    /// The leader's round pushes `tensors` at `clock`: the members' gradients of them
    /// (member by member in local rank order, tensor by tensor as listed; empty: none).
    Gather { clock: Clock, tensors: Vec<u32>, reply: oneshot::Sender<Gathered> },
    /// The leader pulled these values at `clock`.
    Publish { clock: Clock, values: Vec<(u32, Bytes)> },
    /// The leader's work is done: end once the members left.
    End { reply: oneshot::Sender<Vec<u32>> },
}

/// The leader's side: its task's command channel.
pub(super) struct LeaderHandle {
    commands: mpsc::UnboundedSender<Command>,
    size: u32,
}

impl LeaderHandle {
    async fn start(opts: &GroupOptions, codec: &Codec, lens: Vec<usize>) -> Result<LeaderHandle> {
        let tensors = lens.len() as u32;
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| RuntimeError::io("host group leader: listening on 127.0.0.1", e))?;
        let addr = listener.local_addr().map_err(|e| RuntimeError::io("host group leader: its address", e))?;
        write_address(&opts.dir, &addr.to_string())?;
        tracing::info!(%addr, size = opts.size, "host group leader listening");
        let size = opts.size;
        let (commands, rx) = mpsc::unbounded_channel();
        let (events_tx, events) = mpsc::channel(64);
        let accept = tokio::spawn(accept_loop(listener, codec.clone(), opts.size, events_tx));
        let mut world = LeaderWorld {
            commands: rx,
            events,
            conns: HashMap::new(),
            grads: HashMap::new(),
            values: vec![None; tensors as usize],
            lens,
            size,
            gathering: None,
            ending: None,
            accept,
        };
        tokio::spawn(async move {
            let mut machine = Leader::new(size, tensors);
            let mut timer = Timer::new(Micros::new());
            driver::drive(&mut machine, &mut world, &mut timer, VecDeque::new()).await;
            world.accept.abort();
        });
        Ok(LeaderHandle { commands, size: opts.size })
    }

    /// The members' gradients of `tensors` at `clock` (see [`Command::Gather`]).
    pub(super) async fn gather(&self, clock: Clock, tensors: Vec<u32>) -> Result<Gathered> {
        let (reply, rx) = oneshot::channel();
        self.commands.send(Command::Gather { clock, tensors, reply }).map_err(|_| gone())?;
        rx.await.map_err(|_| gone())
    }

    /// Hands the members the values pulled at `clock`.
    pub(super) fn publish(&self, clock: Clock, values: Vec<(u32, Bytes)>) -> Result<()> {
        self.commands.send(Command::Publish { clock, values }).map_err(|_| gone())
    }

    /// Waits until every member left (or the end wait ran out); returns the local ranks
    /// that had not.
    pub(super) async fn end(&self) -> Vec<u32> {
        let (reply, rx) = oneshot::channel();
        if self.commands.send(Command::End { reply }).is_err() {
            return Vec::new();
        }
        rx.await.unwrap_or_default()
    }

    /// Workers in the group, the leader included.
    pub(super) fn size(&self) -> u32 {
        self.size
    }
}

fn gone() -> RuntimeError {
    RuntimeError::Closed("the host group leader's task".into())
}

/// Writes the leader's address to `dir/leader`: whole, then renamed into place.
fn write_address(dir: &Path, addr: &str) -> Result<()> {
    let tmp = dir.join(format!(".leader.{}", std::process::id()));
    std::fs::write(&tmp, addr).map_err(|e| RuntimeError::io(format!("writing {}", tmp.display()), e))?;
    let to = dir.join("leader");
    std::fs::rename(&tmp, &to)
        .map_err(|e| RuntimeError::io(format!("renaming {} to {}", tmp.display(), to.display()), e))
}

/// What the accept task and the readers tell the leader's world.
enum Event {
    /// A member's connection passed the handshake.
    Connected { conn: ConnId, outbox: Outbox },
    /// A frame from a member's connection, or its end (`None`).
    Frame { conn: ConnId, msg: Option<Box<Message>> },
}

/// What woke the leader's world.
enum Woken {
    Event(Event),
    Command(Option<Command>),
}

/// The leader's world (see the module).
struct LeaderWorld {
    commands: mpsc::UnboundedReceiver<Command>,
    events: mpsc::Receiver<Event>,
    conns: HashMap<ConnId, Outbox>,
    /// The members' gradients in hand, by connection and tensor.
    grads: HashMap<(ConnId, u32), Vec<f32>>,
    /// The values the leader pulled, per tensor, with their clock.
    values: Vec<Option<(Clock, Bytes)>>,
    /// Each tensor's length: a member's gradient is of it, or empty.
    lens: Vec<usize>,
    /// Workers in the group, the leader included.
    size: u32,
    /// The leader's round waiting for the members' gradients.
    gathering: Option<(Vec<u32>, oneshot::Sender<Gathered>)>,
    /// The leader's end wait.
    ending: Option<oneshot::Sender<Vec<u32>>>,
    accept: tokio::task::JoinHandle<()>,
}

impl LeaderWorld {
    fn send(&self, conn: ConnId, msg: Message) {
        if let Some(o) = self.conns.get(&conn) {
            let _ = o.send((0, msg));
        }
    }

    /// A member's connection is gone (closed, or refused): its outbox and its gradients
    /// in hand with it.
    fn forget(&mut self, conn: ConnId) {
        self.conns.remove(&conn);
        self.grads.retain(|(c, _), _| *c != conn);
    }
}

impl World<Leader> for LeaderWorld {
    type Woken = Woken;
    type End = ();

    async fn wait(&mut self) -> Woken {
        tokio::select! {
            c = self.commands.recv() => Woken::Command(c),
            e = self.events.recv() => match e {
                Some(e) => Woken::Event(e),
                None => std::future::pending().await,
            },
        }
    }

    async fn feed(
        &mut self,
        machine: &mut Leader,
        now_us: u64,
        woken: Option<Woken>,
        out: &mut Vec<Effect>,
    ) -> ControlFlow<()> {
        let input = match woken {
            None => Input::Timeout,
            Some(Woken::Command(None)) => return ControlFlow::Break(()),
            Some(Woken::Command(Some(Command::Gather { clock, tensors, reply }))) => {
                // Its effects (`Gathered`, at once if every gradient is in hand) are carried
                // out after this.
                machine.handle_into(now_us, Input::Gather { clock, tensors: &tensors }, out);
                self.gathering = Some((tensors, reply));
                return ControlFlow::Continue(());
            }
            Some(Woken::Command(Some(Command::Publish { clock, values }))) => {
                let tensors: Vec<u32> = values.iter().map(|(t, _)| *t).collect();
                for (t, v) in values {
                    if let Some(slot) = self.values.get_mut(t as usize) {
                        *slot = Some((clock, v));
                    }
                }
                machine.handle_into(now_us, Input::Published { clock, tensors: &tensors }, out);
                return ControlFlow::Continue(());
            }
            Some(Woken::Command(Some(Command::End { reply }))) => {
                self.ending = Some(reply);
                Input::Ending
            }
            Some(Woken::Event(Event::Connected { conn, outbox })) => {
                // At most one connection per seat: a connection past them is closed (its
                // outbox dropped) before it can say anything.
                if self.conns.len() + 1 < self.size as usize {
                    self.conns.insert(conn, outbox);
                } else {
                    tracing::warn!(
                        conn,
                        size = self.size,
                        "host group leader: a connection past the group's size, closed"
                    );
                }
                return ControlFlow::Continue(());
            }
            Some(Woken::Event(Event::Frame { conn, .. })) if !self.conns.contains_key(&conn) => {
                // A connection closed or refused: what it still sends is not read.
                return ControlFlow::Continue(());
            }
            Some(Woken::Event(Event::Frame { conn, msg: None })) => {
                self.forget(conn);
                Input::Closed { conn }
            }
            Some(Woken::Event(Event::Frame { conn, msg: Some(msg) })) => match *msg {
                Message::Control(Control::JoinGroup { local_rank }) => Input::Join { conn, local: local_rank },
                Message::Push { block, clock, values } => {
                    let len = self.lens.get(block as usize).copied().unwrap_or(0);
                    if !values.is_empty() && (values.len() != len || values.is_sparse()) {
                        Input::Unexpected { conn, kind: "a gradient of another length than its tensor's" }
                    } else {
                        self.grads.insert((conn, block), values.to_vec());
                        Input::Gradient { conn, tensor: block, clock }
                    }
                }
                Message::Pull { block, clock, .. } => Input::Wants { conn, tensor: block, clock },
                other => Input::Unexpected { conn, kind: kind_name(&other) },
            },
        };
        machine.handle_into(now_us, input, out);
        ControlFlow::Continue(())
    }

    async fn carry_out(
        &mut self,
        _machine: &mut Leader,
        _now_us: u64,
        effect: Effect,
        _queue: &mut VecDeque<Effect>,
    ) -> ControlFlow<()> {
        match effect {
            Effect::Welcome { conn } => self.send(conn, Control::Ok.into()),
            Effect::Refuse { conn, why } => {
                self.send(conn, Message::Error(ErrorReply::new(ErrorCode::BadRequest, why)));
                // Dropping the outbox ends the writer once the error is written; the
                // reader ends with the connection.
                self.forget(conn);
            }
            Effect::Gathered { clock: _, members } => {
                if let Some((tensors, reply)) = self.gathering.take() {
                    let got = members
                        .iter()
                        .map(|m| tensors.iter().map(|t| self.grads.remove(&(*m, *t)).unwrap_or_default()).collect())
                        .collect();
                    let _ = reply.send(got);
                }
            }
            Effect::Ack { conn, tensor, clock } => self.send(conn, Message::PushAck { block: tensor, clock }),
            Effect::Send { conn, tensor } => {
                if let Some(Some((clock, v))) = self.values.get(tensor as usize) {
                    let values = Values::from_wire(v.clone(), Dtype::F32).unwrap_or_default();
                    self.send(conn, Message::PullReply { block: tensor, clock: *clock, values });
                }
            }
            Effect::Over { left } => {
                if let Some(reply) = self.ending.take() {
                    let _ = reply.send(left);
                }
                return ControlFlow::Break(());
            }
        }
        ControlFlow::Continue(())
    }
}

/// Accepts the members' connections: at most `size` in their handshake at once, each
/// then read by a task of its own.
async fn accept_loop(listener: TcpListener, codec: Codec, size: u32, events: mpsc::Sender<Event>) {
    let handshakes = Arc::new(tokio::sync::Semaphore::new(size as usize));
    let mut next: ConnId = 1;
    loop {
        let (mut tcp, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Members that have not joined yet time out naming the leader.
                tracing::error!(error = %e, "host group leader: accepting failed; no more members");
                return;
            }
        };
        let Ok(permit) = handshakes.clone().try_acquire_owned() else {
            tracing::warn!(%peer, "host group leader: too many connections in their handshake; refused");
            continue;
        };
        let conn = next;
        next += 1;
        let (codec, events) = (codec.clone(), events.clone());
        tokio::spawn(async move {
            let name = format!("host group member at {peer}");
            let worker_secret = (codec.key() == KeyId::Worker).then(|| codec.secret());
            let shook =
                handshake::accept_with(&mut tcp, codec.secret(), worker_secret, &name, handshake::HANDSHAKE_TIMEOUT)
                    .await;
            drop(permit);
            if let Err(e) = shook {
                tracing::warn!(error = %e, "host group leader: a connection failed its handshake");
                return;
            }
            let (mut reader, outbox) = crate::conn::split(tcp, codec, name);
            if events.send(Event::Connected { conn, outbox }).await.is_err() {
                return;
            }
            loop {
                let msg = match reader.next().await {
                    Ok(Some((_, msg))) => Some(Box::new(msg)),
                    Ok(None) => None,
                    Err(e) => {
                        tracing::warn!(error = %e, "host group leader: a member's connection failed");
                        None
                    }
                };
                let end = msg.is_none();
                if events.send(Event::Frame { conn, msg }).await.is_err() || end {
                    return;
                }
            }
        });
    }
}

/// A member's link to its leader (see the module).
pub(super) struct MemberLink {
    reader: FrameReader,
    outbox: Outbox,
    /// Gradients sent and not yet acknowledged: tensor -> clock.
    unacked: BTreeMap<u32, Clock>,
    /// Values the leader sent, not yet asked for (a reply read while waiting for another).
    replies: HashMap<u32, (Clock, Values)>,
    timeout: Duration,
}

/// What a member waits for, in errors.
const LEADER: &str = "the host group's leader (local rank 0)";

impl MemberLink {
    async fn join(opts: &GroupOptions, codec: &Codec) -> Result<MemberLink> {
        let wait = Duration::from_micros(GROUP_JOIN_TIMEOUT_US);
        let path = opts.dir.join("leader");
        let what = format!("{LEADER} to write its address to {}", path.display());
        let mut timer = Timer::new(Micros::new());
        let addr = crate::timeout(wait, what, async {
            loop {
                match std::fs::read_to_string(&path) {
                    Ok(a) if !a.is_empty() => return Ok(a),
                    _ => {
                        timer.arm(Some(timer.now_us() + GROUP_ADDRESS_POLL_US));
                        timer.fired().await;
                    }
                }
            }
        })
        .await?;
        let stream = crate::conn::dial_with(&addr, codec, LEADER, None).await?;
        let (mut reader, outbox) = crate::conn::split(stream, codec.clone(), LEADER.into());
        let join = Control::JoinGroup { local_rank: opts.local_rank }.into();
        outbox.send_all_now(vec![(0, join)]).await?;
        let what = format!("{LEADER} to take JoinGroup of local rank {}", opts.local_rank);
        match crate::timeout(wait, what, reader.next()).await? {
            Some((_, Message::Control(Control::Ok))) => {}
            Some((_, Message::Error(reply))) => return Err(RuntimeError::Remote { peer: LEADER.into(), reply }),
            Some((_, other)) => return Err(RuntimeError::unexpected(LEADER, "Ok", &other)),
            None => return Err(RuntimeError::Closed(LEADER.into())),
        }
        tracing::info!(local_rank = opts.local_rank, size = opts.size, %addr, "joined the host group");
        Ok(MemberLink {
            reader,
            outbox,
            unacked: BTreeMap::new(),
            replies: HashMap::new(),
            timeout: Duration::from_micros(elasticps_node::timing::REQUEST_TIMEOUT_US),
        })
    }

    /// Waits at most this long for each answer of the leader.
    pub(super) fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Sends the leader this round's gradients (`None`: a tensor not in the round; an
    /// empty one: no gradient), each once the previous one of its tensor was summed.
    pub(super) async fn send_gradients(&mut self, clock: Clock, grads: &[Option<&[f32]>]) -> Result<()> {
        let mut frames = Vec::new();
        for (t, g) in grads.iter().enumerate() {
            let Some(g) = g else { continue };
            let t = t as u32;
            while self.unacked.contains_key(&t) {
                self.read_one(format!("{LEADER} to sum the gradient of tensor {t}")).await?;
            }
            self.unacked.insert(t, clock);
            frames.push((0, Message::Push { block: t, clock, values: Values::from_slice(g) }));
        }
        self.outbox.send_all_now(frames).await
    }

    /// Fills `params` (`None`: a tensor not pulled) with the values the leader pulled at
    /// `clock` or later.
    pub(super) async fn fetch(&mut self, clock: Clock, params: &mut [Option<&mut [f32]>]) -> Result<()> {
        let asks: Vec<(u64, Message)> = params
            .iter()
            .enumerate()
            .filter(|(t, p)| p.is_some() && self.replies.get(&(*t as u32)).is_none_or(|(c, _)| *c < clock))
            .map(|(t, _)| (0, Message::Pull { block: t as u32, clock, reply: Dtype::F32 }))
            .collect();
        self.outbox.send_all_now(asks).await?;
        for (t, p) in params.iter_mut().enumerate() {
            let Some(p) = p else { continue };
            let t = t as u32;
            loop {
                if let Some((c, v)) = self.replies.remove(&t)
                    && c >= clock
                {
                    if v.len() != p.len() {
                        return Err(RuntimeError::Protocol {
                            peer: LEADER.into(),
                            what: format!("values of tensor {t} hold {}, not {}", v.len(), p.len()),
                        });
                    }
                    v.copy_into(p);
                    break;
                }
                self.read_one(format!("{LEADER} to send the values of tensor {t} at clock {clock}")).await?;
            }
        }
        Ok(())
    }

    /// Reads one answer of the leader, within the timeout.
    async fn read_one(&mut self, what: String) -> Result<()> {
        match crate::timeout(self.timeout, what, self.reader.next()).await? {
            Some((_, Message::PushAck { block, clock })) => {
                if self.unacked.get(&block) == Some(&clock) {
                    self.unacked.remove(&block);
                }
                Ok(())
            }
            Some((_, Message::PullReply { block, clock, values })) => {
                self.replies.insert(block, (clock, values));
                Ok(())
            }
            Some((_, Message::Error(reply))) => Err(RuntimeError::Remote { peer: LEADER.into(), reply }),
            Some((_, other)) => Err(RuntimeError::unexpected(LEADER, "PushAck or PullReply", &other)),
            None => Err(RuntimeError::Closed(LEADER.into())),
        }
    }
}

/// What a message is called in a leader's refusal.
fn kind_name(msg: &Message) -> &'static str {
    match msg {
        Message::Control(c) => c.name(),
        Message::PushPull { .. } => "PushPull",
        Message::Init { .. } => "Init",
        _ => "a frame of another kind",
    }
}

impl super::Client {
    /// One round as this worker's part in its host group says (see the module): alone,
    /// the round itself; as the leader, the members' gradients summed into its own
    /// before the push and the values it pulled handed to them after; as a member, its
    /// gradients to the leader and "no gradient" pushed to the same blocks, its pull
    /// answered by the leader. Initial values (`PushOp::Init`) always go to the servers.
    pub(super) async fn round(
        &mut self,
        push: Option<(PushOp, &[Option<&[f32]>])>,
        mut pull: Option<(Clock, &mut [Option<&mut [f32]>])>,
    ) -> Result<()> {
        let grad_clock = match push {
            Some((PushOp::Grad(c), _)) => Some(c),
            _ => None,
        };
        if self.opts.group.is_none() || (grad_clock.is_none() && pull.is_none()) {
            return self.round_direct(push, pull).await;
        }
        let mut group = match self.group.take() {
            Some(g) => g,
            None => {
                let opts = self.opts.group.clone().expect("checked above");
                let lens = self.current_layout()?.partition.tensors.iter().map(|t| t.len()).collect();
                Group::start(&opts, &self.opts.codec, lens).await?
            }
        };
        let result = self.group_round(&mut group, grad_clock, push, pull.as_mut().map(|(c, p)| (*c, &mut **p))).await;
        self.group = Some(group);
        result
    }

    async fn group_round(
        &mut self,
        group: &mut Group,
        grad_clock: Option<Clock>,
        push: Option<(PushOp, &[Option<&[f32]>])>,
        mut pull: Option<(Clock, &mut [Option<&mut [f32]>])>,
    ) -> Result<()> {
        match group {
            Group::Leader(leader) => {
                let summed: Vec<Option<Vec<f32>>>;
                let refs: Vec<Option<&[f32]>>;
                let push = match (push, grad_clock) {
                    (Some((op, grads)), Some(clock)) => {
                        let tensors: Vec<u32> =
                            grads.iter().enumerate().filter(|(_, g)| g.is_some()).map(|(t, _)| t as u32).collect();
                        let members = leader.gather(clock, tensors.clone()).await?;
                        summed = sum_gradients(grads, &tensors, &members);
                        refs = summed
                            .iter()
                            .zip(grads)
                            .map(|(s, g)| match s {
                                Some(s) => Some(&s[..]),
                                None => *g,
                            })
                            .collect();
                        Some((op, &refs[..]))
                    }
                    (push, _) => push,
                };
                self.round_direct(push, pull.as_mut().map(|(c, p)| (*c, &mut **p))).await?;
                if let Some((clock, params)) = pull {
                    let values = params
                        .iter()
                        .enumerate()
                        .filter_map(|(t, p)| {
                            p.as_ref().map(|p| (t as u32, Bytes::copy_from_slice(bytemuck::cast_slice(p))))
                        })
                        .collect();
                    leader.publish(clock, values)?;
                }
                Ok(())
            }
            Group::Member(link) => {
                link.set_timeout(self.opts.request_timeout);
                match (push, grad_clock) {
                    (Some((op, grads)), Some(clock)) => {
                        link.send_gradients(clock, grads).await?;
                        // "No gradient" to the same blocks: each still counts this worker's
                        // clock, and aggregate mode its push in the mean's divisor.
                        let none: Vec<Option<&[f32]>> = grads.iter().map(|g| g.map(|_| &[][..])).collect();
                        self.round_direct(Some((op, &none[..])), None).await?;
                    }
                    (Some(push), _) => self.round_direct(Some(push), None).await?,
                    (None, _) => {}
                }
                if let Some((clock, params)) = pull {
                    link.fetch(clock, params).await?;
                }
                Ok(())
            }
        }
    }

    /// Ends this worker's part in its host group before it says it is done: the leader
    /// waits for its members to take their last values and leave; a member leaves.
    pub(super) async fn end_group(&mut self) {
        if let Some(Group::Leader(leader)) = self.group.take() {
            let left = leader.end().await;
            if !left.is_empty() {
                tracing::warn!(?left, size = leader.size(), "host group members still connected at the end");
            }
        }
    }
}

/// The leader's gradients with its members' added, tensor by tensor (`tensors`: those
/// pushed, in order; `members[m][i]`: member m's gradient of `tensors[i]`, empty for
/// none): `None` where nothing is added (the leader's own stands), an empty vector where
/// nobody has a gradient. Each sum is the leader's, then the members' in local rank order.
fn sum_gradients(own: &[Option<&[f32]>], tensors: &[u32], members: &[Vec<Vec<f32>>]) -> Vec<Option<Vec<f32>>> {
    let mut out: Vec<Option<Vec<f32>>> = vec![None; own.len()];
    for (i, &t) in tensors.iter().enumerate() {
        let theirs: Vec<&[f32]> =
            members.iter().filter_map(|m| m.get(i)).map(|g| &g[..]).filter(|g| !g.is_empty()).collect();
        if theirs.is_empty() {
            continue;
        }
        let mine = own[t as usize].filter(|g| !g.is_empty());
        let (first, rest) = match mine {
            Some(g) => (g, &theirs[..]),
            None => (theirs[0], &theirs[1..]),
        };
        let mut s = first.to_vec();
        for g in rest {
            for (s, g) in s.iter_mut().zip(g.iter()) {
                *s += g;
            }
        }
        out[t as usize] = Some(s);
    }
    out
}
