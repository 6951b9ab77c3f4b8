//! The verdicts a benchmark report ends with (`bench sync`, `bench straggler`): [`Check`]s,
//! which fail the command, and the issue's [`Target`]s, which are only reported, met or
//! missed; with their Markdown ([`checks_and_targets_markdown`]) and the command's failure
//! ([`ensure_no_check_failed`]). Each benchmark decides its own checks and targets.

use serde::Serialize;

/// Must hold: a failed check fails the command.
#[derive(Clone, Debug, Serialize)]
pub struct Check {
    /// What must hold.
    pub what: String,
    /// The numbers it was decided on.
    pub measured: String,
    /// `None`: skipped (a run it needs was not made).
    pub pass: Option<bool>,
}

/// One of the targets: reported, met or missed.
#[derive(Clone, Debug, Serialize)]
pub struct Target {
    /// The target.
    pub what: String,
    /// The numbers it was decided on.
    pub measured: String,
    /// `None`: not decided (a run it needs was not made).
    pub met: Option<bool>,
}

/// `a` against `b`, each `None` when the run it comes from was not made: what they show
/// and whether they hold, or "not run" and undecided.
fn compare(
    a: Option<f64>,
    b: Option<f64>,
    show: impl FnOnce(f64, f64) -> String,
    holds: impl FnOnce(f64, f64) -> bool,
) -> (String, Option<bool>) {
    match a.zip(b) {
        Some((a, b)) => (show(a, b), Some(holds(a, b))),
        None => ("not run".into(), None),
    }
}

impl Check {
    /// A check of `a` against `b` (skipped when either run was not made).
    pub fn compare(
        what: impl Into<String>,
        (a, b): (Option<f64>, Option<f64>),
        show: impl FnOnce(f64, f64) -> String,
        holds: impl FnOnce(f64, f64) -> bool,
    ) -> Self {
        let (measured, pass) = compare(a, b, show, holds);
        Check { what: what.into(), measured, pass }
    }
}

impl Target {
    /// A target of `a` against `b` (undecided when either run was not made).
    pub fn compare(
        what: impl Into<String>,
        (a, b): (Option<f64>, Option<f64>),
        show: impl FnOnce(f64, f64) -> String,
        holds: impl FnOnce(f64, f64) -> bool,
    ) -> Self {
        let (measured, met) = compare(a, b, show, holds);
        Target { what: what.into(), measured, met }
    }
}

/// The "Checks" and "Targets" lists that end a benchmark's Markdown, each with a blank line
/// before its heading: `- PASS|FAIL|SKIP what: measured` and `- [x]|[ ]|[-] what: measured`.
pub fn checks_and_targets_markdown(checks: &[Check], targets: &[Target]) -> String {
    let mut s = String::new();
    s.push_str("\nChecks (fail the command):\n\n");
    for c in checks {
        let tag = match c.pass {
            Some(true) => "PASS",
            Some(false) => "FAIL",
            None => "SKIP",
        };
        s.push_str(&format!("- {tag} {}: {}\n", c.what, c.measured));
    }
    s.push_str("\nTargets (reported):\n\n");
    for t in targets {
        let tag = match t.met {
            Some(true) => "[x]",
            Some(false) => "[ ]",
            None => "[-]",
        };
        s.push_str(&format!("- {tag} {}: {}\n", t.what, t.measured));
    }
    s
}

/// An error saying how many of the checks failed, if any did (skipped ones do not count).
pub fn ensure_no_check_failed(checks: &[Check]) -> crate::Result<()> {
    let failed = checks.iter().filter(|c| c.pass == Some(false)).count();
    crate::error::ensure_measured!(failed == 0, "{failed} of {} checks failed", checks.len());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_every_verdict_and_fails_only_on_a_failed_check() {
        let check = |pass| Check { what: "w".into(), measured: "m".into(), pass };
        let target = |met| Target { what: "t".into(), measured: "n".into(), met };
        let checks = [check(Some(true)), check(Some(false)), check(None)];
        let md = checks_and_targets_markdown(&checks, &[target(Some(true)), target(Some(false)), target(None)]);
        assert_eq!(
            md,
            "\nChecks (fail the command):\n\n- PASS w: m\n- FAIL w: m\n- SKIP w: m\n\
             \nTargets (reported):\n\n- [x] t: n\n- [ ] t: n\n- [-] t: n\n"
        );
        assert_eq!(ensure_no_check_failed(&checks).unwrap_err().to_string(), "1 of 3 checks failed");
        assert!(ensure_no_check_failed(&[check(Some(true)), check(None)]).is_ok());
        let c = Check::compare("a > b", (Some(2.0), Some(1.0)), |a, b| format!("{a} vs {b}"), |a, b| a > b);
        assert_eq!((c.measured.as_str(), c.pass), ("2 vs 1", Some(true)));
        let t = Target::compare("a > b", (Some(2.0), None), |a, b| format!("{a} vs {b}"), |a, b| a > b);
        assert_eq!((t.measured.as_str(), t.met), ("not run", None));
    }
}
