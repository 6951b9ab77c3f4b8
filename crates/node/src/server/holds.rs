//! The sync policy's held pulls: the bounds a pull must stay within before a policy
//! holds it, the replies to the pulls a push releases, and the log of the long waits.

use elasticps_core::block::Answer;
use elasticps_core::model::BlockId;
use elasticps_core::sync::{Clock, SyncPolicy};
use elasticps_wire::{Message, Values};

use super::{Action, LONG_HOLD_US, MAX_HELD_PER_CONN, MAX_HELD_PER_SERVER, Phase, PullTrace, Server, Slot, Token};
use crate::ConnId;

impl Server {
    /// Why a pull (or a push_pull's pull) of `block` at `clock` on connection `conn` is
    /// refused before the policy sees it: a clock no policy answers soon
    /// (`--max-clock-lead` past `done`), or one pull more than a bound on held pulls.
    pub(super) fn pull_bound(&self, conn: ConnId, block: BlockId, clock: Clock, done: Clock) -> Option<String> {
        let lead = self.max_clock_lead;
        // asp answers every pull at once, however far ahead: nothing would be held.
        let holds = self.shard.as_ref().is_some_and(|s| !matches!(s.effective().sync, SyncPolicy::Asp));
        if holds && clock.saturating_sub(done) > lead {
            return Some(format!(
                "a pull of block {block} at clock {clock} is more than {lead} clocks past its done clock {done} \
                 (--max-clock-lead {lead})"
            ));
        }
        let at_most = self.held_at_most.get();
        if at_most < MAX_HELD_PER_CONN {
            // Neither bound can be reached (MAX_HELD_PER_CONN <= MAX_HELD_PER_SERVER).
            self.held_at_most.set(at_most + 1);
            return None;
        }
        let held = |pred: &dyn Fn(&Token) -> bool| -> usize {
            self.slots.values().map(|s| if let Slot::Owned(o) = s { o.block.held_matching(pred) } else { 0 }).sum()
        };
        let total: usize = self.slots.values().map(|s| if let Slot::Owned(o) = s { o.block.held() } else { 0 }).sum();
        self.held_at_most.set(total + 1);
        if total >= MAX_HELD_PER_SERVER {
            self.held_at_most.set(total);
            return Some(format!(
                "this server holds {total} pulls already, its bound (MAX_HELD_PER_SERVER {MAX_HELD_PER_SERVER})"
            ));
        }
        if total >= MAX_HELD_PER_CONN {
            let mine = held(&|t: &Token| t.conn == conn);
            if mine >= MAX_HELD_PER_CONN {
                self.held_at_most.set(total);
                return Some(format!(
                    "this server holds {mine} pulls of this connection already, its bound per connection \
                     (MAX_HELD_PER_CONN {MAX_HELD_PER_CONN})"
                ));
            }
        }
        None
    }

    /// Replies to the pulls the core released (and traces them).
    pub(super) fn answer_pulls(&mut self, answers: Vec<Answer<Token>>, out: &mut Vec<Action>) {
        for a in answers {
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
            self.counters.bytes_out += a.values.len() as u64 * 4;
            let (block, clock, values) = (a.token.block, a.clock, Values::from_shared(a.values));
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
