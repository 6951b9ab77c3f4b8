//! Warnings a peer can cause, rate-limited (docs/PROTOCOL.md §8): a peer that sends
//! refused requests by the thousand (a pull past the clock lead, a forbidden message, a
//! bad `Hello`) must not make the node write a log line for each. The first
//! [`LOGGED_PER_WINDOW`] of a window of [`WINDOW_US`] are logged one by one, the rest are
//! counted, and the count is logged when the next window begins.

use std::cell::Cell;

/// Refusals logged one by one per window, per node.
pub const LOGGED_PER_WINDOW: u32 = 20;
/// The window, µs.
pub const WINDOW_US: u64 = 10_000_000;

/// Where a window stands.
#[derive(Clone, Copy, Debug, Default)]
struct Window {
    start_us: u64,
    logged: u32,
    left_out: u64,
}

/// The log budget of one node's refusals (a `Cell`: a refusal is decided by `&self`).
#[derive(Default)]
pub struct Throttle {
    window: Cell<Window>,
}

impl std::fmt::Debug for Throttle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Only the log's bookkeeping: not part of the state a refusal must leave as it
        // was (the authorization tests compare a node's state before and after one).
        f.write_str("Throttle")
    }
}

impl Throttle {
    /// Whether the refusal warning of `now_us` is logged. When a window begins, first
    /// logs how many the last one left out; when a window reaches its budget, says that
    /// the rest are counted.
    pub fn admit(&self, now_us: u64) -> bool {
        let mut w = self.window.get();
        if now_us.saturating_sub(w.start_us) >= WINDOW_US {
            if w.left_out > 0 {
                tracing::warn!(
                    left_out = w.left_out,
                    window_s = WINDOW_US / 1_000_000,
                    "{} more refused requests in {} s were not logged one by one",
                    w.left_out,
                    WINDOW_US / 1_000_000
                );
            }
            w = Window { start_us: now_us, logged: 0, left_out: 0 };
        }
        let admitted = w.logged < LOGGED_PER_WINDOW;
        if admitted {
            w.logged += 1;
            if w.logged == LOGGED_PER_WINDOW {
                tracing::warn!(
                    per_window = LOGGED_PER_WINDOW,
                    window_s = WINDOW_US / 1_000_000,
                    "refused requests past {LOGGED_PER_WINDOW} in {} s are counted, not logged one by one",
                    WINDOW_US / 1_000_000
                );
            }
        } else {
            w.left_out += 1;
        }
        self.window.set(w);
        admitted
    }

    /// Refusals left out of the log in the current window.
    pub fn left_out(&self) -> u64 {
        self.window.get().left_out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_logs_its_budget_counts_the_rest_and_the_next_one_starts_afresh() {
        let t = Throttle::default();
        let logged = (0..1_000).filter(|i| t.admit(1_000 + i)).count();
        assert_eq!(logged as u32, LOGGED_PER_WINDOW);
        assert_eq!(t.left_out(), 1_000 - u64::from(LOGGED_PER_WINDOW));
        // Still within the window: nothing more.
        assert!(!t.admit(WINDOW_US - 1));
        // The next window logs again (after it said how many the last one left out).
        assert!(t.admit(1_000 + WINDOW_US));
        assert_eq!(t.left_out(), 0);
    }
}
