//! The server driven in memory, step by step: migrations (both ends), failures, races.

use elasticps_core::block::ShardConfig;
use elasticps_core::model::{Init, Partition, TensorSpec};
use elasticps_core::optimizer::{OptimizerConfig, OptimizerKind};
use elasticps_core::placement::{Placement, PlacementKind};
use elasticps_core::sync::SyncPolicy;
use elasticps_wire::{Assignment, Control, Credential, Injection, Message, MigrationReport, PeerRole, Values};

use super::*;

const LEN: usize = 4;

/// The credential a scheduler with the empty secret issues `role` `id` in job 0.
fn cred(role: PeerRole, id: u32) -> Credential {
    Credential::issue(b"", 0, role, id)
}

/// The `Welcome` of server `id`.
fn welcome_of(id: ServerId) -> Message {
    Control::Welcome { node_id: id, num_workers: 2, num_servers: 2, credential: cred(PeerRole::Server, id) }.into()
}

/// Connection `conn` proves it is `role` `id` (once; a second Hello is forbidden).
fn introduce(s: &mut Server, conn: ConnId, role: PeerRole, id: u32) {
    if s.introduced(conn) {
        return;
    }
    let r =
        s.handle(0, Event::Received { conn, request_id: 0, msg: Control::Hello { credential: cred(role, id) }.into() });
    assert_eq!(replies(&r), vec![(conn, 0, Control::Ok.into())], "Hello of {role:?} {id} on {conn}");
}
/// A's migration target: server 1 at "b".
const B: ServerId = 1;

fn assignment(id: ServerId, sync: SyncPolicy) -> Assignment {
    let tensors = vec![TensorSpec { name: "w".into(), shape: vec![2 * LEN], init: Init::Constant(0.0) }];
    let partition = Partition::new(tensors, LEN * 4).unwrap();
    let placement = Placement::initial(PlacementKind::Range, &partition, 2).unwrap();
    let optimizer = OptimizerConfig { kind: OptimizerKind::Sgd, lr: 1.0, aggregate: false, weight_decay: 0.0 };
    Assignment {
        server_id: id,
        partition,
        placement,
        config: ShardConfig { sync, optimizer, workers: 2 },
        seed: 7,
        inject: Injection::default(),
    }
}

/// Server `id`, registered and assigned (block 0 on server 0, block 1 on server 1), with
/// workers 0 and 1 said Hello on connections 1 and 2.
fn server(id: ServerId, sync: SyncPolicy) -> Server {
    server_of(Server::new(format!("addr{id}")).with_trace(true), assignment(id, sync))
}

/// [`server`] from `s`, assigned `a`.
fn server_of(mut s: Server, a: Assignment) -> Server {
    let id = a.server_id;
    let start = s.start(0);
    assert!(matches!(
        &start[..],
        [Action::ToScheduler { request_id: 1, msg: Message::Control(Control::RegisterServer { .. }) }]
    ));
    s.handle(0, Event::FromScheduler { request_id: 1, msg: welcome_of(id) });
    let acts = s.handle(0, Event::FromScheduler { request_id: 0, msg: Control::Assign(Box::new(a)).into() });
    assert!(
        acts.iter().any(|a| matches!(a, Action::ToScheduler { msg: Message::Control(Control::AssignDone { .. }), .. }))
    );
    for (conn, rank) in [(1, 0), (2, 1)] {
        introduce(&mut s, conn, PeerRole::Worker, rank);
    }
    s
}

fn replies(acts: &[Action]) -> Vec<(ConnId, u64, Message)> {
    acts.iter()
        .filter_map(|a| match a {
            Action::Reply { conn, request_id, msg } => Some((*conn, *request_id, msg.clone())),
            _ => None,
        })
        .collect()
}

fn push(s: &mut Server, now: u64, rank: u32, req: u64, block: u32, clock: u32, g: f32) -> Vec<Action> {
    let msg = Message::Push { block, clock, values: Values::from_vec(vec![g; LEN]) };
    s.handle(now, Event::Received { conn: ConnId::from(rank) + 1, request_id: req, msg })
}

fn pull(s: &mut Server, now: u64, rank: u32, req: u64, block: u32, clock: u32) -> Vec<Action> {
    s.handle(
        now,
        Event::Received {
            conn: ConnId::from(rank) + 1,
            request_id: req,
            msg: Message::Pull { block, clock, reply: elasticps_wire::Dtype::F32 },
        },
    )
}

fn pulled(acts: &[Action]) -> Vec<(ConnId, u64, Vec<f32>)> {
    replies(acts)
        .into_iter()
        .filter_map(|(c, r, m)| match m {
            Message::PullReply { values, .. } => Some((c, r, values.to_vec())),
            _ => None,
        })
        .collect()
}

fn acked(acts: &[Action], conn: ConnId, req: u64) -> bool {
    replies(acts).iter().any(|(c, r, m)| (*c, *r) == (conn, req) && matches!(m, Message::PushAck { .. }))
}

fn moved(owner: ServerId, epoch: u64) -> Message {
    Control::Moved { block: 0, owner, epoch }.into()
}

/// The one step to another server in `acts`.
fn to_server(acts: &[Action]) -> (u64, Message) {
    let steps: Vec<_> = acts
        .iter()
        .filter_map(|a| match a {
            Action::ToServer { call, server: B, addr, msg } if addr == "b" => Some((*call, msg.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(steps.len(), 1, "one step to server 1 in {acts:?}");
    steps[0].clone()
}

/// The `MigrateDone` in `acts`: (request id, report).
fn migrate_done(acts: &[Action]) -> (u64, MigrationReport) {
    acts.iter()
        .find_map(|a| match a {
            Action::ToScheduler { request_id, msg: Message::Control(Control::MigrateDone(r)) } => {
                Some((*request_id, r.clone()))
            }
            _ => None,
        })
        .unwrap_or_else(|| panic!("no MigrateDone in {acts:?}"))
}

/// The scheduler settles block 0's migration at `epoch`: `owner` owns it.
fn settle(s: &mut Server, now: u64, epoch: u64, owner: ServerId) -> Vec<Action> {
    s.handle(now, Event::FromScheduler { request_id: 0, msg: Control::Settled { block: 0, epoch, owner }.into() })
}

/// Hands a step of `a` to `b` on connection 100 and returns `b`'s answer.
fn deliver(b: &mut Server, now: u64, (call, msg): (u64, Message)) -> Message {
    introduce(b, 100, PeerRole::Server, 0);
    let r = b.handle(now, Event::Received { conn: 100, request_id: call, msg });
    let mut r = replies(&r);
    assert_eq!(r.len(), 1, "one answer: {r:?}");
    r.remove(0).2
}

fn migrate(a: &mut Server, now: u64, epoch: u64) -> (u64, Message) {
    let msg = Control::Migrate { block: 0, to: B, to_addr: "b".into(), epoch }.into();
    to_server(&a.handle(now, Event::FromScheduler { request_id: 0, msg }))
}

fn phase(s: &Server) -> &'static str {
    match s.slot(0) {
        Some(Slot::Owned(Owned { phase: Phase::Serving, .. })) => "serving",
        Some(Slot::Owned(Owned { phase: Phase::Copying { .. }, .. })) => "copying",
        Some(Slot::Owned(Owned { phase: Phase::Frozen { .. }, .. })) => "frozen",
        Some(Slot::Owned(Owned { phase: Phase::Arrived { .. }, .. })) => "arrived",
        Some(Slot::Gone { .. }) => "gone",
        None => "none",
    }
}

#[test]
fn a_full_migration_applies_every_push_once_and_answers_parked_requests_moved() {
    let (mut a, mut b) = (server(0, SyncPolicy::Asp), server(B, SyncPolicy::Asp));
    assert!(acked(&push(&mut a, 1, 0, 10, 0, 0, 1.0), 1, 10));

    let snapshot = migrate(&mut a, 2, 2);
    assert_eq!(phase(&a), "copying");
    // Served and logged while the snapshot travels; Init is refused meanwhile.
    assert!(acked(&push(&mut a, 3, 1, 11, 0, 0, 2.0), 2, 11));
    let init = Message::Init { block: 0, values: Values::from_vec(vec![0.0; LEN]) };
    let r = a.handle(3, Event::Received { conn: 1, request_id: 12, msg: init });
    assert!(matches!(&replies(&r)[0].2, Message::Error(e) if e.message.contains("is migrating")), "{r:?}");

    let ok = deliver(&mut b, 4, snapshot.clone());
    assert_eq!(ok, Control::Ok.into());
    let delta = to_server(&a.handle(5, Event::FromServer { call: snapshot.0, reply: Ok(ok) }));
    assert_eq!(phase(&a), "frozen");
    assert!(matches!(&delta.1, Message::Control(Control::BlockDelta { pushes, .. }) if pushes.len() == 1));
    // Frozen: parked, no answer yet.
    assert!(replies(&push(&mut a, 6, 0, 13, 0, 1, 4.0)).is_empty());
    assert!(replies(&pull(&mut a, 6, 1, 14, 0, 1)).is_empty());

    let ok = deliver(&mut b, 7, delta.clone());
    assert_eq!(ok, Control::Ok.into());
    let (call, report) = migrate_done(&a.handle(8, Event::FromServer { call: delta.0, reply: Ok(ok) }));
    assert!(call != 0 && report.error.is_none() && report.held == 0, "{report:?}");
    assert_eq!((report.total_us, report.freeze_us), (6, 3));
    assert_eq!(report.bytes, (LEN as u64 + LEN as u64) * 4, "snapshot and one logged push");

    let r = a.handle(9, Event::FromScheduler { request_id: call, msg: Control::Ok.into() });
    assert_eq!(replies(&r), vec![(1, 13, moved(B, 2)), (2, 14, moved(B, 2))]);
    assert_eq!(phase(&a), "gone");
    assert_eq!(replies(&pull(&mut a, 10, 0, 15, 0, 1)), vec![(1, 15, moved(B, 2))]);

    // The new owner serves nothing before the scheduler settled the move.
    assert_eq!(phase(&b), "arrived");
    assert!(replies(&push(&mut b, 10, 1, 19, 0, 1, 8.0)).is_empty(), "parked until settled");
    let r = settle(&mut b, 10, 2, B);
    assert!(acked(&r, 2, 19), "served once settled: {r:?}");
    assert_eq!(phase(&b), "serving");

    // The workers resend at the new owner; a duplicate push changes nothing.
    assert!(acked(&push(&mut b, 11, 1, 20, 0, 0, 2.0), 2, 20));
    assert!(acked(&push(&mut b, 11, 0, 21, 0, 1, 4.0), 1, 21));
    assert_eq!(pulled(&pull(&mut b, 12, 1, 22, 0, 2)), vec![(2, 22, vec![-15.0; LEN])]);
    let (sa, sb) = (a.metrics_snapshot(), b.metrics_snapshot());
    assert_eq!((sa.migrations_out, sa.blocks, sb.migrations_in, sb.blocks), (1, 0, 1, 2));
    assert_eq!(sa.totals.pushes, 2, "the counters of the block that left stay with the old owner");
    assert_eq!(sb.totals.pushes, 2, "the duplicate is not counted");
}

#[test]
fn a_failed_step_serves_the_parked_requests_here() {
    let (mut a, mut b) = (server(0, SyncPolicy::Asp), server(B, SyncPolicy::Asp));
    let snapshot = migrate(&mut a, 1, 2);
    let ok = deliver(&mut b, 2, snapshot.clone());
    let delta = to_server(&a.handle(3, Event::FromServer { call: snapshot.0, reply: Ok(ok) }));
    assert!(replies(&push(&mut a, 4, 0, 10, 0, 0, 1.0)).is_empty());
    assert!(replies(&pull(&mut a, 4, 1, 11, 0, 0)).is_empty());
    let r = a.handle(5, Event::FromServer { call: delta.0, reply: Err("connection refused".into()) });
    assert!(acked(&r, 1, 10));
    assert_eq!(pulled(&r), vec![(2, 11, vec![-1.0; LEN])]);
    let (id, report) = migrate_done(&r);
    assert_eq!((id, report.error.as_deref()), (0, Some("connection refused")));
    assert_eq!(phase(&a), "serving");
    // A late answer to the abandoned step changes nothing.
    assert!(a.handle(6, Event::FromServer { call: delta.0, reply: Ok(Control::Ok.into()) }).is_empty());

    // A step nobody answers fails at its deadline, the call's, as its link failing would.
    let again = migrate(&mut a, 10, 3);
    assert!(
        a.handle(10 + STEP_TIMEOUT_US - 1, Event::Timeout)
            .iter()
            .all(|x| !matches!(x, Action::ToScheduler { msg: Message::Control(Control::MigrateDone(_)), .. }))
    );
    let (_, report) = migrate_done(&a.handle(10 + STEP_TIMEOUT_US, Event::Timeout));
    assert_eq!(report.error.as_deref(), Some("server 1 did not answer the snapshot of block 0 within 30 s"));
    assert_eq!(phase(&a), "serving");
    assert!(
        a.handle(10 + STEP_TIMEOUT_US, Event::FromServer { call: again.0, reply: Ok(Control::Ok.into()) }).is_empty()
    );
    // The new owner's answer as an error names it.
    let snapshot = migrate(&mut a, 20 + STEP_TIMEOUT_US, 4);
    let refused = Message::Error(elasticps_wire::ErrorReply {
        code: elasticps_wire::ErrorCode::BadRequest,
        message: "no".into(),
    });
    let (_, report) =
        migrate_done(&a.handle(21 + STEP_TIMEOUT_US, Event::FromServer { call: snapshot.0, reply: Ok(refused) }));
    assert_eq!(report.error.as_deref(), Some("server 1 answered BadRequest: no"));
}

#[test]
fn a_lost_acknowledgement_never_leaves_two_copies_serving() {
    let (mut a, mut b) = (server(0, SyncPolicy::Ssp(1)), server(B, SyncPolicy::Ssp(1)));
    let snapshot = migrate(&mut a, 1, 2);
    let ok = deliver(&mut b, 2, snapshot.clone());
    let delta = to_server(&a.handle(3, Event::FromServer { call: snapshot.0, reply: Ok(ok) }));
    assert_eq!(deliver(&mut b, 4, delta), Control::Ok.into(), "b holds a copy at epoch 2");
    // The acknowledgement is lost: a's step times out and it keeps serving the block.
    let (_, report) = migrate_done(&a.handle(3 + STEP_TIMEOUT_US, Event::Timeout));
    assert!(report.error.unwrap().contains("server 1 did not answer the last updates of block 0 within 30 s"));
    assert_eq!(phase(&a), "serving");
    let t = 10 + STEP_TIMEOUT_US;
    // A worker with an old layout pushes and pulls at b's copy: parked, not served.
    assert!(replies(&push(&mut b, t, 0, 29, 0, 0, 5.0)).is_empty());
    assert!(replies(&pull(&mut b, t, 0, 30, 0, 2)).is_empty());
    // Training goes on at a.
    for (rank, g) in [(0, 1.0), (1, 2.0)] {
        assert!(acked(
            &push(&mut a, t, rank, 40 + u64::from(rank), 0, 0, g),
            ConnId::from(rank) + 1,
            40 + u64::from(rank)
        ));
    }
    // The scheduler recorded the failure: b drops its copy and sends the worker to a.
    let r = settle(&mut b, t + 1, 2, 0);
    assert_eq!(
        replies(&r)
            .iter()
            .map(|(c, q, m)| (*c, *q, matches!(m, Message::Control(Control::Moved { owner: 0, .. }))))
            .collect::<Vec<_>>(),
        vec![(1, 29, true), (1, 30, true)]
    );
    assert_eq!(phase(&b), "none");
    // The next migration of the block to b goes through.
    let snapshot = migrate(&mut a, t + 2, 3);
    assert_eq!(deliver(&mut b, t + 3, snapshot.clone()), Control::Ok.into());
    let delta = to_server(&a.handle(t + 4, Event::FromServer { call: snapshot.0, reply: Ok(Control::Ok.into()) }));
    assert_eq!(deliver(&mut b, t + 5, delta.clone()), Control::Ok.into());
    let (call, _) = migrate_done(&a.handle(t + 6, Event::FromServer { call: delta.0, reply: Ok(Control::Ok.into()) }));
    a.handle(t + 7, Event::FromScheduler { request_id: call, msg: Control::Ok.into() });
    settle(&mut b, t + 7, 3, B);
    assert_eq!(phase(&a), "gone");
    assert_eq!(pulled(&pull(&mut b, t + 8, 0, 31, 0, 1)), vec![(1, 31, vec![-3.0; LEN])], "only a's pushes count");
    assert_eq!(b.metrics_snapshot().migrations_in, 1);
}

#[test]
fn a_worker_removed_before_its_block_arrives_is_left_out_of_the_quorum() {
    let (mut a, mut b) = (server(0, SyncPolicy::Bsp), server(B, SyncPolicy::Bsp));
    assert!(acked(&push(&mut a, 1, 0, 10, 0, 0, 1.0), 1, 10));
    let snapshot = migrate(&mut a, 2, 2);
    // RemoveWorker reaches the new owner first, between snapshot and delta.
    assert_eq!(deliver(&mut b, 3, snapshot.clone()), Control::Ok.into());
    b.handle(3, Event::FromScheduler { request_id: 0, msg: Control::RemoveWorker { rank: 1 }.into() });
    let delta = to_server(&a.handle(4, Event::FromServer { call: snapshot.0, reply: Ok(Control::Ok.into()) }));
    assert_eq!(deliver(&mut b, 5, delta), Control::Ok.into());
    settle(&mut b, 5, 2, B);
    // bsp pull(1) needs every active worker's clock 0: worker 1 no longer counts.
    assert_eq!(pulled(&pull(&mut b, 6, 0, 11, 0, 1)), vec![(1, 11, vec![-1.0; LEN])]);
    // Without the removal the same pull waits at the old owner's copy.
    assert!(pulled(&pull(&mut a, 6, 0, 12, 0, 1)).is_empty());
}

#[test]
fn a_held_ssp_pull_is_answered_moved_at_the_handover_and_again_by_the_new_owner() {
    let (mut a, mut b) = (server(0, SyncPolicy::Ssp(1)), server(B, SyncPolicy::Ssp(1)));
    assert!(acked(&push(&mut a, 1, 0, 10, 0, 0, 1.0), 1, 10));
    assert!(acked(&push(&mut a, 1, 0, 11, 0, 1, 1.0), 1, 11));
    assert!(replies(&pull(&mut a, 2, 0, 12, 0, 2)).is_empty(), "held: done 0 < 2 - 1");
    let snapshot = migrate(&mut a, 3, 2);
    assert_eq!(deliver(&mut b, 4, snapshot.clone()), Control::Ok.into());
    let delta = to_server(&a.handle(5, Event::FromServer { call: snapshot.0, reply: Ok(Control::Ok.into()) }));
    assert_eq!(deliver(&mut b, 6, delta.clone()), Control::Ok.into());
    let (call, report) = migrate_done(&a.handle(7, Event::FromServer { call: delta.0, reply: Ok(Control::Ok.into()) }));
    assert_eq!(report.held, 1);
    let r = a.handle(8, Event::FromScheduler { request_id: call, msg: Control::Ok.into() });
    assert_eq!(replies(&r), vec![(1, 12, moved(B, 2))], "answered exactly once, Moved");
    settle(&mut b, 8, 2, B);
    // Re-issued at the new owner: held until worker 1 pushes clock 0.
    assert!(replies(&pull(&mut b, 9, 0, 13, 0, 2)).is_empty());
    let r = push(&mut b, 10, 1, 14, 0, 0, 2.0);
    assert!(acked(&r, 2, 14));
    assert_eq!(pulled(&r), vec![(1, 13, vec![-4.0; LEN])]);
    assert!(r.iter().any(|x| matches!(x, Action::Trace(t) if t.held_us == Some(1) && t.done == 1)));
}

#[test]
fn the_scheduler_refusing_the_move_keeps_the_block_and_its_silence_completes_it() {
    let (mut a, mut b) = (server(0, SyncPolicy::Asp), server(B, SyncPolicy::Asp));
    for (epoch, refuse) in [(2, true), (3, false)] {
        let t = epoch * 100 * STEP_TIMEOUT_US;
        let snapshot = migrate(&mut a, t, epoch);
        deliver(&mut b, t, snapshot.clone());
        let delta = to_server(&a.handle(t, Event::FromServer { call: snapshot.0, reply: Ok(Control::Ok.into()) }));
        deliver(&mut b, t, delta.clone());
        let (call, _) = migrate_done(&a.handle(t, Event::FromServer { call: delta.0, reply: Ok(Control::Ok.into()) }));
        assert!(replies(&push(&mut a, t + 1, 0, 10, 0, epoch as u32 - 2, 1.0)).is_empty(), "parked");
        let r = if refuse {
            let no =
                elasticps_wire::ErrorReply { code: elasticps_wire::ErrorCode::BadRequest, message: "unknown".into() };
            a.handle(t + 2, Event::FromScheduler { request_id: call, msg: Message::Error(no) })
        } else {
            a.handle(t + STEP_TIMEOUT_US, Event::Timeout)
        };
        if refuse {
            assert!(acked(&r, 1, 10), "served here: {r:?}");
            assert_eq!(phase(&a), "serving");
        } else {
            assert_eq!(replies(&r), vec![(1, 10, moved(B, 3))]);
            assert_eq!(phase(&a), "gone");
        }
    }
}

#[test]
fn a_drained_server_lingers_until_its_connections_close() {
    let mut a = server(0, SyncPolicy::Asp);
    let snapshot = migrate(&mut a, 1, 2);
    let delta = to_server(&a.handle(2, Event::FromServer { call: snapshot.0, reply: Ok(Control::Ok.into()) }));
    let (call, _) = migrate_done(&a.handle(3, Event::FromServer { call: delta.0, reply: Ok(Control::Ok.into()) }));
    a.handle(4, Event::FromScheduler { request_id: call, msg: Control::Ok.into() });
    let r =
        a.handle(5, Event::FromScheduler { request_id: 0, msg: Control::Shutdown { reason: "drained".into() }.into() });
    assert!(r.is_empty() && a.lingering() && a.shutting_down());
    assert_eq!(replies(&pull(&mut a, 6, 0, 1, 0, 0)), vec![(1, 1, moved(B, 2))], "still answers Moved");
    assert!(a.handle(7, Event::Closed { conn: 1 }).is_empty());
    let r = a.handle(8, Event::Closed { conn: 2 });
    assert_eq!(r, vec![Action::Exit(Exit::Shutdown { reason: "drained".into() })]);
    assert!(a.exited() && a.handle(9, Event::Timeout).is_empty());

    // A server that still owns blocks leaves at once; one never welcomed fails in time.
    let mut c = server(B, SyncPolicy::Asp);
    let r =
        c.handle(1, Event::FromScheduler { request_id: 0, msg: Control::Shutdown { reason: "done".into() }.into() });
    assert_eq!(r, vec![Action::Exit(Exit::Shutdown { reason: "done".into() })]);
    let mut d = Server::new("x");
    d.start(0);
    assert!(matches!(&d.handle(REGISTER_TIMEOUT_US, Event::Timeout)[..], [Action::Exit(Exit::Failed { .. })]));
}

/// The load report among a server's actions.
fn load_report(actions: &[Action]) -> elasticps_wire::ServerLoad {
    actions
        .iter()
        .find_map(|x| match x {
            Action::ToScheduler { request_id: 0, msg: Message::Control(Control::ServerLoad(l)) } => Some(l.clone()),
            _ => None,
        })
        .expect("a load report")
}

/// The load model plans with wire bytes (the balancer's rule 5c halves a compressed
/// block's bytes): a bf16 push counts its 2 bytes a value in the load report, as the
/// link carried them, not the 4 of the f32s it is widened to.
#[test]
fn a_load_report_counts_the_bytes_a_push_carried_on_the_wire() {
    let mut a = server(0, SyncPolicy::Asp);
    let values = Values::encoded(&[1.0; LEN], elasticps_wire::Dtype::Bf16);
    let msg = Message::Push { block: 0, clock: 0, values };
    a.handle(10, Event::Received { conn: 1, request_id: 1, msg });
    let r = a.handle(STATS_INTERVAL_US, Event::Timeout);
    let load = load_report(&r);
    assert_eq!((load.requests, load.bytes_in), (1, 2 * LEN as u64));
}

#[test]
fn the_timeout_sends_load_reports_and_poll_timeout_names_the_next_one() {
    let mut a = server(0, SyncPolicy::Asp);
    push(&mut a, 10, 0, 1, 0, 0, 1.0);
    a.charge(70, 5);
    let r = a.handle(STATS_INTERVAL_US, Event::Timeout);
    let load = load_report(&r);
    assert_eq!((load.requests, load.bytes_in, load.busy_us, load.shaped_us, load.blocks), (1, 16, 70, 5, 1));
    // Heartbeats are the session's (crate::session), not the server's.
    assert!(!r.iter().any(|x| matches!(x, Action::ToScheduler { msg: Message::Control(Control::Heartbeat), .. })));
    assert_eq!(a.poll_timeout(), Some(2 * STATS_INTERVAL_US), "the next load report");
    assert_eq!(a.take_load(1).requests, 0, "reset");
}

#[test]
fn shutdown_completes_a_move_the_scheduler_has_not_confirmed() {
    let (mut a, mut b) = (server(0, SyncPolicy::Asp), server(B, SyncPolicy::Asp));
    let snapshot = migrate(&mut a, 1, 2);
    deliver(&mut b, 1, snapshot.clone());
    let delta = to_server(&a.handle(2, Event::FromServer { call: snapshot.0, reply: Ok(Control::Ok.into()) }));
    deliver(&mut b, 2, delta.clone());
    migrate_done(&a.handle(3, Event::FromServer { call: delta.0, reply: Ok(Control::Ok.into()) }));
    assert!(replies(&pull(&mut a, 4, 0, 9, 0, 0)).is_empty(), "parked");
    let msg = Control::Shutdown { reason: "every worker finished".into() }.into();
    let r = a.handle(5, Event::FromScheduler { request_id: 0, msg });
    assert_eq!(replies(&r), vec![(1, 9, moved(B, 2))]);
    assert_eq!(phase(&a), "gone");
    assert!(a.lingering(), "drained: waits for its connections, not for the step's deadline");
}

#[test]
fn a_move_the_new_owner_takes_after_shutdown_completes_at_once() {
    let (mut a, mut b) = (server(0, SyncPolicy::Asp), server(B, SyncPolicy::Asp));
    let snapshot = migrate(&mut a, 1, 2);
    deliver(&mut b, 1, snapshot.clone());
    let delta = to_server(&a.handle(2, Event::FromServer { call: snapshot.0, reply: Ok(Control::Ok.into()) }));
    let msg = Control::Shutdown { reason: "every worker finished".into() }.into();
    assert!(a.handle(3, Event::FromScheduler { request_id: 0, msg }).is_empty(), "waits for the running migration");
    deliver(&mut b, 4, delta.clone());
    let r = a.handle(5, Event::FromServer { call: delta.0, reply: Ok(Control::Ok.into()) });
    migrate_done(&r);
    assert_eq!(phase(&a), "gone");
    assert!(a.lingering());
}

fn push_pull(s: &mut Server, now: u64, rank: u32, req: u64, block: u32, clock: u32, g: f32) -> Vec<Action> {
    let msg =
        Message::PushPull { block, clock, values: Values::from_vec(vec![g; LEN]), reply: elasticps_wire::Dtype::F32 };
    s.handle(now, Event::Received { conn: ConnId::from(rank) + 1, request_id: req, msg })
}

#[test]
fn a_push_pull_applies_the_push_then_pulls_the_next_clock_under_the_policy() {
    let mut a = server(0, SyncPolicy::Bsp);
    // bsp: pull(1) waits for every worker's clock 0; the push itself is applied at once.
    // A held pull's push is acknowledged on its own (PushAck, then the PullReply under the
    // same id), so that the worker's window does not fill with held pulls (issue 33).
    let r = push_pull(&mut a, 1, 0, 10, 0, 0, 1.0);
    assert_eq!(replies(&r), vec![(1, 10, Message::PushAck { block: 0, clock: 0 })], "held: {r:?}");
    let r = push_pull(&mut a, 2, 1, 11, 0, 0, 2.0);
    assert_eq!(pulled(&r), vec![(1, 10, vec![-3.0; LEN]), (2, 11, vec![-3.0; LEN])]);
    assert!(replies(&r).iter().all(|(_, _, m)| matches!(m, Message::PullReply { clock: 1, .. })), "{r:?}");
    assert!(r.iter().any(|x| matches!(x, Action::Trace(t) if (t.worker, t.clock, t.held_us) == (0, 1, Some(1)))));
    // A resent push_pull: the push is a duplicate (dropped), the pull answered again.
    assert_eq!(pulled(&push_pull(&mut a, 3, 1, 12, 0, 0, 2.0)), vec![(2, 12, vec![-3.0; LEN])]);
    // A plain push releases a held fused pull like any other.
    assert!(acked(&push_pull(&mut a, 4, 0, 13, 0, 1, 1.0), 1, 13));
    let r = push(&mut a, 5, 1, 14, 0, 1, 1.0);
    assert!(acked(&r, 2, 14));
    assert_eq!(pulled(&r), vec![(1, 13, vec![-5.0; LEN])]);
    let totals = a.metrics_snapshot().totals;
    assert_eq!((totals.pushes, totals.pulls, totals.pulls_held), (4, 4, 2));
    // Refusals: a clock gap applies nothing, the last clock has no next one, no Hello.
    let gap = push_pull(&mut a, 6, 0, 15, 0, 5, 1.0);
    assert!(matches!(&replies(&gap)[..], [(1, 15, Message::Error(e))] if e.message.contains("clock")), "{gap:?}");
    let last = push_pull(&mut a, 6, 0, 16, 0, u32::MAX, 1.0);
    assert!(matches!(&replies(&last)[..], [(1, 16, Message::Error(e))] if e.message.contains("last clock")));
    let msg = Message::PushPull {
        block: 0,
        clock: 2,
        values: Values::from_vec(vec![1.0; LEN]),
        reply: elasticps_wire::Dtype::F32,
    };
    let stranger = a.handle(7, Event::Received { conn: 9, request_id: 17, msg });
    assert!(matches!(&replies(&stranger)[..], [(9, 17, Message::Error(_))]));
    assert_eq!(a.metrics_snapshot().totals.pushes, 4, "nothing refused was applied");
    // asp answers at once, with the push applied.
    let mut b = server(0, SyncPolicy::Asp);
    assert_eq!(pulled(&push_pull(&mut b, 1, 0, 1, 0, 0, 1.0)), vec![(1, 1, vec![-1.0; LEN])]);
}

#[test]
fn push_pulls_across_a_handover_apply_every_push_once() {
    let (mut a, mut b) = (server(0, SyncPolicy::Bsp), server(B, SyncPolicy::Bsp));
    // Worker 0's fused request of clock 0 is held (push applied, pull(1) waits for worker 1).
    assert!(acked(&push_pull(&mut a, 1, 0, 10, 0, 0, 1.0), 1, 10));
    let snapshot = migrate(&mut a, 2, 2);
    assert_eq!(deliver(&mut b, 3, snapshot.clone()), Control::Ok.into());
    let delta = to_server(&a.handle(4, Event::FromServer { call: snapshot.0, reply: Ok(Control::Ok.into()) }));
    // Worker 1's arrives frozen: parked whole, nothing applied.
    assert!(replies(&push_pull(&mut a, 5, 1, 11, 0, 0, 2.0)).is_empty());
    assert_eq!(deliver(&mut b, 6, delta.clone()), Control::Ok.into());
    let (call, report) = migrate_done(&a.handle(7, Event::FromServer { call: delta.0, reply: Ok(Control::Ok.into()) }));
    assert_eq!(report.held, 1);
    let r = a.handle(8, Event::FromScheduler { request_id: call, msg: Control::Ok.into() });
    assert_eq!(replies(&r), vec![(2, 11, moved(B, 2)), (1, 10, moved(B, 2))], "both answered once, Moved");
    settle(&mut b, 9, 2, B);
    // Both resend whole at the new owner: worker 0's push is a duplicate (it came in the
    // snapshot), worker 1's is applied; both pulls of clock 1 see exactly both pushes.
    assert!(acked(&push_pull(&mut b, 10, 0, 20, 0, 0, 1.0), 1, 20), "held for worker 1");
    let r = push_pull(&mut b, 11, 1, 21, 0, 0, 2.0);
    assert_eq!(pulled(&r), vec![(1, 20, vec![-3.0; LEN]), (2, 21, vec![-3.0; LEN])]);
    assert_eq!(b.metrics_snapshot().totals.pushes, 1, "only worker 1's push is new here");
}

#[test]
fn a_worker_taken_back_holds_the_quorum_again_from_the_quorums_clock() {
    let mut s = server(0, SyncPolicy::Bsp);
    let sched = |s: &mut Server, msg: Control| s.handle(1, Event::FromScheduler { request_id: 0, msg: msg.into() });
    sched(&mut s, Control::RemoveWorker { rank: 1 });
    for t in 0..3 {
        assert!(acked(&push(&mut s, 2, 0, 10 + u64::from(t), 0, t, 1.0), 1, 10 + u64::from(t)));
    }
    // Restarted: its next clock is the quorum's, 3; the scheduler learns it.
    let a = sched(&mut s, Control::AddWorker { rank: 1 });
    assert!(
        a.iter().any(|x| matches!(
            x,
            Action::ToScheduler { msg: Message::Control(Control::WorkerAdded { rank: 1, clock: 3 }), .. }
        )),
        "{a:?}"
    );
    // bsp pull(4) waits for it again; a clock the quorum went without is a duplicate.
    assert!(pulled(&pull(&mut s, 3, 0, 20, 0, 4)).is_empty());
    assert!(acked(&push(&mut s, 3, 0, 21, 0, 3, 1.0), 1, 21));
    assert!(acked(&push(&mut s, 3, 1, 22, 0, 2, 5.0), 2, 22), "a duplicate is acknowledged, not applied");
    let a = push(&mut s, 4, 1, 23, 0, 3, 1.0);
    assert_eq!(pulled(&a), vec![(1, 20, vec![-5.0; LEN])], "released by the rejoined worker's clock 3");
}

#[test]
fn a_push_past_the_next_checkpoint_waits_until_its_block_is_written() {
    let mut s = server(0, SyncPolicy::Ssp(3));
    let plan = elasticps_wire::CheckpointPlan { dir: "d".into(), every: 2, resume: None };
    s.handle(0, Event::FromScheduler { request_id: 0, msg: Control::Checkpointing(plan).into() });
    for t in 0..2 {
        assert!(acked(&push(&mut s, 1, 0, 10 + u64::from(t), 0, t, 1.0), 1, 10 + u64::from(t)));
    }
    // Worker 0 is at clock 2, the checkpoint's: its push waits for worker 1 to get there.
    assert!(replies(&push(&mut s, 2, 0, 12, 0, 2, 1.0)).is_empty());
    assert!(acked(&push(&mut s, 3, 1, 20, 0, 0, 2.0), 2, 20));
    let a = push(&mut s, 4, 1, 21, 0, 1, 2.0);
    let states: Vec<_> = a
        .iter()
        .filter_map(|x| match x {
            Action::Checkpoint { clock, state, .. } => Some((*clock, state.values.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(states, vec![(2, vec![-6.0; LEN])], "exactly the pushes of clocks 0 and 1");
    assert!(acked(&a, 2, 21) && acked(&a, 1, 12), "the waiting push is served once the state is taken");
}

#[test]
fn a_rejoined_worker_going_on_past_a_checkpoint_clock_skips_to_it_instead_of_waiting_for_itself() {
    let mut s = server(0, SyncPolicy::Ssp(3));
    let sched = |s: &mut Server, msg: Control| s.handle(1, Event::FromScheduler { request_id: 0, msg: msg.into() });
    let plan = elasticps_wire::CheckpointPlan { dir: "d".into(), every: 2, resume: None };
    sched(&mut s, Control::Checkpointing(plan));
    sched(&mut s, Control::RemoveWorker { rank: 1 });
    for t in 0..2 {
        push(&mut s, 1, 0, 10 + u64::from(t), 0, t, 1.0);
    }
    // Back at clock 2 here; another block had gone on to 5, so it goes on from 5.
    sched(&mut s, Control::AddWorker { rank: 1 });
    for t in 2..4 {
        assert!(acked(&push(&mut s, 2, 0, 10 + u64::from(t), 0, t, 1.0), 1, 10 + u64::from(t)));
    }
    assert!(replies(&push(&mut s, 3, 0, 14, 0, 4, 1.0)).is_empty(), "clock 4 waits for the checkpoint of 4");
    // Its push of 5 skips 2..5 first: that completes clock 4's checkpoint, which neither
    // push may wait for.
    let a = push(&mut s, 4, 1, 20, 0, 5, 2.0);
    let clocks: Vec<_> = a.iter().filter_map(|x| matches!(x, Action::Checkpoint { .. }).then_some(())).collect();
    assert_eq!(clocks.len(), 1, "{a:?}");
    assert!(acked(&a, 2, 20) && acked(&a, 1, 14), "{a:?}");
}

/// Server `id` of a `--replicas 2` job (block 0: primary 0, backup 1; block 1: primary 1,
/// backup 0), registered, assigned and told where the other server is, with workers 0
/// and 1 said Hello on connections 1 and 2; the actions of the `Replicas` step.
fn replicated(id: ServerId) -> (Server, Vec<Action>) {
    let mut s = Server::new(format!("addr{id}"));
    s.start(0);
    s.handle(0, Event::FromScheduler { request_id: 1, msg: welcome_of(id) });
    let base = assignment(id, SyncPolicy::Asp);
    let placement = base.placement.clone().with_replicas(2, 2).unwrap();
    let a = Assignment { placement: placement.clone(), ..base };
    s.handle(0, Event::FromScheduler { request_id: 0, msg: Control::Assign(Box::new(a)).into() });
    for (conn, rank) in [(1, 0), (2, 1)] {
        introduce(&mut s, conn, PeerRole::Worker, rank);
    }
    let servers = (0..2).map(|i| elasticps_wire::ServerAddr { id: i, addr: format!("addr{i}") }).collect();
    let acts =
        s.handle(0, Event::FromScheduler { request_id: 0, msg: Control::Replicas { placement, servers }.into() });
    (s, acts)
}

/// The calls to other servers among `acts`: (call, address, message).
fn to_servers(acts: &[Action]) -> Vec<(u64, String, Message)> {
    acts.iter()
        .filter_map(|a| match a {
            Action::ToServer { call, addr, msg, .. } => Some((*call, addr.clone(), msg.clone())),
            _ => None,
        })
        .collect()
}

#[test]
fn a_push_is_acknowledged_only_once_its_backup_applied_it() {
    let (mut primary, acts) = replicated(0);
    let (mut backup, _) = replicated(1);
    // The backup's first copy: the primary's state, sent once it knows the address.
    let sent = to_servers(&acts);
    let [(sync, addr, snapshot)] = &sent[..] else { panic!("one snapshot to the backup: {sent:?}") };
    assert_eq!(addr, "addr1");
    assert!(matches!(snapshot, Message::Control(Control::ReplicaSnapshot(s)) if s.spec.id == 0));
    introduce(&mut backup, 9, PeerRole::Server, 0);
    let r = backup.handle(1, Event::Received { conn: 9, request_id: 1, msg: snapshot.clone() });
    assert_eq!(replies(&r), vec![(9, 1, Control::Ok.into())]);
    primary.handle(1, Event::FromServer { call: *sync, reply: Ok(Control::Ok.into()) });

    // A push: applied, forwarded, and not acknowledged until the backup answers.
    let acts = push(&mut primary, 2, 0, 5, 0, 0, 3.0);
    assert!(replies(&acts).is_empty(), "the PushAck waits for the backup: {acts:?}");
    let sent = to_servers(&acts);
    let [(call, _, forward)] = &sent[..] else { panic!("one forward: {sent:?}") };
    let r = backup.handle(3, Event::Received { conn: 9, request_id: 2, msg: forward.clone() });
    assert_eq!(replies(&r), vec![(9, 2, Control::Ok.into())]);
    assert_eq!(backup.backup_copy(0).map(|b| b.values().to_vec()), Some(vec![-3.0; LEN]), "the copy has the push");
    let acts = primary.handle(4, Event::FromServer { call: *call, reply: Ok(Control::Ok.into()) });
    assert_eq!(replies(&acts), vec![(1, 5, Message::PushAck { block: 0, clock: 0 })]);

    // A forward that fails: the backup is stale, the reply waits for its next snapshot
    // (which holds the push), not for a backup that never answers.
    let acts = push(&mut primary, 5, 1, 6, 0, 0, 1.0);
    let sent = to_servers(&acts);
    let [(call, _, _)] = &sent[..] else { panic!("one forward: {sent:?}") };
    let acts = primary.handle(6, Event::FromServer { call: *call, reply: Err("connection reset".into()) });
    assert!(replies(&acts).is_empty(), "still not acknowledged: {acts:?}");
    let acts = primary.handle(6 + replica::RESYNC_EVERY_US, Event::Timeout);
    let sent = to_servers(&acts);
    let Some((sync, _, Message::Control(Control::ReplicaSnapshot(state)))) = sent.first().cloned() else {
        panic!("a fresh snapshot: {sent:?}")
    };
    assert_eq!(state.values, vec![-4.0; LEN], "the snapshot holds both pushes");
    let acts =
        primary.handle(7 + replica::RESYNC_EVERY_US, Event::FromServer { call: sync, reply: Ok(Control::Ok.into()) });
    assert_eq!(replies(&acts), vec![(2, 6, Message::PushAck { block: 0, clock: 0 })]);
}

#[test]
fn held_pulls_past_the_bound_per_connection_are_refused_and_a_release_makes_room() {
    let mut s = server(0, SyncPolicy::Bsp);
    // Worker 0 asks for clock 1 again and again: under bsp each waits for clock 0.
    for req in 0..MAX_HELD_PER_CONN as u64 {
        assert!(replies(&pull(&mut s, 1, 0, req, 0, 1)).is_empty(), "pull {req} is held");
    }
    let over = pull(&mut s, 1, 0, u64::MAX, 0, 1);
    match &replies(&over)[..] {
        [(1, u64::MAX, Message::Error(e))] => {
            assert_eq!(e.code, ErrorCode::BadRequest);
            assert!(e.message.contains(&format!("{MAX_HELD_PER_CONN} pulls of this connection")), "{e:?}");
        }
        other => panic!("one more than the bound is refused: {other:?}"),
    }
    // The bound is per connection: worker 1's pull is held as usual.
    assert!(replies(&pull(&mut s, 1, 1, 1, 0, 1)).is_empty());
    // Clock 0 complete: every held pull is answered, and worker 0 pulls again.
    push(&mut s, 2, 0, 7, 0, 0, 1.0);
    let released = push(&mut s, 2, 1, 8, 0, 0, 1.0);
    assert_eq!(pulled(&released).len(), MAX_HELD_PER_CONN + 1);
    assert_eq!(pulled(&pull(&mut s, 3, 0, 9, 0, 1)).len(), 1, "clock 1 is answered at once now");
    assert!(replies(&pull(&mut s, 3, 0, 10, 0, 2)).is_empty(), "and clock 2 is held again, under the bound");
}

/// The one error in `acts`, to (`conn`, `req`).
fn refusal(acts: &[Action], conn: ConnId, req: u64) -> String {
    match &replies(acts)[..] {
        [(c, r, Message::Error(e))] if (*c, *r) == (conn, req) && e.code == ErrorCode::BadRequest => e.message.clone(),
        other => panic!("one BadRequest to {conn}/{req}: {other:?}"),
    }
}

#[test]
fn a_closed_connections_held_pulls_are_dropped_and_its_bound_is_free_again() {
    let mut s = server(0, SyncPolicy::Bsp);
    // Worker 0's honest pull of clock 1 on its connection, and a second connection of
    // worker 0 filled to its bound with pulls of clock 1: every one held for clock 0.
    assert!(replies(&pull(&mut s, 1, 0, 1, 0, 1)).is_empty());
    introduce(&mut s, 3, PeerRole::Worker, 0);
    let far = |s: &mut Server, conn: ConnId, req: u64| {
        s.handle(
            1,
            Event::Received {
                conn,
                request_id: req,
                msg: Message::Pull { block: 0, clock: 1, reply: elasticps_wire::Dtype::F32 },
            },
        )
    };
    for req in 0..MAX_HELD_PER_CONN as u64 {
        assert!(replies(&far(&mut s, 3, req)).is_empty(), "pull {req} is held");
    }
    assert!(refusal(&far(&mut s, 3, 1 << 20), 3, 1 << 20).contains("(MAX_HELD_PER_CONN 65536)"));
    assert_eq!((s.held.total(), s.held.of_conn(3)), (MAX_HELD_PER_CONN + 1, MAX_HELD_PER_CONN));
    // Closed: its pulls leave the block and the count, and are never answered.
    assert!(s.handle(2, Event::Closed { conn: 3 }).is_empty());
    assert_eq!((s.held.total(), s.held.of_conn(3)), (1, 0));
    assert_eq!(s.recount(), Ok(()));
    let Some(Slot::Owned(o)) = s.slot(0) else { panic!("block 0 is here") };
    assert_eq!(o.block.held(), 1);
    // A new connection of the same worker may hold as many again.
    introduce(&mut s, 4, PeerRole::Worker, 0);
    for req in 0..MAX_HELD_PER_CONN as u64 {
        assert!(replies(&far(&mut s, 4, req)).is_empty(), "pull {req} is held again");
    }
    s.handle(3, Event::Closed { conn: 4 });
    // Clock 0 complete: the honest pull alone is answered.
    push(&mut s, 4, 0, 7, 0, 0, 1.0);
    let released = push(&mut s, 4, 1, 8, 0, 0, 1.0);
    assert_eq!(pulled(&released).iter().map(|(c, r, _)| (*c, *r)).collect::<Vec<_>>(), vec![(1, 1)]);
    assert_eq!((s.held.total(), s.recount()), (0, Ok(())));
}

#[test]
fn the_bound_per_server_is_reached_and_a_push_still_releases_only_what_it_releases() {
    let mut s = server(0, SyncPolicy::Bsp);
    // 16 connections of worker 0 hold 65,536 pulls each, far ahead (clock 900).
    let conns = (MAX_HELD_PER_SERVER / MAX_HELD_PER_CONN) as ConnId;
    let started = std::time::Instant::now();
    for c in 0..conns {
        introduce(&mut s, 10 + c, PeerRole::Worker, 0);
        for req in 0..MAX_HELD_PER_CONN as u64 {
            let msg = Message::Pull { block: 0, clock: 900, reply: elasticps_wire::Dtype::F32 };
            let r = s.handle(1, Event::Received { conn: 10 + c, request_id: req, msg });
            assert!(r.is_empty(), "pull {req} on {c} is held: {r:?}");
        }
    }
    let per_pull = started.elapsed() / MAX_HELD_PER_SERVER as u32;
    println!("held {MAX_HELD_PER_SERVER} pulls, {per_pull:?} per pull (a test build)");
    assert_eq!(s.held.total(), MAX_HELD_PER_SERVER);
    // One more, on a connection of its own, is refused by the bound per server.
    introduce(&mut s, 9, PeerRole::Worker, 1);
    let r = pull(&mut s, 2, 1, 5, 0, 1);
    assert!(refusal(&r, 2, 5).contains("(MAX_HELD_PER_SERVER 1048576)"), "{r:?}");
    // The honest workers' pushes are acknowledged (a pull is refused while the server is
    // full, whether or not it would be held).
    for clock in 0..3 {
        assert!(acked(&push(&mut s, 3, 0, 100 + u64::from(clock), 0, clock, 1.0), 1, 100 + u64::from(clock)));
        assert!(acked(&push(&mut s, 3, 1, 200 + u64::from(clock), 0, clock, 1.0), 2, 200 + u64::from(clock)));
    }
    assert!(refusal(&pull(&mut s, 4, 0, 300, 0, 3), 1, 300).contains("MAX_HELD_PER_SERVER"));
    // Closing the connections frees the bound.
    for c in 0..conns {
        s.handle(5, Event::Closed { conn: 10 + c });
    }
    assert_eq!(s.held.total(), 0);
    assert_eq!(pulled(&pull(&mut s, 6, 0, 301, 0, 3)).len(), 1, "answered at once");
    assert!(replies(&pull(&mut s, 6, 1, 6, 0, 4)).is_empty(), "held again, under the bound");
    assert_eq!(s.recount(), Ok(()));
}

/// Server 0 with `aggregate` on, `--max-clock-lead 3`.
fn aggregate_server(sync: SyncPolicy) -> Server {
    let mut a = assignment(0, sync);
    a.config.optimizer.aggregate = true;
    server_of(Server::new("addr0").with_max_clock_lead(3), a)
}

fn pending_sums(s: &Server) -> usize {
    let Some(Slot::Owned(o)) = s.slot(0) else { panic!("block 0 is here") };
    o.block.state().pending.len()
}

#[test]
fn under_aggregate_a_push_past_the_clock_lead_is_refused_and_changes_nothing() {
    let mut s = aggregate_server(SyncPolicy::Bsp);
    // done 0: clocks 0 to 3 are within the lead, each keeps a sum.
    for clock in 0..4 {
        assert!(acked(&push(&mut s, 1, 0, u64::from(clock), 0, clock, 1.0), 1, u64::from(clock)));
    }
    let r = push(&mut s, 1, 0, 9, 0, 4, 1.0);
    let e = refusal(&r, 1, 9);
    assert!(e.contains("a push of block 0 at clock 4") && e.contains("(--max-clock-lead 3)"), "{e}");
    assert_eq!(pending_sums(&s), 4, "nothing of it applied");
    // The connection goes on: worker 1 completes clock 0, and the same push is taken.
    assert!(acked(&push(&mut s, 1, 1, 10, 0, 0, 1.0), 2, 10));
    assert!(acked(&push(&mut s, 1, 0, 11, 0, 4, 1.0), 1, 11));
    assert_eq!(pending_sums(&s), 4, "clocks 1 to 4");
    // A push_pull past the lead is refused too (its pull first under bsp: the same rule).
    let msg = Message::PushPull {
        block: 0,
        clock: 5,
        values: Values::from_vec(vec![1.0; LEN]),
        reply: elasticps_wire::Dtype::F32,
    };
    let e = refusal(&s.handle(2, Event::Received { conn: 1, request_id: 12, msg }), 1, 12);
    assert!(e.contains("a pull of block 0 at clock 6") && e.contains("(--max-clock-lead 3)"), "{e}");
    assert_eq!(pending_sums(&s), 4);

    // Under asp the pulls are not bounded, the pushes under aggregate are.
    let mut s = aggregate_server(SyncPolicy::Asp);
    for clock in 0..4 {
        assert!(acked(&push(&mut s, 1, 0, u64::from(clock), 0, clock, 1.0), 1, u64::from(clock)));
    }
    let msg = Message::PushPull {
        block: 0,
        clock: 4,
        values: Values::from_vec(vec![1.0; LEN]),
        reply: elasticps_wire::Dtype::F32,
    };
    let e = refusal(&s.handle(2, Event::Received { conn: 1, request_id: 12, msg }), 1, 12);
    assert!(e.contains("a push of block 0 at clock 4") && e.contains("(--max-clock-lead 3)"), "{e}");
    assert_eq!(pending_sums(&s), 4);

    // Without aggregate a push keeps no sum: not bounded.
    let mut s = server_of(Server::new("addr0").with_max_clock_lead(3), assignment(0, SyncPolicy::Asp));
    for clock in 0..10 {
        assert!(acked(&push(&mut s, 1, 0, u64::from(clock), 0, clock, 1.0), 1, u64::from(clock)));
    }
}

/// One step of [`counts_follow_every_path`].
#[derive(Clone, Copy, Debug)]
enum HeldOp {
    /// Worker `rank` pulls `ahead` clocks past block 0's done clock, on its own connection
    /// or on extra connection `slot` (if open).
    Pull { rank: u32, slot: Option<usize>, ahead: u32 },
    /// Worker `rank` pushes its next clock (fused with the pull of the one after).
    Push { rank: u32, fused: bool },
    /// Extra connection `slot` closes (if open) or opens (if closed) and says Hello.
    Toggle { slot: usize },
    /// The scheduler removes worker `rank` from the quorums, or takes it back.
    Quorum { rank: u32 },
    /// Block 0's migration to server 1 goes one step on (`fail`: the step fails).
    Migrate { fail: bool },
}

fn held_op() -> impl proptest::strategy::Strategy<Value = HeldOp> {
    use proptest::prelude::*;
    prop_oneof![
        4 => (0u32..2, proptest::option::of(0usize..3), 0u32..4)
            .prop_map(|(rank, slot, ahead)| HeldOp::Pull { rank, slot, ahead }),
        3 => (0u32..2, any::<bool>()).prop_map(|(rank, fused)| HeldOp::Push { rank, fused }),
        2 => (0usize..3).prop_map(|slot| HeldOp::Toggle { slot }),
        1 => (0u32..2).prop_map(|rank| HeldOp::Quorum { rank }),
        1 => any::<bool>().prop_map(|fail| HeldOp::Migrate { fail }),
    ]
}

/// Drives server 0 (bsp or ssp:1) through `ops` and checks after each that its counts of
/// held pulls equal a recount over its blocks, and that no closed connection has a pull
/// held.
fn counts_follow_every_path(sync: SyncPolicy, ops: &[HeldOp]) -> Result<(), proptest::test_runner::TestCaseError> {
    use proptest::prelude::prop_assert_eq;
    let (mut a, mut b) = (server(0, sync), server(B, sync));
    let mut next = [0u32; 2];
    let mut removed = [false; 2];
    let mut extra: [Option<ConnId>; 3] = [None; 3];
    let mut next_conn: ConnId = 10;
    let mut migration: (u8, Option<(u64, Message)>) = (0, None);
    for (now, op) in ops.iter().enumerate() {
        let now = now as u64 + 1;
        let req = 1000 + now;
        match *op {
            HeldOp::Pull { rank, slot, ahead } => {
                let conn = match slot {
                    Some(i) => match extra[i] {
                        Some(c) => c,
                        None => continue,
                    },
                    None => ConnId::from(rank) + 1,
                };
                let done = match a.slot(0) {
                    Some(Slot::Owned(o)) => o.block.done(),
                    _ => 0,
                };
                let msg =
                    Message::Pull { block: 0, clock: done.saturating_add(ahead), reply: elasticps_wire::Dtype::F32 };
                a.handle(now, Event::Received { conn, request_id: req, msg });
            }
            HeldOp::Push { rank, fused } => {
                let (block, clock, values) = (0, next[rank as usize], Values::from_vec(vec![1.0; LEN]));
                let msg = if fused {
                    Message::PushPull { block, clock, values, reply: elasticps_wire::Dtype::F32 }
                } else {
                    Message::Push { block, clock, values }
                };
                let r = a.handle(now, Event::Received { conn: ConnId::from(rank) + 1, request_id: req, msg });
                let took = replies(&r).iter().any(|(c, q, m)| {
                    (*c, *q) == (ConnId::from(rank) + 1, req)
                        && matches!(m, Message::PushAck { .. } | Message::PullReply { .. })
                });
                if took {
                    next[rank as usize] += 1;
                }
            }
            HeldOp::Toggle { slot } => match extra[slot].take() {
                Some(c) => {
                    a.handle(now, Event::Closed { conn: c });
                }
                None => {
                    next_conn += 1;
                    introduce(&mut a, next_conn, PeerRole::Worker, slot as u32 % 2);
                    extra[slot] = Some(next_conn);
                }
            },
            HeldOp::Quorum { rank } => {
                let msg =
                    if removed[rank as usize] { Control::AddWorker { rank } } else { Control::RemoveWorker { rank } };
                removed[rank as usize] ^= true;
                a.handle(now, Event::FromScheduler { request_id: 0, msg: msg.into() });
            }
            HeldOp::Migrate { fail } => match migration {
                (0, _) => migration = (1, Some(migrate(&mut a, now, 2))),
                (1, Some(snapshot)) => {
                    let reply = if fail { Err("lost".to_string()) } else { Ok(deliver(&mut b, now, snapshot.clone())) };
                    let r = a.handle(now, Event::FromServer { call: snapshot.0, reply });
                    migration = if fail { (4, None) } else { (2, Some(to_server(&r))) };
                }
                (2, Some(delta)) => {
                    let reply = if fail { Err("lost".to_string()) } else { Ok(deliver(&mut b, now, delta.clone())) };
                    let r = a.handle(now, Event::FromServer { call: delta.0, reply });
                    let done = r.iter().any(|x| {
                        matches!(x, Action::ToScheduler { msg: Message::Control(Control::MigrateDone(_)), .. })
                    });
                    migration = match (fail, done) {
                        (true, _) => (4, None),
                        // Pushes logged meanwhile: another delta.
                        (false, false) => (2, Some(to_server(&r))),
                        (false, true) => (3, Some((migrate_done(&r).0, Control::Ok.into()))),
                    };
                }
                (3, Some((call, msg))) => {
                    a.handle(now, Event::FromScheduler { request_id: call, msg });
                    migration = (4, None);
                }
                _ => {}
            },
        }
        prop_assert_eq!(a.recount(), Ok(()), "after {:?}", op);
    }
    // Every extra connection closes: nothing of theirs is held or counted.
    for c in extra.into_iter().flatten() {
        a.handle(ops.len() as u64 + 2, Event::Closed { conn: c });
    }
    prop_assert_eq!(a.recount(), Ok(()));
    for c in 10..=next_conn {
        prop_assert_eq!(a.held.of_conn(c), 0);
    }
    Ok(())
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 256, ..Default::default() })]

    /// Any interleaving of held pulls (far ahead), pushes that release some, connections
    /// closed and opened, workers removed and taken back and a migration (handed over or
    /// failed) keeps the counts of held pulls equal to a recount over the blocks.
    #[test]
    fn held_pull_counts_follow_pulls_pushes_closes_quorums_and_migrations(
        ops in proptest::collection::vec(held_op(), 0..60),
        ssp in proptest::bool::ANY,
    ) {
        counts_follow_every_path(if ssp { SyncPolicy::Ssp(1) } else { SyncPolicy::Bsp }, &ops)?;
    }
}

/// The primary and its backup of block 0 after the backup's first snapshot, both ways
/// introduced (the backup hears the primary on connection 9).
fn replicated_pair() -> (Server, Server) {
    let (mut primary, acts) = replicated(0);
    let (mut backup, _) = replicated(1);
    let [(sync, _, snapshot)] = &to_servers(&acts)[..] else { panic!("one snapshot to the backup") };
    introduce(&mut backup, 9, PeerRole::Server, 0);
    let r = backup.handle(1, Event::Received { conn: 9, request_id: 1, msg: snapshot.clone() });
    assert_eq!(replies(&r), vec![(9, 1, Control::Ok.into())]);
    primary.handle(1, Event::FromServer { call: *sync, reply: Ok(Control::Ok.into()) });
    (primary, backup)
}

fn values_of(s: &Server, block: BlockId) -> Vec<f32> {
    match s.slot(block) {
        Some(Slot::Owned(o)) => o.block.values().to_vec(),
        other => panic!("block {block} is not owned: {other:?}"),
    }
}

#[test]
fn a_push_is_forwarded_as_the_received_bytes_before_it_is_applied_and_acknowledged_after_both() {
    let (mut primary, mut backup) = replicated_pair();
    let values = Values::from_vec(vec![3.0; LEN]);
    let msg = Message::Push { block: 0, clock: 0, values: values.clone() };
    let acts = primary.handle(2, Event::Received { conn: 1, request_id: 5, msg });
    // First the forward (a data frame of the very bytes received), then the push is
    // applied in the same step; nothing is answered before the backup.
    let [Action::ToServer { call, msg: forward, .. }] = &acts[..] else { panic!("the forward alone: {acts:?}") };
    let Message::Forward { block: 0, clock: 0, worker: 0, init: false, values: sent } = forward else {
        panic!("a Forward frame: {forward:?}")
    };
    assert_eq!(sent.as_bytes().as_ptr(), values.as_bytes().as_ptr(), "the received bytes, not a copy");
    assert_eq!(values_of(&primary, 0), vec![-3.0; LEN], "applied in the same step");
    let r = backup.handle(3, Event::Received { conn: 9, request_id: 2, msg: forward.clone() });
    assert_eq!(replies(&r), vec![(9, 2, Control::Ok.into())]);
    assert_eq!(backup.backup_copy(0).map(|b| b.values().to_vec()), Some(vec![-3.0; LEN]));
    let acts = primary.handle(4, Event::FromServer { call: *call, reply: Ok(Control::Ok.into()) });
    assert_eq!(replies(&acts), vec![(1, 5, Message::PushAck { block: 0, clock: 0 })]);

    // Another push: applied, and acknowledged once the backup answered, once.
    let acts = push(&mut primary, 5, 1, 6, 0, 0, 1.0);
    let [(call, _, forward)] = &to_servers(&acts)[..] else { panic!("one forward: {acts:?}") };
    backup.handle(5, Event::Received { conn: 9, request_id: 3, msg: forward.clone() });
    let acts = primary.handle(6, Event::FromServer { call: *call, reply: Ok(Control::Ok.into()) });
    assert_eq!(values_of(&primary, 0), vec![-4.0; LEN]);
    assert_eq!(replies(&acts), vec![(2, 6, Message::PushAck { block: 0, clock: 0 })]);

    // A retried push (the worker lost the ack): forwarded again, dropped as a duplicate on
    // both copies, acknowledged again.
    let acts = push(&mut primary, 8, 0, 7, 0, 0, 3.0);
    let [(call, _, forward)] = &to_servers(&acts)[..] else { panic!("one forward: {acts:?}") };
    let r = backup.handle(8, Event::Received { conn: 9, request_id: 4, msg: forward.clone() });
    assert_eq!(replies(&r), vec![(9, 4, Control::Ok.into())]);
    let acts = primary.handle(9, Event::FromServer { call: *call, reply: Ok(Control::Ok.into()) });
    assert_eq!(replies(&acts), vec![(1, 7, Message::PushAck { block: 0, clock: 0 })]);
    assert_eq!(values_of(&primary, 0), vec![-4.0; LEN], "applied once");
    assert_eq!(backup.backup_copy(0).map(|b| b.values().to_vec()), Some(vec![-4.0; LEN]), "applied once");

    // A push the primary refuses (a clock gap) is not forwarded: refused at once.
    let acts = push(&mut primary, 10, 0, 8, 0, 5, 1.0);
    assert!(to_servers(&acts).is_empty(), "{acts:?}");
    assert!(matches!(&replies(&acts)[..], [(1, 8, Message::Error(e))] if e.code == ErrorCode::BadRequest));
}

#[test]
fn a_stale_backups_snapshot_is_followed_by_the_push_it_does_not_hold() {
    let (mut primary, mut backup) = replicated_pair();
    // A forward fails: the backup is stale, with no snapshot in flight until the retry.
    let acts = push(&mut primary, 2, 0, 5, 0, 0, 1.0);
    let [(call, _, _)] = &to_servers(&acts)[..] else { panic!("one forward: {acts:?}") };
    primary.handle(3, Event::FromServer { call: *call, reply: Err("connection reset".into()) });
    // The next push: the snapshot goes first (the state before this push: the forward
    // goes out before the apply), and the push behind it.
    let acts = push(&mut primary, 4, 1, 6, 0, 0, 2.0);
    let sent = to_servers(&acts);
    let [(sync, _, snapshot), (fwd, _, forward)] = &sent[..] else { panic!("a snapshot and a forward: {sent:?}") };
    let Message::Control(Control::ReplicaSnapshot(state)) = snapshot else { panic!("{snapshot:?}") };
    assert_eq!(state.values, vec![-1.0; LEN], "the state before the push");
    assert!(matches!(forward, Message::Forward { worker: 1, clock: 0, .. }), "{forward:?}");
    assert_eq!(values_of(&primary, 0), vec![-3.0; LEN]);
    // The backup takes both, in order: its copy ends as the primary's.
    backup.handle(5, Event::Received { conn: 9, request_id: 2, msg: snapshot.clone() });
    let r = backup.handle(5, Event::Received { conn: 9, request_id: 3, msg: forward.clone() });
    assert_eq!(replies(&r), vec![(9, 3, Control::Ok.into())]);
    assert_eq!(backup.backup_copy(0).map(|b| b.values().to_vec()), Some(vec![-3.0; LEN]));
    // The snapshot's answer releases the push that waited for it (worker 0's), not the
    // one behind it: worker 1's waits for its forward.
    let acts = primary.handle(6, Event::FromServer { call: *sync, reply: Ok(Control::Ok.into()) });
    assert_eq!(replies(&acts), vec![(1, 5, Message::PushAck { block: 0, clock: 0 })]);
    let acts = primary.handle(7, Event::FromServer { call: *fwd, reply: Ok(Control::Ok.into()) });
    assert_eq!(replies(&acts), vec![(2, 6, Message::PushAck { block: 0, clock: 0 })]);
}

#[test]
fn a_forward_its_backup_never_answers_fails_at_the_calls_deadline_and_its_push_waits_for_a_snapshot() {
    let (mut primary, _backup) = replicated_pair();
    // The load reports tick at 1 + k s: none at the forward's deadline (2 + 30 s).
    primary.handle(1, Event::Timeout);
    let acts = push(&mut primary, 2, 0, 5, 0, 0, 3.0);
    let [(call, _, _)] = &to_servers(&acts)[..] else { panic!("one forward: {acts:?}") };
    assert!(replies(&acts).is_empty(), "the PushAck waits for the backup: {acts:?}");
    // As a driver that wakes the server at each poll_timeout, and nothing else happens:
    // the backup never answers. The server fails the forward at its deadline (as a
    // failed link would: the backup is stale) and sends the backup its state
    // RESYNC_EVERY_US later; the PushAck waits for that snapshot.
    let deadline = 2 + STEP_TIMEOUT_US;
    let mut now = 2;
    let mut wakes = 0;
    let (at, sync) = loop {
        // A wake at or before `now` means "now" (the helper's server never ticked yet).
        now = primary.poll_timeout().expect("the server waits for something").max(now);
        wakes += 1;
        assert!(wakes < 1_000, "the server wakes at {now} again and again");
        assert!(now <= deadline + replica::RESYNC_EVERY_US, "no snapshot to the stale backup by {now}");
        let acts = primary.handle(now, Event::Timeout);
        assert!(replies(&acts).is_empty(), "the PushAck waits: {acts:?}");
        if let Some((sync, _, Message::Control(Control::ReplicaSnapshot(state)))) = to_servers(&acts).first().cloned() {
            assert_eq!(state.values, vec![-3.0; LEN], "the snapshot holds the push");
            break (now, sync);
        }
    };
    assert_eq!(at, deadline + replica::RESYNC_EVERY_US, "failed at the call's deadline, not at a later tick");
    // The forward's late answer is ignored: the push still waits for the snapshot.
    assert!(primary.handle(at, Event::FromServer { call: *call, reply: Ok(Control::Ok.into()) }).is_empty());
    let acts = primary.handle(at + 1, Event::FromServer { call: sync, reply: Ok(Control::Ok.into()) });
    assert_eq!(replies(&acts), vec![(1, 5, Message::PushAck { block: 0, clock: 0 })]);
}

#[test]
fn a_push_without_a_gradient_is_acknowledged_counts_for_the_clock_and_applies_nothing() {
    let mut s = server(0, SyncPolicy::Bsp);
    assert!(acked(&push(&mut s, 1, 0, 10, 0, 0, 1.0), 1, 10));
    // Worker 0's pull(1) waits for worker 1's clock 0.
    assert!(pulled(&pull(&mut s, 2, 0, 11, 0, 1)).is_empty());
    let none = Message::Push { block: 0, clock: 0, values: Values::from_vec(Vec::new()) };
    let acts = s.handle(3, Event::Received { conn: 2, request_id: 12, msg: none });
    assert!(acked(&acts, 2, 12), "{acts:?}");
    assert_eq!(pulled(&acts), vec![(1, 11, vec![-1.0; LEN])], "released, with worker 0's gradient alone applied");
    // A payload of another length than the block's is still refused, and the connection serves on.
    let short = Message::Push { block: 0, clock: 1, values: Values::from_vec(vec![1.0; LEN - 1]) };
    let acts = s.handle(4, Event::Received { conn: 2, request_id: 13, msg: short });
    assert!(matches!(&replies(&acts)[..], [(2, 13, Message::Error(e))] if e.code == ErrorCode::BadRequest), "{acts:?}");
    assert!(acked(&push(&mut s, 5, 1, 14, 0, 1, 2.0), 2, 14));
}

/// Row blocks of an embedding table: pulled and pushed by rows, held, refused, migrated
/// and replicated like dense blocks.
mod rows {
    use elasticps_core::model::TableSpec;
    use elasticps_core::rows::{RowInit, RowRule, RowStore, SparseOptimizer};
    use elasticps_wire::{RowBlockLoad, RowIds};
    use proptest::prelude::{TestCaseError, prop_assert, prop_assert_eq};

    use super::*;

    /// Dense block 0 ("w", LEN values) and table "emb" (8 rows of 2, Constant 0.5, SGD lr
    /// 1) in blocks 1..=4 of 2 rows each; server 0 holds blocks 0..=2, server 1 the rest.
    fn table_assignment(id: ServerId, sync: SyncPolicy) -> Assignment {
        table_assignment_of(id, sync, Table::Indexed)
    }

    /// The table of the exactly-once runs: indexed rows, or a hashed table's key ranges.
    #[derive(Clone, Copy, Debug)]
    enum Table {
        /// "emb" of [`table_assignment`]: rows 0 and 1 in block 1, split at row 1.
        Indexed,
        /// "emb" hashed into 4 key ranges (blocks 1..=4, Constant 0, SGD lr 1), at most
        /// `max_rows` rows per server (0: no bound; the job has 1 server as far as the
        /// bound goes, so block 1's share is a quarter, each half of it an eighth). Its
        /// keys: two random 64-bit keys in each half of block 1's positions, from `seed`.
        Keys { max_rows: u64, seed: u64 },
    }

    impl Table {
        /// The table's spec.
        fn spec(self) -> TableSpec {
            match self {
                Table::Indexed => TableSpec::new("emb", 8, 2).with_init(RowInit::Constant(0.5)),
                Table::Keys { max_rows, .. } => TableSpec::hashed("emb", 2, 4)
                    .with_init(RowInit::Constant(0.0))
                    .with_limits(elasticps_core::rows::RowLimits { max_rows, ..Default::default() }),
            }
            .with_optimizer(SparseOptimizer::Sgd { lr: 1.0 })
        }

        /// A row's initial values.
        fn init(self) -> f32 {
            if matches!(self, Table::Indexed) { 0.5 } else { 0.0 }
        }

        /// Where block 1 is split: row 1, or the middle of its key positions.
        fn split_at(self) -> u64 {
            if matches!(self, Table::Indexed) { 1 } else { elasticps_core::rows::KEY_POSITIONS / 8 }
        }

        /// Where a key falls in the table (the row, or its key position).
        fn position(self, key: u64) -> u64 {
            if matches!(self, Table::Indexed) { key } else { elasticps_core::rows::key_position(key) }
        }

        /// The rows or keys the workers push, all in block 1, some in each half of it.
        fn keys(self) -> Vec<u64> {
            let Table::Keys { seed, .. } = self else { return vec![0, 1] };
            let (at, end) = (self.split_at(), 2 * self.split_at());
            let mut z = seed;
            let mut candidates = std::iter::from_fn(|| {
                z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
                let mut x = z;
                x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                Some(x ^ (x >> 31))
            });
            let mut low = Vec::new();
            let mut high = Vec::new();
            while low.len() < 2 || high.len() < 2 {
                let k = candidates.next().unwrap_or_default();
                let pos = self.position(k);
                if pos < at && low.len() < 2 && !low.contains(&k) {
                    low.push(k);
                } else if (at..end).contains(&pos) && high.len() < 2 && !high.contains(&k) {
                    high.push(k);
                }
            }
            low.into_iter().chain(high).collect()
        }
    }

    fn table_assignment_of(id: ServerId, sync: SyncPolicy, table: Table) -> Assignment {
        let tensors = vec![TensorSpec { name: "w".into(), shape: vec![LEN], init: Init::Constant(0.0) }];
        let partition = Partition::with_tables(tensors, vec![table.spec()], LEN * 4).unwrap();
        assert_eq!(partition.blocks.len(), 5);
        let placement = Placement::initial(PlacementKind::Range, &partition, 2).unwrap();
        assert_eq!((placement.owner(1), placement.owner(3)), (Some(0), Some(1)));
        Assignment { partition, placement, ..assignment(id, sync) }
    }

    fn table_server(id: ServerId, sync: SyncPolicy) -> Server {
        table_server_of(id, sync, Table::Indexed)
    }

    fn table_server_of(id: ServerId, sync: SyncPolicy, table: Table) -> Server {
        let mut s = Server::new(format!("addr{id}"));
        s.start(0);
        s.handle(0, Event::FromScheduler { request_id: 1, msg: welcome_of(id) });
        let msg = Control::Assign(Box::new(table_assignment_of(id, sync, table))).into();
        let acts = s.handle(0, Event::FromScheduler { request_id: 0, msg });
        assert!(
            acts.iter()
                .any(|a| matches!(a, Action::ToScheduler { msg: Message::Control(Control::AssignDone { .. }), .. })),
            "{acts:?}"
        );
        for (conn, rank) in [(1, 0), (2, 1)] {
            introduce(&mut s, conn, PeerRole::Worker, rank);
        }
        s
    }

    fn pull_rows(s: &mut Server, now: u64, rank: u32, req: u64, block: u32, clock: u32, ids: &[u64]) -> Vec<Action> {
        let msg = Message::PullRows { block, clock, ids: RowIds::from_slice(ids), reply: elasticps_wire::Dtype::F32 };
        s.handle(now, Event::Received { conn: ConnId::from(rank) + 1, request_id: req, msg })
    }

    #[allow(clippy::too_many_arguments)]
    fn push_rows(
        s: &mut Server,
        now: u64,
        rank: u32,
        req: u64,
        block: u32,
        clock: u32,
        ids: &[u64],
        grads: &[f32],
    ) -> Vec<Action> {
        let msg =
            Message::PushRows { block, clock, dim: 2, ids: RowIds::from_slice(ids), grads: Values::from_slice(grads) };
        s.handle(now, Event::Received { conn: ConnId::from(rank) + 1, request_id: req, msg })
    }

    fn rows_of(acts: &[Action]) -> Vec<(ConnId, u64, Vec<f32>)> {
        replies(acts)
            .into_iter()
            .filter_map(|(c, r, m)| match m {
                Message::PullRowsReply { values, .. } => Some((c, r, values.to_vec())),
                _ => None,
            })
            .collect()
    }

    fn refused(acts: &[Action]) -> String {
        match &replies(acts)[..] {
            [(_, _, Message::Error(e))] if e.code == ErrorCode::BadRequest => e.message.clone(),
            other => panic!("one BadRequest: {other:?}"),
        }
    }

    #[test]
    fn rows_are_pulled_in_the_order_asked_and_a_bsp_pull_waits_for_the_empty_push() {
        let mut s = table_server(0, SyncPolicy::Bsp);
        assert_eq!(rows_of(&pull_rows(&mut s, 1, 0, 1, 1, 0, &[1, 0, 1])), vec![(1, 1, vec![0.5; 6])]);
        // Worker 0 pushes row 1 twice (summed) and pulls clock 1: held for worker 1.
        assert!(acked(&push_rows(&mut s, 2, 0, 2, 1, 0, &[1, 1], &[0.25, 0.0, 0.25, 1.0]), 1, 2));
        assert!(replies(&pull_rows(&mut s, 3, 0, 3, 1, 1, &[1, 0])).is_empty(), "held under bsp");
        // Worker 1 touched no row of block 1: its empty push completes the clock.
        let acts = push_rows(&mut s, 4, 1, 4, 1, 0, &[], &[]);
        assert!(acked(&acts, 2, 4));
        assert_eq!(rows_of(&acts), vec![(1, 3, vec![0.0, -0.5, 0.5, 0.5])]);
        // A resent push is acknowledged and not applied again.
        assert!(acked(&push_rows(&mut s, 5, 0, 5, 1, 0, &[1, 1], &[0.25, 0.0, 0.25, 1.0]), 1, 5));
        assert_eq!(rows_of(&pull_rows(&mut s, 6, 1, 6, 1, 1, &[1])), vec![(2, 6, vec![0.0, -0.5])]);
        match s.slot(1) {
            Some(Slot::Owned(o)) => assert_eq!(o.block.rows().map(|r| r.rows()), Some(1), "only the row pushed"),
            other => panic!("{other:?}"),
        }
        // Not owned here: Moved, as for a dense block.
        let acts = pull_rows(&mut s, 7, 0, 7, 3, 0, &[6]);
        assert_eq!(replies(&acts), vec![(1, 7, Control::Moved { block: 3, owner: 1, epoch: 1 }.into())]);
    }

    /// A restarted worker goes on from the clock its other blocks reached: its row push of
    /// a later clock than this block's next for it is applied (the clocks between are
    /// skipped), and completes the clock a held pull waits for.
    #[test]
    fn a_rejoined_workers_row_push_past_its_next_clock_is_applied_and_releases_the_held_pull() {
        let mut s = table_server(0, SyncPolicy::Bsp);
        let sched = |s: &mut Server, msg: Control| s.handle(1, Event::FromScheduler { request_id: 0, msg: msg.into() });
        sched(&mut s, Control::RemoveWorker { rank: 1 });
        for t in 0..3 {
            assert!(acked(&push_rows(&mut s, 2, 0, 10 + u64::from(t), 1, t, &[0], &[1.0, 1.0]), 1, 10 + u64::from(t)));
        }
        // Taken back at clock 3 here; another block had gone on to 5.
        sched(&mut s, Control::AddWorker { rank: 1 });
        for t in 3..6 {
            assert!(acked(&push_rows(&mut s, 3, 0, 10 + u64::from(t), 1, t, &[0], &[1.0, 1.0]), 1, 10 + u64::from(t)));
        }
        assert!(rows_of(&pull_rows(&mut s, 4, 0, 20, 1, 6, &[0])).is_empty(), "bsp holds pull(6) for worker 1");
        let a = push_rows(&mut s, 5, 1, 30, 1, 5, &[0], &[2.0, 2.0]);
        assert!(acked(&a, 2, 30), "applied, not refused as a clock gap: {a:?}");
        assert_eq!(rows_of(&a), vec![(1, 20, vec![-7.5, -7.5])], "six pushes of worker 0 and worker 1's");
    }

    #[test]
    fn the_load_report_counts_each_row_blocks_requests_and_rows() {
        let mut s = table_server(0, SyncPolicy::Asp);
        push_rows(&mut s, 1, 0, 1, 1, 0, &[0, 1, 1], &[1.0; 6]);
        push_rows(&mut s, 1, 0, 2, 2, 0, &[], &[]);
        pull_rows(&mut s, 1, 0, 3, 1, 1, &[0]);
        let load = s.take_load(1_000_000);
        // Rows 0 and 1 live in block 1, 8 bytes each (2 values, SGD keeps no state).
        let b1 = RowBlockLoad {
            block: 1,
            pushes: 1,
            pulls: 1,
            rows: 4,
            bytes_in: 3 * 8 + 6 * 4,
            bytes_out: 8,
            split_at: 1,
            live_rows: 2,
            row_bytes: 8,
            ..Default::default()
        };
        let b2 = RowBlockLoad { block: 2, pushes: 1, row_bytes: 8, ..Default::default() };
        assert_eq!(load.row_blocks, vec![b1, b2]);
        assert_eq!((b1.push_bytes(), b1.live_bytes()), (48, 16));
        // Counted since the last report only; a block with no traffic and no row is left out.
        push_rows(&mut s, 2, 0, 4, 1, 1, &[1], &[1.0; 2]);
        let load = s.take_load(1_000_000);
        let b1 = RowBlockLoad {
            block: 1,
            pushes: 1,
            rows: 1,
            bytes_in: 16,
            split_at: 1,
            live_rows: 2,
            row_bytes: 8,
            ..Default::default()
        };
        assert_eq!(load.row_blocks, vec![b1]);
    }

    /// Mutation: reporting a block's row counters since it came here instead of over the
    /// interval fails the second report; dropping `live_rows` fails both.
    #[test]
    fn the_load_report_and_metrics_carry_a_bounded_key_ranges_live_rows_and_evictions() {
        let table = Table::Keys { max_rows: 8, seed: 7 };
        let keys = table.keys();
        let mut s = table_server_of(0, SyncPolicy::Asp, table);
        // Block 1 may hold 2 rows: 3 keys pushed at once stay (never a row of this step),
        // the 4th evicts two of them.
        push_rows(&mut s, 1, 0, 1, 1, 0, &keys[..3], &[1.0; 6]);
        push_rows(&mut s, 1, 0, 2, 1, 1, &keys[3..], &[1.0; 2]);
        pull_rows(&mut s, 1, 0, 3, 1, 2, &keys);
        let load = s.take_load(1_000_000);
        let b1 = load.row_blocks.iter().find(|b| b.block == 1).copied().unwrap_or_default();
        assert_eq!((b1.live_rows, b1.evicted, b1.expired, b1.init_reads), (2, 2, 0, 2), "{b1:?}");
        let m = s.metrics_snapshot().rows;
        assert_eq!((m.live_rows, m.counters.created, m.counters.evicted, m.counters.init_reads), (2, 4, 2, 2));
        pull_rows(&mut s, 2, 0, 4, 1, 2, &keys[..1]);
        let load = s.take_load(1_000_000);
        let b1 = load.row_blocks.iter().find(|b| b.block == 1).copied().unwrap_or_default();
        assert_eq!(
            (b1.live_rows, b1.evicted, b1.init_reads),
            (2, 0, u64::from(present(&s, 1, keys[0]) == Some(false))),
            "{b1:?}"
        );
    }

    #[test]
    fn a_row_push_past_the_next_checkpoint_waits_and_the_checkpoint_holds_the_rows() {
        let mut s = table_server(0, SyncPolicy::Ssp(3));
        let plan = elasticps_wire::CheckpointPlan { dir: "d".into(), every: 1, resume: None };
        s.handle(0, Event::FromScheduler { request_id: 0, msg: Control::Checkpointing(plan).into() });
        assert!(acked(&push_rows(&mut s, 1, 0, 10, 1, 0, &[1], &[1.0, 1.0]), 1, 10));
        // Worker 0 at clock 1, the checkpoint's: its push waits for worker 1's clock 0.
        assert!(replies(&push_rows(&mut s, 2, 0, 11, 1, 1, &[1], &[1.0, 1.0])).is_empty());
        let a = push_rows(&mut s, 3, 1, 20, 1, 0, &[], &[]);
        let states: Vec<_> = a
            .iter()
            .filter_map(|x| match x {
                Action::Checkpoint { clock, state, .. } if state.spec.id == 1 => Some((*clock, state.clone())),
                _ => None,
            })
            .collect();
        let [(1, state)] = &states[..] else { panic!("one checkpoint of block 1 at clock 1: {a:?}") };
        let rows = state.rows.as_ref().expect("the rows travel in the checkpoint");
        assert_eq!((rows.ids.clone(), rows.values.clone()), (vec![1], vec![-0.5, -0.5]), "exactly clock 0's push");
        assert!(acked(&a, 2, 20) && acked(&a, 1, 11), "the waiting push is served once the state is taken");
        // The state rebuilds a block with the same rows (a resumed job's).
        let config = s.shard().expect("assigned").config;
        let back: elasticps_core::block::Block<Token> =
            elasticps_core::block::Block::from_state(state.clone(), &[], &config).unwrap();
        assert_eq!(back.rows().map(|r| r.gather(&[1, 0])), Some(vec![-0.5, -0.5, 0.5, 0.5]));
    }

    #[test]
    fn bad_row_requests_are_refused_naming_what_and_the_connection_goes_on() {
        let mut s = table_server(0, SyncPolicy::Asp);
        let e = refused(&pull_rows(&mut s, 1, 0, 1, 1, 0, &[0, 5]));
        assert!(e.contains("row 5 is not in block 1, which holds rows 0..2"), "{e}");
        let e = refused(&push_rows(&mut s, 1, 0, 2, 2, 0, &[9], &[1.0, 1.0]));
        assert!(e.contains("row 9 is not in block 2"), "{e}");
        let msg = Message::PushRows {
            block: 1,
            clock: 0,
            dim: 1,
            ids: RowIds::from_slice(&[0, 1]),
            grads: Values::from_slice(&[1.0, 1.0]),
        };
        let e = refused(&s.handle(1, Event::Received { conn: 1, request_id: 3, msg }));
        assert!(e.contains("holds rows of 2 values, the push carries rows of 1"), "{e}");
        let e = refused(&pull_rows(&mut s, 1, 0, 4, 0, 0, &[0]));
        assert!(e.contains("block 0 is a slice of a dense tensor"), "{e}");
        let e = refused(&pull(&mut s, 1, 0, 5, 1, 0));
        assert!(e.contains("block 1 is a range of a table's rows"), "{e}");
        let msg = Message::Push { block: 2, clock: 0, values: Values::from_vec(vec![1.0; 4]) };
        let e = refused(&s.handle(1, Event::Received { conn: 1, request_id: 6, msg }));
        assert!(e.contains("block 2 is a range of a table's rows"), "{e}");
        let msg = Message::Init { block: 2, values: Values::from_vec(vec![1.0; 4]) };
        let e = refused(&s.handle(1, Event::Received { conn: 1, request_id: 7, msg }));
        assert!(e.contains("range of a table's rows"), "{e}");
        // A pull whose reply would pass the frame limit: refused before any row is read.
        let mut small = table_server(0, SyncPolicy::Asp).with_max_payload(15);
        let e = refused(&pull_rows(&mut small, 1, 0, 1, 1, 0, &[0, 1]));
        assert!(e.contains("2 rows of 2 values from block 1 would be answered with 16 bytes"), "{e}");
        assert_eq!(rows_of(&pull_rows(&mut small, 1, 0, 2, 1, 0, &[1])).len(), 1);
        // Nothing was applied or counted; the connection serves the next request.
        assert!(acked(&push_rows(&mut s, 2, 0, 8, 1, 0, &[0], &[1.0, 2.0]), 1, 8));
        assert_eq!(rows_of(&pull_rows(&mut s, 3, 0, 9, 1, 1, &[0])), vec![(1, 9, vec![-0.5, -1.5])]);
    }

    #[test]
    fn a_row_block_migrates_with_every_row_push_applied_once() {
        let (mut a, mut b) = (table_server(0, SyncPolicy::Asp), table_server(B, SyncPolicy::Asp));
        assert!(acked(&push_rows(&mut a, 1, 0, 10, 1, 0, &[0], &[1.0, 1.0]), 1, 10));
        let msg = Control::Migrate { block: 1, to: B, to_addr: "b".into(), epoch: 2 }.into();
        let snapshot = to_server(&a.handle(2, Event::FromScheduler { request_id: 0, msg }));
        assert!(
            matches!(&snapshot.1, Message::Control(Control::BlockSnapshot { state, .. }) if state.rows.is_some()),
            "{snapshot:?}"
        );
        // Logged while the snapshot travels: a row push and an empty one.
        assert!(acked(&push_rows(&mut a, 3, 1, 11, 1, 0, &[1, 0], &[2.0, 2.0, 3.0, 3.0]), 2, 11));
        assert!(acked(&push_rows(&mut a, 3, 0, 12, 1, 1, &[], &[]), 1, 12));
        let ok = deliver(&mut b, 4, snapshot.clone());
        assert_eq!(ok, Control::Ok.into());
        let delta = to_server(&a.handle(5, Event::FromServer { call: snapshot.0, reply: Ok(ok) }));
        assert!(matches!(&delta.1, Message::Control(Control::BlockDelta { pushes, .. }) if pushes.len() == 2));
        let ok = deliver(&mut b, 6, delta.clone());
        assert_eq!(ok, Control::Ok.into());
        let (call, report) = migrate_done(&a.handle(7, Event::FromServer { call: delta.0, reply: Ok(ok) }));
        assert!(report.error.is_none(), "{report:?}");
        a.handle(8, Event::FromScheduler { request_id: call, msg: Control::Ok.into() });
        let settled = Control::Settled { block: 1, epoch: 2, owner: B }.into();
        b.handle(9, Event::FromScheduler { request_id: 0, msg: settled });
        // The old owner answers Moved; the new one has every push once (a resend is dropped).
        let acts = pull_rows(&mut a, 10, 0, 13, 1, 2, &[0]);
        assert!(matches!(&replies(&acts)[..], [(1, 13, Message::Control(Control::Moved { owner: B, .. }))]));
        assert!(acked(&push_rows(&mut b, 11, 1, 14, 1, 0, &[1, 0], &[2.0, 2.0, 3.0, 3.0]), 2, 14));
        let got = rows_of(&pull_rows(&mut b, 12, 0, 15, 1, 2, &[0, 1]));
        assert_eq!(got, vec![(1, 15, vec![0.5 - 4.0, 0.5 - 4.0, 0.5 - 2.0, 0.5 - 2.0])]);
    }

    #[test]
    fn a_row_push_reaches_the_backup_before_it_is_acknowledged() {
        let mut primary = Server::new("addr0");
        let mut backup = Server::new("addr1");
        let setup = |s: &mut Server, id: ServerId| {
            s.start(0);
            s.handle(0, Event::FromScheduler { request_id: 1, msg: welcome_of(id) });
            let base = table_assignment(id, SyncPolicy::Asp);
            let placement = base.placement.clone().with_replicas(2, 2).unwrap();
            let a = Assignment { placement: placement.clone(), ..base };
            s.handle(0, Event::FromScheduler { request_id: 0, msg: Control::Assign(Box::new(a)).into() });
            for (conn, rank) in [(1, 0), (2, 1)] {
                introduce(s, conn, PeerRole::Worker, rank);
            }
            let servers = (0..2).map(|i| elasticps_wire::ServerAddr { id: i, addr: format!("addr{i}") }).collect();
            s.handle(0, Event::FromScheduler { request_id: 0, msg: Control::Replicas { placement, servers }.into() })
        };
        let acts = setup(&mut primary, 0);
        setup(&mut backup, 1);
        // The backup's first copies: one snapshot per block of the primary.
        introduce(&mut backup, 9, PeerRole::Server, 0);
        for (call, _, msg) in to_servers(&acts) {
            let r = backup.handle(1, Event::Received { conn: 9, request_id: call, msg });
            assert_eq!(replies(&r), vec![(9, call, Control::Ok.into())]);
            primary.handle(1, Event::FromServer { call, reply: Ok(Control::Ok.into()) });
        }
        let acts = push_rows(&mut primary, 2, 0, 5, 1, 0, &[1], &[1.0, 2.0]);
        assert!(replies(&acts).is_empty(), "the ack waits for the backup: {acts:?}");
        let [(call, _, forward)] = &to_servers(&acts)[..] else { panic!("one forward: {acts:?}") };
        assert!(matches!(forward, Message::Control(Control::Replicate { block: 1, push, .. }) if push.rows == [1]));
        let r = backup.handle(3, Event::Received { conn: 9, request_id: 2, msg: forward.clone() });
        assert_eq!(replies(&r), vec![(9, 2, Control::Ok.into())]);
        let copy = backup.backup_copy(1).and_then(|b| b.rows()).map(|r| r.gather(&[1]));
        assert_eq!(copy, Some(vec![-0.5, -1.5]), "the copy has the push");
        let acts = primary.handle(4, Event::FromServer { call: *call, reply: Ok(Control::Ok.into()) });
        assert_eq!(replies(&acts), vec![(1, 5, Message::PushAck { block: 1, clock: 0 })]);
    }

    /// A worker of the exactly-once run: its next clock, and the push it waits for (sent
    /// to a server, answered Moved, or acknowledged).
    struct RowWorker {
        clock: u32,
        /// (request id, the server it was last sent to, the rows, the gradients).
        waiting: Option<(u64, ServerId, Vec<u64>, Vec<f32>)>,
        /// The server its last `Moved` named, where it sends from then on.
        owner: ServerId,
    }

    /// What each row of an exactly-once run must hold: its initial values less the
    /// gradients acknowledged since it was last created. A bound may evict a row between
    /// any two events: a row seen absent after an event starts again from its initializer.
    ///
    /// One event may apply several pushes (the requests parked while the block moved,
    /// served once it is settled), and a bound may evict a row in it that a later push of
    /// the same event creates again: seen present before and after, it holds only the
    /// later push. With `reference`, the rows one block fed the acknowledged pushes in
    /// their order would hold (eviction is a function of the block's state and its pushes,
    /// so a migrated block holds the same rows), the model knows each push's evictions.
    struct Expect {
        table: Table,
        keys: Vec<u64>,
        /// Per key, the gradients acknowledged since its row was last created.
        acc: Vec<[f32; 2]>,
        /// Per key, whether its row existed at the last observation.
        seen: Vec<bool>,
        /// Rows evicted or expired at the last observation, over the servers.
        evictions: u64,
        /// The block's rows as one store that never moved takes the acknowledged pushes.
        reference: Option<RowStore>,
    }

    impl Expect {
        fn new(table: Table) -> Self {
            let keys = table.keys();
            let n = keys.len();
            Self { table, acc: vec![[0.0; 2]; n], seen: vec![false; n], evictions: 0, keys, reference: None }
        }

        /// [`Expect::new`] with a reference store of the block's rule.
        fn with_reference(table: Table, rule: RowRule) -> Self {
            Self { reference: Some(RowStore::new(rule)), ..Self::new(table) }
        }

        /// Gradient `n` of a push, for each of its rows (integers: sums are exact).
        fn grads(ids: &[u64], n: usize) -> Vec<f32> {
            ids.iter().flat_map(|_| [n as f32, -2.0 * n as f32]).collect()
        }

        /// A push of `ids` was acknowledged: applied, once (and, with a reference, the
        /// rows its step evicted start again).
        fn acked(&mut self, ids: &[u64], grads: &[f32]) {
            for (id, g) in ids.iter().zip(grads.chunks(2)) {
                let k = self.keys.iter().position(|k| k == id).expect("a key of the run");
                self.acc[k][0] += g[0];
                self.acc[k][1] += g[1];
            }
            if let Some(r) = &mut self.reference {
                r.step(ids, grads, 1.0);
                r.enforce(|_| false);
                for (acc, key) in self.acc.iter_mut().zip(&self.keys) {
                    if !r.contains(*key) {
                        *acc = [0.0; 2];
                    }
                }
            }
        }

        /// After an event: `present(key)` says whether its row exists where it is served,
        /// `servers` hold the table. A row may vanish only if a bound evicted rows in the
        /// event (the servers' metrics count it): else it was lost.
        fn observe(&mut self, present: impl Fn(u64) -> bool, servers: &[&Server]) -> Result<(), TestCaseError> {
            let evictions =
                servers.iter().map(|s| s.metrics_snapshot().rows.counters).map(|c| c.evicted + c.expired).sum::<u64>();
            for (k, key) in self.keys.iter().enumerate() {
                let now = present(*key);
                prop_assert!(
                    now || !self.seen[k] || evictions > self.evictions,
                    "the row of key {} ({:#x}) vanished with no eviction",
                    k,
                    key
                );
                if let Some(r) = &self.reference {
                    prop_assert_eq!(now, r.contains(*key), "key {}: a row where the reference has one", k);
                }
                if !now {
                    self.acc[k] = [0.0; 2];
                }
                self.seen[k] = now;
            }
            self.evictions = evictions;
            Ok(())
        }

        /// The values a pull of every key must answer.
        fn values(&self) -> Vec<f32> {
            let init = self.table.init();
            self.acc.iter().flat_map(|a| [init - a[0], init - a[1]]).collect()
        }
    }

    /// Whether `key`'s row exists in block `block` of `s`; `None` if the block is not owned there.
    fn present(s: &Server, block: u32, key: u64) -> Option<bool> {
        match s.slot(block) {
            Some(Slot::Owned(o)) => Some(o.block.rows().is_some_and(|r| r.contains(key))),
            _ => None,
        }
    }

    /// Drives block 1 of the table from server 0 to server 1 while two workers push rows:
    /// each `op` is a push of worker 0 or 1 (or its resend after `Moved`), or the next step
    /// of the migration. At the end every push is acknowledged and every row holds the
    /// exact sum of the gradients pushed to it since it was last created (a bound evicts
    /// rows on both servers meanwhile), once, on the new owner.
    fn exactly_once(table: Table, ops: &[u8], rows_of_push: &[Vec<u64>]) -> Result<(), TestCaseError> {
        let mut servers = [table_server_of(0, SyncPolicy::Asp, table), table_server_of(B, SyncPolicy::Asp, table)];
        let mut workers: Vec<RowWorker> = (0..2).map(|_| RowWorker { clock: 0, waiting: None, owner: 0 }).collect();
        let rule = match servers[0].slot(1) {
            Some(Slot::Owned(o)) => o.block.rows().map(|r| *r.rule()),
            _ => None,
        };
        let mut expect = Expect::with_reference(table, rule.expect("block 1 is a row block on server 0"));
        let keys = expect.keys.clone();
        let mut step = 0;
        let mut in_flight: Option<(u64, Message)> = None;
        let mut record_call = 0;
        let mut next_req = 100u64;
        let mut pushes = 0usize;
        // The replies to the workers among `acts` of server `from`.
        let take = |acts: &[Action], workers: &mut Vec<RowWorker>, expect: &mut Expect| {
            for (conn, req, msg) in replies(acts) {
                let w = &mut workers[(conn - 1) as usize];
                let Some((id, _, ids, grads)) = &w.waiting else { continue };
                if *id != req {
                    continue;
                }
                match msg {
                    Message::PushAck { .. } => {
                        expect.acked(ids, grads);
                        w.waiting = None;
                        w.clock += 1;
                    }
                    Message::Control(Control::Moved { owner, .. }) => w.owner = owner,
                    other => panic!("worker {}: unexpected {other:?}", conn - 1),
                }
            }
        };
        // Block 1's rows where they are served: on the old owner while it holds the block.
        let observe = |servers: &[Server; 2], expect: &mut Expect| {
            let present = |k| present(&servers[0], 1, k).or_else(|| present(&servers[1], 1, k)).unwrap_or(false);
            expect.observe(present, &[&servers[0], &servers[1]])
        };
        let total = ops.len() + 60;
        for i in 0..total {
            observe(&servers, &mut expect)?;
            let op = ops.get(i).copied().unwrap_or((i % 3) as u8) % 3;
            if op < 2 {
                let w = op as usize;
                let worker = &mut workers[w];
                let (req, ids, grads) = match &worker.waiting {
                    // Unanswered where it was sent (parked): wait.
                    Some((_, to, _, _)) if *to == worker.owner => continue,
                    Some((_, _, ids, grads)) => (next_req, ids.clone(), grads.clone()),
                    None if worker.clock >= 6 => continue,
                    None => {
                        let ids: Vec<u64> = rows_of_push[pushes % rows_of_push.len()]
                            .iter()
                            .map(|i| keys[*i as usize % keys.len()])
                            .collect();
                        pushes += 1;
                        let grads = Expect::grads(&ids, pushes);
                        (next_req, ids, grads)
                    }
                };
                next_req += 1;
                let to = worker.owner;
                worker.waiting = Some((req, to, ids.clone(), grads.clone()));
                let clock = worker.clock;
                let acts = push_rows(&mut servers[to as usize], i as u64, w as u32, req, 1, clock, &ids, &grads);
                take(&acts, &mut workers, &mut expect);
                continue;
            }
            let now = i as u64;
            let (a, b) = servers.split_at_mut(1);
            let (a, b) = (&mut a[0], &mut b[0]);
            match step {
                0 => {
                    let msg = Control::Migrate { block: 1, to: B, to_addr: "b".into(), epoch: 2 }.into();
                    in_flight = Some(to_server(&a.handle(now, Event::FromScheduler { request_id: 0, msg })));
                }
                1 => {
                    // Snapshot, then deltas (as many as the old owner sends), then MigrateDone.
                    let sent = in_flight.take().expect("a step in flight");
                    let ok = deliver(b, now, sent.clone());
                    prop_assert_eq!(&ok, &Message::from(Control::Ok));
                    let acts = a.handle(now, Event::FromServer { call: sent.0, reply: Ok(ok) });
                    take(&acts, &mut workers, &mut expect);
                    let done = acts.iter().any(|a| {
                        matches!(a, Action::ToScheduler { msg: Message::Control(Control::MigrateDone(_)), .. })
                    });
                    if done {
                        record_call = migrate_done(&acts).0;
                        step = 3;
                    } else {
                        in_flight = Some(to_server(&acts));
                    }
                    continue;
                }
                3 => {
                    let acts = a.handle(now, Event::FromScheduler { request_id: record_call, msg: Control::Ok.into() });
                    take(&acts, &mut workers, &mut expect);
                }
                4 => {
                    let settled = Control::Settled { block: 1, epoch: 2, owner: B }.into();
                    let acts = b.handle(now, Event::FromScheduler { request_id: 0, msg: settled });
                    take(&acts, &mut workers, &mut expect);
                }
                _ => {}
            }
            step += 1;
        }
        prop_assert!(step >= 5, "the migration completed");
        for (w, worker) in workers.iter().enumerate() {
            prop_assert!(worker.waiting.is_none(), "worker {} has an unacknowledged push", w);
        }
        observe(&servers, &mut expect)?;
        prop_assert!(present(&servers[1], 1, keys[0]).is_some(), "the new owner serves the block");
        let got = rows_of(&pull_rows(&mut servers[1], total as u64, 0, 1, 1, 0, &keys));
        prop_assert_eq!(got, vec![(1, 1, expect.values())]);
        Ok(())
    }

    /// The tables the exactly-once runs cover: indexed rows, and a hashed table's key
    /// range with random 64-bit keys, unbounded or bounded to 2 rows a block (4 keys, so
    /// rows are evicted and created again while the block migrates or splits).
    fn tables() -> impl proptest::strategy::Strategy<Value = Table> {
        use proptest::prelude::{Just, Strategy, any};
        proptest::prop_oneof![
            Just(Table::Indexed),
            any::<u64>().prop_map(|seed| Table::Keys { max_rows: 0, seed }),
            any::<u64>().prop_map(|seed| Table::Keys { max_rows: 8, seed }),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 256, ..Default::default() })]

        /// Any interleaving of two workers' row pushes (repeated rows, empty pushes, resends
        /// after Moved) with the steps of a migration, of indexed rows or of random keys
        /// (bounded or not): every push applied exactly once.
        #[test]
        fn a_migrating_row_block_applies_every_row_push_exactly_once(
            table in tables(),
            ops in proptest::collection::vec(0u8..3, 0..40),
            rows_of_push in proptest::collection::vec(proptest::collection::vec(0u64..4, 0..3), 1..6),
        ) {
            exactly_once(table, &ops, &rows_of_push)?;
        }
    }

    /// Splits block 1 (rows 0..2) of server 0 at row 1 while two workers push rows 0 and 1
    /// (each push at most twice: `dup` resends an acknowledged one, as after a lost ack):
    /// each `op` is a push (or its resend) of worker 0 or 1, or the split's next step
    /// (the owner splits; then the scheduler records it and the workers' layouts show
    /// the halves, blocks 5 and 6). A push answered `Moved` to no server is sent again to
    /// the halves once the layout has them. At the end every push is acknowledged, the
    /// old id is answered `Moved` to no server, and each row holds the exact sum of the
    /// gradients pushed to it, once.
    fn split_exactly_once(
        table: Table,
        ops: &[u8],
        rows_of_push: &[Vec<u64>],
        dup: &[bool],
    ) -> Result<(), TestCaseError> {
        use elasticps_core::placement::RETIRED;
        let mut s = table_server_of(0, SyncPolicy::Asp, table);
        let mut expect = Expect::new(table);
        let keys = expect.keys.clone();
        let at = table.split_at();
        // Where a key's row is served: block 1, or the half that holds it.
        let observe = |s: &Server, expect: &mut Expect| {
            let present = |k| {
                present(s, 1, k).or_else(|| present(s, if table.position(k) < at { 5 } else { 6 }, k)).unwrap_or(false)
            };
            expect.observe(present, &[s])
        };
        // 0: not split; 1: split on the owner; 2: recorded, the layout has the halves.
        let mut split = 0;
        // Per worker: its next clock, the push not yet acknowledged everywhere, and
        // whether it is the resend of an acknowledged one.
        let mut clocks = [0u32; 2];
        type Push = (Vec<u64>, Vec<f32>, bool);
        let mut pending: [Option<Push>; 2] = [None, None];
        let (mut pushes, mut req) = (0usize, 100u64);
        let total = ops.len() + 80;
        for i in 0..total {
            let now = i as u64;
            observe(&s, &mut expect)?;
            let op = ops.get(i).copied().unwrap_or((i % 3) as u8) % 3;
            if op == 2 {
                if split == 0 {
                    let msg = Control::SplitBlock { block: 1, at, epoch: 2, recorded: false }.into();
                    let acts = s.handle(now, Event::FromScheduler { request_id: 0, msg });
                    let done = acts.iter().any(|a| {
                        matches!(
                            a,
                            Action::ToScheduler { msg: Message::Control(Control::SplitDone { error: None, .. }), .. }
                        )
                    });
                    prop_assert!(done, "the owner splits and reports: {:?}", acts);
                }
                split = (split + 1).min(2);
                continue;
            }
            let w = op as usize;
            if pending[w].is_none() {
                if clocks[w] >= 6 {
                    continue;
                }
                let ids: Vec<u64> =
                    rows_of_push[pushes % rows_of_push.len()].iter().map(|i| keys[*i as usize % keys.len()]).collect();
                pushes += 1;
                let grads = Expect::grads(&ids, pushes);
                pending[w] = Some((ids, grads, false));
            }
            let Some((ids, grads, resend)) = pending[w].clone() else { continue };
            // The push's requests by the worker's layout: block 1, or the two halves.
            let parts: Vec<(u32, Vec<u64>, Vec<f32>)> = if split < 2 {
                vec![(1, ids.clone(), grads.clone())]
            } else {
                [(5u32, 0u64..at), (6, at..2 * at)]
                    .into_iter()
                    .map(|(b, range)| {
                        let keep: Vec<usize> =
                            (0..ids.len()).filter(|k| range.contains(&table.position(ids[*k]))).collect();
                        (
                            b,
                            keep.iter().map(|k| ids[*k]).collect(),
                            keep.iter().flat_map(|k| grads[k * 2..k * 2 + 2].to_vec()).collect(),
                        )
                    })
                    .collect()
            };
            let mut all_acked = true;
            for (block, ids, grads) in parts {
                req += 1;
                let acts = push_rows(&mut s, now, w as u32, req, block, clocks[w], &ids, &grads);
                match &replies(&acts)[..] {
                    // A resend of an acknowledged push is acknowledged and dropped.
                    [(_, r, Message::PushAck { .. })] if *r == req => {
                        if !resend {
                            expect.acked(&ids, &grads);
                        }
                    }
                    [(_, r, Message::Control(Control::Moved { owner: RETIRED, epoch: 2, .. }))] if *r == req => {
                        prop_assert_eq!(block, 1, "only the old id is retired");
                        all_acked = false;
                    }
                    other => prop_assert!(false, "worker {} push to block {}: {:?}", w, block, other),
                }
            }
            if all_acked {
                let again = !resend && dup.get(pushes % dup.len().max(1)).copied().unwrap_or(false);
                pending[w] = if again { Some((ids, grads, true)) } else { None };
                if !again {
                    clocks[w] += 1;
                }
            }
        }
        prop_assert_eq!(split, 2, "the split happened");
        prop_assert!(clocks == [6, 6] && pending.iter().all(Option::is_none), "every push acknowledged: {:?}", clocks);
        observe(&s, &mut expect)?;
        let r = pull_rows(&mut s, total as u64, 0, 1, 1, 0, &keys[..1]);
        prop_assert_eq!(replies(&r), vec![(1, 1, Control::Moved { block: 1, owner: RETIRED, epoch: 2 }.into())]);
        // Each half is bounded by its share of the table's bound, as the model gives it.
        for half in [5, 6] {
            let Some(Slot::Owned(o)) = s.slot(half) else { panic!("half {half} is not served") };
            let got = o.block.rows().map(|r| r.rule().limits.max_rows);
            let want =
                s.shard().and_then(|sh| sh.partition.row_rule(half, 0).ok().flatten()).map(|r| r.limits.max_rows);
            prop_assert_eq!(got, want, "the bound of half {}", half);
        }
        let values = expect.values();
        for (k, key) in keys.iter().enumerate() {
            let half = if table.position(*key) < at { 5 } else { 6 };
            prop_assert_eq!(
                rows_of(&pull_rows(&mut s, total as u64, 0, 2 + k as u64, half, 0, &[*key])),
                vec![(1, 2 + k as u64, values[k * 2..k * 2 + 2].to_vec())],
                "key {} ({:#x}) on block {}",
                k,
                key,
                half
            );
        }
        Ok(())
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 256, ..Default::default() })]

        /// Any interleaving of two workers' row pushes (repeated rows, empty pushes,
        /// resends after a lost ack or after `Moved`) with the split of their block:
        /// every push applied exactly once, on the half that holds its row.
        #[test]
        fn a_row_block_split_while_workers_push_applies_every_push_exactly_once(
            table in tables(),
            ops in proptest::collection::vec(0u8..3, 0..40),
            rows_of_push in proptest::collection::vec(proptest::collection::vec(0u64..4, 0..3), 1..6),
            dup in proptest::collection::vec(proptest::bool::ANY, 1..6),
        ) {
            split_exactly_once(table, &ops, &rows_of_push, &dup)?;
        }
    }

    #[test]
    fn a_split_is_refused_unless_served_here_and_followed_by_the_other_servers() {
        let mut s = table_server(0, SyncPolicy::Asp);
        let refusal = |s: &mut Server, block: u32, recorded: bool| {
            let msg = Control::SplitBlock { block, at: 1, epoch: 2, recorded }.into();
            let acts = s.handle(0, Event::FromScheduler { request_id: 0, msg });
            acts.iter()
                .find_map(|a| match a {
                    Action::ToScheduler { msg: Message::Control(Control::SplitDone { error, .. }), .. } => {
                        Some(error.clone().unwrap_or_default())
                    }
                    _ => None,
                })
                .unwrap_or_else(|| panic!("no SplitDone: {acts:?}"))
        };
        // A dense block, and a row block of another server: refused, nothing changed.
        assert_eq!(refusal(&mut s, 0, false), elasticps_core::CoreError::NotRows(0).to_string());
        assert!(matches!(s.slot(0), Some(Slot::Owned(_))), "the dense block is served as before");
        assert!(refusal(&mut s, 3, false).contains("block 3 is not served here"));
        assert_eq!(s.shard().map(|sh| sh.partition.blocks.len()), Some(5));
        // Split here; asked again (its report lost), it says so instead of following.
        assert_eq!(refusal(&mut s, 1, false), "");
        assert!(refusal(&mut s, 1, false).contains("split here already"));
        assert_eq!(s.shard().map(|sh| sh.partition.blocks.len()), Some(7));
        // Server 1 does not hold block 1: told the split is recorded, it follows it in its
        // model and placement, once, and says nothing.
        let mut other = table_server(B, SyncPolicy::Asp);
        for _ in 0..2 {
            let msg = Control::SplitBlock { block: 1, at: 1, epoch: 2, recorded: true }.into();
            assert!(other.handle(0, Event::FromScheduler { request_id: 0, msg }).is_empty());
        }
        let shard = other.shard().expect("assigned");
        assert_eq!(
            (shard.partition.blocks.len(), shard.placement.owner(5), shard.placement.owner(1)),
            (7, Some(0), None)
        );
        assert_eq!(shard.placement.epoch, 2);
    }
}

/// The answer to a worker's `GetOptState` or `SetOptState` of `block`.
fn opt_call(s: &mut Server, req: u64, msg: Control) -> Message {
    let r = s.handle(0, Event::Received { conn: 1, request_id: req, msg: msg.into() });
    let got = replies(&r);
    assert_eq!(got.len(), 1, "one reply in {r:?}");
    got[0].2.clone()
}

#[test]
fn a_server_takes_a_tensors_optimizer_from_the_scheduler_alone() {
    use elasticps_core::optimizer::TensorOptimizer;
    let slower = TensorOptimizer { kind: OptimizerKind::Sgd, lr: 0.5, weight_decay: 0.0 };
    let set = Control::SetOptimizer { tensor: 0, optimizer: slower };
    let applied = |acts: &[Action]| {
        acts.iter().any(|a| {
            matches!(
                a,
                Action::ToScheduler { request_id: 0, msg: Message::Control(Control::OptimizerSet { tensor: 0 }) }
            )
        })
    };
    let mut s = server(0, SyncPolicy::Asp);
    // A worker's, on its data connection: refused, saying where it goes; nothing changed.
    let refused = opt_call(&mut s, 1, set.clone());
    assert!(
        matches!(&refused, Message::Error(e) if e.code == ErrorCode::Forbidden && e.message.contains("goes to the scheduler")),
        "{refused:?}"
    );
    push(&mut s, 0, 0, 2, 0, 0, 1.0);
    assert_eq!(pulled(&pull(&mut s, 0, 0, 3, 0, 1)), vec![(1, 3, vec![-1.0; LEN])], "lr 1 still");
    // The scheduler's: applied to the next push, and answered.
    let acts = s.handle(0, Event::FromScheduler { request_id: 0, msg: set.clone().into() });
    assert!(applied(&acts), "{acts:?}");
    push(&mut s, 0, 0, 4, 0, 1, 1.0);
    assert_eq!(pulled(&pull(&mut s, 0, 0, 5, 0, 2)), vec![(1, 5, vec![-1.5; LEN])], "lr 0.5 now");
    // A server with no blocks yet answers too (its Assign carries the scheduler's record).
    let mut late = Server::new("addr9".to_string());
    late.start(0);
    late.handle(0, Event::FromScheduler { request_id: 1, msg: welcome_of(0) });
    assert!(applied(&late.handle(0, Event::FromScheduler { request_id: 0, msg: set.into() })));
}

#[test]
fn a_worker_reads_and_replaces_a_blocks_optimizer_state() {
    use elasticps_core::optimizer::OptState;
    let mut s = server(0, SyncPolicy::Asp);
    push(&mut s, 0, 0, 1, 0, 0, 1.0);
    push(&mut s, 0, 1, 1, 0, 0, 1.0);
    let get = |s: &mut Server, req| opt_call(s, req, Control::GetOptState { block: 0 });
    // Two pushes, two SGD steps, no moments.
    assert_eq!(
        get(&mut s, 2),
        Control::OptState { block: 0, state: OptState { steps: 2, m: vec![], v: vec![] } }.into()
    );
    let state = OptState { steps: 7, m: vec![0.5; LEN], v: vec![0.25; LEN] };
    let set = opt_call(&mut s, 3, Control::SetOptState { block: 0, state: state.clone() });
    assert_eq!(set, Control::Ok.into());
    assert_eq!(get(&mut s, 4), Control::OptState { block: 0, state: state.clone() }.into());
    // A state of another length is refused and changes nothing.
    let bad = OptState { steps: 1, m: vec![1.0; LEN + 1], v: vec![] };
    let refused = opt_call(&mut s, 5, Control::SetOptState { block: 0, state: bad });
    assert!(matches!(&refused, Message::Error(e) if e.code == ErrorCode::BadRequest), "{refused:?}");
    assert_eq!(get(&mut s, 6), Control::OptState { block: 0, state }.into());
    // Values overwritten, the optimizer state left alone; a pull answers them.
    let set = opt_call(&mut s, 8, Control::SetValues { block: 0, values: vec![3.0; LEN] });
    assert_eq!(set, Control::Ok.into());
    assert_eq!(pulled(&pull(&mut s, 0, 0, 9, 0, 1)), vec![(1, 9, vec![3.0; LEN])]);
    assert!(matches!(get(&mut s, 10), Message::Control(Control::OptState { state: OptState { steps: 7, .. }, .. })));
    // Another server's block: Moved to its owner.
    assert_eq!(
        opt_call(&mut s, 7, Control::GetOptState { block: 1 }),
        Control::Moved { block: 1, owner: 1, epoch: 1 }.into()
    );
}
