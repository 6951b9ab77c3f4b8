//! Markdown rendering of a [`Report`] (`summary.md`): headline numbers, the
//! run configuration, a servers table, a workers table and a link to the plot.

use std::fmt::Write as _;

use super::table::markdown_table;
use super::{CURVES_PNG, REPORT_JSON, Report};

/// Renders the human-readable Markdown summary of `report`.
pub fn render(report: &Report) -> String {
    let mut md = String::new();
    md.push_str("# elasticps training report\n\n");

    // Headline numbers.
    let _ = writeln!(md, "- **Test accuracy:** {}", percent(report.test_accuracy));
    let _ = writeln!(md, "- **Test loss:** {}", fixed(report.test_loss, 4));
    let _ = writeln!(md, "- **Throughput:** {} samples/s", thousands(report.samples_per_sec, 1));
    let _ = writeln!(md, "- **Wall time:** {} s", fixed(report.wall_s, 2));
    let _ = writeln!(md, "- **Iterations per worker:** {}", report.iterations);
    let _ = writeln!(
        md,
        "- **Cluster:** {} server{}, {} worker{}",
        report.servers.len(),
        plural(report.servers.len()),
        report.workers.len(),
        plural(report.workers.len()),
    );
    md.push('\n');

    // Configuration.
    md.push_str("## Configuration\n\n");
    match &report.config {
        serde_json::Value::Object(map) if !map.is_empty() => {
            let rows: Vec<Vec<String>> = map
                .iter()
                .map(|(k, v)| {
                    let v = match v {
                        serde_json::Value::String(s) => s.clone(),
                        other => other.to_string(),
                    };
                    vec![format!("`{k}`"), v]
                })
                .collect();
            md.push_str(&markdown_table(&["flag", "value"], &rows));
        }
        serde_json::Value::Null => md.push_str("_not recorded_\n"),
        serde_json::Value::Object(_) => md.push_str("_no flags given_\n"),
        other => {
            let pretty = serde_json::to_string_pretty(other).unwrap_or_else(|_| other.to_string());
            let _ = writeln!(md, "```json\n{pretty}\n```");
        }
    }
    md.push('\n');

    // Servers.
    md.push_str("## Servers\n\n");
    if report.servers.is_empty() {
        md.push_str("_no server statistics recorded_\n");
    } else {
        let mut servers: Vec<_> = report.servers.iter().collect();
        servers.sort_by_key(|s| s.id);
        let rows: Vec<Vec<String>> = servers
            .iter()
            .map(|s| {
                vec![
                    s.id.to_string(),
                    s.sync.clone(),
                    s.blocks.to_string(),
                    human_bytes(s.bytes),
                    s.pushes.to_string(),
                    s.pulls.to_string(),
                    s.pulls_held.to_string(),
                    thousands(s.hold_ms, 1),
                    if s.pulls_held > 0 { fixed(s.hold_ms / s.pulls_held as f64, 2) } else { "-".into() },
                    fixed(s.hold_p99_ms, 1),
                    s.releases.to_string(),
                    s.max_lead.to_string(),
                ]
            })
            .collect();
        md.push_str(&markdown_table(
            &[
                "id",
                "sync",
                "blocks",
                "bytes",
                "pushes",
                "pulls",
                "pulls held",
                "hold ms",
                "ms / held pull",
                "hold p99 ms",
                "sync events",
                "max lead",
            ],
            &rows,
        ));
    }
    md.push('\n');

    // Workers.
    md.push_str("## Workers\n\n");
    if report.workers.is_empty() {
        md.push_str("_no worker statistics recorded_\n");
    } else {
        let mut workers: Vec<_> = report.workers.iter().collect();
        workers.sort_by_key(|w| w.rank);
        let wall_ms = report.wall_s * 1000.0;
        let rows: Vec<Vec<String>> = workers
            .iter()
            .map(|w| {
                vec![
                    w.rank.to_string(),
                    w.iterations.to_string(),
                    thousands(w.wait_ms, 1),
                    if wall_ms > 0.0 { percent(w.wait_ms / wall_ms) } else { "-".into() },
                    fixed(w.iter_ms_mean, 2),
                    fixed(w.iter_ms_p99, 1),
                    fixed(w.comm_ms_per_iter, 2),
                    w.wait_ms_by_server.iter().map(|ms| thousands(*ms, 0)).collect::<Vec<_>>().join(" / "),
                    fixed(w.final_loss, 4),
                ]
            })
            .collect();
        md.push_str(&markdown_table(
            &[
                "rank",
                "iterations",
                "wait ms",
                "wait / wall",
                "iter ms",
                "iter p99 ms",
                "comm ms / iter",
                "wait ms by server",
                "final loss",
            ],
            &rows,
        ));
    }
    md.push('\n');

    // Curves.
    md.push_str("## Curves\n\n");
    let with_loss = report.curve.iter().filter(|p| p.loss.is_some()).count();
    let with_acc = report.curve.iter().filter(|p| p.test_accuracy.is_some()).count();
    let _ = writeln!(
        md,
        "{} curve points ({with_loss} with training loss, {with_acc} with test accuracy).\n",
        report.curve.len()
    );
    let _ = writeln!(md, "![training curves]({CURVES_PNG})\n");
    let _ = writeln!(md, "Full data: [`{REPORT_JSON}`]({REPORT_JSON}).");
    md
}

/// `0.97123` -> `"97.12%"`; non-finite values -> `"n/a"`.
fn percent(fraction: f64) -> String {
    if fraction.is_finite() { format!("{:.2}%", fraction * 100.0) } else { "n/a".into() }
}

/// Fixed-point with `decimals` digits; non-finite values -> `"n/a"`.
fn fixed(x: f64, decimals: usize) -> String {
    if x.is_finite() { format!("{x:.decimals$}") } else { "n/a".into() }
}

/// Fixed-point with `,` thousands separators: `12345.67` -> `"12,345.7"`.
fn thousands(x: f64, decimals: usize) -> String {
    if !x.is_finite() {
        return "n/a".into();
    }
    let s = format!("{:.decimals$}", x.abs());
    let (int, frac) = s.split_once('.').unwrap_or((&s, ""));
    let mut grouped = String::new();
    for (i, c) in int.chars().enumerate() {
        if i > 0 && (int.len() - i) % 3 == 0 {
            grouped.push(',');
        }
        grouped.push(c);
    }
    let sign = if x < 0.0 && s.chars().any(|c| c.is_ascii_digit() && c != '0') { "-" } else { "" };
    if frac.is_empty() { format!("{sign}{grouped}") } else { format!("{sign}{grouped}.{frac}") }
}

/// Binary-prefixed size: `1536` -> `"1.50 KiB"`.
fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit])
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{ServerReport, WorkerReport};

    #[test]
    fn number_formatting() {
        assert_eq!(percent(0.97123), "97.12%");
        assert_eq!(percent(f64::NAN), "n/a");
        assert_eq!(fixed(0.12345, 3), "0.123");
        assert_eq!(thousands(1234567.891, 1), "1,234,567.9");
        assert_eq!(thousands(999.0, 0), "999");
        assert_eq!(thousands(-1000.0, 2), "-1,000.00");
        assert_eq!(thousands(-0.001, 1), "0.0");
        assert_eq!(human_bytes(800), "800 B");
        assert_eq!(human_bytes(1536), "1.50 KiB");
        assert_eq!(human_bytes(3 * 1024 * 1024), "3.00 MiB");
    }

    #[test]
    fn renders_tables() {
        let report = Report {
            config: serde_json::json!({"sync": "ssp:2", "workers": 1}),
            test_accuracy: 0.5,
            test_loss: f64::NAN,
            samples_per_sec: 1000.0,
            wall_s: 2.0,
            iterations: 10,
            servers: vec![ServerReport {
                id: 7,
                sync: "ssp:2".into(),
                blocks: 3,
                bytes: 4096,
                pushes: 10,
                pulls: 10,
                pulls_held: 0,
                hold_ms: 0.0,
                ..ServerReport::default()
            }],
            workers: vec![WorkerReport {
                rank: 0,
                iterations: 10,
                wait_ms: 500.0,
                final_loss: 0.25,
                ..WorkerReport::default()
            }],
            curve: vec![],
        };
        let md = render(&report);
        assert!(md.contains("**Test accuracy:** 50.00%"), "{md}");
        assert!(md.contains("**Test loss:** n/a"), "{md}");
        assert!(md.contains("1 server, 1 worker"), "{md}");
        assert!(md.contains("| `sync`    | ssp:2 |"), "{md}");
        assert!(md.contains("|  7 | ssp:2 |"), "{md}");
        assert!(md.contains("4.00 KiB"), "{md}");
        assert!(md.contains("25.00%"), "{md}");
        assert!(md.contains("0.2500"), "{md}");
    }
}
