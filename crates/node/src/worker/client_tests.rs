//! The client machine driven by hand: dials, frames and layouts fed in, effects checked.

use std::sync::Arc;

use elasticps_core::model::{Init, Partition, TensorSpec};
use elasticps_core::placement::Placement;
use elasticps_wire::credential::{Credential, MAC_LEN, PeerRole};
use elasticps_wire::{Control, ErrorCode, ErrorReply, Layout, Message, ServerAddr, Values};

use super::*;
use crate::Machine;
use crate::timing::{BLOCK_BUSY_RETRY_US, CALL_TIMEOUT_US, FIRST_BACKOFF_US};

/// One tensor of `owners.len()` blocks of 4 values, block b on server `owners[b]`; the
/// servers `addrs` lists (id, address).
fn layout(owners: Vec<u32>, addrs: &[(u32, &str)]) -> Arc<Layout> {
    let n = owners.len() * 4;
    let tensors = vec![TensorSpec { name: "w".into(), shape: vec![n], init: Init::Zeros }];
    Arc::new(Layout {
        partition: Partition::new(tensors, 16).unwrap(),
        placement: Placement::new(1, owners),
        servers: addrs.iter().map(|(id, a)| ServerAddr { id: *id, addr: a.to_string() }).collect(),
        seed: 0,
        wire: Vec::new(),
    })
}

fn client() -> Client {
    let credential = Credential { job: 1, role: PeerRole::Worker, id: 0, mac: [0; MAC_LEN] };
    Client::new(Worker::new(0, 300_000_000, 1_000_000, 0), credential)
}

fn handle(c: &mut Client, now: u64, event: Event<'_>) -> Vec<Effect> {
    let mut out = Vec::new();
    c.handle(now, event, &mut out);
    out
}

/// The connections dialled among `effects`, by server.
fn dials(effects: &[Effect]) -> Vec<(u32, ConnId)> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Dial { server, conn, .. } => Some((*server, *conn)),
            _ => None,
        })
        .collect()
}

/// The round's requests among `effects`: (tag, server).
fn requests(effects: &[Effect]) -> Vec<(Tag, u32)> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Request { tag, server, .. } => Some((*tag, *server)),
            _ => None,
        })
        .collect()
}

fn hellos(effects: &[Effect]) -> usize {
    effects
        .iter()
        .filter(|e| {
            matches!(e, Effect::Send { request_id: HELLO_ID, msg: Message::Control(Control::Hello { .. }), .. })
        })
        .count()
}

fn closes(effects: &[Effect]) -> Vec<ConnId> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Close { conn } => Some(*conn),
            _ => None,
        })
        .collect()
}

fn not_ready() -> Message {
    Message::Error(ErrorReply { code: ErrorCode::NotReady, message: "not yet".into() })
}

/// Installs `l` and opens every connection it dials (their `Hello` accepted unless
/// `accept` is false); returns the connections by server.
fn install(c: &mut Client, now: u64, l: Arc<Layout>, accept: bool) -> Vec<(u32, ConnId)> {
    let dialled = dials(&handle(c, now, Event::Layout(l)));
    for (_, conn) in &dialled {
        assert_eq!(hellos(&handle(c, now, Event::Dialled { conn: *conn })), 1, "Hello first");
        if accept {
            handle(c, now, Event::Frame { conn: *conn, request_id: HELLO_ID, msg: &Control::Ok.into() });
        }
    }
    dialled
}

#[test]
fn requests_wait_for_the_hello_and_a_not_ready_server_is_greeted_again() {
    let mut c = client();
    let conns = install(&mut c, 0, layout(vec![0, 0], &[(0, "s0")]), false);
    let conn = conns[0].1;
    let mut out = Vec::new();
    c.start(10, None, Some((0, &[true])), &mut out).unwrap();
    assert!(requests(&out).is_empty(), "nothing is written before the Hello is accepted: {out:?}");
    // The server has not taken its Welcome yet: Hello again after the backoff.
    assert!(handle(&mut c, 20, Event::Frame { conn, request_id: HELLO_ID, msg: &not_ready() }).is_empty());
    assert_eq!(c.poll_timeout(), Some(20 + FIRST_BACKOFF_US));
    assert_eq!(hellos(&handle(&mut c, 20 + FIRST_BACKOFF_US, Event::Timeout)), 1);
    // Accepted: the held pulls go out, on that connection.
    let out =
        handle(&mut c, 30 + FIRST_BACKOFF_US, Event::Frame { conn, request_id: HELLO_ID, msg: &Control::Ok.into() });
    assert_eq!(requests(&out).len(), 2, "{out:?}");
    let mut done = Vec::new();
    for (tag, _) in requests(&out) {
        let msg = Message::PullReply { block: 0, clock: 0, values: Values::from_vec(vec![0.0; 4]) };
        done.extend(handle(&mut c, 40 + FIRST_BACKOFF_US, Event::Frame { conn, request_id: tag, msg: &msg }));
    }
    assert!(matches!(&done[..], [Effect::RoundDone(_)]), "{done:?}");
}

#[test]
fn a_server_the_layout_drops_is_closed_once_nothing_waits_on_it() {
    let mut c = client();
    let conns = install(&mut c, 0, layout(vec![0, 1], &[(0, "s0"), (1, "s1")]), true);
    let (one, zero) = (conns[1].1, conns[0].1);
    let mut out = Vec::new();
    c.start(10, None, Some((0, &[true])), &mut out).unwrap();
    let sent = requests(&out);
    let on_one = sent.iter().find(|(_, s)| *s == 1).unwrap().0;
    // Server 1 is scaled in while its pull is in flight: kept until it answers.
    let out = handle(&mut c, 20, Event::Layout(layout(vec![0, 0], &[(0, "s0")])));
    assert!(closes(&out).is_empty(), "a connection with a request in flight stays: {out:?}");
    let reply = |b| Message::PullReply { block: b, clock: 0, values: Values::from_vec(vec![0.0; 4]) };
    let out = handle(&mut c, 30, Event::Frame { conn: one, request_id: on_one, msg: &reply(1) });
    assert_eq!(closes(&out), [one], "answered: its connection closes");
    let on_zero = sent.iter().find(|(_, s)| *s == 0).unwrap().0;
    handle(&mut c, 40, Event::Frame { conn: zero, request_id: on_zero, msg: &reply(0) });
    assert!(c.round().is_none());
    assert_eq!(c.connections().collect::<Vec<_>>(), [(0, zero)]);
}

#[test]
fn a_server_listed_at_a_new_address_is_dialled_again_and_its_requests_resent() {
    let mut c = client();
    let conns = install(&mut c, 0, layout(vec![0], &[(0, "s0")]), true);
    let old = conns[0].1;
    let mut out = Vec::new();
    c.start(10, None, Some((0, &[true])), &mut out).unwrap();
    assert_eq!(requests(&out).len(), 1);
    // Server 0 was replaced (restarted elsewhere): its old connection is stale.
    let out = handle(&mut c, 20, Event::Layout(layout(vec![0], &[(0, "s0-new")])));
    assert_eq!(closes(&out), [old], "{out:?}");
    let redial = dials(&out);
    assert_eq!(redial.len(), 1, "{out:?}");
    assert_ne!(redial[0].1, old);
    // A late reply on the stale connection is not taken.
    let stale = Message::PullReply { block: 0, clock: 0, values: Values::from_vec(vec![0.0; 4]) };
    let tag = requests(&out).first().map(|r| r.0).unwrap_or(1 << 32);
    assert!(handle(&mut c, 25, Event::Frame { conn: old, request_id: tag, msg: &stale }).is_empty());
    assert!(c.round().is_some(), "the round waits for the new connection");
}

#[test]
fn a_call_to_a_migrating_block_is_sent_again_until_answered_within_the_call_timeout() {
    let mut c = client();
    let conn = install(&mut c, 0, layout(vec![0], &[(0, "s0")]), true)[0].1;
    let sent = |out: &[Effect]| {
        out.iter()
            .find_map(|e| match e {
                Effect::Send { request_id, msg: Message::Control(Control::GetOptState { block: 0 }), .. } => {
                    Some(*request_id)
                }
                _ => None,
            })
            .expect("the call is sent")
    };
    let mut out = Vec::new();
    c.call(100, Target::Block(0), Control::GetOptState { block: 0 }, &mut out);
    let first = sent(&out);
    assert!(handle(&mut c, 200, Event::Frame { conn, request_id: first, msg: &not_ready() }).is_empty());
    assert_eq!(c.poll_timeout(), Some(200 + BLOCK_BUSY_RETRY_US));
    let second = sent(&handle(&mut c, 200 + BLOCK_BUSY_RETRY_US, Event::Timeout));
    assert_ne!(first, second, "a new request id: a late answer to the first is not taken");
    let ok = Message::from(Control::Ok);
    let out = handle(&mut c, 300 + BLOCK_BUSY_RETRY_US, Event::Frame { conn, request_id: second, msg: &ok });
    assert!(matches!(&out[..], [Effect::Answered(Message::Control(Control::Ok))]), "{out:?}");
    // Still migrating after the call timeout: the call fails with the server's answer.
    let mut again = Vec::new();
    c.call(1_000, Target::Block(0), Control::GetOptState { block: 0 }, &mut again);
    let id = sent(&again);
    let late = 1_000 + CALL_TIMEOUT_US;
    let out = handle(&mut c, late, Event::Frame { conn, request_id: id, msg: &not_ready() });
    let [Effect::Failed(e)] = &out[..] else { panic!("{out:?}") };
    assert_eq!(e.to_string(), "server 0 answered NotReady: not yet");
}

/// A layout the scheduler pushes unasked (the balancer narrowed blocks' wire dtype) is
/// installed only if its epoch is newer than the installed one: a push overtaken by a
/// newer layout changes nothing.
#[test]
fn a_pushed_layout_is_installed_only_when_newer() {
    let mut c = client();
    let at = |epoch: u64, addr: &str| {
        let mut l = (*layout(vec![0], &[(0, addr)])).clone();
        l.placement.epoch = epoch;
        Arc::new(l)
    };
    handle(&mut c, 0, Event::Layout(at(5, "a:1")));
    for (epoch, installed) in [(4, 5), (5, 5), (6, 6)] {
        handle(&mut c, 1, Event::LayoutPushed(at(epoch, "a:1")));
        assert_eq!(c.layout().map(|l| l.placement.epoch), Some(installed), "a push of epoch {epoch}");
    }
    // Installed as any layout is: a server at a new address is dialled.
    let e = handle(&mut c, 2, Event::LayoutPushed(at(7, "b:2")));
    assert_eq!(dials(&e).len(), 1, "{e:?}");
}
