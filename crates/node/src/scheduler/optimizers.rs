//! A tensor's optimizer changed while training runs (docs/PROTOCOL.md §6.13): a worker's
//! `SetOptimizer` goes to the scheduler alone, which records it in its partition (the
//! layout, and the `Assign` of every server that registers later), sends it on to every
//! live server, and answers the worker once each of them applied it (`OptimizerSet`). A
//! server lost meanwhile is not waited for; a worker lost meanwhile is answered by no one.
//!
//! A server applies the scheduler's messages in the order it sent them and answers them
//! in that order, so its `OptimizerSet` for a tensor answers the oldest set of that
//! tensor it was sent and has not answered: two sets of one tensor (two workers at
//! different steps of a schedule) reach every server in the scheduler's order, and each
//! server ends with the scheduler's record.

use std::collections::{BTreeMap, BTreeSet};

use elasticps_core::optimizer::TensorOptimizer;
use elasticps_wire::{Control, ErrorCode};

use super::{Action, Caller, ConnId, Role, Scheduler};

/// The `SetOptimizer` calls one worker connection may have waiting for the servers at
/// once; one more is refused (`BadRequest`) until one is answered.
pub const MAX_PENDING_SETS_PER_WORKER: usize = 4;

/// One worker's `SetOptimizer`, recorded and sent to the servers, not answered yet.
#[derive(Debug)]
struct PendingSet {
    /// Whom to answer (connection, request id); `None` once that worker's connection
    /// closed (kept only to match the servers' answers still to come).
    reply: Option<(ConnId, u64)>,
    /// The worker's rank, for the log.
    rank: u32,
    /// The tensor.
    tensor: u32,
    /// The servers (by id) that have not applied it yet.
    waiting: BTreeSet<u32>,
}

/// The `SetOptimizer` calls waiting for the servers, in the order the scheduler recorded
/// (and sent) them.
#[derive(Debug, Default)]
pub(super) struct OptimizerSets {
    next: u64,
    pending: BTreeMap<u64, PendingSet>,
    /// Sets that came while a restarted scheduler waits for servers to reattach (a worker
    /// makes its calls in flight again once welcomed): taken once every server is back.
    deferred: Vec<(Caller, u32, u32, TensorOptimizer)>,
}

impl OptimizerSets {
    /// The sets still to be answered on `conn`.
    fn on_conn(&self, conn: ConnId) -> usize {
        let pending = self.pending.values().filter(|p| p.reply.is_some_and(|(c, _)| c == conn)).count();
        pending + self.deferred.iter().filter(|(call, ..)| call.conn == conn).count()
    }

    /// Every set sent and not yet applied by every server it waits for (answered or not).
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.pending.len()
    }

    /// Removes the sets no server is still to apply, answering their workers `Ok`.
    fn complete(&mut self, out: &mut Vec<Action>) {
        let done: Vec<u64> = self.pending.iter().filter(|(_, p)| p.waiting.is_empty()).map(|(s, _)| *s).collect();
        for seq in done {
            let Some(p) = self.pending.remove(&seq) else { continue };
            match p.reply {
                Some((conn, request_id)) => {
                    tracing::info!(rank = p.rank, tensor = p.tensor, "tensor optimizer set on every server");
                    out.push(Action::Send { conn, request_id, msg: Control::Ok.into() });
                }
                None => tracing::debug!(rank = p.rank, tensor = p.tensor, "tensor optimizer set, its worker gone"),
            }
        }
    }
}

impl Scheduler {
    /// Worker `rank`'s `SetOptimizer` of `tensor`: refused (nothing changed) if the
    /// connection has [`MAX_PENDING_SETS_PER_WORKER`] waiting, the model is not defined or
    /// the optimizer is invalid; held while a restarted scheduler waits for servers to
    /// reattach; else recorded, sent to every live server, and answered once they all
    /// applied it.
    pub(super) fn set_optimizer(
        &mut self,
        call: Caller,
        rank: u32,
        tensor: u32,
        optimizer: TensorOptimizer,
        out: &mut Vec<Action>,
    ) {
        if self.optimizer_sets.on_conn(call.conn) >= MAX_PENDING_SETS_PER_WORKER {
            let message = format!(
                "worker {rank} has {MAX_PENDING_SETS_PER_WORKER} SetOptimizer calls waiting for the servers, the most \
                 one worker may have: wait for their answers; nothing changed"
            );
            return call.refuse(out, ErrorCode::BadRequest, message);
        }
        if self.recovering() {
            tracing::info!(rank, tensor, "tensor optimizer held until every server reattached");
            return self.optimizer_sets.deferred.push((call, rank, tensor, optimizer));
        }
        let Some(partition) = self.partition.as_mut() else {
            return call.refuse(out, ErrorCode::NotReady, "no model is defined yet".into());
        };
        if let Err(e) = partition.set_optimizer(tensor, optimizer) {
            return call.refuse(out, ErrorCode::BadRequest, e.to_string());
        }
        let mut waiting = BTreeSet::new();
        for (conn, node) in self.nodes.iter() {
            if let Role::Server(id) = node.role {
                waiting.insert(id);
                let msg = Control::SetOptimizer { tensor, optimizer }.into();
                out.push(Action::Send { conn: *conn, request_id: 0, msg });
            }
        }
        tracing::info!(
            rank,
            tensor,
            ?optimizer,
            servers = waiting.len(),
            "tensor optimizer recorded, sent to every server"
        );
        let sets = &mut self.optimizer_sets;
        let seq = sets.next;
        sets.next += 1;
        sets.pending.insert(seq, PendingSet { reply: Some((call.conn, call.request_id)), rank, tensor, waiting });
        sets.complete(out);
    }

    /// Every server reattached to a restarted scheduler: the sets held meanwhile are taken.
    pub(super) fn release_deferred_sets(&mut self, out: &mut Vec<Action>) {
        if self.recovering() {
            return;
        }
        for (call, rank, tensor, optimizer) in std::mem::take(&mut self.optimizer_sets.deferred) {
            self.set_optimizer(call, rank, tensor, optimizer, out);
        }
    }

    /// Server `server` applied the oldest `SetOptimizer` of `tensor` it had not answered.
    pub(super) fn optimizer_set(&mut self, server: u32, tensor: u32, out: &mut Vec<Action>) {
        let sets = &mut self.optimizer_sets;
        let Some(p) = sets.pending.values_mut().find(|p| p.tensor == tensor && p.waiting.contains(&server)) else {
            tracing::debug!(server, tensor, "an OptimizerSet that answers no set");
            return;
        };
        p.waiting.remove(&server);
        sets.complete(out);
    }

    /// The node `role` on `conn` is lost: no set waits for a lost server any longer, and
    /// a lost worker's sets are answered to no one.
    pub(super) fn optimizer_node_lost(&mut self, conn: ConnId, role: Role, out: &mut Vec<Action>) {
        let sets = &mut self.optimizer_sets;
        match role {
            Role::Server(id) => {
                sets.pending.values_mut().for_each(|p| {
                    p.waiting.remove(&id);
                });
                sets.complete(out);
            }
            Role::Worker(rank) => {
                sets.deferred.retain(|(call, ..)| call.conn != conn);
                for p in sets.pending.values_mut().filter(|p| p.reply.is_some_and(|(c, _)| c == conn)) {
                    tracing::info!(rank, tensor = p.tensor, "a SetOptimizer is answered to no one: its worker left");
                    p.reply = None;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::super::{Action, Event, JobConfig};
    use super::MAX_PENDING_SETS_PER_WORKER;
    use elasticps_core::optimizer::{OptimizerKind, TensorOptimizer};
    use elasticps_wire::{Control, ErrorCode, Message};

    fn sgd(lr: f32) -> TensorOptimizer {
        TensorOptimizer { kind: OptimizerKind::Sgd, lr, weight_decay: 0.0 }
    }

    fn answered(a: &[Action], conn: u64, request_id: u64) -> bool {
        a.iter().any(|x| {
            matches!(x, Action::Send { conn: c, request_id: r, msg: Message::Control(Control::Ok) }
                if *c == conn && *r == request_id)
        })
    }

    fn forwarded(a: &[Action], conn: u64) -> Vec<TensorOptimizer> {
        sent_to(a, conn)
            .into_iter()
            .filter_map(|m| match m {
                Message::Control(Control::SetOptimizer { optimizer, .. }) => Some(*optimizer),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn the_worker_is_answered_only_after_every_servers_ack() {
        let mut m = running(config(), 24);
        let a = recv(&mut m, 1, 7, Control::SetOptimizer { tensor: 0, optimizer: sgd(0.01) });
        assert_eq!(forwarded(&a, 10), [sgd(0.01)], "{a:?}");
        assert_eq!(forwarded(&a, 11), [sgd(0.01)], "{a:?}");
        assert!(sent_to(&a, 1).is_empty(), "no answer before the servers applied it: {a:?}");
        assert_eq!(m.partition().unwrap().optimizer(0), Some(&sgd(0.01)), "recorded at once (the layout)");
        assert!(recv(&mut m, 10, 0, Control::OptimizerSet { tensor: 0 }).is_empty());
        // An answer for another tensor answers nothing.
        assert!(recv(&mut m, 11, 0, Control::OptimizerSet { tensor: 3 }).is_empty());
        let a = recv(&mut m, 11, 0, Control::OptimizerSet { tensor: 0 });
        assert!(answered(&a, 1, 7), "{a:?}");
        assert_eq!(m.optimizer_sets.len(), 0);
        // Refused by the record: nothing sent to the servers, nothing waits.
        let a = recv(&mut m, 1, 8, Control::SetOptimizer { tensor: 5, optimizer: sgd(0.01) });
        assert!(matches!(sent_to(&a, 1)[..], [Message::Error(e)] if e.message.contains("tensor 5")), "{a:?}");
        assert!(forwarded(&a, 10).is_empty() && m.optimizer_sets.len() == 0);
    }

    #[test]
    fn a_server_lost_meanwhile_releases_the_wait() {
        let mut m = running(JobConfig { replicas: 2, ..config() }, 8);
        recv(&mut m, 1, 7, Control::SetOptimizer { tensor: 0, optimizer: sgd(0.01) });
        assert!(recv(&mut m, 10, 0, Control::OptimizerSet { tensor: 0 }).is_empty());
        let a = step(&mut m, Event::Lost { conn: 11, why: "killed".into() });
        assert!(answered(&a, 1, 7), "{a:?}");
        assert_eq!(m.optimizer_sets.len(), 0);
        // A later set is sent to, and waits for, the live server alone.
        let a = recv(&mut m, 2, 3, Control::SetOptimizer { tensor: 0, optimizer: sgd(0.02) });
        assert!(forwarded(&a, 11).is_empty() && sent_to(&a, 2).is_empty(), "{a:?}");
        assert!(answered(&recv(&mut m, 10, 0, Control::OptimizerSet { tensor: 0 }), 2, 3));
    }

    #[test]
    fn two_concurrent_sets_of_one_tensor_are_both_answered_and_the_record_is_the_last() {
        let mut m = running(config(), 24);
        let a = recv(&mut m, 1, 7, Control::SetOptimizer { tensor: 0, optimizer: sgd(0.01) });
        let b = recv(&mut m, 2, 4, Control::SetOptimizer { tensor: 0, optimizer: sgd(0.02) });
        // Every server is sent both, in the order recorded.
        for server in [10, 11] {
            assert_eq!([forwarded(&a, server), forwarded(&b, server)].concat(), [sgd(0.01), sgd(0.02)]);
        }
        // Server 0 applies both, server 1 the first: only the first worker is answered.
        recv(&mut m, 10, 0, Control::OptimizerSet { tensor: 0 });
        recv(&mut m, 10, 0, Control::OptimizerSet { tensor: 0 });
        let a = recv(&mut m, 11, 0, Control::OptimizerSet { tensor: 0 });
        assert!(answered(&a, 1, 7) && !answered(&a, 2, 4), "{a:?}");
        let a = recv(&mut m, 11, 0, Control::OptimizerSet { tensor: 0 });
        assert!(answered(&a, 2, 4), "{a:?}");
        assert_eq!(m.partition().unwrap().optimizer(0), Some(&sgd(0.02)));
        assert_eq!(m.optimizer_sets.len(), 0);
    }

    #[test]
    fn a_worker_disconnect_drops_its_pending_set_and_no_later_set_is_answered_early() {
        let mut m = running(JobConfig { rejoin_wait_us: 60_000_000, ..config() }, 24);
        recv(&mut m, 1, 7, Control::SetOptimizer { tensor: 0, optimizer: sgd(0.01) });
        step(&mut m, Event::Lost { conn: 1, why: "closed".into() });
        assert_eq!(m.optimizer_sets.on_conn(1), 0, "nothing waits to answer a closed connection");
        recv(&mut m, 2, 4, Control::SetOptimizer { tensor: 0, optimizer: sgd(0.02) });
        // The servers' answers to the first set answer no one, not the second.
        let a = recv(&mut m, 10, 0, Control::OptimizerSet { tensor: 0 });
        let b = recv(&mut m, 11, 0, Control::OptimizerSet { tensor: 0 });
        assert!(!answered(&a, 1, 7) && !answered(&b, 1, 7) && !answered(&b, 2, 4), "{a:?} {b:?}");
        assert_eq!(m.optimizer_sets.len(), 1, "the first is gone once both servers applied it");
        recv(&mut m, 10, 0, Control::OptimizerSet { tensor: 0 });
        let a = recv(&mut m, 11, 0, Control::OptimizerSet { tensor: 0 });
        assert!(answered(&a, 2, 4), "{a:?}");
        assert_eq!(m.optimizer_sets.len(), 0);
    }

    #[test]
    fn a_worker_may_have_only_so_many_sets_waiting() {
        let mut m = running(config(), 24);
        for r in 0..MAX_PENDING_SETS_PER_WORKER as u64 {
            recv(&mut m, 1, 10 + r, Control::SetOptimizer { tensor: 0, optimizer: sgd(0.01) });
        }
        let a = recv(&mut m, 1, 99, Control::SetOptimizer { tensor: 0, optimizer: sgd(0.5) });
        let refused = |a: &[Action]| {
            matches!(sent_to(a, 1)[..], [Message::Error(e)]
                if e.code == ErrorCode::BadRequest && e.message.contains(&format!("{MAX_PENDING_SETS_PER_WORKER} SetOptimizer")))
        };
        assert!(refused(&a), "{a:?}");
        assert!(forwarded(&a, 10).is_empty(), "nothing sent: {a:?}");
        assert_eq!(m.partition().unwrap().optimizer(0), Some(&sgd(0.01)), "nothing recorded");
        // Another worker is not bounded by this one's.
        let a = recv(&mut m, 2, 5, Control::SetOptimizer { tensor: 0, optimizer: sgd(0.5) });
        assert_eq!(forwarded(&a, 10), [sgd(0.5)]);
        // Once one is answered the worker may set another.
        recv(&mut m, 10, 0, Control::OptimizerSet { tensor: 0 });
        recv(&mut m, 11, 0, Control::OptimizerSet { tensor: 0 });
        let a = recv(&mut m, 1, 100, Control::SetOptimizer { tensor: 0, optimizer: sgd(0.5) });
        assert_eq!(forwarded(&a, 10), [sgd(0.5)]);
    }

    #[test]
    fn a_server_that_registers_later_gets_the_record_in_its_assignment() {
        let mut m = running(JobConfig { max_servers: 3, ..config() }, 24);
        recv(&mut m, 1, 7, Control::SetOptimizer { tensor: 0, optimizer: sgd(0.01) });
        let a = recv(&mut m, 12, 1, Control::RegisterServer { data_addr: "s2".into() });
        let assign = sent_to(&a, 12).into_iter().find_map(|m| match m {
            Message::Control(Control::Assign(x)) => Some(x.partition.optimizer(0).copied()),
            _ => None,
        });
        assert_eq!(assign, Some(Some(sgd(0.01))), "{a:?}");
        // It was not asked: the two servers' answers suffice.
        recv(&mut m, 10, 0, Control::OptimizerSet { tensor: 0 });
        assert!(answered(&recv(&mut m, 11, 0, Control::OptimizerSet { tensor: 0 }), 1, 7));
    }
}
