//! A role adapter's timer for a state machine's `poll_timeout()`: armed at the deadline
//! the machine names, again only when it names an earlier one. A timer that fires after
//! its deadline moved later is a harmless `Timeout` (the machines check the time).

use crate::cluster::Outbox;

/// The timer of one deadline source.
#[derive(Debug, Default)]
pub struct Wake {
    /// The earliest timer armed and not fired yet.
    armed: Option<u64>,
}

impl Wake {
    /// Arms a timer with `token` at `at` (µs), unless one is armed at or before it.
    pub fn arm(&mut self, out: &mut Outbox<'_>, at: Option<u64>, token: u64) {
        let Some(at) = at else { return };
        if self.armed.is_some_and(|armed| armed <= at) {
            return;
        }
        self.armed = Some(at);
        out.wake_at(at.max(out.now_us()), token);
    }

    /// A timer with this source's token fired.
    pub fn fired(&mut self, out: &Outbox<'_>) {
        if self.armed.is_some_and(|armed| armed <= out.now_us()) {
            self.armed = None;
        }
    }
}
