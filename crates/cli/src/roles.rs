//! The three roles as commands: `scheduler`, `server`, `worker`.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use elasticps_runtime::client::ClientOptions;
use elasticps_runtime::scheduler::{self, SchedulerOptions};
use elasticps_runtime::server::{self, ServerOptions};

use crate::args::{DataArgs, JobArgs, NetArgs};
use crate::events::{Emitter, Event};
use crate::launch::ServerLauncher;

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
    /// Give up if the cluster is not complete within this many seconds.
    #[arg(long, env = "ELASTICPS_JOIN_TIMEOUT", default_value_t = 300)]
    pub join_timeout_s: u64,
    /// How to start servers when the job scales out: `local` (processes on this host) or
    /// `none` (operators start them by hand with `elasticps server`).
    #[arg(long, env = "ELASTICPS_LAUNCHER", default_value = "local", value_parser = ["local", "none"])]
    pub launcher: String,
    /// Where servers started by the local launcher write their logs.
    #[arg(long, env = "ELASTICPS_LOG_DIR")]
    pub log_dir: Option<PathBuf>,
    /// Print JSON events on stdout.
    #[arg(long, env = "ELASTICPS_EVENTS")]
    pub events: bool,
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
    /// Transport settings.
    #[command(flatten)]
    pub net: NetArgs,
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
    /// Print JSON events on stdout (unless ELASTICPS_EVENTS_FD names a descriptor for them,
    /// as `elasticps launch` does).
    #[arg(long, env = "ELASTICPS_EVENTS")]
    pub events: bool,
}

/// Runs the scheduler until the job ends.
pub async fn scheduler(cmd: SchedulerCmd) -> anyhow::Result<()> {
    let emitter = Emitter::new(cmd.events);
    let opts = SchedulerOptions {
        listen: cmd.listen.clone(),
        job: cmd.job.job_config()?,
        codec: cmd.net.codec(),
        join_timeout: Duration::from_secs(cmd.join_timeout_s),
    };
    let mut launched = None;
    let launcher: Option<Box<dyn scheduler::Launcher>> = match cmd.launcher.as_str() {
        "local" => {
            let dir = cmd.log_dir.clone().unwrap_or_else(|| std::env::temp_dir().join("elasticps-scaled"));
            let l = ServerLauncher::new(&dir, cmd.net.to_flags(), cmd.net.secret.clone())?;
            launched = Some(l.launched());
            Some(Box::new(l))
        }
        _ => None,
    };
    let end = scheduler::run_with(opts, launcher, |addr| {
        tracing::info!(%addr, "scheduler listening");
        emitter.emit(&Event::Listening { addr: addr.to_string() });
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

/// Runs a server until the scheduler ends the job.
pub async fn server(cmd: ServerCmd) -> anyhow::Result<()> {
    let emitter = Emitter::new(cmd.events);
    let opts = ServerOptions {
        scheduler: cmd.scheduler,
        listen: cmd.listen,
        advertise: cmd.advertise,
        codec: cmd.net.codec(),
        trace: cmd.trace,
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
    let mut opts = ClientOptions::new(&cmd.scheduler);
    opts.codec = cmd.net.codec();
    opts.request_timeout = cmd.data.request_timeout();
    // Started by `elasticps launch`, events go to its pipe (ELASTICPS_EVENTS_FD).
    let emitter = Emitter::from_env(cmd.events)?;
    crate::job::run(&cmd.scheduler, &cmd.data, opts, emitter).await
}
