//! Experiment reports written by `elasticps train --report DIR`.
//!
//! A [`Report`] is the complete, self-contained record of one training run:
//!
//! * the run's configuration (its command-line flags, as given),
//! * the headline results (final test accuracy and loss, throughput, wall time,
//!   iterations per worker),
//! * one [`ServerReport`] per parameter-server shard (sync mode, blocks held,
//!   traffic, how often and how long pulls were held back by the consistency
//!   model),
//! * one [`WorkerReport`] per worker (iterations, time spent waiting on the
//!   servers, final training loss, every iteration's duration),
//! * the balancing history (`balance`: migrations, scaling events, load timeline),
//! * the training curve: timestamped [`CurvePoint`]s carrying a worker's
//!   training loss and/or a test-accuracy measurement.
//!
//! [`write()`] turns a report into three files in the report directory:
//!
//! | file          | content                                                    |
//! |---------------|------------------------------------------------------------|
//! | `report.json` | the [`Report`] itself, pretty-printed JSON (machine-readable; deserialize it back into [`Report`]) |
//! | `summary.md`  | human-readable Markdown: headline numbers, configuration, a servers table and a workers table ([`summary`]) |
//! | `curves.png`  | two panels: training loss vs time per worker, test accuracy vs time ([`plot`]) |
//! | `balance.png` | bytes and estimated service time per server, mean iteration time, migrations and scaling events over time ([`balance_plot`]); only when the report has a balance timeline |
//!
//! The report also carries the scheduler's [`BalanceLog`] (`balance`: every migration and
//! scaling event, the load timeline, the settling time) and, per worker, every iteration's
//! duration with the wall-clock start ([`WorkerReport::iter_ms`]), so that iteration times
//! can be lined up with migrations. [`to_json`] keeps arrays of numbers on one line.
//!
//! The benchmarks' analytics live here too: [`analytics`] draws a run's throughput, sync
//! counters, accuracy over time and, against its balance log, the settle time, the window
//! after it and its rate, and the spikes around migrations; [`stats`] sums the lanes of a
//! measured phase (latency percentiles, GB/s).
//!
//! Non-finite floating-point values (a diverged run's `NaN` loss, say) are
//! written by `serde_json` as `null`; the plain `f64` fields read `null` back
//! as `NaN` so such a `report.json` still loads, while `CurvePoint`'s optional
//! fields read it back as `None`.

pub mod analytics;
pub mod balance_plot;
mod error;
pub mod plot;
pub mod stats;
pub mod summary;
pub mod table;

pub use error::{ReportError, Result};

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

pub use elasticps_node::events::WorkerReport;
use elasticps_node::events::f64_or_nan;
pub use elasticps_node::scheduler::{BalanceLog, ServerPoint};
use serde::{Deserialize, Serialize};

/// File name of the machine-readable report inside the report directory.
pub const REPORT_JSON: &str = "report.json";
/// File name of the Markdown summary inside the report directory.
pub const SUMMARY_MD: &str = "summary.md";
/// File name of the training-curve plot inside the report directory.
pub const CURVES_PNG: &str = "curves.png";
/// File name of the load-balancing plot inside the report directory (written when the
/// report has a balance timeline).
pub const BALANCE_PNG: &str = "balance.png";

/// Everything recorded about one training run.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Report {
    /// The run's flags, as given on the command line (typically a JSON object
    /// mapping flag name to value).
    pub config: serde_json::Value,
    /// Final test accuracy, as a fraction in `0..=1`.
    #[serde(deserialize_with = "f64_or_nan")]
    pub test_accuracy: f64,
    /// Final mean test loss.
    #[serde(deserialize_with = "f64_or_nan")]
    pub test_loss: f64,
    /// Training throughput over the whole run, summed over all workers.
    #[serde(deserialize_with = "f64_or_nan")]
    pub samples_per_sec: f64,
    /// Wall-clock duration of the training phase, in seconds.
    #[serde(deserialize_with = "f64_or_nan")]
    pub wall_s: f64,
    /// Training iterations per worker (the maximum over workers).
    pub iterations: u64,
    /// Per parameter-server statistics, one entry per server.
    pub servers: Vec<ServerReport>,
    /// Per worker statistics, one entry per worker.
    pub workers: Vec<WorkerReport>,
    /// The training curve drawn in `curves.png`.
    pub curve: Vec<CurvePoint>,
    /// The scheduler's balancing history: migrations, scaling events, the load timeline
    /// drawn in `balance.png` (`null` when the scheduler sent none).
    #[serde(default)]
    pub balance: Option<BalanceLog>,
}

/// Statistics of one parameter server over the run.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct ServerReport {
    /// Server id.
    pub id: u32,
    /// Consistency model the server ran (e.g. `"bsp"`, `"ssp:3"`, `"async"`).
    pub sync: String,
    /// Number of parameter blocks this server owned.
    pub blocks: u32,
    /// Bytes of parameters held by this server.
    pub bytes: u64,
    /// Gradient pushes received.
    pub pushes: u64,
    /// Parameter pulls served.
    pub pulls: u64,
    /// Pulls that had to be held back until the consistency model allowed
    /// them (e.g. waiting for stragglers under BSP/SSP).
    pub pulls_held: u64,
    /// Total time pulls spent held back, in milliseconds.
    #[serde(deserialize_with = "f64_or_nan")]
    pub hold_ms: f64,
    /// 99th percentile of the hold time of held pulls (log2-bucket upper bound), ms.
    #[serde(default, deserialize_with = "f64_or_nan")]
    pub hold_p99_ms: f64,
    /// Sync events: times held pulls were released.
    #[serde(default)]
    pub releases: u64,
    /// Largest lead between the fastest and the slowest worker seen on any block, clocks.
    #[serde(default)]
    pub max_lead: u64,
}

/// One sample of the training curve.
///
/// A point carries a worker's training loss, a test-accuracy measurement, or
/// both; `curves.png` draws `loss` per `rank` in its left panel and every
/// `test_accuracy` in its right panel.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct CurvePoint {
    /// Seconds since the start of training.
    #[serde(deserialize_with = "f64_or_nan")]
    pub t_s: f64,
    /// The worker's iteration number at this point.
    pub iteration: u64,
    /// Rank of the worker this point belongs to.
    pub rank: u32,
    /// Training (mini-batch) loss, if recorded at this point.
    pub loss: Option<f64>,
    /// Test accuracy as a fraction in `0..=1`, if evaluated at this point.
    pub test_accuracy: Option<f64>,
    /// Other values a training script logged at this point (`elasticps.log(...)`), by
    /// name; absent from report.json when empty.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metrics: BTreeMap<String, f64>,
}

/// Writes `report.json`, `summary.md` and `curves.png` for `report` into
/// `dir`, creating the directory (and its parents) if needed. Existing files
/// of those names are overwritten.
pub fn write(dir: &Path, report: &Report) -> Result<()> {
    fs::create_dir_all(dir).map_err(|e| ReportError::io("creating report directory", dir, e))?;

    let json_path = dir.join(REPORT_JSON);
    let json = to_json(report)?;
    fs::write(&json_path, json + "\n").map_err(|e| ReportError::io("writing", &json_path, e))?;

    let md_path = dir.join(SUMMARY_MD);
    fs::write(&md_path, summary::render(report)).map_err(|e| ReportError::io("writing", &md_path, e))?;

    let png_path = dir.join(CURVES_PNG);
    plot::draw_curves(&png_path, &report.curve).map_err(|e| e.drawing(png_path.display().to_string()))?;

    let balance_path = dir.join(BALANCE_PNG);
    match &report.balance {
        Some(log) if !log.timeline.is_empty() => {
            balance_plot::draw(&balance_path, log).map_err(|e| e.drawing(balance_path.display().to_string()))?
        }
        // No timeline: no plot, and none left over from an earlier run in the same directory.
        _ => match fs::remove_file(&balance_path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(ReportError::io("removing the stale", &balance_path, e));
            }
            _ => {}
        },
    }
    Ok(())
}

/// Pretty-printed JSON (as `serde_json::to_string_pretty`), except that arrays holding
/// only numbers (or nulls) stay on one line: a worker's thousands of iteration times
/// take one line instead of thousands.
pub fn to_json<T: Serialize + ?Sized>(value: &T) -> serde_json::Result<String> {
    let pretty = serde_json::to_string_pretty(value)?;
    let lines: Vec<&str> = pretty.lines().collect();
    let mut out = String::with_capacity(pretty.len());
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        if line.ends_with('[') {
            // Scan the items up to the closing bracket; collapse if all are scalars.
            let mut j = i + 1;
            let mut items = Vec::new();
            while j < lines.len() {
                let item = lines[j].trim();
                if item == "]" || item == "]," {
                    break;
                }
                let bare = item.strip_suffix(',').unwrap_or(item);
                if bare != "null" && bare.parse::<f64>().is_err() {
                    break;
                }
                items.push(bare);
                j += 1;
            }
            if j < lines.len() && j > i + 1 && matches!(lines[j].trim(), "]" | "],") {
                out.push_str(line);
                out.push_str(&items.join(", "));
                out.push_str(lines[j].trim());
                out.push('\n');
                i = j + 1;
                continue;
            }
        }
        out.push_str(line);
        out.push('\n');
        i += 1;
    }
    out.pop();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// A unique, fresh directory under the system temp dir, removed on drop
    /// unless `ELASTICPS_KEEP_TEST_OUTPUT` is set (handy to look at the PNG).
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(tag: &str) -> Self {
            static N: AtomicU32 = AtomicU32::new(0);
            let nanos =
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
            let dir = std::env::temp_dir().join(format!(
                "elasticps-report-{tag}-{}-{nanos}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            TempDir(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            if std::env::var_os("ELASTICPS_KEEP_TEST_OUTPUT").is_some() {
                eprintln!("kept report test output in {}", self.0.display());
            } else {
                let _ = fs::remove_dir_all(&self.0);
            }
        }
    }

    /// Tiny deterministic PRNG (xorshift) for synthetic noise.
    struct Rng(u64);
    impl Rng {
        fn next_f64(&mut self) -> f64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 >> 11) as f64 / (1u64 << 53) as f64
        }
    }

    /// A realistic run: 4 workers (one straggler), 2 BSP servers, loss decaying
    /// from ~2.3 with noise, test accuracy evaluated every 50 iterations.
    fn synthetic_report() -> Report {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let mut curve = Vec::new();
        let iters = 400u64;
        for rank in 0..4u32 {
            let secs_per_iter = if rank == 3 { 0.031 } else { 0.025 };
            for it in (0..iters).step_by(5) {
                let t_s = it as f64 * secs_per_iter + 0.002 * rank as f64;
                let base = 0.12 + 2.18 * (-(it as f64) / 70.0).exp();
                let noise = (rng.next_f64() - 0.5) * 0.35 * base;
                let test_accuracy = (rank == 0 && it % 50 == 0)
                    .then(|| 0.1 + 0.87 * (1.0 - (-(it as f64) / 80.0).exp()) + (rng.next_f64() - 0.5) * 0.01);
                curve.push(CurvePoint {
                    t_s,
                    iteration: it,
                    rank,
                    loss: Some(base + noise),
                    test_accuracy,
                    metrics: BTreeMap::new(),
                });
            }
        }
        curve.push(CurvePoint {
            t_s: 12.4,
            iteration: iters,
            rank: 0,
            loss: None,
            test_accuracy: Some(0.9712),
            metrics: BTreeMap::from([("samples".to_string(), 12800.0)]),
        });
        Report {
            config: serde_json::json!({
                "workers": 4,
                "servers": 2,
                "sync": "bsp",
                "lr": 0.05,
                "batch_size": 64,
                "iterations": iters,
                "dataset": "synthetic-mnist",
            }),
            test_accuracy: 0.9712,
            test_loss: 0.0934,
            samples_per_sec: 8256.5,
            wall_s: 12.4,
            iterations: iters,
            servers: (0..2)
                .map(|id| ServerReport {
                    id,
                    sync: "bsp".into(),
                    blocks: 8,
                    bytes: 1_592_320 / 2,
                    pushes: 1600,
                    pulls: 1600,
                    pulls_held: 1187 + u64::from(id),
                    hold_ms: 2345.678,
                    ..ServerReport::default()
                })
                .collect(),
            workers: (0..4)
                .map(|rank| WorkerReport {
                    rank,
                    iterations: iters,
                    wait_ms: if rank == 3 { 120.5 } else { 2400.25 },
                    final_loss: 0.13 + 0.01 * f64::from(rank),
                    ..WorkerReport::default()
                })
                .collect(),
            curve,
            balance: None,
        }
    }

    /// Checks the PNG signature and the IHDR width/height.
    fn assert_png(path: &Path, width: u32, height: u32) {
        let bytes = fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        assert!(bytes.len() > 33, "PNG too short: {} bytes", bytes.len());
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "PNG signature");
        assert_eq!(&bytes[8..12], &13u32.to_be_bytes(), "IHDR length");
        assert_eq!(&bytes[12..16], b"IHDR", "first chunk is IHDR");
        let w = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
        let h = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
        assert_eq!((w, h), (width, height), "PNG dimensions");
        assert_eq!(&bytes[bytes.len() - 8..bytes.len() - 4], b"IEND", "ends with IEND");
    }

    #[test]
    fn writes_all_three_files() {
        let tmp = TempDir::new("full");
        let report = synthetic_report();
        write(&tmp.0, &report).expect("write report");

        let json = fs::read_to_string(tmp.0.join(REPORT_JSON)).unwrap();
        let back: Report = serde_json::from_str(&json).unwrap();
        assert_eq!(back, report);

        let md = fs::read_to_string(tmp.0.join(SUMMARY_MD)).unwrap();
        assert!(md.contains("97.12%"), "accuracy missing:\n{md}");
        for s in &report.servers {
            let row = md
                .lines()
                .filter(|l| l.starts_with('|'))
                .find(|l| l.split('|').nth(1).map(str::trim) == Some(&s.id.to_string()));
            let row = row.unwrap_or_else(|| panic!("no row for server {}:\n{md}", s.id));
            assert!(row.contains(&s.sync) && row.contains(&s.pulls_held.to_string()), "{row}");
        }
        for w in &report.workers {
            assert!(md.contains(&format!("{:.4}", w.final_loss)), "worker {}:\n{md}", w.rank);
        }

        let png = tmp.0.join(CURVES_PNG);
        assert_png(&png, plot::WIDTH, plot::HEIGHT);
        // A blank canvas compresses to a few KB; text and curves make it larger.
        assert!(fs::metadata(&png).unwrap().len() > 20_000);
    }

    #[test]
    fn balance_log_round_trips_and_draws() {
        let tmp = TempDir::new("balance");
        let mut report = synthetic_report();
        report.balance = Some(balance_plot::tests::sample_log());
        report.workers[0].started_unix_ms = 1.7e12 + 1234.5;
        report.workers[0].iter_ms = vec![12.5, 13.25, 1000.001, 0.0];
        write(&tmp.0, &report).expect("write report");
        let json = fs::read_to_string(tmp.0.join(REPORT_JSON)).unwrap();
        let back: Report = serde_json::from_str(&json).unwrap();
        assert_eq!(back, report);
        // Numeric arrays stay on one line; arrays of objects do not.
        assert!(json.contains("\"iter_ms\": [12.5, 13.25, 1000.001, 0.0]"), "{json}");
        assert!(json.contains("\"migrations\": [\n"), "{json}");
        assert_eq!(back.workers[0].iteration_ends_unix_ms()[1], 1.7e12 + 1234.5 + 12.5 + 13.25);
        assert_png(&tmp.0.join(BALANCE_PNG), balance_plot::WIDTH, balance_plot::HEIGHT);
        let md = fs::read_to_string(tmp.0.join(SUMMARY_MD)).unwrap();
        assert!(md.contains("## Balance") && md.contains("**Migrations:** 7 (1 more failed)"), "{md}");
        assert!(md.contains("| 20.0 | scale-out |"), "{md}");
        assert!(md.contains("![load balance](balance.png)"), "{md}");

        // Without a log: null in report.json, no plot (the stale one is removed).
        report.balance = None;
        write(&tmp.0, &report).expect("write report");
        let json = fs::read_to_string(tmp.0.join(REPORT_JSON)).unwrap();
        assert!(json.contains("\"balance\": null"), "{json}");
        assert!(!tmp.0.join(BALANCE_PNG).exists());
        assert!(!fs::read_to_string(tmp.0.join(SUMMARY_MD)).unwrap().contains("## Balance"));
        // An older report.json without the new fields still loads.
        let mut value: serde_json::Value = serde_json::from_str(&json).unwrap();
        value.as_object_mut().unwrap().remove("balance");
        for w in value["workers"].as_array_mut().unwrap() {
            w.as_object_mut().unwrap().remove("iter_ms");
            w.as_object_mut().unwrap().remove("started_unix_ms");
        }
        let old: Report = serde_json::from_value(value).unwrap();
        assert_eq!(old.balance, None);
        assert!(old.workers[0].iter_ms.is_empty());
    }

    #[test]
    fn to_json_only_inlines_scalar_arrays() {
        let v =
            serde_json::json!({"a": [1, 2.5, null], "b": [], "c": [[1, 2], [3]], "d": ["x", "y"], "e": [{"f": [1]}]});
        let s = to_json(&v).unwrap();
        assert!(s.contains("\"a\": [1, 2.5, null]"), "{s}");
        assert!(s.contains("\"b\": []"), "{s}");
        assert!(s.contains("[1, 2],") && s.contains("[3]\n"), "{s}");
        assert!(s.contains("\"d\": [\n"), "{s}");
        assert!(s.contains("\"f\": [1]"), "{s}");
        assert_eq!(serde_json::from_str::<serde_json::Value>(&s).unwrap(), v);
        assert!(!s.ends_with('\n'));
    }

    #[test]
    fn empty_curve_still_writes_valid_png() {
        let tmp = TempDir::new("empty");
        let mut report = synthetic_report();
        report.curve.clear();
        report.servers.clear();
        report.workers.clear();
        report.config = serde_json::Value::Null;
        write(&tmp.0, &report).expect("write report");
        assert_png(&tmp.0.join(CURVES_PNG), plot::WIDTH, plot::HEIGHT);
        let back: Report = serde_json::from_str(&fs::read_to_string(tmp.0.join(REPORT_JSON)).unwrap()).unwrap();
        assert_eq!(back, report);
    }

    #[test]
    fn degenerate_curves_do_not_panic() {
        let tmp = TempDir::new("degenerate");
        let mut report = synthetic_report();
        let p = |t_s: f64, loss: Option<f64>, acc: Option<f64>| CurvePoint {
            t_s,
            iteration: 1,
            rank: 0,
            loss,
            test_accuracy: acc,
            metrics: BTreeMap::new(),
        };
        // A single point, a diverged (NaN / inf) loss, no accuracy at all.
        report.curve =
            vec![p(0.0, Some(2.3), None), p(0.0, Some(f64::NAN), None), p(f64::INFINITY, Some(f64::INFINITY), None)];
        report.test_loss = f64::NAN;
        write(&tmp.0, &report).expect("write report");
        assert_png(&tmp.0.join(CURVES_PNG), plot::WIDTH, plot::HEIGHT);
        // NaN is written as null and read back as NaN.
        let back: Report = serde_json::from_str(&fs::read_to_string(tmp.0.join(REPORT_JSON)).unwrap()).unwrap();
        assert!(back.test_loss.is_nan());
        assert_eq!(back.curve[1].loss, None);

        // Only accuracy points, all identical.
        report.curve = vec![p(1.0, None, Some(0.5)), p(1.0, None, Some(0.5))];
        write(&tmp.0, &report).expect("write report");
        assert_png(&tmp.0.join(CURVES_PNG), plot::WIDTH, plot::HEIGHT);
    }

    #[test]
    fn write_reports_unwritable_directory() {
        let tmp = TempDir::new("blocked");
        fs::create_dir_all(&tmp.0).unwrap();
        let file = tmp.0.join("not-a-dir");
        fs::write(&file, b"x").unwrap();
        let err = write(&file.join("sub"), &synthetic_report()).unwrap_err();
        assert!(format!("{err:#}").contains("not-a-dir"), "{err:#}");
    }
}
