//! The model and its layout: a worker defines the model (its tensors and their
//! optimizers), the scheduler places its blocks once the servers registered and sends each
//! server its `Assign`; workers wait for the layout until every server holds its blocks.
//! Also the start clock.

use std::collections::BTreeSet;

use elasticps_core::model::{Partition, TableSpec, TensorSpec};
use elasticps_core::optimizer::TensorOptimizer;
use elasticps_core::placement::Placement;
use elasticps_wire::{Assignment, Control, ErrorCode, Layout, ServerAddr};

use super::{Action, Caller, ConnId, Role, Scheduler};

impl Scheduler {
    /// `DefineModel`, `GetLayout` (also an operator tool's), `AssignDone`, `GetStartClock`.
    pub(super) fn on_layout(&mut self, call: Caller, control: Control, out: &mut Vec<Action>) {
        let (conn, request_id) = (call.conn, call.request_id);
        match (control, call.role) {
            (Control::DefineModel { tensors, optimizers, tables }, Some(Role::Worker(rank))) => {
                if let Err(message) = self.define(tensors, optimizers, tables, rank) {
                    call.refuse(out, ErrorCode::BadRequest, message);
                    return;
                }
                self.waiting_for_layout.push((conn, request_id));
                self.try_assign(out);
                self.answer_layout_waiters(out);
            }
            (Control::GetStartClock, Some(role)) => {
                let rejoined = match role {
                    Role::Worker(rank) => self.rejoin_clocks.get(&rank).copied(),
                    Role::Server(_) => None,
                };
                call.reply(out, Control::StartClock { clock: rejoined.unwrap_or(self.start_clock()) }.into())
            }
            // A node's, or an operator tool's (`elasticps export`, not registered).
            (Control::GetLayout, _) => {
                if self.partition.is_none() {
                    call.refuse(out, ErrorCode::NotReady, "no model is defined yet".into());
                    return;
                }
                self.waiting_for_layout.push((conn, request_id));
                self.answer_layout_waiters(out);
            }
            (Control::AssignDone { .. }, Some(Role::Server(id))) if self.layout_ready => {
                if let Some(placement) = self.placement.as_ref() {
                    let orders = self.elastic.serving_now(id, placement, self.now_us);
                    self.carry_out(orders, out);
                }
            }
            (Control::AssignDone { .. }, Some(Role::Server(id))) => {
                self.assigned.insert(id);
                if self.assigned.len() as u32 == self.config.servers {
                    tracing::info!(servers = self.config.servers, "every server holds its blocks: training can start");
                    self.layout_ready = true;
                    self.answer_layout_waiters(out);
                }
            }
            (other, _) => call.refuse_now(out, other),
        }
    }

    fn define(
        &mut self,
        tensors: Vec<TensorSpec>,
        optimizers: Vec<Option<TensorOptimizer>>,
        tables: Vec<TableSpec>,
        rank: u32,
    ) -> Result<(), String> {
        match &self.partition {
            Some(p) if p.tensors == tensors && p.tables == tables => Ok(()),
            Some(p) => Err(format!(
                "worker {rank} defined a model that differs from the one already defined ({} tensors, first {:?}, \
                 {} tables; got {} tensors, {} tables)",
                p.tensors.len(),
                p.tensors.first().map(|t| &t.name),
                p.tables.len(),
                tensors.len(),
                tables.len()
            )),
            None => {
                let p = Partition::with_tables(tensors, tables, self.config.block_bytes)
                    .map(|p| p.with_servers(self.config.servers))
                    .and_then(|p| p.with_optimizers(optimizers))
                    .map_err(|e| e.to_string())?;
                tracing::info!(
                    tensors = p.tensors.len(),
                    tables = p.tables.len(),
                    blocks = p.blocks.len(),
                    values = p.total_len(),
                    "model defined"
                );
                self.partition = Some(p);
                Ok(())
            }
        }
    }

    pub(super) fn try_assign(&mut self, out: &mut Vec<Action>) {
        let Some(partition) = &self.partition else { return };
        if self.placement.is_some() || (self.servers.len() as u32) < self.config.servers {
            return;
        }
        if let Some(r) = self.config.checkpoint.as_ref().and_then(|p| p.resume.as_ref())
            && r.blocks.len() != partition.blocks.len()
        {
            let reason = format!(
                "the checkpoint of clock {} holds {} blocks, this model in blocks of {} bytes has {}: resume with the \
                 same model and --block-bytes",
                r.clock,
                r.blocks.len(),
                self.config.block_bytes,
                partition.blocks.len()
            );
            self.finish(false, reason, out);
            return;
        }
        let placement = match Placement::initial(self.config.placement, partition, self.config.servers)
            .and_then(|p| p.with_replicas(self.config.replicas, self.config.servers))
        {
            Ok(p) => p,
            Err(e) => {
                self.finish(false, format!("cannot place the model: {e}"), out);
                return;
            }
        };
        self.elastic.model_placed(partition.blocks.iter().map(|b| b.bytes() as u64).collect());
        self.placement = Some(placement);
        for id in 0..self.servers.len() {
            if let Some(a) = self.assignment(id as u32) {
                self.send_assignment(self.servers[id].0, a, out);
            }
        }
    }

    /// `Assign` to a server, after the checkpoint plan if the job has one. A server that
    /// joins after a worker rejoined learns the rank too (`AddWorker`): a block that moves
    /// to it later may get that worker's pushes past the clock it held for it.
    pub(super) fn send_assignment(&self, conn: ConnId, a: Assignment, out: &mut Vec<Action>) {
        if let Some(plan) = &self.config.checkpoint {
            out.push(Action::Send { conn, request_id: 0, msg: Control::Checkpointing(plan.clone()).into() });
        }
        out.push(Action::Send { conn, request_id: 0, msg: Control::Assign(Box::new(a)).into() });
        if let Some(msg) = self.replicas_message() {
            out.push(Action::Send { conn, request_id: 0, msg });
        }
        // Not one that left since (that would take it back into the quorums).
        let rejoined: BTreeSet<u32> = (self.rejoin_clocks.keys())
            .filter(|r| !self.finished_workers.contains(r))
            .chain(self.rejoining.keys())
            .copied()
            .collect();
        for rank in rejoined {
            out.push(Action::Send { conn, request_id: 0, msg: Control::AddWorker { rank }.into() });
        }
    }

    /// The first clock of the job: the resumed checkpoint's, or 0.
    pub fn start_clock(&self) -> u32 {
        self.config.checkpoint.as_ref().and_then(|p| p.resume.as_ref()).map_or(0, |r| r.clock)
    }

    /// What server `id` is to hold now (for a late server: nothing, until blocks move to it).
    pub(super) fn assignment(&self, id: u32) -> Option<Assignment> {
        Some(Assignment {
            server_id: id,
            partition: self.partition.clone()?,
            placement: self.placement.clone()?,
            config: self.config.shard_config(id),
            seed: self.config.seed,
            inject: self.config.injection(id),
        })
    }

    pub(super) fn layout(&self) -> Option<Layout> {
        let removed = self.elastic.removed();
        Some(Layout {
            partition: self.partition.clone()?,
            placement: self.placement.clone()?,
            servers: self
                .servers
                .iter()
                .enumerate()
                .filter(|(id, _)| !removed.contains(&(*id as u32)))
                .map(|(id, (_, addr))| ServerAddr { id: id as u32, addr: addr.clone() })
                .collect(),
            seed: self.config.seed,
            wire: self.elastic.wire().to_vec(),
        })
    }

    pub(super) fn answer_layout_waiters(&mut self, out: &mut Vec<Action>) {
        if !self.layout_ready {
            return;
        }
        let Some(layout) = self.layout() else { return };
        for (conn, request_id) in self.waiting_for_layout.drain(..) {
            out.push(Action::Send { conn, request_id, msg: Control::Layout(layout.clone()).into() });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::super::{Action, Scheduler};
    use elasticps_core::optimizer::{OptimizerKind, TensorOptimizer};
    use elasticps_core::sync::SyncPolicy;
    use elasticps_wire::{Control, Message};

    #[test]
    fn layout_is_answered_once_every_server_holds_its_blocks() {
        let mut m = Scheduler::new(config(), 10_000_000);
        recv(&mut m, 1, 1, Control::RegisterWorker);
        let a =
            recv(&mut m, 1, 2, Control::DefineModel { tensors: model(), optimizers: Vec::new(), tables: Vec::new() });
        assert!(a.is_empty(), "no servers yet: {a:?}");
        recv(&mut m, 10, 1, Control::RegisterServer { data_addr: "s0".into() });
        let a = recv(&mut m, 11, 1, Control::RegisterServer { data_addr: "s1".into() });
        assert!(matches!(sent_to(&a, 10)[0], Message::Control(Control::Assign(x)) if x.config.sync == SyncPolicy::Bsp));
        assert!(
            matches!(sent_to(&a, 11)[1], Message::Control(Control::Assign(x)) if x.config.sync == SyncPolicy::Ssp(2))
        );
        assert!(recv(&mut m, 10, 0, Control::AssignDone { server_id: 0 }).is_empty());
        let a = recv(&mut m, 11, 0, Control::AssignDone { server_id: 1 });
        match &a[..] {
            [Action::Send { conn: 1, request_id: 2, msg: Message::Control(Control::Layout(l)) }] => {
                assert_eq!(l.partition.blocks.len(), 2);
                assert_eq!(l.servers[1].addr, "s1");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            m.waiting_for(),
            Some("scheduler waits for 2 servers and 2 workers to register (has 2 servers, 1 workers)".into())
        );
    }

    #[test]
    fn an_operator_gets_the_layout_without_registering() {
        // `elasticps export`: an unregistered connection asks, and waits for the layout
        // as a worker would.
        let mut m = Scheduler::new(config(), 10_000_000);
        let none = recv(&mut m, 50, 1, Control::GetLayout);
        assert!(
            matches!(&sent_to(&none, 50)[..], [Message::Error(e)] if e.code == elasticps_wire::ErrorCode::NotReady),
            "no model yet: {none:?}"
        );
        recv(&mut m, 1, 1, Control::RegisterWorker);
        recv(&mut m, 1, 2, Control::DefineModel { tensors: model(), optimizers: Vec::new(), tables: Vec::new() });
        assert!(recv(&mut m, 50, 2, Control::GetLayout).is_empty(), "no servers yet");
        recv(&mut m, 10, 1, Control::RegisterServer { data_addr: "s0".into() });
        recv(&mut m, 11, 1, Control::RegisterServer { data_addr: "s1".into() });
        recv(&mut m, 10, 0, Control::AssignDone { server_id: 0 });
        let a = recv(&mut m, 11, 0, Control::AssignDone { server_id: 1 });
        assert!(matches!(&sent_to(&a, 50)[..], [Message::Control(Control::Layout(_))]), "{a:?}");
    }

    #[test]
    fn tensor_optimizers_are_defined_with_the_model_and_changed_later() {
        let mut m = Scheduler::new(config(), 10_000_000);
        recv(&mut m, 1, 1, Control::RegisterWorker);
        let sgd = TensorOptimizer { kind: OptimizerKind::Sgd, lr: 0.1, weight_decay: 0.0 };
        recv(&mut m, 1, 2, Control::DefineModel { tensors: model(), optimizers: vec![Some(sgd)], tables: Vec::new() });
        let slower = TensorOptimizer { lr: 0.01, ..sgd };
        let a = recv(&mut m, 1, 3, Control::SetOptimizer { tensor: 0, optimizer: slower });
        assert_eq!(a, vec![Action::Send { conn: 1, request_id: 3, msg: Control::Ok.into() }]);
        assert_eq!(m.partition.as_ref().unwrap().optimizer(0), Some(&slower));
        let a = recv(&mut m, 1, 4, Control::SetOptimizer { tensor: 5, optimizer: slower });
        assert!(matches!(sent_to(&a, 1)[0], Message::Error(e) if e.message.contains("tensor 5")));
    }
}
