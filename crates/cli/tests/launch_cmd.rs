//! `elasticps launch -- CMD` end to end: the user's command as the workers (here the
//! binary's own `worker` role, or small shell scripts that misbehave), their events on
//! fd 3, their output forwarded with a `[worker i]` prefix, the report, and that a dead
//! worker or Ctrl-C stops every process, including what a script started itself.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::common::{self, BIN, alive, assert_all_gone, run_to_end, wait_for_children};

/// `elasticps launch --quiet ARGS...` with stdout and stderr piped and no `ELASTICPS_*`
/// variable of the test environment.
fn launch(args: &[&str]) -> Command {
    let mut cmd = common::bin_command(&["launch", "--quiet"]);
    cmd.args(args);
    cmd
}

/// Writes an executable shell script into `dir`.
fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).expect("writing a script");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    path
}

/// A launcher whose stdout lines are read on a thread (so the test can watch them while
/// it runs).
struct Running {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Running {
    fn start(mut cmd: Command) -> Self {
        let mut child = cmd.spawn().expect("starting elasticps launch");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self { child, lines, seen: Vec::new() }
    }

    /// The first stdout line that starts with `prefix`, waiting at most 30 s.
    fn wait_line(&mut self, prefix: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        if let Some(l) = self.seen.iter().find(|l| l.starts_with(prefix)) {
            return l.clone();
        }
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.starts_with(prefix) {
                        return line;
                    }
                }
                Err(_) => break,
            }
        }
        panic!("no line starting with {prefix:?} within 30 s; stdout so far:\n{}", self.seen.join("\n"));
    }

    /// Waits at most `limit` for the launcher to exit; returns its status and stderr.
    fn wait(&mut self, limit: Duration) -> (ExitStatus, String) {
        let status = common::wait_timeout(&mut self.child, limit);
        let err = common::read_all(self.child.stderr.take());
        let Some(status) = status else {
            let _ = self.child.kill();
            panic!("elasticps launch did not exit within {limit:?}\nstderr:\n{err}");
        };
        (status, err)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The pid printed by a script as `[worker I] child PID`.
fn child_pid(line: &str) -> u32 {
    line.rsplit(' ').next().and_then(|p| p.parse().ok()).unwrap_or_else(|| panic!("no pid in {line:?}"))
}

#[test]
fn launch_runs_the_worker_role_as_the_command_and_reports_both_workers() {
    let dir = common::temp_dir("launch-report");
    let dir_s = dir.display().to_string();
    let args = ["--workers", "2", "--report", &dir_s, "--", BIN, "worker", "--iterations", "30", "--eval-every", "0"];
    let out = run_to_end(launch(&args), Duration::from_secs(120));
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "launch failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("test accuracy") && stdout.contains("after 30 steps per worker"), "{stdout}");
    // launch's default under bsp is DDP's arithmetic: the scheduler got --aggregate.
    assert!(stdout.contains("2 servers, 2 workers, bsp --aggregate: "), "{stdout}");
    assert!(!stdout.contains("sent no final report"), "{stdout}");
    // The worker role's log lines (stderr) are forwarded, prefixed with the spawn index.
    for i in 0..2 {
        assert!(stderr.contains(&format!("[worker {i}] ")), "{stderr}");
    }

    let report = common::read_report(&dir);
    let workers = report["workers"].as_array().expect("workers");
    let mut ranks: Vec<u64> = workers.iter().map(|w| w["rank"].as_u64().expect("rank")).collect();
    ranks.sort();
    assert_eq!(ranks, [0, 1], "{workers:?}");
    assert!(workers.iter().all(|w| w["iterations"] == 30 && w["samples"] == 30 * 32), "{workers:?}");
    assert!(report["test_accuracy"].as_f64().is_some_and(|a| a > 0.3), "{}", report["test_accuracy"]);
    assert_eq!(report["config"]["command"], format!("{BIN} worker --iterations 30 --eval-every 0"));
    assert_eq!(report["config"]["workers"], 2);
    assert_eq!(report["config"]["aggregate"], true, "launch aggregates under bsp by default");
    // Both workers' pushes reached both servers: 2 pushes of every block per iteration.
    let servers = report["servers"].as_array().expect("servers");
    assert_eq!(servers.len(), 2);
    for s in servers {
        assert_eq!(s["pushes"].as_u64(), Some(s["blocks"].as_u64().expect("blocks") * 2 * 30), "{s}");
    }
    assert!(dir.join("summary.md").exists() && dir.join("curves.png").exists());
    let log = std::fs::read_to_string(dir.join("logs/worker-1.log")).expect("worker 1's log");
    assert!(log.contains("training starts"), "{log}");
}

#[test]
fn a_script_gets_the_environment_its_output_is_prefixed_and_its_logged_metrics_reach_the_report() {
    let dir = common::temp_dir("launch-log");
    // Each worker says hello on stdout, logs metrics on fd 3 with its spawn index as the
    // rank, then becomes a real worker (a small synthetic model).
    let body = format!(
        r#"echo "hello from $ELASTICPS_LOCAL_RANK: workers=$ELASTICPS_WORKERS fd=$ELASTICPS_EVENTS_FD frame=$ELASTICPS_MAX_FRAME_MIB timeout=$ELASTICPS_REQUEST_TIMEOUT jitter=$ELASTICPS_WORKER_JITTER"
echo "oops on stderr" >&2
acc=0.25; [ "$ELASTICPS_LOCAL_RANK" = 0 ] && acc=0.75
echo '{{"event":"log","rank":'$ELASTICPS_LOCAL_RANK',"step":3,"metrics":{{"loss":0.5,"accuracy":'$acc',"total":10,"samples":99,"lr":null}}}}' >&3
exec {BIN} worker --model synthetic:resnet56 --compute-ms 1 --iterations 10"#
    );
    let worker = script(&dir, "worker.sh", &body);
    let report_dir = dir.join("report");
    let (w, r) = (worker.display().to_string(), report_dir.display().to_string());
    let out = run_to_end(
        launch(&["--workers", "2", "--request-timeout-s", "77", "--worker-jitter", "1:20", "--report", &r, "--", &w]),
        Duration::from_secs(120),
    );
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "launch failed:\n{stdout}\n{stderr}");
    for i in 0..2 {
        let hello = format!("[worker {i}] hello from {i}: workers=2 fd=3 frame=64 timeout=77 jitter=1:20");
        assert!(stdout.lines().any(|l| l == hello), "missing {hello:?} in:\n{stdout}");
        assert!(stderr.lines().any(|l| l == format!("[worker {i}] oops on stderr")), "{stderr}");
    }
    // The headline accuracy is rank 0's, whichever rank logged last.
    assert!(stdout.contains("test accuracy 75.00% after 10 steps per worker"), "{stdout}");

    let report = common::read_report(&report_dir);
    assert_eq!(report["test_accuracy"].as_f64(), Some(0.75));
    assert_eq!(report["workers"].as_array().map(Vec::len), Some(2));
    assert_eq!(report["config"]["worker_jitter"], "1:20");
    // --worker-jitter 1:20 reached the worker role: every iteration slept its 20 ms (a
    // sleep never ends early) on top of the 1 ms of compute.
    for w in report["workers"].as_array().expect("workers") {
        let iter_ms: Vec<f64> = w["iter_ms"].as_array().expect("iter_ms").iter().filter_map(|v| v.as_f64()).collect();
        assert_eq!(iter_ms.len(), 10, "{w}");
        assert!(iter_ms.iter().all(|ms| *ms >= 20.0), "an iteration shorter than its 20 ms delay: {iter_ms:?}");
    }
    let logged: Vec<&serde_json::Value> = report["curve"]
        .as_array()
        .expect("curve")
        .iter()
        .filter(|p| p["iteration"] == 3 && p["metrics"].is_object())
        .collect();
    assert_eq!(logged.len(), 2, "one logged point per worker: {logged:?}");
    for p in logged {
        assert_eq!(p["loss"].as_f64(), Some(0.5), "{p}");
        // Keys the launcher reads itself are not repeated; the others are kept (a NaN as null).
        assert_eq!(p["metrics"], serde_json::json!({"samples": 99.0, "lr": null}), "{p}");
    }
    let log = std::fs::read_to_string(report_dir.join("logs/worker-0.log")).expect("worker 0's log");
    assert!(log.contains("hello from 0") && log.contains("oops on stderr"), "{log}");
}

#[test]
fn a_worker_that_exits_3_ends_the_job_at_once_naming_it_and_leaves_no_process_behind() {
    let dir = common::temp_dir("launch-exit3");
    // Worker 1 starts a child of its own, then fails; worker 0 trains for ever.
    let body = format!(
        r#"if [ "$ELASTICPS_LOCAL_RANK" = 1 ]; then
  sleep 300 &
  echo "self $$"
  echo "child $!"
  sleep 2
  echo "giving up" >&2
  exit 3
fi
exec {BIN} worker --iterations 1000000 --eval-every 0"#
    );
    let worker = script(&dir, "worker.sh", &body).display().to_string();
    let started = Instant::now();
    let mut job = Running::start(launch(&["--", &worker]));
    let kids = wait_for_children(&job.child, 5);
    assert_eq!(kids.len(), 5, "scheduler, 2 servers, 2 workers: {kids:?}");
    let grandchild = child_pid(&job.wait_line("[worker 1] child "));
    assert!(alive(grandchild), "the script's own child runs");
    let worker1 = child_pid(&job.wait_line("[worker 1] self "));
    let (status, err) = job.wait(Duration::from_secs(30));
    let took = started.elapsed();
    assert!(!status.success());
    assert!(kids.iter().any(|(p, _)| *p == worker1), "worker 1 is a child of the launcher: {kids:?}");
    let named = format!("worker 1 (pid {worker1}: {worker}) exited with status 3");
    assert!(err.contains(&named), "the error must name the worker, its pid, command and status: {err}");
    assert!(err.contains("giving up"), "the error shows the tail of its log: {err}");
    assert!(took < Duration::from_secs(15), "the job must end at once, took {took:?}");
    let mut all = kids.clone();
    all.push((grandchild, "sleep 300 (the script's child)".into()));
    assert_all_gone(&all);
}

#[test]
fn ctrl_c_stops_every_process_including_a_scripts_children() {
    let dir = common::temp_dir("launch-sigint");
    let worker = script(&dir, "worker.sh", "sleep 300 &\necho \"child $!\"\nwait").display().to_string();
    let mut job = Running::start(launch(&["--workers", "2", "--", &worker]));
    let kids = wait_for_children(&job.child, 5);
    assert_eq!(kids.len(), 5, "{kids:?}");
    let mut all = kids.clone();
    for i in 0..2 {
        let pid = child_pid(&job.wait_line(&format!("[worker {i}] child ")));
        all.push((pid, format!("worker {i}'s sleep")));
    }
    common::send_signal(job.child.id(), libc::SIGINT);
    let (status, err) = job.wait(Duration::from_secs(20));
    assert!(!status.success());
    assert!(err.contains("interrupted: every node was stopped"), "{err}");
    assert_all_gone(&all);
}

#[test]
fn a_command_that_cannot_start_is_a_clear_error_before_any_process_starts() {
    let started = Instant::now();
    let out = run_to_end(launch(&["--", "/nonexistent/elasticps-train.py", "--lr", "1"]), Duration::from_secs(20));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("cannot start the worker command `/nonexistent/elasticps-train.py --lr 1`")
            && err.contains("is not an executable file"),
        "{err}"
    );
    let out = run_to_end(launch(&["--", "elasticps-no-such-program"]), Duration::from_secs(20));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("elasticps-no-such-program: command not found on PATH"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(5), "nothing was started, so nothing to wait for");

    // No command at all is a usage error.
    let out = run_to_end(launch(&["--workers", "2"]), Duration::from_secs(20));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("required") && err.contains("<CMD>"), "{err}");
}

/// Issue 35 (secure by default): a launch across hosts without a cluster secret refuses to
/// start, saying what to set, before it dials or listens anywhere.
#[test]
fn a_launch_across_hosts_without_a_secret_refuses_to_start_saying_what_to_set() {
    let started = Instant::now();
    let out =
        run_to_end(launch(&["--nnodes", "2", "--rdzv", "127.0.0.1:29499", "--", "true"]), Duration::from_secs(20));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("a job across hosts needs a cluster secret") && err.contains("ELASTICPS_SECRET"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(5), "refused before any wait: {:?}", started.elapsed());
}

/// Issue 35 (secure by default): a launched script holds a worker secret of its own and
/// never the cluster secret, whether the user gave a cluster secret or none, and trains
/// with it. (A worker-secret connection cannot be a server: `trust.rs`.)
#[test]
fn a_launched_script_holds_a_worker_secret_of_its_own_and_never_the_cluster_secret() {
    let dir = common::temp_dir("launch-secrets");
    let body = format!(
        "echo \"cluster=[$ELASTICPS_SECRET] worker=[$ELASTICPS_WORKER_SECRET]\"\nexec {BIN} worker --iterations 5 --eval-every 0"
    );
    let worker = script(&dir, "worker.sh", &body).display().to_string();
    let derived = elasticps_wire::credential::derived_worker_secret(b"the-cluster-s3cret");
    for given in [true, false] {
        let mut args = vec!["--workers", "1", "--servers", "1"];
        if given {
            args.extend(["--secret", "the-cluster-s3cret"]);
        }
        args.extend(["--", &worker]);
        let mut cmd = common::bin_command(&["launch"]);
        cmd.args(&args);
        let out = run_to_end(cmd, Duration::from_secs(60));
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "given {given}: the script trains with its worker secret:\n{stdout}\n{stderr}");
        assert!(stdout.contains("after 5 steps per worker"), "{stdout}");
        let line = stdout.lines().find(|l| l.contains("cluster=[")).unwrap_or_else(|| panic!("{stdout}"));
        assert!(line.contains("cluster=[]"), "given {given}: the script saw a cluster secret: {line}");
        let ws = line.split("worker=[").nth(1).and_then(|r| r.strip_suffix(']')).unwrap_or_else(|| panic!("{line}"));
        assert_eq!(ws.len(), 64, "a worker secret of its own: {line}");
        assert_eq!(ws == derived, given, "derived from the given cluster secret, else from a drawn one: {line}");
        assert_eq!(
            stdout.contains("note: no --secret given"),
            !given,
            "the note says how to reach the job with operator tools:\n{stdout}"
        );
    }
}

/// Accepts one connection on `listener` within 30 s and runs the acceptor's side of the
/// handshake with `secret` (a scheduler's, as the agent's rendezvous expects).
fn accept_as_scheduler(listener: &std::net::TcpListener, secret: &[u8]) -> std::net::TcpStream {
    use elasticps_wire::handshake::{HELLO_LEN, NONCE_LEN, PROOF_LEN, ServerHandshake};
    use std::io::{Read, Write};
    listener.set_nonblocking(true).expect("nonblocking listener");
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut s = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => panic!("the agent did not dial the rendezvous within 30 s: {e}"),
        }
    };
    s.set_nonblocking(false).expect("blocking stream");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("read timeout");
    let mut hello = [0u8; HELLO_LEN];
    s.read_exact(&mut hello).expect("the agent's hello");
    let (server, reply) = ServerHandshake::new(secret, [7u8; NONCE_LEN]).on_hello(&hello).expect("a valid hello");
    s.write_all(&reply).expect("our hello");
    let mut proof = [0u8; PROOF_LEN];
    s.read_exact(&mut proof).expect("the agent's proof");
    let (verdict, accepted) = server.on_proof(&proof);
    s.write_all(&verdict).expect("the verdict");
    accepted.expect("the agent proved the cluster secret");
    s
}

/// Issue 35: a host agent starts at most the slots it offered, one process per slot,
/// whatever it is told. A hand-written scheduler (the cluster secret's holder) welcomes
/// an agent that offered 1 server and 1 worker slot and sends it 16 `StartNode` orders:
/// 2 processes start, and each order past the slots is reported `NodeExited { ok: false }`
/// naming the bound.
#[test]
fn sixteen_start_orders_to_a_two_slot_agent_start_two_processes() {
    use elasticps_wire::{Codec, Control, DEFAULT_MAX_PAYLOAD, Message, NodeRole};
    const SECRET: &str = "agent-s3cret";
    let codec = Codec::new(SECRET.as_bytes(), DEFAULT_MAX_PAYLOAD);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    let rdzv = listener.local_addr().expect("its address").to_string();
    let mut cmd = common::bin_command(&["launch", "--quiet"]);
    cmd.args(["--nnodes", "2", "--rdzv", &rdzv, "--advertise", "127.0.0.2", "--secret", SECRET]);
    cmd.args(["--servers-per-node", "1", "--workers-per-node", "1", "--server-slots", "1", "--worker-slots", "1"]);
    cmd.args(["--join-timeout-s", "60", "--", "sleep", "30"]);
    let mut job = Running::start(cmd);
    let mut s = accept_as_scheduler(&listener, SECRET.as_bytes());
    let (h, join) = match common::read_reply(&mut s, &codec, Duration::from_secs(10)) {
        common::Reply::Frame(h, Message::Control(Control::JoinHost(offer))) => (h, offer),
        other => panic!("expected the agent's JoinHost, got {other:?}"),
    };
    assert_eq!((join.server_slots, join.worker_slots), (1, 1), "{join:?}");
    common::write_frame(&mut s, &codec, h.request_id, &Control::HostWelcome { host: 1 }.into()).expect("welcome");
    for slot in 0..16u32 {
        let role = if slot % 2 == 0 { NodeRole::Server } else { NodeRole::Worker { rank: Some(slot) } };
        let order = Control::StartNode { slot, role, workers: 2 };
        common::write_frame(&mut s, &codec, 0, &order.into()).expect("an order");
    }
    // Each order past the slots comes back refused, naming the bound.
    let mut refused = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while refused.len() < 14 && Instant::now() < deadline {
        match common::read_reply(&mut s, &codec, Duration::from_millis(500)) {
            common::Reply::Frame(_, Message::Control(Control::NodeExited { slot, ok: false, status, .. })) => {
                assert!(status.contains("this host offered 1"), "slot {slot}: {status}");
                refused.push(slot);
            }
            common::Reply::Frame(..) | common::Reply::TimedOut => {}
            other => panic!("the agent's connection ended: {other:?}"),
        }
    }
    refused.sort();
    assert_eq!(refused, (2..16).collect::<Vec<u32>>(), "the first server and worker orders take the two slots");
    // One process per slot: the server and the worker, nothing more.
    std::thread::sleep(Duration::from_millis(500));
    let kids = common::children(job.child.id());
    let (sleeps, servers) = (
        kids.iter().filter(|(_, c)| c.starts_with("sleep")).count(),
        kids.iter().filter(|(_, c)| c.contains(" server")).count(),
    );
    assert_eq!((servers, sleeps), (1, 1), "processes the agent started: {kids:?}");
    drop(s);
    common::send_signal(job.child.id(), libc::SIGINT);
    let pids = kids.clone();
    let (status, _) = job.wait(Duration::from_secs(30));
    assert!(!status.success(), "the scheduler went away: the host's launch fails");
    assert_all_gone(&pids);
}

#[test]
fn workers_that_exit_without_joining_end_the_launch_after_the_end_timeout() {
    let dir = common::temp_dir("launch-nojoin");
    let worker = script(&dir, "worker.sh", "echo \"not joining\"").display().to_string();
    let started = Instant::now();
    let mut job = Running::start(launch(&["--end-timeout-s", "2", "--", &worker]));
    let kids = wait_for_children(&job.child, 3);
    assert!(kids.len() >= 3, "the scheduler and 2 servers at least: {kids:?}");
    job.wait_line("[worker 1] not joining");
    let (status, err) = job.wait(Duration::from_secs(30));
    assert!(!status.success());
    assert!(
        err.contains(
            "every worker exited, but the job did not end within 2 s (still running: scheduler, server 0, server 1)"
        ),
        "{err}"
    );
    assert!(started.elapsed() < Duration::from_secs(20), "bounded by --end-timeout-s: {:?}", started.elapsed());
    assert_all_gone(&kids);
}

#[test]
fn a_worker_killed_by_a_signal_is_named_with_the_signal() {
    let dir = common::temp_dir("launch-kill9");
    let body = format!(
        r#"if [ "$ELASTICPS_LOCAL_RANK" = 0 ]; then
  echo "self $$"
  sleep 1
  kill -9 $$
fi
exec {BIN} worker --iterations 1000000 --eval-every 0"#
    );
    let worker = script(&dir, "worker.sh", &body).display().to_string();
    let mut job = Running::start(launch(&["--", &worker]));
    let kids = wait_for_children(&job.child, 5);
    let victim = child_pid(&job.wait_line("[worker 0] self "));
    let (status, err) = job.wait(Duration::from_secs(30));
    assert!(!status.success());
    let named = format!("worker 0 (pid {victim}: {worker}) was killed by signal 9");
    assert!(err.contains(&named), "{err}");
    assert_all_gone(&kids);
}

#[test]
fn a_job_without_a_report_removes_its_logs_if_it_succeeds_and_keeps_them_saying_where_if_it_fails() {
    let dir = common::temp_dir("launch-logs");
    let tmp = dir.join("tmp");
    std::fs::create_dir_all(&tmp).expect("creating TMPDIR");
    let left =
        || -> Vec<PathBuf> { std::fs::read_dir(&tmp).expect("TMPDIR").map(|e| e.expect("entry").path()).collect() };

    let mut ok =
        launch(&["--", BIN, "worker", "--model", "synthetic:resnet56", "--compute-ms", "1", "--iterations", "5"]);
    ok.env("TMPDIR", &tmp);
    let out = run_to_end(ok, Duration::from_secs(120));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "launch failed:\n{err}");
    assert_eq!(left(), Vec::<PathBuf>::new(), "a job that succeeded leaves no logs behind");

    let worker = script(&dir, "fails.sh", "echo 'giving up' >&2\nexit 3").display().to_string();
    let mut failed = launch(&["--", &worker]);
    failed.env("TMPDIR", &tmp);
    let out = run_to_end(failed, Duration::from_secs(60));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    let kept = left();
    assert_eq!(kept.len(), 1, "the failed job's log directory: {kept:?}");
    assert!(err.contains(&format!("every node's log is kept in {}", kept[0].display())), "{err}");
    // Both workers fail: whichever exits first fails the job (the other may be killed
    // before it writes a line), and its log is kept.
    let logs: Vec<String> =
        ["worker-0.log", "worker-1.log"].iter().filter_map(|f| std::fs::read_to_string(kept[0].join(f)).ok()).collect();
    assert!(logs.iter().any(|log| log.contains("giving up")), "{logs:?}");
}
