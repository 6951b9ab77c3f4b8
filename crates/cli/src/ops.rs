//! Operator commands against a running scheduler: `elasticps status` (the cluster as the
//! scheduler sees it) and `elasticps scale` (add a server, drain and remove one, or move
//! one block by hand).
//!
//! Both open a control connection to the scheduler and send one request without
//! registering (docs/PROTOCOL.md §6.7): `GetStatus`, answered `Status(ClusterStatus)`, and
//! `Scale(ScaleRequest)`, answered `Ok` or an `Error`.

use std::io::{IsTerminal, Write};
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use elasticps_runtime::RuntimeError;
use elasticps_runtime::session::{Notifications, SchedLink};
use elasticps_wire::{ClusterStatus, Codec, Control, Message, ScaleRequest};

use elasticps_launch::args::NetArgs;
use elasticps_report::table::markdown_table;

/// How long the scheduler may take to answer one request.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// `elasticps status`: servers, workers, balancing and migrations of a running job.
#[derive(Args, Clone, Debug)]
pub struct StatusCmd {
    /// The scheduler's address.
    #[arg(long, env = "ELASTICPS_SCHEDULER", default_value = "127.0.0.1:7000")]
    pub scheduler: String,
    /// Print the status as JSON (with --watch: one object per line).
    #[arg(long)]
    pub json: bool,
    /// Refresh every SECS seconds until Ctrl-C or the scheduler goes away.
    #[arg(long, value_name = "SECS", value_parser = parse_secs)]
    pub watch: Option<Duration>,
    /// Transport settings.
    #[command(flatten)]
    pub net: NetArgs,
}

/// `elasticps scale`: ask the scheduler for one server more or less, or to move a block.
#[derive(Args, Clone, Debug)]
pub struct ScaleCmd {
    /// The scheduler's address.
    #[arg(long, env = "ELASTICPS_SCHEDULER", default_value = "127.0.0.1:7000")]
    pub scheduler: String,
    /// Transport settings.
    #[command(flatten)]
    pub net: NetArgs,
    /// What to do.
    #[command(subcommand)]
    pub action: ScaleAction,
}

/// A scaling action.
#[derive(Subcommand, Clone, Debug, PartialEq, Eq)]
pub enum ScaleAction {
    /// Start one more server (through the scheduler's launcher) and move load to it.
    AddServer,
    /// Drain server IDX's blocks to the other servers, then stop it.
    RemoveServer {
        /// The server id (as `elasticps status` shows it).
        idx: u32,
    },
    /// Move one block to another server (after the migrations already planned).
    MoveBlock {
        /// The block id.
        block: u32,
        /// The server id of its new owner.
        to: u32,
    },
}

impl ScaleAction {
    fn request(&self) -> ScaleRequest {
        match self {
            ScaleAction::AddServer => ScaleRequest::AddServer,
            ScaleAction::RemoveServer { idx } => ScaleRequest::RemoveServer(*idx),
            ScaleAction::MoveBlock { block, to } => ScaleRequest::MoveBlock { block: *block, to: *to },
        }
    }
}

fn parse_secs(s: &str) -> Result<Duration, String> {
    match s.trim().parse::<f64>() {
        Ok(secs) if secs.is_finite() && secs > 0.0 && secs <= 86_400.0 => Ok(Duration::from_secs_f64(secs)),
        _ => Err(format!("expected a number of seconds above 0 (e.g. 2 or 0.5), got {s:?}")),
    }
}

/// Runs `elasticps status`.
pub async fn status(cmd: StatusCmd) -> anyhow::Result<()> {
    cmd.net.install()?;
    let (peer, notes) = connect(&cmd.scheduler, cmd.net.codec()).await?;
    let Some(every) = cmd.watch else {
        let status = get_status(&peer, &cmd.scheduler).await?;
        print(&status_text(&status, cmd.json, false));
        return Ok(());
    };
    tokio::select! {
        r = watch(&cmd, &peer, notes, every) => r,
        r = tokio::signal::ctrl_c() => r.context("cannot wait for Ctrl-C"),
    }
}

/// `--watch`: prints the status every `every` until the scheduler goes away.
// The sleep paces an operator's display (`--watch`'s interval), a rule of no process,
// so clippy.toml's ban does not apply.
#[allow(clippy::disallowed_methods)]
async fn watch(cmd: &StatusCmd, peer: &SchedLink, mut notes: Notifications, every: Duration) -> anyhow::Result<()> {
    let clear = !cmd.json && std::io::stdout().is_terminal();
    let mut first = true;
    loop {
        let status = match get_status(peer, &cmd.scheduler).await {
            Ok(s) => s,
            // Seen once, then gone: the job ended (or the scheduler died). Not an error.
            Err(e) if !first && is_gone(&e) => {
                eprintln!("the scheduler at {} went away", cmd.scheduler);
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        first = false;
        let mut text = status_text(&status, cmd.json, true);
        if clear {
            text = format!(
                "\x1b[H\x1b[2J{}  (every {:.1} s, Ctrl-C to stop)\n\n{text}",
                cmd.scheduler,
                every.as_secs_f64()
            );
        } else if !cmd.json {
            text.push('\n');
        }
        print(&text);
        let until = tokio::time::Instant::now() + every;
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(until) => break,
                note = notes.recv() => match note {
                    None => {
                        eprintln!("the scheduler at {} went away", cmd.scheduler);
                        return Ok(());
                    }
                    Some(Message::Control(Control::Shutdown { reason })) => {
                        eprintln!("the scheduler at {} shuts down: {reason}", cmd.scheduler);
                        return Ok(());
                    }
                    Some(_) => {}
                },
            }
        }
    }
}

/// Runs `elasticps scale`.
pub async fn scale(cmd: ScaleCmd) -> anyhow::Result<()> {
    cmd.net.install()?;
    let (peer, _notes) = connect(&cmd.scheduler, cmd.net.codec()).await?;
    let done = request_scale(&peer, &cmd.scheduler, cmd.action.request()).await?;
    println!("{done}");
    Ok(())
}

fn print(text: &str) {
    let mut out = std::io::stdout().lock();
    // A closed pipe (`elasticps status | head`) is not worth a panic.
    let _ = out.write_all(text.as_bytes()).and_then(|()| out.flush());
}

/// Opens a control connection to the scheduler.
async fn connect(addr: &str, codec: Codec) -> anyhow::Result<(SchedLink, Notifications)> {
    SchedLink::operator(addr, codec).await.map_err(|e| {
        let why = match e {
            RuntimeError::Io { source, .. } => source.to_string(),
            RuntimeError::Timeout { after, .. } => format!("no connection within {:.0} s", after.as_secs_f64()),
            other => other.to_string(),
        };
        anyhow::anyhow!("cannot reach the scheduler at {addr}: {why}")
    })
}

/// Asks for the cluster's status.
async fn get_status(peer: &SchedLink, addr: &str) -> anyhow::Result<ClusterStatus> {
    match ask(peer, addr, Control::GetStatus, "the status").await? {
        Control::Status(s) => Ok(s),
        other => bail!("the scheduler at {addr} answered GetStatus with {}", variant(&other)),
    }
}

/// Sends a scale request; returns what to tell the operator.
async fn request_scale(peer: &SchedLink, addr: &str, req: ScaleRequest) -> anyhow::Result<String> {
    match ask(peer, addr, Control::Scale(req), "the scale request").await? {
        Control::Ok => Ok(match req {
            ScaleRequest::AddServer => "scale-out requested".to_string(),
            ScaleRequest::RemoveServer(idx) => format!("server {idx} drains and stops"),
            ScaleRequest::MoveBlock { block, to } => format!("block {block} moves to server {to}"),
        }),
        other => bail!("the scheduler at {addr} answered the scale request with {}", variant(&other)),
    }
}

/// One request to the scheduler; errors say what went wrong in operator terms.
async fn ask(peer: &SchedLink, addr: &str, msg: Control, what: &str) -> anyhow::Result<Control> {
    let reply = peer.call(msg.into(), ANSWER_TIMEOUT, || format!("the scheduler at {addr} to answer")).await;
    match reply {
        Ok(Message::Control(c)) => Ok(c),
        Ok(other) => bail!("the scheduler at {addr} answered with a {:?} frame", other.kind()),
        Err(RuntimeError::Remote { reply, .. }) => {
            bail!("the scheduler at {addr} refused {what}: {} ({:?})", reply.message, reply.code)
        }
        Err(e @ RuntimeError::Closed(_)) => Err(anyhow::Error::new(e).context(format!(
            "the scheduler at {addr} closed the connection without answering \
             (a wrong --secret / ELASTICPS_SECRET, or a scheduler that does not take operator requests)"
        ))),
        Err(e) => Err(anyhow::Error::new(e).context(format!("no answer from the scheduler at {addr}"))),
    }
}

/// The connection is gone (as opposed to a refusal or a bad answer).
fn is_gone(e: &anyhow::Error) -> bool {
    e.chain()
        .any(|c| matches!(c.downcast_ref::<RuntimeError>(), Some(RuntimeError::Closed(_) | RuntimeError::Io { .. })))
}

/// The variant's name, for "answered with ..." errors (not the whole message).
fn variant(c: &Control) -> String {
    let debug = format!("{c:?}");
    debug.split([' ', '(', '{']).next().unwrap_or_default().to_string()
}

/// What `status` prints: pretty JSON, one JSON line (watching), or the tables.
fn status_text(status: &ClusterStatus, json: bool, watching: bool) -> String {
    if !json {
        return render_status(status);
    }
    // ClusterStatus holds strings and numbers only: serializing cannot fail.
    let mut s = if watching { serde_json::to_string(status) } else { serde_json::to_string_pretty(status) }
        .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
    s.push('\n');
    s
}

/// The status as text: a summary line, the servers table and the workers table.
pub fn render_status(s: &ClusterStatus) -> String {
    let plural = if s.migrations == 1 { "" } else { "s" };
    let mut out = format!("balance {}, placement epoch {}, {} migration{plural}\n", s.balance, s.epoch, s.migrations);
    let stragglers: Vec<String> = s.servers.iter().filter(|v| v.straggler).map(|v| v.id.to_string()).collect();
    if !stragglers.is_empty() {
        out.push_str(&format!("straggler: server {}\n", stragglers.join(", ")));
    }

    out.push_str(&format!("\nservers ({})\n", s.servers.len()));
    let rows: Vec<Vec<String>> = s
        .servers
        .iter()
        .map(|v| {
            vec![
                v.id.to_string(),
                v.addr.clone(),
                v.state.clone(),
                v.blocks.to_string(),
                format!("{:.2}", v.bytes as f64 / 1e6),
                // 0: not measured yet.
                positive(v.rate_bps / 1e6, 1),
                if v.rate_bps > 0.0 && v.confidence.is_finite() {
                    format!("{:.0}%", v.confidence.clamp(0.0, 1.0) * 100.0)
                } else {
                    String::new()
                },
                positive(v.service_ms, 1),
                if v.straggler { "yes".into() } else { String::new() },
            ]
        })
        .collect();
    out.push_str(&markdown_table(
        &["id", "addr", "state", "blocks", "MB", "rate MB/s", "conf", "service ms", "straggler"],
        &rows,
    ));

    out.push_str(&format!("\nworkers ({})\n", s.workers.len()));
    let rows: Vec<Vec<String>> = s
        .workers
        .iter()
        .map(|w| {
            vec![
                w.rank.to_string(),
                w.clock.to_string(),
                positive(w.iter_ms, 1),
                if w.done { "yes".into() } else { "no".into() },
            ]
        })
        .collect();
    out.push_str(&markdown_table(&["rank", "clock", "iter ms", "done"], &rows));
    out
}

/// `x` with `digits` decimals, or an empty cell when it is not a positive number (not
/// measured yet).
fn positive(x: f64, digits: usize) -> String {
    if x.is_finite() && x > 0.0 { format!("{x:.digits$}") } else { String::new() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use elasticps_runtime::conn;
    use elasticps_wire::{ErrorCode, ErrorReply, ServerStatus, WorkerStatus};

    fn sample() -> ClusterStatus {
        let server = |id: u32, state: &str, bytes: u64, rate_bps: f64, service_ms: f64, straggler: bool| ServerStatus {
            id,
            addr: format!("10.0.0.{}:7001", id + 5),
            state: state.into(),
            blocks: 3 + id,
            bytes,
            rate_bps,
            confidence: 0.8,
            service_ms,
            straggler,
        };
        ClusterStatus {
            balance: "psld".into(),
            epoch: 7,
            migrations: 3,
            servers: vec![
                server(0, "serving", 12_582_912, 250e6, 50.3, false),
                server(1, "serving", 4_194_304, 21.5e6, 195.04, true),
                server(2, "joining", 0, 0.0, 0.0, false),
            ],
            workers: vec![
                WorkerStatus { rank: 0, clock: 118, iter_ms: 212.25, done: false },
                WorkerStatus { rank: 1, clock: 120, iter_ms: f64::NAN, done: true },
            ],
        }
    }

    #[test]
    fn the_status_reads_as_two_aligned_tables() {
        let text = render_status(&sample());
        let want = "\
balance psld, placement epoch 7, 3 migrations
straggler: server 1

servers (3)
| id | addr          | state   | blocks |    MB | rate MB/s | conf | service ms | straggler |
|---:|:--------------|:--------|-------:|------:|----------:|-----:|-----------:|:----------|
|  0 | 10.0.0.5:7001 | serving |      3 | 12.58 |     250.0 |  80% |       50.3 |           |
|  1 | 10.0.0.6:7001 | serving |      4 |  4.19 |      21.5 |  80% |      195.0 | yes       |
|  2 | 10.0.0.7:7001 | joining |      5 |  0.00 |           |      |            |           |

workers (2)
| rank | clock | iter ms | done |
|-----:|------:|--------:|:-----|
|    0 |   118 |   212.2 | no   |
|    1 |   120 |         | yes  |
";
        assert_eq!(text, want, "got:\n{text}");
    }

    #[test]
    fn an_empty_cluster_still_prints_its_headers() {
        let s = ClusterStatus { balance: "static".into(), epoch: 1, migrations: 1, servers: vec![], workers: vec![] };
        let text = render_status(&s);
        assert!(text.starts_with("balance static, placement epoch 1, 1 migration\n\nservers (0)\n| id |"), "{text}");
        assert!(text.contains("workers (0)\n| rank | clock | iter ms | done |\n"), "{text}");
    }

    #[test]
    fn json_is_the_cluster_status() {
        let s = sample();
        let pretty = status_text(&s, true, false);
        let v: serde_json::Value = serde_json::from_str(&pretty).unwrap();
        assert_eq!(v["epoch"], 7);
        assert_eq!(v["servers"][1]["straggler"], true);
        assert_eq!(v["workers"][1]["iter_ms"], serde_json::Value::Null, "NaN becomes null");
        let line = status_text(&s, true, true);
        assert_eq!(line.lines().count(), 1);
        assert!(line.ends_with('\n'));
    }

    #[test]
    fn command_lines_parse() {
        let cli = crate::Cli::try_parse_from([
            "elasticps",
            "status",
            "--scheduler",
            "h:7000",
            "--json",
            "--watch",
            "0.5",
            "--secret",
            "s",
        ])
        .unwrap();
        let crate::Command::Status(cmd) = cli.command else { panic!("not status") };
        assert_eq!((cmd.scheduler.as_str(), cmd.json, cmd.watch), ("h:7000", true, Some(Duration::from_millis(500))));
        assert_eq!(cmd.net.secret, "s");
        for bad in ["0", "-1", "x", "inf"] {
            assert!(crate::Cli::try_parse_from(["elasticps", "status", "--watch", bad]).is_err(), "{bad}");
        }

        let scale = |args: &[&str]| match crate::Cli::try_parse_from(args).map(|c| c.command) {
            Ok(crate::Command::Scale(cmd)) => Ok((cmd.scheduler, cmd.action)),
            Ok(_) => panic!("not scale"),
            Err(e) => Err(e),
        };
        assert_eq!(
            scale(&["elasticps", "scale", "--scheduler", "h:1", "add-server"]).unwrap(),
            ("h:1".to_string(), ScaleAction::AddServer)
        );
        assert_eq!(
            scale(&["elasticps", "scale", "--scheduler", "h:1", "remove-server", "2"]).unwrap().1,
            ScaleAction::RemoveServer { idx: 2 }
        );
        assert_eq!(ScaleAction::RemoveServer { idx: 2 }.request(), ScaleRequest::RemoveServer(2));
        assert_eq!(
            scale(&["elasticps", "scale", "move-block", "17", "3"]).unwrap(),
            ("127.0.0.1:7000".to_string(), ScaleAction::MoveBlock { block: 17, to: 3 })
        );
        assert_eq!(ScaleAction::MoveBlock { block: 17, to: 3 }.request(), ScaleRequest::MoveBlock { block: 17, to: 3 });
        assert!(scale(&["elasticps", "scale", "remove-server"]).is_err());
        assert!(scale(&["elasticps", "scale", "remove-server", "x"]).is_err());
        assert!(scale(&["elasticps", "scale"]).is_err());
    }

    /// A scheduler that answers GetStatus with `sample()`, `Scale(RemoveServer(9))` with an
    /// error and other scale requests with Ok, on one connection.
    async fn fake_scheduler() -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let secret = Codec::default().secret().to_vec();
            let deadline = elasticps_runtime::handshake::HANDSHAKE_TIMEOUT;
            elasticps_runtime::handshake::accept(&mut stream, &secret, "operator", deadline).await.unwrap();
            let (mut reader, out) = conn::split(stream, Codec::default(), "operator".into());
            while let Ok(Some((h, msg))) = reader.next().await {
                let reply = match msg {
                    Message::Control(Control::GetStatus) => Control::Status(sample()).into(),
                    Message::Control(Control::Scale(ScaleRequest::RemoveServer(9))) => {
                        Message::Error(ErrorReply::new(ErrorCode::BadRequest, "the job has no server 9"))
                    }
                    Message::Control(Control::Scale(_)) => Control::Ok.into(),
                    _ => Control::Heartbeat.into(),
                };
                let _ = out.send((h.request_id, reply));
            }
        });
        addr
    }

    #[tokio::test]
    async fn talks_to_a_scheduler() {
        let addr = fake_scheduler().await;
        let (peer, _notes) = connect(&addr, Codec::default()).await.unwrap();
        let got = get_status(&peer, &addr).await.unwrap();
        // NaN != NaN: compare the rest.
        assert_eq!((got.epoch, got.servers.clone()), (7, sample().servers));
        assert!(got.workers[1].iter_ms.is_nan());
        assert_eq!(request_scale(&peer, &addr, ScaleRequest::AddServer).await.unwrap(), "scale-out requested");
        assert_eq!(
            request_scale(&peer, &addr, ScaleRequest::RemoveServer(1)).await.unwrap(),
            "server 1 drains and stops"
        );
        let err = request_scale(&peer, &addr, ScaleRequest::RemoveServer(9)).await.unwrap_err();
        assert_eq!(
            format!("{err:#}"),
            format!("the scheduler at {addr} refused the scale request: the job has no server 9 (BadRequest)")
        );
    }

    #[tokio::test]
    async fn an_absent_scheduler_is_reported_as_unreachable() {
        // A port that was free a moment ago.
        let addr = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().to_string()
        };
        let err = connect(&addr, Codec::default()).await.err().unwrap();
        assert!(err.to_string().starts_with(&format!("cannot reach the scheduler at {addr}: ")), "{err}");
    }
}
