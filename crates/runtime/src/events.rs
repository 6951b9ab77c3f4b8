//! Machine-readable progress that nodes write for a launcher, one JSON object per line:
//! the roles print them on stdout when started with `--events`; a worker started by
//! `elasticps launch` writes them to the file descriptor named by `ELASTICPS_EVENTS_FD`
//! (so the user's own stdout stays free). `elasticps train` and `elasticps launch` read
//! them to draw progress bars and write the report. The Python package writes the same
//! lines through this module, so the format has one definition.
//!
//! A line is an [`Event`], tagged by `"event"`:
//!
//! ```text
//! {"event":"listening","addr":"127.0.0.1:7000"}
//! {"event":"joined","rank":0}
//! {"event":"progress","rank":0,"iteration":10,"total":600,"loss":0.31}
//! {"event":"log","rank":0,"step":10,"metrics":{"loss":0.31,"accuracy":0.97,"total":600}}
//! {"event":"worker_done","rank":0,"iterations":600,...}
//! ```
//!
//! Non-finite numbers (a diverged loss) are written as `null` by `serde_json`; they read
//! back as `NaN`, so such a line is never dropped.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::os::fd::{FromRawFd, RawFd};
use std::sync::{Arc, Mutex, OnceLock};

pub use elasticps_node::events::{Event, WorkerReport, f64_or_nan};

use crate::RuntimeError;

/// The variable that names the file descriptor a launched worker writes its events to.
pub const EVENTS_FD_VAR: &str = "ELASTICPS_EVENTS_FD";

/// Where an [`Emitter`] writes.
#[derive(Clone, Debug)]
enum Sink {
    Nowhere,
    Stdout,
    Fd(Arc<Mutex<File>>),
}

/// Writes events, one whole line each, flushed at once: to the launcher's pipe, to
/// stdout, or nowhere. Cheap to clone (clones share the file).
#[derive(Clone, Debug)]
pub struct Emitter {
    sink: Sink,
}

impl Emitter {
    /// An emitter that prints on stdout if `enabled`, and writes nothing otherwise.
    pub fn new(enabled: bool) -> Self {
        Self { sink: if enabled { Sink::Stdout } else { Sink::Nowhere } }
    }

    /// The emitter a worker's environment asks for: the file descriptor named by
    /// `ELASTICPS_EVENTS_FD` if it is set (a launcher's pipe), else stdout if `stdout`
    /// (the `--events` flag), else nothing.
    pub fn from_env(stdout: bool) -> Result<Self, RuntimeError> {
        match std::env::var(EVENTS_FD_VAR) {
            Ok(v) if !v.trim().is_empty() => {
                let fd: RawFd = v.trim().parse().map_err(|_| {
                    RuntimeError::Usage(format!("{EVENTS_FD_VAR}={v:?} is not a file descriptor number"))
                })?;
                Self::to_fd(fd)
            }
            _ => Ok(Self::new(stdout)),
        }
    }

    /// An emitter that writes to the open file descriptor `fd`, which it takes over: the
    /// descriptor is opened once per process (every emitter for `fd` shares it) and marked
    /// close-on-exec, so the caller's own child processes do not inherit the pipe.
    pub fn to_fd(fd: RawFd) -> Result<Self, RuntimeError> {
        static OPENED: OnceLock<Mutex<BTreeMap<RawFd, Arc<Mutex<File>>>>> = OnceLock::new();
        let mut opened = OPENED.get_or_init(Mutex::default).lock().unwrap_or_else(|e| e.into_inner());
        if let Some(file) = opened.get(&fd) {
            return Ok(Self { sink: Sink::Fd(file.clone()) });
        }
        if fd < 0 {
            return Err(RuntimeError::Usage(format!("{EVENTS_FD_VAR}={fd} is not a file descriptor number")));
        }
        // SAFETY: fcntl on an integer only queries (then sets) descriptor flags; it touches
        // no memory.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
        if flags < 0 {
            return Err(RuntimeError::io(
                format!(
                    "{EVENTS_FD_VAR}={fd} names no open file descriptor (was this process started by `elasticps launch`?)"
                ),
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: as above.
        unsafe { libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC) };
        // SAFETY: `fd` is open (checked above) and was handed to this process for its
        // events; the registry above makes this the only `File` that owns it.
        let file = Arc::new(Mutex::new(unsafe { File::from_raw_fd(fd) }));
        opened.insert(fd, file.clone());
        Ok(Self { sink: Sink::Fd(file) })
    }

    /// True if events go somewhere.
    pub fn is_enabled(&self) -> bool {
        !matches!(self.sink, Sink::Nowhere)
    }

    /// Writes one event line and flushes it, so a reader sees it at once. A reader that
    /// went away is not an error: the line is dropped.
    pub fn emit(&self, event: &Event) {
        if !self.is_enabled() {
            return;
        }
        let Ok(line) = serde_json::to_string(event) else { return };
        self.emit_line(&line);
    }

    /// Writes one event line already in JSON (a node's, relayed by its host agent), as
    /// [`Emitter::emit`] does.
    pub fn emit_line(&self, line: &str) {
        let line = format!("{}\n", line.trim_end());
        match &self.sink {
            Sink::Nowhere => {}
            Sink::Stdout => {
                let mut out = std::io::stdout().lock();
                let _ = out.write_all(line.as_bytes());
                let _ = out.flush();
            }
            Sink::Fd(file) => {
                let mut f = file.lock().unwrap_or_else(|e| e.into_inner());
                if let Err(e) = f.write_all(line.as_bytes()).and_then(|()| f.flush()) {
                    tracing::debug!(error = %e, "cannot write an event line");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader};
    use std::os::fd::{IntoRawFd, OwnedFd};

    fn pipe() -> (File, OwnedFd) {
        let mut fds = [0; 2];
        // SAFETY: pipe writes two descriptors into the array it is given.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0, "pipe: {}", std::io::Error::last_os_error());
        // SAFETY: both descriptors were just created and are owned by nothing else.
        unsafe { (File::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
    }

    #[test]
    fn an_fd_emitter_writes_whole_lines_once_per_process() {
        let (read, write) = pipe();
        let fd = write.into_raw_fd();
        let a = Emitter::to_fd(fd).expect("an open pipe");
        let b = Emitter::to_fd(fd).expect("the same descriptor again");
        // SAFETY: F_GETFD only reads descriptor flags.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
        assert!(flags & libc::FD_CLOEXEC != 0, "the pipe must not leak into the worker's children");
        a.emit(&Event::Listening { addr: "a".into() });
        b.emit(&Event::Listening { addr: "b".into() });
        let mut lines = BufReader::new(read).lines();
        for want in ["a", "b"] {
            let line = lines.next().expect("a line").expect("readable");
            assert!(matches!(serde_json::from_str(&line), Ok(Event::Listening { addr }) if addr == want), "{line}");
        }
        assert!(a.is_enabled() && !Emitter::new(false).is_enabled());
    }

    #[test]
    fn a_closed_fd_is_a_clear_error() {
        // Far above any descriptor this test process opens.
        let fd = 999_999;
        let err = Emitter::to_fd(fd).unwrap_err().to_string();
        assert!(err.contains("ELASTICPS_EVENTS_FD=999999 names no open file descriptor"), "{err}");
        assert!(Emitter::to_fd(-1).is_err());
    }
}
