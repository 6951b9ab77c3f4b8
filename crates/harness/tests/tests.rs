//! Integration tests of elasticps-harness: the real scheduler, servers and workers
//! on the simulated network, one module per subject.

mod harness {
    //! The real scheduler driven through the simulated network by scripted test
    //! drivers, and the harness's throughput.

    use elasticps_core::block::ShardConfig;
    use elasticps_core::model::{Init, TensorSpec};
    use elasticps_core::optimizer::{OptimizerConfig, OptimizerKind};
    use elasticps_core::placement::PlacementKind;
    use elasticps_core::sync::SyncPolicy;
    use elasticps_harness::{Cluster, ClusterConfig, LinkSpec, LostWhy, NodeId, NodeKind, Outbox, Role, Stop};
    use elasticps_node::ConnId;
    use elasticps_node::scheduler::JobConfig;
    use elasticps_wire::{Control, Message, ScaleRequest, Values};

    fn job(servers: u32, workers: u32) -> JobConfig {
        JobConfig {
            servers,
            workers,
            block_bytes: 16,
            placement: PlacementKind::Range,
            shard: ShardConfig {
                sync: SyncPolicy::Bsp,
                optimizer: OptimizerConfig { kind: OptimizerKind::Sgd, lr: 0.1, aggregate: false, weight_decay: 0.0 },
                workers,
            },
            server_sync: Vec::new(),
            seed: 1,
            inject: Vec::new(),
            balance: Default::default(),
            balance_compress: None,
            max_servers: servers,
            min_servers: servers,
            checkpoint: None,
            rejoin_wait_us: 0,
            replicas: 1,
        }
    }

    fn model() -> Vec<TensorSpec> {
        vec![TensorSpec { name: "w".into(), shape: vec![16], init: Init::Zeros }]
    }

    /// A TEST DRIVER, not a role of the product: it connects to the scheduler, sends
    /// its opening messages (request ids 1, 2, ...), answers what it receives by a
    /// fixed script, heartbeats if asked, and records everything.
    struct TestDriver {
        hello: Vec<Message>,
        answer: fn(&Message) -> Vec<Message>,
        heartbeat_us: Option<u64>,
        conn: ConnId,
        got: Vec<(u64, u64, Message)>,
        lost: Vec<(u64, LostWhy)>,
    }

    impl TestDriver {
        fn new(hello: Vec<Message>, answer: fn(&Message) -> Vec<Message>) -> Self {
            Self { hello, answer, heartbeat_us: Some(1_000_000), conn: 0, got: Vec::new(), lost: Vec::new() }
        }

        /// A server that registers at `sim:<node>` and acknowledges its assignment.
        fn server() -> Self {
            Self::new(Vec::new(), |m| match m {
                Message::Control(Control::Assign(a)) => vec![Control::AssignDone { server_id: a.server_id }.into()],
                _ => Vec::new(),
            })
        }

        /// A worker that registers and, once welcomed, defines the model.
        fn worker() -> Self {
            Self::new(vec![Control::RegisterWorker.into()], |m| match m {
                Message::Control(Control::Welcome { .. }) => {
                    vec![Control::DefineModel { tensors: model(), optimizers: Vec::new(), tables: Vec::new() }.into()]
                }
                _ => Vec::new(),
            })
        }

        fn silent(mut self) -> Self {
            self.heartbeat_us = None;
            self
        }

        fn controls(&self) -> impl Iterator<Item = &Control> {
            self.got.iter().filter_map(|(_, _, m)| if let Message::Control(c) = m { Some(c) } else { None })
        }
    }

    impl Role for TestDriver {
        fn on_start(&mut self, out: &mut Outbox<'_>) {
            self.conn = out.connect(out.scheduler());
            if self.hello.is_empty() {
                // A server announces the address the harness lists it under.
                self.hello.push(Control::RegisterServer { data_addr: out.me().addr() }.into());
            }
            for (i, msg) in self.hello.drain(..).enumerate() {
                out.send(self.conn, i as u64 + 1, msg);
            }
            if let Some(every) = self.heartbeat_us {
                out.wake_at(out.now_us() + every, 0);
            }
        }

        fn on_message(&mut self, out: &mut Outbox<'_>, conn: ConnId, request_id: u64, msg: Message) {
            assert_eq!(conn, self.conn, "the driver has one connection");
            if let Message::Control(Control::Shutdown { .. }) = msg {
                self.heartbeat_us = None; // the process would exit
            }
            for reply in (self.answer)(&msg) {
                out.send(conn, 0, reply);
            }
            self.got.push((out.now_us(), request_id, msg));
        }

        fn on_lost(&mut self, out: &mut Outbox<'_>, _conn: ConnId, why: LostWhy) {
            self.lost.push((out.now_us(), why));
        }

        fn on_timer(&mut self, out: &mut Outbox<'_>, _token: u64) {
            if let Some(every) = self.heartbeat_us
                && out.send(self.conn, 0, Control::Heartbeat.into())
            {
                out.wake_at(out.now_us() + every, 0);
            }
        }
    }

    type Drivers = Cluster<TestDriver>;

    /// A cluster of `servers` and `workers` test drivers, run for 10 ms of virtual time.
    fn registered(config: ClusterConfig) -> (Drivers, Vec<NodeId>) {
        let (s, w) = (config.job.servers, config.job.workers);
        let mut c = Cluster::new(config);
        let mut ids = Vec::new();
        for i in 0..s {
            ids.push(c.add(NodeKind::Server(i), LinkSpec::default(), TestDriver::server()));
        }
        for i in 0..w {
            ids.push(c.add(NodeKind::Worker(i), LinkSpec::default(), TestDriver::worker()));
        }
        assert_eq!(c.run(10_000, 10_000), Stop::Until);
        (c, ids)
    }

    #[test]
    fn the_scheduler_welcomes_assigns_and_answers_the_layout_through_the_network() {
        let (c, ids) = registered(ClusterConfig::new(job(2, 2)));
        assert_eq!(c.scheduler().waiting_for(), None);
        for (i, id) in ids[..2].iter().enumerate() {
            let s = c.role(*id).unwrap();
            let got: Vec<_> = s.controls().collect();
            assert!(
                matches!(got[0], Control::Welcome { node_id, num_workers: 2, .. } if *node_id == i as u32),
                "{got:?}"
            );
            assert!(matches!(got[1], Control::Assign(a) if a.server_id == i as u32), "{got:?}");
        }
        for (rank, id) in ids[2..].iter().enumerate() {
            let w = c.role(*id).unwrap();
            assert!(
                matches!(w.got[0], (_, 1, Message::Control(Control::Welcome { node_id, .. })) if node_id == rank as u32)
            );
            // The layout answers DefineModel (request id 0 as the driver sends it) and lists
            // the servers under their harness addresses.
            let layout = w.controls().find_map(|m| if let Control::Layout(l) = m { Some(l) } else { None });
            let layout = layout.unwrap_or_else(|| panic!("worker {rank} got no layout: {:?}", w.got));
            let addrs: Vec<_> = layout.servers.iter().map(|s| s.addr.clone()).collect();
            assert_eq!(addrs, [ids[0].addr(), ids[1].addr()]);
        }
        // Every exchange is a few 50 us hops; nothing waited for a tick.
        let last = ids.iter().flat_map(|id| c.role(*id).unwrap().got.iter().map(|g| g.0)).max();
        assert!(last.is_some_and(|t| t < 1_000), "{last:?}");
    }

    #[test]
    fn a_silently_crashed_worker_is_removed_after_the_heartbeat_timeout() {
        let config = ClusterConfig { heartbeat_timeout_us: 3_000_000, ..ClusterConfig::new(job(1, 2)) };
        let (mut c, ids) = registered(config);
        c.crash(ids[1], false);
        assert_eq!(c.run(10_000_000, 100_000), Stop::Until);
        let server = c.role(ids[0]).unwrap();
        let removed: Vec<_> = server
            .got
            .iter()
            .filter(|(_, _, m)| matches!(m, Message::Control(Control::RemoveWorker { rank: 0 })))
            .map(|(t, _, _)| *t)
            .collect();
        // Declared dead at its heartbeat expiry, 3 s (and 1 us) after its last message
        // reached the scheduler (at 150 us); the server hears of it one 50 us hop later.
        assert_eq!(removed, [3_000_201], "{:?}", server.got);
        assert!(c.finished().is_none());
    }

    #[test]
    fn a_server_that_crashes_ends_the_job_and_everyone_is_told() {
        let (mut c, ids) = registered(ClusterConfig::new(job(2, 1)));
        c.crash(ids[1], true);
        match c.run(20_000, 10_000) {
            Stop::Finished { ok: false, reason } => assert!(reason.contains("server 1"), "{reason}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            c.run(30_000_000, 10_000),
            Stop::Idle,
            "the scheduler sets no timer once over (those set before fire with nothing to do); the drivers, shut \
             down, stop heartbeating"
        );
        for id in [ids[0], ids[2]] {
            let d = c.role(id).unwrap();
            assert!(d.controls().any(|m| matches!(m, Control::Shutdown { .. })), "{:?}", d.got);
        }
    }

    #[test]
    fn the_job_finishes_when_every_worker_is_done() {
        let (mut c, ids) = registered(ClusterConfig::new(job(1, 2)));
        // Drive the workers' last message by hand, as a role would.
        for (rank, id) in ids[1..].iter().enumerate() {
            let conn = c.role(*id).unwrap().conn;
            assert!(c.network_mut().send(*id, conn, 9, Control::WorkerDone { rank: rank as u32 }.into()));
        }
        assert_eq!(c.run(1_000_000, 10_000), Stop::Finished { ok: true, reason: "every worker finished".into() });
        assert_eq!(c.finished(), Some((true, "every worker finished")));
    }

    #[test]
    fn a_scale_out_asks_the_owner_for_a_server_which_joins_late() {
        let mut job = job(1, 1);
        job.max_servers = 2;
        let config = ClusterConfig { can_launch: true, ..ClusterConfig::new(job) };
        let (mut c, _ids) = registered(config);
        let op = c.add(
            NodeKind::Other(0),
            LinkSpec::default(),
            TestDriver::new(vec![Control::Scale(ScaleRequest::AddServer).into()], |_| Vec::new()).silent(),
        );
        assert_eq!(c.run(100_000, 10_000), Stop::StartServer);
        let late = c.add(NodeKind::Server(1), LinkSpec::default(), TestDriver::server());
        assert_eq!(c.run(200_000, 10_000), Stop::Until);
        assert!(matches!(c.role(op).unwrap().got[0].2, Message::Control(Control::Ok)));
        let got: Vec<_> = c.role(late).unwrap().controls().collect();
        assert!(matches!(got[..], [Control::Welcome { node_id: 1, .. }, Control::Assign(_), ..]), "{got:?}");
    }

    #[test]
    fn a_dropped_connection_is_learned_by_both_ends_and_the_scheduler_removes_the_worker() {
        let (mut c, ids) = registered(ClusterConfig::new(job(1, 2)));
        let conn = c.role(ids[2]).unwrap().conn;
        c.network_mut().drop_conn(conn);
        assert_eq!(c.run(20_000, 10_000), Stop::Until);
        assert_eq!(c.role(ids[2]).unwrap().lost, [(10_000, LostWhy::Dropped)]);
        let server = c.role(ids[0]).unwrap();
        assert!(
            server.controls().any(|m| matches!(m, Control::RemoveWorker { rank: 1 })),
            "the scheduler learned the loss and took worker 1 out: {:?}",
            server.got
        );
        assert!(!c.network().is_open(ids[2], conn));
    }

    /// One registration under jitter, and its digest.
    fn digest(seed: u64) -> (u64, u64) {
        let config = ClusterConfig { seed, jitter_us: 40, ..ClusterConfig::new(job(3, 4)) };
        let (mut c, _) = registered(config);
        assert_eq!(c.run(5_000_000, 100_000), Stop::Until);
        (c.network().digest(), c.stats().delivered)
    }

    #[test]
    fn a_seed_reproduces_a_run_and_another_seed_does_not() {
        let (a, n) = digest(11);
        assert!(n > 40, "{n} deliveries");
        assert_eq!(digest(11), (a, n));
        assert_ne!(digest(12).0, a);
    }

    /// The same check over a run that ends: the scheduler's `finish` sends `Shutdown` to
    /// every node in the order of its node table, which must be ordered (it was a
    /// `HashMap`: 19 different delivery orders in 20 runs of one seed).
    #[test]
    fn a_seed_reproduces_a_run_that_ends() {
        let run = || {
            let (mut c, ids) = registered(ClusterConfig { seed: 3, jitter_us: 40, ..ClusterConfig::new(job(3, 4)) });
            c.crash(ids[1], true);
            assert!(matches!(c.run(5_000_000, 100_000), Stop::Finished { ok: false, .. }));
            // The scheduler's timers set before the end fire with nothing to do.
            assert_eq!(c.run(30_000_000, 100_000), Stop::Idle);
            c.network().digest()
        };
        let first = run();
        for _ in 0..10 {
            assert_eq!(run(), first);
        }
    }

    /// A worker of the throughput bench: keeps `window` pushes in flight, to servers in turn.
    enum Bench {
        Worker { servers: Vec<NodeId>, conns: Vec<ConnId>, next: usize, window: usize, values: Values },
        Server,
    }

    impl Role for Bench {
        fn on_start(&mut self, out: &mut Outbox<'_>) {
            if let Bench::Worker { servers, conns, next, window, values } = self {
                *conns = servers.iter().map(|s| out.connect(*s)).collect();
                for _ in 0..*window {
                    let conn = conns[*next % conns.len()];
                    *next += 1;
                    out.send(conn, 0, Message::Push { block: 0, clock: 0, values: values.clone() });
                }
            }
        }

        fn on_message(&mut self, out: &mut Outbox<'_>, conn: ConnId, request_id: u64, msg: Message) {
            match self {
                Bench::Server => {
                    if let Message::Push { block, clock, .. } = msg {
                        out.send(conn, request_id, Message::PushAck { block, clock });
                    }
                }
                Bench::Worker { conns, next, values, .. } => {
                    let conn = conns[*next % conns.len()];
                    *next += 1;
                    out.send(conn, 0, Message::Push { block: 0, clock: 0, values: values.clone() });
                }
            }
        }

        fn on_lost(&mut self, _: &mut Outbox<'_>, _: ConnId, _: LostWhy) {}
    }

    /// Throughput of the harness: 1,000 workers x 100 servers (servers capped at
    /// 10 Gbit/s, pushes charged 100 KB), 16 and then 160 pushes in flight per worker
    /// (160: a ResNet-50's blocks at once), 10 M deliveries each. Prints deliveries per
    /// second; asserts nothing about time.
    /// `cargo test --release -p elasticps-node --test tests bench -- --ignored --nocapture`
    #[test]
    #[ignore = "a benchmark: run it on purpose, in release"]
    fn bench_deliveries_per_second() {
        for window in [16, 160] {
            bench(window);
        }
    }

    fn bench(window: usize) {
        const DELIVERIES: u64 = 10_000_000;
        let mut c: Cluster<Bench> = Cluster::new(ClusterConfig::new(job(100, 1000)));
        c.network_mut().set_size_hook(|m| if matches!(m, Message::Push { .. }) { 100_000 } else { 32 });
        let server_link = LinkSpec::default().capped_mbps(1_250.0);
        let servers: Vec<_> = (0..100).map(|i| c.add(NodeKind::Server(i), server_link, Bench::Server)).collect();
        let values = Values::from_vec(vec![0.5]);
        for w in 0..1000u32 {
            let servers = servers.clone();
            let worker =
                Bench::Worker { servers, conns: Vec::new(), next: w as usize, window: 16, values: values.clone() };
            c.add(NodeKind::Worker(w), LinkSpec::default(), worker);
        }
        let start = std::time::Instant::now();
        let stop = c.run(u64::MAX, DELIVERIES);
        let secs = start.elapsed().as_secs_f64();
        let delivered = c.stats().delivered;
        assert_eq!(stop, Stop::Events);
        assert!(delivered >= DELIVERIES - 1_000, "{delivered}");
        println!(
            "harness, {window} in flight per worker: {delivered} deliveries in {secs:.2} s wall = {:.2} M deliveries/s ({} ns each); {:.3} s virtual",
            delivered as f64 / secs / 1e6,
            (secs * 1e9 / delivered as f64).round(),
            c.network().now_us() as f64 / 1e6
        );
    }
}

mod job {
    //! Whole jobs on the harness: the real scheduler, servers and workers.

    use elasticps_core::block::ShardConfig;
    use elasticps_core::model::{BlockId, Init, TensorSpec};
    use elasticps_core::optimizer::{OptimizerConfig, OptimizerKind};
    use elasticps_core::placement::PlacementKind;
    use elasticps_core::sync::{Clock, SyncPolicy};
    use elasticps_harness::{ClusterConfig, JobSetup, ServerModel, SimJob, Stage, TrainingLoop};
    use elasticps_node::scheduler::JobConfig;
    use elasticps_node::server::Slot;

    pub(super) fn job(servers: u32, workers: u32, sync: SyncPolicy) -> JobConfig {
        JobConfig {
            servers,
            workers,
            block_bytes: 16,
            placement: PlacementKind::RoundRobin,
            shard: ShardConfig {
                sync,
                optimizer: OptimizerConfig { kind: OptimizerKind::Sgd, lr: 1.0, aggregate: false, weight_decay: 0.0 },
                workers,
            },
            server_sync: Vec::new(),
            seed: 1,
            inject: Vec::new(),
            balance: Default::default(),
            balance_compress: None,
            max_servers: servers,
            min_servers: servers,
            checkpoint: None,
            rejoin_wait_us: 0,
            replicas: 1,
        }
    }

    pub(super) fn model() -> Vec<TensorSpec> {
        vec![
            TensorSpec { name: "w".into(), shape: vec![40], init: Init::Zeros },
            TensorSpec { name: "b".into(), shape: vec![3], init: Init::Zeros },
        ]
    }

    /// Integer gradients, so that the final parameters are exact in f32.
    pub(super) fn grad(rank: u32, clock: Clock, block: BlockId) -> f32 {
        ((rank + 1) * 3 + clock * 7 + block) as f32 % 5.0 + 1.0
    }

    /// Every worker's training loop, with at most `window` requests of a round in flight
    /// to one server.
    pub(super) fn training_with_window(iterations: u32, window: usize) -> impl FnMut(u32) -> TrainingLoop {
        move |i| TrainingLoop {
            tensors: model(),
            iterations,
            compute_us: Box::new(move |rank, t| 1_000 + u64::from((rank * 7 + t * 13 + i) % 5) * 700),
            grad,
            timeout_us: 300_000_000,
            // Workers of one job differ: half fuse push and pull, half do not.
            fuse: i % 2 == 0,
            window,
            zero_as_no_gradient: false,
            table: None,
        }
    }

    #[test]
    fn a_job_trains_to_the_exact_parameters_and_ends() {
        trains_to_the_exact_parameters(elasticps_node::timing::DEFAULT_WINDOW);
    }

    /// A window of one request in flight per server: the rounds hold their other sends
    /// back and the job still ends with the exact values.
    #[test]
    fn a_job_with_a_window_of_one_trains_to_the_exact_parameters() {
        trains_to_the_exact_parameters(1);
    }

    /// Two ssp workers at different clocks set one tensor's optimizer at once: both go
    /// through the scheduler, both are answered, and every server ends with the scheduler's
    /// record (the later set), which the layout shows.
    #[test]
    fn concurrent_optimizer_sets_reach_every_server_in_the_schedulers_order() {
        use elasticps_core::optimizer::TensorOptimizer;
        use elasticps_harness::JobRole;
        let mut setup = JobSetup::new(ClusterConfig::new(job(2, 2, SyncPolicy::Ssp(3))));
        setup.server_model = ServerModel { apply_bps: 0, check_bound: true, ..ServerModel::default() };
        let mut sim = SimJob::new(setup, training_with_window(30, elasticps_node::timing::DEFAULT_WINDOW));
        let mut until = 0;
        while sim.workers().any(|(_, w)| w.record().iteration_ends_us.len() < 3) {
            until += 2_000;
            assert!(sim.run(until, 10_000_000).is_none(), "the job ended before the sets");
            assert!(until < 60_000_000, "training did not start");
        }
        let sgd = |lr| TensorOptimizer { kind: OptimizerKind::Sgd, lr, weight_decay: 0.0 };
        let workers: Vec<_> = sim.workers().map(|(n, _)| n).collect();
        for (node, lr) in workers.iter().zip([0.5, 0.25]) {
            sim.cluster_mut().with_role(*node, |role, out| match role {
                JobRole::Worker(w) => w.set_optimizer(out, 0, sgd(lr)),
                _ => panic!("not a worker"),
            });
        }
        let end = sim.run(600_000_000, 10_000_000).expect("the job ends");
        assert!(end.ok, "{end:?}");
        for (_, w) in sim.workers() {
            assert_eq!(w.record().optimizers_set, 1, "each set answered once");
        }
        let recorded = sim.cluster().scheduler().partition().and_then(|p| p.optimizer(0)).copied();
        assert_eq!(recorded, Some(sgd(0.25)), "the scheduler recorded the later set last");
        let mut servers = 0;
        for (_, s) in sim.servers() {
            let shard = s.server().and_then(|s| s.shard()).expect("an assigned server");
            assert_eq!(shard.tensor_optimizers.first().copied().flatten(), recorded, "server {}", shard.id);
            servers += 1;
        }
        assert_eq!(servers, 2);
    }

    fn trains_to_the_exact_parameters(window: usize) {
        let iterations = 6;
        let mut setup = JobSetup::new(ClusterConfig::new(job(2, 3, SyncPolicy::Ssp(1))));
        setup.server_model = ServerModel { apply_bps: 0, check_bound: true, ..ServerModel::default() };
        let mut sim = SimJob::new(setup, training_with_window(iterations, window));
        let end = sim.run(600_000_000, 10_000_000).expect("the job ends");
        assert!(end.ok, "{end:?}");
        for (_, w) in sim.workers() {
            assert_eq!(*w.stage(), Stage::Done);
            assert_eq!(w.record().iteration_ends_us.len(), iterations as usize);
        }
        let mut seen = 0;
        for (_, s) in sim.servers() {
            assert!(s.violations().is_empty(), "{:?}", s.violations());
            let server = s.server().unwrap();
            for b in server.owned() {
                let Some(Slot::Owned(o)) = server.slot(b) else { panic!("block {b} owned but not here") };
                let want: f32 = -(0..3).flat_map(|r| (0..iterations).map(move |t| grad(r, t, b))).sum::<f32>();
                assert!(o.block.values().iter().all(|v| *v == want), "block {b}: {:?} != {want}", o.block.values());
                seen += 1;
            }
        }
        assert!(seen >= 4, "{seen} blocks");
    }
}

mod exactly_once;
mod window;
