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
//!   servers, final training loss),
//! * the training curve: timestamped [`CurvePoint`]s carrying a worker's
//!   training loss and/or a test-accuracy measurement.
//!
//! [`write`] turns a report into three files in the report directory:
//!
//! | file          | content                                                    |
//! |---------------|------------------------------------------------------------|
//! | `report.json` | the [`Report`] itself, pretty-printed JSON (machine-readable; deserialize it back into [`Report`]) |
//! | `summary.md`  | human-readable Markdown: headline numbers, configuration, a servers table and a workers table ([`summary`]) |
//! | `curves.png`  | two panels: training loss vs time per worker, test accuracy vs time ([`plot`]) |
//!
//! Non-finite floating-point values (a diverged run's `NaN` loss, say) are
//! written by `serde_json` as `null`; the plain `f64` fields read `null` back
//! as `NaN` so such a `report.json` still loads, while `CurvePoint`'s optional
//! fields read it back as `None`.

pub mod plot;
pub mod summary;
pub mod table;

use std::fs;
use std::path::Path;

use anyhow::Context;
use serde::{Deserialize, Deserializer, Serialize};

/// File name of the machine-readable report inside the report directory.
pub const REPORT_JSON: &str = "report.json";
/// File name of the Markdown summary inside the report directory.
pub const SUMMARY_MD: &str = "summary.md";
/// File name of the training-curve plot inside the report directory.
pub const CURVES_PNG: &str = "curves.png";

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

/// Statistics of one worker over the run.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct WorkerReport {
    /// Worker rank.
    pub rank: u32,
    /// Training iterations the worker completed.
    pub iterations: u64,
    /// Examples processed.
    #[serde(default)]
    pub samples: u64,
    /// Total time spent waiting on parameter servers (push and pull), in milliseconds.
    #[serde(deserialize_with = "f64_or_nan")]
    pub wait_ms: f64,
    /// Training loss at the worker's last iteration.
    #[serde(deserialize_with = "f64_or_nan")]
    pub final_loss: f64,
    /// Seconds from the first pull to the last push.
    #[serde(default, deserialize_with = "f64_or_nan")]
    pub train_s: f64,
    /// Mean iteration time (compute + communication), ms.
    #[serde(default, deserialize_with = "f64_or_nan")]
    pub iter_ms_mean: f64,
    /// 99th percentile of the iteration time (upper bound of its log2 bucket), ms.
    #[serde(default, deserialize_with = "f64_or_nan")]
    pub iter_ms_p99: f64,
    /// Mean communication time per iteration (the overlapped push + pull), ms.
    #[serde(default, deserialize_with = "f64_or_nan")]
    pub comm_ms_per_iter: f64,
    /// Total time each server took to answer this worker's rounds, ms, by server id.
    #[serde(default)]
    pub wait_ms_by_server: Vec<f64>,
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
}

/// Writes `report.json`, `summary.md` and `curves.png` for `report` into
/// `dir`, creating the directory (and its parents) if needed. Existing files
/// of those names are overwritten.
pub fn write(dir: &Path, report: &Report) -> anyhow::Result<()> {
    fs::create_dir_all(dir).with_context(|| format!("creating report directory {}", dir.display()))?;

    let json_path = dir.join(REPORT_JSON);
    let json = serde_json::to_string_pretty(report).context("serializing report to JSON")?;
    fs::write(&json_path, json + "\n").with_context(|| format!("writing {}", json_path.display()))?;

    let md_path = dir.join(SUMMARY_MD);
    fs::write(&md_path, summary::render(report)).with_context(|| format!("writing {}", md_path.display()))?;

    let png_path = dir.join(CURVES_PNG);
    plot::draw_curves(&png_path, &report.curve).with_context(|| format!("drawing {}", png_path.display()))?;
    Ok(())
}

/// Deserializes an `f64` that `serde_json` may have written as `null` (it
/// does so for `NaN` and infinities); `null` becomes `NaN`.
fn f64_or_nan<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
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
                curve.push(CurvePoint { t_s, iteration: it, rank, loss: Some(base + noise), test_accuracy });
            }
        }
        curve.push(CurvePoint { t_s: 12.4, iteration: iters, rank: 0, loss: None, test_accuracy: Some(0.9712) });
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
