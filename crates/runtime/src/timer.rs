//! The one timer every driver sleeps on: a machine's `poll_timeout()` (absolute µs on the
//! driver's [`Micros`] clock) turned into a tokio deadline. A driver arms it after each
//! step with what the machine asked for and selects on [`Timer::fired`] beside its
//! sockets; nothing else in the runtime sleeps to decide anything.

use std::pin::Pin;
use std::time::Duration;

use tokio::time::{Instant, Sleep};

use crate::Micros;

/// A deadline far enough to mean never: a `poll_timeout` past what the clock can name.
const NEVER: Duration = Duration::from_secs(365 * 86_400);

/// A machine's clock and its next wake-up (see the module).
#[derive(Debug)]
pub struct Timer {
    clock: Micros,
    sleep: Pin<Box<Sleep>>,
    armed: bool,
}

impl Timer {
    /// A timer on `clock`, not armed.
    // The one sleep of a driver (clippy.toml disallows it everywhere else): the machine
    // decides when it wakes, this only waits for that time.
    #[allow(clippy::disallowed_methods)]
    pub fn new(clock: Micros) -> Self {
        Self { clock, sleep: Box::pin(tokio::time::sleep(Duration::ZERO)), armed: false }
    }

    /// The machine's `now_us`.
    pub fn now_us(&self) -> u64 {
        self.clock.now()
    }

    /// The clock the timer counts on.
    pub fn clock(&self) -> Micros {
        self.clock
    }

    /// Wakes at `at_us` (the machine's `poll_timeout()`); `None`: never. A time already
    /// past fires at once.
    pub fn arm(&mut self, at_us: Option<u64>) {
        self.armed = at_us.is_some();
        if let Some(at) = at_us {
            let now = Instant::now();
            let after = Duration::from_micros(at.saturating_sub(self.clock.now()));
            let deadline = now.checked_add(after.min(NEVER)).unwrap_or(now + NEVER);
            self.sleep.as_mut().reset(deadline);
        }
    }

    /// Completes when the armed deadline is reached (then the timer is disarmed until
    /// the next [`Timer::arm`]); pending forever when not armed. Cancel-safe.
    pub async fn fired(&mut self) {
        if !self.armed {
            return std::future::pending().await;
        }
        self.sleep.as_mut().await;
        self.armed = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether the timer stays quiet for 80 ms.
    async fn quiet(t: &mut Timer) -> bool {
        tokio::time::timeout(Duration::from_millis(80), t.fired()).await.is_err()
    }

    #[tokio::test]
    async fn fires_at_the_machines_deadline_once_and_never_when_unarmed() {
        let mut t = Timer::new(Micros::new());
        t.arm(None);
        assert!(quiet(&mut t).await, "an unarmed timer fired");
        let at = t.now_us() + 50_000;
        t.arm(Some(at));
        tokio::time::timeout(Duration::from_secs(5), t.fired()).await.expect("the armed timer never fired");
        assert!(t.now_us() >= at, "fired at {} µs, before its deadline {at} µs", t.now_us());
        assert!(quiet(&mut t).await, "fired twice for one arm");
        t.arm(Some(u64::MAX));
        assert!(quiet(&mut t).await, "a deadline past the clock's range fired");
        t.arm(Some(0));
        tokio::time::timeout(Duration::from_secs(5), t.fired())
            .await
            .expect("a deadline in the past did not fire at once");
    }
}
