//! The host agent's rules, each driven through [`Agent::handle`] with the time: join
//! (answer, refusal, timeout, an unreachable rendezvous), the slot bound, exits reported,
//! heartbeats, a lost scheduler, the end wait; and two agents against the real
//! [`Scheduler`] in-process.

use std::collections::BTreeMap;

use elasticps_wire::{Control, ErrorCode, ErrorReply, HostOffer, KeyId, Message, NodeRole};

use super::*;
use crate::scheduler::hosts::{HOST_HEARTBEAT_TIMEOUT_US, HostsConfig};
use crate::scheduler::{self, Scheduler};
use crate::timing::{FIRST_BACKOFF_US, HEARTBEAT_EVERY_US};

const JOIN_TIMEOUT_US: u64 = 20_000_000;
const END_US: u64 = 10_000_000;

fn offer(addr: &str, servers: u32, workers: u32, slots: u32) -> HostOffer {
    HostOffer {
        name: format!("h{addr}"),
        addr: addr.into(),
        servers,
        workers,
        server_slots: slots,
        worker_slots: slots,
    }
}

fn config(leads: bool) -> AgentConfig {
    AgentConfig {
        name: "a".into(),
        rdzv: "10.0.0.1:29400".into(),
        offer: offer("10.0.0.2", 1, 1, 2),
        leads,
        join_timeout_us: JOIN_TIMEOUT_US,
        end_timeout_us: END_US,
        host_groups: false,
    }
}

fn control(c: Control) -> Message {
    c.into()
}

/// The messages the effects write, with their request ids.
fn sent(effects: &[Effect]) -> Vec<(u64, Message)> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Send { request_id, msg } => Some((*request_id, msg.clone())),
            _ => None,
        })
        .collect()
}

fn exits(effects: &[Effect]) -> Vec<Outcome> {
    effects.iter().filter_map(|e| if let Effect::Exit(o) = e { Some(o.clone()) } else { None }).collect()
}

fn spawns(effects: &[Effect]) -> Vec<Spawn> {
    effects.iter().filter_map(|e| if let Effect::Spawn(s) = e { Some(s.clone()) } else { None }).collect()
}

fn says(effects: &[Effect]) -> Vec<String> {
    effects.iter().filter_map(|e| if let Effect::Say { line, .. } = e { Some(line.clone()) } else { None }).collect()
}

/// An agent that joined at time 0 (dialled, `JoinHost` answered by `HostWelcome`).
fn joined(leads: bool) -> Agent {
    joined_with(config(leads))
}

fn joined_with(config: AgentConfig) -> Agent {
    let mut a = Agent::new(config, 0);
    assert_eq!(a.poll_timeout(), Some(0), "it dials at once");
    assert!(matches!(a.handle(0, Input::Timeout)[..], [Effect::Dial]));
    let e = a.handle(0, Input::Dialled);
    assert!(matches!(&sent(&e)[..], [(REATTACH_ID, Message::Control(Control::JoinHost(o)))] if o.addr == "10.0.0.2"));
    let e = a.handle(0, Input::Frame { request_id: REATTACH_ID, msg: &control(Control::HostWelcome { host: 3 }) });
    assert_eq!(says(&e), ["host a (10.0.0.2) joined the job at 10.0.0.1:29400 as host 3"]);
    assert!(matches!(&sent(&e)[..], [(0, Message::Control(Control::Heartbeat))]), "the first heartbeat at once");
    a
}

fn start(slot: u32, role: NodeRole) -> Message {
    control(Control::StartNode { slot, role, workers: 4 })
}

/// Hands `msg` (a notification) to the agent at `now`.
fn note(a: &mut Agent, now: u64, msg: Message) -> Vec<Effect> {
    a.handle(now, Input::Frame { request_id: 0, msg: &msg })
}

/// Orders `slot` started, and starts it as process `node` if the agent asks to.
fn order(a: &mut Agent, now: u64, slot: u32, role: NodeRole, node: NodeId) -> Vec<Effect> {
    let e = note(a, now, start(slot, role));
    if !spawns(&e).is_empty() {
        a.handle(now, Input::Spawned { slot, node });
    }
    e
}

#[test]
fn the_join_is_answered_and_a_refusal_ends_the_launch_saying_why() {
    joined(false);
    let mut a = Agent::new(config(false), 0);
    a.handle(0, Input::Timeout);
    a.handle(0, Input::Dialled);
    let no =
        Message::Error(ErrorReply { code: ErrorCode::BadRequest, message: "loopback and others cannot mix".into() });
    let e = a.handle(5, Input::Frame { request_id: REATTACH_ID, msg: &no });
    match &exits(&e)[..] {
        [Outcome::Failed { failure: Failure::Refused, why }] => {
            assert!(why.contains("could not join the job at 10.0.0.1:29400") && why.contains("cannot mix"), "{why}")
        }
        other => panic!("{other:?}"),
    }
    assert!(a.is_done() && a.poll_timeout().is_none());
}

#[test]
fn an_unanswered_join_times_out_after_30_s_whatever_the_dial_window() {
    let mut a = Agent::new(AgentConfig { join_timeout_us: 1_000_000, ..config(false) }, 0);
    a.handle(0, Input::Timeout);
    a.handle(500_000, Input::Dialled);
    // Connected: the dial window (1 s) no longer ends it; the JoinHost's deadline does.
    assert_eq!(a.poll_timeout(), Some(500_000 + JOIN_CALL_TIMEOUT_US));
    assert!(a.handle(2_000_000, Input::Timeout).is_empty());
    let e = a.handle(500_000 + JOIN_CALL_TIMEOUT_US, Input::Timeout);
    match &exits(&e)[..] {
        [Outcome::Failed { failure: Failure::JoinTimeout, why }] => {
            assert!(why.contains("timed out after 30 s"), "{why}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_unreachable_rendezvous_is_dialled_with_the_backoff_said_every_5_s_and_given_up_in_time() {
    let mut a = Agent::new(config(false), 0);
    let (mut dials, mut lines, mut end) = (Vec::new(), Vec::new(), None);
    // Every dial fails at once; bounded: the window ends it.
    for _ in 0..200 {
        let Some(now) = a.poll_timeout() else { break };
        for e in a.handle(now, Input::Timeout) {
            match e {
                Effect::Dial => {
                    dials.push(now);
                    assert!(exits(&a.handle(now, Input::DialFailed { why: "connection refused".into() })).is_empty());
                }
                Effect::Say { line, .. } => lines.push((now, line)),
                Effect::Exit(o) => end = Some((now, o)),
                other => panic!("{other:?}"),
            }
        }
    }
    assert_eq!(dials[..4], [0, FIRST_BACKOFF_US, 3 * FIRST_BACKOFF_US, 7 * FIRST_BACKOFF_US], "100 ms doubling");
    assert!(dials.windows(2).all(|w| w[1] - w[0] <= crate::timing::MAX_BACKOFF_US));
    let at: Vec<u64> = lines.iter().map(|(t, _)| *t).collect();
    assert_eq!(at, [5_000_000, 10_000_000, 15_000_000], "every 5 s while it waits");
    assert_eq!(lines[0].1, "host a waits for the scheduler at 10.0.0.1:29400 (connection refused)");
    let (t, outcome) = end.expect("given up");
    assert_eq!(t, JOIN_TIMEOUT_US, "on time");
    match outcome {
        Outcome::Failed { failure: Failure::Unreachable, why } => {
            assert!(
                why.contains("could not reach the scheduler at 10.0.0.1:29400 within 20 s (connection refused)"),
                "{why}"
            )
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_connection_closed_before_the_join_is_answered_is_dialled_again_and_joins_again() {
    let mut a = Agent::new(config(false), 0);
    a.handle(0, Input::Timeout);
    a.handle(0, Input::Dialled);
    assert!(a.handle(10, Input::Lost { why: "reset".into() }).is_empty());
    assert_eq!(a.poll_timeout(), Some(10 + FIRST_BACKOFF_US));
    assert!(matches!(a.handle(10 + FIRST_BACKOFF_US, Input::Timeout)[..], [Effect::Dial]));
    let e = a.handle(20 + FIRST_BACKOFF_US, Input::Dialled);
    assert!(matches!(&sent(&e)[..], [(REATTACH_ID, Message::Control(Control::JoinHost(_)))]), "the JoinHost again");
}

#[test]
fn heartbeats_go_every_500_ms_from_the_welcome_on() {
    let mut a = joined(false);
    let mut beats = Vec::new();
    for _ in 0..20 {
        let now = a.poll_timeout().expect("a heartbeat is due");
        if now > 3_000_000 {
            break;
        }
        for (id, msg) in sent(&a.handle(now, Input::Timeout)) {
            assert_eq!((id, msg), (0, control(Control::Heartbeat)));
            beats.push(now);
        }
    }
    assert_eq!(beats, (1..=6).map(|k| k * HEARTBEAT_EVERY_US).collect::<Vec<_>>());
}

#[test]
fn the_agent_starts_nodes_only_within_the_slots_it_offered() {
    // 2 server and 2 worker slots; 16 orders: new slots, repeated slots, both kinds.
    let mut a = joined(false);
    let (mut started, mut refused_with_exit, mut node) = (BTreeMap::new(), Vec::new(), 0);
    for k in 0..16u32 {
        let slot = k % 6;
        let role = if k % 3 == 0 { NodeRole::Server } else { NodeRole::Worker { rank: Some(k) } };
        let e = order(&mut a, k as u64, slot, role, node);
        for s in spawns(&e) {
            assert!(started.insert(s.slot, s.node).is_none(), "slot {} started twice", s.slot);
            node += 1;
        }
        for (_, msg) in sent(&e) {
            match msg {
                Message::Control(Control::NodeExited { slot: s, ok: false, status, .. }) => {
                    assert!(status.contains("refuses") && status.contains("slots"), "{status}");
                    refused_with_exit.push(s);
                }
                other => panic!("{other:?}"),
            }
        }
    }
    let servers = started.values().filter(|n| **n == NodeKind::Server).count();
    assert_eq!((servers, started.len() - servers), (2, 2), "{started:?}");
    assert!(refused_with_exit.iter().all(|s| !started.contains_key(s)), "a running slot is never reported exited");
    // A slot freed by an exit takes a new order.
    a.handle(20, Input::Exited { node: 0, ok: true, status: "exit status: 0".into() });
    let e = order(&mut a, 21, 40, NodeRole::Server, 99);
    assert_eq!(spawns(&e).len() + started.values().filter(|n| **n == NodeKind::Server).count(), 3);
}

#[test]
fn a_duplicate_order_for_a_running_slot_starts_nothing_and_reports_nothing() {
    let mut a = joined(false);
    assert_eq!(spawns(&order(&mut a, 1, 7, NodeRole::Worker { rank: None }, 0)).len(), 1);
    let e = order(&mut a, 2, 7, NodeRole::Worker { rank: Some(0) }, 1);
    assert!(spawns(&e).is_empty() && sent(&e).is_empty(), "{e:?}");
    assert_eq!(says(&e), ["host a refuses to start worker slot 7 (rank 0): slot 7 already runs worker slot 7 here"]);
}

/// One push per host: the workers a host starts when the job starts form its group (their
/// seats: rank in the group, its size); a restarted worker and any worker past them push alone,
/// and nothing is grouped without `host_groups` or with one worker a host.
#[test]
fn the_workers_a_host_starts_with_the_job_form_its_group_and_a_restarted_one_does_not() {
    let group_of = |host_groups: bool, workers: u32, orders: &[Option<u32>]| -> Vec<Option<(u32, u32)>> {
        let mut a = joined_with(AgentConfig {
            host_groups,
            offer: offer("10.0.0.2", 1, workers, workers + 2),
            ..config(false)
        });
        orders
            .iter()
            .enumerate()
            .map(|(i, rank)| {
                let e = order(&mut a, 1 + i as u64, 10 + i as u32, NodeRole::Worker { rank: *rank }, i);
                match &spawns(&e)[..] {
                    [Spawn { node: NodeKind::Worker { group, .. }, .. }] => group.map(|g| (g.rank, g.size)),
                    other => panic!("{other:?}"),
                }
            })
            .collect()
    };
    assert_eq!(group_of(true, 2, &[None, None, Some(3)]), [Some((0, 2)), Some((1, 2)), None]);
    assert_eq!(group_of(true, 2, &[Some(3), None, None]), [None, Some((0, 2)), Some((1, 2))], "after a restart");
    assert_eq!(group_of(false, 2, &[None, None]), [None, None]);
    assert_eq!(group_of(true, 1, &[None]), [None]);
}

/// A worker that dies before it logged anything is reported with the rank it joined as
/// (its `joined` line), so the scheduler can restart it with that rank.
#[test]
fn a_worker_that_dies_before_it_logs_is_reported_with_the_rank_it_joined_as() {
    let mut a = joined(false);
    order(&mut a, 1, 4, NodeRole::Worker { rank: None }, 0);
    a.handle(2, Input::Line { node: 0, event: Event::Joined { rank: 3 } });
    let e = a.handle(3, Input::Exited { node: 0, ok: false, status: "exit status: 1".into() });
    let exited = Control::NodeExited { slot: 4, ok: false, status: "exit status: 1".into(), rank: Some(3) };
    assert_eq!(sent(&e), [(0, control(exited))]);
}

#[test]
fn exits_are_reported_with_the_rank_the_events_named_and_events_are_relayed() {
    let mut a = joined(false);
    let e = order(&mut a, 1, 4, NodeRole::Worker { rank: None }, 0);
    assert!(matches!(
        &spawns(&e)[..],
        [Spawn { node: NodeKind::Worker { rank: None, workers: 4, local: 0, group: None }, .. }]
    ));
    let progress = Event::Progress { rank: 2, iteration: 1, total: 9, loss: 0.5 };
    let e = a.handle(2, Input::Line { node: 0, event: progress });
    assert!(
        matches!(&sent(&e)[..], [(0, Message::Control(Control::HostEvent { line }))] if line.contains("\"rank\":2"))
    );
    assert!(e.iter().any(|e| matches!(e, Effect::Show(Event::Progress { .. }))));
    let e = a.handle(3, Input::Line { node: 0, event: Event::Metrics { node: "worker 2".into(), addr: "x".into() } });
    assert!(e.is_empty(), "a metrics address is not relayed");
    let e = a.handle(4, Input::Exited { node: 0, ok: false, status: "signal: 9".into() });
    let exited = Control::NodeExited { slot: 4, ok: false, status: "signal: 9".into(), rank: Some(2) };
    assert_eq!(sent(&e), [(0, control(exited))]);
    assert_eq!(says(&e), ["[a worker slot 4] exited with signal: 9"]);
    // A node that could not start is reported too, and frees its slot.
    order(&mut a, 5, 5, NodeRole::Server, 1);
    let e = a.handle(6, Input::SpawnFailed { slot: 5, why: "no such file".into() });
    assert_eq!(
        sent(&e),
        [(0, control(Control::NodeExited { slot: 5, ok: false, status: "no such file".into(), rank: None }))]
    );
}

#[test]
fn a_lost_scheduler_ends_a_host_but_the_rendezvous_host_waits_for_its_scheduler_process() {
    let mut a = joined(false);
    order(&mut a, 1, 0, NodeRole::Server, 0);
    let e = a.handle(2, Input::Lost { why: "eof".into() });
    match &exits(&e)[..] {
        [Outcome::Failed { failure: Failure::SchedulerLost, why }] => {
            assert!(why.contains("lost the scheduler"), "{why}")
        }
        other => panic!("{other:?}"),
    }
    let mut a = joined(true);
    assert!(exits(&a.handle(2, Input::Lost { why: "eof".into() })).is_empty());
    assert!(sent(&a.handle(HEARTBEAT_EVERY_US, Input::Timeout)).is_empty(), "no heartbeat without a link");
    assert_eq!(exits(&a.handle(3, Input::SchedulerExited { ok: true })), [Outcome::JobOver]);
}

#[test]
fn after_the_shutdown_the_agent_waits_for_its_nodes_then_closes_and_leaves() {
    let mut a = joined(false);
    order(&mut a, 1, 0, NodeRole::Server, 0);
    let e = note(&mut a, 10, control(Control::Shutdown { reason: "every worker finished".into() }));
    assert!(exits(&e).is_empty() && !e.iter().any(|e| matches!(e, Effect::Close)), "its server still runs");
    assert_eq!(a.poll_timeout(), Some(10 + END_US).min(a.poll_timeout()));
    let e = a.handle(20, Input::Exited { node: 0, ok: true, status: "exit status: 0".into() });
    assert!(matches!(&sent(&e)[..], [(0, Message::Control(Control::NodeExited { slot: 0, ok: true, .. }))]));
    let close = e.iter().position(|e| matches!(e, Effect::Close)).expect("it closes its connection");
    assert!(matches!(&e[close + 1..], [Effect::Exit(Outcome::Left(r))] if r == "every worker finished"), "{e:?}");
}

#[test]
fn nodes_that_outlive_the_end_wait_fail_the_launch_naming_them() {
    let mut a = joined(false);
    order(&mut a, 1, 3, NodeRole::Worker { rank: Some(1) }, 0);
    note(&mut a, 10, control(Control::Shutdown { reason: "done".into() }));
    let mut now = 10;
    let mut end = None;
    for _ in 0..100 {
        now = a.poll_timeout().expect("the end wait");
        if let [o] = &exits(&a.handle(now, Input::Timeout))[..] {
            end = Some(o.clone());
            break;
        }
    }
    assert_eq!(now, 10 + END_US);
    let why = "the job is over (done), but these nodes of host a did not exit within 10 s: worker slot 3 (rank 1)";
    assert_eq!(end, Some(Outcome::Failed { failure: Failure::EndTimeout, why: why.into() }));
}

/// A job config of one server and one worker per host, blocks of 16 bytes.
fn job() -> scheduler::JobConfig {
    use elasticps_core::block::ShardConfig;
    use elasticps_core::optimizer::{OptimizerConfig, OptimizerKind};
    use elasticps_core::sync::SyncPolicy;
    scheduler::JobConfig {
        servers: 1,
        workers: 1,
        block_bytes: 16,
        placement: elasticps_core::placement::PlacementKind::Range,
        shard: ShardConfig {
            sync: SyncPolicy::Bsp,
            optimizer: OptimizerConfig { kind: OptimizerKind::Sgd, lr: 0.1, aggregate: false, weight_decay: 0.0 },
            workers: 1,
        },
        seed: 1,
        server_sync: Vec::new(),
        inject: Vec::new(),
        balance: Default::default(),
        balance_compress: None,
        max_servers: 4,
        min_servers: 1,
        checkpoint: None,
        rejoin_wait_us: 0,
        replicas: 1,
    }
}

/// Agents (each on its own connection, its conn its index + 100) and the real scheduler,
/// with every effect carried out in-process and the time moved by the soonest deadline.
struct World {
    now: u64,
    scheduler: Scheduler,
    agents: Vec<Agent>,
    /// The slots each agent's driver started.
    started: Vec<Vec<(u32, NodeKind)>>,
    /// The outcome each agent ended with.
    ended: Vec<Option<Outcome>>,
}

impl World {
    fn run_until(&mut self, until: u64) {
        for _ in 0..10_000 {
            let soonest = self.agents.iter().filter_map(Agent::poll_timeout).chain(self.scheduler.poll_timeout()).min();
            match soonest {
                Some(t) if t <= until => {
                    self.now = self.now.max(t);
                    for i in 0..self.agents.len() {
                        if self.agents[i].poll_timeout().is_some_and(|t| t <= self.now) {
                            self.agent(i, Input::Timeout);
                        }
                    }
                    if self.scheduler.poll_timeout().is_some_and(|t| t <= self.now) {
                        self.sched(scheduler::Event::Timeout);
                    }
                }
                _ => break,
            }
        }
        self.now = until;
    }

    fn agent(&mut self, i: usize, input: Input<'_>) {
        let conn = 100 + i as u64;
        for e in self.agents[i].handle(self.now, input) {
            match e {
                Effect::Dial => {
                    let peer = self.agents[i].config.offer.addr.clone();
                    self.sched(scheduler::Event::Connected { conn, peer, key: KeyId::Cluster });
                    self.agent(i, Input::Dialled);
                }
                Effect::Send { request_id, msg } => self.sched(scheduler::Event::Received { conn, request_id, msg }),
                Effect::Close => self.sched(scheduler::Event::Lost { conn, why: "closed".into() }),
                Effect::Spawn(s) => self.started[i].push((s.slot, s.node)),
                Effect::Exit(o) => self.ended[i] = Some(o),
                Effect::Show(_) | Effect::Say { .. } => {}
            }
        }
    }

    fn sched(&mut self, event: scheduler::Event) {
        for action in self.scheduler.handle(self.now, event) {
            match action {
                scheduler::Action::Send { conn, request_id, msg } if conn >= 100 => {
                    let i = (conn - 100) as usize;
                    if i < self.agents.len() {
                        self.agent(i, Input::Frame { request_id, msg: &msg });
                    }
                }
                scheduler::Action::Close(conn) if conn >= 100 => {
                    let i = (conn - 100) as usize;
                    self.agent(i, Input::Lost { why: "closed by the scheduler".into() });
                }
                _ => {}
            }
        }
    }
}

#[test]
fn agents_against_the_real_scheduler_join_start_what_they_offered_and_stay_alive_by_their_heartbeats() {
    let hosts = HostsConfig { min_hosts: 2, max_hosts: 2, restart_workers: 0, restart_servers: 0 };
    let scheduler = Scheduler::new(job(), 10_000_000).with_hosts(hosts);
    let agent =
        |addr: &str| Agent::new(AgentConfig { name: addr.into(), offer: offer(addr, 1, 1, 2), ..config(false) }, 0);
    let agents = vec![agent("10.0.0.1"), agent("10.0.0.2"), agent("10.0.0.3")];
    let mut w = World { now: 0, scheduler, agents, started: vec![Vec::new(); 3], ended: vec![None; 3] };
    w.run_until(0);
    // The first two joined and started one server and one worker each; the third was
    // refused (the job has its 2 hosts) and says so.
    for i in 0..2 {
        let mut kinds: Vec<bool> = w.started[i].iter().map(|(_, k)| *k == NodeKind::Server).collect();
        kinds.sort();
        assert_eq!(kinds, [false, true], "host {i}: {:?}", w.started[i]);
        assert_eq!(w.ended[i], None);
    }
    match &w.ended[2] {
        Some(Outcome::Failed { failure: Failure::Refused, why }) => assert!(why.contains("its 2 hosts"), "{why}"),
        other => panic!("{other:?}"),
    }
    // Silent for longer than the scheduler's host timeout, the agents' heartbeats keep
    // their hosts in the job.
    w.run_until(3 * HOST_HEARTBEAT_TIMEOUT_US);
    assert_eq!(w.scheduler.balance_log().scaling.iter().filter(|e| e.action == "host-lost").count(), 0);
    assert_eq!(w.ended[..2], [None, None]);
}
