//! What a Python worker measures of its own run, for the launcher's report: the
//! run crate's [`Tally`], with iterations told apart by clock, since a backward pass
//! pushes one clock tensor by tensor in many rounds.

use elasticps_core::sync::Clock;
use elasticps_run::tally::Tally;

/// A worker's numbers so far.
#[derive(Clone, Debug, Default)]
pub struct RunStats {
    /// The worker's rank (set at the end).
    pub rank: u32,
    /// The timings: an iteration runs from the first push of one clock to the first push
    /// of the next (the last one ends at `finish`).
    pub tally: Tally,
    /// The clock pushed last.
    last: Option<Clock>,
}

impl RunStats {
    /// A round pushing `clock` starts now.
    pub fn clock_starts(&mut self, clock: Clock) {
        match self.last {
            Some(c) if c == clock => return,
            Some(_) => self.tally.iteration_ends(),
            None => self.tally.start(),
        }
        self.last = Some(clock);
    }

    /// The run is over: the iteration under way ends now.
    pub fn finish(&mut self, rank: u32) {
        self.rank = rank;
        if self.last.take().is_some() {
            self.tally.iteration_ends();
        }
    }
}
