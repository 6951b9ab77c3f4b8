//! The three roles as commands: `scheduler`, `server`, `worker`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use elasticps_runtime::client::ClientOptions;
use elasticps_runtime::metrics::{MetricsEndpoint, SchedulerMetrics, Scrape, ServerMetrics, WorkerMetrics};
use elasticps_runtime::scheduler::{self, SchedulerOptions};
use elasticps_runtime::server::{self, ServerOptions};

use crate::events::{Emitter, Event};
use elasticps_launch::args::{DataArgs, JobArgs, NetArgs};
use elasticps_launch::process::ServerLauncher;

/// `elasticps scheduler`: membership, layout, heartbeats, the end of the job.
#[derive(Args, Clone, Debug)]
pub struct SchedulerCmd {
    /// Address to listen on.
    #[arg(long, env = "ELASTICPS_LISTEN", default_value = "127.0.0.1:7000")]
    pub listen: String,
    /// The job.
    #[command(flatten)]
    pub job: JobArgs,
    /// Transport settings.
    #[command(flatten)]
    pub net: NetArgs,
    /// Give up if the cluster is not complete within this many seconds of the first
    /// worker's registration (of the start while servers or hosts are missing: a worker's
    /// own start, importing torch and building its model, does not count).
    #[arg(long, env = "ELASTICPS_JOIN_TIMEOUT", default_value_t = 300)]
    pub join_timeout_s: u64,
    /// How to start servers when the job scales out: `local` (processes on this host) or
    /// `none` (operators start them by hand with `elasticps server`).
    #[arg(long, env = "ELASTICPS_LAUNCHER", default_value = "local", value_parser = ["local", "none"])]
    pub launcher: String,
    /// Where servers started by the local launcher write their logs.
    #[arg(long, env = "ELASTICPS_LOG_DIR")]
    pub log_dir: Option<PathBuf>,
    /// Serve Prometheus metrics at http://HOST:PORT/metrics (port 0: any free port).
    #[arg(long, env = "ELASTICPS_METRICS_LISTEN", value_name = "HOST:PORT")]
    pub metrics_listen: Option<String>,
    /// Print JSON events on stdout.
    #[arg(long, env = "ELASTICPS_EVENTS")]
    pub events: bool,
    /// A job that spans hosts: wait for MIN host agents (`elasticps launch --rdzv`), take
    /// up to MAX, and start the servers and workers on them.
    #[arg(long, value_name = "MIN[:MAX]", value_parser = elasticps_launch::hosts::parse_nnodes)]
    pub nnodes: Option<(u32, u32)>,
    /// With --nnodes: restart a lost worker with its rank on a host with room, at most
    /// this many times in all.
    #[arg(long, default_value_t = 0)]
    pub restart_workers: u32,
    /// With --nnodes and --replicas: start a server in place of a lost one on a host with
    /// room, at most this many times in all.
    #[arg(long, default_value_t = 0)]
    pub restart_servers: u32,
}

/// `elasticps server`: owns blocks, applies pushes, answers pulls.
#[derive(Args, Clone, Debug)]
pub struct ServerCmd {
    /// The scheduler's address.
    #[arg(long, env = "ELASTICPS_SCHEDULER", default_value = "127.0.0.1:7000")]
    pub scheduler: String,
    /// Address to listen on for workers (port 0: any free port).
    #[arg(long, env = "ELASTICPS_LISTEN", default_value = "127.0.0.1:0")]
    pub listen: String,
    /// Address workers should dial, if not the listen address (e.g. when listening on 0.0.0.0).
    #[arg(long, env = "ELASTICPS_ADVERTISE")]
    pub advertise: Option<String>,
    /// Write one JSON line per answered pull to this file (for checking sync semantics).
    #[arg(long, env = "ELASTICPS_TRACE")]
    pub trace: Option<PathBuf>,
    /// Refuse a pull whose clock is more than this many clocks past its block's done
    /// clock (BadRequest naming the limit): no policy answers it soon.
    #[arg(long, env = "ELASTICPS_MAX_CLOCK_LEAD", value_name = "CLOCKS", default_value_t = elasticps_runtime::server::MAX_CLOCK_LEAD)]
    pub max_clock_lead: u32,
    /// Transport settings.
    #[command(flatten)]
    pub net: NetArgs,
    /// Serve Prometheus metrics at http://HOST:PORT/metrics (port 0: any free port).
    #[arg(long, env = "ELASTICPS_METRICS_LISTEN", value_name = "HOST:PORT")]
    pub metrics_listen: Option<String>,
    /// Print JSON events on stdout.
    #[arg(long, env = "ELASTICPS_EVENTS")]
    pub events: bool,
}

/// `elasticps worker`: trains the MLP on its shard of the data through the client library.
#[derive(Args, Clone, Debug)]
pub struct WorkerCmd {
    /// The scheduler's address.
    #[arg(long, env = "ELASTICPS_SCHEDULER", default_value = "127.0.0.1:7000")]
    pub scheduler: String,
    /// Data and schedule.
    #[command(flatten)]
    pub data: DataArgs,
    /// Transport settings.
    #[command(flatten)]
    pub net: NetArgs,
    /// Serve Prometheus metrics at http://HOST:PORT/metrics (port 0: any free port).
    #[arg(long, env = "ELASTICPS_METRICS_LISTEN", value_name = "HOST:PORT")]
    pub metrics_listen: Option<String>,
    /// Print JSON events on stdout (unless ELASTICPS_EVENTS_FD names a descriptor for them,
    /// as `elasticps launch` does).
    #[arg(long, env = "ELASTICPS_EVENTS")]
    pub events: bool,
    /// Rejoin as this rank: a worker restarted after it was lost (the launcher's
    /// --restart-workers sets it). It goes on from the clock the job is at.
    #[arg(long, env = "ELASTICPS_RANK")]
    pub rank: Option<u32>,
}

/// Binds `--metrics-listen` for `metrics`; the endpoint serves until dropped.
async fn serve_metrics(listen: &str, metrics: Arc<dyn Scrape>) -> anyhow::Result<MetricsEndpoint> {
    MetricsEndpoint::bind(listen, metrics).await.with_context(|| format!("--metrics-listen {listen}"))
}

/// The metrics event of a node, once `registered` says its id (a server's id and a
/// worker's rank are known only once the scheduler accepted it; a node that never
/// registers fails on its own, and prints none).
fn emit_metrics_when<F>(emitter: Emitter, role: &'static str, addr: SocketAddr, registered: F)
where
    F: std::future::Future<Output = Option<u32>> + Send + 'static,
{
    tokio::spawn(async move {
        match registered.await {
            Some(id) => emitter.emit(&Event::Metrics { node: format!("{role} {id}"), addr: addr.to_string() }),
            None => tracing::warn!(role, "no metrics event: the node's metrics closed before it registered"),
        }
    });
}

/// `HOST:0` for the servers a scheduler launches, from the scheduler's `--metrics-listen`.
fn any_port(listen: &str) -> String {
    match listen.rsplit_once(':') {
        Some((host, _)) => format!("{host}:0"),
        None => "127.0.0.1:0".into(),
    }
}

/// Runs the scheduler until the job ends.
pub async fn scheduler(cmd: SchedulerCmd) -> anyhow::Result<()> {
    cmd.net.check_worker_secret()?;
    cmd.net.install()?;
    let emitter = Emitter::new(cmd.events);
    let mut job = cmd.job.job_config()?;
    if let (Some(dir), Some(plan)) = (&cmd.job.resume, job.checkpoint.as_mut()) {
        let restore = elasticps_runtime::checkpoint::latest(dir)
            .with_context(|| format!("--resume {}: no checkpoint to resume from", dir.display()))?;
        tracing::info!(clock = restore.clock, blocks = restore.blocks.len(), dir = %dir.display(), "resuming from a checkpoint");
        plan.resume = Some(restore);
    }
    let metrics = cmd.metrics_listen.as_ref().map(|_| SchedulerMetrics::new());
    let endpoint = match (&cmd.metrics_listen, &metrics) {
        (Some(listen), Some(m)) => Some(serve_metrics(listen, m.clone()).await?),
        _ => None,
    };
    let opts = SchedulerOptions {
        listen: cmd.listen.clone(),
        job,
        codec: cmd.net.codec(),
        frame_timeout: cmd.net.frame_timeout(),
        join_timeout: Duration::from_secs(cmd.join_timeout_s),
        metrics,
        state_dir: cmd.job.state_dir.clone(),
        hosts: cmd.nnodes.map(|(min_hosts, max_hosts)| scheduler::HostsConfig {
            min_hosts,
            max_hosts,
            restart_workers: cmd.restart_workers,
            restart_servers: cmd.restart_servers,
        }),
        relay: cmd.nnodes.map(|_| emitter.clone()),
    };
    let mut launched = None;
    let launcher: Option<Box<dyn scheduler::Launcher>> = match cmd.launcher.as_str() {
        "local" if cmd.nnodes.is_none() => {
            let dir = cmd.log_dir.clone().unwrap_or_else(|| std::env::temp_dir().join("elasticps-scaled"));
            let mut flags = cmd.net.to_flags();
            if let Some(listen) = &cmd.metrics_listen {
                // Launched servers serve metrics too, on a free port of the same host.
                flags.extend(["--metrics-listen".into(), any_port(listen)]);
            }
            let env = cmd.net.role_env().into_iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            let l = ServerLauncher::new(&dir, flags, env)?;
            launched = Some(l.launched());
            Some(Box::new(l))
        }
        _ => None,
    };
    let end = scheduler::run_with(opts, launcher, |addr| {
        tracing::info!(%addr, "scheduler listening");
        emitter.emit(&Event::Listening { addr: addr.to_string() });
        if let Some(e) = &endpoint {
            emitter.emit(&Event::Metrics { node: "scheduler".into(), addr: e.addr().to_string() });
        }
    })
    .await?;
    if let Some(servers) = launched {
        // Their final counters are forwarded on our stdout: wait for them.
        servers.wait(Duration::from_secs(30)).await;
    }
    tracing::info!(reason = %end.reason, migrations = end.balance.migrations.len(), "scheduler done");
    emitter.emit(&Event::Balance(end.balance));
    Ok(())
}

/// What a server advertises: `--advertise`, else, listening on an unspecified address,
/// the address of the interface that routes to the scheduler. Refused: a loopback or
/// unspecified address to a scheduler on another host.
fn advertised(scheduler: &str, listen: &str, advertise: Option<String>) -> anyhow::Result<Option<String>> {
    use elasticps_launch::addr;
    let sched = addr::resolve(scheduler, 7000, "--scheduler")?;
    let listen_ip = addr::split_port(listen).0.parse::<std::net::IpAddr>().ok();
    let advertise = match (advertise, listen_ip) {
        (Some(a), _) => Some(a),
        (None, Some(ip)) if ip.is_unspecified() => Some(addr::route_to(sched)?.to_string()),
        (None, _) => None,
    };
    let shown = advertise.as_deref().unwrap_or(listen);
    addr::check_advertised(addr::resolve(shown, 0, "--advertise")?.ip(), sched)
        .with_context(|| format!("server listening on {listen}"))?;
    Ok(advertise)
}

/// Runs a server until the scheduler ends the job.
pub async fn server(cmd: ServerCmd) -> anyhow::Result<()> {
    cmd.net.check_worker_secret()?;
    cmd.net.install()?;
    let emitter = Emitter::new(cmd.events);
    let metrics = cmd.metrics_listen.as_ref().map(|_| ServerMetrics::new());
    let mut _endpoint = None;
    if let (Some(listen), Some(m)) = (&cmd.metrics_listen, &metrics) {
        let e = serve_metrics(listen, m.clone()).await?;
        let m = m.clone();
        emit_metrics_when(emitter.clone(), "server", e.addr(), async move { m.registered().await });
        _endpoint = Some(e);
    }
    let advertise = advertised(&cmd.scheduler, &cmd.listen, cmd.advertise)?;
    let opts = ServerOptions {
        scheduler: cmd.scheduler,
        listen: cmd.listen,
        advertise,
        codec: cmd.net.codec(),
        frame_timeout: cmd.net.frame_timeout(),
        trace: cmd.trace,
        metrics,
        scheduler_retry: cmd.net.scheduler_retry(),
        max_clock_lead: cmd.max_clock_lead,
    };
    let stats = server::run(opts).await?;
    tracing::info!(
        server = stats.server_id,
        pushes = stats.totals.pushes,
        pulls = stats.totals.pulls,
        held = stats.totals.pulls_held,
        "server done"
    );
    emitter.emit(&Event::ServerStats(stats));
    Ok(())
}

/// Runs the training job of one worker.
pub async fn worker(cmd: WorkerCmd) -> anyhow::Result<()> {
    cmd.net.install()?;
    let mut opts = ClientOptions::new(&cmd.scheduler);
    opts.codec = cmd.net.worker_codec();
    opts.request_timeout = cmd.data.request_timeout();
    opts.fuse = !cmd.data.no_fuse;
    opts.wire_dtype = cmd.data.wire_dtype;
    opts.compress = cmd.data.compress;
    opts.rank = cmd.rank;
    opts.scheduler_retry = cmd.net.scheduler_retry();
    // Set by `elasticps launch` on a job across hosts: one push per host.
    opts.group = elasticps_runtime::client::GroupOptions::from_env()?;
    // Started by `elasticps launch`, events go to its pipe (ELASTICPS_EVENTS_FD).
    let emitter = Emitter::from_env(cmd.events)?;
    let mut _endpoint = None;
    if let Some(listen) = &cmd.metrics_listen {
        let m = WorkerMetrics::new();
        let e = serve_metrics(listen, m.clone()).await?;
        let registered = m.clone();
        emit_metrics_when(emitter.clone(), "worker", e.addr(), async move { registered.registered().await });
        opts.metrics = Some(m);
        _endpoint = Some(e);
    }
    crate::job::run(&cmd.scheduler, &cmd.data, opts, emitter).await
}

#[cfg(test)]
mod tests {
    use super::any_port;

    #[test]
    fn launched_servers_get_a_free_port_on_the_schedulers_metrics_host() {
        assert_eq!(any_port("0.0.0.0:9100"), "0.0.0.0:0");
        assert_eq!(any_port("[::1]:9100"), "[::1]:0");
        assert_eq!(any_port("localhost"), "127.0.0.1:0");
    }
}
