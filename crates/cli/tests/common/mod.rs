//! Helpers for integration tests that run the real `elasticps` binary as processes.
//!
//! - [`Proc`]: a child process of the binary, killed when dropped. Its stdout (the JSON
//!   events that roles print with `--events`) is read on a background thread into a
//!   channel, so every read has a timeout; its stderr goes to a log file in a scratch
//!   directory, kept (and its path printed) only if the test panics.
//! - [`start_scheduler`], [`start_scheduler_at`], [`start_server`], [`start_server_on`],
//!   [`start_worker`]: the roles, each started with `--events`.
//! - [`cluster`]: a job's flags, typed ([`cluster::JobSpec`]), a scheduler with its servers,
//!   and workers in process that joined it.
//! - [`models`]: the tests' small models and integer gradients, and the values SGD gives.
//! - [`tiny`]: a tiny job with a cluster secret and a well-behaved worker whose every pull
//!   is checked, for the tests that attack or garble its nodes.
//! - [`tokio_rt`]: a runtime for tests that drive `elasticps_runtime::client::Client` in
//!   process.
//! - Raw frames over `std::net::TcpStream` ([`connect_raw`], [`write_frame`],
//!   [`read_reply`]) for tests that speak the wire protocol by hand.
//!
//! Every wait is bounded in time; nothing loops forever. Children get
//! `PR_SET_PDEATHSIG(SIGKILL)`, so they die with the test thread that spawned them even if
//! the test binary is killed (spawn them from the test's own thread, not from a helper
//! thread that ends early).

#![allow(dead_code)]

pub mod cluster;
pub mod models;
pub mod tiny;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use elasticps_wire::{Codec, FrameHeader, HEADER_LEN, Message, WireError};
use serde_json::Value;

/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_elasticps");
/// How long a role may take to start (print its address, accept connections).
pub const START_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a role may take to exit once its job is over.
pub const EXIT_TIMEOUT: Duration = Duration::from_secs(30);

/// A fresh directory under the system temp dir, unique to this test process and call.
pub fn scratch_dir(tag: &str) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let tag: String = tag.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '-' }).collect();
    let dir = std::env::temp_dir().join(format!("elasticps-it-{}-{n}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
    dir
}

/// Same as [`scratch_dir`]: a fresh, existing directory for a test's files (not removed
/// afterwards).
pub fn temp_dir(tag: &str) -> PathBuf {
    scratch_dir(tag)
}

/// Waits at most `timeout` for a child started by hand to exit (polling `try_wait`).
pub fn wait_timeout(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(s) = child.try_wait().unwrap_or_else(|e| panic!("waiting for a child: {e}")) {
            return Some(s);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `elasticps ARGS...` with stdin closed, stdout and stderr piped, and no `ELASTICPS_*`
/// variable of the test environment, so that the command line alone configures it.
pub fn bin_command(args: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("ELASTICPS_") {
            cmd.env_remove(k);
        }
    }
    cmd
}

/// Runs `cmd` (with stdout and stderr piped) to its end, at most `limit`: its status,
/// stdout and stderr. Past `limit` it is killed, and the test fails with what it printed.
pub fn run_to_end(mut cmd: Command, limit: Duration) -> Output {
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("starting {cmd:?}: {e}"));
    let status = wait_timeout(&mut child, limit);
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let (stdout, stderr) = (read_all(child.stdout.take()), read_all(child.stderr.take()));
    let Some(status) = status else {
        panic!("{cmd:?} did not end within {limit:?}\nstdout:\n{stdout}\nstderr:\n{stderr}");
    };
    Output { status, stdout: stdout.into_bytes(), stderr: stderr.into_bytes() }
}

/// Runs `elasticps ARGS` (see [`bin_command`]) to its end, at most `limit` (see
/// [`run_to_end`]): its status, stdout and stderr.
pub fn run_bin(args: &[&str], limit: Duration) -> (ExitStatus, String, String) {
    let out = run_to_end(bin_command(args), limit);
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status, text(&out.stdout), text(&out.stderr))
}

/// The `report.json` a launcher (`train` or `launch` with `--report DIR`) wrote into `dir`.
pub fn read_report(dir: &std::path::Path) -> Value {
    let path = dir.join("report.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

/// Everything `r` gives until its end, as text (empty for `None`).
pub fn read_all(r: Option<impl Read>) -> String {
    let mut s = String::new();
    if let Some(mut r) = r {
        let _ = r.read_to_string(&mut s);
    }
    s
}

/// A running `elasticps` process; killed (and reaped) when dropped.
pub struct Proc {
    /// A name for messages ("server 1").
    pub name: String,
    child: Child,
    events: mpsc::Receiver<Value>,
    history: Vec<Value>,
    dir: PathBuf,
    log: PathBuf,
    status: Option<ExitStatus>,
}

impl Proc {
    /// Starts `elasticps ARGS...` with stdout piped and stderr logged to a file.
    /// `ELASTICPS_*` variables of the test environment are not passed on, so the command
    /// line alone configures the role.
    pub fn spawn(name: &str, args: &[&str]) -> Proc {
        let dir = scratch_dir(name);
        let log = dir.join("stderr.log");
        let stderr = std::fs::File::create(&log).unwrap_or_else(|e| panic!("creating {}: {e}", log.display()));
        let mut cmd = bin_command(args);
        cmd.stderr(stderr);
        #[cfg(target_os = "linux")]
        {
            use std::os::unix::process::CommandExt;
            // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
            unsafe {
                cmd.pre_exec(|| {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                    Ok(())
                });
            }
        }
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("starting {name} ({BIN}): {e}"));
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, events) = mpsc::channel();
        std::thread::Builder::new()
            .name(format!("{name} stdout"))
            .spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    // Roles print only JSON events on stdout; anything else is kept as a string.
                    let value = serde_json::from_str(&line).unwrap_or(Value::String(line));
                    if tx.send(value).is_err() {
                        break;
                    }
                }
            })
            .expect("spawning a reader thread");
        Proc { name: name.to_string(), child, events, history: Vec::new(), dir, log, status: None }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The next line of stdout as JSON, waiting at most `timeout`; `None` on timeout or
    /// once stdout is closed and drained. Every line read is also kept in [`Proc::events`].
    pub fn read_event_line(&mut self, timeout: Duration) -> Option<Value> {
        let v = self.events.recv_timeout(timeout).ok()?;
        self.history.push(v.clone());
        Some(v)
    }

    /// The next event named `name` (`{"event": name, ...}`), skipping others, waiting at
    /// most `timeout` in all.
    pub fn wait_event(&mut self, name: &str, timeout: Duration) -> Option<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.checked_duration_since(Instant::now())?;
            let v = self.read_event_line(left)?;
            if event_name(&v) == Some(name) {
                return Some(v);
            }
        }
    }

    /// Every line read so far, in order.
    pub fn events(&self) -> &[Value] {
        &self.history
    }

    /// The events named `name` read so far.
    pub fn events_named(&self, name: &str) -> Vec<&Value> {
        self.history.iter().filter(|v| event_name(v) == Some(name)).collect()
    }

    /// The `server_stats` event a server prints once, as it ends: its final counters.
    pub fn server_stats(&self) -> &Value {
        let stats = self.history.iter().find(|v| event_name(v) == Some("server_stats"));
        stats.unwrap_or_else(|| panic!("{} printed no server_stats", self.name))
    }

    /// Reads every remaining event until stdout closes, then waits for the exit status;
    /// at most `timeout` in all. `None` if the process is still running at the deadline.
    pub fn finish(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match self.events.recv_timeout(left) {
                Ok(v) => self.history.push(v),
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
                Err(mpsc::RecvTimeoutError::Timeout) => return None,
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        self.wait_exit(left.max(Duration::from_millis(100)))
    }

    /// The exit status if the process has exited (non-blocking).
    pub fn try_exit(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().unwrap_or_else(|e| panic!("waiting for {}: {e}", self.name));
        }
        self.status
    }

    /// Waits at most `timeout` for the process to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.try_exit() {
                return Some(s);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Asserts that the process exits with status 0 within `timeout`, reading its
    /// remaining events on the way (see [`Proc::finish`]).
    pub fn assert_success(&mut self, timeout: Duration) {
        match self.finish(timeout) {
            Some(s) if s.success() => {}
            Some(s) => panic!("{} exited with {s}\n{}", self.name, self.log_tail(30)),
            None => panic!("{} did not exit within {timeout:?}\n{}", self.name, self.log_tail(30)),
        }
    }

    /// True if the process exits with status 0 within `timeout` (its remaining events are
    /// read on the way, see [`Proc::finish`]).
    pub fn wait_success(&mut self, timeout: Duration) -> bool {
        self.finish(timeout).is_some_and(|s| s.success())
    }

    /// Kills the process (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        if self.try_exit().is_none() {
            let _ = self.child.kill();
            self.status = self.child.wait().ok();
        }
    }

    /// The process's stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last `lines` lines of stderr, labelled, for assertion messages.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = self.log();
        let all: Vec<&str> = text.lines().collect();
        format!(
            "--- last lines of {} ({}):\n{}",
            self.name,
            self.log.display(),
            all[all.len().saturating_sub(lines)..].join("\n")
        )
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!("{}: stderr kept in {}", self.name, self.log.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// The `"event"` field of an event line.
pub fn event_name(v: &Value) -> Option<&str> {
    v.get("event").and_then(Value::as_str)
}

/// Starts `elasticps scheduler --listen 127.0.0.1:0 --events ARGS...` and waits (at most
/// [`START_TIMEOUT`]) for its `listening` event; returns it with its address.
pub fn start_scheduler(args: &[&str]) -> (Proc, String) {
    start_scheduler_at("scheduler", "127.0.0.1:0", args)
}

/// Starts `elasticps scheduler --listen LISTEN --events ARGS...` as `name` and waits (at
/// most [`START_TIMEOUT`]) for its `listening` event; returns it with its address.
pub fn start_scheduler_at(name: &str, listen: &str, args: &[&str]) -> (Proc, String) {
    let mut all = vec!["scheduler", "--listen", listen, "--events"];
    all.extend_from_slice(args);
    let mut p = Proc::spawn(name, &all);
    let Some(ev) = p.wait_event("listening", START_TIMEOUT) else {
        panic!("{name} did not listen on {listen} within {START_TIMEOUT:?}\n{}", p.log_tail(30));
    };
    let addr = ev["addr"].as_str().unwrap_or_else(|| panic!("listening event without addr: {ev}")).to_string();
    (p, addr)
}

/// The flags as `&str`s.
pub fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// Starts `elasticps server --scheduler SCHED --listen 127.0.0.1:0 --events EXTRA...`.
/// Its data address is only known to the scheduler (and to workers through the layout);
/// use [`start_server_on`] when the test must dial the server itself.
pub fn start_server(sched_addr: &str, extra: &[&str]) -> Proc {
    let mut all = vec!["server", "--scheduler", sched_addr, "--listen", "127.0.0.1:0", "--events"];
    all.extend_from_slice(extra);
    Proc::spawn("server", &all)
}

/// Starts a server on a free port the test knows, and waits (at most [`START_TIMEOUT`])
/// until it accepts connections; returns it with its data address.
///
/// The port is found by binding `127.0.0.1:0` and closing it again, so another process may
/// take it in between (a tiny race); a server that then fails to bind exits at once, and
/// this retries with a new port, up to 5 times.
pub fn start_server_on(sched_addr: &str, extra: &[&str]) -> (Proc, String) {
    for _attempt in 0..5 {
        let addr = free_local_addr();
        let mut all = vec!["server", "--scheduler", sched_addr, "--listen", addr.as_str(), "--events"];
        all.extend_from_slice(extra);
        let mut p = Proc::spawn(&format!("server on {addr}"), &all);
        let deadline = Instant::now() + START_TIMEOUT;
        let sock: SocketAddr = addr.parse().expect("a socket address");
        loop {
            if let Some(status) = p.try_exit() {
                let log = p.log();
                if log.contains("binding") {
                    break; // the port was taken meanwhile: try another one
                }
                panic!("server on {addr} exited with {status} before accepting connections\n{}", p.log_tail(30));
            }
            if TcpStream::connect_timeout(&sock, Duration::from_millis(200)).is_ok() {
                return (p, addr);
            }
            assert!(
                Instant::now() < deadline,
                "server on {addr} did not accept within {START_TIMEOUT:?}\n{}",
                p.log_tail(30)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    panic!("could not start a server on a free port in 5 attempts");
}

/// Starts `elasticps worker --scheduler SCHED --events EXTRA...`.
pub fn start_worker(sched_addr: &str, extra: &[&str]) -> Proc {
    let mut all = vec!["worker", "--scheduler", sched_addr, "--events"];
    all.extend_from_slice(extra);
    Proc::spawn("worker", &all)
}

/// A multi-thread tokio runtime with 2 workers, for in-process clients.
pub fn tokio_rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("a tokio runtime")
}

/// `127.0.0.1:PORT` with a port that was free a moment ago (see [`start_server_on`]).
pub fn free_local_addr() -> String {
    let l = TcpListener::bind("127.0.0.1:0").expect("binding 127.0.0.1:0");
    l.local_addr().expect("bound address").to_string()
}

/// Polls `f` every 10 ms until it returns `Some`, at most `timeout`.
pub fn poll_until<T>(timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

// ---------------------------------------------------------------------------------------
// Raw frames over std TcpStream.

/// A blocking connection with no delay and 10 s read/write timeouts that passed the
/// handshake with `secret`; ready for raw frames.
pub fn connect_raw(addr: &str, secret: &[u8]) -> TcpStream {
    let mut s = connect_unauthenticated(addr);
    handshake_raw(&mut s, secret).unwrap_or_else(|e| panic!("handshake with {addr}: {e}"));
    s
}

/// The dialer's side of the handshake on a blocking stream (what the runtime does).
pub fn handshake_raw(s: &mut TcpStream, secret: &[u8]) -> Result<(), String> {
    handshake_raw_with(s, elasticps_wire::KeyId::Cluster, secret)
}

/// [`connect_raw`] with the handshake of `key` (`KeyId::Worker`: the `--worker-secret`).
pub fn connect_raw_with(addr: &str, key: elasticps_wire::KeyId, secret: &[u8]) -> TcpStream {
    let mut s = connect_unauthenticated(addr);
    handshake_raw_with(&mut s, key, secret).unwrap_or_else(|e| panic!("handshake with {addr}: {e}"));
    s
}

/// [`handshake_raw`] with the key `key` names and its `secret`.
pub fn handshake_raw_with(s: &mut TcpStream, key: elasticps_wire::KeyId, secret: &[u8]) -> Result<(), String> {
    use elasticps_wire::handshake::{ClientHandshake, HELLO_LEN, NONCE_LEN, VERDICT_LEN};
    let nonce: [u8; NONCE_LEN] = std::array::from_fn(|i| (i as u8).wrapping_mul(37) ^ std::process::id() as u8);
    let (client, hello) = ClientHandshake::start_with(key, secret, nonce);
    s.write_all(&hello).map_err(|e| e.to_string())?;
    let mut reply = [0u8; HELLO_LEN];
    s.read_exact(&mut reply).map_err(|e| e.to_string())?;
    let (client, proof) = client.on_hello(&reply).map_err(|e| e.to_string())?;
    s.write_all(&proof).map_err(|e| e.to_string())?;
    let mut verdict = [0u8; VERDICT_LEN];
    s.read_exact(&mut verdict).map_err(|e| e.to_string())?;
    client.on_verdict(&verdict).map_err(|e| e.to_string())
}

/// A blocking connection with no delay and 10 s read/write timeouts, before any handshake.
pub fn connect_unauthenticated(addr: &str) -> TcpStream {
    let sock: SocketAddr = addr.parse().unwrap_or_else(|e| panic!("{addr}: {e}"));
    let s = TcpStream::connect_timeout(&sock, Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("connecting to {addr}: {e}"));
    s.set_nodelay(true).expect("nodelay");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("read timeout");
    s.set_write_timeout(Some(Duration::from_secs(10))).expect("write timeout");
    s
}

/// Writes one frame (header and payload).
pub fn write_frame(s: &mut TcpStream, codec: &Codec, request_id: u64, msg: &Message) -> std::io::Result<()> {
    let (head, payload) = codec.encode(request_id, msg).expect("encodable message");
    let mut buf = head.to_vec();
    buf.extend_from_slice(&payload);
    s.write_all(&buf)
}

/// What a read of one frame found.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // a test helper: one reply at a time
pub enum Reply {
    /// A whole, valid frame.
    Frame(FrameHeader, Message),
    /// The peer closed the connection cleanly at a frame boundary.
    Eof,
    /// The peer reset the connection (at a frame boundary).
    Reset,
    /// Nothing (or only part of a frame) arrived in time.
    TimedOut,
    /// The connection ended in the middle of a frame (`got` of `wanted` bytes).
    Truncated {
        /// Bytes read.
        got: usize,
        /// Bytes expected.
        wanted: usize,
    },
    /// The bytes are not a valid frame for this codec.
    Invalid(WireError),
}

/// Reads one frame with `codec`, waiting at most `timeout` in all.
pub fn read_reply(s: &mut TcpStream, codec: &Codec, timeout: Duration) -> Reply {
    let deadline = Instant::now() + timeout;
    let mut head = [0u8; HEADER_LEN];
    match read_full(s, &mut head, deadline) {
        Full::Done => {}
        Full::Eof(0) => return Reply::Eof,
        Full::Reset(0) => return Reply::Reset,
        Full::Eof(got) | Full::Reset(got) => return Reply::Truncated { got, wanted: HEADER_LEN },
        Full::TimedOut => return Reply::TimedOut,
    }
    let h = match codec.decode_header(&head) {
        Ok(h) => h,
        Err(e) => return Reply::Invalid(e),
    };
    let mut payload = vec![0u8; h.payload_len as usize];
    match read_full(s, &mut payload, deadline) {
        Full::Done => {}
        Full::Eof(got) | Full::Reset(got) => {
            return Reply::Truncated { got: HEADER_LEN + got, wanted: HEADER_LEN + payload.len() };
        }
        Full::TimedOut => return Reply::TimedOut,
    }
    match Message::decode(&h, payload.into()) {
        Ok(m) => Reply::Frame(h, m),
        Err(e) => Reply::Invalid(e),
    }
}

/// Sends the header of a `kind` frame of `len` payload bytes on `s` (request id 9) and no
/// byte of its payload: the peer must refuse it from the header alone, with an `Error`
/// of `code` whose message mentions `words`, then close the connection (PROTOCOL.md §2,
/// check 8).
pub fn assert_refused_from_header(
    s: &mut TcpStream,
    codec: &Codec,
    (kind, len): (elasticps_wire::Kind, u32),
    code: elasticps_wire::ErrorCode,
    words: &str,
) {
    let head = codec.encode_header(&FrameHeader {
        kind,
        request_id: 9,
        block: 0,
        clock: 0,
        payload_len: len,
        flags: elasticps_wire::Flags::default(),
    });
    s.write_all(&head).expect("the header");
    match read_reply(s, codec, Duration::from_secs(5)) {
        Reply::Frame(h, Message::Error(e)) => {
            assert_eq!((h.request_id, e.code), (9, code), "{kind:?}: {e:?}");
            assert!(e.message.contains(words), "{kind:?}: {}", e.message);
        }
        other => panic!("a {kind:?} header of {len} bytes: expected an Error from its header, got {other:?}"),
    }
    assert!(matches!(read_reply(s, codec, Duration::from_secs(5)), Reply::Eof | Reply::Reset), "closed");
}

/// Sends `msg` and reads the next frame, which must be a valid one; returns it.
pub fn call_raw(s: &mut TcpStream, codec: &Codec, request_id: u64, msg: &Message) -> (FrameHeader, Message) {
    write_frame(s, codec, request_id, msg).unwrap_or_else(|e| panic!("sending {:?}: {e}", msg.kind()));
    match read_reply(s, codec, Duration::from_secs(10)) {
        Reply::Frame(h, m) => (h, m),
        other => panic!("expected a reply to {:?} (request {request_id}), got {other:?}", msg.kind()),
    }
}

enum Full {
    Done,
    Eof(usize),
    Reset(usize),
    TimedOut,
}

fn read_full(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> Full {
    let mut got = 0;
    while got < buf.len() {
        let Some(left) = deadline.checked_duration_since(Instant::now()).filter(|d| !d.is_zero()) else {
            return Full::TimedOut;
        };
        s.set_read_timeout(Some(left)).expect("read timeout");
        match s.read(&mut buf[got..]) {
            Ok(0) => return Full::Eof(got),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return Full::TimedOut;
            }
            Err(e)
                if matches!(e.kind(), std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionAborted) =>
            {
                return Full::Reset(got);
            }
            Err(e) => panic!("reading from a raw connection: {e}"),
        }
    }
    Full::Done
}

/// Waits for every worker task, at most 60 s each, in order.
pub async fn join_workers<T>(tasks: Vec<tokio::task::JoinHandle<T>>) -> Vec<T> {
    let mut out = Vec::new();
    for t in tasks {
        out.push(
            tokio::time::timeout(Duration::from_secs(60), t).await.expect("worker timed out").expect("worker panicked"),
        );
    }
    out
}

// ---------------------------------------------------------------------------------------
// Process trees of a launcher (`elasticps train` / `elasticps launch`).

/// The pids of `pid`'s children, with their command lines.
pub fn children(pid: u32) -> Vec<(u32, String)> {
    let list = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    list.split_whitespace()
        .filter_map(|p| p.parse().ok())
        .map(|p: u32| {
            let cmdline = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
            (p, String::from_utf8_lossy(&cmdline).replace('\0', " "))
        })
        .collect()
}

/// Waits (at most 30 s) until the launcher `child` has at least `n` children; returns them.
pub fn wait_for_children(child: &Child, n: usize) -> Vec<(u32, String)> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let kids = children(child.id());
        if kids.len() >= n || Instant::now() > deadline {
            return kids;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Sends `signal` (`libc::SIGKILL`, `libc::SIGINT`) to `pid`, a process the test started
/// (a launcher, or one of its children).
pub fn send_signal(pid: u32, signal: libc::c_int) {
    // SAFETY: kill(2) touches no memory; the pid is of a process this test started.
    unsafe { libc::kill(pid as libc::pid_t, signal) };
}

/// True if `pid` is a live process (a zombie counts as dead).
pub fn alive(pid: u32) -> bool {
    // A zombie is dead for our purposes; /proc/PID/stat field 3 is the state.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s.split_whitespace().nth(2).is_none_or(|st| st != "Z"))
}

/// Asserts that every process of `pids` is gone within 10 s.
pub fn assert_all_gone(pids: &[(u32, String)]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids.iter().any(|(p, _)| alive(*p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let left: Vec<_> = pids.iter().filter(|(p, _)| alive(*p)).collect();
    assert!(left.is_empty(), "orphan processes left behind: {left:?}");
}
