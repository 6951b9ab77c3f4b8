//! The round driven by hand: replies and layouts fed in, actions checked.

use elasticps_core::model::{Init, Partition, TensorSpec};
use elasticps_core::placement::{Placement, RETIRED};
use elasticps_wire::{Control, ErrorCode, ErrorReply, Layout, Message, ServerAddr, Values};

use super::*;
use crate::NodeError;

const TIMEOUT_US: u64 = 300_000_000;
const INTERVAL_US: u64 = 1_000_000;

/// Tensors of `lens` values cut into blocks of `block_len` values, owned as `owners` says.
fn layout(lens: &[usize], block_len: usize, owners: Vec<u32>, epoch: u64, servers: u32) -> Layout {
    let tensors = lens
        .iter()
        .enumerate()
        .map(|(i, n)| TensorSpec { name: format!("t{i}"), shape: vec![*n], init: Init::Zeros })
        .collect();
    let partition = Partition::new(tensors, block_len * 4).unwrap();
    assert_eq!(partition.blocks.len(), owners.len(), "one owner per block");
    Layout {
        partition,
        placement: Placement::new(epoch, owners),
        servers: (0..servers).map(|id| ServerAddr { id, addr: format!("s{id}") }).collect(),
        seed: 0,
        wire: Vec::new(),
    }
}

/// A worker with fusion off: the push, then the pull (the tests of the fused round say
/// [`fused`]).
fn worker() -> Worker {
    Worker::new(0, TIMEOUT_US, INTERVAL_US, 0).with_fusion(false)
}

fn fused() -> Worker {
    let w = Worker::new(0, TIMEOUT_US, INTERVAL_US, 0);
    assert!(w.fuses(), "fusion is the default");
    w
}

/// The sends among `actions`: (tag, server, block id, op).
fn sends(actions: &[Action]) -> Vec<(Tag, u32, u32, Op)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Send { tag, server, block, op } => Some((*tag, *server, block.id, *op)),
            _ => None,
        })
        .collect()
}

/// The reply `msg` to request `tag`, handed to `r` at `now`.
fn reply(r: &mut Round, now: u64, tag: Tag, msg: &Message) -> crate::Result<Vec<Action>> {
    r.handle(now, RoundEvent::Reply { tag, msg })
}

/// The layout `l` handed to `r` at `now` (after [`Action::RefreshLayout`]).
fn relayout(r: &mut Round, now: u64, l: &Layout) -> crate::Result<Vec<Action>> {
    r.handle(now, RoundEvent::Layout(l))
}

/// Request `tag` lost (its connection closed) at `now`.
fn lose(r: &mut Round, now: u64, tag: Tag) -> crate::Result<Vec<Action>> {
    r.handle(now, RoundEvent::Lost { tag })
}

/// The timeout event at `now`.
fn timeout(r: &mut Round, now: u64) -> crate::Result<Vec<Action>> {
    r.handle(now, RoundEvent::Timeout)
}

fn ack(block: u32) -> Message {
    Message::PushAck { block, clock: 0 }
}

fn pulled(block: u32, len: usize) -> Message {
    Message::PullReply { block, clock: 0, values: Values::from_vec(vec![0.5; len]) }
}

/// `Moved` naming server 9, which no layout of these tests lists: the worker must
/// refresh its layout to reach it.
fn moved(block: u32) -> Message {
    moved_to(block, 9, 2)
}

fn moved_to(block: u32, owner: u32, epoch: u64) -> Message {
    Message::Control(Control::Moved { block, owner, epoch })
}

/// (server, block) of each send.
fn where_to(actions: &[Action]) -> Vec<(u32, u32)> {
    sends(actions).iter().map(|(_, s, b, _)| (*s, *b)).collect()
}

#[test]
fn a_pull_is_sent_only_once_its_server_acknowledged_the_pushes() {
    // Two tensors of two blocks each; blocks 0, 1 on server 0, blocks 2, 3 on server 1.
    let l = layout(&[4, 4], 2, vec![0, 0, 1, 1], 1, 2);
    let mut w = worker();
    let (mut r, first) = w.start(10, &l, Some((PushOp::Grad(3), &[true, true])), Some((4, &[true, true]))).unwrap();
    let first = sends(&first);
    assert_eq!(
        first.iter().map(|(_, s, b, op)| (*s, *b, *op)).collect::<Vec<_>>(),
        vec![(0, 0, Op::Push(3)), (0, 1, Op::Push(3)), (1, 2, Op::Push(3)), (1, 3, Op::Push(3))],
        "every push in flight at once, no pull yet"
    );
    let tags: Vec<Tag> = first.iter().map(|s| s.0).collect();
    assert!(reply(&mut r, 20, tags[0], &ack(0)).unwrap().is_empty(), "server 0 has not acknowledged block 1");
    assert!(reply(&mut r, 25, tags[2], &ack(2)).unwrap().is_empty());
    let pulls0 = sends(&reply(&mut r, 30, tags[1], &ack(1)).unwrap());
    assert_eq!(
        pulls0.iter().map(|(_, s, b, op)| (*s, *b, *op)).collect::<Vec<_>>(),
        vec![(0, 0, Op::Pull(4)), (0, 1, Op::Pull(4))]
    );
    let pulls1 = sends(&reply(&mut r, 40, tags[3], &ack(3)).unwrap());
    assert_eq!(pulls1.iter().map(|(_, s, b, _)| (*s, *b)).collect::<Vec<_>>(), vec![(1, 2), (1, 3)]);
    for (tag, _, b, _) in pulls1.iter().chain(&pulls0) {
        assert!(!r.is_done());
        assert!(reply(&mut r, 100 + u64::from(*b), *tag, &pulled(*b, 2)).unwrap().is_empty());
    }
    assert!(r.is_done());
    assert_eq!(r.in_flight(), 0);
    // Server 1's last reply (block 3) came at 103, server 0's (block 1) at 101.
    assert_eq!(r.waited().collect::<Vec<_>>(), vec![(0, 91), (1, 93)]);
    assert_eq!(r.waits_per_server_us(), vec![91, 93]);
    // Push phases: server 0 from 10 to 30, server 1 from 10 to 40; 2 blocks of 8 bytes each.
    assert_eq!(r.push_load().collect::<Vec<_>>(), vec![(0, 16, 20), (1, 16, 30)]);
    assert_eq!(r.refreshes(), 0);
    assert!(w.finish(200, r).is_none(), "no report before the stats interval");
    let load = w.load().current();
    assert_eq!(load.clock, 3);
    assert_eq!(load.per_server.len(), 2);
    assert_eq!((load.per_server[1].rounds, load.per_server[1].wait_us, load.per_server[1].push_us), (1, 93, 30));
}

#[test]
fn a_moved_block_is_resent_to_its_new_owner_after_the_layout() {
    let l = layout(&[4], 2, vec![0, 1], 1, 2);
    let mut w = worker();
    let (mut r, first) = w.start(0, &l, Some((PushOp::Grad(0), &[true])), Some((1, &[true]))).unwrap();
    let first = sends(&first);
    assert_eq!(first.len(), 2);
    // Server 1 acknowledges block 1 and pulls it; server 0 answers Moved for block 0.
    let p1 = sends(&reply(&mut r, 5, first[1].0, &ack(1)).unwrap());
    assert_eq!(p1.iter().map(|(_, s, b, op)| (*s, *b, *op)).collect::<Vec<_>>(), vec![(1, 1, Op::Pull(1))]);
    let after_moved = reply(&mut r, 6, first[0].0, &moved(0)).unwrap();
    assert_eq!(after_moved, vec![Action::RefreshLayout], "nothing sent before the layout");
    assert!(!r.is_done());
    assert!(reply(&mut r, 7, p1[0].0, &pulled(1, 2)).unwrap().is_empty());
    assert!(!r.is_done(), "block 0 is still to push and pull");
    // The new layout gives block 0 to server 1: the push is resent there, then the pull.
    let l2 = layout(&[4], 2, vec![1, 1], 2, 2);
    let resent = sends(&relayout(&mut r, 8, &l2).unwrap());
    assert_eq!(resent.iter().map(|(_, s, b, op)| (*s, *b, *op)).collect::<Vec<_>>(), vec![(1, 0, Op::Push(0))]);
    let p0 = sends(&reply(&mut r, 9, resent[0].0, &ack(0)).unwrap());
    assert_eq!(p0.iter().map(|(_, s, b, op)| (*s, *b, *op)).collect::<Vec<_>>(), vec![(1, 0, Op::Pull(1))]);
    assert!(reply(&mut r, 12, p0[0].0, &pulled(0, 2)).unwrap().is_empty());
    assert!(r.is_done());
    assert_eq!(r.refreshes(), 1);
    assert_eq!(r.waited().collect::<Vec<_>>(), vec![(0, 6), (1, 12)]);
    // Server 0 acknowledged nothing: no push sample for it.
    assert_eq!(r.push_load().collect::<Vec<_>>(), vec![(1, 16, 5 + 1)]);
}

#[test]
fn a_moved_naming_a_known_owner_at_a_newer_epoch_resends_there_at_once() {
    let l = layout(&[6], 2, vec![0, 0, 1], 4, 3);
    let mut w = fused();
    let (mut r, first) = w.start(0, &l, Some((PushOp::Grad(3), &[true])), Some((4, &[true]))).unwrap();
    let first = sends(&first);
    // Block 0 moved to server 2 at epoch 5: resent there at once, as the same push_pull.
    let resent = sends(&reply(&mut r, 5, first[0].0, &moved_to(0, 2, 5)).unwrap());
    assert_eq!(
        resent.iter().map(|(_, s, b, op)| (*s, *b, *op)).collect::<Vec<_>>(),
        vec![(2, 0, Op::PushPull(3))],
        "no refresh, no wait"
    );
    for (tag, _, b, _) in resent.iter().chain(&first[1..]) {
        reply(&mut r, 10, *tag, &pulled(*b, 2)).unwrap();
    }
    assert!(r.is_done());
    assert_eq!((r.redirects(), r.refreshes()), (1, 0));
    w.finish(10, r);

    // The next round starts from the same layout (epoch 4), the hint applied: block 0
    // goes to server 2 directly.
    let (mut r, first) = w.start(20, &l, Some((PushOp::Grad(4), &[true])), Some((5, &[true]))).unwrap();
    assert_eq!(where_to(&first), vec![(0, 1), (1, 2), (2, 0)]);
    let first = sends(&first);
    // A Moved at the epoch the round knows of the block (the hint's) or older is chased
    // through the layout...
    assert_eq!(reply(&mut r, 21, first[2].0, &moved_to(0, 1, 5)).unwrap(), vec![Action::RefreshLayout]);
    // ...as is one naming the server that answered, or a server the layout does not list
    // (a refresh is under way: they wait for the next one).
    assert!(reply(&mut r, 22, first[0].0, &moved_to(1, 0, 9)).unwrap().is_empty());
    assert!(reply(&mut r, 23, first[1].0, &moved_to(2, 7, 9)).unwrap().is_empty());
    // A layout of the hint's epoch or later replaces it.
    let acts = relayout(&mut r, 24, &layout(&[6], 2, vec![1, 1, 2], 6, 3)).unwrap();
    assert_eq!(where_to(&acts), vec![(1, 0)]);
    assert_eq!(acts.last(), Some(&Action::RefreshLayout));
    assert!(r.hints.is_empty());
    let again = relayout(&mut r, 25, &layout(&[6], 2, vec![1, 1, 2], 7, 3)).unwrap();
    assert_eq!(where_to(&again), vec![(1, 1), (2, 2)]);
    for (tag, _, b, _) in sends(&acts).iter().chain(&sends(&again)) {
        reply(&mut r, 30, *tag, &pulled(*b, 2)).unwrap();
    }
    assert!(r.is_done());
    assert_eq!((r.redirects(), r.refreshes()), (0, 2));

    // Followed moves need ever newer epochs: a server naming the old owner back at the
    // epoch it was sent on is chased through the layout.
    let mut w = fused();
    let (mut r, first) = w.start(0, &l, Some((PushOp::Grad(0), &[true])), Some((1, &[true]))).unwrap();
    let to1 = reply(&mut r, 1, sends(&first)[0].0, &moved_to(0, 1, 6)).unwrap();
    assert_eq!(where_to(&to1), vec![(1, 0)]);
    assert_eq!(reply(&mut r, 2, sends(&to1)[0].0, &moved_to(0, 0, 6)).unwrap(), vec![Action::RefreshLayout]);
}

#[test]
fn requests_a_lost_server_did_not_answer_go_to_the_owner_of_the_refreshed_layout() {
    // Blocks 0, 1 on server 0, block 2 on server 1.
    let l = layout(&[6], 2, vec![0, 0, 1], 1, 2);
    let mut w = worker();
    let (mut r, first) = w.start(0, &l, Some((PushOp::Grad(3), &[true])), Some((4, &[true]))).unwrap();
    let first = sends(&first);
    assert_eq!(r.waiting_on(0).collect::<Vec<_>>(), vec![first[0].0, first[1].0]);
    // Server 0 acknowledges block 0, then its connection closes with block 1 unanswered.
    let p0 = sends(&reply(&mut r, 5, first[0].0, &ack(0)).unwrap());
    assert!(p0.is_empty(), "the pulls wait for the whole push phase");
    let lost: Vec<Tag> = r.waiting_on(0).collect();
    assert_eq!(lost, vec![first[1].0]);
    let after = lose(&mut r, 6, lost[0]).unwrap();
    // Block 0 was acknowledged: its pull goes to server 0's connection as planned (the
    // runtime finds it closed and reports that pull lost too); block 1 is chased.
    assert_eq!(sends(&after).iter().map(|(_, s, b, op)| (*s, *b, *op)).collect::<Vec<_>>(), vec![(0, 0, Op::Pull(4))]);
    assert!(after.contains(&Action::RefreshLayout));
    let pull0 = sends(&after)[0].0;
    assert!(lose(&mut r, 7, pull0).unwrap().is_empty(), "a refresh is under way: it waits for the next one");
    assert!(lose(&mut r, 7, pull0).unwrap().is_empty(), "a tag no longer waiting changes nothing");
    // Server 1 answers its block as usual.
    let p2 = sends(&reply(&mut r, 8, first[2].0, &ack(2)).unwrap());
    reply(&mut r, 9, p2[0].0, &pulled(2, 2)).unwrap();
    // The refreshed layout names server 1 for every block: block 1's push is resent there
    // (a duplicate if server 0 had applied it), then, after the next refresh, block 0's pull.
    let l2 = layout(&[6], 2, vec![1, 1, 1], 2, 2);
    let resent = relayout(&mut r, 10, &l2).unwrap();
    assert_eq!(sends(&resent).iter().map(|(_, s, b, op)| (*s, *b, *op)).collect::<Vec<_>>(), vec![(1, 1, Op::Push(3))]);
    assert!(resent.contains(&Action::RefreshLayout));
    let pushed = sends(&resent)[0].0;
    let pull1 = sends(&reply(&mut r, 11, pushed, &ack(1)).unwrap());
    assert_eq!(pull1.iter().map(|(_, s, b, op)| (*s, *b, *op)).collect::<Vec<_>>(), vec![(1, 1, Op::Pull(4))]);
    let again = sends(&relayout(&mut r, 12, &layout(&[6], 2, vec![1, 1, 1], 3, 2)).unwrap());
    assert_eq!(again.iter().map(|(_, s, b, op)| (*s, *b, *op)).collect::<Vec<_>>(), vec![(1, 0, Op::Pull(4))]);
    reply(&mut r, 13, pull1[0].0, &pulled(1, 2)).unwrap();
    reply(&mut r, 14, again[0].0, &pulled(0, 2)).unwrap();
    assert!(r.is_done());
}

#[test]
fn a_lost_server_the_layout_keeps_naming_ends_the_round_naming_it() {
    let l = layout(&[2], 2, vec![0], 1, 1);
    let mut w = Worker::new(0, 1_000_000, INTERVAL_US, 0).with_fusion(false);
    let (mut r, first) = w.start(0, &l, Some((PushOp::Grad(0), &[true])), None).unwrap();
    let err = lose(&mut r, 2_500_000, sends(&first)[0].0).unwrap_err();
    assert_eq!(
        err.to_string(),
        "protocol error with servers: the connection to server(s) [0] closed with requests in flight, and the \
         layout still named them after 1 refreshes in 2.5 s"
    );
}

#[test]
fn a_moved_pull_is_resent_as_a_pull() {
    let l = layout(&[2], 2, vec![0], 1, 2);
    let mut w = worker();
    let (mut r, first) = w.start(0, &l, None, Some((7, &[true]))).unwrap();
    let first = sends(&first);
    assert_eq!(first.iter().map(|(_, s, b, op)| (*s, *b, *op)).collect::<Vec<_>>(), vec![(0, 0, Op::Pull(7))]);
    assert_eq!(reply(&mut r, 1, first[0].0, &moved(0)).unwrap(), vec![Action::RefreshLayout]);
    let resent = sends(&relayout(&mut r, 2, &layout(&[2], 2, vec![1], 2, 2)).unwrap());
    assert_eq!(resent.iter().map(|(_, s, b, op)| (*s, *b, *op)).collect::<Vec<_>>(), vec![(1, 0, Op::Pull(7))]);
    reply(&mut r, 3, resent[0].0, &pulled(0, 2)).unwrap();
    assert!(r.is_done());
    assert!(r.iteration().is_none(), "a pull counts no iteration");
}

#[test]
fn the_same_epoch_waits_before_resending() {
    let l = layout(&[2], 2, vec![0], 1, 2);
    let mut w = worker();
    let (mut r, first) = w.start(0, &l, Some((PushOp::Grad(0), &[true])), None).unwrap();
    let tag = sends(&first)[0].0;
    assert_eq!(reply(&mut r, 100, tag, &moved(0)).unwrap(), vec![Action::RefreshLayout]);
    // The scheduler has not published the move yet.
    assert!(relayout(&mut r, 200, &l).unwrap().is_empty());
    assert_eq!(r.poll_timeout(), Some(200 + MOVED_BACKOFF_US), "nothing in flight: the wait's end");
    assert!(timeout(&mut r, 300).unwrap().is_empty(), "too early");
    assert_eq!(r.poll_timeout(), Some(200 + MOVED_BACKOFF_US));
    let resent = sends(&timeout(&mut r, 200 + MOVED_BACKOFF_US).unwrap());
    assert_eq!(resent.iter().map(|(_, s, b, op)| (*s, *b, *op)).collect::<Vec<_>>(), vec![(0, 0, Op::Push(0))]);
    // Moved again: the second refresh waits twice as long.
    assert_eq!(reply(&mut r, 6000, resent[0].0, &moved(0)).unwrap(), vec![Action::RefreshLayout]);
    assert!(relayout(&mut r, 6100, &l).unwrap().is_empty());
    assert_eq!(r.poll_timeout(), Some(6100 + 2 * MOVED_BACKOFF_US));
    let resent = sends(&timeout(&mut r, 6100 + 2 * MOVED_BACKOFF_US).unwrap());
    reply(&mut r, 20_000, resent[0].0, &ack(0)).unwrap();
    assert!(r.is_done());
    assert_eq!(r.refreshes(), 2);
}

#[test]
fn blocks_that_keep_moving_end_the_round_after_the_refresh_limit() {
    let l = layout(&[2], 2, vec![0], 1, 1);
    let mut w = worker();
    let (mut r, first) = w.start(0, &l, Some((PushOp::Grad(0), &[true])), None).unwrap();
    let mut tag = sends(&first)[0].0;
    let mut now = 0;
    for i in 1..=MAX_LAYOUT_REFRESHES as u64 {
        now += 10;
        assert_eq!(reply(&mut r, now, tag, &moved(0)).unwrap(), vec![Action::RefreshLayout]);
        let next = layout(&[2], 2, vec![0], 1 + i, 1);
        tag = sends(&relayout(&mut r, now, &next).unwrap())[0].0;
    }
    let err = reply(&mut r, now + 10, tag, &moved(0)).unwrap_err();
    assert_eq!(err.to_string(), "protocol error with servers: blocks kept moving through 65 layout refreshes in 0.0 s");
}

#[test]
fn blocks_that_keep_moving_end_the_round_after_the_request_timeout() {
    let l = layout(&[2], 2, vec![0], 1, 1);
    let mut w = Worker::new(0, 1_000_000, INTERVAL_US, 0).with_fusion(false);
    let (mut r, first) = w.start(0, &l, Some((PushOp::Grad(0), &[true])), None).unwrap();
    let err = reply(&mut r, 2_500_000, sends(&first)[0].0, &moved(0)).unwrap_err();
    assert!(matches!(err, NodeError::Protocol { .. }));
    assert_eq!(err.to_string(), "protocol error with servers: blocks kept moving through 1 layout refreshes in 2.5 s");
}

#[test]
fn a_block_moved_while_a_refresh_is_under_way_waits_for_the_next_refresh() {
    let l = layout(&[2, 2], 2, vec![0, 1], 1, 3);
    let mut w = worker();
    let (mut r, first) = w.start(0, &l, Some((PushOp::Grad(0), &[true, true])), None).unwrap();
    let first = sends(&first);
    assert_eq!(reply(&mut r, 1, first[0].0, &moved(0)).unwrap(), vec![Action::RefreshLayout]);
    // Block 1 moves while the refresh is under way: no second refresh at once.
    assert!(reply(&mut r, 2, first[1].0, &moved(1)).unwrap().is_empty());
    // The layout (which may predate block 1's move) resends block 0, then refreshes again.
    let l2 = layout(&[2, 2], 2, vec![2, 1], 2, 3);
    let acts = relayout(&mut r, 3, &l2).unwrap();
    let resent0 = sends(&acts);
    assert_eq!(resent0.iter().map(|(_, s, b, _)| (*s, *b)).collect::<Vec<_>>(), vec![(2, 0)]);
    assert_eq!(acts.last(), Some(&Action::RefreshLayout));
    let l3 = layout(&[2, 2], 2, vec![2, 2], 3, 3);
    let resent1 = sends(&relayout(&mut r, 4, &l3).unwrap());
    assert_eq!(resent1.iter().map(|(_, s, b, _)| (*s, *b)).collect::<Vec<_>>(), vec![(2, 1)]);
    reply(&mut r, 5, resent1[0].0, &ack(1)).unwrap();
    assert!(!r.is_done(), "block 0's push is still in flight");
    reply(&mut r, 6, resent0[0].0, &ack(0)).unwrap();
    assert!(r.is_done());
    assert_eq!(r.refreshes(), 2);
}

#[test]
fn push_only_and_pull_only_rounds() {
    let l = layout(&[4], 2, vec![0, 1], 1, 2);
    let mut w = worker();
    let (mut r, first) = w.start(0, &l, Some((PushOp::Grad(5), &[true])), None).unwrap();
    let first = sends(&first);
    assert!(first.iter().all(|(_, _, _, op)| *op == Op::Push(5)));
    for (tag, _, b, _) in &first {
        assert!(reply(&mut r, 3, *tag, &ack(*b)).unwrap().is_empty(), "a push-only round pulls nothing");
    }
    assert!(r.is_done());
    assert_eq!(r.iteration(), Some(Iteration { clock: 5, since_last_us: None }));
    w.finish(3, r);

    let (mut r, first) = w.start(10, &l, None, Some((6, &[true]))).unwrap();
    let first = sends(&first);
    assert_eq!(
        first.iter().map(|(_, s, b, op)| (*s, *b, *op)).collect::<Vec<_>>(),
        vec![(0, 0, Op::Pull(6)), (1, 1, Op::Pull(6))]
    );
    for (tag, _, b, _) in &first {
        reply(&mut r, 20, *tag, &pulled(*b, 2)).unwrap();
    }
    assert!(r.is_done());
    assert_eq!(r.push_load().count(), 0, "a pull measures no service time");
    assert_eq!(r.waited().collect::<Vec<_>>(), vec![(0, 10), (1, 10)]);
}

#[test]
fn a_partial_round_carries_a_pull_only_block_past_its_servers_pushes() {
    // Tensor 0 (blocks 0, 1) pushed and pulled, tensor 1 (block 2) only pulled, tensor 2
    // (block 3) in neither; all on server 0, except block 1 on server 1.
    let l = layout(&[4, 2, 2], 2, vec![0, 1, 0, 0], 1, 2);
    let mut w = worker();
    let (mut r, first) =
        w.start(0, &l, Some((PushOp::Grad(1), &[true, false])), Some((2, &[true, true, false]))).unwrap();
    let first = sends(&first);
    assert_eq!(
        first.iter().map(|(_, s, b, op)| (*s, *b, *op)).collect::<Vec<_>>(),
        vec![(0, 0, Op::Push(1)), (1, 1, Op::Push(1))],
        "block 2's pull waits for server 0's pushes"
    );
    let p0 = sends(&reply(&mut r, 1, first[0].0, &ack(0)).unwrap());
    assert_eq!(
        p0.iter().map(|(_, s, b, op)| (*s, *b, *op)).collect::<Vec<_>>(),
        vec![(0, 0, Op::Pull(2)), (0, 2, Op::Pull(2))]
    );
    let p1 = sends(&reply(&mut r, 2, first[1].0, &ack(1)).unwrap());
    assert_eq!(p1.iter().map(|(_, s, b, _)| (*s, *b)).collect::<Vec<_>>(), vec![(1, 1)]);
    for (tag, _, b, _) in p0.iter().chain(&p1) {
        reply(&mut r, 3, *tag, &pulled(*b, 2)).unwrap();
    }
    assert!(r.is_done());
    // A server that holds only pulled blocks gets a pull phase at once.
    let (_, first) =
        w.start(10, &l, Some((PushOp::Grad(2), &[false, false, true])), Some((3, &[false, true]))).unwrap();
    let first = sends(&first);
    assert_eq!(first.iter().map(|(_, s, b, op)| (*s, *b, *op)).collect::<Vec<_>>(), vec![(0, 3, Op::Push(2))]);
}

#[test]
fn an_init_round_pushes_initial_values() {
    let l = layout(&[2], 2, vec![0], 1, 1);
    let mut w = worker();
    let (mut r, first) = w.start(0, &l, Some((PushOp::Init, &[true])), None).unwrap();
    let first = sends(&first);
    assert_eq!(first[0].3, Op::Init);
    assert!(r.iteration().is_none(), "init counts no iteration");
    reply(&mut r, 1, first[0].0, &ack(0)).unwrap();
    assert!(r.is_done());
}

#[test]
fn a_round_with_nothing_to_do_is_done_at_once() {
    let l = layout(&[2], 2, vec![0], 1, 1);
    let mut w = worker();
    let (r, first) = w.start(0, &l, Some((PushOp::Grad(0), &[false])), Some((1, &[]))).unwrap();
    assert!(first.is_empty());
    assert!(r.is_done());
    assert_eq!(r.waits_per_server_us(), vec![0]);
}

#[test]
fn wrong_replies_fail_the_round_with_todays_messages() {
    let l = layout(&[2], 2, vec![0], 1, 1);
    let mut w = worker();
    let (mut r, first) = w.start(0, &l, None, Some((4, &[true]))).unwrap();
    let tag = sends(&first)[0].0;
    let err = reply(&mut r, 1, tag, &pulled(0, 3)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "protocol error with server 0: expected PullReply of 2 values, got PullReply of 3 values"
    );
    let err = reply(&mut r, 1, tag, &ack(0)).unwrap_err();
    assert_eq!(err.to_string(), "protocol error with server 0: expected PullReply of 2 values, got PushAck");
    let refusal = ErrorReply { code: ErrorCode::UnknownBlock, message: "no block 0".into() };
    let err = reply(&mut r, 1, tag, &Message::Error(refusal)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "server 0 (answering pull(clock 4) of block 0 from worker 0) answered UnknownBlock: no block 0"
    );
    assert!(matches!(reply(&mut r, 1, tag + 1, &pulled(0, 2)), Err(NodeError::Refused(_))), "no such request");
    let (mut r2, first2) = w.start(10, &l, Some((PushOp::Grad(0), &[true])), None).unwrap();
    let tag2 = sends(&first2)[0].0;
    assert_ne!(tag2, tag, "tags are unique across rounds");
    assert!(matches!(reply(&mut r2, 11, tag, &ack(0)), Err(NodeError::Refused(_))), "a reply from an earlier round");
    let err = reply(&mut r2, 11, tag2, &pulled(0, 2)).unwrap_err();
    assert_eq!(err.to_string(), "protocol error with server 0: expected PushAck, got PullReply of 2 values");
    // A reply counts once.
    reply(&mut r2, 12, tag2, &ack(0)).unwrap();
    assert!(matches!(reply(&mut r2, 13, tag2, &ack(0)), Err(NodeError::Refused(_))));
}

#[test]
fn a_layout_without_the_block_fails_the_resend() {
    let l = layout(&[4], 2, vec![0, 0], 1, 1);
    let mut w = worker();
    let (mut r, first) = w.start(0, &l, None, Some((0, &[true]))).unwrap();
    let first = sends(&first);
    reply(&mut r, 1, first[0].0, &pulled(0, 2)).unwrap();
    assert_eq!(reply(&mut r, 1, first[1].0, &moved(1)).unwrap(), vec![Action::RefreshLayout]);
    let mut short = layout(&[2], 2, vec![0], 2, 1);
    short.placement.owners.clear();
    assert!(matches!(relayout(&mut r, 2, &short), Err(NodeError::Core(_))));
}

#[test]
fn the_load_report_counts_iterations_and_is_due_every_interval() {
    let l = layout(&[2], 2, vec![0], 1, 1);
    let mut w = worker();
    let mut now = 0;
    for clock in 0..3 {
        // Two rounds per clock (tensor by tensor): one iteration.
        for _ in 0..2 {
            let (mut r, first) = w.start(now, &l, Some((PushOp::Grad(clock), &[true])), None).unwrap();
            reply(&mut r, now + 100, sends(&first)[0].0, &ack(0)).unwrap();
            assert!(w.finish(now + 100, r).is_none());
            now += 150_000;
        }
    }
    let (mut r, first) = w.start(now, &l, Some((PushOp::Grad(3), &[true])), None).unwrap();
    assert_eq!(r.iteration(), Some(Iteration { clock: 3, since_last_us: Some(300_000) }));
    reply(&mut r, now + 100, sends(&first)[0].0, &ack(0)).unwrap();
    let report = w.finish(INTERVAL_US, r).expect("the interval passed");
    assert_eq!((report.rank, report.clock, report.iterations, report.iter_us), (0, 3, 3, 900_000));
    assert_eq!(report.per_server.len(), 1);
    let s = &report.per_server[0];
    assert_eq!((s.server, s.rounds, s.push_bytes, s.push_us, s.wait_us), (0, 7, 7 * 8, 700, 700));
    let fresh = w.load().current();
    assert_eq!((fresh.clock, fresh.iterations, fresh.per_server.len()), (3, 0, 0));
}

mod schedules {
    //! Random rounds against a model cluster whose blocks move while the round runs (and
    //! whose scheduler may publish a move late), whose connections close at random, with
    //! random windows, answered in random order: every pushed block is acknowledged
    //! once, every pulled block answered once, no pull before its block's push was
    //! acknowledged, never more requests in flight to a server than the window, and the
    //! round ends.

    use proptest::prelude::*;

    use super::*;

    #[derive(Debug, Clone)]
    struct Case {
        servers: u32,
        blocks_per_tensor: Vec<usize>,
        owners: Vec<u32>,
        push: Option<Vec<bool>>,
        pull: Option<Vec<bool>>,
        /// Random choices: which request is answered next, when a block moves, where.
        choices: Vec<u32>,
        /// The worker fuses push and pull.
        fuse: bool,
        /// Requests in flight to one server at most.
        window: usize,
    }

    fn case() -> impl Strategy<Value = Case> {
        (1u32..5, prop::collection::vec(1usize..5, 1..5)).prop_flat_map(|(servers, blocks_per_tensor)| {
            let blocks: usize = blocks_per_tensor.iter().sum();
            let tensors = blocks_per_tensor.len();
            (
                Just(servers),
                Just(blocks_per_tensor),
                prop::collection::vec(0..servers, blocks),
                prop::option::of(prop::collection::vec(any::<bool>(), tensors)),
                prop::option::of(prop::collection::vec(any::<bool>(), tensors)),
                prop::collection::vec(any::<u32>(), 64..256),
                any::<bool>(),
                1usize..6,
            )
                .prop_map(|(servers, blocks_per_tensor, owners, push, pull, choices, fuse, window)| Case {
                    servers,
                    blocks_per_tensor,
                    owners,
                    push,
                    pull,
                    choices,
                    fuse,
                    window,
                })
        })
    }

    fn run(c: &Case) -> Result<(), TestCaseError> {
        let lens = &c.blocks_per_tensor;
        let mut truth = layout(lens, 1, c.owners.clone(), 1, c.servers);
        // What the scheduler publishes: the truth, or (after a late move) the one before.
        let mut published = truth.clone();
        let nblocks = c.owners.len();
        let mut choice = c.choices.iter().copied().cycle();
        let mut w = worker().with_fusion(c.fuse).with_window(c.window);
        let push = c.push.as_deref().map(|m| (PushOp::Grad(3), m));
        let pull = c.pull.as_deref().map(|m| (4, m));
        let pushes = |t: u32| c.push.as_ref().is_some_and(|m| m[t as usize]);
        let pulls = |t: u32| c.pull.as_ref().is_some_and(|m| m[t as usize]);
        let (mut r, first) = w.start(0, &truth, push, pull).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut in_flight: Vec<(Tag, u32, BlockSpec, Op)> = Vec::new();
        let (mut acked, mut answered) = (vec![0u32; nblocks], vec![0u32; nblocks]);
        let mut refresh = false;
        let (mut moves, mut losses) = (0, 0);
        let mut now = 0u64;
        let mut todo = first;
        for _ in 0..10_000 {
            for a in todo.drain(..) {
                match a {
                    Action::Send { tag, server, block, op } => {
                        let t = block.tensor;
                        match op {
                            Op::Push(_) => prop_assert!(pushes(t), "push of a tensor not pushed"),
                            Op::Pull(_) => {
                                prop_assert!(pulls(t), "pull of a tensor not pulled");
                                prop_assert!(
                                    !pushes(t) || acked[block.id as usize] == 1,
                                    "pull of block {} before its push was acknowledged",
                                    block.id
                                );
                            }
                            Op::PushPull(_) => {
                                prop_assert!(c.fuse && pushes(t) && pulls(t), "push_pull of block {}", block.id);
                                prop_assert_eq!(acked[block.id as usize], 0, "push_pull after the push was acked");
                            }
                            Op::Init => prop_assert!(false, "no init in this round"),
                            Op::PushRows(_) | Op::PullRows(_) => prop_assert!(false, "a row op in a tensor round"),
                        }
                        if !c.fuse {
                            prop_assert!(!matches!(op, Op::PushPull(_)), "push_pull without fusion");
                        }
                        in_flight.push((tag, server, block, op));
                    }
                    Action::RefreshLayout => {
                        prop_assert!(!refresh);
                        refresh = true;
                    }
                }
            }
            for s in 0..c.servers {
                // The window of each lane: requests that carry a push, requests that pull.
                for pulls in [false, true] {
                    let n = in_flight.iter().filter(|f| f.1 == s && f.3.carries_values() != pulls).count();
                    prop_assert!(
                        n <= c.window,
                        "{} requests in flight to server {} (pulls {}), window {}",
                        n,
                        s,
                        pulls,
                        c.window
                    );
                }
                let n = in_flight.iter().filter(|f| f.1 == s).count();
                prop_assert_eq!(n, r.in_flight_to(s), "the round counts what is in flight");
            }
            if in_flight.is_empty() {
                prop_assert_eq!(r.queued(), 0, "requests held back with room in every window");
            }
            if r.is_done() {
                break;
            }
            // The wait before resending moved blocks (a request's deadline is far later).
            let wake = r.poll_timeout().filter(|t| *t < now + TIMEOUT_US / 2);
            prop_assert!(wake.is_none() || !refresh, "a wait while a refresh is under way");
            now += 10;
            let pick = choice.next().unwrap_or(0);
            if moves < 6 && pick % 7 == 0 {
                // A block moves; the scheduler publishes it at once or late.
                let b = (pick / 7) as usize % nblocks;
                let to = (truth.placement.owners[b] + 1) % c.servers;
                truth.placement.owners[b] = to;
                truth.placement.epoch += 1;
                moves += 1;
                if pick % 2 == 0 {
                    published = truth.clone();
                }
                continue;
            }
            if losses < 3 && pick % 11 == 5 && !in_flight.is_empty() {
                // A server's connection closes: what it did not answer is lost (its
                // pushes may or may not have been applied: counted as not).
                let s = in_flight[pick as usize % in_flight.len()].1;
                in_flight.retain(|f| f.1 != s);
                losses += 1;
                todo = r
                    .handle(now, RoundEvent::ServerLost { server: s })
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                continue;
            }
            if refresh && (in_flight.is_empty() || pick % 3 == 0) {
                refresh = false;
                let l = published.clone();
                published = truth.clone();
                todo = relayout(&mut r, now, &l).map_err(|e| TestCaseError::fail(e.to_string()))?;
                continue;
            }
            if let Some(until) = wake.filter(|_| in_flight.is_empty() || pick % 3 == 1) {
                now = now.max(until);
                todo = timeout(&mut r, now).map_err(|e| TestCaseError::fail(e.to_string()))?;
                continue;
            }
            prop_assert!(!in_flight.is_empty(), "the round waits for nothing");
            let (tag, server, block, op) = in_flight.swap_remove(pick as usize % in_flight.len());
            let b = block.id;
            let msg = if truth.placement.owners[b as usize] != server {
                moved(b)
            } else if op.is_push() {
                acked[b as usize] += 1;
                ack(b)
            } else if let Op::PushPull(_) = op {
                acked[b as usize] += 1;
                answered[b as usize] += 1;
                pulled(b, block.len)
            } else {
                answered[b as usize] += 1;
                pulled(b, block.len)
            };
            todo = reply(&mut r, now, tag, &msg).map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
        prop_assert!(r.is_done(), "the round did not end");
        prop_assert!(in_flight.is_empty());
        for blk in &truth.partition.blocks {
            let id = blk.id as usize;
            prop_assert_eq!(acked[id], u32::from(pushes(blk.tensor)), "block {} acknowledged", id);
            prop_assert_eq!(answered[id], u32::from(pulls(blk.tensor)), "block {} answered", id);
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        #[test]
        fn every_block_is_pushed_and_pulled_once_however_blocks_move(c in case()) {
            run(&c)?;
        }
    }
}

#[test]
fn a_fused_round_sends_one_push_pull_per_block_pushed_and_pulled() {
    // Tensor 0 (blocks 0, 1) pushed and pulled, tensor 1 (block 2) only pushed, tensor 2
    // (block 3) only pulled; blocks 0 and 2 on server 0, 1 and 3 on server 1.
    let l = layout(&[4, 2, 2], 2, vec![0, 1, 0, 1], 1, 2);
    let mut w = fused();
    let (mut r, first) =
        w.start(10, &l, Some((PushOp::Grad(3), &[true, true, false])), Some((4, &[true, false, true]))).unwrap();
    let first = sends(&first);
    assert_eq!(
        first.iter().map(|(_, s, b, op)| (*s, *b, *op)).collect::<Vec<_>>(),
        vec![(0, 0, Op::PushPull(3)), (0, 2, Op::Push(3)), (1, 1, Op::PushPull(3))],
        "fused where pushed and pulled, a plain push where only pushed, the pull-only block waits"
    );
    // A PushAck to a push_pull says its pull is held: the request leaves the window and
    // waits for its PullReply, which settles it; a second PushAck is a protocol error.
    let (mut other, sent) =
        fused().start(10, &l, Some((PushOp::Grad(3), &[true, true, false])), Some((4, &[true, false, true]))).unwrap();
    let tag = sends(&sent)[0].0;
    assert!(reply(&mut other, 15, tag, &ack(0)).unwrap().is_empty());
    assert!(other.is_held(tag) && other.op_of(tag) == Some(Op::PushPull(3)), "held, still waiting");
    assert_eq!(other.in_flight_to(0), 1, "only block 2's push is in flight to server 0");
    assert_eq!(other.poll_timeout(), Some(10 + TIMEOUT_US), "a held pull keeps its deadline");
    let err = reply(&mut other, 16, tag, &ack(0)).unwrap_err();
    assert_eq!(err.to_string(), "protocol error with server 0: expected PullReply of 2 values, got PushAck");
    assert!(!Op::PushPull(3).ends_with(Kind::PushAck) && Op::PushPull(3).ends_with(Kind::PullReply));
    assert_eq!(r.op_of(first[0].0), Some(Op::PushPull(3)));
    assert!(reply(&mut r, 20, first[0].0, &pulled(0, 2)).unwrap().is_empty(), "server 0 still has block 2's push");
    assert_eq!(r.op_of(first[0].0), None, "answered");
    assert!(reply(&mut r, 25, first[1].0, &ack(2)).unwrap().is_empty(), "server 0's phase ends: nothing left to pull");
    // Server 1's phase ends with block 1's reply: then block 3 (carried) is pulled.
    let pulls = sends(&reply(&mut r, 40, first[2].0, &pulled(1, 2)).unwrap());
    assert_eq!(pulls.iter().map(|(_, s, b, op)| (*s, *b, *op)).collect::<Vec<_>>(), vec![(1, 3, Op::Pull(4))]);
    assert!(reply(&mut r, 50, pulls[0].0, &pulled(3, 2)).unwrap().is_empty());
    assert!(r.is_done());
    // Push load: both pushes to server 0 (phase 10..25), block 1's to server 1 (10..40).
    assert_eq!(r.push_load().collect::<Vec<_>>(), vec![(0, 16, 15), (1, 8, 30)]);
    assert_eq!(r.waited().collect::<Vec<_>>(), vec![(0, 15), (1, 40)]);
    w.finish(60, r);

    // A pull of another clock than the push's next one is not fused; neither is an init.
    let (_, first) = w.start(100, &l, Some((PushOp::Grad(3), &[true; 3])), Some((3, &[true; 3]))).unwrap();
    assert!(sends(&first).iter().all(|(_, _, _, op)| *op == Op::Push(3)));
    let (_, first) = w.start(100, &l, Some((PushOp::Init, &[true; 3])), Some((0, &[true; 3]))).unwrap();
    assert!(sends(&first).iter().all(|(_, _, _, op)| *op == Op::Init));
}

#[test]
fn a_moved_push_pull_is_resent_whole_and_its_error_names_it() {
    let l = layout(&[4], 2, vec![0, 1], 1, 2);
    let mut w = fused();
    let (mut r, first) = w.start(0, &l, Some((PushOp::Grad(0), &[true])), Some((1, &[true]))).unwrap();
    let first = sends(&first);
    assert_eq!(first.iter().map(|(_, _, _, op)| *op).collect::<Vec<_>>(), vec![Op::PushPull(0); 2]);
    assert_eq!(reply(&mut r, 5, first[0].0, &moved(0)).unwrap(), vec![Action::RefreshLayout]);
    assert!(reply(&mut r, 6, first[1].0, &pulled(1, 2)).unwrap().is_empty());
    let resent = sends(&relayout(&mut r, 8, &layout(&[4], 2, vec![1, 1], 2, 2)).unwrap());
    assert_eq!(resent.iter().map(|(_, s, b, op)| (*s, *b, *op)).collect::<Vec<_>>(), vec![(1, 0, Op::PushPull(0))]);
    // A lost connection resends it whole too.
    assert_eq!(lose(&mut r, 9, resent[0].0).unwrap(), vec![Action::RefreshLayout]);
    let again = sends(&relayout(&mut r, 10, &layout(&[4], 2, vec![0, 1], 3, 2)).unwrap());
    assert_eq!(again.iter().map(|(_, s, b, op)| (*s, *b, *op)).collect::<Vec<_>>(), vec![(0, 0, Op::PushPull(0))]);
    let refusal = ErrorReply { code: ErrorCode::BadRequest, message: "clock gap".into() };
    let err = reply(&mut r, 11, again[0].0, &Message::Error(refusal)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "server 0 (answering push_pull(clock 0) of block 0 from worker 0) answered BadRequest: clock gap"
    );
}

#[test]
fn a_moved_push_pull_is_chased_while_its_servers_other_pulls_are_held() {
    // Blocks 0 and 1 on server 0. The sync policy holds block 1's pull until the other
    // workers push it, and they may wait for this worker's resend of block 0: the chase
    // cannot wait for the phase to end.
    let l = layout(&[4], 2, vec![0, 0], 1, 2);
    let mut w = fused();
    let (mut r, first) = w.start(0, &l, Some((PushOp::Grad(0), &[true])), Some((1, &[true]))).unwrap();
    let first = sends(&first);
    assert_eq!(reply(&mut r, 5, first[0].0, &moved(0)).unwrap(), vec![Action::RefreshLayout], "block 1 still held");
    let resent = sends(&relayout(&mut r, 8, &layout(&[4], 2, vec![1, 0], 2, 2)).unwrap());
    assert_eq!(resent.iter().map(|(_, s, b, op)| (*s, *b, *op)).collect::<Vec<_>>(), vec![(1, 0, Op::PushPull(0))]);
    assert!(reply(&mut r, 9, resent[0].0, &pulled(0, 2)).unwrap().is_empty());
    assert!(!r.is_done(), "block 1 is still held");
    assert!(reply(&mut r, 12, first[1].0, &pulled(1, 2)).unwrap().is_empty());
    assert!(r.is_done());
    assert_eq!(r.refreshes(), 1);
}

#[test]
fn the_window_holds_sends_back_and_an_answer_frees_room_for_the_next() {
    // Five blocks on server 0, one on server 1; a window of 2.
    let l = layout(&[12], 2, vec![0, 0, 0, 0, 0, 1], 1, 2);
    let mut w = worker().with_window(2);
    assert_eq!(w.window(), 2);
    let (mut r, first) = w.start(0, &l, Some((PushOp::Grad(0), &[true])), None).unwrap();
    let first = sends(&first);
    assert_eq!(
        first.iter().map(|(_, s, b, _)| (*s, *b)).collect::<Vec<_>>(),
        vec![(0, 0), (0, 1), (1, 5)],
        "two in flight to server 0, the rest held back; server 1 has its own window"
    );
    assert_eq!((r.in_flight(), r.in_flight_to(0), r.queued()), (3, 2, 3));
    // Each answer lets the next held send out, in the order planned.
    let next = sends(&reply(&mut r, 10, first[1].0, &ack(1)).unwrap());
    assert_eq!(next.iter().map(|(_, s, b, _)| (*s, *b)).collect::<Vec<_>>(), vec![(0, 2)]);
    assert!(reply(&mut r, 11, first[2].0, &ack(5)).unwrap().is_empty(), "server 1 has nothing held");
    let next2 = sends(&reply(&mut r, 12, first[0].0, &ack(0)).unwrap());
    assert_eq!(next2.iter().map(|(_, s, b, _)| (*s, *b)).collect::<Vec<_>>(), vec![(0, 3)]);
    let next3 = sends(&reply(&mut r, 13, next[0].0, &ack(2)).unwrap());
    assert_eq!(next3.iter().map(|(_, s, b, _)| (*s, *b)).collect::<Vec<_>>(), vec![(0, 4)]);
    assert_eq!((r.in_flight_to(0), r.queued()), (2, 0));
    reply(&mut r, 14, next2[0].0, &ack(3)).unwrap();
    reply(&mut r, 15, next3[0].0, &ack(4)).unwrap();
    assert!(r.is_done());
    // The push phase of server 0 ran from the round's start to its last answer.
    assert_eq!(r.push_load().collect::<Vec<_>>(), vec![(0, 5 * 8, 15), (1, 8, 11)]);
}

#[test]
fn a_lost_servers_held_sends_come_back_lost_once_each() {
    let l = layout(&[8], 2, vec![0, 0, 0, 0], 1, 2);
    let mut w = worker().with_window(1);
    let (mut r, first) = w.start(0, &l, Some((PushOp::Grad(0), &[true])), None).unwrap();
    let first = sends(&first);
    assert_eq!(first.len(), 1);
    assert_eq!(r.queued(), 3);
    // The connection closes: the request in flight and the three held back are lost, the
    // round refreshes the layout once and sends nothing to the lost server meanwhile.
    let after = r.handle(5, RoundEvent::ServerLost { server: 0 }).unwrap();
    assert_eq!(after, vec![Action::RefreshLayout]);
    assert_eq!((r.in_flight(), r.queued()), (0, 0));
    assert!(r.handle(6, RoundEvent::ServerLost { server: 0 }).unwrap().is_empty(), "nothing left to lose");
    assert!(lose(&mut r, 6, first[0].0).unwrap().is_empty(), "lost already");
    // Every block is resent once to the new owner, through its window.
    let resent = sends(&relayout(&mut r, 7, &layout(&[8], 2, vec![1, 1, 1, 1], 2, 2)).unwrap());
    assert_eq!(resent.iter().map(|(_, s, b, op)| (*s, *b, *op)).collect::<Vec<_>>(), vec![(1, 0, Op::Push(0))]);
    let mut tag = resent[0].0;
    let mut pushed = vec![0];
    for b in 0..4 {
        let next = sends(&reply(&mut r, 8 + u64::from(b), tag, &ack(b)).unwrap());
        if let Some((t, _, blk, _)) = next.first() {
            tag = *t;
            pushed.push(*blk);
        }
    }
    assert_eq!(pushed, vec![0, 1, 2, 3], "each held block lost and resent exactly once");
    assert!(r.is_done());
    assert_eq!(r.refreshes(), 1);
}

#[test]
fn poll_timeout_is_the_oldest_requests_deadline_and_its_timeout_names_the_wait() {
    let l = layout(&[4], 2, vec![0, 1], 1, 2);
    let mut w = Worker::new(3, 1_000_000, INTERVAL_US, 0).with_fusion(false).with_window(1);
    let (mut r, first) = w.start(100, &l, Some((PushOp::Grad(7), &[true])), Some((8, &[true]))).unwrap();
    let first = sends(&first);
    assert_eq!(r.poll_timeout(), Some(1_000_100), "both sent at 100");
    // Server 0 acknowledges at 500: its pull goes out then, with a later deadline; the
    // oldest request waiting is server 1's push.
    let pull = sends(&reply(&mut r, 500, first[0].0, &ack(0)).unwrap());
    assert_eq!(pull.iter().map(|(_, s, b, op)| (*s, *b, *op)).collect::<Vec<_>>(), vec![(0, 0, Op::Pull(8))]);
    assert_eq!(r.poll_timeout(), Some(1_000_100));
    assert!(timeout(&mut r, 999_999).unwrap().is_empty(), "early: nothing happens");
    let pull1 = sends(&reply(&mut r, 600, first[1].0, &ack(1)).unwrap());
    assert_eq!(r.poll_timeout(), Some(1_000_500), "now the pull sent at 500");
    let err = timeout(&mut r, 1_000_500).unwrap_err();
    assert!(matches!(err, NodeError::Timeout { after_us: 1_000_000, .. }));
    assert_eq!(
        err.to_string(),
        "timed out after 1.0 s: worker 3 waits for server 0 to answer pull(clock 8) of block 0"
    );
    let _ = pull1;
    // A round with nothing in flight wakes for nothing.
    let (r, first) = worker().start(0, &l, None, None).unwrap();
    assert!(first.is_empty() && r.is_done());
    assert_eq!(r.poll_timeout(), None);
}

/// A model of one dense tensor of 4 values (block 0) and one table of 10 rows of 2
/// values, cut into blocks of 2 rows (blocks 1..=5): blocks on servers 0 and 1 in turn.
fn table_layout() -> Layout {
    use elasticps_core::model::TableSpec;
    let tensors = vec![TensorSpec { name: "w".into(), shape: vec![4], init: Init::Zeros }];
    let partition = Partition::with_tables(tensors, vec![TableSpec::new("emb", 10, 2)], 16).unwrap();
    let owners = (0..partition.blocks.len() as u32).map(|b| b % 2).collect();
    Layout {
        partition,
        placement: Placement::new(1, owners),
        servers: (0..2).map(|id| ServerAddr { id, addr: format!("s{id}") }).collect(),
        seed: 0,
        wire: Vec::new(),
    }
}

#[test]
fn a_row_push_goes_to_every_block_of_the_table_and_a_row_pull_only_to_the_wanted_ones() {
    let l = table_layout();
    let mut w = worker();
    // Push: every block of table 0 (1..=5), even those no row of which was touched.
    let (mut r, actions) = w.start_rows(0, &l, 0, RowsOp::Push(3), &|_| false).unwrap();
    let s = sends(&actions);
    let mut blocks: Vec<u32> = s.iter().map(|(_, _, b, _)| *b).collect();
    blocks.sort_unstable();
    assert_eq!(blocks, [1, 2, 3, 4, 5]);
    assert!(s.iter().all(|(_, server, b, op)| *op == Op::PushRows(3) && *server == b % 2));
    for (tag, _, b, _) in &s {
        reply(&mut r, 1, *tag, &ack(*b)).unwrap();
    }
    assert!(r.is_done());
    // The dense push of the clock counts the iteration, not the row round; and a row
    // block's range is not what a push carried: no push rate from row pushes.
    assert!(r.iteration().is_none());
    assert_eq!(r.push_load().count(), 0);
    w.finish(2, r);

    // Pull: only the blocks holding rows asked for; the reply's length is the rows'.
    let (mut r, actions) =
        w.start_rows(3, &l, 0, RowsOp::Pull(4), &|b| b.row_range().is_some_and(|(s, _, _)| s == 4 || s == 8)).unwrap();
    let s = sends(&actions);
    assert_eq!(
        s.iter().map(|(_, _, b, op)| (*b, *op)).collect::<Vec<_>>(),
        [(3, Op::PullRows(4)), (5, Op::PullRows(4))]
    );
    for (tag, _, b, _) in &s {
        let msg = Message::PullRowsReply { block: *b, clock: 4, values: Values::from_vec(vec![1.0; 2]) };
        reply(&mut r, 4, *tag, &msg).unwrap();
    }
    assert!(r.is_done());
}

#[test]
fn a_tensor_round_leaves_the_tables_blocks_out() {
    let l = table_layout();
    let mut w = worker();
    // Table 0's blocks have `tensor == 0`, as tensor 0's: a push of tensor 0 must not
    // send them.
    let (_, actions) = w.start(0, &l, Some((PushOp::Grad(0), &[true])), None).unwrap();
    let mut blocks: Vec<u32> = sends(&actions).iter().map(|(_, _, b, _)| *b).collect();
    blocks.sort_unstable();
    assert_eq!(blocks, [0]);
}

#[test]
fn a_moved_row_block_is_resent_to_its_new_owner() {
    let l = table_layout();
    let mut w = worker();
    let (mut r, actions) = w.start_rows(0, &l, 0, RowsOp::Pull(0), &|b| b.id == 3).unwrap();
    let s = sends(&actions);
    assert_eq!(s.len(), 1);
    let (tag, server, block, _) = s[0];
    assert_eq!((server, block), (1, 3));
    let moved = Message::Control(Control::Moved { block: 3, owner: 0, epoch: 2 });
    let more = sends(&reply(&mut r, 1, tag, &moved).unwrap());
    assert_eq!(more.iter().map(|(_, s, b, op)| (*s, *b, *op)).collect::<Vec<_>>(), [(0, 3, Op::PullRows(0))]);
    let msg = Message::PullRowsReply { block: 3, clock: 0, values: Values::from_vec(vec![0.0; 4]) };
    reply(&mut r, 2, more[0].0, &msg).unwrap();
    assert!(r.is_done());
}

#[test]
fn a_row_round_of_an_unknown_table_is_refused_and_a_timeout_names_pull_rows() {
    let l = table_layout();
    let mut w = worker();
    assert!(matches!(w.start_rows(0, &l, 1, RowsOp::Pull(0), &|_| true), Err(NodeError::Refused(_))));
    let (mut r, _) = w.start_rows(0, &l, 0, RowsOp::Pull(7), &|b| b.id == 2).unwrap();
    let at = r.poll_timeout().unwrap();
    let e = timeout(&mut r, at).unwrap_err().to_string();
    assert!(e.contains("pull_rows(clock 7) of block 2"), "{e}");
}

#[test]
fn a_row_round_whose_block_was_split_asks_to_be_planned_again() {
    let l = table_layout();
    let mut w = worker();
    let (mut r, actions) = w.start_rows(0, &l, 0, RowsOp::Push(0), &|_| true).unwrap();
    let s = sends(&actions);
    let (tag, _, _, _) = *s.iter().find(|(_, _, b, _)| *b == 3).unwrap();
    // The owner split block 3: Moved to no server at epoch 2, and a refresh.
    let moved = Message::Control(Control::Moved { block: 3, owner: RETIRED, epoch: 2 });
    let a = reply(&mut r, 1, tag, &moved).unwrap();
    assert!(a.contains(&Action::RefreshLayout), "{a:?}");
    // The scheduler has not recorded it yet: the same layout, the round waits.
    assert!(r.handle(2, RoundEvent::Layout(&l)).unwrap().is_empty());
    // After a moment it sends again to the owner, which answers Moved again.
    let at = r.poll_timeout().unwrap();
    let again = sends(&r.handle(at, RoundEvent::Timeout).unwrap());
    assert_eq!(again.iter().map(|(_, s, b, _)| (*s, *b)).collect::<Vec<_>>(), [(1, 3)]);
    assert_eq!(reply(&mut r, at, again[0].0, &moved).unwrap(), [Action::RefreshLayout]);
    // Recorded: block 3 is retired, its rows 4 and 5 are blocks 6 and 7.
    let mut split = l.clone();
    let halves = split.partition.split_rows(3, 5).unwrap();
    assert_eq!(split.placement.split(3, 6).unwrap(), halves);
    let e = r.handle(at + 1, RoundEvent::Layout(&split)).unwrap_err();
    assert!(matches!(e, NodeError::Recut { block: 3 }), "{e}");
    // Planned again from that layout, the push goes to the halves.
    let (_, actions) = w.start_rows(at + 2, &split, 0, RowsOp::Push(0), &|_| true).unwrap();
    let mut blocks: Vec<u32> = sends(&actions).iter().map(|(_, _, b, _)| *b).collect();
    blocks.sort_unstable();
    assert_eq!(blocks, [1, 2, 4, 5, 6, 7]);
}

/// Issue 33: a held pull leaves the window. Two workers order server 0's blocks 0 and 1
/// differently, each with a window of 1: each one's first push_pull is held until the other
/// pushes that block. The PushAck of a held push_pull lets the second one out, so each
/// worker's push reaches the server and both pulls are released.
#[test]
fn a_held_push_pull_leaves_the_window_so_the_next_push_goes_out() {
    let l = layout(&[4], 2, vec![0, 0], 1, 1);
    let mut w = fused().with_window(1);
    let (mut r, first) = w.start(10, &l, Some((PushOp::Grad(3), &[true])), Some((4, &[true]))).unwrap();
    let first = sends(&first);
    assert_eq!(first.iter().map(|(_, s, b, op)| (*s, *b, *op)).collect::<Vec<_>>(), vec![(0, 0, Op::PushPull(3))]);
    assert_eq!(r.queued(), 1, "block 1 waits for room");
    // Block 0's pull is held: its push is acknowledged on its own, and block 1 goes out.
    let next = sends(&reply(&mut r, 20, first[0].0, &ack(0)).unwrap());
    assert_eq!(next.iter().map(|(_, s, b, op)| (*s, *b, *op)).collect::<Vec<_>>(), vec![(0, 1, Op::PushPull(3))]);
    assert_eq!((r.in_flight_to(0), r.queued()), (1, 0));
    assert!(reply(&mut r, 30, next[0].0, &pulled(1, 2)).unwrap().is_empty());
    assert!(!r.is_done(), "block 0's pull is still held");
    assert!(reply(&mut r, 40, first[0].0, &pulled(0, 2)).unwrap().is_empty());
    assert!(r.is_done());
}

/// A held push_pull whose block then moves is resent as a pull only: its push was
/// acknowledged.
#[test]
fn a_held_push_pull_that_moves_is_resent_as_a_pull() {
    let l = layout(&[4], 2, vec![0, 0], 1, 2);
    let mut w = fused();
    let (mut r, first) = w.start(10, &l, Some((PushOp::Grad(3), &[true])), Some((4, &[true]))).unwrap();
    let first = sends(&first);
    assert!(reply(&mut r, 20, first[0].0, &ack(0)).unwrap().is_empty());
    let resent = sends(&reply(&mut r, 30, first[0].0, &moved_to(0, 1, 2)).unwrap());
    assert_eq!(resent.iter().map(|(_, s, b, op)| (*s, *b, *op)).collect::<Vec<_>>(), vec![(1, 0, Op::Pull(4))]);
}

/// A push never waits behind a pull for room in its server's window: unfused, with a
/// window of 1, server 0's pull of block 0 is in flight (the sync policy may hold it until
/// other workers push), and block 1, moved to server 0, must still have its push sent there
/// at once (other workers' held pulls may wait for it).
#[test]
fn a_push_does_not_wait_behind_a_pull_for_room() {
    let l = layout(&[4], 2, vec![0, 1], 1, 2);
    let mut w = worker().with_window(1);
    let (mut r, first) = w.start(10, &l, Some((PushOp::Grad(3), &[true])), Some((4, &[true]))).unwrap();
    let first = sends(&first);
    assert_eq!(
        first.iter().map(|(_, s, b, op)| (*s, *b, *op)).collect::<Vec<_>>(),
        vec![(0, 0, Op::Push(3)), (1, 1, Op::Push(3))]
    );
    let pull = sends(&reply(&mut r, 20, first[0].0, &ack(0)).unwrap());
    assert_eq!(pull.iter().map(|(_, s, b, op)| (*s, *b, *op)).collect::<Vec<_>>(), vec![(0, 0, Op::Pull(4))]);
    // Block 1 moved to server 0: its push goes there now, beside the pull in flight.
    let resent = sends(&reply(&mut r, 30, first[1].0, &moved_to(1, 0, 2)).unwrap());
    assert_eq!(resent.iter().map(|(_, s, b, op)| (*s, *b, *op)).collect::<Vec<_>>(), vec![(0, 1, Op::Push(3))]);
    assert_eq!(r.in_flight_to(0), 2);
}
