//! Membership: who is in the job. Servers and workers register and are welcomed with
//! their credential; a restarted worker rejoins with its rank once every server took it
//! back; heartbeats keep a node in; a worker says it is done; a node is lost (its
//! connection closed, or silent past the heartbeat timeout) and what follows from it; a
//! connection that never registers is closed.

use std::collections::{BTreeMap, BTreeSet, btree_map};

use elasticps_wire::{Control, Credential, ErrorCode, ErrorReply, KeyId, Message, PeerRole};

use super::{Action, Caller, ConnId, Node, Role, Scheduler};

/// A connection that has not registered (as a server, a worker or a host agent) within
/// this long is closed, µs. An operator tool's `GetStatus` or `Scale` is answered
/// meanwhile.
pub const REGISTER_WITHIN_US: u64 = 10_000_000;

/// At most this many connections wait to register at once (authenticated, not yet a
/// server, a worker, a rejoining worker or a host agent; an operator tool's connection
/// counts too). One more takes the place of the oldest of them, which is told why and
/// closed ([`Scheduler::with_max_unregistered`] changes it).
///
/// Why the oldest goes rather than the newcomer: a newcomer refused would lock every
/// honest late joiner (a restarted worker, a late host agent, `elasticps status`) out for
/// as long as a flood stands, while an honest peer registers one round trip after its
/// handshake, so it is evicted only if this many connections open within that round
/// trip. Registered nodes never count: a flood of silent connections cannot take a
/// registered node's place, nor, since it evicts itself long before the acceptor's
/// `--max-connections` (4,096), keep a new node from registering. An operator tool's
/// question (`GetStatus`, `Scale`) renews its place as it renews its registration wait,
/// so `elasticps status --watch` stays unless this many connections open between two of
/// its polls; it does not count apart, since any holder of the worker secret can ask it.
pub const MAX_UNREGISTERED: usize = 1024;

/// A restarted worker waiting for the servers to take its rank back.
#[derive(Debug)]
pub(super) struct Rejoin {
    pub(super) conn: ConnId,
    request_id: u64,
    /// Servers (by id) asked to take the rank back, with how many of their answers
    /// (`WorkerAdded`) are still to come.
    waiting: BTreeMap<u32, u32>,
    /// The largest next clock they answered (`None` before one with a block answered).
    clock: Option<u32>,
}

/// The registered servers and workers by connection, with when each was last heard from
/// in order: the first is the next to miss its heartbeat deadline.
#[derive(Debug, Default)]
pub(super) struct Nodes {
    by_conn: BTreeMap<ConnId, Node>,
    by_seen: BTreeSet<(u64, ConnId)>,
}

impl Nodes {
    /// `node` registered (or reattached) on `conn`.
    pub(super) fn insert(&mut self, conn: ConnId, node: Node) {
        self.remove(&conn);
        self.by_seen.insert((node.last_seen_us, conn));
        self.by_conn.insert(conn, node);
    }

    /// The node on `conn` leaves.
    pub(super) fn remove(&mut self, conn: &ConnId) -> Option<Node> {
        let node = self.by_conn.remove(conn)?;
        self.by_seen.remove(&(node.last_seen_us, *conn));
        Some(node)
    }

    /// A message from `conn` (if it is a node's) arrived at `now_us`.
    pub(super) fn heard(&mut self, conn: ConnId, now_us: u64) {
        if let Some(node) = self.by_conn.get_mut(&conn) {
            self.by_seen.remove(&(node.last_seen_us, conn));
            node.last_seen_us = now_us;
            self.by_seen.insert((now_us, conn));
        }
    }

    /// When the node heard from least recently was last heard from.
    pub(super) fn oldest_seen_us(&self) -> Option<u64> {
        self.by_seen.first().map(|(seen, _)| *seen)
    }

    pub(super) fn get(&self, conn: &ConnId) -> Option<&Node> {
        self.by_conn.get(conn)
    }

    pub(super) fn contains_key(&self, conn: &ConnId) -> bool {
        self.by_conn.contains_key(conn)
    }

    /// The nodes in connection order.
    pub(super) fn iter(&self) -> btree_map::Iter<'_, ConnId, Node> {
        self.by_conn.iter()
    }

    pub(super) fn keys(&self) -> btree_map::Keys<'_, ConnId, Node> {
        self.by_conn.keys()
    }

    pub(super) fn values(&self) -> btree_map::Values<'_, ConnId, Node> {
        self.by_conn.values()
    }
}

impl Scheduler {
    /// `RegisterServer`, `RegisterWorker`, `RejoinWorker`, `WorkerAdded`, `Heartbeat`,
    /// `WorkerDone`.
    pub(super) fn on_membership(&mut self, call: Caller, control: Control, out: &mut Vec<Action>) {
        let (conn, request_id) = (call.conn, call.request_id);
        match (control, call.role) {
            (Control::RegisterServer { data_addr }, None) => self.register_server(call, data_addr, out),
            (Control::RegisterWorker, None) => self.register_worker(call, out),
            (Control::RejoinWorker { rank }, None) => {
                if let Err(message) = self.rejoin(conn, request_id, rank, out) {
                    call.refuse(out, ErrorCode::BadRequest, message);
                    out.push(Action::Close(conn));
                }
            }
            (Control::WorkerAdded { rank, clock }, Some(Role::Server(id))) => self.worker_added(rank, id, clock, out),
            (Control::Heartbeat, Some(_)) => {}
            (Control::WorkerDone { .. }, Some(Role::Worker(rank))) => {
                tracing::info!(rank, "worker finished");
                call.reply(out, Control::Ok.into());
                self.worker_left(rank, out);
                self.done_again(rank, out);
            }
            (other, _) => call.refuse_now(out, other),
        }
    }

    fn register_server(&mut self, call: Caller, data_addr: String, out: &mut Vec<Action>) {
        let conn = call.conn;
        let id = self.servers.len() as u32;
        let initial = id < self.config.servers;
        let late_ok = self.layout_ready && self.elastic.registered_count() < self.config.max_servers;
        if !initial && !late_ok {
            let max = self.config.max_servers.max(self.config.servers);
            call.refuse(out, ErrorCode::BadRequest, format!("the job already has its {max} servers (--max-servers)"));
            out.push(Action::Close(conn));
            return;
        }
        tracing::info!(server = id, addr = %data_addr, initial, "server joined");
        if let Some(h) = self.hosts.as_mut() {
            h.server_registered(id, &data_addr, self.peers.get(&conn).map(String::as_str));
        }
        self.servers.push((conn, data_addr));
        self.nodes.insert(conn, Node { role: Role::Server(id), last_seen_us: self.now_us });
        self.elastic.registered(id, initial, self.now_us);
        call.reply(out, self.welcome(PeerRole::Server, id));
        if initial {
            self.try_assign(out);
        } else if let Some(a) = self.assignment(id) {
            self.send_assignment(conn, a, out);
        }
    }

    fn register_worker(&mut self, call: Caller, out: &mut Vec<Action>) {
        let conn = call.conn;
        let rank = self.workers.len() as u32;
        if rank >= self.config.workers {
            call.refuse(out, ErrorCode::BadRequest, format!("the job already has its {} workers", self.config.workers));
            out.push(Action::Close(conn));
            return;
        }
        tracing::info!(rank, "worker joined");
        if let Some(h) = self.hosts.as_mut() {
            h.worker_registered(rank, self.peers.get(&conn).map(String::as_str));
        }
        self.workers.push(conn);
        self.nodes.insert(conn, Node { role: Role::Worker(rank), last_seen_us: self.now_us });
        call.reply(out, self.welcome(PeerRole::Worker, rank));
    }

    /// Connection `conn` opened with handshake `key` (right after its handshake, whether
    /// or not it ever sends a frame): it has [`REGISTER_WITHIN_US`] to register, and a
    /// place among the [`MAX_UNREGISTERED`] connections that wait to (the oldest of them
    /// is closed if every place is taken).
    pub(super) fn connection_opened(&mut self, conn: ConnId, key: KeyId, out: &mut Vec<Action>) {
        if let Some((_, since)) = self.opened.insert(conn, (key, self.now_us)) {
            self.registering.remove(&(since, conn));
        }
        self.make_room_to_register(out);
        self.registering.insert((self.now_us, conn));
    }

    /// Frees a place for one more connection waiting to register when all
    /// `max_unregistered` are taken: closes the oldest that has not registered, telling it
    /// why ([`MAX_UNREGISTERED`]). (Registered ones left the places as they registered,
    /// [`Scheduler::forget_if_registered`].)
    fn make_room_to_register(&mut self, out: &mut Vec<Action>) {
        while self.registering.len() >= self.max_unregistered {
            let Some((since, conn)) = self.registering.pop_first() else { break };
            if !self.waits_to_register(since, conn) {
                continue;
            }
            let max = self.max_unregistered;
            let waited_ms = self.now_us.saturating_sub(since) / 1_000;
            tracing::warn!(
                conn,
                max_unregistered = max,
                waited_ms,
                "connection dropped: the oldest of the connections that have not registered when every place was taken"
            );
            let message = format!(
                "closed: {max} connections were waiting to register with the scheduler (its bound on unregistered \
                 connections) and this one was the oldest; register (RegisterServer, RegisterWorker, JoinHost, ...) \
                 right after the handshake"
            );
            let msg = Message::Error(ErrorReply { code: ErrorCode::BadRequest, message });
            out.push(Action::Send { conn, request_id: 0, msg });
            out.push(Action::Close(conn));
            self.connection_closed(conn);
            self.shut.insert(conn);
        }
    }

    /// Whether the entry (`since`, `conn`) of the connections waiting to register still
    /// stands: that connection is open, waits since `since`, and has not registered.
    fn waits_to_register(&self, since: u64, conn: ConnId) -> bool {
        self.opened.get(&conn).is_some_and(|(_, s)| *s == since) && !self.registered(conn)
    }

    /// Whether connection `conn` registered (as a server, a worker, a rejoining worker or
    /// a host agent): the runtime lets such a connection send frames of any kind and size
    /// (docs/PROTOCOL.md §8); before, only small control frames.
    pub fn is_registered(&self, conn: ConnId) -> bool {
        self.registered(conn)
    }

    /// Connection `conn` closed.
    pub(super) fn connection_closed(&mut self, conn: ConnId) {
        if let Some((_, since)) = self.opened.remove(&conn) {
            self.registering.remove(&(since, conn));
        }
    }

    /// An operator tool on `conn` asked again: its wait to register starts again.
    pub(super) fn still_asking(&mut self, conn: ConnId) {
        if let Some((_, since)) = self.opened.get_mut(&conn) {
            self.registering.remove(&(*since, conn));
            *since = self.now_us;
            self.registering.insert((self.now_us, conn));
        }
    }

    /// Whether `conn` registered (as a node, a rejoining worker or a host agent).
    fn registered(&self, conn: ConnId) -> bool {
        self.nodes.contains_key(&conn)
            || self.rejoining.values().any(|r| r.conn == conn)
            || self.hosts.as_ref().is_some_and(|h| h.is_agent(conn))
    }

    /// Connection `conn` sent a message: if it registered with it, it leaves the
    /// connections waiting to register (a registration comes only in a message from its
    /// own connection), so that these hold no registered one.
    pub(super) fn forget_if_registered(&mut self, conn: ConnId) {
        if let Some((_, since)) = self.opened.get(&conn)
            && self.registered(conn)
        {
            self.registering.remove(&(*since, conn));
        }
    }

    /// Drops the connections that registered from the front of those that may not have:
    /// the first left is the next to be closed for not registering.
    pub(super) fn forget_registered(&mut self) {
        while let Some(&(since, conn)) = self.registering.first() {
            if self.waits_to_register(since, conn) {
                break;
            }
            self.registering.pop_first();
        }
    }

    /// When the first connection that has not registered is to be closed, µs.
    pub(super) fn register_deadline_us(&self) -> Option<u64> {
        self.registering.first().map(|(since, _)| since.saturating_add(REGISTER_WITHIN_US).saturating_add(1))
    }

    /// Every node not heard from for longer than the heartbeat timeout is lost, and its
    /// connection closed.
    pub(super) fn lose_silent_nodes(&mut self, out: &mut Vec<Action>) {
        let now_us = self.now_us;
        let dead: Vec<ConnId> = self
            .nodes
            .iter()
            .filter(|(_, n)| now_us.saturating_sub(n.last_seen_us) > self.heartbeat_timeout_us)
            .map(|(c, _)| *c)
            .collect();
        for conn in dead {
            let secs = self.heartbeat_timeout_us as f64 / 1e6;
            self.on_lost(conn, &format!("no heartbeat for {secs:.0} s"), out);
            out.push(Action::Close(conn));
        }
    }

    /// Closes every connection that has not registered within [`REGISTER_WITHIN_US`].
    pub(super) fn close_unregistered(&mut self, out: &mut Vec<Action>) {
        let now_us = self.now_us;
        let late: Vec<ConnId> = self
            .opened
            .iter()
            .filter(|(c, (_, since))| now_us.saturating_sub(*since) > REGISTER_WITHIN_US && !self.registered(**c))
            .map(|(c, _)| *c)
            .collect();
        for conn in late {
            tracing::warn!(conn, within_s = REGISTER_WITHIN_US / 1_000_000, "connection closed: it did not register");
            let message = format!(
                "closed: this connection did not register within {} s (RegisterServer, RegisterWorker, JoinHost, ...)",
                REGISTER_WITHIN_US / 1_000_000
            );
            let msg = Message::Error(ErrorReply { code: ErrorCode::BadRequest, message });
            out.push(Action::Send { conn, request_id: 0, msg });
            out.push(Action::Close(conn));
            self.connection_closed(conn);
            self.shut.insert(conn);
        }
    }

    /// The `Welcome` of a node registered as `role` `node_id`, with its credential.
    pub(super) fn welcome(&self, role: PeerRole, node_id: u32) -> Message {
        let credential = Credential::issue(&self.secret, self.job, role, node_id);
        Control::Welcome { node_id, num_workers: self.config.workers, num_servers: self.config.servers, credential }
            .into()
    }

    /// Whether a reattaching node's credential is this job's for `role` `id`.
    pub(super) fn check_credential(
        &self,
        credential: &Credential,
        role: PeerRole,
        id: u32,
    ) -> Result<(), (ErrorCode, String)> {
        credential.verify_for(&self.secret, self.job).map_err(|e| (ErrorCode::Unauthenticated, e.to_string()))?;
        if (credential.role, credential.id) != (role, id) {
            let message = format!("the credential of {credential} cannot reattach as {role:?} {id}");
            return Err((ErrorCode::Unauthenticated, message.to_lowercase()));
        }
        Ok(())
    }

    /// A restarted worker asks to come back as `rank`: every live server is asked to take
    /// it back ([`Control::AddWorker`]); it is welcomed once they all answered.
    pub(super) fn rejoin(
        &mut self,
        conn: ConnId,
        request_id: u64,
        rank: u32,
        out: &mut Vec<Action>,
    ) -> Result<(), String> {
        if rank >= self.config.workers {
            return Err(format!("worker {rank} cannot rejoin: the job has workers 0..{}", self.config.workers));
        }
        if rank as usize >= self.workers.len() {
            return Err(format!("worker {rank} cannot rejoin: it never joined (RegisterWorker)"));
        }
        if self.finished_workers.contains(&rank) && !self.failed_workers.contains_key(&rank) {
            return Err(format!("worker {rank} cannot rejoin: it finished"));
        }
        if !self.failed_workers.contains_key(&rank) {
            // Its old process is gone (it was restarted) but its connection has not been
            // seen closing yet: the new one takes the rank over. Only with the cluster
            // secret: a worker-secret connection proves no rank, and could take a live one.
            let old = self.nodes.iter().find(|(_, n)| n.role == Role::Worker(rank)).map(|(c, _)| *c);
            if old.is_some() && self.opened.get(&conn).is_some_and(|(k, _)| *k == KeyId::Worker) {
                return Err(format!(
                    "worker {rank} is connected: a connection of the worker secret rejoins only a rank the scheduler \
                     lost"
                ));
            }
            if let Some(old) = old {
                self.on_lost(old, "replaced by a restarted worker with its rank", out);
                out.push(Action::Close(old));
            }
        }
        if self.rejoining.contains_key(&rank) {
            return Err(format!("worker {rank} is already rejoining"));
        }
        let live: Vec<(u32, ConnId)> = self
            .nodes
            .iter()
            .filter_map(|(c, n)| match n.role {
                Role::Server(id) => Some((id, *c)),
                Role::Worker(_) => None,
            })
            .collect();
        tracing::info!(rank, servers = live.len(), "a restarted worker rejoins");
        let mut waiting = BTreeMap::new();
        for (id, server) in live {
            waiting.insert(id, 1);
            out.push(Action::Send { conn: server, request_id: 0, msg: Control::AddWorker { rank }.into() });
        }
        self.rejoining.insert(rank, Rejoin { conn, request_id, waiting, clock: None });
        self.worker_added(rank, u32::MAX, u32::MAX, out);
        Ok(())
    }

    /// Server `server` took `rank` back (its next clock there is `clock`); the last one
    /// to answer welcomes the worker.
    pub(super) fn worker_added(&mut self, rank: u32, server: u32, clock: u32, out: &mut Vec<Action>) {
        let Some(r) = self.rejoining.get_mut(&rank) else { return };
        if let btree_map::Entry::Occupied(mut left) = r.waiting.entry(server) {
            *left.get_mut() -= 1;
            if *left.get() == 0 {
                left.remove();
            }
        }
        // A server with none of the blocks answers u32::MAX.
        if clock != u32::MAX {
            r.clock = r.clock.max(Some(clock));
        }
        if !r.waiting.is_empty() {
            return;
        }
        let Some(r) = self.rejoining.remove(&rank) else { return };
        let clock = r.clock.unwrap_or_else(|| self.start_clock());
        tracing::info!(rank, clock, "worker rejoined");
        self.failed_workers.remove(&rank);
        self.finished_workers.remove(&rank);
        self.elastic.worker_rejoined(rank);
        self.rejoin_clocks.insert(rank, clock);
        if let Some(h) = self.hosts.as_mut() {
            h.worker_registered(rank, self.peers.get(&r.conn).map(String::as_str));
        }
        if let Some(c) = self.workers.get_mut(rank as usize) {
            *c = r.conn;
        }
        self.nodes.insert(r.conn, Node { role: Role::Worker(rank), last_seen_us: self.now_us });
        out.push(Action::Send { conn: r.conn, request_id: r.request_id, msg: self.welcome(PeerRole::Worker, rank) });
    }

    pub(super) fn worker_left(&mut self, rank: u32, out: &mut Vec<Action>) {
        if !self.finished_workers.insert(rank) {
            return;
        }
        self.elastic.worker_left(rank);
        self.barrier.retain(|(_, _, r)| *r != rank);
        self.release_barrier(out);
        for (conn, _) in &self.servers {
            out.push(Action::Send { conn: *conn, request_id: 0, msg: Control::RemoveWorker { rank }.into() });
        }
        self.maybe_end(out);
    }

    /// The node on `conn` is lost (`why`): what follows from it, and the rejoins that
    /// waited for it.
    pub(super) fn on_lost(&mut self, conn: ConnId, why: &str, out: &mut Vec<Action>) {
        let Some(node) = self.nodes.remove(&conn) else { return };
        self.optimizer_node_lost(conn, node.role, out);
        let silent_us = self.now_us.saturating_sub(node.last_seen_us);
        self.lose_node(node.role, why, silent_us, out);
        if let Role::Server(id) = node.role {
            // A restarted worker waits for no server that left. Its blocks failed over to
            // backups whose servers answered for the blocks they owned then, not for these
            // copies: they are asked again (after the `Replicas` promoting them), so that
            // its new life starts past every clock these blocks hold from its first.
            let ranks: Vec<u32> = self.rejoining.keys().copied().collect();
            for rank in ranks {
                if let Some(r) = self.rejoining.get_mut(&rank) {
                    r.waiting.remove(&id);
                }
                if self.config.replicas > 1 {
                    self.ask_to_add(rank, out);
                }
                self.worker_added(rank, u32::MAX, u32::MAX, out);
            }
        }
    }

    /// Asks every live server (again) to take `rank` back ([`Control::AddWorker`]), and
    /// waits for these answers too.
    fn ask_to_add(&mut self, rank: u32, out: &mut Vec<Action>) {
        let Some(r) = self.rejoining.get_mut(&rank) else { return };
        for (conn, n) in self.nodes.iter() {
            if let Role::Server(id) = n.role {
                *r.waiting.entry(id).or_default() += 1;
                out.push(Action::Send { conn: *conn, request_id: 0, msg: Control::AddWorker { rank }.into() });
            }
        }
    }

    /// What follows from losing the node `role`, silent for `silent_us`.
    fn lose_node(&mut self, role: Role, why: &str, silent_us: u64, out: &mut Vec<Action>) {
        match role {
            Role::Server(id) if self.elastic.lost(id, self.now_us) => {
                tracing::info!(server = id, %why, "a removed server left");
                // Its backup copies (a drained server backs up blocks it does not own).
                if let Some(p) = self.placement.as_mut()
                    && p.backups_on(id).next().is_some()
                    && p.fail_server(id).is_ok()
                {
                    self.rebuild_copies();
                    self.broadcast_replicas(out);
                }
                self.tell_workers_of_failover(out);
            }
            Role::Server(id) if self.config.replicas > 1 => self.failover(id, why, silent_us, out),
            Role::Server(id) => {
                let addr = self.servers.get(id as usize).map_or("", |(_, a)| a.as_str());
                let resume = match (&self.config.checkpoint, self.complete_checkpoint) {
                    (Some(plan), Some(clock)) => {
                        format!("; resume from its latest checkpoint (clock {clock}) with --resume {}", plan.dir)
                    }
                    (Some(plan), None) => format!("; no checkpoint in {} is complete yet", plan.dir),
                    (None, _) => "; with --checkpoint-dir DIR --checkpoint-every N a job can be resumed".into(),
                };
                self.finish(false, format!("server {id} ({addr}) is gone: {why}{resume}"), out);
            }
            Role::Worker(rank) if !self.finished_workers.contains(&rank) => {
                tracing::error!(rank, %why, "worker lost before it finished; removing it from every quorum");
                self.failed_workers.insert(rank, why.to_string());
                self.worker_left(rank, out);
            }
            Role::Worker(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::super::{Action, Event, JobConfig, Scheduler};
    use super::MAX_UNREGISTERED;
    use elasticps_wire::{Control, ErrorCode, KeyId, Message};

    /// Connection `conn` completes its handshake at `now_us` (with the worker secret).
    fn open(m: &mut Scheduler, now_us: u64, conn: u64) -> Vec<Action> {
        m.handle(now_us, Event::Connected { conn, peer: "10.0.0.9".into(), key: KeyId::Worker })
    }

    /// The connections an action list closes.
    fn closed(a: &[Action]) -> Vec<u64> {
        a.iter().filter_map(|x| if let Action::Close(c) = x { Some(*c) } else { None }).collect()
    }

    #[test]
    fn one_connection_more_than_the_unregistered_bound_takes_the_place_of_the_oldest_and_nodes_never_count() {
        assert_eq!(MAX_UNREGISTERED, 1024);
        let mut m = Scheduler::new(config(), 60_000_000).with_max_unregistered(3);
        // Two workers registered: they hold no place among the unregistered.
        open(&mut m, 1, 1);
        recv(&mut m, 1, 1, Control::RegisterWorker);
        open(&mut m, 2, 2);
        recv(&mut m, 2, 1, Control::RegisterWorker);
        assert!(m.is_registered(1) && m.is_registered(2));
        // Three silent connections take the three places, evicting no one.
        for (t, conn) in [(3, 100), (4, 101), (5, 102)] {
            assert!(closed(&open(&mut m, t, conn)).is_empty(), "room for {conn}");
        }
        assert!(!m.is_registered(100));
        // A fourth: the oldest silent one (100) goes, told why; no worker does.
        let a = open(&mut m, 6, 103);
        assert_eq!(closed(&a), [100], "{a:?}");
        let told = sent_to(&a, 100);
        assert!(
            matches!(told[..], [Message::Error(e)] if e.code == ErrorCode::BadRequest && e.message.contains("3 connections were waiting to register")),
            "{told:?}"
        );
        // What the evicted one sent before the close reached the runtime is dropped.
        assert!(recv(&mut m, 100, 1, Control::RegisterWorker).is_empty());
        // A late joiner connects under the flood and registers: the oldest silent one
        // made room for it, and once registered it holds no place.
        let a = m.handle(7, Event::Connected { conn: 104, peer: "10.0.0.2".into(), key: KeyId::Cluster });
        assert_eq!(closed(&a), [101], "{a:?}");
        let a = recv(&mut m, 104, 1, Control::RegisterServer { data_addr: "s0".into() });
        assert!(matches!(sent_to(&a, 104)[..], [Message::Control(Control::Welcome { .. })]), "{a:?}");
        assert!(m.is_registered(104), "a server is registered");
        // It left the places: one is free (102 and 103 hold the others).
        assert!(closed(&open(&mut m, 8, 105)).is_empty(), "a registered server holds no place");
        let a = open(&mut m, 9, 106);
        assert_eq!(closed(&a), [102], "{a:?}");
    }

    #[test]
    fn an_operator_question_renews_its_place_among_the_unregistered() {
        let mut m = Scheduler::new(config(), 60_000_000).with_max_unregistered(2);
        open(&mut m, 1, 50);
        open(&mut m, 2, 51);
        // The older connection asks (as `elasticps status --watch` polls): 51 is now the oldest.
        let a = m.handle(3, Event::Received { conn: 50, request_id: 1, msg: Control::GetStatus.into() });
        assert!(matches!(sent_to(&a, 50)[..], [Message::Control(Control::Status(_))]), "{a:?}");
        let a = open(&mut m, 4, 52);
        assert_eq!(closed(&a), [51], "{a:?}");
    }

    #[test]
    fn a_connection_that_never_sends_a_frame_is_closed_at_its_registration_deadline() {
        let mut m = Scheduler::new(config(), 60_000_000);
        open(&mut m, 5, 7);
        let at = m.poll_timeout().unwrap();
        let mut a = Vec::new();
        let mut t = at;
        // The wait reports come first; bounded.
        for _ in 0..5 {
            a = m.handle(t, Event::Timeout);
            if !closed(&a).is_empty() {
                break;
            }
            t = m.poll_timeout().unwrap();
        }
        assert_eq!(t, 5 + super::REGISTER_WITHIN_US + 1);
        assert_eq!(closed(&a), [7], "{a:?}");
        assert!(matches!(sent_to(&a, 7)[..], [Message::Error(e)] if e.message.contains("did not register")), "{a:?}");
    }

    #[test]
    fn refuses_extra_nodes_and_a_different_model() {
        let mut m = Scheduler::new(config(), 10_000_000);
        recv(&mut m, 1, 1, Control::RegisterWorker);
        recv(&mut m, 2, 1, Control::RegisterWorker);
        let a = recv(&mut m, 3, 1, Control::RegisterWorker);
        assert!(a.contains(&Action::Close(3)));
        recv(&mut m, 1, 2, Control::DefineModel { tensors: model(), optimizers: Vec::new(), tables: Vec::new() });
        let mut other = model();
        other[0].shape = vec![9];
        let a = recv(&mut m, 2, 2, Control::DefineModel { tensors: other, optimizers: Vec::new(), tables: Vec::new() });
        assert!(matches!(sent_to(&a, 2)[0], Message::Error(e) if e.message.contains("differs")));
    }

    #[test]
    fn job_ends_when_every_worker_is_done_and_fails_when_a_server_dies() {
        let mut m = Scheduler::new(config(), 10_000_000);
        recv(&mut m, 10, 1, Control::RegisterServer { data_addr: "s0".into() });
        recv(&mut m, 1, 1, Control::RegisterWorker);
        recv(&mut m, 2, 1, Control::RegisterWorker);
        let a = recv(&mut m, 1, 5, Control::WorkerDone { rank: 0 });
        assert!(sent_to(&a, 10).iter().any(|m| matches!(m, Message::Control(Control::RemoveWorker { rank: 0 }))));
        let a = recv(&mut m, 2, 5, Control::WorkerDone { rank: 1 });
        assert!(a.iter().any(|x| matches!(x, Action::Finish { ok: true, .. })));

        let mut m = Scheduler::new(config(), 10_000_000);
        recv(&mut m, 10, 1, Control::RegisterServer { data_addr: "s0".into() });
        let a = step(&mut m, Event::Lost { conn: 10, why: "closed".into() });
        assert!(a.iter().any(|x| matches!(x, Action::Finish { ok: false, reason } if reason.contains("server 0"))));
    }

    #[test]
    fn poll_timeout_names_the_heartbeat_expiry_of_a_silent_node_and_a_timeout_then_loses_it() {
        let mut m = Scheduler::new(config(), 1_000);
        recv(&mut m, 1, 1, Control::RegisterWorker);
        recv(&mut m, 2, 1, Control::RegisterWorker);
        m.handle(600, Event::Received { conn: 2, request_id: 0, msg: Control::Heartbeat.into() });
        assert_eq!(m.poll_timeout(), Some(1_001), "worker 0, silent since 0, expires past 1 ms");
        assert!(m.handle(1_000, Event::Timeout).is_empty(), "not before its expiry");
        let a = m.handle(1_001, Event::Timeout);
        assert!(a.contains(&Action::Close(1)), "{a:?}");
        assert!(!a.contains(&Action::Close(2)), "{a:?}");
        assert_eq!(m.poll_timeout(), Some(1_601), "now worker 1's expiry");
    }

    #[test]
    fn a_deadline_that_passed_and_still_stands_is_checked_again_a_tick_later() {
        let mut m = running(JobConfig { rejoin_wait_us: 200_000, ..config() }, 24);
        step(&mut m, Event::Lost { conn: 2, why: "killed".into() });
        recv(&mut m, 1, 5, Control::WorkerDone { rank: 0 });
        // Every worker left, one lost: the job waits 200 ms for it. It comes back, but the
        // servers have not taken it back yet when the wait is over: the job cannot end.
        recv(&mut m, 5, 1, Control::RejoinWorker { rank: 1 });
        assert_eq!(m.poll_timeout(), Some(200_000));
        let a = m.handle(200_000, Event::Timeout);
        assert!(!a.iter().any(|x| matches!(x, Action::Finish { .. })), "{a:?}");
        assert_eq!(m.poll_timeout(), Some(200_000 + crate::timing::SCHEDULER_TICK_US), "not at once again");
        // The servers take it back: it is welcomed, and the job goes on.
        recv(&mut m, 10, 0, Control::WorkerAdded { rank: 1, clock: 3 });
        let a = recv(&mut m, 11, 0, Control::WorkerAdded { rank: 1, clock: 3 });
        assert!(matches!(sent_to(&a, 5)[..], [Message::Control(Control::Welcome { node_id: 1, .. })]), "{a:?}");
    }

    #[test]
    fn a_silent_node_is_declared_dead_after_the_heartbeat_timeout() {
        let mut m = Scheduler::new(config(), 1_000);
        recv(&mut m, 1, 1, Control::RegisterWorker);
        recv(&mut m, 2, 1, Control::RegisterWorker);
        assert!(m.handle(500, Event::Timeout).is_empty());
        recv(&mut m, 2, 0, Control::Heartbeat);
        let a = m.handle(1_400, Event::Timeout);
        assert!(a.contains(&Action::Close(1)));
        assert!(!a.contains(&Action::Close(2)));
    }

    #[test]
    fn a_lost_worker_rejoins_once_every_server_took_it_back_and_the_job_then_ends_well() {
        let mut m = running(config(), 24);
        let refused = |a: &[Action], conn| sent_to(a, conn).iter().any(|m| matches!(m, Message::Error(_)));
        assert!(refused(&recv(&mut m, 4, 1, Control::RejoinWorker { rank: 7 }), 4), "no rank 7");
        let a = step(&mut m, Event::Lost { conn: 2, why: "closed".into() });
        assert!(sent_to(&a, 10).iter().any(|m| matches!(m, Message::Control(Control::RemoveWorker { rank: 1 }))));
        // Restarted: every server is asked to take rank 1 back; the worker waits for both.
        let a = recv(&mut m, 5, 1, Control::RejoinWorker { rank: 1 });
        for server in [10, 11] {
            assert!(sent_to(&a, server).iter().any(|m| matches!(m, Message::Control(Control::AddWorker { rank: 1 }))));
        }
        assert!(sent_to(&a, 5).is_empty(), "no welcome before the servers answered");
        assert!(recv(&mut m, 10, 0, Control::WorkerAdded { rank: 1, clock: 9 }).is_empty());
        let a = recv(&mut m, 11, 0, Control::WorkerAdded { rank: 1, clock: 7 });
        assert!(matches!(sent_to(&a, 5)[..], [Message::Control(Control::Welcome { node_id: 1, .. })]), "{a:?}");
        let a = recv(&mut m, 5, 2, Control::GetStartClock);
        // It goes on from the largest next clock: each clock of its new life reaches
        // every block or none (a clock one block's quorum went on without is lost on all).
        assert!(matches!(sent_to(&a, 5)[..], [Message::Control(Control::StartClock { clock: 9 })]), "{a:?}");
        recv(&mut m, 1, 5, Control::WorkerDone { rank: 0 });
        assert!(refused(&recv(&mut m, 6, 1, Control::RejoinWorker { rank: 0 }), 6), "rank 0 finished");
        let a = recv(&mut m, 5, 5, Control::WorkerDone { rank: 1 });
        assert!(a.iter().any(|x| matches!(x, Action::Finish { ok: true, .. })), "{a:?}");
    }

    #[test]
    fn a_rejoin_waiting_for_a_lost_primary_asks_the_promoted_backup_again_for_its_clock() {
        // Replicas 2: block 0 on server 0 backed up on server 1, block 1 the other way.
        let mut m = running(JobConfig { replicas: 2, ..config() }, 8);
        step(&mut m, Event::Lost { conn: 2, why: "closed".into() });
        recv(&mut m, 5, 1, Control::RejoinWorker { rank: 1 });
        // Server 1 answers for the block it owns; server 0 (silent) is lost before it answers.
        assert!(recv(&mut m, 11, 0, Control::WorkerAdded { rank: 1, clock: 2 }).is_empty());
        let a = step(&mut m, Event::Lost { conn: 10, why: "no heartbeat".into() });
        let to_11 = sent_to(&a, 11);
        let promoted = to_11.iter().position(|m| matches!(m, Message::Control(Control::Replicas { .. })));
        let asked = to_11.iter().position(|m| matches!(m, Message::Control(Control::AddWorker { rank: 1 })));
        assert!(promoted.is_some_and(|p| asked.is_some_and(|q| p < q)), "asked again after its promotion: {a:?}");
        assert!(sent_to(&a, 5).is_empty(), "no welcome before the promoted copy's clock is known: {a:?}");
        // Its promoted copy holds 6 clocks of rank 1's first life: the new life starts there.
        let a = recv(&mut m, 11, 0, Control::WorkerAdded { rank: 1, clock: 6 });
        assert!(matches!(sent_to(&a, 5)[..], [Message::Control(Control::Welcome { node_id: 1, .. })]), "{a:?}");
        let a = recv(&mut m, 5, 2, Control::GetStartClock);
        assert!(matches!(sent_to(&a, 5)[..], [Message::Control(Control::StartClock { clock: 6 })]), "{a:?}");
    }

    #[test]
    fn a_restarted_worker_takes_its_rank_over_from_a_connection_not_seen_closing_yet() {
        let mut m = running(config(), 24);
        let a = recv(&mut m, 5, 1, Control::RejoinWorker { rank: 1 });
        assert!(a.contains(&Action::Close(2)), "the old connection of rank 1 is dropped: {a:?}");
        assert!(sent_to(&a, 10).iter().any(|m| matches!(m, Message::Control(Control::RemoveWorker { rank: 1 }))));
        assert!(sent_to(&a, 10).iter().any(|m| matches!(m, Message::Control(Control::AddWorker { rank: 1 }))));
        recv(&mut m, 10, 0, Control::WorkerAdded { rank: 1, clock: 4 });
        let a = recv(&mut m, 11, 0, Control::WorkerAdded { rank: 1, clock: 4 });
        assert!(matches!(sent_to(&a, 5)[..], [Message::Control(Control::Welcome { node_id: 1, .. })]), "{a:?}");
    }
}
