//! A local cluster of role processes: spawns them, reads their event streams, watches
//! them exit, and kills them all on failure or Ctrl-C. Children also die with the
//! launcher (Linux `PR_SET_PDEATHSIG`), so nothing is left behind even if it is killed.

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};

use anyhow::Context;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;
use tokio::sync::mpsc;

use crate::events::Event;

/// What happened to a node of the cluster.
#[derive(Debug)]
pub enum NodeEvent {
    /// The node printed an event.
    Line {
        /// The event.
        event: Event,
    },
    /// The node exited.
    Exited {
        /// Index of the node, in spawn order.
        node: usize,
        /// Its exit status.
        status: ExitStatus,
    },
}

struct Node {
    name: String,
    pid: Option<u32>,
    log: PathBuf,
    running: bool,
}

/// The processes of one local job.
pub struct Cluster {
    exe: PathBuf,
    log_dir: PathBuf,
    nodes: Vec<Node>,
    tx: mpsc::UnboundedSender<NodeEvent>,
    rx: mpsc::UnboundedReceiver<NodeEvent>,
}

impl Cluster {
    /// A cluster of this binary's roles, with each node's stderr logged under `log_dir`.
    pub fn new(log_dir: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(log_dir)
            .with_context(|| format!("creating the log directory {}", log_dir.display()))?;
        let exe = std::env::current_exe().context("finding the elasticps binary")?;
        let (tx, rx) = mpsc::unbounded_channel();
        Ok(Self { exe, log_dir: log_dir.to_path_buf(), nodes: Vec::new(), tx, rx })
    }

    /// Starts `elasticps ARGS... --events` as node `name` (e.g. "server 1"); returns its index.
    pub fn spawn(&mut self, name: &str, args: &[String], env: &[(&str, &str)]) -> anyhow::Result<usize> {
        let node = self.nodes.len();
        let log = self.log_dir.join(format!("{}.log", name.replace(' ', "-")));
        let mut child = role_command(&self.exe, args, env, &log)?
            .spawn()
            .with_context(|| format!("starting {name} ({})", self.exe.display()))?;
        let pid = child.id();
        let stdout = child.stdout.take().context("child stdout")?;
        let tx = self.tx.clone();
        let label = name.to_string();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                match serde_json::from_str::<Event>(&line) {
                    Ok(event) => {
                        let _ = tx.send(NodeEvent::Line { event });
                    }
                    Err(_) => tracing::debug!(node = %label, %line, "not an event"),
                }
            }
            // stdout is closed: wait for the exit status.
            match child.wait().await {
                Ok(status) => {
                    let _ = tx.send(NodeEvent::Exited { node, status });
                }
                Err(e) => tracing::warn!(node = %label, error = %e, "cannot wait for child"),
            }
        });
        self.nodes.push(Node { name: name.to_string(), pid, log, running: true });
        Ok(node)
    }

    /// The next thing that happened (`None` never comes while the cluster is alive).
    pub async fn next(&mut self) -> Option<NodeEvent> {
        let ev = self.rx.recv().await;
        if let Some(NodeEvent::Exited { node, .. }) = &ev {
            self.nodes[*node].running = false;
        }
        ev
    }

    /// Name of node `node`.
    pub fn name(&self, node: usize) -> &str {
        &self.nodes[node].name
    }

    /// True once every node has exited.
    pub fn all_exited(&self) -> bool {
        self.nodes.iter().all(|n| !n.running)
    }

    /// The last `lines` lines of a node's log, for error messages.
    pub fn log_tail(&self, node: usize, lines: usize) -> String {
        let n = &self.nodes[node];
        let text = std::fs::read_to_string(&n.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        let tail = all[all.len().saturating_sub(lines)..].join("\n");
        format!("last lines of {}:\n{tail}", n.log.display())
    }

    /// Kills every node still running.
    pub fn kill_all(&mut self) {
        for n in self.nodes.iter_mut().filter(|n| n.running) {
            if let Some(pid) = n.pid {
                // SAFETY: kill(2) on a pid we spawned and have not reaped.
                unsafe {
                    libc::kill(pid as libc::pid_t, libc::SIGKILL);
                }
            }
            n.running = false;
        }
    }

    /// The error for a node that exited with `status`, with the tail of its log.
    pub fn failure(&self, node: usize, status: ExitStatus) -> anyhow::Error {
        anyhow::anyhow!("{} exited with {status}\n{}", self.name(node), self.log_tail(node, 12))
    }
}

/// `elasticps ARGS... --events` with stdout piped (the event stream), stderr into `log`,
/// and death with the thread that spawns it (Linux `PR_SET_PDEATHSIG`).
fn role_command(exe: &Path, args: &[String], env: &[(&str, &str)], log: &Path) -> anyhow::Result<Command> {
    let stderr = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let mut cmd = Command::new(exe);
    cmd.args(args).arg("--events").stdin(Stdio::null()).stdout(Stdio::piped()).stderr(stderr).kill_on_drop(true);
    // Every child would bind the same metrics address: each gets its own flag instead.
    cmd.env_remove("ELASTICPS_METRICS_LISTEN");
    for (k, v) in env {
        cmd.env(k, v);
    }
    #[cfg(target_os = "linux")]
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    Ok(cmd)
}

/// The scheduler's launcher for scale-out: starts `elasticps server` processes on this
/// host, logs them into `log_dir` and forwards their event lines (their final counters)
/// to this process's stdout, where `elasticps train` reads them.
pub struct ServerLauncher {
    exe: PathBuf,
    log_dir: PathBuf,
    /// Transport flags for the servers.
    args: Vec<String>,
    secret: String,
    started: u32,
    running: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>,
}

/// Waits for the servers a [`ServerLauncher`] started (their final events forwarded).
#[derive(Clone)]
pub struct LaunchedServers(Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>);

impl LaunchedServers {
    /// Waits until every launched server exited, at most `timeout` in all.
    pub async fn wait(&self, timeout: std::time::Duration) {
        let tasks: Vec<_> = std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()));
        let all = futures::future::join_all(tasks);
        if tokio::time::timeout(timeout, all).await.is_err() {
            tracing::warn!("launched servers did not exit within {timeout:?}");
        }
    }
}

impl ServerLauncher {
    /// A launcher whose servers get `args` and the cluster `secret`.
    pub fn new(log_dir: &Path, args: Vec<String>, secret: String) -> anyhow::Result<Self> {
        std::fs::create_dir_all(log_dir)
            .with_context(|| format!("creating the log directory {}", log_dir.display()))?;
        let exe = std::env::current_exe().context("finding the elasticps binary")?;
        Ok(Self { exe, log_dir: log_dir.to_path_buf(), args, secret, started: 0, running: Arc::default() })
    }

    /// A handle to wait for the launched servers once the job is over.
    pub fn launched(&self) -> LaunchedServers {
        LaunchedServers(self.running.clone())
    }

    fn start(&mut self, scheduler_addr: &str) -> anyhow::Result<()> {
        self.started += 1;
        let log = self.log_dir.join(format!("server-scaled-{}.log", self.started));
        let mut args = vec!["server".into(), "--scheduler".into(), scheduler_addr.into(), "--listen".into()];
        args.push("127.0.0.1:0".into());
        args.extend(self.args.iter().cloned());
        let mut child = role_command(&self.exe, &args, &[("ELASTICPS_SECRET", &self.secret)], &log)?
            .spawn()
            .context("starting a server")?;
        let stdout = child.stdout.take().context("child stdout")?;
        tracing::info!(log = %log.display(), pid = child.id(), "server process started");
        let task = tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if serde_json::from_str::<Event>(&line).is_ok() {
                    use std::io::Write;
                    let mut out = std::io::stdout().lock();
                    let _ = writeln!(out, "{line}");
                    let _ = out.flush();
                }
            }
            match child.wait().await {
                Ok(status) if status.success() => tracing::info!("a scaled server exited"),
                Ok(status) => tracing::warn!(%status, "a scaled server failed"),
                Err(e) => tracing::warn!(error = %e, "cannot wait for a scaled server"),
            }
        });
        self.running.lock().unwrap_or_else(|e| e.into_inner()).push(task);
        Ok(())
    }
}

impl elasticps_runtime::scheduler::Launcher for ServerLauncher {
    fn start_server(&mut self, scheduler_addr: &str) -> Result<(), String> {
        self.start(scheduler_addr).map_err(|e| format!("{e:#}"))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.kill_all();
    }
}
