//! Prometheus metrics of real processes: a scheduler, two servers and two workers, each
//! with `--metrics-listen 127.0.0.1:0`, scraped over HTTP while the workers train; and
//! `elasticps train --metrics` naming where to scrape every node.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{self, Proc, START_TIMEOUT};

const ITERATIONS: u32 = 400;
const METRICS: &[&str] = &["--metrics-listen", "127.0.0.1:0"];

/// One answer of a metrics endpoint.
struct Answer {
    status_line: String,
    head: String,
    body: String,
}

/// Sends `request` to `addr` and reads the whole answer (the endpoint closes), at most 10 s.
fn http(addr: &str, request: &str) -> Answer {
    let sock: SocketAddr = addr.parse().unwrap_or_else(|e| panic!("{addr}: {e}"));
    let mut s = TcpStream::connect_timeout(&sock, Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("connecting to the metrics endpoint {addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("read timeout");
    s.write_all(request.as_bytes()).unwrap_or_else(|e| panic!("sending to {addr}: {e}"));
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap_or_else(|e| panic!("reading the answer of {addr}: {e}"));
    let text = String::from_utf8(raw).unwrap_or_else(|e| panic!("{addr} answered non-UTF-8: {e}"));
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or_else(|| panic!("{addr}: no header end in {text:?}"));
    let status_line = head.lines().next().unwrap_or_default().to_string();
    Answer { status_line, head: head.to_string(), body: body.to_string() }
}

/// `GET /metrics` of `addr`: the exposition text (asserting 200, the content type and `# EOF`).
fn scrape(addr: &str) -> String {
    let a = http(addr, "GET /metrics HTTP/1.1\r\nHost: test\r\n\r\n");
    assert_eq!(a.status_line, "HTTP/1.1 200 OK", "{addr}:\n{}", a.head);
    assert!(
        a.head.contains("Content-Type: application/openmetrics-text; version=1.0.0; charset=utf-8"),
        "{addr}:\n{}",
        a.head
    );
    assert!(a.body.ends_with("# EOF\n"), "{addr}: exposition does not end with # EOF:\n{}", a.body);
    a.body
}

/// The value of the sample `series` (name with labels, exactly as exposed).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// Waits (at most [`START_TIMEOUT`]) for `p`'s metrics event; returns (node, addr).
fn metrics_event(p: &mut Proc) -> (String, String) {
    let Some(ev) = p.wait_event("metrics", START_TIMEOUT) else {
        panic!("{} printed no metrics event within {START_TIMEOUT:?}\n{}", p.name, p.log_tail(30));
    };
    let field = |k: &str| ev[k].as_str().unwrap_or_else(|| panic!("metrics event without {k}: {ev}")).to_string();
    (field("node"), field("addr"))
}

/// `elasticps scale move-block BLOCK TO`: true if the scheduler accepted the move.
fn move_block(sched_addr: &str, block: u32, to: u32) -> bool {
    let mut child = Command::new(common::BIN)
        .args(["scale", "--scheduler", sched_addr, "move-block", &block.to_string(), &to.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting elasticps scale");
    match common::wait_timeout(&mut child, Duration::from_secs(30)) {
        Some(status) => status.success(),
        None => {
            let _ = child.kill();
            let _ = child.wait();
            panic!("elasticps scale move-block did not exit within 30 s");
        }
    }
}

#[test]
fn every_node_serves_its_families_while_the_job_runs() {
    let mut sargs = vec!["--servers", "2", "--workers", "2", "--sync", "ssp:2", "--launcher", "none"];
    sargs.extend_from_slice(METRICS);
    let (mut sched, addr) = common::start_scheduler(&sargs);
    let (node, sched_metrics) = metrics_event(&mut sched);
    assert_eq!(node, "scheduler");

    let mut servers: Vec<Proc> = (0..2).map(|_| common::start_server(&addr, METRICS)).collect();
    let mut server_metrics: Vec<(String, String)> = servers.iter_mut().map(metrics_event).collect();
    server_metrics.sort();
    let names: Vec<&str> = server_metrics.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["server 0", "server 1"], "each server names its own id");

    let iterations = ITERATIONS.to_string();
    let mut wargs = vec!["--model", "synthetic:resnet56", "--compute-ms", "10", "--iterations", &iterations];
    wargs.extend_from_slice(METRICS);
    let mut workers: Vec<Proc> = (0..2).map(|_| common::start_worker(&addr, &wargs)).collect();
    let mut worker_metrics: Vec<(String, String)> = workers.iter_mut().map(metrics_event).collect();
    worker_metrics.sort();
    assert_eq!(worker_metrics[0].0, "worker 0");
    assert_eq!(worker_metrics[1].0, "worker 1");

    // Scrape every server until each has applied pushes, and a worker until it counted
    // iterations and waits on both servers: bounded in time and count.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last_pushes = [0.0f64; 2];
    let mut scrapes = 0;
    let worker_text = loop {
        scrapes += 1;
        for (i, (_, a)) in server_metrics.iter().enumerate() {
            last_pushes[i] = sample(&scrape(a), "elasticps_server_pushes_total").unwrap_or(0.0);
        }
        let t = scrape(&worker_metrics[0].1);
        let worker_ready = sample(&t, "elasticps_worker_iterations_total").unwrap_or(0.0) >= 2.0
            && sample(&t, r#"elasticps_worker_wait_seconds_total{server="1"}"#).is_some();
        if last_pushes.iter().all(|p| *p > 0.0) && worker_ready {
            break t;
        }
        assert!(
            Instant::now() < deadline && scrapes < 1200,
            "servers never showed pushes ({last_pushes:?}) or the worker its rounds after {scrapes} scrapes:\n{t}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    // This was during the run: the worker is still training.
    let done = sample(&worker_text, "elasticps_worker_iterations_total").expect("iterations");
    assert!(done < f64::from(ITERATIONS), "scraped after the run: {done} iterations");
    assert!(workers.iter_mut().all(|w| w.try_exit().is_none()), "a worker exited before the scrape");
    eprintln!("during the run, after {scrapes} scrapes: pushes {last_pushes:?}, worker 0 at iteration {done}");

    for (node, a) in &server_metrics {
        let t = scrape(a);
        let id = node.trim_start_matches("server ");
        assert!(t.contains(&format!(r#"elasticps_server_info{{server="{id}",sync="ssp:2"}} 1"#)), "{node}:\n{t}");
        assert_eq!(sample(&t, "elasticps_server_staleness_bound"), Some(2.0), "{node}:\n{t}");
        assert!(sample(&t, "elasticps_server_blocks").unwrap_or(0.0) >= 1.0, "{node}:\n{t}");
        assert!(sample(&t, "elasticps_server_received_bytes_total").unwrap_or(0.0) > 0.0, "{node}:\n{t}");
        for family in [
            "# TYPE elasticps_server_pulls counter",
            "# TYPE elasticps_server_sent_bytes counter",
            "# TYPE elasticps_server_pulls_held counter",
            "# TYPE elasticps_server_pull_hold_seconds histogram",
            "# TYPE elasticps_server_migrations_in counter",
            "# TYPE elasticps_server_migrations_out counter",
            "elasticps_server_pull_hold_seconds_bucket{le=\"+Inf\"}",
        ] {
            assert!(t.contains(family), "{node} lacks {family:?}:\n{t}");
        }
    }
    for family in [
        "# TYPE elasticps_worker_iterations counter",
        "# TYPE elasticps_worker_iteration_seconds histogram",
        "# TYPE elasticps_worker_wait_seconds counter",
        r#"elasticps_worker_wait_seconds_total{server="0"}"#,
        r#"elasticps_worker_info{rank="0"} 1"#,
    ] {
        assert!(worker_text.contains(family), "worker 0 lacks {family:?}:\n{worker_text}");
    }

    // The scheduler sets its families on its timeouts (every second while training
    // runs, the balancer's round): both servers serving, the placement's first epoch,
    // both workers running.
    let deadline = Instant::now() + Duration::from_secs(10);
    let sched_text = loop {
        let t = scrape(&sched_metrics);
        if sample(&t, r#"elasticps_scheduler_servers{state="serving"}"#) == Some(2.0) {
            break t;
        }
        assert!(Instant::now() < deadline, "the scheduler never showed 2 serving servers:\n{t}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(sample(&sched_text, "elasticps_scheduler_placement_epoch"), Some(1.0), "{sched_text}");
    assert_eq!(sample(&sched_text, "elasticps_scheduler_stragglers"), Some(0.0), "{sched_text}");
    for family in [
        "# TYPE elasticps_scheduler_servers gauge",
        "# TYPE elasticps_scheduler_scaling_events counter",
        r#"elasticps_scheduler_scaling_events_total{action="scale-out"} 0"#,
        "# TYPE elasticps_scheduler_migrations counter",
    ] {
        assert!(sched_text.contains(family), "scheduler lacks {family:?}:\n{sched_text}");
    }

    // An operator moves block 0 to the other server: the old owner counts a migration
    // out, the new one a migration in, the scheduler a migration and a new epoch.
    let moved_to = (0..2u32)
        .find(|to| move_block(&addr, 0, *to))
        .unwrap_or_else(|| panic!("the scheduler refused to move block 0 anywhere"));
    let (from_m, to_m) = (&server_metrics[1 - moved_to as usize].1, &server_metrics[moved_to as usize].1);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (from_t, to_t, sched_t) = (scrape(from_m), scrape(to_m), scrape(&sched_metrics));
        let done = sample(&from_t, "elasticps_server_migrations_out_total") == Some(1.0)
            && sample(&to_t, "elasticps_server_migrations_in_total") == Some(1.0)
            && sample(&sched_t, "elasticps_scheduler_migrations_total") == Some(1.0)
            && sample(&sched_t, "elasticps_scheduler_placement_epoch") == Some(2.0);
        if done {
            assert_eq!(sample(&from_t, "elasticps_server_migrations_in_total"), Some(0.0), "{from_t}");
            assert_eq!(sample(&to_t, "elasticps_server_migrations_out_total"), Some(0.0), "{to_t}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the move of block 0 to server {moved_to} never showed:\n{from_t}\n{to_t}\n{sched_t}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // A live node refuses other paths and garbage, and keeps serving.
    let a = http(&server_metrics[0].1, "GET /debug HTTP/1.1\r\n\r\n");
    assert_eq!(a.status_line, "HTTP/1.1 404 Not Found");
    let a = http(&server_metrics[0].1, "\u{1}\u{2} nonsense\r\n\r\n");
    assert_eq!(a.status_line, "HTTP/1.1 400 Bad Request");

    for w in &mut workers {
        w.assert_success(Duration::from_secs(120));
    }
    sched.assert_success(common::EXIT_TIMEOUT);
    for s in &mut servers {
        s.assert_success(common::EXIT_TIMEOUT);
        let stats = s.server_stats();
        let id = stats["server_id"].as_u64().expect("server_id") as usize;
        let final_pushes = stats["totals"]["pushes"].as_f64().expect("pushes");
        let scraped = server_metrics
            .iter()
            .position(|(n, _)| *n == format!("server {id}"))
            .map(|j| last_pushes[j])
            .unwrap_or_else(|| panic!("server {id} was not scraped"));
        assert!(scraped <= final_pushes, "server {id}: scraped {scraped} pushes, final count {final_pushes}");
    }
}

#[test]
fn train_with_metrics_prints_where_to_scrape_every_node() {
    let args = ["train", "--quiet", "--metrics", "--model", "synthetic:resnet56", "--compute-ms", "1"];
    let (status, out, err) = common::run_bin(&[&args[..], &["--iterations", "20"]].concat(), Duration::from_secs(120));
    assert!(status.success(), "train failed ({status:?}):\n{out}\n{err}");
    let line = out.lines().find(|l| l.starts_with("metrics: ")).unwrap_or_else(|| panic!("no metrics line:\n{out}"));
    let nodes: Vec<&str> = line["metrics: ".len()..].split(", ").collect();
    let names: Vec<String> =
        nodes.iter().map(|n| n.rsplit_once(' ').map_or("", |(name, _)| name).to_string()).collect();
    assert_eq!(names, ["scheduler", "server 0", "server 1", "worker 0", "worker 1"], "{line}");
    for n in nodes {
        let url = n.rsplit_once(' ').map_or("", |(_, u)| u);
        let addr = url.strip_prefix("http://").and_then(|u| u.strip_suffix("/metrics"));
        let port = addr.and_then(|a| a.strip_prefix("127.0.0.1:")).and_then(|p| p.parse::<u16>().ok());
        assert!(port.is_some_and(|p| p > 0), "not a scrape URL with a bound port: {n:?} in {line}");
    }
}
