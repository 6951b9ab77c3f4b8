//! The sync policy's held pulls: the bounds a request must stay within before a policy
//! sees it, the count of the pulls held (per connection and in all), the replies to the
//! pulls a push releases, the pulls of a closed connection dropped, and the log of the
//! long waits.

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use elasticps_core::block::Answer;
use elasticps_core::model::BlockId;
use elasticps_core::sync::{Clock, SyncPolicy};
use elasticps_wire::{Dtype, Message, Values};

use super::request::Request;
use super::{Action, LONG_HOLD_US, MAX_HELD_PER_CONN, MAX_HELD_PER_SERVER, Phase, PullTrace, Server, Slot, Token};
use crate::ConnId;

/// The pulls held on this server, counted in all, per connection and, for each
/// connection, per block (the blocks a closed connection's pulls are dropped from). O(1)
/// per pull held or let go; every path that holds or lets go of a pull goes through
/// [`HeldCount::hold`] and [`HeldCount::let_go`] (checked against the blocks by
/// `Server::recount` in the unit tests).
#[derive(Debug, Default)]
pub(super) struct HeldCount {
    total: usize,
    conns: HashMap<ConnId, ConnHeld>,
}

/// One connection's held pulls: how many, and how many in each block.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct ConnHeld {
    /// How many in all.
    pub(super) total: usize,
    /// How many in each block.
    pub(super) blocks: HashMap<BlockId, usize>,
}

impl HeldCount {
    /// A pull of `t` is held.
    pub(super) fn hold(&mut self, t: &Token) {
        self.total += 1;
        let c = self.conns.entry(t.conn).or_default();
        c.total += 1;
        *c.blocks.entry(t.block).or_default() += 1;
    }

    /// The held pull of `t` is no longer held (answered, answered `Moved`, dropped).
    pub(super) fn let_go(&mut self, t: &Token) {
        let Entry::Occupied(mut c) = self.conns.entry(t.conn) else {
            debug_assert!(false, "a pull let go that was not counted: {t:?}");
            return;
        };
        let Entry::Occupied(mut b) = c.get_mut().blocks.entry(t.block) else {
            debug_assert!(false, "a pull let go that was not counted: {t:?}");
            return;
        };
        *b.get_mut() -= 1;
        if *b.get() == 0 {
            b.remove();
        }
        self.total -= 1;
        c.get_mut().total -= 1;
        if c.get().total == 0 {
            c.remove();
        }
    }

    /// Pulls held in all.
    pub(super) fn total(&self) -> usize {
        self.total
    }

    /// Pulls of connection `conn` held.
    pub(super) fn of_conn(&self, conn: ConnId) -> usize {
        self.conns.get(&conn).map_or(0, |c| c.total)
    }

    /// Uncounts every held pull of `conn` (it closed): what it held, by block.
    pub(super) fn take_conn(&mut self, conn: ConnId) -> Option<ConnHeld> {
        let c = self.conns.remove(&conn)?;
        self.total -= c.total;
        Some(c)
    }
}

impl Server {
    /// The one rule of `--max-clock-lead`: why a `what` ("pull", "push") of `block` at
    /// `clock` is refused when the block's `done` is `done` (more than the lead past it).
    fn past_lead(&self, what: &str, block: BlockId, clock: Clock, done: Clock) -> Option<String> {
        let lead = self.max_clock_lead;
        (clock.saturating_sub(done) > lead).then(|| {
            format!(
                "a {what} of block {block} at clock {clock} is more than {lead} clocks past its done clock {done} \
                 (--max-clock-lead {lead})"
            )
        })
    }

    /// Why a data request on connection `conn` to `block` (`done` its done clock) is
    /// refused before it changes anything, and O(1): a pull (or a push_pull's pull) of a
    /// clock no policy answers soon (`--max-clock-lead` past `done`; not under asp, which
    /// answers every pull at once), one pull more than a bound on held pulls, or (under
    /// `--aggregate`, where a push of a clock not complete keeps a block-sized sum) a push
    /// (or a push_pull's push) past the same lead.
    pub(super) fn request_bound(&self, conn: ConnId, block: BlockId, request: &Request, done: Clock) -> Option<String> {
        let shard = self.shard.as_ref()?;
        if let Some(clock) = request.pulled() {
            // asp answers every pull at once, however far ahead: nothing would be held.
            if !matches!(shard.effective().sync, SyncPolicy::Asp)
                && let Some(refused) = self.past_lead("pull", block, clock, done)
            {
                return Some(refused);
            }
            let total = self.held.total();
            if total >= MAX_HELD_PER_SERVER {
                return Some(format!(
                    "this server holds {total} pulls already, its bound (MAX_HELD_PER_SERVER {MAX_HELD_PER_SERVER})"
                ));
            }
            let mine = self.held.of_conn(conn);
            if mine >= MAX_HELD_PER_CONN {
                return Some(format!(
                    "this server holds {mine} pulls of this connection already, its bound per connection \
                     (MAX_HELD_PER_CONN {MAX_HELD_PER_CONN})"
                ));
            }
        }
        if let Some(clock) = request.pushed()
            && let Some(Slot::Owned(o)) = self.slots.get(&block)
            && shard.config_for(o.block.spec()).optimizer.aggregate
        {
            return self.past_lead("push", block, clock, done);
        }
        None
    }

    /// A pull of `to` was held by its block's policy: counted, or (its connection closed
    /// while it was parked on a frozen block) dropped at once.
    pub(super) fn held_pull(&mut self, to: Token) {
        if self.conns.contains_key(&to.conn) {
            return self.held.hold(&to);
        }
        if let Some(Slot::Owned(o)) = self.slots.get_mut(&to.block) {
            o.block.drop_held(|t| *t == to);
        }
    }

    /// Data connection `conn` closed: its held pulls are dropped from every block that
    /// holds some (nobody waits for their answers) and uncounted.
    pub(super) fn conn_closed(&mut self, conn: ConnId) {
        self.conns.remove(&conn);
        let Some(held) = self.held.take_conn(conn) else { return };
        let mut dropped = 0;
        for (block, n) in held.blocks {
            if let Some(Slot::Owned(o)) = self.slots.get_mut(&block) {
                let d = o.block.drop_held(|t| t.conn == conn);
                debug_assert_eq!(d, n, "block {block} held another count of connection {conn}'s pulls");
                dropped += d;
            }
        }
        tracing::info!(
            server = self.id,
            conn,
            dropped,
            held = self.held.total(),
            "connection closed; its held pulls are dropped"
        );
    }

    /// Checks the counts of held pulls against the blocks (a scan of every pull held):
    /// the total, each connection's by block, and no pull held for a closed connection.
    #[cfg(test)]
    pub(super) fn recount(&self) -> Result<(), String> {
        let mut conns: HashMap<ConnId, ConnHeld> = HashMap::new();
        let mut total = 0;
        for slot in self.slots.values() {
            if let Slot::Owned(o) = slot {
                for t in o.block.held_tokens() {
                    if !self.conns.contains_key(&t.conn) {
                        return Err(format!("a pull of closed connection {} is held: {t:?}", t.conn));
                    }
                    total += 1;
                    let c = conns.entry(t.conn).or_default();
                    c.total += 1;
                    *c.blocks.entry(t.block).or_default() += 1;
                }
            }
        }
        if total != self.held.total || conns != self.held.conns {
            return Err(format!(
                "counted {} held ({:?}), the blocks hold {total} ({conns:?})",
                self.held.total, self.held.conns
            ));
        }
        Ok(())
    }

    /// Replies to the pulls the core released (and traces them).
    pub(super) fn answer_pulls(&mut self, answers: Vec<Answer<Token>>, out: &mut Vec<Action>) {
        for a in answers {
            if a.held_us.is_some() {
                self.held.let_go(&a.token);
            }
            if self.trace {
                let t = PullTrace {
                    block: a.token.block,
                    worker: a.worker,
                    clock: a.clock,
                    done: a.done,
                    held_us: a.held_us,
                };
                out.push(Action::Trace(t));
            }
            let values = match a.token.reply {
                Dtype::F32 => Values::from_shared(a.values),
                dtype => Values::encoded(&a.values, dtype),
            };
            self.counters.bytes_out += values.wire_len() as u64;
            let (block, clock) = (a.token.block, a.clock);
            let msg = if a.rows.is_some() {
                Message::PullRowsReply { block, clock, values }
            } else {
                Message::PullReply { block, clock, values }
            };
            out.push(Action::Reply { conn: a.token.conn, request_id: a.token.request_id, msg });
        }
    }

    /// Says what the server waits for: an assignment, or (for a pull held for more than
    /// 5 s) the push that releases it. A held pull is the one wait on a server that no
    /// timeout ends (the worker's request timeout does).
    pub(super) fn log_waits(&self, now_us: u64) {
        let Some(shard) = &self.shard else {
            tracing::info!(
                server = self.id,
                "server waits for the scheduler to assign blocks (a worker must define the model and every server must join)"
            );
            return;
        };
        let longest = self
            .slots
            .iter()
            .filter_map(|(b, s)| match s {
                Slot::Owned(o) => o.block.waiting(now_us).map(|w| (*b, w)),
                Slot::Gone { .. } => None,
            })
            .max_by_key(|(_, w)| w.held_us);
        for (block, o) in self.slots.iter().filter_map(|(b, s)| match s {
            Slot::Owned(o) => Some((b, o)),
            Slot::Gone { .. } => None,
        }) {
            if let Phase::Arrived { since_us, parked } = &o.phase
                && now_us.saturating_sub(*since_us) > LONG_HOLD_US
            {
                tracing::warn!(
                    server = shard.id,
                    block,
                    epoch = o.epoch,
                    parked = parked.len(),
                    "block {block} arrived by migration waits for the scheduler to settle the move"
                );
            }
        }
        if let Some((block, w)) = longest.filter(|(_, w)| w.held_us > LONG_HOLD_US) {
            tracing::warn!(
                server = shard.id,
                block,
                held_s = w.held_us / 1_000_000,
                "pull({}) of worker {} waits for worker {} to push clock {}",
                w.clock,
                w.worker,
                w.slowest,
                w.next_clock
            );
        }
    }
}
