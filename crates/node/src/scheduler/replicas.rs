//! Replicas (`--replicas`): every block has a primary and `replicas - 1` backups on
//! distinct serving servers. The copies are rebuilt when servers drain, leave or join; the
//! servers learn who holds what from `Replicas`; a lost server's primaries fail over to
//! their first backups.

use std::collections::BTreeMap;

use elasticps_core::model::BlockId;
use elasticps_wire::{Control, Message};

use super::{Action, Role, Scheduler};

impl Scheduler {
    /// `Replicas` (who holds which copy, and where the servers are) for a job with
    /// replicas.
    pub(super) fn replicas_message(&self) -> Option<Message> {
        if self.config.replicas <= 1 {
            return None;
        }
        let layout = self.layout()?;
        Some(Control::Replicas { placement: layout.placement, servers: layout.servers }.into())
    }

    /// Sends `Replicas` to every server still in the job.
    pub(super) fn broadcast_replicas(&self, out: &mut Vec<Action>) {
        let Some(msg) = self.replicas_message() else { return };
        for (conn, n) in self.nodes.iter() {
            if matches!(n.role, Role::Server(_)) {
                out.push(Action::Send { conn: *conn, request_id: 0, msg: msg.clone() });
            }
        }
    }

    /// Sends `Replicas` to every worker once a server is lost (failed over, or removed and
    /// gone): a worker's requests to it, whose host may have gone silent (no close ever
    /// reaches the worker), go to the owners of a refreshed layout at once instead of
    /// waiting out their deadlines ([`crate::session::servers_lost`]).
    pub(super) fn tell_workers_of_failover(&self, out: &mut Vec<Action>) {
        let Some(layout) = self.layout() else { return };
        let msg: Message = Control::Replicas { placement: layout.placement, servers: layout.servers }.into();
        for (conn, n) in self.nodes.iter() {
            if matches!(n.role, Role::Worker(_)) {
                out.push(Action::Send { conn: *conn, request_id: 0, msg: msg.clone() });
            }
        }
    }

    /// Keeps every block at `replicas - 1` backups on serving servers: a backup on a
    /// server that drains (or left) is dropped, and a block short of backups gets new
    /// ones on the serving servers with the fewest copies that hold none of it (and are
    /// not where it migrates to). A block stays short while too few servers serve (one
    /// more joining fixes it). The caller tells the servers if a copy changed.
    pub(super) fn rebuild_copies(&mut self) {
        let want = self.config.replicas.saturating_sub(1) as usize;
        if want == 0 {
            return;
        }
        let serving = self.elastic.serving();
        let moving: Vec<Option<u32>> = match &self.placement {
            Some(p) => (0..p.owners.len() as BlockId).map(|b| self.elastic.migrating_to(b)).collect(),
            None => return,
        };
        let Some(placement) = self.placement.as_mut() else { return };
        let (mut dropped, mut added, mut short) = (0, 0, 0);
        for backups in placement.backups.iter_mut() {
            let before = backups.len();
            backups.retain(|s| serving.contains(s));
            dropped += before - backups.len();
        }
        let mut copies: BTreeMap<u32, usize> = serving.iter().map(|s| (*s, 0)).collect();
        for b in 0..placement.owners.len() as BlockId {
            for s in placement.backups_of(b).iter().chain(placement.owner(b).as_slice()) {
                if let Some(c) = copies.get_mut(s) {
                    *c += 1;
                }
            }
        }
        for b in 0..placement.owners.len() as BlockId {
            while placement.backups_of(b).len() < want {
                let target = copies
                    .iter()
                    .filter(|(s, _)| !placement.holds_copy(b, **s) && moving[b as usize] != Some(**s))
                    .min_by_key(|(s, c)| (**c, **s));
                let Some((&s, _)) = target else {
                    short += 1;
                    break;
                };
                if placement.add_backup(b, s).is_err() {
                    break;
                }
                *copies.entry(s).or_default() += 1;
                added += 1;
            }
        }
        debug_assert_eq!(placement.check_copies(), Ok(()));
        if dropped + added == 0 {
            return;
        }
        let why = format!(
            "{dropped} backup copies dropped from servers that left or drain, {added} placed; {short} blocks short of \
             {want} backups (too few servers)"
        );
        self.elastic.event(self.now_us, "copies-rebuilt", None, why);
    }

    /// Server `id` is lost in a job with replicas: its primaries are promoted to their
    /// first backups (the epoch goes up), its copies are rebuilt elsewhere, and training
    /// goes on. A block with no other copy ends the job.
    pub(super) fn failover(&mut self, id: u32, why: &str, silent_us: u64, out: &mut Vec<Action>) {
        let addr = self.servers.get(id as usize).map_or(String::new(), |(_, a)| a.clone());
        let Some(placement) = self.placement.as_mut().filter(|_| self.layout_ready) else {
            return self.finish(false, format!("server {id} ({addr}) is gone before training started: {why}"), out);
        };
        let detection = format!("{why}; last heard from {:.2} s before", silent_us as f64 / 1e6);
        match placement.fail_server(id) {
            Err(block) => {
                let reason = format!("server {id} ({addr}) is gone: {detection}; block {block} had no other copy");
                self.finish(false, reason, out);
            }
            Ok(promoted) => {
                tracing::warn!(server = id, %addr, %detection, promoted = promoted.len(), epoch = placement.epoch, "server lost: its blocks fail over to their backups");
                let orders = self.elastic.failed(id, &detection, promoted.len(), placement, self.now_us);
                self.rebuild_copies();
                self.broadcast_replicas(out);
                self.tell_workers_of_failover(out);
                self.carry_out(orders, out);
            }
        }
    }
}
