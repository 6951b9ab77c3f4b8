//! A round's request window per server and its requests' deadlines: at most `limit`
//! requests in flight to one server in each of two lanes (the others wait in their lane's
//! queue, in the order planned, and go out as answers free room), and the deadline of
//! each request sent (its send time plus the request timeout), oldest first.
//!
//! The two lanes of a server are its requests that carry a push (push, init, push_pull,
//! row push) and those that only pull (pull, row pull). A push is never queued behind a
//! pull: a pull may be held by the sync policy until other workers push, and those
//! workers' pushes must never wait for room behind their own held pulls (issue 33: two
//! workers that order one server's blocks differently would each fill the window with
//! held requests waiting for pushes the other queued). A push_pull whose pull the server
//! holds is acknowledged on its own (`PushAck`, then its `PullReply`): the round then
//! calls [`Window::release`] for it while it still waits for its pull, so a held pull
//! never counts against the window; its deadline stays.
//!
//! So the window bounds what it is for, the bytes a worker has in flight to one server and
//! the requests a server must read and answer at once from one connection, and a server
//! holds at most one pull per block per connection for a worker's round (the server's
//! own bound on held pulls per connection is apart from the window).
//!
//! It names requests by their index in the round; [`super::Round`] owns it and decides
//! what a request's answer means.

use std::collections::VecDeque;

/// One server's side of the window.
#[derive(Debug, Default)]
struct Lane {
    /// Requests sent and not answered.
    in_flight: usize,
    /// Requests planned and waiting for room, in the order planned.
    queued: VecDeque<u32>,
}

/// The window of one round (see [the module](self)); recycled with its round.
#[derive(Debug, Default)]
pub(super) struct Window {
    limit: usize,
    timeout_us: u64,
    /// Per server id, two lanes: `2 * id` for the requests that carry a push, `2 * id + 1`
    /// for those that only pull ([`Window::lane`]).
    lanes: Vec<Lane>,
    /// (deadline, request index) of every request sent, in send order (so by deadline:
    /// every request waits the same timeout). Answered requests are dropped from the
    /// front by [`Window::prune`].
    deadlines: VecDeque<(u64, u32)>,
    /// Requests queued over every server.
    queued: usize,
}

impl Window {
    /// Resets it for a new round: at most `limit` (at least 1) requests in flight per
    /// server, each answered within `timeout_us`.
    pub(super) fn reset(&mut self, limit: usize, timeout_us: u64) {
        self.limit = limit.max(1);
        self.timeout_us = timeout_us;
        for lane in &mut self.lanes {
            lane.in_flight = 0;
            lane.queued.clear();
        }
        self.deadlines.clear();
        self.queued = 0;
    }

    /// The lane of `server`'s requests that only pull (`pulls`) or carry a push.
    fn lane(&mut self, server: u32, pulls: bool) -> &mut Lane {
        let s = server as usize * 2 + usize::from(pulls);
        if self.lanes.len() <= s {
            self.lanes.resize_with(s + 1, Lane::default);
        }
        &mut self.lanes[s]
    }

    /// Request `index` to `server` (one that only pulls if `pulls`) is planned at
    /// `now_us`: true if it goes out now (it counts in flight from now, its deadline set),
    /// false if it waits in its lane's queue for room.
    pub(super) fn admit(&mut self, now_us: u64, server: u32, pulls: bool, index: u32) -> bool {
        let limit = self.limit;
        let lane = self.lane(server, pulls);
        if lane.in_flight >= limit {
            lane.queued.push_back(index);
            self.queued += 1;
            return false;
        }
        lane.in_flight += 1;
        self.sent(now_us, index);
        true
    }

    fn sent(&mut self, now_us: u64, index: u32) {
        self.deadlines.push_back((now_us.saturating_add(self.timeout_us), index));
    }

    /// A request in flight to `server` (in the lane `pulls` names) was answered, lost, or
    /// its pull is held, at `now_us`: the next request queued in that lane, if any, goes
    /// out now (counted in flight, its deadline set).
    pub(super) fn release(&mut self, now_us: u64, server: u32, pulls: bool) -> Option<u32> {
        let lane = self.lane(server, pulls);
        lane.in_flight = lane.in_flight.saturating_sub(1);
        let next = lane.queued.pop_front()?;
        lane.in_flight += 1;
        self.queued -= 1;
        self.sent(now_us, next);
        Some(next)
    }

    /// The connection to `server` is gone: nothing is in flight there any more, and the
    /// requests queued for it (both lanes) are returned in the order planned, to be lost.
    pub(super) fn drop_server(&mut self, server: u32) -> Vec<u32> {
        let mut queued = Vec::new();
        for pulls in [false, true] {
            let lane = self.lane(server, pulls);
            lane.in_flight = 0;
            queued.extend(std::mem::take(&mut lane.queued));
        }
        self.queued -= queued.len();
        // Indices are in the order the round planned them.
        queued.sort_unstable();
        queued
    }

    /// Takes request `index` out of `server`'s queue (in the lane `pulls` names); false if
    /// it was not queued there.
    pub(super) fn unqueue(&mut self, server: u32, pulls: bool, index: u32) -> bool {
        let lane = self.lane(server, pulls);
        let Some(at) = lane.queued.iter().position(|i| *i == index) else { return false };
        lane.queued.remove(at);
        self.queued -= 1;
        true
    }

    /// Requests in flight to `server` (both lanes; a held pull is not in flight).
    pub(super) fn in_flight_to(&self, server: u32) -> usize {
        let s = server as usize * 2;
        self.lanes.get(s..(s + 2).min(self.lanes.len())).map_or(0, |l| l.iter().map(|l| l.in_flight).sum())
    }

    /// Requests in flight over every server.
    pub(super) fn in_flight(&self) -> usize {
        self.lanes.iter().map(|l| l.in_flight).sum()
    }

    /// Requests waiting for room over every server.
    pub(super) fn queued(&self) -> usize {
        self.queued
    }

    /// Drops from the front of the deadlines the requests no longer waiting for their
    /// answer (`waiting(index)` false), so that the front is the oldest one still waiting.
    pub(super) fn prune(&mut self, waiting: impl Fn(u32) -> bool) {
        while let Some(&(_, index)) = self.deadlines.front() {
            if waiting(index) {
                break;
            }
            self.deadlines.pop_front();
        }
    }

    /// The oldest request still waiting (after [`Window::prune`]): its deadline and index.
    pub(super) fn oldest(&self) -> Option<(u64, u32)> {
        self.deadlines.front().copied()
    }

    /// The request timeout.
    pub(super) fn timeout_us(&self) -> u64 {
        self.timeout_us
    }
}
