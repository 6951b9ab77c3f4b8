//! A round's request window per server and its requests' deadlines: at most `limit`
//! requests in flight to one server (the others wait in that server's queue, in the order
//! planned, and go out as answers free room), and the deadline of each request sent (its
//! send time plus the request timeout), oldest first.
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
    /// Per server id.
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

    fn lane(&mut self, server: u32) -> &mut Lane {
        let s = server as usize;
        if self.lanes.len() <= s {
            self.lanes.resize_with(s + 1, Lane::default);
        }
        &mut self.lanes[s]
    }

    /// Request `index` to `server` is planned at `now_us`: true if it goes out now (it
    /// counts in flight from now, its deadline set), false if it waits in the server's
    /// queue for room.
    pub(super) fn admit(&mut self, now_us: u64, server: u32, index: u32) -> bool {
        let limit = self.limit;
        let lane = self.lane(server);
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

    /// A request in flight to `server` was answered (or lost) at `now_us`: the next
    /// request queued for that server, if any, goes out now (counted in flight, its
    /// deadline set).
    pub(super) fn release(&mut self, now_us: u64, server: u32) -> Option<u32> {
        let lane = self.lane(server);
        lane.in_flight = lane.in_flight.saturating_sub(1);
        let next = lane.queued.pop_front()?;
        lane.in_flight += 1;
        self.queued -= 1;
        self.sent(now_us, next);
        Some(next)
    }

    /// The connection to `server` is gone: nothing is in flight there any more, and the
    /// requests queued for it are returned (in the order planned), to be lost.
    pub(super) fn drop_server(&mut self, server: u32) -> VecDeque<u32> {
        let lane = self.lane(server);
        lane.in_flight = 0;
        let queued = std::mem::take(&mut lane.queued);
        self.queued -= queued.len();
        queued
    }

    /// Takes request `index` out of `server`'s queue; false if it was not queued there.
    pub(super) fn unqueue(&mut self, server: u32, index: u32) -> bool {
        let lane = self.lane(server);
        let Some(at) = lane.queued.iter().position(|i| *i == index) else { return false };
        lane.queued.remove(at);
        self.queued -= 1;
        true
    }

    /// Requests in flight to `server`.
    pub(super) fn in_flight_to(&self, server: u32) -> usize {
        self.lanes.get(server as usize).map_or(0, |l| l.in_flight)
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
