//! Markdown rendering of a [`Report`] (`summary.md`): headline numbers, the
//! run configuration, a servers table, a workers table and a link to the plot.

use std::fmt::Write as _;

use elasticps_core::stats::median;
use elasticps_node::scheduler::MigrationEvent;

use super::table::markdown_table;
use super::{BALANCE_PNG, BalanceLog, CURVES_PNG, REPORT_JSON, Report};

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

    // Balance.
    if let Some(log) = &report.balance {
        balance(&mut md, log);
    }
    let _ = writeln!(md, "Full data: [`{REPORT_JSON}`]({REPORT_JSON}).");
    md
}

/// The "Balance" section: mode, migrations (count, bytes, freeze and total time), scaling
/// events, settling time, the servers at the last sample, a link to `balance.png`.
fn balance(md: &mut String, log: &BalanceLog) {
    md.push_str(
        "## Balance

",
    );
    migrations(md, log);
    md.push('\n');
    scaling_events(md, log);
    last_sample(md, log);
}

/// The section's list: mode, migrations and their times, verdicts, settling time, the
/// first failed migrations.
fn migrations(md: &mut String, log: &BalanceLog) {
    let ok: Vec<_> = log.migrations.iter().filter(|m| m.error.is_none()).collect();
    let failed = log.migrations.len() - ok.len();
    let bytes: u64 = ok.iter().map(|m| m.bytes).sum();
    let freeze: Vec<f64> = ok.iter().map(|m| m.freeze_ms).collect();
    let total: Vec<f64> = ok.iter().map(|m| m.total_ms).collect();
    let _ = writeln!(md, "- **Mode:** {}", if log.mode.is_empty() { "unknown" } else { &log.mode });
    let _ = writeln!(
        md,
        "- **Migrations:** {}{}, {} moved",
        ok.len(),
        if failed > 0 { format!(" ({failed} more failed)") } else { String::new() },
        human_bytes(bytes)
    );
    if !ok.is_empty() {
        let _ = writeln!(
            md,
            "- **Block frozen:** p50 {} ms, max {} ms; **request to handover:** p50 {} ms, max {} ms",
            fixed(median(&freeze).unwrap_or(f64::NAN), 2),
            fixed(max(&freeze), 2),
            fixed(median(&total).unwrap_or(f64::NAN), 1),
            fixed(max(&total), 1)
        );
        moves_by_server(md, &ok);
    }
    verdicts(md, log);
    let _ = writeln!(
        md,
        "- **Settled:** {}",
        log.settled_s.map_or("never moved (placement unchanged)".to_string(), |s| format!(
            "{} s after the scheduler started (the last migration or scaling decision)",
            fixed(s, 1)
        ))
    );
    if failed > 0 {
        let errors: Vec<String> = log
            .migrations
            .iter()
            .filter_map(|m| {
                Some(format!(
                    "block {} {} -> {} at {} s: {}",
                    m.block,
                    m.from,
                    m.to,
                    fixed(m.at_s, 1),
                    m.error.as_ref()?
                ))
            })
            .take(5)
            .collect();
        let _ = writeln!(md, "- **Failed migrations** (first {}): {}", errors.len(), errors.join("; "));
    }
}

/// The successful migrations `ok` (at least one) by (from, to) server, then when the
/// first and the last happened.
fn moves_by_server(md: &mut String, ok: &[&MigrationEvent]) {
    let mut moves: Vec<((u32, u32), (usize, u64))> = Vec::new();
    for m in ok {
        match moves.iter_mut().find(|(k, _)| *k == (m.from, m.to)) {
            Some((_, (n, b))) => {
                *n += 1;
                *b += m.bytes;
            }
            None => moves.push(((m.from, m.to), (1, m.bytes))),
        }
    }
    moves.sort_by_key(|(k, _)| *k);
    let list: Vec<String> =
        moves.iter().map(|((f, t), (n, b))| format!("{f} -> {t}: {n} ({})", human_bytes(*b))).collect();
    let _ = writeln!(md, "- **Moves by server:** {}", list.join(", "));
    if let (Some(first), Some(last)) = (ok.first(), ok.last()) {
        let _ = writeln!(md, "- **First / last migration:** {} s / {} s", fixed(first.at_s, 1), fixed(last.at_s, 1));
    }
}

/// The balancer's verdicts on its decisions (kept or reverted, predicted and measured
/// gain), if it judged any.
fn verdicts(md: &mut String, log: &BalanceLog) {
    if log.decisions.is_empty() {
        return;
    }
    let kept = log.decisions.iter().filter(|d| d.kept()).count();
    let list: Vec<String> = log
        .decisions
        .iter()
        .map(|d| {
            format!(
                "{} at {} s ({} blocks: predicted {:+.1}%, measured {:+.1}%)",
                d.verdict,
                fixed(d.judged_s, 1),
                d.moves,
                -d.predicted_gain * 100.0,
                -d.measured_gain * 100.0
            )
        })
        .collect();
    let _ = writeln!(
        md,
        "- **Verdicts** (iteration time, negative is faster): {kept} kept, {} reverted: {}",
        log.decisions.len() - kept,
        list.join("; ")
    );
}

/// The scaling events, as a table (or a line saying there were none).
fn scaling_events(md: &mut String, log: &BalanceLog) {
    if log.scaling.is_empty() {
        md.push_str("No scaling events.\n\n");
    } else {
        md.push_str("Scaling events:\n\n");
        let rows: Vec<Vec<String>> = log
            .scaling
            .iter()
            .map(|e| {
                vec![
                    fixed(e.at_s, 1),
                    e.action.clone(),
                    e.server.map_or("-".into(), |s| s.to_string()),
                    e.reason.clone(),
                ]
            })
            .collect();
        md.push_str(&markdown_table(&["at s", "action", "server", "reason"], &rows));
        md.push('\n');
    }
}

/// The servers at the last sample of the load timeline, as a table, and a link to
/// `balance.png` (or a line saying no timeline was recorded).
fn last_sample(md: &mut String, log: &BalanceLog) {
    if let Some(last) = log.timeline.last() {
        let _ = writeln!(md, "Servers at the last sample ({} s):\n", fixed(last.t_s, 1));
        let rows: Vec<Vec<String>> = last
            .servers
            .iter()
            .map(|s| {
                vec![
                    s.id.to_string(),
                    s.blocks.to_string(),
                    human_bytes(s.bytes),
                    if s.rate_bps > 0.0 { format!("{} MB/s", fixed(s.rate_bps / 1e6, 1)) } else { "-".into() },
                    if s.rate_bps > 0.0 { fixed(s.service_ms, 1) } else { "-".into() },
                    if s.straggler { "yes".into() } else { "".into() },
                ]
            })
            .collect();
        md.push_str(&markdown_table(&["id", "blocks", "bytes", "rate", "service ms", "straggler"], &rows));
        md.push('\n');
        row_blocks(md, &last.servers);
        let _ = writeln!(md, "![load balance]({BALANCE_PNG})\n");
    } else {
        md.push_str("_no load timeline recorded_\n\n");
    }
}

/// The servers' embedding rows at the last sample (what their row blocks hold, and what
/// they evicted, expired, refused and read uninitialized over the job), as a table; nothing
/// when no server reported a row block.
fn row_blocks(md: &mut String, servers: &[elasticps_node::scheduler::ServerPoint]) {
    let rows: Vec<Vec<String>> = servers
        .iter()
        .filter_map(|s| {
            let r = s.rows?;
            Some(vec![
                s.id.to_string(),
                r.live_rows.to_string(),
                human_bytes(r.live_bytes),
                r.evicted.to_string(),
                r.expired.to_string(),
                r.refused_grads.to_string(),
                r.init_reads.to_string(),
            ])
        })
        .collect();
    if rows.is_empty() {
        return;
    }
    md.push_str("Embedding rows (live at the last sample; the counts over the job):\n\n");
    let headers = ["id", "live rows", "live bytes", "evicted", "expired", "refused gradients", "init reads"];
    md.push_str(&markdown_table(&headers, &rows));
    md.push('\n');
}

/// The largest finite value (NaN for none).
pub fn max(values: &[f64]) -> f64 {
    values.iter().copied().filter(|x| x.is_finite()).fold(f64::NAN, f64::max)
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
    use crate::{ServerReport, WorkerReport};

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
            balance: None,
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

    /// Every part of the balance section: migrations (one failed), moves by server,
    /// a verdict, a scaling event, the servers at the last sample.
    #[test]
    fn the_balance_section_lists_migrations_verdicts_scaling_and_the_last_sample() {
        use elasticps_node::scheduler::{DecisionRecord, LoadSample, ScaleEvent, ServerPoint};
        let migration = |at_s: f64, block, from, to, error: Option<&str>| MigrationEvent {
            at_s,
            block,
            from,
            to,
            bytes: 1 << 20,
            freeze_ms: at_s,
            total_ms: 10.0 * at_s,
            held: 0,
            error: error.map(str::to_string),
        };
        let server = |id, rate_bps, straggler| ServerPoint {
            id,
            blocks: 3,
            bytes: 3 << 20,
            rate_bps,
            confidence: 1.0,
            in_mbps: 0.0,
            out_mbps: 0.0,
            queued_ms_per_s: 0.0,
            service_ms: 2.5,
            straggler,
            rows: None,
        };
        let log = BalanceLog {
            mode: "psld".into(),
            started_unix_ms: 0.0,
            migrations: vec![
                migration(1.0, 4, 0, 1, None),
                migration(2.0, 5, 0, 1, None),
                migration(3.0, 6, 1, 2, None),
                migration(4.0, 7, 0, 2, Some("the new owner is gone")),
            ],
            scaling: vec![ScaleEvent { at_s: 5.0, action: "add".into(), server: Some(2), reason: "slow".into() }],
            timeline: vec![LoadSample {
                t_s: 6.0,
                iter_ms: None,
                servers: vec![server(0, 0.0, true), server(1, 5e6, false)],
            }],
            decisions: vec![DecisionRecord {
                judged_s: 3.5,
                moves: 2,
                predicted_gain: 0.2,
                measured_gain: 0.1,
                verdict: "kept".into(),
                ..DecisionRecord::default()
            }],
            settled_s: Some(5.5),
        };
        let mut md = String::new();
        balance(&mut md, &log);
        assert_eq!(md, EXPECTED_BALANCE);
    }

    #[test]
    fn the_servers_embedding_rows_are_listed_only_when_some_server_reported_rows() {
        use elasticps_node::scheduler::{ServerPoint, ServerRows};
        let point = |id, rows| ServerPoint {
            id,
            blocks: 1,
            bytes: 0,
            rate_bps: 0.0,
            confidence: 0.0,
            in_mbps: 0.0,
            out_mbps: 0.0,
            queued_ms_per_s: 0.0,
            service_ms: 0.0,
            straggler: false,
            rows,
        };
        let mut md = String::new();
        row_blocks(&mut md, &[point(0, None)]);
        assert_eq!(md, "");
        let r = ServerRows {
            live_rows: 4096,
            live_bytes: 1 << 20,
            evicted: 17,
            expired: 3,
            refused_grads: 9,
            init_reads: 250,
        };
        row_blocks(&mut md, &[point(0, None), point(1, Some(r))]);
        assert!(
            md.contains("| id | live rows | live bytes | evicted | expired | refused gradients | init reads |"),
            "{md}"
        );
        assert!(
            md.contains("|  1 |      4096 |   1.00 MiB |      17 |       3 |                 9 |        250 |"),
            "{md}"
        );
        assert!(!md.contains("|  0 |"), "{md}");
    }

    const EXPECTED_BALANCE: &str = concat!(
        "## Balance\n",
        "\n",
        "- **Mode:** psld\n",
        "- **Migrations:** 3 (1 more failed), 3.00 MiB moved\n",
        "- **Block frozen:** p50 2.00 ms, max 3.00 ms; **request to handover:** p50 20.0 ms, max 30.0 ms\n",
        "- **Moves by server:** 0 -> 1: 2 (2.00 MiB), 1 -> 2: 1 (1.00 MiB)\n",
        "- **First / last migration:** 1.0 s / 3.0 s\n",
        "- **Verdicts** (iteration time, negative is faster): 1 kept, 0 reverted: kept at 3.5 s (2 blocks: predicted -20.0%, measured -10.0%)\n",
        "- **Settled:** 5.5 s after the scheduler started (the last migration or scaling decision)\n",
        "- **Failed migrations** (first 1): block 7 0 -> 2 at 4.0 s: the new owner is gone\n",
        "\n",
        "Scaling events:\n",
        "\n",
        "| at s | action | server | reason |\n",
        "|-----:|:-------|-------:|:-------|\n",
        "|  5.0 | add    |      2 | slow   |\n",
        "\n",
        "Servers at the last sample (6.0 s):\n",
        "\n",
        "| id | blocks |    bytes | rate     | service ms | straggler |\n",
        "|---:|-------:|---------:|:---------|:-----------|:----------|\n",
        "|  0 |      3 | 3.00 MiB | -        | -          | yes       |\n",
        "|  1 |      3 | 3.00 MiB | 5.0 MB/s | 2.5        |           |\n",
        "\n",
        "![load balance](balance.png)\n",
        "\n",
    );
}
