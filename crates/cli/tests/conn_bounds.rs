//! Issue 35, item 4, against real processes: partial frames must not pin unbounded
//! memory (docs/PROTOCOL.md §8, "partial frames"). Connections of the worst class (the
//! worker's credential, a `Hello` taken) each send the header of a 64 MiB `Push` and most
//! of its payload, then stall; the server's memory stays under its budget for partial
//! frames (`--max-partial-mib`) plus a fixed allowance, the frames that went longest
//! without a byte are dropped for newer ones, and the honest worker trains on and ends
//! exactly.

use std::io::Write;
use std::time::{Duration, Instant};

use elasticps_wire::{Control, DEFAULT_MAX_PAYLOAD, FrameHeader, Kind, Message};

use crate::common::tiny::{Job, Shape};
use crate::common::*;

/// The cluster secret of the job.
const SECRET: &str = "partial-s3cret";
/// The servers' budget for partial frames in this test, MiB (`--max-partial-mib`).
const BUDGET_MIB: u64 = 256;
/// What a server may hold beyond the budget and its memory before the attack, MiB: the
/// payload pool (64 MiB at most), a 256 KiB read buffer per connection (16 MiB for 64),
/// one evicted frame's buffer not yet freed when the next one is counted (64 MiB), and
/// 64 MiB for the allocator and the rest.
const ALLOWANCE_MIB: u64 = 208;

/// A field of `/proc/<pid>/status` in MiB (`VmRSS`, `VmHWM`).
fn mem_mib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("the server's /proc status");
    let line = status.lines().find(|l| l.starts_with(field)).unwrap_or_else(|| panic!("no {field} in {status}"));
    let kib: u64 = line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).expect("a size in kB");
    kib / 1024
}

/// 64 connections, each with a `Hello` taken, send the header of a 64 MiB `Push` and
/// 60 MiB of its payload, then stall: the server's resident memory never passes its
/// partial-frame budget plus [`ALLOWANCE_MIB`] over what it held before, the ones that
/// went longest without a byte are dropped (logged), and the honest worker trains between
/// the attacks and ends exactly.
#[test]
fn sixty_four_stalled_64_mib_frames_stay_within_the_partial_frame_budget() {
    const ATTACKERS: usize = 64;
    const SENT: usize = 60 << 20;
    let budget = BUDGET_MIB.to_string();
    let budget: &'static str = Box::leak(budget.into_boxed_str());
    let mut job = Job::start(Shape { flags: vec!["--max-partial-mib", budget], ..Shape::new(SECRET) });
    job.round("start");
    let pid = job.servers[0].as_ref().expect("server 0").pid();
    let before = mem_mib(pid, "VmRSS");
    let started = Instant::now();
    let codec = job.codec();
    let payload = vec![0u8; SENT];
    let (mut stalled, mut dropped) = (Vec::new(), 0);
    for i in 0..ATTACKERS {
        let mut s = connect_raw(&job.addrs[0], SECRET.as_bytes());
        let (_, ok) = call_raw(&mut s, &codec, 1, &job.hello());
        assert_eq!(ok, Message::Control(Control::Ok), "attacker {i}'s Hello");
        let head = codec.encode_header(&FrameHeader {
            kind: Kind::Push,
            request_id: 2,
            block: 0,
            clock: 1_000,
            payload_len: DEFAULT_MAX_PAYLOAD,
            flags: elasticps_wire::Flags::default(),
        });
        // A write fails once the server dropped this frame for a newer one.
        match s.write_all(&head).and_then(|()| s.write_all(&payload)) {
            Ok(()) => stalled.push(s),
            Err(_) => dropped += 1,
        }
        if i % 16 == 15 {
            job.round(&format!("{} stalled frames", i + 1));
        }
    }
    let (rss, peak) = (mem_mib(pid, "VmRSS"), mem_mib(pid, "VmHWM"));
    eprintln!(
        "{ATTACKERS} attackers in {:?}: {} stalled, {dropped} dropped while sending; server RSS {before} MiB before, \
         {rss} MiB after, peak {peak} MiB (budget {BUDGET_MIB} MiB + allowance {ALLOWANCE_MIB} MiB)",
        started.elapsed(),
        stalled.len()
    );
    assert!(
        peak <= before + BUDGET_MIB + ALLOWANCE_MIB,
        "the server's peak resident memory {peak} MiB passed {before} + {BUDGET_MIB} + {ALLOWANCE_MIB} MiB"
    );
    let log = job.server_log(0);
    assert!(
        log.contains("went longest without a byte") && log.contains("--max-partial-mib"),
        "the server logs the frames it dropped:\n{log}"
    );
    // At most the budget's worth of stalled frames is still held: the others were closed.
    let held = stalled
        .iter_mut()
        .map(|s| {
            s.set_read_timeout(Some(Duration::from_millis(200))).expect("timeout");
            let mut b = [0u8; 64];
            // An Error or EOF: closed; a timeout: the server still holds the frame.
            matches!(std::io::Read::read(s, &mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut)
        })
        .filter(|held| *held)
        .count();
    eprintln!("{held} stalled frames still held");
    assert!(held as u64 * 64 <= BUDGET_MIB, "{held} frames of 64 MiB held: more than the budget");
    job.round("the attack");
    drop(stalled);
    job.round("the attackers left");
    job.finish(true);
}

/// Before its `Hello` is taken, a connection to a server may send small control frames
/// alone: a data frame's header, and a control frame's above 64 KiB, are refused from the
/// header (no payload byte follows), the connection closed, and the job goes on exactly.
#[test]
fn a_data_frame_before_hello_is_refused_from_its_header() {
    use elasticps_wire::ErrorCode;
    let job = Job::start(Shape::new(SECRET));
    let codec = job.codec();
    for (kind, len, code, words) in [
        (Kind::Push, DEFAULT_MAX_PAYLOAD, ErrorCode::Forbidden, "only control frames"),
        (Kind::Control, 1 << 20, ErrorCode::TooLarge, "at most 65536 bytes"),
    ] {
        let mut s = connect_raw(&job.addrs[0], SECRET.as_bytes());
        assert_refused_from_header(&mut s, &codec, (kind, len), code, words);
    }
    job.finish(true);
}
