//! The balancing part of `elasticps train --report`: the scheduler's balance log in
//! report.json (migrations, timeline), every worker's per-iteration times on the wall clock,
//! the "Balance" section of summary.md and balance.png.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::Value;

use crate::common;

fn unix_ms() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("clock after 1970").as_secs_f64() * 1e3
}

/// Runs `elasticps train --quiet ARGS --report DIR` (bounded in time) and returns report.json.
fn train(dir: &std::path::Path, args: &[&str]) -> Value {
    let report = dir.display().to_string();
    let all = [&["train", "--quiet"][..], args, &["--report", &report]].concat();
    let (status, _, err) = common::run_bin(&all, Duration::from_secs(120));
    assert!(status.success(), "train failed: {err}");
    common::read_report(dir)
}

/// Checks every worker's `iter_ms` and `started_unix_ms` against the run: one duration per
/// iteration, they tile the training time, and the start lies within the run.
fn check_iteration_times(report: &Value, iterations: usize, before: f64, after: f64) {
    for w in report["workers"].as_array().expect("workers") {
        let ms: Vec<f64> = w["iter_ms"].as_array().expect("iter_ms").iter().map(|v| v.as_f64().expect("ms")).collect();
        assert_eq!(ms.len(), iterations, "one duration per iteration: {w}");
        assert!(ms.iter().all(|m| *m > 0.0 && *m < 60_000.0), "{ms:?}");
        let started = w["started_unix_ms"].as_f64().expect("started_unix_ms");
        assert!(before < started && started < after, "start {started} outside the run [{before}, {after}]");
        // train_s also covers the pull of clock 0 before the first iteration (slow when a
        // server is starved).
        let sum_s = ms.iter().sum::<f64>() / 1e3;
        let train_s = w["train_s"].as_f64().expect("train_s");
        assert!(sum_s <= train_s + 1e-3 && sum_s > 0.8 * train_s, "iterations {sum_s} s vs training {train_s} s");
        assert!(started + sum_s * 1e3 < after, "the last iteration ends within the run");
    }
}

#[test]
fn a_static_run_reports_its_balance_log_and_every_iteration() {
    let dir = common::temp_dir("balance-static");
    let before = unix_ms();
    let report = train(&dir, &["--iterations", "300", "--eval-every", "0", "--balance", "static"]);
    let after = unix_ms();
    check_iteration_times(&report, 300, before, after);

    let config = &report["config"];
    assert_eq!(config["balance"], "static");
    assert_eq!((config["max_servers"].as_u64(), config["min_servers"].as_u64()), (Some(2), Some(2)));
    assert_eq!(config["server_bandwidth"], serde_json::json!([]));
    assert_eq!(config["straggler_at"], 0.0);

    let balance = &report["balance"];
    assert_eq!(balance["mode"], "static");
    assert_eq!(balance["migrations"], serde_json::json!([]), "static never moves a block");
    assert!(balance["settled_s"].is_null());
    let started = balance["started_unix_ms"].as_f64().expect("started_unix_ms");
    assert!(before < started && started < after);
    let summary = std::fs::read_to_string(dir.join("summary.md")).expect("summary.md");
    assert!(summary.contains("## Balance") && summary.contains("**Mode:** static"), "{summary}");
    assert!(summary.contains("**Migrations:** 0"), "{summary}");
    // balance.png comes with a timeline (a sample per second of training).
    let timeline = balance["timeline"].as_array().expect("timeline");
    assert_eq!(dir.join("balance.png").exists(), !timeline.is_empty());
    // Arrays of numbers stay on one line.
    let json = std::fs::read_to_string(dir.join("report.json")).expect("report.json");
    let line = json.lines().find(|l| l.trim_start().starts_with("\"iter_ms\": [")).expect("iter_ms in report.json");
    assert!(line.trim_end().trim_end_matches(',').ends_with(']'), "{line}");
}

/// `--server-bandwidth` starves server 1 (2 MB/s against 20 MB/s): psld moves its blocks
/// away, the iterations get faster, and the report shows every step.
#[test]
fn psld_moves_blocks_off_a_starved_server_and_the_report_shows_it() {
    let dir = common::temp_dir("balance-psld");
    let before = unix_ms();
    let report = train(
        &dir,
        &[
            "--model",
            "synthetic:resnet56",
            "--compute-ms",
            "5",
            "--workers",
            "2",
            "--servers",
            "4",
            "--iterations",
            "60",
            "--optimizer",
            "sgd",
            "--lr",
            "0.01",
            "--balance",
            "psld",
            "--server-bandwidth",
            "0=20,1=2,2=20,3=20",
        ],
    );
    let after = unix_ms();
    check_iteration_times(&report, 60, before, after);
    assert_eq!(report["config"]["server_bandwidth"], serde_json::json!(["0=20", "1=2", "2=20", "3=20"]));

    let balance = &report["balance"];
    assert_eq!(balance["mode"], "psld");
    let migrations = balance["migrations"].as_array().expect("migrations");
    let off_1: Vec<&Value> = migrations.iter().filter(|m| m["from"] == 1 && m["error"].is_null()).collect();
    assert!(!off_1.is_empty(), "blocks moved off server 1:\n{balance}");
    for m in migrations {
        for key in ["at_s", "block", "to", "bytes", "freeze_ms", "total_ms"] {
            assert!(m[key].is_number(), "migration without {key}: {m}");
        }
    }
    assert!(balance["settled_s"].as_f64().is_some_and(|s| s > 0.0), "{balance}");
    let timeline = balance["timeline"].as_array().expect("timeline");
    let bytes_of_1 = |sample: &Value| {
        sample["servers"].as_array().and_then(|s| s.iter().find(|p| p["id"] == 1)).and_then(|p| p["bytes"].as_u64())
    };
    let first = timeline.first().and_then(bytes_of_1).expect("server 1 in the first sample");
    let last = timeline.last().and_then(bytes_of_1).expect("server 1 in the last sample");
    assert!(last * 2 < first, "server 1 kept {last} of its {first} bytes");

    // Worker 0 got faster: the last 20 iterations against the 2nd to 4th (the first warms up).
    let ms: Vec<f64> =
        report["workers"][0]["iter_ms"].as_array().expect("iter_ms").iter().filter_map(Value::as_f64).collect();
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (early, late) = (mean(&ms[1..4]), mean(&ms[ms.len() - 20..]));
    assert!(late * 2.0 < early, "iterations did not speed up: {early:.0} ms -> {late:.0} ms\n{ms:?}");

    let summary = std::fs::read_to_string(dir.join("summary.md")).expect("summary.md");
    assert!(summary.contains("**Mode:** psld") && summary.contains("1 -> "), "{summary}");
    let png = std::fs::read(dir.join("balance.png")).expect("balance.png");
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
}
