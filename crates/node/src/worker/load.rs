//! What a worker reports to the scheduler every stats interval: its iterations and what
//! each server cost it (the balancer's measurements).

use elasticps_core::sync::Clock;
use elasticps_wire::{ServerSample, WorkerLoad};

use super::Round;

/// An iteration a round counted, for the runtime's metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Iteration {
    /// The clock the round pushes.
    pub clock: Clock,
    /// The time since the first push of the previous clock (none for the first push).
    pub since_last_us: Option<u64>,
}

/// The load report being collected over one stats interval.
#[derive(Debug)]
pub struct LoadReport {
    interval_us: u64,
    since_us: u64,
    /// When the last push of a new clock started, and that clock.
    last_push: Option<(u64, Clock)>,
    report: WorkerLoad,
    /// `index[server]`: 1 + the server's position in `report.per_server` (0: none yet).
    index: Vec<u32>,
}

impl LoadReport {
    /// An empty report of worker `rank`, due every `interval_us` from `now_us`.
    pub fn new(rank: u32, interval_us: u64, now_us: u64) -> Self {
        Self {
            interval_us,
            since_us: now_us,
            last_push: None,
            report: WorkerLoad { rank, ..Default::default() },
            index: Vec::new(),
        }
    }

    /// The report so far.
    pub fn current(&self) -> &WorkerLoad {
        &self.report
    }

    /// A round pushing `clock` starts: the time since the first push of the previous clock
    /// is one iteration. A client that pushes tensor by tensor pushes one clock many times:
    /// only the first counts (`None` for the others).
    pub fn iteration(&mut self, now_us: u64, clock: Clock) -> Option<Iteration> {
        if self.last_push.is_some_and(|(_, c)| c == clock) {
            return None;
        }
        let last = self.last_push.replace((now_us, clock)).map(|(t, _)| t);
        let since_last_us = last.map(|l| now_us.saturating_sub(l));
        if let Some(took) = since_last_us {
            self.report.iterations += 1;
            self.report.iter_us += took;
        }
        self.report.clock = clock;
        Some(Iteration { clock, since_last_us })
    }

    fn sample(&mut self, server: u32) -> &mut ServerSample {
        let s = server as usize;
        if self.index.len() <= s {
            self.index.resize(s + 1, 0);
        }
        if self.index[s] == 0 {
            self.report.per_server.push(ServerSample { server, ..Default::default() });
            self.index[s] = self.report.per_server.len() as u32;
        }
        &mut self.report.per_server[self.index[s] as usize - 1]
    }

    /// A finished round: each server's push bytes and push time (its service time), then
    /// one round and its wait for each server the round waited for.
    pub fn record(&mut self, round: &Round) {
        for (server, bytes, us) in round.push_load() {
            let p = self.sample(server);
            p.push_bytes += bytes;
            p.push_us += us;
        }
        for (server, waited_us) in round.waited() {
            let p = self.sample(server);
            p.rounds += 1;
            p.wait_us += waited_us;
        }
    }

    /// The report, if an interval has passed since the last (then a fresh one starts).
    pub fn due(&mut self, now_us: u64) -> Option<WorkerLoad> {
        if now_us.saturating_sub(self.since_us) < self.interval_us {
            return None;
        }
        self.since_us = now_us;
        self.index.clear();
        let fresh = WorkerLoad { rank: self.report.rank, clock: self.report.clock, ..Default::default() };
        Some(std::mem::replace(&mut self.report, fresh))
    }
}
