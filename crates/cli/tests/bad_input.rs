//! Bad input against live processes (DESIGN.md §5, docs/PROTOCOL.md §2, §7, §8).
//!
//! A node that receives a frame it cannot validate answers with an `Error` frame carrying
//! the matching code, if it can, closes **that connection only**, and keeps serving every
//! other connection. These tests run the scheduler and the servers as real processes of
//! the binary, send them garbage over raw TCP connections, and check the codes, the end of
//! the connection, and that well-behaved clients (in process, or worker processes training
//! the MLP) carry on unharmed.

use std::io::{Read, Write};
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use elasticps_wire::{
    Codec, Control, DEFAULT_MAX_PAYLOAD, ErrorCode, FrameHeader, HEADER_LEN, Kind, MAGIC, Message, VERSION, Values,
    checksum,
};

use crate::common::tiny::{Job, Shape};
use crate::common::*;

/// Every node of these tests runs with this cluster secret.
const SECRET: &str = "s3cret";
/// How long a refusal may take to arrive.
const REPLY_TIMEOUT: Duration = Duration::from_secs(5);
/// The tiny cluster's `--frame-timeout-s`: a stalled frame or handshake is dropped after it.
const STALL_S: &str = "3";

fn codec() -> Codec {
    Codec::new(SECRET.as_bytes(), DEFAULT_MAX_PAYLOAD)
}

/// 32 header bytes from raw fields, with a checksum that is correct for `secret`, so that
/// exactly the field under test is wrong.
fn raw_header(version: u8, kind: u8, flags: u16, request_id: u64, payload_len: u32, secret: &[u8]) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..4].copy_from_slice(&MAGIC);
    h[4] = version;
    h[5] = kind;
    h[6..8].copy_from_slice(&flags.to_le_bytes());
    h[8..16].copy_from_slice(&request_id.to_le_bytes());
    h[24..28].copy_from_slice(&payload_len.to_le_bytes());
    let sum = checksum(&h, secret);
    h[28..32].copy_from_slice(&sum.to_le_bytes());
    h
}

/// Deterministic noise (xorshift64*).
fn noise(len: usize, mut seed: u64) -> Vec<u8> {
    (0..len)
        .map(|_| {
            seed ^= seed >> 12;
            seed ^= seed << 25;
            seed ^= seed >> 27;
            (seed.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
        })
        .collect()
}

/// One way of sending a node something that is not a valid frame.
struct Bad {
    name: &'static str,
    bytes: Vec<u8>,
    /// Close our sending side after the bytes (the node sees end of stream).
    half_close: bool,
    /// The `Error` code the node must answer with; `None`: it answers nothing (the peer
    /// left in the middle of a frame) and just closes.
    expect: Option<ErrorCode>,
    /// A word the error message must contain (a clear error, not just a code).
    mentions: &'static str,
    /// The request id the `Error` frame must carry: the refused frame's own when its
    /// header was readable (magic, version and checksum held), else 0.
    request_id: u64,
}

fn bad_frames() -> Vec<Bad> {
    let secret = SECRET.as_bytes();
    let c = codec();
    // Any well-formed Hello: these frames are refused before their payload counts.
    let credential = elasticps_wire::Credential::issue(secret, 0, elasticps_wire::PeerRole::Worker, 0);
    let hello = Message::Control(Control::Hello { credential });
    let (hello_head, hello_payload) = c.encode(48, &hello).expect("hello");

    let mut garbage = noise(64, 0x5eed);
    garbage[0] = b'X'; // never the magic, whatever the noise
    let oversized = c.encode_header(&FrameHeader {
        kind: Kind::Push,
        request_id: 41,
        block: 0,
        clock: 0,
        payload_len: 1 << 30,
        flags: elasticps_wire::Flags::default(),
    });
    let (wrong_secret_head, wrong_secret_payload) =
        Codec::new(b"not the secret", DEFAULT_MAX_PAYLOAD).encode(44, &hello).expect("hello");
    let mut trailing = hello_head.to_vec();
    trailing.extend_from_slice(&hello_payload);
    trailing.push(0);
    // The same Hello, announcing one more payload byte (so the header is valid).
    trailing[..HEADER_LEN].copy_from_slice(&raw_header(
        VERSION,
        Kind::Control as u8,
        0,
        48,
        hello_payload.len() as u32 + 1,
        secret,
    ));
    let truncated = {
        let head = c.encode_header(&FrameHeader {
            kind: Kind::Push,
            request_id: 49,
            block: 0,
            clock: 0,
            payload_len: 64,
            flags: elasticps_wire::Flags::default(),
        });
        let mut v = head.to_vec();
        v.extend_from_slice(&[0u8; 20]); // 20 of the 64 announced bytes, then end of stream
        v
    };

    vec![
        Bad {
            name: "random garbage",
            bytes: garbage,
            half_close: false,
            expect: Some(ErrorCode::Malformed),
            mentions: "magic",
            request_id: 0,
        },
        Bad {
            name: "a header announcing a 1 GiB payload (header only: refused before any payload)",
            bytes: oversized.to_vec(),
            half_close: false,
            expect: Some(ErrorCode::TooLarge),
            mentions: "1073741824",
            request_id: 41,
        },
        Bad {
            name: "protocol version 6 (a newer node)",
            bytes: raw_header(VERSION + 1, Kind::Control as u8, 0, 42, 0, secret).to_vec(),
            half_close: false,
            expect: Some(ErrorCode::BadVersion),
            mentions: "version 5",
            request_id: 0,
        },
        Bad {
            name: "unknown kind 99",
            bytes: raw_header(VERSION, 99, 0, 43, 0, secret).to_vec(),
            half_close: false,
            expect: Some(ErrorCode::UnknownKind),
            mentions: "99",
            request_id: 43,
        },
        Bad {
            name: "a wrong cluster secret",
            bytes: [&wrong_secret_head[..], &wrong_secret_payload[..]].concat(),
            half_close: false,
            expect: Some(ErrorCode::BadChecksum),
            mentions: "secret",
            request_id: 0,
        },
        Bad {
            name: "reserved flags set",
            bytes: raw_header(VERSION, Kind::Control as u8, 1, 45, 0, secret).to_vec(),
            half_close: false,
            expect: Some(ErrorCode::Malformed),
            mentions: "flags",
            request_id: 45,
        },
        Bad {
            name: "a Pull with a payload",
            bytes: [&raw_header(VERSION, Kind::Pull as u8, 0, 46, 4, secret)[..], &[0u8; 4][..]].concat(),
            half_close: false,
            expect: Some(ErrorCode::Malformed),
            mentions: "empty",
            request_id: 46,
        },
        Bad {
            name: "an undecodable control payload",
            bytes: [&raw_header(VERSION, Kind::Control as u8, 0, 47, 3, secret)[..], &[0xff; 3][..]].concat(),
            half_close: false,
            expect: Some(ErrorCode::Malformed),
            mentions: "postcard",
            request_id: 47,
        },
        Bad {
            name: "a control payload with a trailing byte",
            bytes: trailing,
            half_close: false,
            expect: Some(ErrorCode::Malformed),
            mentions: "trailing",
            request_id: 48,
        },
        Bad {
            // A data frame from a connection that has not said who it is: refused from
            // its header, before its payload (PROTOCOL.md §2, check 8), on a server as on
            // the scheduler.
            name: "a frame truncated in its payload",
            bytes: truncated,
            half_close: true,
            expect: Some(ErrorCode::Forbidden),
            mentions: "only control frames",
            request_id: 49,
        },
        Bad {
            name: "a truncated header",
            bytes: hello_head[..12].to_vec(),
            half_close: true,
            expect: None,
            mentions: "",
            request_id: 0,
        },
    ]
}

/// Sends `bad` on a new connection to `addr`; checks the refusal and that the node then
/// closes the connection (EOF).
fn check_refused(addr: &str, bad: &Bad) {
    let mut s = connect_raw(addr, SECRET.as_bytes());
    s.write_all(&bad.bytes).unwrap_or_else(|e| panic!("{}: sending to {addr}: {e}", bad.name));
    if bad.half_close {
        s.shutdown(Shutdown::Write).expect("half close");
    }
    let c = codec();
    if let Some(code) = bad.expect {
        let started = Instant::now();
        match read_reply(&mut s, &c, REPLY_TIMEOUT) {
            Reply::Frame(h, Message::Error(e)) => {
                assert_eq!(e.code, code, "{}: {addr} answered {e}", bad.name);
                assert_eq!((h.block, h.clock), (0, 0), "{}: an Error frame has block and clock 0", bad.name);
                assert_eq!(h.request_id, bad.request_id, "{}: the request id of the Error frame", bad.name);
                assert!(
                    e.message.contains(bad.mentions),
                    "{}: the message {:?} should mention {:?}",
                    bad.name,
                    e.message,
                    bad.mentions
                );
                assert!(started.elapsed() < REPLY_TIMEOUT, "{}", bad.name);
            }
            other => panic!("{}: expected Error {code:?} from {addr}, got {other:?}", bad.name),
        }
    }
    match read_reply(&mut s, &c, REPLY_TIMEOUT) {
        Reply::Eof => {}
        other => panic!("{}: expected {addr} to close the connection after refusing it, got {other:?}", bad.name),
    }
}

/// The tiny job of these tests (see [`crate::common::tiny`]): scheduler + 2 server
/// processes that each own a block and drop a stalled frame after [`STALL_S`], and one
/// in-process worker client (rank 0) whose every pull is checked value for value.
fn tiny() -> Job {
    let job = Job::start(Shape { flags: vec!["--frame-timeout-s", STALL_S], ..Shape::new(SECRET) });
    let owners = &job.layout.placement.owners;
    assert!(owners.contains(&0) && owners.contains(&1), "both servers must own a block: {owners:?}");
    job
}

/// Ends the job: the worker says it is done; every process must exit 0, and the servers'
/// counters must show exactly the well-behaved worker's requests.
fn finish(job: Job) {
    let served = job.finish(false);
    assert_eq!(served.blocks, 3);
    assert_eq!(served.pushes, 3 * served.worker_pushes, "only the well-behaved worker's pushes were applied");
}

/// The blocks of server `s`, and one block of the other server.
fn owned_and_foreign(job: &Job, s: u32) -> (Vec<u32>, u32) {
    let owners = &job.layout.placement.owners;
    let owned: Vec<u32> = (0..owners.len() as u32).filter(|b| owners[*b as usize] == s).collect();
    let foreign = (0..owners.len() as u32).find(|b| owners[*b as usize] != s).expect("a block elsewhere");
    (owned, foreign)
}

#[test]
fn a_server_refuses_each_bad_frame_closes_only_that_connection_and_keeps_serving() {
    let mut c = tiny();
    c.round("start");
    // An idle, well-behaved raw connection opened before the garbage must survive it too.
    let mut idle = connect_raw(&c.addrs[0], SECRET.as_bytes());
    let (h, m) = call_raw(&mut idle, &codec(), 1, &c.hello());
    assert!(matches!(m, Message::Control(Control::Ok)) && h.request_id == 1, "Hello: {m:?}");

    for s in 0..c.addrs.len() {
        for bad in bad_frames() {
            check_refused(&c.addrs[s].clone(), &bad);
            c.round(&format!("{} sent to server {s}", bad.name));
        }
    }

    let (h, m) = call_raw(&mut idle, &codec(), 2, &Control::GetStats.into());
    match m {
        Message::Control(Control::Stats(st)) => {
            assert_eq!((h.request_id, st.server_id), (2, 0));
            let owned = owned_and_foreign(&c, 0).0.len() as u64;
            assert_eq!(st.totals.pushes, owned * u64::from(c.clock), "server 0 applied exactly the worker's pushes");
        }
        other => panic!("GetStats on the idle connection: {other:?}"),
    }
    drop(idle);
    finish(c);
}

/// Hostile or broken peers: a wrong secret (a worker process and a raw peer), a peer that
/// sends a frame before the handshake, one that stops half way through the handshake, and
/// one that stops half way through a frame header after it. Each is refused or dropped
/// with a clear error and a log line, and the well-behaved worker's training goes on,
/// value for value.
#[test]
fn a_wrong_secret_a_skipped_handshake_and_stalled_peers_are_refused_while_the_job_goes_on() {
    let mut c = tiny();
    c.round("start");
    let mut stalled = Vec::new();
    for addr in [c.sched_addr.clone(), c.addrs[0].clone(), c.addrs[1].clone()] {
        let mut s = connect_unauthenticated(&addr);
        let e = handshake_raw(&mut s, b"not the secret").expect_err("a wrong secret must be refused");
        assert!(e.contains("cluster secret differs"), "{addr}: {e}");

        let mut s = connect_unauthenticated(&addr);
        write_frame(&mut s, &codec(), 9, &c.hello()).expect("a frame");
        match read_reply(&mut s, &codec(), REPLY_TIMEOUT) {
            Reply::Frame(_, Message::Error(e)) => {
                assert_eq!(e.code, ErrorCode::Unauthenticated, "{addr}: {e}");
                assert!(e.message.contains("sent a frame before the handshake"), "{addr}: {e}");
            }
            other => panic!("{addr}: a frame before the handshake got {other:?}"),
        }
        assert!(matches!(read_reply(&mut s, &codec(), REPLY_TIMEOUT), Reply::Eof | Reply::Reset), "{addr} closes");

        let mut s = connect_unauthenticated(&addr);
        s.write_all(b"EPSH").expect("half a hello");
        stalled.push((addr.clone(), s));

        let mut s = connect_raw(&addr, SECRET.as_bytes());
        s.write_all(&MAGIC).expect("half a header");
        stalled.push((addr, s));
    }
    c.round("three refusals on every node");

    // A worker process with the wrong secret stops with an error that says so.
    let mut w = start_worker(&c.sched_addr, &["--iterations", "1", "--secret", "not the secret"]);
    let status = w.finish(Duration::from_secs(30));
    assert!(matches!(status, Some(s) if !s.success()), "a worker with the wrong secret ended with {status:?}");
    assert!(w.log().contains("cluster secret differs"), "{}", w.log_tail(10));

    // The stalled peers are dropped once their deadline (--frame-timeout-s) passes.
    let deadline = Instant::now() + Duration::from_secs(STALL_S.parse().expect("seconds")) + REPLY_TIMEOUT;
    for (addr, mut s) in stalled {
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(10));
        s.set_read_timeout(Some(left)).expect("read timeout");
        let mut buf = [0u8; 64];
        match s.read(&mut buf) {
            Ok(0) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            other => panic!("{addr}: a stalled peer was not dropped: {other:?}"),
        }
    }
    c.round("the stalled peers were dropped");
    for (name, log) in [("scheduler", c.sched.log()), ("server 0", c.server_log(0))] {
        assert!(log.contains("connection refused"), "{name} logs each refusal\n{log}");
        assert!(log.contains("cluster secret"), "{name} logs why\n{log}");
    }
    finish(c);
}

#[test]
fn a_request_for_a_missing_block_gets_unknown_block_and_the_connection_stays_usable() {
    let mut c = tiny();
    let k = codec();
    for s in 0..c.addrs.len() as u32 {
        let (owned, foreign) = owned_and_foreign(&c, s);
        let mut conn = connect_raw(&c.addrs[s as usize], SECRET.as_bytes());

        // Before Hello a server does not know whose requests these are.
        let (_, m) = call_raw(&mut conn, &k, 1, &c.hello());
        assert!(matches!(m, Message::Control(Control::Ok)), "Hello: {m:?}");

        for (id, block) in [(2, 9_999u32), (3, u32::MAX)] {
            let (h, m) =
                call_raw(&mut conn, &k, id, &Message::Pull { block, clock: 0, reply: elasticps_wire::Dtype::F32 });
            match m {
                Message::Error(e) => {
                    assert_eq!(e.code, ErrorCode::UnknownBlock, "pull of block {block}: {e}");
                    assert!(e.message.contains(&block.to_string()), "the message names the block: {e}");
                    assert_eq!(h.request_id, id, "the error answers the request");
                }
                other => panic!("pull of missing block {block}: {other:?}"),
            }
        }
        let (h, m) =
            call_raw(&mut conn, &k, 4, &Message::Push { block: 9_999, clock: 0, values: Values::from_vec(vec![1.0]) });
        assert!(
            matches!(&m, Message::Error(e) if e.code == ErrorCode::UnknownBlock) && h.request_id == 4,
            "push of a missing block: {m:?}"
        );

        // The same connection still works: a pull of an owned block...
        let b = owned[0];
        let (_, off, len) = c.blocks[b as usize];
        let (h, m) =
            call_raw(&mut conn, &k, 5, &Message::Pull { block: b, clock: 0, reply: elasticps_wire::Dtype::F32 });
        match m {
            Message::PullReply { block, clock: 0, values } if block == b => {
                let want = c.expected[c.blocks[b as usize].0][off..off + len].to_vec();
                assert_eq!((h.request_id, values.to_vec()), (5, want), "initial values of block {b}");
            }
            other => panic!("pull of owned block {b} after UnknownBlock: {other:?}"),
        }
        // ...a block of the other server is Moved, not unknown...
        let (h, m) =
            call_raw(&mut conn, &k, 6, &Message::Pull { block: foreign, clock: 0, reply: elasticps_wire::Dtype::F32 });
        assert_eq!(h.request_id, 6);
        assert_eq!(
            m,
            Message::Control(Control::Moved { block: foreign, owner: 1 - s, epoch: c.layout.placement.epoch }),
            "pull of a foreign block"
        );
        // ...a push of the wrong length is a BadRequest that keeps the connection...
        let (h, m) = call_raw(
            &mut conn,
            &k,
            7,
            &Message::Push { block: b, clock: 0, values: Values::from_vec(vec![1.0; len + 1]) },
        );
        assert!(
            matches!(&m, Message::Error(e) if e.code == ErrorCode::BadRequest) && h.request_id == 7,
            "push of the wrong length: {m:?}"
        );
        // ...and nothing of that was applied.
        let (_, m) = call_raw(&mut conn, &k, 8, &Control::GetStats.into());
        match m {
            Message::Control(Control::Stats(st)) => assert_eq!((st.server_id, st.totals.pushes), (s, 0), "{st:?}"),
            other => panic!("GetStats: {other:?}"),
        }
    }
    // The well-behaved worker is unaffected.
    c.round("requests for missing blocks");
    c.round("requests for missing blocks");
    finish(c);
}

#[test]
fn the_scheduler_survives_garbage_and_a_job_still_completes() {
    let (mut sched, addr) =
        start_scheduler(&["--servers", "2", "--workers", "1", "--secret", SECRET, "--join-timeout-s", "60"]);
    let garbage_round = |when: &str| {
        for bad in bad_frames() {
            check_refused(&addr, &bad);
        }
        // A well-formed frame that is not a control message: refused (from its header, the
        // connection has not registered) and closed.
        let mut s = connect_raw(&addr, SECRET.as_bytes());
        write_frame(&mut s, &codec(), 9, &Message::Pull { block: 0, clock: 0, reply: elasticps_wire::Dtype::F32 })
            .expect("send");
        match read_reply(&mut s, &codec(), REPLY_TIMEOUT) {
            Reply::Frame(h, Message::Error(e)) => {
                assert_eq!((e.code, h.request_id), (ErrorCode::Forbidden, 9), "{when}: {e}");
                assert!(e.message.contains("only control frames"), "{when}: {e}");
            }
            other => panic!("{when}: a Pull sent to the scheduler: {other:?}"),
        }
        match read_reply(&mut s, &codec(), REPLY_TIMEOUT) {
            Reply::Eof => {}
            other => panic!("{when}: the scheduler should close a connection that sends data frames, got {other:?}"),
        }
    };
    garbage_round("before anyone joined");
    let mut servers = vec![start_server(&addr, &["--secret", SECRET])];
    garbage_round("after a server joined");
    servers.push(start_server(&addr, &["--secret", SECRET]));
    let mut worker = start_worker(
        &addr,
        &["--iterations", "100", "--eval-every", "0", "--secret", SECRET, "--request-timeout-s", "30"],
    );

    worker.assert_success(Duration::from_secs(60));
    let evals = worker.events_named("eval");
    let last = evals.last().unwrap_or_else(|| panic!("the worker printed no eval\n{}", worker.log_tail(30)));
    assert_eq!(last["iteration"], 100);
    assert!(last["accuracy"].as_f64().expect("accuracy") > 0.5, "final eval {last}");
    sched.assert_success(EXIT_TIMEOUT);
    for s in &mut servers {
        s.assert_success(EXIT_TIMEOUT);
    }
}

/// Opens connections to `addr` and sends it invalid frames, one per connection, until
/// `stop`; checks every refusal and counts it in `refused`. Fails with the first wrong
/// refusal seen before `stop` (after it, the job may be ending and the server gone).
fn spam(addr: String, stop: Arc<AtomicBool>, refused: Arc<AtomicU64>, seed: u64) -> Result<(), String> {
    let cases = bad_frames().into_iter().filter(|b| b.expect.is_some()).collect::<Vec<_>>();
    let mut i = seed as usize;
    while !stop.load(Ordering::Relaxed) {
        i += 1;
        match spam_once(&addr, &cases, i) {
            Ok(()) => {
                refused.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) if stop.load(Ordering::Relaxed) => break,
            Err(e) => return Err(e),
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

/// One invalid frame on a new connection to `addr`, and its refusal checked.
fn spam_once(addr: &str, cases: &[Bad], i: usize) -> Result<(), String> {
    let k = codec();
    let sock = addr.parse().map_err(|e| format!("{addr}: {e}"))?;
    let mut s =
        std::net::TcpStream::connect_timeout(&sock, REPLY_TIMEOUT).map_err(|e| format!("connecting to {addr}: {e}"))?;
    s.set_write_timeout(Some(REPLY_TIMEOUT)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(REPLY_TIMEOUT)).map_err(|e| e.to_string())?;
    handshake_raw(&mut s, SECRET.as_bytes()).map_err(|e| format!("handshake with {addr}: {e}"))?;
    if i.is_multiple_of(7) {
        // An oversized header followed by a flood of payload bytes: the node must close the
        // connection instead of reading (or allocating) the announced 4 GiB.
        let head = k.encode_header(&FrameHeader {
            kind: Kind::Push,
            request_id: 77,
            block: 0,
            clock: 0,
            payload_len: u32::MAX,
            flags: elasticps_wire::Flags::default(),
        });
        s.write_all(&head).map_err(|e| format!("sending an oversized header to {addr}: {e}"))?;
        let chunk = noise(64 << 10, i as u64);
        let mut sent = 0usize;
        while sent < 256 << 20 {
            match s.write(&chunk) {
                Ok(n) => sent += n,
                Err(_) => return Ok(()), // refused: the server closed (reset) the connection
            }
        }
        return Err(format!("{addr} took {sent} payload bytes of a frame announcing {} bytes", u32::MAX));
    }
    let bad = &cases[i % cases.len()];
    s.write_all(&bad.bytes).map_err(|e| format!("{}: sending to {addr}: {e}", bad.name))?;
    match read_reply(&mut s, &k, REPLY_TIMEOUT) {
        Reply::Frame(_, Message::Error(e)) if Some(e.code) == bad.expect => {}
        other => return Err(format!("{}: expected {:?} from {addr}, got {other:?}", bad.name, bad.expect)),
    }
    match read_reply(&mut s, &k, REPLY_TIMEOUT) {
        Reply::Eof => Ok(()),
        other => Err(format!("{}: expected {addr} to close, got {other:?}", bad.name)),
    }
}

#[test]
fn garbage_sent_to_a_servers_port_mid_training_does_not_stop_that_training_run() {
    const ITERATIONS: u64 = 300;
    let (mut sched, addr) =
        start_scheduler(&["--servers", "2", "--workers", "2", "--secret", SECRET, "--join-timeout-s", "60"]);
    let (s0, a0) = start_server_on(&addr, &["--secret", SECRET]);
    let (s1, a1) = start_server_on(&addr, &["--secret", SECRET]);
    let mut servers = [s0, s1];
    let worker_args = ["--iterations", "300", "--eval-every", "0", "--secret", SECRET, "--request-timeout-s", "60"];
    let mut workers = [start_worker(&addr, &worker_args), start_worker(&addr, &worker_args)];

    // Connections that stay open for the whole run: a partial header that never completes,
    // and an oversized header whose refusal is only read at the end.
    let mut stalled = Vec::new();
    for a in [&a0, &a1] {
        let mut partial = connect_raw(a, SECRET.as_bytes());
        partial.write_all(&MAGIC).expect("partial header");
        let mut unread = connect_raw(a, SECRET.as_bytes());
        unread
            .write_all(&codec().encode_header(&FrameHeader {
                kind: Kind::Pull,
                request_id: 5,
                block: 0,
                clock: 0,
                payload_len: 1 << 30,
                flags: elasticps_wire::Flags::default(),
            }))
            .expect("oversized");
        stalled.push((partial, unread));
    }

    let stop = Arc::new(AtomicBool::new(false));
    let refused = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut spammers = Vec::new();
    for (n, a) in [&a0, &a1, &a0, &a1].into_iter().enumerate() {
        let (a, stop, refused, errors) = (a.clone(), stop.clone(), refused.clone(), errors.clone());
        spammers.push(std::thread::spawn(move || {
            if let Err(e) = spam(a, stop, refused, n as u64 * 3) {
                errors.lock().unwrap_or_else(|e| e.into_inner()).push(e);
            }
        }));
    }

    // Training is under way once worker 0 reports progress; the spam must overlap it. It
    // stops half way, so that it never races the servers' exit at the end of the job.
    let first = workers[0].wait_event("progress", Duration::from_secs(30));
    let during_from = refused.load(Ordering::Relaxed);
    assert!(first.is_some(), "worker 0 reported no progress\n{}", workers[0].log_tail(30));
    let deadline = Instant::now() + Duration::from_secs(60);
    while let Some(ev) = workers[0].read_event_line(deadline.saturating_duration_since(Instant::now())) {
        if ev["iteration"].as_u64().is_some_and(|i| i >= ITERATIONS / 2) {
            break;
        }
    }
    let during = refused.load(Ordering::Relaxed) - during_from;
    stop.store(true, Ordering::Relaxed);
    for t in spammers {
        t.join().expect("a spammer thread panicked");
    }
    let outcome: Vec<_> = workers.iter_mut().map(|w| w.finish(Duration::from_secs(60))).collect();
    let errors = errors.lock().unwrap_or_else(|e| e.into_inner()).clone();
    assert!(errors.is_empty(), "refusals were wrong: {errors:#?}");

    for (w, status) in workers.iter().zip(&outcome) {
        assert!(matches!(status, Some(s) if s.success()), "{} ended with {status:?}\n{}", w.name, w.log_tail(30));
    }
    eprintln!("{during} invalid frames refused while the workers trained");
    assert!(during > 0, "no garbage was refused while the workers trained");
    let mut ranks = Vec::new();
    for w in &workers {
        let done = w.events_named("worker_done");
        assert_eq!(done.len(), 1, "{}: {:?}", w.name, w.events());
        assert_eq!(done[0]["iterations"], ITERATIONS);
        ranks.push(done[0]["rank"].as_u64().expect("rank"));
    }
    ranks.sort_unstable();
    assert_eq!(ranks, [0, 1]);
    // Rank 0 (whichever process registered first) evaluates the final model.
    let evals: Vec<_> = workers.iter().flat_map(|w| w.events_named("eval")).collect();
    assert_eq!(evals.len(), 1, "only rank 0 evaluates, once at the end (--eval-every 0): {evals:?}");
    let last = evals[0];
    assert_eq!((last["rank"].as_u64(), last["iteration"].as_u64()), (Some(0), Some(ITERATIONS)), "{last}");
    assert!(last["accuracy"].as_f64().expect("accuracy") > 0.5, "final eval {last}");

    sched.assert_success(EXIT_TIMEOUT);
    let (mut pushes, mut pulls, mut blocks) = (0, 0, 0);
    for s in &mut servers {
        s.assert_success(EXIT_TIMEOUT);
        let st = s.server_stats();
        pushes += st["totals"]["pushes"].as_u64().expect("pushes");
        pulls += st["totals"]["pulls"].as_u64().expect("pulls");
        blocks += st["blocks"].as_u64().expect("blocks");
    }
    // Exactly the workers' requests were served; no garbage counted as one. Worker 0
    // pulls once more for its final evaluation.
    assert!(blocks > 0);
    assert_eq!(pushes, blocks * 2 * ITERATIONS, "pushes");
    assert_eq!(pulls, blocks * (2 * ITERATIONS + 1), "pulls");

    // The connection that announced 1 GiB was refused at once, although nobody read it.
    for (partial, mut unread) in stalled {
        match read_reply(&mut unread, &codec(), REPLY_TIMEOUT) {
            Reply::Frame(_, Message::Error(e)) => assert_eq!(e.code, ErrorCode::TooLarge, "{e}"),
            other => panic!("the oversized header kept open: {other:?}"),
        }
        drop(partial);
    }
}

/// The test certificates (crates/cli/tests/data/tls, see its README).
fn tls_file(name: &str) -> String {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tls").join(name).display().to_string()
}

/// `--tls-cert CERT.pem --tls-key CERT.key --tls-ca CA`: `node`/`ca.pem` is this cluster's.
fn tls_flags(cert: &str, ca: &str) -> Vec<String> {
    let f = |n: &str| tls_file(n);
    [
        "--tls-cert".into(),
        f(&format!("{cert}.pem")),
        "--tls-key".into(),
        f(&format!("{cert}.key")),
        "--tls-ca".into(),
        f(ca),
    ]
    .to_vec()
}

/// A job whose every connection is mutual TLS (scheduler, servers, workers as processes,
/// an operator tool) completes, while peers that do not belong are refused at every node
/// and the refusals are logged: a peer whose certificate another CA signed (in process,
/// and a worker process), and a plain-TCP peer (a raw handshake, and `status` without TLS).
#[test]
fn a_job_over_tls_completes_while_a_peer_of_another_ca_and_a_plain_peer_are_refused() {
    let tls = tls_flags("node", "ca.pem");
    let with = |base: &[&str]| base.iter().map(|s| s.to_string()).chain(tls.iter().cloned()).collect::<Vec<_>>();
    let sched_args = with(&["--servers", "2", "--workers", "2", "--secret", SECRET, "--join-timeout-s", "60"]);
    let (mut sched, addr) = start_scheduler(&refs(&sched_args));
    let node_args = with(&["--secret", SECRET]);
    let (s0, a0) = start_server_on(&addr, &refs(&node_args));
    let (s1, a1) = start_server_on(&addr, &refs(&node_args));
    let mut servers = [s0, s1];
    let worker_args =
        with(&["--iterations", "100", "--eval-every", "0", "--secret", SECRET, "--request-timeout-s", "60"]);
    let mut workers = [start_worker(&addr, &refs(&worker_args)), start_worker(&addr, &refs(&worker_args))];
    let first = workers[0].wait_event("progress", Duration::from_secs(60));
    assert!(first.is_some(), "worker 0 reported no progress over TLS\n{}", workers[0].log_tail(30));

    // An operator tool over TLS sees the job; without TLS it is refused.
    let status_args = with(&["status", "--json", "--scheduler", &addr, "--secret", SECRET]);
    let (st, out, err) = run_bin(&refs(&status_args), Duration::from_secs(30));
    assert!(st.success(), "status over TLS failed: {err}");
    assert!(out.contains("servers"), "status over TLS: {out}");
    let (st, _, err) = run_bin(&["status", "--scheduler", &addr, "--secret", SECRET], Duration::from_secs(30));
    assert!(!st.success(), "status without TLS must fail");
    assert!(err.contains("cannot reach the scheduler") && err.contains("TLS"), "{err}");

    let rt = tokio_rt();
    // Trusts our CA (so it would accept our nodes), but another CA signed its certificate.
    let intruder = elasticps_runtime::tls::TlsConfig::from_files(
        std::path::Path::new(&tls_file("other.pem")),
        std::path::Path::new(&tls_file("other.key")),
        std::path::Path::new(&tls_file("ca.pem")),
    )
    .expect("the other CA's certificate loads");
    for node in [&addr, &a0, &a1] {
        let k = codec();
        let dial = elasticps_runtime::conn::dial_with(node, &k, "node", Some(&intruder));
        let e = rt.block_on(async { tokio::time::timeout(REPLY_TIMEOUT * 2, dial).await });
        let e = e.expect("the refusal comes in time").err().unwrap_or_else(|| panic!("{node} took another CA's peer"));
        assert!(e.to_string().contains("refused this node's certificate"), "{node}: {e}");

        let mut plain = connect_unauthenticated(node);
        let e = handshake_raw(&mut plain, SECRET.as_bytes()).expect_err("a plain-TCP peer must be refused");
        assert!(!e.is_empty(), "{node}");
    }
    let mut other_args = vec!["--iterations".to_string(), "1".into(), "--secret".into(), SECRET.into()];
    other_args.extend(tls_flags("other", "ca.pem"));
    let mut w = start_worker(&addr, &refs(&other_args));
    let status = w.finish(Duration::from_secs(30));
    assert!(matches!(status, Some(s) if !s.success()), "a worker of another CA ended with {status:?}");
    assert!(w.log().contains("refused this node's certificate"), "{}", w.log_tail(10));

    for w in &mut workers {
        let status = w.finish(Duration::from_secs(120));
        assert!(matches!(status, Some(s) if s.success()), "{} ended with {status:?}\n{}", w.name, w.log_tail(30));
        assert_eq!(w.events_named("worker_done").len(), 1, "{}: {:?}", w.name, w.events());
    }
    let evals: Vec<_> = workers.iter().flat_map(|w| w.events_named("eval")).collect();
    assert!(evals.iter().any(|e| e["iteration"] == 100), "the final evaluation over TLS: {evals:?}");
    sched.assert_success(EXIT_TIMEOUT);
    for s in &mut servers {
        s.assert_success(EXIT_TIMEOUT);
    }
    for (name, log) in [("scheduler", sched.log()), ("server 0", servers[0].log()), ("server 1", servers[1].log())] {
        assert!(log.contains("connection refused"), "{name} logs each refusal\n{log}");
        assert!(log.contains("tls handshake with"), "{name} logs the TLS refusal\n{log}");
        assert!(log.contains("opened with the plain-TCP handshake, but this node requires TLS"), "{name}\n{log}");
    }
}

/// `elasticps train` passes the TLS flags to every node it starts and the job completes;
/// an incomplete or broken set of TLS flags is refused before any process starts, naming
/// the flag and the file.
#[test]
fn train_over_tls_completes_and_bad_tls_flags_are_refused_up_front() {
    let tls = tls_flags("node", "ca.pem");
    let mut args = vec!["train", "--quiet", "--model", "synthetic:resnet56", "--compute-ms", "1", "--iterations", "10"];
    args.extend(["--secret", SECRET]);
    let report = temp_dir("tls-train");
    let report_s = report.display().to_string();
    let all: Vec<&str> =
        args.iter().copied().chain(tls.iter().map(String::as_str)).chain(["--report", &report_s]).collect();
    let (st, out, err) = run_bin(&all, Duration::from_secs(180));
    assert!(st.success(), "train over TLS failed:\n{out}\n{err}");
    // Every node it started ran with TLS (each logs its transport at start).
    let logs: Vec<_> = std::fs::read_dir(report.join("logs")).expect("the nodes' logs").flatten().collect();
    assert!(logs.len() >= 5, "scheduler, 2 servers, 2 workers: {logs:?}");
    for log in logs {
        let text = std::fs::read_to_string(log.path()).expect("a node's log");
        assert!(text.contains("transport") && text.contains("tls=true"), "{:?}:\n{text}", log.path());
    }

    let (st, _, err) = run_bin(
        &[&args[..], &tls[..2].iter().map(String::as_str).collect::<Vec<_>>()].concat(),
        Duration::from_secs(30),
    );
    assert!(!st.success() && err.contains("--tls-cert, --tls-key and --tls-ca together"), "{err}");
    let missing = tls_file("missing.pem");
    let broken: Vec<&str> =
        ["--tls-cert", tls[1].as_str(), "--tls-key", tls[3].as_str(), "--tls-ca", missing.as_str()].to_vec();
    let (st, _, err) = run_bin(&[&args[..], &broken[..]].concat(), Duration::from_secs(30));
    assert!(!st.success() && err.contains(&format!("--tls-ca {missing}: cannot read it")), "{err}");
}

/// `--max-connections N` bounds a node's authenticated connections: one over it is closed
/// once its handshake is done, and logged, and a connection under it is still served.
#[test]
fn max_connections_closes_a_connection_over_the_bound_and_logs_it() {
    let (mut sched, addr) = start_scheduler(&[
        "--servers",
        "1",
        "--workers",
        "1",
        "--secret",
        SECRET,
        "--join-timeout-s",
        "60",
        "--max-connections",
        "2",
    ]);
    let mut held = vec![connect_raw(&addr, SECRET.as_bytes()), connect_raw(&addr, SECRET.as_bytes())];
    // A connection takes its place once its handshake is done, a moment after the dialer
    // read its verdict: an answer on each proves both hold theirs.
    for (i, s) in held.iter_mut().enumerate() {
        let (_, m) = call_raw(s, &codec(), 1, &Control::GetStatus.into());
        assert!(matches!(m, Message::Control(Control::Status(_))), "held connection {i} is served: {m:?}");
    }
    // Its handshake has places of its own (--max-handshakes); past it, no place is left.
    let mut over = connect_unauthenticated(&addr);
    handshake_raw(&mut over, SECRET.as_bytes()).expect("the handshake itself is not bounded by --max-connections");
    over.set_read_timeout(Some(REPLY_TIMEOUT)).expect("read timeout");
    let mut buf = [0u8; 8];
    match over.read(&mut buf) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("the third connection must be closed at once, got {other:?}"),
    }
    // The held connections still work; freeing one makes room again.
    let (_, m) = call_raw(&mut held[0], &codec(), 2, &Control::GetStatus.into());
    assert!(matches!(m, Message::Control(Control::Status(_))), "a connection under the bound is served: {m:?}");
    held.pop();
    let again = poll_until(REPLY_TIMEOUT, || {
        let mut s = connect_unauthenticated(&addr);
        handshake_raw(&mut s, SECRET.as_bytes()).ok().map(|()| s)
    });
    assert!(again.is_some(), "a freed place is taken again");
    let log = poll_until(REPLY_TIMEOUT, || Some(sched.log()).filter(|l| l.contains("too many connections open")));
    let log = log.unwrap_or_else(|| panic!("the refusal is logged\n{}", sched.log()));
    assert!(log.contains("max=2"), "{log}");
    sched.kill();
}

/// Row frames against live servers (docs/PROTOCOL.md §6.12): a model with a table, defined
/// over a raw control connection; rows pulled in the order asked; every kind of bad row
/// request refused naming what was wrong, on a connection that then goes on serving.
#[test]
fn row_requests_are_served_and_bad_ones_refused_on_a_connection_that_stays_usable() {
    use elasticps_core::model::{Init, TableSpec, TensorSpec};
    use elasticps_core::rows::{RowInit, SparseOptimizer};
    use elasticps_wire::RowIds;

    let (mut sched, addr) = start_scheduler(&[
        "--servers",
        "2",
        "--workers",
        "1",
        "--secret",
        SECRET,
        "--block-bytes",
        "16",
        "--join-timeout-s",
        "60",
    ]);
    let mut servers = vec![start_server(&addr, &["--secret", SECRET]), start_server(&addr, &["--secret", SECRET])];
    let c = codec();
    let mut control = connect_raw(&addr, SECRET.as_bytes());
    let credential = match call_raw(&mut control, &c, 1, &Control::RegisterWorker.into()).1 {
        Message::Control(Control::Welcome { credential, .. }) => credential,
        other => panic!("expected Welcome, got {other:?}"),
    };
    let table =
        TableSpec::new("emb", 8, 2).with_init(RowInit::Constant(0.5)).with_optimizer(SparseOptimizer::Sgd { lr: 1.0 });
    let define = Control::DefineModel {
        tensors: vec![TensorSpec { name: "w".into(), shape: vec![4], init: Init::Constant(0.0) }],
        optimizers: vec![],
        tables: vec![table],
    };
    let layout = match call_raw(&mut control, &c, 2, &define.into()).1 {
        Message::Control(Control::Layout(l)) => l,
        other => panic!("expected the layout, got {other:?}"),
    };
    assert_eq!(layout.partition.blocks.len(), 5, "1 dense block, 4 blocks of 2 rows");
    let owner = layout.placement.owner(1).expect("block 1 has an owner");
    let server_addr = &layout.servers.iter().find(|s| s.id == owner).expect("its address").addr;
    let mut data = connect_raw(server_addr, SECRET.as_bytes());
    let hello = Control::Hello { credential }.into();
    assert_eq!(call_raw(&mut data, &c, 1, &hello).1, Control::Ok.into());

    let pull_rows = |clock, ids: &[u64]| Message::PullRows {
        block: 1,
        clock,
        ids: RowIds::from_slice(ids),
        reply: elasticps_wire::Dtype::F32,
    };
    let push_rows = |dim, ids: &[u64], grads: &[f32]| Message::PushRows {
        block: 1,
        clock: 0,
        dim,
        ids: RowIds::from_slice(ids),
        grads: Values::from_slice(grads),
    };
    let refused =
        |data: &mut std::net::TcpStream, id: u64, msg: Message, mentions: &str| match call_raw(data, &c, id, &msg) {
            (h, Message::Error(e)) => {
                assert_eq!((e.code, h.request_id), (ErrorCode::BadRequest, id), "{e}");
                assert!(e.message.contains(mentions), "{e} should say {mentions:?}");
            }
            other => panic!("expected a refusal naming {mentions:?}, got {other:?}"),
        };
    match call_raw(&mut data, &c, 2, &pull_rows(0, &[1, 0, 1])).1 {
        Message::PullRowsReply { block: 1, clock: 0, values } => assert_eq!(values.to_vec(), vec![0.5; 6]),
        other => panic!("expected the rows, got {other:?}"),
    }
    refused(&mut data, 3, pull_rows(0, &[0, 5]), "row 5 is not in block 1, which holds rows 0..2");
    refused(&mut data, 4, push_rows(1, &[0, 1], &[1.0, 1.0]), "the push carries rows of 1");
    refused(
        &mut data,
        5,
        Message::Pull { block: 1, clock: 0, reply: elasticps_wire::Dtype::F32 },
        "is a range of a table's rows",
    );
    let dense =
        Message::PullRows { block: 0, clock: 0, ids: RowIds::from_slice(&[0]), reply: elasticps_wire::Dtype::F32 };
    if layout.placement.owner(0) == Some(owner) {
        refused(&mut data, 6, dense, "is a slice of a dense tensor");
    }
    // Nothing was applied; the connection serves the next requests.
    assert_eq!(call_raw(&mut data, &c, 7, &push_rows(2, &[1], &[1.0, 2.0])).1, Message::PushAck { block: 1, clock: 0 });
    match call_raw(&mut data, &c, 8, &pull_rows(1, &[1, 0])).1 {
        Message::PullRowsReply { values, .. } => assert_eq!(values.to_vec(), vec![-0.5, -1.5, 0.5, 0.5]),
        other => panic!("expected the rows, got {other:?}"),
    }
    // The job ends when its one worker says so.
    assert_eq!(call_raw(&mut control, &c, 3, &Control::WorkerDone { rank: 0 }.into()).1, Control::Ok.into());
    sched.assert_success(EXIT_TIMEOUT);
    for s in &mut servers {
        s.assert_success(EXIT_TIMEOUT);
    }
}
