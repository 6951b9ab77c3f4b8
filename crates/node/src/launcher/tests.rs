//! The launcher's rules, each driven through [`Launcher::handle`] on virtual time: the
//! scheduler's start deadline, the start order, worker restarts within their budget,
//! dead servers replaced within theirs, the end wait, a signal.

use super::*;

const END_US: u64 = 45_000_000;
const SCHED: NodeId = 0;

fn config(servers: u32, workers: u32) -> LauncherConfig {
    LauncherConfig { servers, workers, replicas: 1, restart_workers: 0, restart_servers: 0, end_timeout_us: END_US }
}

fn spawns(effects: &[Effect]) -> Vec<Spawn> {
    effects.iter().filter_map(|e| if let Effect::Spawn(s) = e { Some(s.clone()) } else { None }).collect()
}

fn says(effects: &[Effect]) -> Vec<String> {
    effects.iter().filter_map(|e| if let Effect::Say { line, .. } = e { Some(line.clone()) } else { None }).collect()
}

fn fails(effects: &[Effect]) -> Vec<Failure> {
    effects.iter().filter_map(|e| if let Effect::Fail(f) = e { Some(f.clone()) } else { None }).collect()
}

/// A driver on virtual time: it starts every spawn as the next node id, as the
/// cluster numbers its processes, and keeps every effect.
struct Run {
    l: Launcher,
    next_node: NodeId,
    /// Every effect so far, in order.
    log: Vec<Effect>,
    /// Spawned: node -> label.
    nodes: Vec<String>,
}

impl Run {
    fn new(config: LauncherConfig) -> Self {
        Self { l: Launcher::new(config), next_node: 0, log: Vec::new(), nodes: Vec::new() }
    }

    /// Hands the launcher `input` at `now`, carries out its spawns (they all start);
    /// returns the effects of this input and of the spawns' outcomes.
    fn feed(&mut self, now: u64, input: Input) -> Vec<Effect> {
        let mut queue = std::collections::VecDeque::from(self.l.handle(now, input));
        let mut all = Vec::new();
        while let Some(e) = queue.pop_front() {
            if let Effect::Spawn(spawn) = &e {
                let node = self.next_node;
                self.next_node += 1;
                self.nodes.push(spawn.label.clone());
                queue.extend(self.l.handle(now, Input::Spawned { spawn: spawn.clone(), node }));
            }
            all.push(e);
        }
        self.log.extend(all.iter().cloned());
        all
    }

    /// The launcher's timeout, if it is due at or before `now`.
    fn tick(&mut self, now: u64) -> Vec<Effect> {
        match self.l.poll_timeout() {
            Some(at) if at <= now => self.feed(now, Input::Timeout),
            _ => Vec::new(),
        }
    }

    fn exit(&mut self, now: u64, node: NodeId, ok: bool) -> Vec<Effect> {
        let status = if ok { "exit status: 0" } else { "exit status: 1" };
        self.feed(now, Input::Exited { node, ok, status: status.into() })
    }

    /// Started at time 0: the scheduler listening, the servers and workers spawned.
    fn started(config: LauncherConfig) -> Self {
        let mut r = Self::new(config);
        assert_eq!(r.l.poll_timeout(), Some(0), "it starts the scheduler at once");
        let e = r.tick(0);
        assert_eq!(spawns(&e), [Spawn::named(NodeKind::Scheduler)]);
        let e = r.feed(0, Input::Listening { node: SCHED, addr: "127.0.0.1:7000".into() });
        assert_eq!(e.first(), Some(&Effect::Listening { addr: "127.0.0.1:7000".into() }));
        r
    }
}

#[test]
fn the_scheduler_starts_first_then_the_servers_then_the_workers() {
    let r = Run::started(config(2, 2));
    assert_eq!(r.nodes, ["scheduler", "server 0", "server 1", "worker 0", "worker 1"]);
    assert_eq!(r.l.poll_timeout(), None, "nothing to wait for while the job runs");
}

#[test]
fn a_scheduler_that_does_not_listen_within_its_start_timeout_fails_the_job() {
    let mut r = Run::new(config(1, 1));
    r.tick(0);
    assert_eq!(r.l.poll_timeout(), Some(SCHEDULER_START_TIMEOUT_US));
    assert!(r.tick(SCHEDULER_START_TIMEOUT_US - 1).is_empty(), "not before its deadline");
    let e = r.tick(SCHEDULER_START_TIMEOUT_US);
    let why = "the scheduler did not report its address within 20 s".to_string();
    assert_eq!(fails(&e), [Failure::SchedulerSilent { node: SCHED, why }]);
    assert_eq!(r.nodes, ["scheduler"], "nothing else started");
    assert_eq!(r.l.poll_timeout(), None);
    // A scheduler that listens in time arms no deadline again.
    let mut r = Run::new(config(1, 1));
    r.tick(0);
    r.feed(SCHEDULER_START_TIMEOUT_US - 1, Input::Listening { node: SCHED, addr: "a".into() });
    assert!(r.tick(SCHEDULER_START_TIMEOUT_US).is_empty());
}

#[test]
fn a_worker_that_cannot_start_stops_every_node() {
    let mut r = Run::new(config(1, 2));
    r.tick(0);
    let mut l = std::mem::replace(&mut r.l, Launcher::new(config(0, 0)));
    let e = l.handle(0, Input::Listening { node: SCHED, addr: "a".into() });
    let spawn = spawns(&e).remove(0);
    let e = l.handle(0, Input::Spawned { spawn, node: 1 });
    let spawn = spawns(&e).remove(0);
    assert_eq!(spawn.label, "worker 0");
    let e = l.handle(0, Input::SpawnFailed { spawn });
    assert_eq!(fails(&e), [Failure::SpawnFailed { then: Some("every node started so far was stopped") }]);
    assert!(l.is_over());
}

#[test]
fn a_dead_worker_is_restarted_with_its_rank_while_restarts_are_left() {
    let mut r = Run::started(LauncherConfig { restart_workers: 1, ..config(1, 2) });
    // worker 0 is node 2, worker 1 node 3; worker 1 works as rank 1.
    r.feed(1, Input::RankNamed { node: 3, rank: 1 });
    let e = r.exit(5_000_000, 3, false);
    assert_eq!(says(&e), ["[worker 1] exited with exit status: 1; restarting it as rank 1 (0 restarts left)"]);
    assert!(e.contains(&Effect::WorkerRestarted { rank: 1, at_us: 5_000_000, status: "exit status: 1".into() }));
    assert_eq!(spawns(&e), [Spawn::named(NodeKind::Worker { index: 1, rank: Some(1) })]);
    assert_eq!(r.nodes.last().map(String::as_str), Some("worker 1 (restarted as rank 1)"));
    // The restarted worker (node 4) names its rank and dies again: the budget is spent.
    r.feed(6_000_000, Input::RankNamed { node: 4, rank: 1 });
    let e = r.exit(7_000_000, 4, false);
    assert!(spawns(&e).is_empty(), "no restart left");
    assert_eq!(
        fails(&e),
        [Failure::NodeFailed { node: 4, then: Some("the job failed; every other node was stopped") }]
    );
}

#[test]
fn a_dead_worker_whose_rank_is_unknown_fails_the_job() {
    let mut r = Run::started(LauncherConfig { restart_workers: 3, ..config(1, 1) });
    let e = r.exit(1, 2, false);
    assert!(spawns(&e).is_empty());
    assert_eq!(fails(&e), [Failure::NodeFailed { node: 2, then: Some(super::exits::JOB_FAILED) }]);
}

#[test]
fn a_dead_server_with_replicas_is_replaced_while_restarts_are_left() {
    let mut r = Run::started(LauncherConfig { replicas: 2, restart_servers: 1, ..config(2, 1) });
    // server 0 is node 1, server 1 node 2, worker 0 node 3.
    let e = r.exit(2_000_000, 1, false);
    assert_eq!(
        says(&e),
        ["[server 0] exited with exit status: 1; its blocks fail over to their backups; starting server 2 in its \
          place (0 restarts left)"]
    );
    let lost = Effect::ServerLost { index: 0, at_us: 2_000_000, status: "exit status: 1".into(), replaced: true };
    assert!(e.contains(&lost));
    assert_eq!(spawns(&e), [Spawn::named(NodeKind::Server { index: 2 })]);
    assert!(fails(&e).is_empty());
    // The next dead server fails over, but nothing takes its place: the budget is spent.
    let e = r.exit(3_000_000, 2, false);
    assert_eq!(says(&e), ["[server 1] exited with exit status: 1; its blocks fail over to their backups"]);
    assert!(spawns(&e).is_empty());
    assert!(e.contains(&Effect::ServerLost {
        index: 1,
        at_us: 3_000_000,
        status: "exit status: 1".into(),
        replaced: false
    }));
    assert!(fails(&e).is_empty(), "the job goes on on the backups");
}

#[test]
fn a_dead_server_without_replicas_fails_the_job() {
    let mut r = Run::started(LauncherConfig { restart_servers: 1, ..config(1, 1) });
    let e = r.exit(1, 1, false);
    assert!(spawns(&e).is_empty());
    assert_eq!(fails(&e), [Failure::NodeFailed { node: 1, then: Some(super::exits::JOB_FAILED) }]);
}

#[test]
fn the_end_wait_starts_at_the_last_workers_exit_and_names_what_still_runs() {
    let mut r = Run::started(config(1, 2));
    // worker 0 is node 2, worker 1 node 3.
    r.exit(10_000_000, 2, true);
    assert_eq!(r.l.poll_timeout(), None, "a worker still runs: no end wait yet");
    r.exit(20_000_000, 3, true);
    assert_eq!(r.l.poll_timeout(), Some(20_000_000 + END_US));
    assert!(r.tick(20_000_000 + END_US - 1).is_empty(), "not before the end wait is over");
    let e = r.tick(20_000_000 + END_US);
    let why = "every worker exited, but the job did not end within 45 s (still running: scheduler, server 0); a \
               worker that exits without finishing leaves the scheduler waiting for it"
        .to_string();
    assert_eq!(fails(&e), [Failure::EndTimeout { why }]);
}

#[test]
fn a_job_that_ends_within_the_end_wait_is_done() {
    let mut r = Run::started(config(1, 1));
    r.exit(10_000_000, 2, true);
    r.exit(11_000_000, 1, true);
    let e = r.exit(12_000_000, SCHED, true);
    assert_eq!(e, [Effect::Done]);
    assert_eq!(r.l.poll_timeout(), None, "the end wait is over with the job");
    assert!(r.tick(10_000_000 + END_US).is_empty(), "it never fires");
    assert!(fails(&r.log).is_empty());
}

#[test]
fn a_signal_stops_every_node() {
    let mut r = Run::started(config(1, 1));
    let e = r.feed(3, Input::Signal("interrupted"));
    assert_eq!(e, [Effect::Fail(Failure::Stopped("interrupted"))]);
    assert!(r.l.is_over());
    assert!(r.exit(4, 1, false).is_empty(), "nothing after the end");
    // Before the scheduler listens, too.
    let mut r = Run::new(config(1, 1));
    r.tick(0);
    assert_eq!(r.feed(1, Input::Signal("hung up")), [Effect::Fail(Failure::Stopped("hung up"))]);
}
