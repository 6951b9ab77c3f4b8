//! A local cluster of processes: this binary's roles, and (for `elasticps launch`) the
//! user's own worker commands. It spawns them, reads their event streams, watches them
//! exit, and kills them all on failure or Ctrl-C. Children also die with the launcher
//! (Linux `PR_SET_PDEATHSIG`), so nothing is left behind even if it is killed; a user's
//! command runs in its own process group, which is killed with it, so a script's own
//! children die too.
//!
//! A role prints its events on stdout. A user's command gets a pipe as file descriptor 3
//! (`ELASTICPS_EVENTS_FD=3`) for its events; its stdout and stderr are free for the user:
//! every line is forwarded ([`NodeEvent::Output`]) and written to the node's log.

use std::ffi::OsString;
use std::io::Write as _;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::io::{AsyncBufRead, AsyncBufReadExt, BufReader};
use tokio::process::Command;
use tokio::sync::mpsc;

use elasticps_runtime::events::Event;

use crate::{LaunchError, Result};

/// What happened to a node of the cluster.
#[derive(Debug)]
pub enum NodeEvent {
    /// The node printed an event.
    Line {
        /// Index of the node, in spawn order.
        node: usize,
        /// The event.
        event: Event,
    },
    /// A user's command printed a line on its stdout or stderr (already in its log).
    Output {
        /// Index of the node, in spawn order.
        node: usize,
        /// The line, without its end (invalid UTF-8 replaced).
        line: String,
        /// True if it came from stderr.
        stderr: bool,
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
    /// For a user's command: its command line; it leads its own process group.
    command: Option<String>,
}

/// The file descriptor a user's command writes its events to.
pub const EVENTS_FD: i32 = 3;
/// How long the output of a command that exited is still read (a child of the command
/// may hold its pipes open).
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// The command that starts this program again, when its executable is not `elasticps`
/// ([`set_self_command`]).
static SELF_COMMAND: OnceLock<Vec<OsString>> = OnceLock::new();

/// Declares how this program starts itself: a program and its leading arguments (the
/// Python package's entry sets `[sys.executable, "-m", "elasticps"]`, since its executable
/// is the interpreter). Without it, the nodes are this process's own executable. Set once,
/// before any node starts; false if it was already set.
pub fn set_self_command(argv: Vec<OsString>) -> bool {
    !argv.is_empty() && SELF_COMMAND.set(argv).is_ok()
}

/// How this program's roles start: a program, and the arguments before the role's own
/// (`elasticps`, or `python -m elasticps` under the Python package).
#[derive(Clone, Debug)]
struct SelfCommand {
    program: PathBuf,
    lead: Vec<OsString>,
}

impl SelfCommand {
    /// The command [`set_self_command`] declared, else this process's executable.
    fn get() -> Result<Self> {
        match SELF_COMMAND.get().and_then(|argv| argv.split_first()) {
            Some((program, lead)) => Ok(Self { program: program.into(), lead: lead.to_vec() }),
            None => Ok(Self {
                program: std::env::current_exe().map_err(|e| LaunchError::io("finding the elasticps binary", e))?,
                lead: Vec::new(),
            }),
        }
    }
}

/// The processes of one local job.
pub struct Cluster {
    exe: SelfCommand,
    log_dir: PathBuf,
    nodes: Vec<Node>,
    tx: mpsc::UnboundedSender<NodeEvent>,
    rx: mpsc::UnboundedReceiver<NodeEvent>,
}

impl Cluster {
    /// A cluster of this binary's roles and users' commands, with each node's log under
    /// `log_dir`.
    pub fn new(log_dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(log_dir)
            .map_err(|e| LaunchError::io(format!("creating the log directory {}", log_dir.display()), e))?;
        let exe = SelfCommand::get()?;
        let (tx, rx) = mpsc::unbounded_channel();
        Ok(Self { exe, log_dir: log_dir.to_path_buf(), nodes: Vec::new(), tx, rx })
    }

    /// Starts `elasticps ARGS... --events` as node `name` (e.g. "server 1"); returns its index.
    pub fn spawn(&mut self, name: &str, args: &[String], env: &[(&str, &str)]) -> Result<usize> {
        let node = self.nodes.len();
        let log = self.log_dir.join(format!("{}.log", name.replace(' ', "-")));
        let mut child = role_command(&self.exe, args, env, &log)?
            .spawn()
            .map_err(|e| LaunchError::io(format!("starting {name} ({})", self.exe.program.display()), e))?;
        let pid = child.id();
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| LaunchError::io("child stdout", std::io::ErrorKind::BrokenPipe.into()))?;
        let tx = self.tx.clone();
        let label = name.to_string();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                match serde_json::from_str::<Event>(&line) {
                    Ok(event) => {
                        let _ = tx.send(NodeEvent::Line { node, event });
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
        self.nodes.push(Node { name: name.to_string(), pid, log, running: true, command: None });
        Ok(node)
    }

    /// Starts a user's command `argv` as node `name` (e.g. "worker 1") with `env` added
    /// to this process's environment, in its own process group, with a pipe for its
    /// events as file descriptor [`EVENTS_FD`]. Its stdout and stderr lines come back as
    /// [`NodeEvent::Output`] and go into `LOG_DIR/NAME.log`.
    pub fn spawn_command(&mut self, name: &str, argv: &[String], env: &[(String, String)]) -> Result<usize> {
        let node = self.nodes.len();
        let (program, args) = argv.split_first().ok_or_else(|| LaunchError::Flags("an empty command".into()))?;
        let shown = shell_words(argv);
        let log = self.log_dir.join(format!("{}.log", name.replace(' ', "-")));
        let log_file =
            std::fs::File::create(&log).map_err(|e| LaunchError::io(format!("creating {}", log.display()), e))?;
        let log_file = Arc::new(Mutex::new(log_file));
        let (events_read, events_write) = cloexec_pipe().map_err(|e| LaunchError::io("creating the events pipe", e))?;
        let write_fd = events_write.as_raw_fd();
        let mut cmd = Command::new(program);
        cmd.args(args).envs(env.iter().map(|(k, v)| (k, v))).kill_on_drop(true);
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        // SAFETY: only async-signal-safe calls (setpgid, prctl, dup2, fcntl) on integers.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setpgid(0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                #[cfg(target_os = "linux")]
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                // The pipe was made close-on-exec; its copy as fd 3 is not.
                let ok = if write_fd == EVENTS_FD {
                    libc::fcntl(EVENTS_FD, libc::F_SETFD, 0)
                } else {
                    libc::dup2(write_fd, EVENTS_FD)
                };
                if ok < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let spawned = cmd.spawn();
        // The child has its copy: without ours, the pipe ends when the child's copies do.
        drop(events_write);
        let mut child =
            spawned.map_err(|e| LaunchError::io(format!("cannot start {name} (`{shown}`): {program}"), e))?;
        let pid = child.id();
        let (stdout, stderr) = (
            child
                .stdout
                .take()
                .ok_or_else(|| LaunchError::io("child stdout", std::io::ErrorKind::BrokenPipe.into()))?,
            child
                .stderr
                .take()
                .ok_or_else(|| LaunchError::io("child stderr", std::io::ErrorKind::BrokenPipe.into()))?,
        );
        let events = tokio::net::unix::pipe::Receiver::from_owned_fd(events_read)
            .map_err(|e| LaunchError::io("reading the events pipe", e))?;
        let tx = self.tx.clone();
        let label = name.to_string();
        let readers = vec![
            tokio::spawn(read_events(BufReader::new(events), tx.clone(), node, label.clone())),
            tokio::spawn(forward_output(BufReader::new(stdout), node, false, log_file.clone(), tx.clone())),
            tokio::spawn(forward_output(BufReader::new(stderr), node, true, log_file, tx.clone())),
        ];
        tracing::info!(node = %label, pid, command = %shown, "command started");
        tokio::spawn(async move {
            let status = child.wait().await;
            // What the command left behind in its process group dies with it (and then
            // holds none of its pipes open).
            if let Some(pid) = pid {
                // SAFETY: kill(2) on the process group our child led.
                unsafe {
                    libc::kill(-(pid as libc::pid_t), libc::SIGKILL);
                }
            }
            // Read what it wrote before it exited; a process that left the group and
            // still holds a pipe open does not keep the job waiting.
            let drain = futures::future::join_all(readers);
            if tokio::time::timeout(DRAIN_TIMEOUT, drain).await.is_err() {
                tracing::debug!(node = %label, "output still open after the command exited");
            }
            match status {
                Ok(status) => {
                    let _ = tx.send(NodeEvent::Exited { node, status });
                }
                Err(e) => tracing::warn!(node = %label, error = %e, "cannot wait for child"),
            }
        });
        self.nodes.push(Node { name: name.to_string(), pid, log, running: true, command: Some(shown) });
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

    /// The next event if one is waiting (`Some(None)`: every sender is gone), without
    /// waiting for one.
    pub fn try_next(&mut self) -> Option<Option<NodeEvent>> {
        match self.rx.try_recv() {
            Ok(ev) => {
                if let NodeEvent::Exited { node, .. } = &ev {
                    self.nodes[*node].running = false;
                }
                Some(Some(ev))
            }
            Err(mpsc::error::TryRecvError::Empty) => None,
            Err(mpsc::error::TryRecvError::Disconnected) => Some(None),
        }
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

    /// The names of the nodes still running.
    pub fn running(&self) -> Vec<&str> {
        self.nodes.iter().filter(|n| n.running).map(|n| n.name.as_str()).collect()
    }

    /// Kills node `node` with SIGKILL, as `kill -9` would (its exit comes as a
    /// [`NodeEvent::Exited`]); a node that is not running is left alone.
    pub fn kill(&mut self, node: usize) {
        if let Some(Node { pid: Some(pid), running: true, .. }) = self.nodes.get(node) {
            // SAFETY: kill(2) on a pid we spawned and have not reaped.
            unsafe {
                libc::kill(*pid as libc::pid_t, libc::SIGKILL);
            }
        }
    }

    /// Kills every node still running, and the process group of every user's command
    /// (what its own children left behind, even once the command itself has exited).
    pub fn kill_all(&mut self) {
        for n in self.nodes.iter_mut() {
            let Some(pid) = n.pid else { continue };
            if n.command.is_some() {
                // SAFETY: kill(2) on the process group our child leads (its pid).
                unsafe {
                    libc::kill(-(pid as libc::pid_t), libc::SIGKILL);
                }
            }
            if n.running {
                // SAFETY: kill(2) on a pid we spawned and have not reaped.
                unsafe {
                    libc::kill(pid as libc::pid_t, libc::SIGKILL);
                }
            }
            n.running = false;
        }
    }

    /// Kills every node still running and waits (at most `within`) until each of them has
    /// been reaped, so that none outlives the launcher's return, not even for a moment.
    pub async fn stop(&mut self, within: std::time::Duration) {
        let mut waiting: std::collections::BTreeSet<usize> =
            self.nodes.iter().enumerate().filter(|(_, n)| n.running).map(|(i, _)| i).collect();
        self.kill_all();
        let deadline = tokio::time::Instant::now() + within;
        while !waiting.is_empty() {
            match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Ok(Some(NodeEvent::Exited { node, .. })) => {
                    waiting.remove(&node);
                }
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => {
                    let left: Vec<&str> = waiting.iter().map(|i| self.nodes[*i].name.as_str()).collect();
                    tracing::warn!(?left, "killed nodes not reaped in time");
                    return;
                }
            }
        }
    }

    /// The error for a node that exited with `status`, with the tail of its log: for a
    /// role `server 1 exited with exit status: 1`, for a user's command `worker 1 (pid
    /// 12345: python train.py) was killed by signal 9` or `... exited with status 3`.
    pub fn failure(&self, node: usize, status: ExitStatus) -> LaunchError {
        let n = &self.nodes[node];
        match &n.command {
            None => LaunchError::NodeFailed(format!("{} exited with {status}\n{}", n.name, self.log_tail(node, 12))),
            Some(command) => {
                let how = match (status.code(), status.signal()) {
                    (Some(code), _) => format!("exited with status {code}"),
                    (None, Some(sig)) => format!("was killed by signal {sig}"),
                    (None, None) => format!("exited with {status}"),
                };
                let pid = n.pid.map_or_else(|| "pid ?".to_string(), |p| format!("pid {p}"));
                LaunchError::NodeFailed(format!("{} ({pid}: {command}) {how}\n{}", n.name, self.log_tail(node, 12)))
            }
        }
    }
}

/// Reads event lines from a user's command's pipe until it closes.
async fn read_events(
    mut r: impl AsyncBufRead + Unpin,
    tx: mpsc::UnboundedSender<NodeEvent>,
    node: usize,
    label: String,
) {
    let mut buf = Vec::new();
    let mut warned = false;
    loop {
        buf.clear();
        match r.read_until(b'\n', &mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let line = String::from_utf8_lossy(&buf);
        let line = line.trim_end();
        if line.is_empty() {
            continue;
        }
        match serde_json::from_str::<Event>(line) {
            Ok(event) => {
                let _ = tx.send(NodeEvent::Line { node, event });
            }
            Err(e) if !warned => {
                warned = true;
                tracing::warn!(node = %label, %line, error = %e, "not an event line on fd 3 (further ones are ignored quietly)");
            }
            Err(_) => {}
        }
    }
}

/// Forwards a user's command's output lines (and writes them into its log) until the
/// stream closes.
async fn forward_output(
    mut r: impl AsyncBufRead + Unpin,
    node: usize,
    stderr: bool,
    log: Arc<Mutex<std::fs::File>>,
    tx: mpsc::UnboundedSender<NodeEvent>,
) {
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match r.read_until(b'\n', &mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        if buf.last() != Some(&b'\n') {
            buf.push(b'\n');
        }
        {
            let mut f = log.lock().unwrap_or_else(|e| e.into_inner());
            let _ = f.write_all(&buf);
        }
        let line = String::from_utf8_lossy(&buf).trim_end_matches(['\n', '\r']).to_string();
        let _ = tx.send(NodeEvent::Output { node, line, stderr });
    }
}

/// Checks, before anything starts, that the program of `argv` can be run: a path must be
/// an executable file, a bare name must be one on `PATH`.
pub fn check_program(argv: &[String]) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let Some(program) = argv.first().filter(|p| !p.is_empty()) else {
        return Err(LaunchError::Flags(
            "no worker command: give it after `--`, e.g. `elasticps launch -- python train.py`".into(),
        ));
    };
    let runnable = |p: &Path| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
    let shown = shell_words(argv);
    if program.contains('/') {
        crate::error::ensure_flags!(
            runnable(Path::new(program)),
            "cannot start the worker command `{shown}`: {program} is not an executable file"
        );
    } else {
        let path = std::env::var_os("PATH").unwrap_or_default();
        crate::error::ensure_flags!(
            std::env::split_paths(&path).any(|dir| runnable(&dir.join(program))),
            "cannot start the worker command `{shown}`: {program}: command not found on PATH"
        );
    }
    Ok(())
}

/// A pipe whose two ends are close-on-exec: (read, write).
fn cloexec_pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two new descriptors into the array it is given.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just created and nothing else owns them.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// A command line for messages: words joined by spaces, quoted when they need it.
pub fn shell_words(argv: &[String]) -> String {
    argv.iter()
        .map(|w| {
            let plain = !w.is_empty() && w.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c));
            if plain { w.clone() } else { format!("'{}'", w.replace('\'', r"'\''")) }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// `elasticps ARGS... --events` with stdout piped (the event stream), stderr into `log`,
/// and death with the thread that spawns it (Linux `PR_SET_PDEATHSIG`).
fn role_command(exe: &SelfCommand, args: &[String], env: &[(&str, &str)], log: &Path) -> Result<Command> {
    let stderr = std::fs::File::create(log).map_err(|e| LaunchError::io(format!("creating {}", log.display()), e))?;
    let mut cmd = Command::new(&exe.program);
    cmd.args(&exe.lead)
        .args(args)
        .arg("--events")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .kill_on_drop(true);
    // Every child would bind the same metrics address: each gets its own flag instead.
    cmd.env_remove("ELASTICPS_METRICS_LISTEN");
    // A role prints its events on the stdout we read, even if this launcher was itself
    // started by `elasticps launch`.
    cmd.env_remove(elasticps_runtime::events::EVENTS_FD_VAR);
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
    exe: SelfCommand,
    log_dir: PathBuf,
    /// Transport flags for the servers.
    args: Vec<String>,
    /// Their secrets, as environment variables ([`crate::args::NetArgs::role_env`]).
    env: Vec<(String, String)>,
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
    /// A launcher whose servers get `args` and the secrets of `env`.
    pub fn new(log_dir: &Path, args: Vec<String>, env: Vec<(String, String)>) -> Result<Self> {
        std::fs::create_dir_all(log_dir)
            .map_err(|e| LaunchError::io(format!("creating the log directory {}", log_dir.display()), e))?;
        let exe = SelfCommand::get()?;
        Ok(Self { exe, log_dir: log_dir.to_path_buf(), args, env, started: 0, running: Arc::default() })
    }

    /// A handle to wait for the launched servers once the job is over.
    pub fn launched(&self) -> LaunchedServers {
        LaunchedServers(self.running.clone())
    }

    fn start(&mut self, scheduler_addr: &str) -> Result<()> {
        self.started += 1;
        let log = self.log_dir.join(format!("server-scaled-{}.log", self.started));
        let mut args = vec!["server".into(), "--scheduler".into(), scheduler_addr.into(), "--listen".into()];
        args.push("127.0.0.1:0".into());
        args.extend(self.args.iter().cloned());
        let env: Vec<(&str, &str)> = self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let mut child =
            role_command(&self.exe, &args, &env, &log)?.spawn().map_err(|e| LaunchError::io("starting a server", e))?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| LaunchError::io("child stdout", std::io::ErrorKind::BrokenPipe.into()))?;
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
