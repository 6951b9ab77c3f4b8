//! Rule 2, **the verdict loop**: the load model predicts, the workers' measured iteration
//! time decides. Every decision that changes the placement (a migration round, a probe, a
//! compression of a server's blocks, rule 5c, undone by setting them back to f32, a
//! scale-out) is measured over a window of iteration times before it and one after it,
//! and is kept only if it paid; what did not pay is undone and backs off.
//!
//! - **Windows** ([`Window`]). A window is the balancer's steps (about one a second) with
//!   the iterations the workers completed in each and their mean time. Its mean iteration
//!   time is the mean of those iterations, but never less than the time since the last
//!   step at which one completed: an iteration that has not completed counts its elapsed
//!   time, so a stall is never a gain. The window before a decision is the steps since the
//!   last busy step (at most [`super::BASELINE_STEPS`]); the window after starts
//!   [`super::TRIAL_SETTLE_US`] after the round finished and lasts `trial_us` (8 s), or
//!   three of the iterations before it if that is longer.
//! - **The rule** ([`pays`]). A migration round predicted to save `p` of the iteration
//!   time (`(max T before - max T after) / iteration time before`; 0 for a probe) and
//!   measured to save `m` is kept when `m >= min(KEEP_SHARE * p, ENOUGH) - Z * noise`
//!   and `m >= -MAX_LOSS`, where `noise` is the relative standard error of the difference of
//!   the two windows' means. So a gain smaller than half the prediction that the noise
//!   cannot explain is undone, and a measured loss beyond [`MAX_LOSS`] is never kept,
//!   whatever the noise.
//! - **Undo and back off.** A reverted round's blocks move back to where they were; the
//!   cool-down doubles with each consecutive revert (up to [`super::MAX_HOLDOFF_DOUBLINGS`]
//!   times). For [`super::REVERT_HOLDOFF_US`], doubling the same way, no rule moves a
//!   block off the sources of a reverted round (they were not the bottleneck the model
//!   took them for: another of their blocks would fail the same way), nor onto the server
//!   of a reverted probe (it is slow). A reverted move onto a server whose rate was
//!   unknown when it was decided bans only moves from its source onto that server and
//!   onto servers still of unknown rate (it may have failed for its destination, taken at
//!   the median rate, not for its source: the model knows the destination now, and may
//!   find a better one); probes themselves go on at their own intervals. A
//!   kept round resets the doubling and lifts the bans onto its destinations (the model
//!   ranks them right again, as for a straggler that recovered).
//! - **Without iteration times** the verdict falls back on the model: the max service
//!   time from fresh rates against the one before the round.
//!
//! Each verdict is a [`Verdict`], returned as [`super::Decision::Judged`] for the report.

use serde::{Deserialize, Serialize};

use super::loads::{Loads, Tabu};
use super::{Balancer, Decision, MAX_HOLDOFF_DOUBLINGS, Move, Phase, REVERT_HOLDOFF_US, TRIAL_SETTLE_US, View};
use crate::placement::ServerId;

/// Share of the predicted gain a decision must show to be kept (within the noise).
pub const KEEP_SHARE: f64 = 0.5;
/// Standard errors of noise forgiven in the comparison of [`pays`].
pub const Z: f64 = 2.0;
/// A decision measured to slow iterations by more than this fraction is never kept.
pub const MAX_LOSS: f64 = 0.02;
/// A decision measured to save this share of the iteration time is kept, whatever it
/// predicted (the model over-predicted, but the job is faster).
pub const ENOUGH: f64 = 0.05;
/// The window after a decision lasts at least this many of the iterations before it.
pub const WINDOW_ITERATIONS: f64 = 3.0;

/// The iteration times of a window of balancer steps.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Window {
    /// Steps before this time do not count.
    start_us: u64,
    /// Per step from the start: (time, iterations completed since the step before, their
    /// mean µs).
    steps: Vec<(u64, u64, f64)>,
}

impl Window {
    /// An empty window whose steps count from `start_us`.
    pub fn starting(start_us: u64) -> Self {
        Self { start_us, steps: Vec::new() }
    }

    /// The steps count from here.
    pub fn start_us(&self) -> u64 {
        self.start_us
    }

    /// One balancer step at `now_us`: `iterations` completed since the previous one, with
    /// a mean time of `mean_us` (ignored without iterations). Steps before the start are
    /// ignored.
    pub fn push(&mut self, now_us: u64, iterations: u64, mean_us: Option<f64>) {
        if now_us < self.start_us {
            return;
        }
        let mean = mean_us.filter(|m| m.is_finite() && *m > 0.0);
        let iterations = if mean.is_some() { iterations.max(1) } else { 0 };
        self.steps.push((now_us, iterations, mean.unwrap_or(0.0)));
    }

    /// Keeps the last `steps` steps, and more while they are within `span_us` of the
    /// last one (the window slides; a slow job's window spans several iterations).
    pub fn keep_last(&mut self, steps: usize, span_us: u64) {
        let Some(&(last, _, _)) = self.steps.last() else { return };
        let from = last.saturating_sub(span_us);
        let old = self.steps.len().saturating_sub(steps);
        let cut = self.steps[..old].iter().take_while(|s| s.0 < from).count();
        if cut > 0 {
            self.start_us = self.steps[cut - 1].0;
            self.steps.drain(..cut);
        }
    }

    /// The mean time of the iterations completed in the window, µs (no stall counted;
    /// `None` if none completed).
    pub fn completed_mean_us(&self) -> Option<f64> {
        let done: u64 = self.steps.iter().map(|s| s.1).sum();
        let sum: f64 = self.steps.iter().map(|s| s.1 as f64 * s.2).sum();
        (done > 0).then(|| sum / done as f64)
    }

    /// Steps at which iterations completed.
    pub fn progress_steps(&self) -> usize {
        self.steps.iter().filter(|s| s.1 > 0).count()
    }

    /// Steps in the window.
    pub fn len(&self) -> usize {
        self.steps.len()
    }

    /// True without steps.
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }

    /// The mean iteration time, µs: the mean of the iterations completed, but at least the
    /// time from the last step at which one completed (or the start) to the last step, so
    /// that an iteration still running counts its elapsed time. `None` without steps.
    pub fn mean_us(&self) -> Option<f64> {
        let &(last, _, _) = self.steps.last()?;
        let done: u64 = self.steps.iter().map(|s| s.1).sum();
        let sum: f64 = self.steps.iter().map(|s| s.1 as f64 * s.2).sum();
        let progress = self.steps.iter().rev().find(|s| s.1 > 0).map_or(self.start_us, |s| s.0);
        let stalled = last.saturating_sub(progress) as f64;
        let mean = if done > 0 { sum / done as f64 } else { 0.0 };
        let mean = mean.max(stalled);
        (mean > 0.0).then_some(mean)
    }

    /// The relative standard error of [`Window::mean_us`], from the spread of the steps'
    /// means (1, as good as unknown, with fewer than two steps that completed iterations).
    pub fn rse(&self) -> f64 {
        let means: Vec<f64> = self.steps.iter().filter(|s| s.1 > 0).map(|s| s.2).collect();
        let n = means.len() as f64;
        if means.len() < 2 {
            return 1.0;
        }
        let mean = means.iter().sum::<f64>() / n;
        let var = means.iter().map(|m| (m - mean) * (m - mean)).sum::<f64>() / (n - 1.0);
        if mean > 0.0 { (var / n).sqrt() / mean } else { 1.0 }
    }
}

/// **The rule**: a decision predicted to save `predicted` of the iteration time (a
/// fraction; 0 for a probe) and measured to save `measured` (negative: a loss), with
/// `noise` the relative standard error of that measurement, pays if it shows at least
/// [`KEEP_SHARE`] of its prediction within [`Z`] standard errors, and lost at most
/// [`MAX_LOSS`].
pub fn pays(predicted: f64, measured: f64, noise: f64) -> bool {
    let wanted = (KEEP_SHARE * predicted.max(0.0)).min(ENOUGH);
    measured.is_finite() && measured >= wanted - Z * noise.max(0.0) && measured >= -MAX_LOSS
}

impl Balancer {
    /// Rule 2 for a migration round or a probe: once its window after has passed, the
    /// verdict, and the moves back if it did not pay.
    pub(super) fn judge(&mut self, view: &View, servers: &[ServerId], loads: &Loads) -> Vec<Decision> {
        let now = view.now_us;
        let Phase::Judging(j) = &mut self.phase else { return Vec::new() };
        let window = j.window.get_or_insert_with(|| Window::starting(now.saturating_add(TRIAL_SETTLE_US)));
        window.push(now, view.iterations, view.iter_us);
        if now < window.start_us().saturating_add(j.baseline.span_us(self.params.trial_us)) {
            return Vec::new();
        }
        let Phase::Judging(j) = std::mem::replace(&mut self.phase, Phase::Steady) else { return Vec::new() };
        let window = j.window.clone().unwrap_or_default();
        let predicted_s = (j.max_before - j.max_after).max(0.0);
        let (predicted, measured, noise, before_ms, after_ms) = match (j.baseline.mean_us, self.mean_us(&window)) {
            (Some(b), Some(a)) => {
                let noise = ((j.baseline.rse * b).powi(2) + (window.rse() * a).powi(2)).sqrt() / b;
                (predicted_s * 1e6 / b, (b - a) / b, noise, Some(b / 1e3), Some(a / 1e3))
            }
            _ => {
                // No iteration times: the model judges, from fresh rates.
                let before = j.max_before.max(f64::MIN_POSITIVE);
                (predicted_s / before, (before - loads.max_time()) / before, 0.0, None, None)
            }
        };
        let kept = pays(predicted, measured, noise);
        let verdict = Verdict {
            decided_us: j.baseline.decided_us,
            judged_us: now,
            what: j.what.clone(),
            moves: j.compress.as_ref().map_or(j.moves.len(), |(_, blocks)| blocks.len()),
            predicted_gain: predicted,
            measured_gain: measured,
            before_ms,
            after_ms,
            kept,
        };
        self.quiet_since = Some(now);
        if kept {
            // A round onto a server that paid shows the model ranks it right again (a
            // straggler that recovered): the moves onto it ruled out earlier are allowed.
            self.backoff = 0;
            self.tabu.retain(|t, _| !j.moves.iter().any(|m| *t == Tabu::Onto(m.to)));
            if let Some((server, _)) = &j.compress {
                self.compress_after_us.remove(server);
            }
            return vec![Decision::Judged(verdict)];
        }
        // Undo: every moved block still where the round put it goes back, and the same
        // moves are ruled out while the backed-off hold-off runs.
        let holdoff = REVERT_HOLDOFF_US << self.backoff.min(MAX_HOLDOFF_DOUBLINGS);
        self.backoff = self.backoff.saturating_add(1);
        for m in &j.moves {
            // A probe's server is slow; a move onto a server of unknown rate (taken at the
            // median) may have failed for that server, not for its source; else the
            // source was not the bottleneck.
            let until = now.saturating_add(holdoff);
            if j.probe {
                self.tabu.insert(Tabu::Onto(m.to), until);
            } else if j.unknown.contains(&m.to) {
                self.tabu.insert(Tabu::FromOntoUnknown(m.from), until);
                self.tabu.insert(Tabu::Pair(m.from, m.to), until);
            } else {
                self.tabu.insert(Tabu::From(m.from), until);
            }
        }
        let back: Vec<Move> = j
            .moves
            .iter()
            .rev()
            .filter(|m| view.placement.owner(m.block) == Some(m.to) && servers.binary_search(&m.from).is_ok())
            .map(|m| Move { block: m.block, from: m.to, to: m.from })
            .collect();
        let why = format!(
            "revert ({}): predicted {:.1}% faster, measured {:+.1}% (noise {:.1}%)",
            j.what,
            predicted * 100.0,
            -measured * 100.0,
            noise * 100.0
        );
        let mut out = vec![Decision::Judged(verdict)];
        if let Some((server, blocks)) = j.compress {
            // A compression that did not pay: its blocks back to f32, and that server not
            // compressed again for the hold-off, doubling with each revert.
            let reverts = self.compress_after_us.get(&server).map_or(0, |h| h.1).saturating_add(1);
            let until = now.saturating_add(REVERT_HOLDOFF_US << (reverts - 1).min(MAX_HOLDOFF_DOUBLINGS));
            self.compress_after_us.insert(server, (until, reverts));
            out.push(Decision::Wire { blocks, dtype: crate::dtype::Dtype::F32, why });
            return out;
        }
        if !back.is_empty() {
            out.push(Decision::Migrate { moves: back, why });
        }
        out
    }
}

/// The record of one judged decision (report.json's `balance.decisions`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    /// When the decision was made, µs on the balancer's clock.
    pub decided_us: u64,
    /// When it was judged.
    pub judged_us: u64,
    /// What was decided (`migrate`, `probe`, `scale-out`) and why.
    pub what: String,
    /// Blocks it moved.
    pub moves: usize,
    /// The share of the iteration time the model predicted it saves.
    pub predicted_gain: f64,
    /// The share measured (negative: a loss).
    pub measured_gain: f64,
    /// Mean iteration time before, ms (`None`: judged by the model).
    pub before_ms: Option<f64>,
    /// Mean iteration time after, ms.
    pub after_ms: Option<f64>,
    /// Kept (true) or reverted.
    pub kept: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000;

    #[test]
    fn a_window_counts_a_stall_as_its_elapsed_time() {
        let mut w = Window::starting(10 * S);
        assert_eq!(w.mean_us(), None);
        w.push(9 * S, 5, Some(1.0)); // before the start: ignored
        assert!(w.is_empty());
        for t in 11..=14 {
            w.push(t * S, 4, Some(200_000.0));
        }
        assert_eq!(w.mean_us(), Some(200_000.0));
        assert_eq!(w.rse(), 0.0);
        // Nothing completes for 6 s: the mean is at least those 6 s.
        for t in 15..=20 {
            w.push(t * S, 0, None);
        }
        assert_eq!(w.mean_us(), Some(6e6));
        // A window in which nothing ever completed: its whole length.
        let mut stalled = Window::starting(0);
        for t in 1..=8 {
            stalled.push(t * S, 0, None);
        }
        assert_eq!(stalled.mean_us(), Some(8e6));
        assert_eq!(stalled.rse(), 1.0);
    }

    #[test]
    fn a_window_weighs_steps_by_their_iterations_and_slides() {
        let mut w = Window::starting(0);
        w.push(S, 1, Some(100.0));
        w.push(2 * S, 3, Some(200.0));
        assert_eq!(w.mean_us(), Some(175.0));
        assert!(w.rse() > 0.0);
        w.push(3 * S, 2, Some(300.0));
        w.keep_last(2, 0);
        assert_eq!(w.len(), 2);
        assert_eq!(w.start_us(), S);
        assert_eq!(w.mean_us(), Some(240.0));
        assert_eq!(w.completed_mean_us(), Some(240.0));
        assert_eq!(w.progress_steps(), 2);
        // A span longer than the steps keeps them all.
        w.push(4 * S, 1, Some(300.0));
        w.keep_last(1, 10 * S);
        assert_eq!(w.len(), 3);
        w.keep_last(1, S);
        assert_eq!(w.len(), 2);
    }

    #[test]
    fn the_rule_keeps_what_paid_and_never_a_measured_loss() {
        // Predicted 30%, measured 20%: kept; measured 3% with little noise: reverted.
        assert!(pays(0.3, 0.2, 0.01));
        assert!(!pays(0.3, 0.03, 0.005));
        // The same 3% within the noise of 10%: kept.
        assert!(pays(0.3, 0.03, 0.1));
        // Predicted 80%, measured 6%: the job is faster, kept.
        assert!(pays(0.8, 0.06, 0.0));
        // A loss of 3% is never kept, however noisy.
        assert!(!pays(0.0, -0.03, 1.0));
        // A probe (no gain predicted) that cost nothing measurable is kept.
        assert!(pays(0.0, -0.01, 0.01));
        assert!(!pays(0.0, f64::NAN, 0.0));
    }
}
