//! The attacks of issue 19 against real processes (DESIGN.md §10, docs/PROTOCOL.md §1.3,
//! §7.1): a scheduler and servers of the `elasticps` binary over TCP with a cluster
//! secret, a well-behaved worker in process, and an attacker that holds a worker's
//! secret and credential (a compromised training script) and speaks raw frames.
//!
//! Each test forges one kind of message and checks that it is refused (`Forbidden`,
//! `Unauthenticated` and a closed connection, `BadRequest` naming the bound), that the
//! refusal is logged with the identity the message claimed and the one its connection
//! proved, that the well-behaved worker is served between the attacks (every pull checked
//! value for value), and that the job ends with exact values.

use std::net::TcpStream;
use std::time::{Duration, Instant};

use elasticps_core::block::{BlockState, LoggedPush};
use elasticps_core::optimizer::{OptState, OptimizerKind, TensorOptimizer};
use elasticps_core::sync::Clocks;
use elasticps_wire::{
    ClusterStatus, Codec, Control, Credential, DEFAULT_MAX_PAYLOAD, ErrorCode, KeyId, Message, PeerRole, ScaleRequest,
    Values,
};

use crate::common::tiny::{Job, Shape};
use crate::common::*;

/// The cluster secret of these jobs.
const SECRET: &str = "trust-s3cret";
/// The worker secret (`--worker-secret`) of the job that has one.
const WORKER_SECRET: &str = "workers-only";
/// How long a refusal (or any reply) may take.
const REPLY_TIMEOUT: Duration = Duration::from_secs(10);

fn codec() -> Codec {
    Codec::new(SECRET.as_bytes(), DEFAULT_MAX_PAYLOAD)
}

fn worker_codec() -> Codec {
    Codec::for_worker_secret(WORKER_SECRET.as_bytes(), DEFAULT_MAX_PAYLOAD)
}

/// 2 servers, 1 worker, bsp, with this file's cluster secret.
fn shape() -> Shape {
    Shape::new(SECRET)
}

/// Ends the job (a last pull, exact; every live process exits 0). With `count`, the
/// servers' counters must show exactly the workers' pushes.
fn finish(job: Job, count: bool) {
    let served = job.finish(true);
    if count {
        assert_eq!(served.pushes, 3 * served.worker_pushes, "only the well-behaved workers' pushes were applied");
    }
}

impl Job {
    /// A state of block `b` with every value `v`: a forged copy.
    fn forged_state(&self, b: u32, v: f32) -> BlockState {
        let spec = self.layout.partition.blocks[b as usize];
        BlockState {
            spec,
            values: vec![v; spec.len],
            opt: OptState::default(),
            clocks: Clocks::new(1),
            pending: vec![],
            rows: None,
        }
    }

    /// A raw connection to server `s` that said Hello with the worker's credential.
    fn as_worker(&self, s: u32) -> TcpStream {
        let mut conn = connect_raw(&self.addrs[s as usize], SECRET.as_bytes());
        let m = call(&mut conn, &codec(), 1, &self.hello());
        assert_eq!(m, Message::Control(Control::Ok), "the worker's Hello to server {s}");
        conn
    }
}

/// Sends `msg` with request id `id` and returns the reply to it (notifications skipped),
/// waiting at most [`REPLY_TIMEOUT`].
fn call(s: &mut TcpStream, codec: &Codec, id: u64, msg: &Message) -> Message {
    write_frame(s, codec, id, msg).unwrap_or_else(|e| panic!("sending {}: {e}", name(msg)));
    let deadline = Instant::now() + REPLY_TIMEOUT;
    for _ in 0..100 {
        let left = deadline.saturating_duration_since(Instant::now());
        match read_reply(s, codec, left) {
            Reply::Frame(h, m) if h.request_id == id => return m,
            Reply::Frame(_, _) => continue,
            other => panic!("expected a reply to {} (request {id}), got {other:?}", name(msg)),
        }
    }
    panic!("no reply to {} among 100 frames", name(msg))
}

fn name(msg: &Message) -> String {
    match msg {
        Message::Control(c) => c.name().to_string(),
        other => format!("{:?}", other.kind()),
    }
}

/// Asserts `m` is an `Error` of `code` whose message mentions every word of `words`.
fn assert_refused(m: &Message, code: ErrorCode, words: &[&str], what: &str) {
    match m {
        Message::Error(e) => {
            assert_eq!(e.code, code, "{what}: {e}");
            for w in words {
                assert!(e.message.contains(w), "{what}: the error {:?} should mention {w:?}", e.message);
            }
        }
        other => panic!("{what}: expected an Error {code:?}, got {other:?}"),
    }
}

/// Asserts the peer closes `s` within [`REPLY_TIMEOUT`] (nothing more to read).
fn assert_closed(s: &mut TcpStream, what: &str) {
    match read_reply(s, &codec(), REPLY_TIMEOUT) {
        Reply::Eof | Reply::Reset => {}
        other => panic!("{what}: expected the connection to close, got {other:?}"),
    }
}

/// Waits (at most 10 s) for a line of `log()` with every one of `parts`; returns it.
fn logged(log: impl Fn() -> String, parts: &[&str], what: &str) -> String {
    let found = poll_until(Duration::from_secs(10), || {
        log().lines().find(|l| parts.iter().all(|p| l.contains(p))).map(str::to_string)
    });
    found.unwrap_or_else(|| panic!("{what}: no log line with {parts:?}:\n{}", log()))
}

fn status(s: &mut TcpStream, id: u64) -> ClusterStatus {
    match call(s, &codec(), id, &Control::GetStatus.into()) {
        Message::Control(Control::Status(st)) => st,
        other => panic!("GetStatus: {other:?}"),
    }
}

/// (a) `Replicate` on a worker's data connection, after a valid worker Hello: refused,
/// and the real push of that clock is then applied, not dropped as a duplicate.
#[test]
fn a_replicate_on_a_worker_connection_is_forbidden_and_the_real_push_is_applied() {
    let mut job = Job::start(shape());
    job.round("start");
    let b = 0;
    let s = job.owner(b);
    let mut conn = job.as_worker(s);
    let len = job.blocks[b as usize].2;
    let t = job.clock;
    for (id, worker, init) in [(2, 0, false), (3, 7, false), (4, 0, true)] {
        let push = LoggedPush::dense(worker, t, vec![100.0; len]);
        let m = call(&mut conn, &codec(), id, &Control::Replicate { block: b, init, push }.into());
        assert_refused(&m, ErrorCode::Forbidden, &["worker 0", "Replicate"], &format!("Replicate of worker {worker}"));
    }
    let line = logged(|| job.server_log(s), &["forbidden message refused", "Replicate"], "server");
    assert!(line.contains("forwarding a push of worker 0") && line.contains("proven=worker 0"), "{line}");
    logged(|| job.server_log(s), &["forbidden message refused", "forwarding a push of worker 7"], "server");
    // The connection is still the worker's: its stats, unchanged by the forgeries.
    match call(&mut conn, &codec(), 5, &Control::GetStats.into()) {
        Message::Control(Control::Stats(st)) => {
            let owned = (0..3).filter(|b| job.owner(*b) == s).count() as u64;
            assert_eq!(st.totals.pushes, owned * u64::from(t), "only the worker's pushes: {st:?}");
        }
        other => panic!("GetStats after the forgeries: {other:?}"),
    }
    // Clock t: the values the forgeries did not change, then the real push, applied.
    job.round("three forged Replicates of clock t");
    job.round("the real push of clock t");
    finish(job, true);
}

/// A worker's `SetOptimizer` straight to a server, skipping the scheduler (issue 35): every
/// server refuses it (`Forbidden`, saying it goes to the scheduler), logs it, and changes
/// nothing: the next rounds' values are exact with the job's learning rate.
#[test]
fn a_set_optimizer_straight_to_a_server_is_forbidden_and_changes_nothing() {
    let mut job = Job::start(shape());
    job.round("start");
    let optimizer = TensorOptimizer { kind: OptimizerKind::Sgd, lr: 100.0, weight_decay: 0.0 };
    for s in 0..job.addrs.len() as u32 {
        let mut conn = job.as_worker(s);
        let m = call(&mut conn, &codec(), 2, &Control::SetOptimizer { tensor: 0, optimizer }.into());
        let what = format!("SetOptimizer to server {s}");
        assert_refused(&m, ErrorCode::Forbidden, &["worker 0", "SetOptimizer", "goes to the scheduler"], &what);
        logged(|| job.server_log(s), &["forbidden message refused", "SetOptimizer"], &what);
    }
    job.round("after the refused SetOptimizers");
    job.round("one more");
    finish(job, true);
}

/// (b) With `--replicas 2`, a backup refuses `ReplicaSnapshot` and `Replicate` from a
/// worker connection; once the primary is killed, the promoted backup serves the exact
/// values.
#[test]
fn a_backup_refuses_copies_from_a_worker_and_serves_exact_values_once_promoted() {
    let mut job = Job::start(Shape { servers: 3, sched_flags: vec!["--replicas", "2"], ..shape() });
    job.round("start");
    let b = 0;
    let primary = job.owner(b);
    let backup = job.layout.placement.backups_of(b)[0];
    assert_ne!(primary, backup);
    let mut conn = job.as_worker(backup);
    let m = call(&mut conn, &codec(), 2, &Control::ReplicaSnapshot(job.forged_state(b, 1000.0)).into());
    assert_refused(&m, ErrorCode::Forbidden, &["worker 0", "ReplicaSnapshot"], "ReplicaSnapshot from a worker");
    let len = job.blocks[b as usize].2;
    let push = LoggedPush::dense(0, job.clock, vec![100.0; len]);
    let m = call(&mut conn, &codec(), 3, &Control::Replicate { block: b, init: false, push }.into());
    assert_refused(&m, ErrorCode::Forbidden, &["worker 0", "Replicate"], "Replicate from a worker");
    for what in ["ReplicaSnapshot", "Replicate"] {
        let line = logged(|| job.server_log(backup), &["forbidden message refused", what], "the backup");
        assert!(line.contains("claimed=") && line.contains("proven=worker 0"), "{line}");
    }
    job.round("forged copies sent to the backup");
    job.round("forged copies sent to the backup");

    // The primary dies; its backup is promoted and serves the block.
    let mut victim = job.servers[primary as usize].take().expect("the primary runs");
    victim.kill();
    job.round("the primary was killed");
    job.round("the backup was promoted");
    let m =
        call(&mut conn, &codec(), 4, &Message::Pull { block: b, clock: job.clock, reply: elasticps_wire::Dtype::F32 });
    match m {
        Message::PullReply { block, values, .. } => {
            assert_eq!((block, values.to_vec()), (b, job.block_values(b)), "the promoted backup's values")
        }
        other => panic!("a pull of block {b} from its promoted backup: {other:?}"),
    }
    logged(|| job.sched.log(), &["server lost"], "the scheduler");
    finish(job, false);
}

/// (c) `BlockSnapshot` and `BlockDelta` on a connection that said no Hello are refused
/// and park nothing: pulls are answered, and a real move of that block onto that server
/// then works.
#[test]
fn a_snapshot_or_delta_without_hello_is_forbidden_and_parks_nothing() {
    let mut job = Job::start(shape());
    job.round("start");
    let b = 0;
    let owner = job.owner(b);
    let target = 1 - owner;
    let mut anon = connect_raw(&job.addrs[target as usize], SECRET.as_bytes());
    let epoch = job.layout.placement.epoch + 99;
    let snapshot = Control::BlockSnapshot { epoch, state: job.forged_state(b, 1000.0) };
    let m = call(&mut anon, &codec(), 1, &snapshot.into());
    assert_refused(&m, ErrorCode::Forbidden, &["BlockSnapshot", "Hello"], "BlockSnapshot without Hello");
    let len = job.blocks[b as usize].2;
    let pushes = vec![LoggedPush::dense(0, job.clock, vec![100.0; len])];
    let m = call(&mut anon, &codec(), 2, &Control::BlockDelta { block: b, epoch, pushes }.into());
    assert_refused(&m, ErrorCode::Forbidden, &["BlockDelta", "Hello"], "BlockDelta without Hello");
    for what in ["BlockSnapshot", "BlockDelta"] {
        let line = logged(|| job.server_log(target), &["forbidden message refused", what], "the server");
        assert!(line.contains("claimed=") && line.contains("proven=no identity (cluster key)"), "{line}");
    }
    // With a worker's Hello too.
    let mut conn = job.as_worker(target);
    let snapshot = Control::BlockSnapshot { epoch, state: job.forged_state(b, 1000.0) };
    let m = call(&mut conn, &codec(), 2, &snapshot.into());
    assert_refused(&m, ErrorCode::Forbidden, &["worker 0", "BlockSnapshot"], "BlockSnapshot from a worker");
    // Nothing parked: the block is the other server's, said at once.
    let m =
        call(&mut conn, &codec(), 3, &Message::Pull { block: b, clock: job.clock, reply: elasticps_wire::Dtype::F32 });
    assert_eq!(m, Message::Control(Control::Moved { block: b, owner, epoch: job.layout.placement.epoch }));
    job.round("a forged snapshot and delta");

    // A real move of that block onto that server.
    let mut op = connect_raw(&job.sched_addr, SECRET.as_bytes());
    let m = call(&mut op, &codec(), 1, &Control::Scale(ScaleRequest::MoveBlock { block: b, to: target }).into());
    assert_eq!(m, Message::Control(Control::Ok), "MoveBlock {b} to server {target}");
    let moved = poll_until(Duration::from_secs(30), || {
        let st = status(&mut op, 2);
        (st.migrations >= 1).then_some(st)
    });
    assert!(moved.is_some(), "the move of block {b} to server {target} did not complete\n{}", job.sched.log_tail(20));
    job.round("block moved to the server that refused the forged snapshot");
    let m =
        call(&mut conn, &codec(), 4, &Message::Pull { block: b, clock: job.clock, reply: elasticps_wire::Dtype::F32 });
    match m {
        Message::PullReply { block, values, .. } => {
            assert_eq!((block, values.to_vec()), (b, job.block_values(b)), "block {b} on its new owner")
        }
        other => panic!("a pull of block {b} from its new owner: {other:?}"),
    }
    job.round("block moved");
    finish(job, true);
}

/// (d) `Hello` with a credential that does not hold: a rank the job does not have, a MAC
/// made with another secret, another job's. Each is `Unauthenticated` and the
/// connection closes.
#[test]
fn a_hello_with_a_forged_credential_is_unauthenticated_and_closed() {
    let mut job = Job::start(shape());
    job.round("start");
    let own = job.credential();
    let secret = SECRET.as_bytes();
    let forged = [
        ("rank 99", Credential::issue(secret, own.job, PeerRole::Worker, 99), "not in this job", "worker 99"),
        ("another secret", Credential::issue(b"guessed", own.job, PeerRole::Worker, 1), "secret", "worker 1"),
        ("another job", Credential::issue(secret, own.job ^ 1, PeerRole::Worker, 0), "not of this job", "worker 0"),
        (
            "a server's, another secret",
            Credential::issue(b"guessed", own.job, PeerRole::Server, 1),
            "secret",
            "server 1",
        ),
    ];
    for s in 0..job.addrs.len() as u32 {
        for (what, credential, why, claimed) in &forged {
            let mut conn = connect_raw(&job.addrs[s as usize], secret);
            let m = call(&mut conn, &codec(), 1, &Control::Hello { credential: credential.clone() }.into());
            assert_refused(&m, ErrorCode::Unauthenticated, &[why], &format!("Hello with {what} to server {s}"));
            assert_closed(&mut conn, &format!("Hello with {what} to server {s}"));
            let claimed = format!("claimed={claimed}");
            let line = logged(|| job.server_log(s), &["hello refused", &claimed], &format!("server {s}"));
            assert!(line.contains("proven=no identity (cluster key)"), "{line}");
            job.round(&format!("Hello with {what} to server {s}"));
        }
    }
    finish(job, true);
}

/// (e) `WorkerDone` naming another rank, from a worker's scheduler connection: refused,
/// and that worker is not finished.
#[test]
fn worker_done_of_another_rank_is_forbidden_and_finishes_no_one() {
    let mut job = Job::start(Shape { workers: 2, sync: "asp", ..shape() });
    // The attacker: a second worker of the job, on its own scheduler connection.
    let mut evil = connect_raw(&job.sched_addr, SECRET.as_bytes());
    let rank = match call(&mut evil, &codec(), 1, &Control::RegisterWorker.into()) {
        Message::Control(Control::Welcome { node_id, .. }) => node_id,
        other => panic!("RegisterWorker: {other:?}"),
    };
    assert_eq!(rank, 1);
    job.round("start");
    let m = call(&mut evil, &codec(), 2, &Control::WorkerDone { rank: 0 }.into());
    assert_refused(&m, ErrorCode::Forbidden, &["worker 1", "worker 0"], "WorkerDone of rank 0 from rank 1");
    let line = logged(|| job.sched.log(), &["forbidden message refused", "WorkerDone"], "the scheduler");
    assert!(line.contains("proven=worker 1"), "{line}");
    assert!(line.contains("claimed=worker 0"), "the refusal names the identity the message claimed: {line}");
    let st = status(&mut evil, 3);
    assert!(st.workers.iter().all(|w| !w.done), "no worker is done: {:?}", st.workers);
    job.round("WorkerDone of rank 0 sent by rank 1");
    write_frame(&mut evil, &codec(), 0, &Control::Heartbeat.into()).expect("a heartbeat");
    job.round("WorkerDone of rank 0 sent by rank 1");
    // The attacker's own WorkerDone is taken; then the real worker's.
    let m = call(&mut evil, &codec(), 4, &Control::WorkerDone { rank: 1 }.into());
    assert_eq!(m, Message::Control(Control::Ok), "WorkerDone of its own rank");
    let st = status(&mut connect_raw(&job.sched_addr, SECRET.as_bytes()), 1);
    let done: Vec<u32> = st.workers.iter().filter(|w| w.done).map(|w| w.rank).collect();
    assert_eq!(done, [1], "only the attacker is done");
    job.round("the attacker finished; the job goes on");
    finish(job, true);
}

/// (f) A pull for a clock far in the future: `BadRequest` naming `--max-clock-lead`, and
/// the connection stays usable.
#[test]
fn a_far_future_pull_is_a_bad_request_naming_the_bound_and_the_connection_stays_usable() {
    let mut job = Job::start(shape());
    job.round("start");
    let b = 0;
    let s = job.owner(b);
    let mut conn = job.as_worker(s);
    let m =
        call(&mut conn, &codec(), 2, &Message::Pull { block: b, clock: u32::MAX, reply: elasticps_wire::Dtype::F32 });
    assert_refused(&m, ErrorCode::BadRequest, &["--max-clock-lead", "1000"], "pull(2^32-1)");
    let len = job.blocks[b as usize].2;
    let push_pull = Message::PushPull {
        block: b,
        clock: u32::MAX - 1,
        values: Values::from_vec(vec![100.0; len]),
        reply: elasticps_wire::Dtype::F32,
    };
    let m = call(&mut conn, &codec(), 3, &push_pull);
    assert_refused(&m, ErrorCode::BadRequest, &["--max-clock-lead"], "push_pull(2^32-2)");
    let m = call(
        &mut conn,
        &codec(),
        4,
        &Message::Pull { block: b, clock: job.clock + 1001, reply: elasticps_wire::Dtype::F32 },
    );
    assert_refused(&m, ErrorCode::BadRequest, &["--max-clock-lead"], "pull(done + 1001)");
    // Usable: a pull of the current clock is answered with the exact values.
    match call(&mut conn, &codec(), 5, &Message::Pull { block: b, clock: job.clock, reply: elasticps_wire::Dtype::F32 })
    {
        Message::PullReply { values, .. } => assert_eq!(values.to_vec(), job.block_values(b)),
        other => panic!("a pull of the current clock after the refusals: {other:?}"),
    }
    job.round("far-future pulls");
    job.round("far-future pulls");
    finish(job, true);
}

/// (g) With `--worker-secret`, a connection of the worker secret cannot register as a
/// server, nor present a server's credential, nor send a server's messages; workers of
/// that secret train.
#[test]
fn a_worker_secret_connection_cannot_become_a_server() {
    let mut job = Job::start(Shape { worker_secret: Some(WORKER_SECRET), ..shape() });
    job.round("start");
    let ws = WORKER_SECRET.as_bytes();
    let k = worker_codec();
    // The scheduler.
    let mut evil = connect_raw_with(&job.sched_addr, KeyId::Worker, ws);
    let m = call(&mut evil, &k, 1, &Control::RegisterServer { data_addr: "127.0.0.1:1".into() }.into());
    assert_refused(&m, ErrorCode::Forbidden, &["worker key", "RegisterServer"], "RegisterServer with the worker key");
    let line = logged(|| job.sched.log(), &["forbidden message refused", "RegisterServer"], "the scheduler");
    assert!(line.contains("proven=no identity (worker key)"), "{line}");
    assert!(line.contains("claimed="), "the refusal names the identity the message claimed: {line}");
    job.round("RegisterServer with the worker key");

    // A server: a server's credential (a stolen one, and one MACed with the worker secret).
    let own = job.credential();
    let stolen = Credential::issue(SECRET.as_bytes(), own.job, PeerRole::Server, 0);
    let minted = Credential::issue(ws, own.job, PeerRole::Server, 0);
    for (what, credential, why) in
        [("a stolen server credential", stolen, "worker secret"), ("a minted one", minted, "secret")]
    {
        let mut conn = connect_raw_with(&job.addrs[0], KeyId::Worker, ws);
        let m = call(&mut conn, &k, 1, &Control::Hello { credential }.into());
        assert_refused(&m, ErrorCode::Unauthenticated, &[why], &format!("Hello with {what}"));
        assert_closed(&mut conn, what);
        let line = logged(|| job.server_log(0), &["hello refused", "claimed=server 0"], "server 0");
        assert!(line.contains("proven=no identity (worker key)"), "{line}");
        job.round(&format!("Hello with {what} on the worker key"));
    }
    // As a worker (its own credential), it sends what only servers send.
    let mut conn = connect_raw_with(&job.addrs[0], KeyId::Worker, ws);
    assert_eq!(call(&mut conn, &k, 1, &job.hello()), Message::Control(Control::Ok));
    let b = (0..3).find(|b| job.owner(*b) == 0).expect("server 0 owns a block");
    let snapshot = Control::BlockSnapshot { epoch: 99, state: job.forged_state(b, 1000.0) };
    let m = call(&mut conn, &k, 2, &snapshot.into());
    assert_refused(&m, ErrorCode::Forbidden, &["worker 0"], "BlockSnapshot from a worker-key worker");
    job.round("a worker-key worker sent a BlockSnapshot");
    finish(job, true);
}

/// (h) 5,000 connections that never start the handshake, opened at once to a server and
/// to the scheduler and kept open, do not stop an authenticated worker from connecting
/// and training; a worker authenticated before them is served meanwhile.
#[test]
fn five_thousand_handshake_less_connections_do_not_lock_out_an_authenticated_worker() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    const FLOOD: usize = 5_000;
    /// Bounds of the flood, in connections per target and in time.
    const MOST: usize = 20_000;
    const LONGEST: Duration = Duration::from_secs(60);
    let mut job = Job::start(Shape { workers: 2, sync: "asp", ..shape() });
    job.round("start");
    let targets = [job.sched_addr.clone(), job.addrs[0].clone()];

    // One thread per target opens connections that never say a byte, and keeps opening
    // them (an attacker who refloods) until told to stop: 5,000 at once, then more.
    let started = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let opened: Vec<Arc<AtomicUsize>> = targets.iter().map(|_| Arc::new(AtomicUsize::new(0))).collect();
    let openers: Vec<_> = targets
        .iter()
        .cloned()
        .zip(opened.iter().cloned())
        .map(|(addr, count)| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let sock = addr.parse().expect("an address");
                let (mut open, mut failed) = (Vec::with_capacity(MOST), 0);
                while !stop.load(Ordering::Relaxed) && open.len() < MOST && started.elapsed() < LONGEST {
                    match TcpStream::connect_timeout(&sock, Duration::from_secs(2)) {
                        Ok(s) => open.push(s),
                        Err(_) => failed += 1,
                    }
                    count.store(open.len(), Ordering::Relaxed);
                }
                (open, failed)
            })
        })
        .collect();
    let flooded = poll_until(LONGEST, || opened.iter().all(|c| c.load(Ordering::Relaxed) >= FLOOD).then_some(()));
    assert!(flooded.is_some(), "the flood did not reach {FLOOD} connections per target within {LONGEST:?}");
    eprintln!("{FLOOD} handshake-less connections per target open after {:?}", started.elapsed());

    // The worker authenticated before the flood is served meanwhile.
    job.round("the flood opened");
    // Another worker connects now, while the flood goes on, and trains.
    let before_join: Vec<usize> = opened.iter().map(|c| c.load(Ordering::Relaxed)).collect();
    job.join(job.shape.options(&job.sched_addr, false));
    eprintln!("the second worker joined {:?} after the flood started", started.elapsed());
    job.round_other(0, "joining during the flood");
    job.round("the second worker joined");
    job.round_other(0, "joining during the flood");
    // The flood went on while the worker joined: no opener had stopped by itself.
    assert!(openers.iter().all(|t| !t.is_finished()), "the flood had stopped before the worker trained");
    stop.store(true, Ordering::Relaxed);
    let mut flood = Vec::new();
    for ((t, addr), b) in openers.into_iter().zip(&targets).zip(&before_join) {
        let (open, failed) = t.join().expect("an opener thread");
        eprintln!("{} handshake-less connections to {addr} opened ({failed} failed); {b} before the join", open.len());
        flood.push(open);
    }
    logged(
        || job.sched.log(),
        &["connection dropped: the oldest of the connections in the handshake"],
        "the scheduler",
    );
    logged(|| job.server_log(0), &["connection dropped: the oldest of the connections in the handshake"], "server 0");
    drop(flood);
    job.round("the flood closed");
    job.round_other(0, "the flood closed");
    finish(job, true);
}
