//! `elasticps train`: the main job. Starts a whole local cluster (scheduler, servers,
//! workers as separate processes on 127.0.0.1), shows progress, prints a summary and
//! writes the report.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Args;
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::args::{DataArgs, JobArgs, NetArgs};
use crate::events::Event;
use crate::launch::{Cluster, NodeEvent};
use crate::report::{CurvePoint, Report, ServerReport, WorkerReport};
use elasticps_runtime::scheduler::BalanceLog;
use elasticps_train::synthetic::ModelKind;

/// `elasticps train`.
#[derive(Args, Clone, Debug)]
pub struct TrainCmd {
    /// The job (servers, workers, sync, optimizer, placement...).
    #[command(flatten)]
    pub job: JobArgs,
    /// Data and schedule.
    #[command(flatten)]
    pub data: DataArgs,
    /// Transport settings.
    #[command(flatten)]
    pub net: NetArgs,
    /// Write report.json, summary.md, curves.png (and the nodes' logs) into this directory.
    #[arg(long, env = "ELASTICPS_REPORT")]
    pub report: Option<PathBuf>,
    /// Do not draw progress bars.
    #[arg(long, env = "ELASTICPS_QUIET")]
    pub quiet: bool,
    /// Serve Prometheus metrics on every node (a free port each) and print where to
    /// scrape them.
    #[arg(long, env = "ELASTICPS_METRICS")]
    pub metrics: bool,
}

/// Everything a local run produced.
#[derive(Debug, Default)]
pub struct RunOutcome {
    /// Wall time from the first spawn to the last exit.
    pub wall: Duration,
    /// Final numbers of each rank.
    pub workers: BTreeMap<u32, WorkerReport>,
    /// Final counters of each server.
    pub servers: BTreeMap<u32, elasticps_wire::ServerStats>,
    /// Loss and accuracy points over time.
    pub curve: Vec<CurvePoint>,
    /// The last evaluation: (accuracy, loss).
    pub final_eval: Option<(f32, f32)>,
    /// The scheduler's balancing history.
    pub balance: Option<BalanceLog>,
}

/// Runs one job on a local cluster and collects its events.
pub async fn run_local(cmd: &TrainCmd, extra_server_args: &[String]) -> anyhow::Result<RunOutcome> {
    // A wrong job flag is refused here, before any process starts.
    cmd.job.job_config()?;
    let log_dir = match &cmd.report {
        Some(dir) => dir.join("logs"),
        None => std::env::temp_dir().join(format!("elasticps-{}", std::process::id())),
    };
    let mut cluster = Cluster::new(&log_dir)?;
    let env = [("ELASTICPS_SECRET", cmd.net.secret.as_str())];
    let started = Instant::now();

    let metrics_flags: Vec<String> =
        if cmd.metrics { vec!["--metrics-listen".into(), "127.0.0.1:0".into()] } else { Vec::new() };
    let mut scrape = ScrapeList::new(cmd.metrics, 1 + cmd.job.servers as usize + cmd.job.workers as usize);

    let mut args = vec!["scheduler".to_string(), "--listen".into(), "127.0.0.1:0".into(), "--log-dir".into()];
    args.push(log_dir.display().to_string());
    args.extend(cmd.job.to_flags());
    args.extend(cmd.net.to_flags());
    args.extend(metrics_flags.iter().cloned());
    let sched = cluster.spawn("scheduler", &args, &env)?;
    let addr = loop {
        let next = tokio::time::timeout(Duration::from_secs(20), cluster.next()).await;
        match next {
            Ok(Some(NodeEvent::Line { event: Event::Listening { addr } })) => break addr,
            Ok(Some(NodeEvent::Line { event: Event::Metrics { node, addr } })) => scrape.add(node, addr),
            Ok(Some(NodeEvent::Exited { node, status })) => return Err(cluster.failure(node, status)),
            Ok(Some(_)) => continue,
            Ok(None) | Err(_) => {
                anyhow::bail!("the scheduler did not report its address within 20 s\n{}", cluster.log_tail(sched, 12))
            }
        }
    };
    for i in 0..cmd.job.servers {
        let mut args =
            vec!["server".to_string(), "--scheduler".into(), addr.clone(), "--listen".into(), "127.0.0.1:0".into()];
        args.extend(cmd.net.to_flags());
        args.extend(metrics_flags.iter().cloned());
        args.extend(extra_server_args.iter().map(|a| a.replace("{i}", &i.to_string())));
        cluster.spawn(&format!("server {i}"), &args, &env)?;
    }
    for i in 0..cmd.job.workers {
        let mut args = vec!["worker".to_string(), "--scheduler".into(), addr.clone()];
        args.extend(cmd.data.to_flags());
        args.extend(cmd.net.to_flags());
        args.extend(metrics_flags.iter().cloned());
        cluster.spawn(&format!("worker {i}"), &args, &env)?;
    }

    let bars = Bars::new(cmd.quiet);
    let mut out = RunOutcome::default();
    loop {
        let next = tokio::select! {
            ev = cluster.next() => ev,
            _ = tokio::signal::ctrl_c() => {
                cluster.kill_all();
                anyhow::bail!("interrupted: every node was stopped");
            }
        };
        let t_s = started.elapsed().as_secs_f64();
        match next {
            None => break,
            Some(NodeEvent::Exited { node, status }) => {
                if !status.success() {
                    bars.clear();
                    let err = cluster.failure(node, status);
                    cluster.kill_all();
                    return Err(err.context("the job failed; every other node was stopped"));
                }
                if cluster.all_exited() {
                    break;
                }
            }
            Some(NodeEvent::Line { event }) => match event {
                Event::Progress { rank, iteration, total, loss } => {
                    bars.update(rank, iteration, total, loss);
                    out.curve.push(CurvePoint {
                        t_s,
                        iteration: iteration.into(),
                        rank,
                        loss: Some(loss.into()),
                        test_accuracy: None,
                    });
                }
                Event::Eval { rank, iteration, accuracy, loss } => {
                    out.final_eval = Some((accuracy, loss));
                    out.curve.push(CurvePoint {
                        t_s,
                        iteration: iteration.into(),
                        rank,
                        loss: None,
                        test_accuracy: Some(accuracy.into()),
                    });
                }
                Event::WorkerDone(w) => {
                    out.workers.insert(w.rank, w);
                }
                Event::ServerStats(s) => {
                    out.servers.insert(s.server_id, s);
                }
                Event::Balance(log) => out.balance = Some(log),
                Event::Metrics { node, addr } => scrape.add(node, addr),
                Event::Listening { .. } => {}
            },
        }
    }
    bars.clear();
    out.wall = started.elapsed();
    Ok(out)
}

/// `elasticps train`: run, print the summary, write the report.
pub async fn train(cmd: TrainCmd) -> anyhow::Result<()> {
    let outcome = run_local(&cmd, &[]).await?;
    let report = build_report(&cmd, &outcome)?;
    if report.test_accuracy.is_nan() {
        println!("{} iterations per worker (synthetic model: no test set)", report.iterations);
    } else {
        println!(
            "test accuracy {:.2}% (loss {:.4}) after {} iterations per worker",
            report.test_accuracy * 100.0,
            report.test_loss,
            report.iterations
        );
    }
    let held: u64 = report.servers.iter().map(|s| s.pulls_held).sum();
    let hold_ms: f64 = report.servers.iter().map(|s| s.hold_ms).sum();
    println!(
        "{} servers, {} workers, {}: {:.0} samples/s, wall {:.1} s, pulls held {} ({:.1} ms in total)",
        cmd.job.servers, cmd.job.workers, cmd.job.sync, report.samples_per_sec, report.wall_s, held, hold_ms
    );
    if let Some(log) = &outcome.balance
        && (log.mode != "static" || !log.migrations.is_empty())
    {
        let done: Vec<_> = log.migrations.iter().filter(|m| m.error.is_none()).collect();
        let mb: f64 = done.iter().map(|m| m.bytes as f64).sum::<f64>() / 1e6;
        let freeze = done.iter().map(|m| m.freeze_ms).fold(0.0, f64::max);
        let scaling: Vec<String> = log
            .scaling
            .iter()
            .map(|e| format!("{} {}", e.action, e.server.map_or("-".into(), |s| s.to_string())))
            .collect();
        println!(
            "balance {}: {} migrations ({mb:.1} MB moved, longest freeze {freeze:.1} ms), scaling: {}",
            log.mode,
            done.len(),
            if scaling.is_empty() { "none".to_string() } else { scaling.join(", ") }
        );
    }
    if let Some(dir) = &cmd.report {
        crate::report::write(dir, &report)?;
        println!("report written to {}", dir.display());
    }
    Ok(())
}

/// Turns a run's events into the report.
pub fn build_report(cmd: &TrainCmd, o: &RunOutcome) -> anyhow::Result<Report> {
    // A synthetic model has no test set: its accuracy is NaN (null in report.json).
    let (test_accuracy, test_loss) = match (o.final_eval, cmd.data.model) {
        (Some(e), _) => e,
        (None, ModelKind::Synthetic(_)) => (f32::NAN, f32::NAN),
        (None, ModelKind::Mlp) => anyhow::bail!("worker 0 reported no test evaluation"),
    };
    let workers: Vec<WorkerReport> = o.workers.values().cloned().collect();
    anyhow::ensure!(
        workers.len() as u32 == cmd.job.workers,
        "only {} of {} workers reported their end",
        workers.len(),
        cmd.job.workers
    );
    let samples: u64 = workers.iter().map(|w| w.samples).sum();
    let train_s = workers.iter().map(|w| w.train_s).fold(0.0, f64::max);
    let iterations = workers.iter().map(|w| w.iterations).max().unwrap_or(0);
    let servers = o
        .servers
        .values()
        .map(|s| ServerReport {
            id: s.server_id,
            sync: s.sync.clone(),
            blocks: s.blocks,
            bytes: s.bytes,
            pushes: s.totals.pushes,
            pulls: s.totals.pulls,
            pulls_held: s.totals.pulls_held,
            hold_ms: s.totals.hold_us as f64 / 1e3,
            hold_p99_ms: s.hold_p99_us as f64 / 1e3,
            releases: s.totals.releases,
            max_lead: s.totals.max_lead,
        })
        .collect();
    let config = serde_json::json!({
        "servers": cmd.job.servers,
        "workers": cmd.job.workers,
        "sync": cmd.job.sync.to_string(),
        "optimizer": cmd.job.optimizer.to_string(),
        "lr": cmd.job.lr.to_string().parse::<f64>().unwrap_or(f64::NAN),
        "aggregate": cmd.job.aggregate,
        "placement": cmd.job.placement.to_string(),
        "block_bytes": cmd.job.block_bytes,
        "seed": cmd.job.seed,
        "dataset": cmd.data.dataset.as_str(),
        "batch_size": cmd.data.batch_size,
        "epochs": cmd.data.epochs,
        "iterations": cmd.data.iterations,
        "model": cmd.data.model.to_string(),
        "compute_ms": cmd.data.compute_ms,
        "worker_delay": cmd.data.worker_delay.as_ref().map(ToString::to_string),
        "server_sync": cmd.job.server_sync.iter().map(|(i, p)| format!("{i}={p}")).collect::<Vec<_>>(),
        "server_bandwidth": cmd.job.server_bandwidth.iter().map(|(i, mbps)| format!("{i}={mbps}")).collect::<Vec<_>>(),
        "server_interference": cmd.job.server_interference.iter().map(|(i, f)| format!("{i}={f}")).collect::<Vec<_>>(),
        "straggler_at": cmd.job.straggler_at,
        "balance": cmd.job.balance.to_string(),
        "max_servers": cmd.job.max_servers.unwrap_or(cmd.job.servers),
        "min_servers": cmd.job.min_servers.unwrap_or(cmd.job.servers),
    });
    Ok(Report {
        config,
        test_accuracy: test_accuracy.into(),
        test_loss: test_loss.into(),
        samples_per_sec: if train_s > 0.0 { samples as f64 / train_s } else { 0.0 },
        wall_s: o.wall.as_secs_f64(),
        iterations,
        servers,
        workers,
        curve: o.curve.clone(),
        balance: o.balance.clone(),
    })
}

/// Where to scrape each node (`--metrics`): printed once every node started reports its
/// address, then one line per node that joins later (a server the scheduler launched).
struct ScrapeList {
    enabled: bool,
    expected: usize,
    nodes: Vec<(String, String)>,
    printed: bool,
}

impl ScrapeList {
    fn new(enabled: bool, expected: usize) -> Self {
        Self { enabled, expected, nodes: Vec::new(), printed: false }
    }

    fn add(&mut self, node: String, addr: String) {
        if !self.enabled {
            return;
        }
        let url = format!("http://{addr}/metrics");
        if self.printed {
            println!("metrics: {node} {url}");
            return;
        }
        self.nodes.push((node, url));
        if self.nodes.len() >= self.expected {
            // scheduler first, then servers and workers by id.
            let key = |n: &str| {
                let (role, id) = n.split_once(' ').unwrap_or((n, ""));
                let order = match role {
                    "scheduler" => 0,
                    "server" => 1,
                    _ => 2,
                };
                (order, id.parse::<u32>().unwrap_or(0))
            };
            self.nodes.sort_by_key(|(n, _)| key(n));
            let list: Vec<String> = self.nodes.iter().map(|(n, u)| format!("{n} {u}")).collect();
            println!("metrics: {}", list.join(", "));
            self.printed = true;
        }
    }
}

/// One progress bar per worker rank.
struct Bars {
    multi: MultiProgress,
    bars: std::cell::RefCell<BTreeMap<u32, ProgressBar>>,
}

impl Bars {
    fn new(quiet: bool) -> Self {
        let target = if quiet { ProgressDrawTarget::hidden() } else { ProgressDrawTarget::stderr() };
        Self { multi: MultiProgress::with_draw_target(target), bars: Default::default() }
    }

    fn update(&self, rank: u32, iteration: u32, total: u32, loss: f32) {
        let mut bars = self.bars.borrow_mut();
        let bar = bars.entry(rank).or_insert_with(|| {
            let b = self.multi.add(ProgressBar::new(total.into()));
            b.set_style(
                ProgressStyle::with_template(
                    "worker {prefix:>2} [{bar:30.cyan/blue}] {pos:>6}/{len} it  {per_sec:>10}  loss {msg}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            b.set_prefix(rank.to_string());
            b
        });
        bar.set_position(iteration.into());
        bar.set_message(format!("{loss:.4}"));
    }

    fn clear(&self) {
        for b in self.bars.borrow().values() {
            b.finish();
        }
    }
}
