//! The barrier: workers wait in a `Barrier` until every worker still in the job (not done,
//! not removed) waits in it.

use elasticps_wire::Control;

use super::{Action, Caller, Role, Scheduler};

impl Scheduler {
    /// `Barrier`, from a worker.
    pub(super) fn on_barrier(&mut self, call: Caller, control: Control, out: &mut Vec<Action>) {
        match (control, call.role) {
            (Control::Barrier, Some(Role::Worker(rank))) => {
                self.barrier.retain(|(_, _, r)| *r != rank);
                self.barrier.push((call.conn, call.request_id, rank));
                self.release_barrier(out);
            }
            (other, _) => call.refuse_now(out, other),
        }
    }

    /// Answers a barrier once every worker still in the job (registered or yet to come,
    /// not done and not removed) waits in it.
    pub(super) fn release_barrier(&mut self, out: &mut Vec<Action>) {
        let live = (self.config.workers as usize).saturating_sub(self.finished_workers.len());
        if self.barrier.is_empty() || self.barrier.len() < live {
            return;
        }
        tracing::debug!(workers = self.barrier.len(), "barrier released");
        for (conn, request_id, _) in self.barrier.drain(..) {
            out.push(Action::Send { conn, request_id, msg: Control::Ok.into() });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::super::{Action, Event, Scheduler};
    use elasticps_wire::Control;

    #[test]
    fn a_barrier_opens_when_every_live_worker_waits_in_it() {
        let mut m = Scheduler::new(config(), 10_000_000);
        recv(&mut m, 1, 1, Control::RegisterWorker);
        recv(&mut m, 2, 1, Control::RegisterWorker);
        assert!(recv(&mut m, 1, 7, Control::Barrier).is_empty());
        let a = recv(&mut m, 2, 9, Control::Barrier);
        assert_eq!(
            a,
            vec![
                Action::Send { conn: 1, request_id: 7, msg: Control::Ok.into() },
                Action::Send { conn: 2, request_id: 9, msg: Control::Ok.into() }
            ]
        );
        // A worker that dies while the other waits lets it through.
        assert!(recv(&mut m, 1, 8, Control::Barrier).is_empty());
        let a = step(&mut m, Event::Lost { conn: 2, why: "killed".into() });
        assert!(a.contains(&Action::Send { conn: 1, request_id: 8, msg: Control::Ok.into() }), "{a:?}");
    }
}
