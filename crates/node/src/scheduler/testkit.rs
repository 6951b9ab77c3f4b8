//! What the scheduler's unit tests share: a job, a running scheduler, messages in and
//! what was sent out.

use elasticps_core::block::ShardConfig;
use elasticps_core::model::{Init, TensorSpec};
use elasticps_core::optimizer::{OptimizerConfig, OptimizerKind};
use elasticps_core::placement::PlacementKind;
use elasticps_core::sync::SyncPolicy;
use elasticps_wire::{Control, KeyId, Message};

use super::{Action, ConnId, Event, JobConfig, Scheduler};

/// Two servers and two workers, blocks of 16 bytes, server 1 on `ssp:2`.
pub fn config() -> JobConfig {
    JobConfig {
        servers: 2,
        workers: 2,
        block_bytes: 16,
        placement: PlacementKind::Range,
        shard: ShardConfig {
            sync: SyncPolicy::Bsp,
            optimizer: OptimizerConfig { kind: OptimizerKind::Sgd, lr: 0.1, aggregate: false, weight_decay: 0.0 },
            workers: 2,
        },
        seed: 1,
        server_sync: vec![(1, SyncPolicy::Ssp(2))],
        inject: Vec::new(),
        balance: Default::default(),
        balance_compress: None,
        max_servers: 2,
        min_servers: 2,
        checkpoint: None,
        rejoin_wait_us: 0,
        replicas: 1,
    }
}

/// `event` at the scheduler's current time.
pub fn step(m: &mut Scheduler, event: Event) -> Vec<Action> {
    let now_us = m.now_us;
    m.handle(now_us, event)
}

/// `c` arrives on `conn` with `request_id`.
pub fn recv(m: &mut Scheduler, conn: ConnId, request_id: u64, c: Control) -> Vec<Action> {
    step(m, Event::Received { conn, request_id, msg: c.into() })
}

/// A model of 8 values (2 blocks).
pub fn model() -> Vec<TensorSpec> {
    vec![TensorSpec { name: "w".into(), shape: vec![8], init: Init::Zeros }]
}

/// The messages sent on `conn`.
pub fn sent_to(actions: &[Action], conn: ConnId) -> Vec<&Message> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Send { conn: c, msg, .. } if *c == conn => Some(msg),
            _ => None,
        })
        .collect()
}

/// A host agent `name` at `ip` joins on `conn`, offering `servers` and `workers`.
pub fn join(m: &mut Scheduler, conn: ConnId, name: &str, ip: &str, servers: u32, workers: u32) -> Vec<Action> {
    step(m, Event::Connected { conn, peer: ip.into(), key: KeyId::Cluster });
    let offer = elasticps_wire::HostOffer {
        name: name.into(),
        addr: ip.into(),
        servers,
        workers,
        server_slots: servers + 1,
        worker_slots: workers + 1,
    };
    recv(m, conn, 1, Control::JoinHost(offer))
}

/// The nodes a `StartNode` sent on `conn` starts (in a job of 2 workers).
pub fn starts(actions: &[Action], conn: ConnId) -> Vec<elasticps_wire::NodeRole> {
    sent_to(actions, conn)
        .into_iter()
        .filter_map(|m| match m {
            Message::Control(Control::StartNode { role, workers: 2, .. }) => Some(*role),
            _ => None,
        })
        .collect()
}

/// Two servers (connections 10, 11) and two workers (1, 2) with a model of `len` values
/// (blocks of 4) placed.
pub fn running(config: JobConfig, len: usize) -> Scheduler {
    let mut m = Scheduler::new(config, 10_000_000).with_launcher(true);
    recv(&mut m, 1, 1, Control::RegisterWorker);
    recv(&mut m, 2, 1, Control::RegisterWorker);
    let tensors = vec![TensorSpec { name: "w".into(), shape: vec![len], init: Init::Zeros }];
    recv(&mut m, 1, 2, Control::DefineModel { tensors, optimizers: Vec::new(), tables: Vec::new() });
    recv(&mut m, 10, 1, Control::RegisterServer { data_addr: "s0".into() });
    recv(&mut m, 11, 1, Control::RegisterServer { data_addr: "s1".into() });
    recv(&mut m, 10, 0, Control::AssignDone { server_id: 0 });
    recv(&mut m, 11, 0, Control::AssignDone { server_id: 1 });
    assert_eq!(m.waiting_for(), None);
    m
}
