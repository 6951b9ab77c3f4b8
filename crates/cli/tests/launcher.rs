//! `elasticps train` end to end: the report it writes, and that it stops every node and
//! names the culprit when a node dies or the user presses Ctrl-C.

use std::process::{Child, Command};
use std::time::Duration;

use crate::common::{self, assert_all_gone, run_to_end, wait_for_children};

/// How long a `train` run to its end may take.
const TRAIN_LIMIT: Duration = Duration::from_secs(180);

/// `elasticps train --quiet ARGS...` (see [`common::bin_command`]).
fn train(args: &[&str]) -> Command {
    let mut cmd = common::bin_command(&["train", "--quiet"]);
    cmd.args(args);
    cmd
}

/// Waits at most `limit` for the launcher `child` to exit; its status and stderr.
fn wait_exit(child: &mut Child, limit: Duration) -> (std::process::ExitStatus, String) {
    let status = common::wait_timeout(child, limit).expect("train did not exit in time");
    (status, common::read_all(child.stderr.take()))
}

#[test]
fn train_writes_a_complete_report() {
    let dir = common::temp_dir("report");
    let dir_s = dir.display().to_string();
    let out = run_to_end(train(&["--iterations", "80", "--eval-every", "40", "--report", &dir_s]), TRAIN_LIMIT);
    assert!(out.status.success(), "train failed: {}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("test accuracy"), "{stdout}");

    let report = common::read_report(&dir);
    let acc = report["test_accuracy"].as_f64().expect("test_accuracy");
    assert!(acc > 0.6, "80 iterations of adam must learn something: {acc}");
    assert!(report["samples_per_sec"].as_f64().expect("samples_per_sec") > 0.0);
    assert!(report["wall_s"].as_f64().expect("wall_s") > 0.0);
    assert_eq!(report["iterations"], 80);
    assert_eq!(report["config"]["sync"], "bsp");
    // The MLP has 6 tensors, one block each, placed best fit: the 784x256 weights alone
    // on one server, the other 5 tensors on the other. Every worker pushes every block
    // once per iteration; worker 0 pulls once more for the final evaluation.
    let servers = report["servers"].as_array().expect("servers");
    assert_eq!(servers.len(), 2);
    let mut blocks: Vec<u64> = servers.iter().map(|s| s["blocks"].as_u64().expect("blocks")).collect();
    blocks.sort();
    assert_eq!(blocks, [1, 5]);
    for s in servers {
        let b = s["blocks"].as_u64().expect("blocks");
        assert_eq!(s["pushes"].as_u64(), Some(b * 2 * 80), "{s}");
        assert_eq!(s["pulls"].as_u64(), Some(b * (80 + 81)), "{s}");
        assert!(s["pulls_held"].as_u64().is_some() && s["hold_ms"].as_f64().is_some(), "{s}");
    }
    let total_bytes: u64 = servers.iter().map(|s| s["bytes"].as_u64().unwrap_or(0)).sum();
    assert_eq!(total_bytes, 4 * (784 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10));
    let workers = report["workers"].as_array().expect("workers");
    assert_eq!(workers.len(), 2);
    assert!(workers.iter().all(|w| w["iterations"] == 80 && w["wait_ms"].as_f64().is_some()));

    let summary = std::fs::read_to_string(dir.join("summary.md")).expect("summary.md");
    assert!(summary.contains("Test accuracy"));
    let png = std::fs::read(dir.join("curves.png")).expect("curves.png");
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert!(dir.join("logs/server-0.log").exists());
}

#[test]
fn a_dead_worker_stops_the_job_with_an_error_naming_it_and_leaves_no_orphans() {
    let mut child = train(&["--iterations", "1000000", "--eval-every", "0"]).spawn().expect("spawn train");
    let kids = wait_for_children(&child, 5);
    assert_eq!(kids.len(), 5, "scheduler, 2 servers, 2 workers: {kids:?}");
    // Let training start, then kill worker 1 as hard as possible.
    std::thread::sleep(Duration::from_millis(1500));
    let (victim, _) = kids.iter().rev().find(|(_, c)| c.contains(" worker ")).expect("a worker").clone();
    common::send_signal(victim, libc::SIGKILL);
    let (status, err) = wait_exit(&mut child, Duration::from_secs(30));
    assert!(!status.success());
    assert!(err.contains("worker 1 exited with signal: 9"), "the error must name the dead node: {err}");
    assert_all_gone(&kids);
}

#[test]
fn a_dead_worker_restarted_with_its_rank_rejoins_and_the_job_completes() {
    for sync in ["bsp", "ssp:2"] {
        let dir = common::temp_dir("restart");
        let dir_s = dir.display().to_string();
        // Long enough that the kill below lands while the job runs (400 iterations took
        // 1.3 s on a quiet machine: the worker had finished before it was killed).
        let args =
            ["--iterations", "3000", "--eval-every", "0", "--sync", sync, "--restart-workers", "1", "--report", &dir_s];
        let mut child = train(&args).spawn().expect("spawn train");
        let kids = wait_for_children(&child, 5);
        assert_eq!(kids.len(), 5, "scheduler, 2 servers, 2 workers: {kids:?}");
        std::thread::sleep(Duration::from_millis(1500));
        let (victim, _) = kids.iter().rev().find(|(_, c)| c.contains(" worker ")).expect("a worker").clone();
        common::send_signal(victim, libc::SIGKILL);
        let (status, err) = wait_exit(&mut child, Duration::from_secs(120));
        assert!(status.success(), "{sync}: the job must complete after the restart: {err}");
        assert!(err.contains("exited with signal: 9 (SIGKILL); restarting it as rank"), "{sync}: {err}");
        let report = common::read_report(&dir);
        let workers = report["workers"].as_array().expect("workers");
        assert_eq!(workers.len(), 2, "{sync}: both ranks reported their end: {workers:?}");
        let iterations: Vec<u64> = workers.iter().map(|w| w["iterations"].as_u64().unwrap_or(0)).collect();
        assert!(
            iterations.contains(&3000) && iterations.iter().any(|i| *i > 0 && *i < 3000),
            "{sync}: one rank ran all 3000 iterations, the restarted one the rest from where the job was: {iterations:?}"
        );
        assert!(report["test_accuracy"].as_f64().unwrap_or(0.0) > 0.6, "{sync}: the model learned: {report}");
        assert_all_gone(&kids);
    }
}

/// Issue 10, item 1: `train --servers 3 --replicas 2`, one server killed by hand mid-run:
/// the job finishes, the model learns as well as without the loss, a new server takes the
/// dead one's place, and report.json lists the loss, its detection and the failover.
#[test]
fn a_server_killed_in_train_with_two_replicas_fails_over_and_the_job_finishes() {
    let dir = common::temp_dir("failover");
    let dir_s = dir.display().to_string();
    let args = [
        "--servers",
        "3",
        "--replicas",
        "2",
        "--restart-servers",
        "1",
        "--iterations",
        "400",
        "--eval-every",
        "0",
        "--report",
        &dir_s,
    ];
    let mut child = train(&args).spawn().expect("spawn train");
    let kids = wait_for_children(&child, 6);
    assert_eq!(kids.len(), 6, "scheduler, 3 servers, 2 workers: {kids:?}");
    std::thread::sleep(Duration::from_millis(1500));
    let (victim, _) = kids.iter().find(|(_, c)| c.contains(" server ")).expect("a server").clone();
    common::send_signal(victim, libc::SIGKILL);
    let (status, err) = wait_exit(&mut child, Duration::from_secs(120));
    assert!(status.success(), "the job must finish after the failover: {err}");
    assert!(err.contains("its blocks fail over to their backups; starting server 3 in its place"), "{err}");
    let report = common::read_report(&dir);
    let workers = report["workers"].as_array().expect("workers");
    assert!(workers.iter().all(|w| w["iterations"].as_u64() == Some(400)), "every worker ran on: {workers:?}");
    assert!(report["test_accuracy"].as_f64().unwrap_or(0.0) > 0.6, "the model learned: {report}");
    let events: Vec<&str> = report["balance"]["scaling"]
        .as_array()
        .expect("scaling events")
        .iter()
        .filter_map(|e| e["action"].as_str())
        .collect();
    for want in ["server-lost", "failover", "copies-rebuilt", "joined"] {
        assert!(events.contains(&want), "report.json lists {want}: {events:?}");
    }
    assert_all_gone(&kids);
}

#[test]
fn ctrl_c_stops_every_node() {
    let mut child = train(&["--iterations", "1000000", "--eval-every", "0"]).spawn().expect("spawn train");
    let kids = wait_for_children(&child, 5);
    assert_eq!(kids.len(), 5, "{kids:?}");
    std::thread::sleep(Duration::from_millis(500));
    common::send_signal(child.id(), libc::SIGINT);
    let (status, err) = wait_exit(&mut child, Duration::from_secs(20));
    assert!(!status.success());
    assert!(err.contains("interrupted"), "{err}");
    assert_all_gone(&kids);
}

#[test]
fn missing_data_gets_an_error_that_says_how_to_get_it() {
    let out = run_to_end(train(&["--dataset", "mnist", "--data-dir", "/nonexistent/elasticps-data"]), TRAIN_LIMIT);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("MNIST not found at /nonexistent/elasticps-data"), "{err}");
    assert!(err.contains("scripts/fetch-data"), "{err}");
}

#[test]
fn a_wrong_flag_is_refused_before_anything_starts() {
    let out = run_to_end(train(&["--sync", "ssp:x"]), TRAIN_LIMIT);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("invalid sync policy") && err.contains("ssp:S"), "{err}");
    // Flags that only make sense together are checked before any process starts too.
    let out = run_to_end(train(&["--server-bandwidth", "5=20"]), TRAIN_LIMIT);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--server-bandwidth names server 5") && !err.contains("scheduler exited"), "{err}");
}
