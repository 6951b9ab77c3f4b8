//! Integration tests of elasticps-wire through its public API.

mod common {
    use elasticps_core::block::{BlockState, BlockStats, LoggedPush, PendingSum, ShardConfig};
    use elasticps_core::model::{BlockSpec, Init, Partition, TensorSpec};
    use elasticps_core::optimizer::{OptState, OptimizerConfig, OptimizerKind, TensorOptimizer};
    use elasticps_core::placement::{Placement, PlacementKind};
    use elasticps_core::sync::{Clocks, SyncPolicy};
    use elasticps_wire::*;
    use proptest::prelude::*;

    /// Space-separated lowercase hex, as docs/PROTOCOL.md writes bytes.
    pub fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect::<Vec<_>>().join(" ")
    }

    /// Rewrites the checksum of a hand-edited header so that only the edited field is wrong.
    pub fn reseal(head: &mut [u8; HEADER_LEN], secret: &[u8]) {
        let sum = checksum(head, secret);
        head[CHECKSUM_OFFSET..].copy_from_slice(&sum.to_le_bytes());
    }

    /// The postcard tag of every Control variant: the table in docs/PROTOCOL.md. The match is
    /// exhaustive, so adding a variant does not compile until this table (and the doc) has it.
    pub fn control_tag(c: &Control) -> u8 {
        match c {
            Control::RegisterServer { .. } => 0,
            Control::RegisterWorker => 1,
            Control::Welcome { .. } => 2,
            Control::DefineModel { .. } => 3,
            Control::GetLayout => 4,
            Control::Layout(_) => 5,
            Control::Assign(_) => 6,
            Control::AssignDone { .. } => 7,
            Control::Heartbeat => 8,
            Control::WorkerDone { .. } => 9,
            Control::RemoveWorker { .. } => 10,
            Control::Shutdown { .. } => 11,
            Control::Hello { .. } => 12,
            Control::Ok => 13,
            Control::Moved { .. } => 14,
            Control::GetStats => 15,
            Control::Stats(_) => 16,
            Control::Migrate { .. } => 17,
            Control::BlockSnapshot { .. } => 18,
            Control::BlockDelta { .. } => 19,
            Control::MigrateDone(_) => 20,
            Control::ServerLoad(_) => 21,
            Control::WorkerLoad(_) => 22,
            Control::GetStatus => 23,
            Control::Status(_) => 24,
            Control::Scale(_) => 25,
            Control::Barrier => 26,
            Control::SetOptimizer { .. } => 27,
            Control::Settled { .. } => 28,
            Control::Checkpointing(_) => 29,
            Control::CheckpointWritten { .. } => 30,
            Control::GetStartClock => 31,
            Control::StartClock { .. } => 32,
            Control::RejoinWorker { .. } => 33,
            Control::AddWorker { .. } => 34,
            Control::WorkerAdded { .. } => 35,
            Control::Replicate { .. } => 36,
            Control::Replicas { .. } => 37,
            Control::ReplicaSnapshot(_) => 38,
            Control::ReattachServer { .. } => 39,
            Control::ReattachWorker { .. } => 40,
            Control::JoinHost(_) => 41,
            Control::HostWelcome { .. } => 42,
            Control::StartNode { .. } => 43,
            Control::NodeExited { .. } => 44,
            Control::HostEvent { .. } => 45,
            Control::SplitBlock { .. } => 46,
            Control::SplitDone { .. } => 47,
            Control::GetOptState { .. } => 48,
            Control::OptState { .. } => 49,
            Control::SetOptState { .. } => 50,
            Control::SetValues { .. } => 51,
            Control::OptimizerSet { .. } => 52,
            Control::ExportBlock { .. } => 53,
            Control::ExportedBlock { .. } => 54,
            Control::JoinGroup { .. } => 55,
        }
    }

    /// Any f32 but NaN (for fields compared with `==`).
    pub fn finite_or_inf() -> impl Strategy<Value = f32> {
        any::<u32>().prop_map(f32::from_bits).prop_filter("not NaN", |v| !v.is_nan())
    }

    /// Any f64 but NaN (for fields compared with `==`).
    pub fn f64_not_nan() -> impl Strategy<Value = f64> {
        any::<u64>().prop_map(f64::from_bits).prop_filter("not NaN", |v| !v.is_nan())
    }

    /// Any f32 bit pattern, NaNs included (compared bitwise through `Values`).
    pub fn any_bits_f32() -> impl Strategy<Value = f32> {
        any::<u32>().prop_map(f32::from_bits)
    }

    pub fn arb_dtype() -> impl Strategy<Value = Dtype> {
        prop::sample::select(Dtype::ALL.to_vec())
    }

    /// Dense values of any dtype, built every way.
    pub fn arb_values() -> impl Strategy<Value = Values> {
        (prop::collection::vec(any_bits_f32(), 0..64), 0..4u8, arb_dtype()).prop_map(|(v, how, dtype)| match how {
            0 => Values::from_vec(v),
            1 => Values::from_shared(std::sync::Arc::new(v)),
            2 => Values::from_slice(&v),
            _ => Values::encoded(&v, dtype),
        })
    }

    /// A gradient: dense values of any dtype, or a sparse one (any positions: whether
    /// they fit the block is the server's check, not the decoder's).
    pub fn arb_gradient() -> impl Strategy<Value = Values> {
        prop_oneof![
            arb_values(),
            (prop::collection::vec((any::<u32>(), any_bits_f32()), 0..32), arb_dtype()).prop_map(|(pairs, dtype)| {
                let (idx, v): (Vec<u32>, Vec<f32>) = pairs.into_iter().unzip();
                Values::sparse(&idx, &v, dtype)
            }),
        ]
    }

    fn arb_init() -> impl Strategy<Value = Init> {
        prop_oneof![
            Just(Init::Zeros),
            (finite_or_inf(), finite_or_inf()).prop_map(|(low, high)| Init::Uniform { low, high }),
            finite_or_inf().prop_map(Init::Constant),
        ]
    }

    pub fn arb_tensors() -> impl Strategy<Value = Vec<TensorSpec>> {
        prop::collection::vec(("[a-z.]{0,12}", prop::collection::vec(1..6usize, 0..4), arb_init()), 1..5).prop_map(
            |ts| {
                ts.into_iter()
                    .enumerate()
                    .map(|(i, (name, shape, init))| TensorSpec { name: format!("{i}{name}"), shape, init })
                    .collect()
            },
        )
    }

    fn arb_partition() -> impl Strategy<Value = Partition> {
        (arb_tensors(), 4..64usize).prop_map(|(t, block_bytes)| Partition::new(t, block_bytes).unwrap())
    }

    fn arb_placement(p: &Partition) -> impl Strategy<Value = Placement> + use<> {
        let p = p.clone();
        (0..4usize, 1..5u32, any::<u64>()).prop_map(move |(kind, servers, epoch)| {
            let kind =
                [PlacementKind::Range, PlacementKind::Hash, PlacementKind::RoundRobin, PlacementKind::BestFit][kind];
            let mut pl = Placement::initial(kind, &p, servers).unwrap();
            pl.epoch = epoch;
            pl
        })
    }

    fn arb_addrs() -> impl Strategy<Value = Vec<ServerAddr>> {
        prop::collection::vec((any::<u32>(), "[a-z0-9.:]{0,20}"), 0..4)
            .prop_map(|v| v.into_iter().map(|(id, addr)| ServerAddr { id, addr }).collect())
    }

    fn arb_layout() -> impl Strategy<Value = Layout> {
        arb_partition()
            .prop_flat_map(|p| {
                (arb_placement(&p), Just(p), arb_addrs(), any::<u64>(), prop::collection::vec(arb_dtype(), 0..4))
            })
            .prop_map(|(placement, partition, servers, seed, wire)| Layout {
                partition,
                placement,
                servers,
                seed,
                wire,
            })
    }

    fn arb_shard_config() -> impl Strategy<Value = ShardConfig> {
        let sync = prop_oneof![
            Just(SyncPolicy::Bsp),
            Just(SyncPolicy::Asp),
            any::<u32>().prop_map(SyncPolicy::Ssp),
            any::<u32>().prop_map(SyncPolicy::Lazy),
            (any::<u32>(), f64_not_nan()).prop_map(|(s, p)| SyncPolicy::Pssp { s, p }),
            any::<u32>().prop_map(SyncPolicy::Dpssp),
            any::<(u32, u32)>().prop_map(|(min, max)| SyncPolicy::Adaptive { min, max }),
        ];
        (sync, arb_optimizer_kind(), finite_or_inf(), any::<bool>(), finite_or_inf(), any::<u32>()).prop_map(
            |(sync, kind, lr, aggregate, weight_decay, workers)| ShardConfig {
                sync,
                optimizer: OptimizerConfig { kind, lr, aggregate, weight_decay },
                workers,
            },
        )
    }

    fn arb_injection() -> impl Strategy<Value = Injection> {
        (any::<u64>(), finite_or_inf(), any::<u64>()).prop_map(|(bandwidth_bps, interference, at_us)| Injection {
            bandwidth_bps,
            interference,
            at_us,
        })
    }

    fn arb_assignment() -> impl Strategy<Value = Assignment> {
        arb_partition()
            .prop_flat_map(|p| {
                (any::<u32>(), arb_placement(&p), Just(p), arb_shard_config(), any::<u64>(), arb_injection())
            })
            .prop_map(|(server_id, placement, partition, config, seed, inject)| Assignment {
                server_id,
                partition,
                placement,
                config,
                seed,
                inject,
            })
    }

    /// `n` f32s (no NaN: `BlockState` is compared with `==`).
    fn arb_f32s(n: usize) -> impl Strategy<Value = Vec<f32>> {
        prop::collection::vec(finite_or_inf(), n)
    }

    /// A clock state for `workers` workers: each has pushed some clocks, some were removed.
    fn arb_clocks(workers: u32) -> impl Strategy<Value = Clocks> {
        (prop::collection::vec(0..6u32, workers as usize), prop::collection::vec(any::<bool>(), workers as usize))
            .prop_map(move |(pushed, removed)| {
                let mut c = Clocks::new(workers);
                for (w, n) in pushed.iter().enumerate() {
                    for t in 0..*n {
                        assert!(c.record(0, w as u32, t).unwrap());
                    }
                }
                for (w, r) in removed.iter().enumerate() {
                    if *r {
                        c.remove_worker(w as u32);
                    }
                }
                c
            })
    }

    /// Any optimizer state (moments empty or of one length).
    pub fn arb_opt_state() -> impl Strategy<Value = OptState> {
        (any::<u64>(), 0..24usize).prop_flat_map(|(steps, len)| {
            let buf = prop_oneof![Just(Vec::new()), arb_f32s(len)];
            (buf.clone(), buf).prop_map(move |(m, v)| OptState { steps, m, v })
        })
    }

    /// A consistent block state: values, optimizer buffers (empty, or one value per
    /// element) and pending sums all have the block's length.
    pub fn arb_block_state() -> impl Strategy<Value = BlockState> {
        (any::<u32>(), any::<u32>(), 0..1000usize, 0..24usize, 0..4u32)
            .prop_flat_map(|(id, tensor, offset, len, workers)| {
                let spec = BlockSpec::dense(id, tensor, offset, len);
                let buf = prop_oneof![Just(Vec::new()), arb_f32s(len)];
                let opt = (any::<u64>(), buf.clone(), buf).prop_map(|(steps, m, v)| OptState { steps, m, v });
                let pending = prop::collection::vec(
                    (any::<u32>(), arb_f32s(len), any::<u32>()).prop_map(|(clock, sum, count)| PendingSum {
                        clock,
                        sum,
                        count,
                    }),
                    0..3,
                );
                (Just(spec), arb_f32s(len), opt, arb_clocks(workers), pending)
            })
            .prop_map(|(spec, values, opt, clocks, pending)| BlockState {
                spec,
                values,
                opt,
                clocks,
                pending,
                rows: None,
            })
    }

    fn arb_logged_push() -> impl Strategy<Value = LoggedPush> {
        (any::<u32>(), any::<u32>(), 0..24usize)
            .prop_flat_map(|(worker, clock, len)| (Just(worker), Just(clock), arb_f32s(len)))
            .prop_map(|(worker, clock, grad)| LoggedPush::dense(worker, clock, grad))
    }

    fn arb_migration_report() -> impl Strategy<Value = MigrationReport> {
        (any::<(u32, u32, u32, u64)>(), any::<(u64, u64, u64, u32)>(), prop::option::of(".{0,30}")).prop_map(
            |((block, from, to, epoch), (bytes, freeze_us, total_us, held), error)| MigrationReport {
                block,
                from,
                to,
                epoch,
                bytes,
                freeze_us,
                total_us,
                held,
                error,
            },
        )
    }

    fn arb_server_load() -> impl Strategy<Value = ServerLoad> {
        (any::<(u32, u64, u64, u64)>(), any::<(u64, u64, u64, u32, u64)>(), (0.0f64..1e12, any::<u32>())).prop_map(
            |(
                (server_id, interval_us, bytes_in, bytes_out),
                (requests, busy_us, shaped_us, blocks, bytes),
                (rx_bps, rx_frames),
            )| {
                ServerLoad {
                    server_id,
                    interval_us,
                    bytes_in,
                    bytes_out,
                    requests,
                    busy_us,
                    shaped_us,
                    blocks,
                    bytes,
                    rx_bps,
                    rx_frames,
                    row_blocks: vec![RowBlockLoad {
                        block: blocks,
                        pushes: 3,
                        pulls: 2,
                        rows: 9,
                        bytes_in,
                        bytes_out,
                        split_at: 7,
                        live_rows: requests,
                        row_bytes: 264,
                        evicted: busy_us,
                        expired: 5,
                        refused_grads: shaped_us,
                        init_reads: 11,
                    }],
                }
            },
        )
    }

    fn arb_worker_load() -> impl Strategy<Value = WorkerLoad> {
        let sample = any::<(u32, u32, u64, u64, u64)>().prop_map(|(server, rounds, push_bytes, push_us, wait_us)| {
            ServerSample { server, rounds, push_bytes, push_us, wait_us }
        });
        (any::<(u32, u32, u32, u64)>(), prop::collection::vec(sample, 0..4)).prop_map(
            |((rank, clock, iterations, iter_us), per_server)| WorkerLoad {
                rank,
                clock,
                iterations,
                iter_us,
                per_server,
            },
        )
    }

    fn arb_cluster_status() -> impl Strategy<Value = ClusterStatus> {
        let server = (
            any::<u32>(),
            "[a-z0-9.:]{0,20}",
            prop::sample::select(vec!["serving", "joining", "draining", "gone"]),
            any::<(u32, u64)>(),
            (f64_not_nan(), f64_not_nan(), f64_not_nan()),
            any::<bool>(),
        )
            .prop_map(|(id, addr, state, (blocks, bytes), (rate_bps, confidence, service_ms), straggler)| {
                ServerStatus {
                    id,
                    addr,
                    state: state.to_string(),
                    blocks,
                    bytes,
                    rate_bps,
                    confidence,
                    service_ms,
                    straggler,
                }
            });
        let worker = (any::<(u32, u32)>(), f64_not_nan(), any::<bool>())
            .prop_map(|((rank, clock), iter_ms, done)| WorkerStatus { rank, clock, iter_ms, done });
        (
            prop::sample::select(vec!["static", "psld"]),
            any::<(u64, u32)>(),
            prop::collection::vec(server, 0..4),
            prop::collection::vec(worker, 0..4),
        )
            .prop_map(|(balance, (epoch, migrations), servers, workers)| ClusterStatus {
                balance: balance.to_string(),
                epoch,
                migrations,
                servers,
                workers,
            })
    }

    fn arb_stats() -> impl Strategy<Value = ServerStats> {
        (any::<u32>(), ".{0,10}", any::<u32>(), any::<u64>(), any::<[u64; 7]>(), any::<u64>()).prop_map(
            |(server_id, sync, blocks, bytes, c, hold_p99_us)| {
                // `..Default::default()` keeps this compiling if core adds counters.
                #[allow(clippy::needless_update)]
                let totals = BlockStats {
                    pushes: c[0],
                    pulls: c[1],
                    pulls_held: c[2],
                    hold_us: c[3],
                    releases: c[4],
                    bytes_in: c[5],
                    bytes_out: c[6],
                    ..BlockStats::default()
                };
                ServerStats { server_id, sync, blocks, bytes, totals, hold_p99_us }
            },
        )
    }

    pub fn arb_control() -> impl Strategy<Value = Control> {
        prop_oneof![
            ".{0,30}".prop_map(|data_addr| Control::RegisterServer { data_addr }),
            Just(Control::RegisterWorker),
            (any::<(u32, u32, u32)>(), arb_credential()).prop_map(
                |((node_id, num_workers, num_servers), credential)| {
                    Control::Welcome { node_id, num_workers, num_servers, credential }
                }
            ),
            (arb_tensors(), prop::collection::vec(prop::option::of(arb_tensor_optimizer()), 0..3))
                .prop_map(|(tensors, optimizers)| Control::DefineModel { tensors, optimizers, tables: Vec::new() }),
            Just(Control::GetLayout),
            arb_layout().prop_map(Control::Layout),
            arb_assignment().prop_map(|a| Control::Assign(Box::new(a))),
            any::<u32>().prop_map(|server_id| Control::AssignDone { server_id }),
            Just(Control::Heartbeat),
            any::<u32>().prop_map(|rank| Control::WorkerDone { rank }),
            any::<u32>().prop_map(|rank| Control::RemoveWorker { rank }),
            ".{0,30}".prop_map(|reason| Control::Shutdown { reason }),
            arb_credential().prop_map(|credential| Control::Hello { credential }),
            Just(Control::Ok),
            any::<(u32, u32, u64)>().prop_map(|(block, owner, epoch)| Control::Moved { block, owner, epoch }),
            Just(Control::GetStats),
            arb_stats().prop_map(Control::Stats),
            (any::<(u32, u32, u64)>(), "[a-z0-9.:]{0,20}").prop_map(|((block, to, epoch), to_addr)| Control::Migrate {
                block,
                to,
                to_addr,
                epoch
            }),
            (any::<u64>(), arb_block_state()).prop_map(|(epoch, state)| Control::BlockSnapshot { epoch, state }),
            (any::<(u32, u64)>(), prop::collection::vec(arb_logged_push(), 0..4))
                .prop_map(|((block, epoch), pushes)| Control::BlockDelta { block, epoch, pushes }),
            arb_migration_report().prop_map(Control::MigrateDone),
            arb_server_load().prop_map(Control::ServerLoad),
            arb_worker_load().prop_map(Control::WorkerLoad),
            Just(Control::GetStatus),
            arb_cluster_status().prop_map(Control::Status),
            prop_oneof![
                Just(ScaleRequest::AddServer),
                any::<u32>().prop_map(ScaleRequest::RemoveServer),
                any::<(u32, u32)>().prop_map(|(block, to)| ScaleRequest::MoveBlock { block, to }),
            ]
            .prop_map(Control::Scale),
            Just(Control::Barrier),
            (any::<u32>(), arb_tensor_optimizer())
                .prop_map(|(tensor, optimizer)| Control::SetOptimizer { tensor, optimizer }),
            any::<(u32, u64, u32)>().prop_map(|(block, epoch, owner)| Control::Settled { block, epoch, owner }),
            ("[a-z0-9/]{0,20}", any::<u32>(), prop::option::of((any::<u32>(), arb_checkpoint_entries()))).prop_map(
                |(dir, every, resume)| Control::Checkpointing(CheckpointPlan {
                    dir,
                    every,
                    resume: resume.map(|(clock, blocks)| Restore { clock, blocks }),
                })
            ),
            (any::<u32>(), arb_checkpoint_entries())
                .prop_map(|(clock, blocks)| Control::CheckpointWritten { clock, blocks }),
            Just(Control::GetStartClock),
            any::<u32>().prop_map(|clock| Control::StartClock { clock }),
            any::<u32>().prop_map(|rank| Control::RejoinWorker { rank }),
            any::<u32>().prop_map(|rank| Control::AddWorker { rank }),
            any::<(u32, u32)>().prop_map(|(rank, clock)| Control::WorkerAdded { rank, clock }),
            (
                any::<u32>(),
                arb_credential(),
                "[a-z0-9:.]{0,20}",
                prop::collection::vec(any::<(u32, u64, bool)>(), 0..4)
            )
                .prop_map(|(server_id, credential, data_addr, blocks)| Control::ReattachServer {
                    server_id,
                    credential,
                    data_addr,
                    blocks: blocks
                        .into_iter()
                        .map(|(block, epoch, arrived)| elasticps_wire::HeldBlock { block, epoch, arrived })
                        .collect(),
                }),
            (any::<u32>(), arb_credential())
                .prop_map(|(rank, credential)| Control::ReattachWorker { rank, credential }),
            ("[a-z0-9-]{0,12}", "[0-9.]{0,15}", any::<(u32, u32, u32, u32)>()).prop_map(
                |(name, addr, (servers, workers, server_slots, worker_slots))| {
                    Control::JoinHost(elasticps_wire::HostOffer {
                        name,
                        addr,
                        servers,
                        workers,
                        server_slots,
                        worker_slots,
                    })
                }
            ),
            any::<u32>().prop_map(|host| Control::HostWelcome { host }),
            (any::<(u32, u32)>(), prop::option::of(prop::option::of(any::<u32>()))).prop_map(
                |((slot, workers), role)| {
                    let role = match role {
                        None => elasticps_wire::NodeRole::Server,
                        Some(rank) => elasticps_wire::NodeRole::Worker { rank },
                    };
                    Control::StartNode { slot, role, workers }
                }
            ),
            (any::<(u32, bool)>(), ".{0,20}", prop::option::of(any::<u32>()))
                .prop_map(|((slot, ok), status, rank)| Control::NodeExited { slot, ok, status, rank }),
            ".{0,40}".prop_map(|line| Control::HostEvent { line }),
            any::<(u32, u64, u64, bool)>().prop_map(|(block, at, epoch, recorded)| Control::SplitBlock {
                block,
                at,
                epoch,
                recorded
            }),
            (any::<(u32, u64, u64)>(), prop::option::of(".{0,20}"))
                .prop_map(|((block, at, epoch), error)| Control::SplitDone { block, at, epoch, error }),
            any::<u32>().prop_map(|block| Control::GetOptState { block }),
            (any::<u32>(), arb_opt_state()).prop_map(|(block, state)| Control::OptState { block, state }),
            (any::<u32>(), arb_opt_state()).prop_map(|(block, state)| Control::SetOptState { block, state }),
            (any::<u32>(), arb_f32s(8)).prop_map(|(block, values)| Control::SetValues { block, values }),
            any::<u32>().prop_map(|tensor| Control::OptimizerSet { tensor }),
        ]
    }

    /// Any credential (the MAC need not hold: encoding does not check it).
    pub fn arb_credential() -> impl Strategy<Value = Credential> {
        (any::<u64>(), any::<bool>(), any::<u32>(), any::<[u8; 32]>()).prop_map(|(job, server, id, mac)| Credential {
            job,
            role: if server { PeerRole::Server } else { PeerRole::Worker },
            id,
            mac,
        })
    }

    pub fn arb_checkpoint_entries() -> impl Strategy<Value = Vec<CheckpointEntry>> {
        prop::collection::vec(
            (any::<u32>(), "[a-z0-9/.-]{0,20}", any::<(u64, u32)>())
                .prop_map(|(block, file, (len, crc32))| CheckpointEntry { block, file, len, crc32 }),
            0..4,
        )
    }

    pub fn arb_optimizer_kind() -> impl Strategy<Value = OptimizerKind> {
        prop_oneof![
            Just(OptimizerKind::Sgd),
            finite_or_inf().prop_map(|beta| OptimizerKind::Momentum { beta }),
            (finite_or_inf(), finite_or_inf(), finite_or_inf()).prop_map(|(beta1, beta2, eps)| OptimizerKind::Adam {
                beta1,
                beta2,
                eps
            }),
            (finite_or_inf(), finite_or_inf(), finite_or_inf()).prop_map(|(beta1, beta2, eps)| OptimizerKind::AdamW {
                beta1,
                beta2,
                eps
            }),
        ]
    }

    pub fn arb_tensor_optimizer() -> impl Strategy<Value = TensorOptimizer> {
        (arb_optimizer_kind(), finite_or_inf(), finite_or_inf()).prop_map(|(kind, lr, weight_decay)| TensorOptimizer {
            kind,
            lr,
            weight_decay,
        })
    }

    pub fn arb_error_code() -> impl Strategy<Value = ErrorCode> {
        prop::sample::select(vec![
            ErrorCode::Malformed,
            ErrorCode::BadVersion,
            ErrorCode::UnknownKind,
            ErrorCode::TooLarge,
            ErrorCode::BadChecksum,
            ErrorCode::UnknownBlock,
            ErrorCode::BadRequest,
            ErrorCode::NotReady,
            ErrorCode::ShuttingDown,
            ErrorCode::Internal,
            ErrorCode::Unauthenticated,
            ErrorCode::Forbidden,
        ])
    }

    pub fn arb_message() -> impl Strategy<Value = Message> {
        prop_oneof![
            arb_control().prop_map(Message::Control),
            (any::<u32>(), any::<u32>(), arb_gradient())
                .prop_map(|(block, clock, values)| { Message::Push { block, clock, values } }),
            any::<(u32, u32)>().prop_map(|(block, clock)| Message::PushAck { block, clock }),
            (any::<(u32, u32)>(), arb_dtype()).prop_map(|((block, clock), reply)| Message::Pull {
                block,
                clock,
                reply
            }),
            (any::<u32>(), any::<u32>(), arb_values())
                .prop_map(|(block, clock, values)| { Message::PullReply { block, clock, values } }),
            (arb_error_code(), ".{0,40}").prop_map(|(code, message)| Message::Error(ErrorReply { code, message })),
            (any::<u32>(), arb_values()).prop_map(|(block, values)| Message::Init { block, values }),
            (any::<u32>(), any::<u32>(), arb_gradient(), arb_dtype())
                .prop_map(|(block, clock, values, reply)| { Message::PushPull { block, clock, values, reply } }),
            (any::<u32>(), any::<u32>(), any::<u32>(), any::<bool>(), arb_gradient()).prop_map(
                |(block, clock, worker, init, values)| {
                    let clock = if init { 0 } else { clock };
                    Message::Forward { block, clock, worker, init, values }
                }
            ),
            (any::<u32>(), any::<u32>(), prop::collection::vec(any::<u64>(), 0..8), arb_dtype()).prop_map(
                |(block, clock, ids, reply)| Message::PullRows { block, clock, ids: RowIds::from_vec(ids), reply }
            ),
            (any::<u32>(), any::<u32>(), arb_values()).prop_map(|(block, clock, values)| Message::PullRowsReply {
                block,
                clock,
                values
            }),
            (any::<u32>(), any::<u32>(), 1..4u32, prop::collection::vec(any::<u64>(), 0..5)).prop_flat_map(
                |(block, clock, dim, ids)| {
                    let n = ids.len() * dim as usize;
                    (Just((block, clock, dim, ids)), arb_f32s(n)).prop_map(|((block, clock, dim, ids), grads)| {
                        Message::PushRows {
                            block,
                            clock,
                            dim,
                            ids: RowIds::from_vec(ids),
                            grads: Values::from_vec(grads),
                        }
                    })
                }
            ),
        ]
    }
}

mod roundtrip {
    use bytes::BytesMut;
    use elasticps_wire::*;
    use proptest::prelude::*;

    use crate::common::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        /// Header + payload, the way the runtime reads a socket.
        #[test]
        fn through_decode_header_and_message_decode(
            id in any::<u64>(),
            msg in arb_message(),
            secret in prop::collection::vec(any::<u8>(), 0..16),
        ) {
            let codec = Codec::new(&secret, DEFAULT_MAX_PAYLOAD);
            let (head, payload) = codec.encode(id, &msg).unwrap();
            let h = codec.decode_header(&head).unwrap();
            prop_assert_eq!(h.kind, msg.kind());
            prop_assert_eq!(h.request_id, id);
            prop_assert_eq!((h.block, h.clock), msg.block_clock());
            prop_assert_eq!(h.payload_len as usize, payload.len());
            let back = Message::decode(&h, payload).unwrap();
            prop_assert_eq!(&back, &msg);
            if let Message::Control(c) = &msg {
                let bytes = postcard::to_allocvec(c).unwrap();
                prop_assert_eq!(bytes[0], control_tag(c), "postcard tag of {:?}", c);
                prop_assert_eq!(Control::NAMES[usize::from(control_tag(c))], c.name(), "the name of tag {}", bytes[0]);
            }
        }

        /// A stream of frames fed in arbitrary chunks through `decode_frame`.
        #[test]
        fn through_decode_frame_in_chunks(
            msgs in prop::collection::vec((any::<u64>(), arb_message()), 1..4),
            cuts in prop::collection::vec(0..1usize << 16, 0..12),
        ) {
            let codec = Codec::new(b"secret", DEFAULT_MAX_PAYLOAD);
            let mut stream = Vec::new();
            let mut ends = Vec::new();
            for (id, m) in &msgs {
                let (head, payload) = codec.encode(*id, m).unwrap();
                stream.extend_from_slice(&head);
                stream.extend_from_slice(&payload);
                ends.push(stream.len());
            }
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (stream.len() + 1)).collect();
            cuts.push(stream.len());
            cuts.sort_unstable();

            let mut buf = BytesMut::new();
            let mut fed = 0;
            let mut consumed = 0;
            let mut got = Vec::new();
            for cut in cuts {
                buf.extend_from_slice(&stream[fed..cut]);
                fed = cut;
                loop {
                    let before = buf.clone();
                    match codec.decode_frame(&mut buf).unwrap() {
                        None => {
                            prop_assert_eq!(&buf, &before, "incomplete must leave the buffer untouched");
                            prop_assert!(consumed + buf.len() < ends.get(got.len()).copied().unwrap_or(usize::MAX));
                            break;
                        }
                        Some((h, payload)) => {
                            consumed += HEADER_LEN + payload.len();
                            prop_assert_eq!(consumed, ends[got.len()]);
                            got.push((h.request_id, Message::decode(&h, payload).unwrap()));
                        }
                    }
                }
            }
            prop_assert!(buf.is_empty());
            prop_assert_eq!(got, msgs);
        }

        /// Every proper prefix of a frame is "incomplete", never an error, and consumes nothing.
        #[test]
        fn every_prefix_is_incomplete(id in any::<u64>(), msg in arb_message()) {
            let codec = Codec::default();
            let mut frame = BytesMut::new();
            codec.encode_to(id, &msg, &mut frame).unwrap();
            for n in 0..frame.len() {
                let mut buf = BytesMut::from(&frame[..n]);
                prop_assert_eq!(codec.decode_frame(&mut buf), Ok(None));
                prop_assert_eq!(&buf[..], &frame[..n]);
            }
            let mut buf = frame.clone();
            prop_assert_eq!(codec.decode_message(&mut buf).unwrap(), Some((id, msg)));
        }

        /// Arbitrary bytes never panic the decoder.
        #[test]
        fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            let codec = Codec::default();
            let mut buf = BytesMut::from(&bytes[..]);
            while let Ok(Some((h, payload))) = codec.decode_frame(&mut buf) {
                let _ = Message::decode(&h, payload);
            }
        }

        /// Random frames with a valid envelope (magic, version, checksum) but arbitrary kind,
        /// fields and payload reach the payload decoders (postcard on garbage) without panic.
        #[test]
        fn random_sealed_frames_never_panic(
            kind in 0..14u8,
            flags in prop::sample::select(vec![0u16, 0, 0, 1, 0x8000]),
            fields in any::<(u64, u32, u32)>(),
            payload in prop::collection::vec(any::<u8>(), 0..128),
            extra in 0..3u32,
        ) {
            let codec = Codec::new(b"k", 100);
            let mut head = [0u8; HEADER_LEN];
            head[..4].copy_from_slice(&MAGIC);
            head[4] = VERSION;
            head[5] = kind;
            head[6..8].copy_from_slice(&flags.to_le_bytes());
            head[8..16].copy_from_slice(&fields.0.to_le_bytes());
            head[16..20].copy_from_slice(&fields.1.to_le_bytes());
            head[20..24].copy_from_slice(&fields.2.to_le_bytes());
            head[24..28].copy_from_slice(&(payload.len() as u32).to_le_bytes());
            reseal(&mut head, b"k");
            let mut buf = BytesMut::from(&head[..]);
            buf.extend_from_slice(&payload);
            buf.extend_from_slice(&vec![0u8; extra as usize]);
            match codec.decode_frame(&mut buf) {
                Ok(Some((h, p))) => {
                    prop_assert_eq!(h.payload_len as usize, payload.len());
                    prop_assert_eq!(buf.len(), extra as usize);
                    if let Ok(m) = Message::decode(&h, p) {
                        // Whatever decodes re-encodes to the same frame, except postcard
                        // payloads: postcard accepts non-shortest varints (see
                        // `postcard_accepts_long_varints`), we re-encode them shortest.
                        let (h2, p2) = codec.encode(h.request_id, &m).unwrap();
                        if !h.kind.is_postcard() {
                            prop_assert_eq!(&p2[..], &payload[..]);
                            prop_assert_eq!(h2, head);
                        }
                    }
                }
                Ok(None) => prop_assert!(false, "a whole frame is never incomplete"),
                Err(_) => {}
            }
        }
    }
}

mod invalid {
    use bytes::{Bytes, BytesMut};
    use elasticps_wire::*;

    use crate::common::*;

    const SECRET: &[u8] = b"cluster-a";

    fn codec() -> Codec {
        Codec::new(SECRET, 1024)
    }

    fn pull_header() -> [u8; HEADER_LEN] {
        codec().encode(9, &Message::Pull { block: 1, clock: 2, reply: Dtype::F32 }).unwrap().0
    }

    /// A header with one byte range replaced and the checksum made right again.
    fn edited(range: std::ops::Range<usize>, bytes: &[u8]) -> [u8; HEADER_LEN] {
        let mut h = pull_header();
        h[range].copy_from_slice(bytes);
        reseal(&mut h, SECRET);
        h
    }

    /// Both entry points refuse `head`; returns the error.
    fn refuse(head: [u8; HEADER_LEN]) -> WireError {
        let err = codec().decode_header(&head).unwrap_err();
        let mut buf = BytesMut::from(&head[..]);
        assert_eq!(codec().decode_frame(&mut buf), Err(err.clone()), "decode_frame agrees");
        assert_eq!(&buf[..], &head[..], "an invalid frame is not consumed");
        err
    }

    #[test]
    fn the_untouched_header_is_valid() {
        let h = codec().decode_header(&pull_header()).unwrap();
        assert_eq!(
            h,
            FrameHeader {
                kind: Kind::Pull,
                request_id: 9,
                block: 1,
                clock: 2,
                payload_len: 0,
                flags: Flags::default()
            }
        );
    }

    #[test]
    fn bad_magic() {
        let mut h = pull_header();
        h[..4].copy_from_slice(b"GET ");
        let err = refuse(h);
        assert_eq!(err, WireError::BadMagic { got: *b"GET " });
        assert_eq!(err.code(), ErrorCode::Malformed);
        assert_eq!(refuse(edited(0..4, b"EPS2")), WireError::BadMagic { got: *b"EPS2" });
    }

    #[test]
    fn versions_1_to_4_and_6() {
        // Version 1 had no backup lists in its placements, version 2 no credentials,
        // version 3 no embedding tables, version 4 no hashed tables nor exports
        // (PROTOCOL.md §2).
        for v in [1, 2, 3, 4, 6] {
            let err = refuse(edited(4..5, &[v]));
            assert_eq!(err, WireError::BadVersion { got: v });
            assert_eq!(err.code(), ErrorCode::BadVersion);
            // Version is checked before the checksum: another version learns it is the version.
            let mut h = pull_header();
            h[4] = v;
            assert_eq!(refuse(h), WireError::BadVersion { got: v });
        }
    }

    #[test]
    fn unknown_kinds() {
        for k in [0u8, 13, 99, 255] {
            let err = refuse(edited(5..6, &[k]));
            assert_eq!(err, WireError::UnknownKind { got: k });
            assert_eq!(err.code(), ErrorCode::UnknownKind);
        }
        assert_eq!(Kind::try_from(99u8), Err(WireError::UnknownKind { got: 99 }));
        for k in Kind::ALL {
            assert_eq!(Kind::try_from(u8::from(k)), Ok(k));
        }
    }

    #[test]
    fn row_frames_whose_lengths_do_not_add_up_are_refused() {
        // From the header: PullRows not whole u64s, PushRows shorter than its prefix or not
        // whole words.
        for (kind, len) in [(Kind::PullRows, 4u32), (Kind::PullRows, 12), (Kind::PushRows, 4), (Kind::PushRows, 10)] {
            let mut bad = edited(5..6, &[kind as u8]);
            bad[24..28].copy_from_slice(&len.to_le_bytes());
            reseal(&mut bad, SECRET);
            assert!(matches!(refuse(bad), WireError::BadPayload { kind: k, .. } if k == kind), "{kind} {len}");
        }
        // From the payload: a count and dim that do not match the bytes.
        let msg = Message::PushRows {
            block: 1,
            clock: 2,
            dim: 2,
            ids: RowIds::from_vec(vec![4]),
            grads: Values::from_vec(vec![0.5, 0.25]),
        };
        let (head, payload) = codec().encode(3, &msg).unwrap();
        let h = codec().decode_header(&head).unwrap();
        assert_eq!(Message::decode(&h, payload.clone()).unwrap(), msg);
        for (at, word) in [(0, 2u32), (4, 3), (4, u32::MAX), (0, u32::MAX)] {
            let mut p = payload.to_vec();
            p[at..at + 4].copy_from_slice(&word.to_le_bytes());
            let err = Message::decode(&h, p.into()).unwrap_err();
            assert!(matches!(err, WireError::BadPayload { kind: Kind::PushRows, .. }), "{err}");
            assert_eq!(err.code(), ErrorCode::Malformed);
        }
        // An encoder refuses gradients that are not ids x dim.
        let wrong = Message::PushRows {
            block: 1,
            clock: 2,
            dim: 2,
            ids: RowIds::from_vec(vec![4, 5]),
            grads: Values::from_vec(vec![0.5, 0.25]),
        };
        assert!(matches!(codec().encode(3, &wrong), Err(WireError::BadPayload { kind: Kind::PushRows, .. })));
        let ids = RowIds::from_vec(vec![3, 1 << 63]);
        assert_eq!(ids.to_vec(), vec![3, 1 << 63]);
        assert_eq!((ids.len(), ids.get(1)), (2, 1 << 63));
        assert_eq!(format!("{ids:?}"), "RowIds(len=2, [3, 9223372036854775808])");
    }

    #[test]
    fn an_init_frame_carries_clock_zero() {
        let values = Values::from_vec(vec![1.0, 2.0]);
        let (head, payload) = codec().encode(3, &Message::Init { block: 4, values: values.clone() }).unwrap();
        let h = codec().decode_header(&head).unwrap();
        assert_eq!((h.kind, h.block, h.clock), (Kind::Init, 4, 0));
        assert_eq!(Message::decode(&h, payload.clone()).unwrap(), Message::Init { block: 4, values });
        let wrong = FrameHeader { clock: 5, ..h };
        assert!(matches!(Message::decode(&wrong, payload), Err(WireError::BadPayload { kind: Kind::Init, .. })));
    }

    #[test]
    fn a_push_pull_frame_carries_the_gradient_and_the_push_clock() {
        let values = Values::from_vec(vec![1.0, -2.0]);
        let msg = Message::PushPull { block: 3, clock: 5, values: values.clone(), reply: Dtype::F32 };
        let (head, payload) = Codec::default().encode(8, &msg).unwrap();
        // Kind 8, block 3, clock 5 (the push's), 8 payload bytes: the gradient as in a Push.
        assert_eq!((head[5], &head[16..28]), (8, &[3, 0, 0, 0, 5, 0, 0, 0, 8, 0, 0, 0][..]));
        assert_eq!(&payload[..], &[0, 0, 0x80, 0x3f, 0, 0, 0, 0xc0]);
        let h = Codec::default().decode_header(&head).unwrap();
        assert_eq!((h.kind, h.request_id, h.block, h.clock, h.f32_len()), (Kind::PushPull, 8, 3, 5, 2));
        assert!(h.kind.carries_f32() && !h.kind.is_empty_payload() && !h.kind.is_postcard());
        assert_eq!(Message::decode(&h, payload).unwrap(), msg);
        assert_eq!(Kind::PushPull.to_string(), "PushPull");
        // A payload that is not whole f32 values is refused from the header.
        let mut bad = edited(5..6, &[Kind::PushPull as u8]);
        bad[24..28].copy_from_slice(&7u32.to_le_bytes());
        reseal(&mut bad, SECRET);
        assert!(matches!(refuse(bad), WireError::BadPayload { kind: Kind::PushPull, .. }));
    }

    #[test]
    fn a_forward_frame_carries_the_worker_the_init_flag_and_the_received_bytes() {
        let values = Values::from_vec(vec![1.0, -2.0]);
        let msg = Message::Forward { block: 3, clock: 5, worker: 2, init: false, values: values.clone() };
        // Written apart: header, 8-byte prefix, then the values' own bytes (no copy).
        let (head, prefix, body) = Codec::default().encode_parts(8, &msg).unwrap();
        assert_eq!(body.as_ptr(), values.as_bytes().as_ptr(), "the payload is the values' bytes, not a copy");
        assert_eq!(prefix, Some([2, 0, 0, 0, 0, 0, 0, 0]));
        assert_eq!((head[5], &head[16..28]), (9, &[3, 0, 0, 0, 5, 0, 0, 0, 16, 0, 0, 0][..]));
        let (head2, payload) = Codec::default().encode(8, &msg).unwrap();
        assert_eq!(head2, head);
        assert_eq!(hex(&payload), "02 00 00 00 00 00 00 00 00 00 80 3f 00 00 00 c0");
        assert_eq!(
            hex(&head),
            "45 50 53 31 05 09 00 00 08 00 00 00 00 00 00 00 03 00 00 00 05 00 00 00 10 00 00 00 ac 1e 82 46"
        );
        let h = Codec::default().decode_header(&head).unwrap();
        assert_eq!((h.kind, h.request_id, h.block, h.clock, h.payload_len), (Kind::Forward, 8, 3, 5, 16));
        assert!(h.kind.carries_words() && !h.kind.carries_f32() && !h.kind.is_postcard());
        assert_eq!(Message::decode(&h, payload.clone()).unwrap(), msg);
        assert_eq!(Kind::Forward.to_string(), "Forward");
        // An init: flag 1 and clock 0; clock 5 with the flag is refused, so is a flag of 2.
        let init = Message::Forward { block: 3, clock: 0, worker: 2, init: true, values };
        let (ih, ip) = Codec::default().encode(8, &init).unwrap();
        let ih = Codec::default().decode_header(&ih).unwrap();
        assert_eq!(Message::decode(&ih, ip.clone()).unwrap(), init);
        let wrong = FrameHeader { clock: 5, ..ih };
        assert!(matches!(Message::decode(&wrong, ip.clone()), Err(WireError::BadPayload { kind: Kind::Forward, .. })));
        let mut two = ip.to_vec();
        two[4] = 2;
        assert!(matches!(Message::decode(&ih, two.into()), Err(WireError::BadPayload { kind: Kind::Forward, .. })));
        // Shorter than the prefix, or not whole words: refused from the header.
        for len in [0u32, 4, 10] {
            let mut bad = edited(5..6, &[Kind::Forward as u8]);
            bad[24..28].copy_from_slice(&len.to_le_bytes());
            reseal(&mut bad, SECRET);
            assert!(matches!(refuse(bad), WireError::BadPayload { kind: Kind::Forward, .. }), "{len}");
        }
        // The prefix alone (an empty block) is a valid frame.
        let empty = Message::Forward { block: 1, clock: 1, worker: 0, init: false, values: Values::default() };
        let (eh, ep) = Codec::default().encode(1, &empty).unwrap();
        assert_eq!(Message::decode(&Codec::default().decode_header(&eh).unwrap(), ep).unwrap(), empty);
    }

    #[test]
    fn flags_are_checked_against_the_kind() {
        let ok = |kind, bits| Flags::parse(kind, bits).unwrap();
        let bad = |kind, bits| {
            assert_eq!(Flags::parse(kind, bits), Err(WireError::BadFlags { got: bits }), "{kind} {bits:#x}")
        };
        assert_eq!(ok(Kind::Push, 1), Flags { dtype: Dtype::Bf16, ..Flags::default() });
        assert_eq!(ok(Kind::Pull, 2 << 2), Flags { reply: Dtype::F16, ..Flags::default() });
        assert_eq!(
            ok(Kind::PushPull, 1 | (1 << 2) | (1 << 4)),
            Flags { dtype: Dtype::Bf16, reply: Dtype::Bf16, sparse: true }
        );
        assert!(ok(Kind::Forward, 1 << 4).sparse);
        bad(Kind::Push, 3); // dtype code 3
        bad(Kind::Pull, 3 << 2);
        bad(Kind::Pull, 1); // a Pull carries no values
        bad(Kind::Push, 1 << 2); // a Push asks for none
        bad(Kind::Init, 1 << 4); // an Init is not a gradient
        bad(Kind::PullReply, 1 << 4);
        bad(Kind::Control, 1);
        bad(Kind::Push, 1 << 5); // reserved
        for kind in Kind::ALL {
            assert_eq!(ok(kind, 0), Flags::default());
        }
    }

    #[test]
    fn sparse_payloads_must_add_up() {
        let c = Codec::default();
        let msg = Message::Push { block: 1, clock: 2, values: Values::sparse(&[1, 5], &[0.5, -2.0], Dtype::Bf16) };
        let (head, payload) = c.encode(3, &msg).unwrap();
        assert_eq!(payload.len(), 4 + 2 * 4 + 2 * 2, "count, two positions, two bf16s");
        let h = c.decode_header(&head).unwrap();
        assert_eq!(Message::decode(&h, payload.clone()).unwrap(), msg);
        // One byte short, and a count that claims more than the payload holds.
        let short = FrameHeader { payload_len: h.payload_len - 2, ..h };
        assert!(matches!(
            Message::decode(&short, payload.slice(..payload.len() - 2)),
            Err(WireError::BadSparse { .. })
        ));
        let mut lying = payload.to_vec();
        lying[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(Message::decode(&h, lying.into()), Err(WireError::BadSparse { .. })));
        let empty = FrameHeader { payload_len: 0, ..h };
        assert!(matches!(Message::decode(&empty, Bytes::new()), Err(WireError::BadSparse { .. })));
        // An odd number of bf16 bytes is refused from the header alone.
        let odd = FrameHeader {
            kind: Kind::PullReply,
            flags: Flags { dtype: Dtype::Bf16, ..Flags::default() },
            payload_len: 3,
            ..h
        };
        let mut raw = c.encode_header(&odd);
        assert!(matches!(c.decode_header(&raw), Err(WireError::BadPayload { kind: Kind::PullReply, .. })));
        raw[6] = 0;
        assert!(c.decode_header(&raw).is_err(), "the checksum covers the flags");
    }

    #[test]
    fn nonzero_flags() {
        let err = refuse(edited(6..8, &[1, 0]));
        assert_eq!(err, WireError::BadFlags { got: 1 });
        assert_eq!(err.code(), ErrorCode::Malformed);
        assert_eq!(refuse(edited(6..8, &[0, 0x80])), WireError::BadFlags { got: 0x8000 });
    }

    #[test]
    fn too_large_is_detected_from_the_header_alone() {
        let mut h = edited(5..6, &[Kind::Push as u8]);
        h[24..28].copy_from_slice(&1028u32.to_le_bytes());
        reseal(&mut h, SECRET);
        // Only the 32 header bytes are in the buffer: refused, not "incomplete".
        let err = refuse(h);
        assert_eq!(err, WireError::TooLarge { len: 1028, max: 1024 });
        assert_eq!(err.code(), ErrorCode::TooLarge);
        // u32::MAX too (no overflow anywhere).
        h[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
        reseal(&mut h, SECRET);
        assert_eq!(refuse(h), WireError::TooLarge { len: u64::from(u32::MAX), max: 1024 });
        // Exactly the limit is fine.
        h[24..28].copy_from_slice(&1024u32.to_le_bytes());
        reseal(&mut h, SECRET);
        assert_eq!(codec().decode_header(&h).unwrap().payload_len, 1024);
    }

    #[test]
    fn encode_refuses_payloads_over_the_limit() {
        let push = Message::Push { block: 0, clock: 0, values: Values::from_vec(vec![0.0; 257]) };
        let err = codec().encode(1, &push).unwrap_err();
        assert_eq!(err, WireError::TooLarge { len: 1028, max: 1024 });
        let push = Message::Push { block: 0, clock: 0, values: Values::from_vec(vec![0.0; 256]) };
        assert_eq!(codec().encode(1, &push).unwrap().1.len(), 1024);
    }

    #[test]
    fn wrong_secret_is_bad_checksum() {
        let head = pull_header();
        let other = Codec::new(b"cluster-b", 1024);
        let err = other.decode_header(&head).unwrap_err();
        assert_eq!(err, WireError::BadChecksum);
        assert_eq!(err.code(), ErrorCode::BadChecksum);
        assert!(err.to_string().contains("wrong cluster secret"), "{err}");
        assert_eq!(Codec::default().decode_header(&head), Err(WireError::BadChecksum));
    }

    #[test]
    fn corrupt_header_is_bad_checksum() {
        for byte in 8..32 {
            let mut h = pull_header();
            h[byte] ^= 0x10;
            assert_eq!(refuse(h), WireError::BadChecksum, "byte {byte}");
        }
    }

    #[test]
    fn push_payload_of_7_bytes() {
        let mut h = edited(5..6, &[Kind::Push as u8]);
        h[24..28].copy_from_slice(&7u32.to_le_bytes());
        reseal(&mut h, SECRET);
        let err = refuse(h);
        assert!(matches!(err, WireError::BadPayload { kind: Kind::Push, .. }), "{err}");
        assert_eq!(err.code(), ErrorCode::Malformed);
        // Message::decode checks it as well, for headers it did not validate itself.
        let fh = FrameHeader {
            kind: Kind::PullReply,
            request_id: 1,
            block: 0,
            clock: 0,
            payload_len: 7,
            flags: Flags::default(),
        };
        let err = Message::decode(&fh, Bytes::from_static(&[0; 7])).unwrap_err();
        assert!(matches!(err, WireError::BadPayload { kind: Kind::PullReply, .. }), "{err}");
    }

    #[test]
    fn pull_and_push_ack_with_a_payload() {
        for kind in [Kind::Pull, Kind::PushAck] {
            let mut h = edited(5..6, &[kind as u8]);
            h[24..28].copy_from_slice(&4u32.to_le_bytes());
            reseal(&mut h, SECRET);
            assert!(matches!(refuse(h), WireError::BadPayload { kind: k, .. } if k == kind));
            let fh = FrameHeader { kind, request_id: 1, block: 0, clock: 0, payload_len: 4, flags: Flags::default() };
            assert!(matches!(Message::decode(&fh, Bytes::from_static(&[0; 4])), Err(WireError::BadPayload { .. })));
        }
    }

    #[test]
    fn payload_length_must_match_the_header() {
        let fh = FrameHeader {
            kind: Kind::Push,
            request_id: 1,
            block: 0,
            clock: 0,
            payload_len: 8,
            flags: Flags::default(),
        };
        assert!(matches!(Message::decode(&fh, Bytes::from_static(&[0; 4])), Err(WireError::BadPayload { .. })));
    }

    fn control_header(len: usize) -> FrameHeader {
        FrameHeader {
            kind: Kind::Control,
            request_id: 1,
            block: 0,
            clock: 0,
            payload_len: len as u32,
            flags: Flags::default(),
        }
    }

    #[test]
    fn garbage_postcard() {
        for garbage in [&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff][..], &[17], &[200, 1], &[0, 50, b'a'], &[]] {
            let err = Message::decode(&control_header(garbage.len()), Bytes::copy_from_slice(garbage)).unwrap_err();
            assert!(matches!(err, WireError::Postcard(_)), "{garbage:?}: {err}");
            assert_eq!(err.code(), ErrorCode::Malformed);
        }
        // An Error frame with an unknown code (11 is Forbidden, the last one).
        let fh = FrameHeader { kind: Kind::Error, payload_len: 2, ..control_header(0) };
        assert!(matches!(Message::decode(&fh, Bytes::from_static(&[12, 0])), Err(WireError::Postcard(_))));
        // Invalid UTF-8 in a string.
        let bad_utf8 = [11u8, 2, 0xc3, 0x28];
        let err = Message::decode(&control_header(4), Bytes::copy_from_slice(&bad_utf8)).unwrap_err();
        assert!(matches!(err, WireError::Postcard(_)), "{err}");
    }

    #[test]
    fn trailing_postcard_bytes() {
        // Heartbeat (tag 8) followed by a stray byte.
        let err = Message::decode(&control_header(2), Bytes::from_static(&[8, 0])).unwrap_err();
        assert!(matches!(err, WireError::BadPayload { kind: Kind::Control, .. }), "{err}");
        assert_eq!(Message::decode(&control_header(1), Bytes::from_static(&[8])).unwrap(), Control::Heartbeat.into());
    }

    #[test]
    fn postcard_accepts_long_varints() {
        // Documented in PROTOCOL.md §5: encoders write shortest varints, decoders accept longer ones.
        let done2 = Message::Control(Control::WorkerDone { rank: 2 });
        for p in [&[0x09, 0x02][..], &[0x09, 0x82, 0x00], &[0x89, 0x00, 0x82, 0x80, 0x00]] {
            let got = Message::decode(&control_header(p.len()), Bytes::copy_from_slice(p)).unwrap();
            assert_eq!(got, done2, "{p:02x?}");
        }
        // But not longer than the type allows (u32: 5 bytes).
        let p = [0x09, 0x82, 0x80, 0x80, 0x80, 0x80, 0x00];
        assert!(Message::decode(&control_header(p.len()), Bytes::copy_from_slice(&p)).is_err());
    }

    /// `BlockSnapshot { epoch: 7, state }` of a one-value block, by hand, with the f32
    /// byte strings given: values, then the optimizer's `m` and `v`.
    fn snapshot_bytes(values: &[u8], m: &[u8], v: &[u8]) -> Vec<u8> {
        let mut p = vec![18, 7, 0, 0, 0, 1, 0]; // tag 18, epoch 7, spec { id 0, tensor 0, offset 0, len 1, Dense }
        let bytes = |p: &mut Vec<u8>, f: &[u8]| {
            p.push(f.len() as u8);
            p.extend_from_slice(f);
        };
        bytes(&mut p, values);
        p.push(0); // opt.steps
        bytes(&mut p, m);
        bytes(&mut p, v);
        p.extend_from_slice(&[1, 0, 1, 1, 0, 0]); // clocks { pushed [0], active [true] }, pending [], rows None
        p
    }

    #[test]
    fn f32_byte_strings_must_be_whole_f32s() {
        use elasticps_core::block::{BlockState, LoggedPush};
        use elasticps_core::model::BlockSpec;
        use elasticps_core::optimizer::OptState;
        use elasticps_core::sync::Clocks;

        // The hand-made bytes are right when the lengths are.
        let one = [0, 0, 0x80, 0x3f];
        let state = BlockState {
            spec: BlockSpec::dense(0, 0, 0, 1),
            values: vec![1.0],
            opt: OptState { steps: 0, m: vec![1.0], v: vec![] },
            clocks: Clocks::new(1),
            pending: vec![],
            rows: None,
        };
        let good = snapshot_bytes(&one, &one, &[]);
        assert_eq!(postcard::to_allocvec(&Control::BlockSnapshot { epoch: 7, state: state.clone() }).unwrap(), good);
        let msg = Message::decode(&control_header(good.len()), Bytes::from(good)).unwrap();
        assert_eq!(msg, Message::Control(Control::BlockSnapshot { epoch: 7, state }));

        let refused = |p: Vec<u8>, what: &str| {
            let err = Message::decode(&control_header(p.len()), Bytes::from(p.clone())).unwrap_err();
            assert!(matches!(err, WireError::Postcard(_)), "{what}: {err}");
            assert_eq!(err.code(), ErrorCode::Malformed, "{what}");
            // (postcard drops the visitor's "a multiple of 4 bytes": its custom errors have no text.)
            // The same through a whole frame.
            let codec = Codec::default();
            let mut frame = BytesMut::new();
            let head = FrameHeader { request_id: 3, ..control_header(p.len()) };
            frame.extend_from_slice(&codec.encode_header(&head));
            frame.extend_from_slice(&p);
            assert!(matches!(codec.decode_message(&mut frame), Err(WireError::Postcard(_))), "{what}");
        };
        refused(snapshot_bytes(&one[..3], &one, &[]), "3 bytes of values");
        refused(snapshot_bytes(&[0, 0, 0x80, 0x3f, 0], &one, &[]), "5 bytes of values");
        refused(snapshot_bytes(&one, &one[..2], &[]), "2 bytes of m");
        refused(snapshot_bytes(&one, &one, &[1]), "1 byte of v");

        // A pending sum and a logged push, too.
        let mut p = snapshot_bytes(&one, &[], &[]);
        p.truncate(p.len() - 2);
        p.extend_from_slice(&[1, 0, 3, 0, 0, 0x80, 1, 0]); // pending [{ clock 0, sum: 3 bytes, count 1 }], rows None
        refused(p, "3 bytes of a pending sum");
        let delta = Control::BlockDelta { block: 3, epoch: 2, pushes: vec![LoggedPush::dense(1, 5, vec![1.0])] };
        let mut p = postcard::to_allocvec(&delta).unwrap();
        assert_eq!(p, [19, 3, 2, 1, 1, 5, 4, 0, 0, 0x80, 0x3f, 0]);
        p[6] = 3;
        p.remove(10);
        refused(p, "3 bytes of a gradient");
    }

    #[test]
    fn a_huge_announced_vector_does_not_allocate_it() {
        // DefineModel with a tensor list claiming 2^62 entries, in 10 bytes.
        let mut p = vec![3u8];
        p.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x3f]);
        let err = Message::decode(&control_header(p.len()), Bytes::from(p)).unwrap_err();
        assert!(matches!(err, WireError::Postcard(_)), "{err}");
    }

    #[test]
    fn error_replies_carry_the_code_and_text() {
        let err = WireError::BadVersion { got: 2 };
        let reply = err.to_reply();
        assert_eq!(reply.code, ErrorCode::BadVersion);
        assert!(reply.message.contains("version 2"), "{}", reply.message);
        let (head, payload) = codec().encode(5, &Message::Error(reply.clone())).unwrap();
        let h = codec().decode_header(&head).unwrap();
        assert_eq!(Message::decode(&h, payload).unwrap(), Message::Error(reply));
        assert_eq!(WireError::NotF32 { len: 3, dtype: Dtype::F32 }.code(), ErrorCode::Malformed);
        assert_eq!(WireError::Postcard("x".into()).code(), ErrorCode::Malformed);
    }

    #[test]
    fn messages_are_clear() {
        assert_eq!(
            WireError::TooLarge { len: 70_000_000, max: DEFAULT_MAX_PAYLOAD }.to_string(),
            "payload of 70000000 bytes exceeds the limit of 67108864 bytes"
        );
        assert_eq!(
            WireError::BadMagic { got: *b"GET " }.to_string(),
            "bad magic [47, 45, 54, 20]: not an elasticps frame (expected \"EPS1\")"
        );
        assert_eq!(WireError::UnknownKind { got: 99 }.to_string(), "unknown frame kind 99");
        assert_eq!(
            WireError::BadFlags { got: 1 }.to_string(),
            "flags 0x0001 are not valid for this kind of frame (bits 0-1: the values' dtype, 2-3: the reply's, 4: sparse)"
        );
        assert_eq!(
            WireError::BadPayload { kind: Kind::Pull, why: "must be empty, has 4 bytes".into() }.to_string(),
            "bad Pull payload: must be empty, has 4 bytes"
        );
        assert!(!format!("{:?}", Codec::new(b"hunter2", 1)).contains("hunter2"), "Debug hides the secret");
        let _ = hex(&[]);
    }
}

/// The worked examples of docs/PROTOCOL.md, pinned byte for byte; each test also checks that
/// the doc still shows those bytes, so the document cannot drift from the code.
mod golden {
    use elasticps_core::block::LoggedPush;
    use elasticps_core::model::{Init, Partition, TensorSpec};
    use elasticps_core::placement::{Placement, PlacementKind};
    use elasticps_wire::*;

    use crate::common::*;

    fn doc() -> String {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/PROTOCOL.md");
        std::fs::read_to_string(path).expect("docs/PROTOCOL.md")
    }

    #[track_caller]
    fn pinned(what: &str, got: &[u8], want: &str) {
        assert_eq!(hex(got), want, "{what}: the encoding changed; update docs/PROTOCOL.md and this test");
        assert!(doc().contains(want), "docs/PROTOCOL.md no longer shows the {what} bytes `{want}`");
    }

    #[test]
    fn pull_header_empty_secret() {
        let (head, payload) =
            Codec::default().encode(7, &Message::Pull { block: 3, clock: 5, reply: Dtype::F32 }).unwrap();
        assert!(payload.is_empty());
        pinned(
            "Pull header (empty secret)",
            &head,
            "45 50 53 31 05 04 00 00 07 00 00 00 00 00 00 00 03 00 00 00 05 00 00 00 00 00 00 00 73 31 92 f1",
        );
        assert_eq!(checksum(&head, b""), 0xf192_3173);
        assert!(doc().contains("0xf1923173"));
    }

    #[test]
    fn pull_header_with_secret() {
        let codec = Codec::new(b"s3cret", DEFAULT_MAX_PAYLOAD);
        let (head, _) = codec.encode(7, &Message::Pull { block: 3, clock: 5, reply: Dtype::F32 }).unwrap();
        pinned(
            "Pull header (secret s3cret)",
            &head,
            "45 50 53 31 05 04 00 00 07 00 00 00 00 00 00 00 03 00 00 00 05 00 00 00 00 00 00 00 1f 0c 49 59",
        );
        assert_eq!(checksum(&head, b"s3cret"), 0x5949_0c1f);
        assert!(doc().contains("0x59490c1f"));
    }

    #[test]
    fn push_frame() {
        let msg = Message::Push { block: 3, clock: 5, values: Values::from_vec(vec![1.0, -2.0]) };
        let (head, payload) = Codec::default().encode(8, &msg).unwrap();
        pinned(
            "Push header",
            &head,
            "45 50 53 31 05 02 00 00 08 00 00 00 00 00 00 00 03 00 00 00 05 00 00 00 08 00 00 00 c7 1b 73 a5",
        );
        pinned("Push payload", &payload, "00 00 80 3f 00 00 00 c0");
    }

    #[test]
    fn push_without_a_gradient() {
        // An empty payload: no gradient (a parameter unused in the step). The frame checks
        // take it, and the block's push counts it for the clock and applies nothing.
        let msg = Message::Push { block: 3, clock: 5, values: Values::from_vec(Vec::new()) };
        let (head, payload) = Codec::default().encode(9, &msg).unwrap();
        assert!(payload.is_empty());
        pinned(
            "Push without a gradient",
            &head,
            "45 50 53 31 05 02 00 00 09 00 00 00 00 00 00 00 03 00 00 00 05 00 00 00 00 00 00 00 6e 08 a0 05",
        );
        let h = Codec::default().decode_header(&head).unwrap();
        let back = Message::decode(&h, payload.clone()).unwrap();
        assert_eq!(back, msg);
        let Message::Push { values, .. } = back else { unreachable!() };
        assert_eq!(
            elasticps_core::block::Gradient::from_payload(&values.to_f32s()),
            elasticps_core::block::Gradient::None
        );
        // Forwarded to a backup: the 8 prefix bytes alone.
        let fwd = Message::Forward { block: 3, clock: 5, worker: 2, init: false, values: Values::from_vec(Vec::new()) };
        let (head, payload) = Codec::default().encode(9, &fwd).unwrap();
        assert_eq!((hex(&payload), &head[24..28]), ("02 00 00 00 00 00 00 00".to_string(), &[8, 0, 0, 0][..]));
        assert_eq!(Message::decode(&Codec::default().decode_header(&head).unwrap(), payload).unwrap(), fwd);
        // In a migration's delta: an empty f32 byte string.
        let delta = Control::BlockDelta { block: 3, epoch: 2, pushes: vec![LoggedPush::dense(1, 5, vec![])] };
        pinned("BlockDelta without a gradient", &postcard::to_allocvec(&delta).unwrap(), "13 03 02 01 01 05 00 00");
    }

    #[test]
    fn adamw_set_optimizer() {
        let kind = elasticps_core::optimizer::OptimizerKind::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8 };
        let optimizer = elasticps_core::optimizer::TensorOptimizer { kind, lr: 0.001, weight_decay: 0.01 };
        pinned(
            "SetOptimizer AdamW",
            &postcard::to_allocvec(&Control::SetOptimizer { tensor: 1, optimizer }).unwrap(),
            "1b 01 03 66 66 66 3f 77 be 7f 3f 77 cc 2b 32 6f 12 83 3a 0a d7 23 3c",
        );
    }

    #[test]
    fn push_pull_frame() {
        let msg =
            Message::PushPull { block: 3, clock: 5, values: Values::from_vec(vec![1.0, -2.0]), reply: Dtype::F32 };
        let (head, payload) = Codec::default().encode(8, &msg).unwrap();
        pinned(
            "PushPull header",
            &head,
            "45 50 53 31 05 08 00 00 08 00 00 00 00 00 00 00 03 00 00 00 05 00 00 00 08 00 00 00 08 8b 5c 48",
        );
        pinned("PushPull payload", &payload, "00 00 80 3f 00 00 00 c0");
    }

    #[test]
    fn pull_rows_frames() {
        let msg = Message::PullRows { block: 3, clock: 5, ids: RowIds::from_vec(vec![7, 1 << 40]), reply: Dtype::F32 };
        let (head, payload) = Codec::default().encode(8, &msg).unwrap();
        pinned(
            "PullRows header",
            &head,
            "45 50 53 31 05 0a 00 00 08 00 00 00 00 00 00 00 03 00 00 00 05 00 00 00 10 00 00 00 91 27 67 30",
        );
        pinned("PullRows payload", &payload, "07 00 00 00 00 00 00 00 00 00 00 00 00 01 00 00");
        let reply = Message::PullRowsReply { block: 3, clock: 5, values: Values::from_vec(vec![1.0, -2.0]) };
        let (head, payload) = Codec::default().encode(8, &reply).unwrap();
        pinned(
            "PullRowsReply header",
            &head,
            "45 50 53 31 05 0b 00 00 08 00 00 00 00 00 00 00 03 00 00 00 05 00 00 00 08 00 00 00 35 b2 b9 3e",
        );
        pinned("PullRowsReply payload", &payload, "00 00 80 3f 00 00 00 c0");
    }

    #[test]
    fn push_rows_frame() {
        let msg = Message::PushRows {
            block: 3,
            clock: 5,
            dim: 1,
            ids: RowIds::from_vec(vec![7, 9]),
            grads: Values::from_vec(vec![1.0, -2.0]),
        };
        let (head, payload) = Codec::default().encode(8, &msg).unwrap();
        pinned(
            "PushRows header",
            &head,
            "45 50 53 31 05 0c 00 00 08 00 00 00 00 00 00 00 03 00 00 00 05 00 00 00 20 00 00 00 4a ad 86 2d",
        );
        pinned(
            "PushRows payload",
            &payload,
            "02 00 00 00 01 00 00 00 07 00 00 00 00 00 00 00 09 00 00 00 00 00 00 00 00 00 80 3f 00 00 00 c0",
        );
        // An empty push: the count 0 and the dim, nothing else.
        let empty = Message::PushRows { block: 3, clock: 5, dim: 1, ids: RowIds::default(), grads: Values::default() };
        let (_, payload) = Codec::default().encode(8, &empty).unwrap();
        pinned("empty PushRows payload", &payload, "00 00 00 00 01 00 00 00");
    }

    #[test]
    fn hello_frame() {
        let codec = Codec::new(b"s3cret", DEFAULT_MAX_PAYLOAD);
        let credential = Credential::issue(b"s3cret", 42, PeerRole::Worker, 1);
        let (head, payload) = codec.encode(1, &Control::Hello { credential }.into()).unwrap();
        pinned(
            "Hello header",
            &head,
            "45 50 53 31 05 01 00 00 01 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 24 00 00 00 fe 7a 6d 7a",
        );
        pinned(
            "Hello payload",
            &payload,
            "0c 2a 00 01 e8 c6 c5 1d dd 91 b1 db 94 24 d2 2c 49 2c 38 fb 1a 54 59 6d e3 c3 fb 0d 58 d1 04 02 3c 83 42 47",
        );
    }

    #[test]
    fn error_frame() {
        let msg = Message::Error(ErrorReply::new(ErrorCode::UnknownBlock, "no block 9"));
        let (head, payload) = Codec::default().encode(8, &msg).unwrap();
        pinned(
            "Error header",
            &head,
            "45 50 53 31 05 06 00 00 08 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 0c 00 00 00 97 f1 33 15",
        );
        pinned("Error payload", &payload, "05 0a 6e 6f 20 62 6c 6f 63 6b 20 39");
    }

    #[test]
    fn control_payloads() {
        let cases = [
            (
                Control::Welcome {
                    node_id: 1,
                    num_workers: 2,
                    num_servers: 3,
                    credential: Credential::issue(b"s3cret", 42, PeerRole::Worker, 1),
                },
                "02 01 02 03 2a 00 01 e8 c6 c5 1d dd 91 b1 db 94 24 d2 2c 49 2c 38 fb 1a 54 59 6d e3 c3 fb 0d 58 d1 04 02 3c 83 42 47",
            ),
            (Control::Moved { block: 300, owner: 1, epoch: 2 }, "0e ac 02 01 02"),
            (
                Control::RegisterServer { data_addr: "10.0.0.5:7001".into() },
                "00 0d 31 30 2e 30 2e 30 2e 35 3a 37 30 30 31",
            ),
        ];
        for (c, want) in cases {
            pinned(&format!("{c:?}"), &postcard::to_allocvec(&c).unwrap(), want);
        }
    }

    #[test]
    fn migration_payloads() {
        let migrate = Control::Migrate { block: 3, to: 1, to_addr: "10.0.0.6:7001".into(), epoch: 2 };
        pinned(
            "Migrate example",
            &postcard::to_allocvec(&migrate).unwrap(),
            "11 03 01 0d 31 30 2e 30 2e 30 2e 36 3a 37 30 30 31 02",
        );
        let delta = Control::BlockDelta { block: 3, epoch: 2, pushes: vec![LoggedPush::dense(1, 5, vec![1.0, -2.0])] };
        pinned(
            "BlockDelta example",
            &postcard::to_allocvec(&delta).unwrap(),
            "13 03 02 01 01 05 08 00 00 80 3f 00 00 00 c0 00",
        );
    }

    #[test]
    fn layout_payload() {
        let tensors = vec![
            TensorSpec { name: "w".into(), shape: vec![2, 3], init: Init::Uniform { low: -1.0, high: 1.0 } },
            TensorSpec { name: "b".into(), shape: vec![3], init: Init::Zeros },
        ];
        let partition = Partition::new(tensors, 16).unwrap();
        let placement = Placement::initial(PlacementKind::RoundRobin, &partition, 2).unwrap();
        let servers = vec![ServerAddr { id: 0, addr: "h:1".into() }, ServerAddr { id: 1, addr: "h:2".into() }];
        let layout = Layout { partition, placement, servers, seed: 42, wire: Vec::new() };
        let bytes = postcard::to_allocvec(&Control::Layout(layout.clone())).unwrap();
        pinned(
            "Layout example",
            &bytes,
            "05 02 01 77 02 02 03 01 00 00 80 bf 00 00 80 3f 01 62 01 03 00 00 03 00 00 00 04 00 01 00 04 02 00 02 01 00 03 00 00 01 01 03 00 00 01 00 02 00 03 68 3a 31 01 03 68 3a 32 2a",
        );
        // Block 1 in bf16 (the balancer's --balance-compress): the list follows the seed.
        // A layout without it, as every layout before the field, decodes with none.
        let narrowed = Layout { wire: vec![Dtype::F32, Dtype::Bf16], ..layout.clone() };
        let with = postcard::to_allocvec(&Control::Layout(narrowed.clone())).unwrap();
        assert_eq!(with[..bytes.len()], bytes[..]);
        assert_eq!(with[bytes.len()..], [0x02, 0x00, 0x01]);
        assert_eq!(postcard::from_bytes::<Control>(&with).unwrap(), Control::Layout(narrowed));
        assert_eq!(postcard::from_bytes::<Control>(&bytes).unwrap(), Control::Layout(layout.clone()));
    }

    #[test]
    fn doc_lists_every_control_tag() {
        let doc = doc();
        // Every variant, in tag order.
        let names = Control::NAMES;
        for (i, name) in names.iter().enumerate() {
            let row = format!("| {i} | `{name}");
            assert!(doc.contains(&row), "docs/PROTOCOL.md lacks the Control tag row `{row}`");
        }
        let codes = [
            "Malformed",
            "BadVersion",
            "UnknownKind",
            "TooLarge",
            "BadChecksum",
            "UnknownBlock",
            "BadRequest",
            "NotReady",
            "ShuttingDown",
            "Internal",
            "Unauthenticated",
            "Forbidden",
        ];
        for (i, name) in codes.iter().enumerate() {
            let row = format!("| {i} | `{name}`");
            assert!(doc.contains(&row), "docs/PROTOCOL.md lacks the ErrorCode row `{row}`");
        }
    }
}

/// The handshake and credential test vectors of docs/PROTOCOL.md §1.4, checked against the
/// real code and against the formulas the document gives: a changed byte in the document,
/// or a changed encoding in the code, fails here.
mod handshake_vector {
    use std::collections::BTreeMap;

    use elasticps_wire::handshake::{ClientHandshake, HELLO_LEN, NONCE_LEN, PROOF_LEN, ServerHandshake, VERDICT_LEN};
    use elasticps_wire::{Credential, KeyId, PeerRole, WireError};
    use hmac::{Hmac, Mac};
    use sha2::Sha256;

    use crate::common::hex;

    /// Every name of the section's vectors.
    const NAMES: [&str; 18] = [
        "secret",
        "nonce_c",
        "nonce_s",
        "ClientHello",
        "ServerHello",
        "ClientProof",
        "Verdict",
        "worker_secret",
        "key1.ClientHello",
        "key1.ServerHello",
        "key1.ClientProof",
        "key1.Verdict",
        "wrong_secret",
        "wrong.ClientProof",
        "wrong.Verdict",
        "credential.input",
        "credential.mac",
        "credential",
    ];

    /// The vectors of §1.4: every line `NAME  hex hex ...` inside a fenced block of the
    /// section, by name. A name given twice, or a line that is not all hex bytes, fails.
    fn vectors() -> BTreeMap<String, Vec<u8>> {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/PROTOCOL.md");
        let doc = std::fs::read_to_string(path).expect("docs/PROTOCOL.md");
        let start =
            doc.find("\n### 1.4 Test vectors\n").expect("docs/PROTOCOL.md has a section `### 1.4 Test vectors`");
        let rest = &doc[start + 1..];
        let end = rest[4..].find("\n#").map_or(rest.len(), |e| e + 4);
        let mut out = BTreeMap::new();
        let mut fenced = false;
        for line in rest[..end].lines() {
            if line.starts_with("```") {
                fenced = !fenced;
                continue;
            }
            if !fenced {
                continue;
            }
            let mut words = line.split_whitespace();
            let Some(name) = words.next() else { continue };
            let bytes: Vec<u8> = words
                .map(|w| {
                    assert_eq!(w.len(), 2, "§1.4, `{name}`: `{w}` is not one hex byte");
                    u8::from_str_radix(w, 16).unwrap_or_else(|_| panic!("§1.4, `{name}`: `{w}` is not hex"))
                })
                .collect();
            assert!(out.insert(name.to_string(), bytes).is_none(), "§1.4 gives `{name}` twice");
        }
        for name in out.keys() {
            assert!(NAMES.contains(&name.as_str()), "§1.4 gives `{name}`, which this test does not check");
        }
        for name in NAMES {
            assert!(out.contains_key(name), "§1.4 lacks the vector `{name}`");
        }
        out
    }

    fn array<const N: usize>(v: &BTreeMap<String, Vec<u8>>, name: &str) -> [u8; N] {
        v[name].as_slice().try_into().unwrap_or_else(|_| panic!("§1.4 `{name}` has {} bytes, not {N}", v[name].len()))
    }

    /// `HMAC-SHA256(key, parts...)`, as the document defines the proofs.
    fn hmac(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
        let mut m = Hmac::<Sha256>::new_from_slice(key).unwrap();
        for p in parts {
            m.update(p);
        }
        m.finalize().into_bytes().into()
    }

    #[track_caller]
    fn same(v: &BTreeMap<String, Vec<u8>>, name: &str, got: &[u8]) {
        assert_eq!(hex(&v[name]), hex(got), "§1.4 `{name}` differs from what the code makes");
    }

    /// One whole handshake from the document's inputs: (ClientHello, ServerHello,
    /// ClientProof, Verdict, what the acceptor decided, what the dialer decided).
    #[allow(clippy::type_complexity)]
    fn run(
        key: KeyId,
        dialer_secret: &[u8],
        acceptor: ServerHandshake,
        nonce_c: [u8; NONCE_LEN],
    ) -> (
        [u8; HELLO_LEN],
        [u8; HELLO_LEN],
        [u8; PROOF_LEN],
        [u8; VERDICT_LEN],
        Result<KeyId, WireError>,
        Result<(), WireError>,
    ) {
        let (client, client_hello) = ClientHandshake::start_with(key, dialer_secret, nonce_c);
        let (server, server_hello) = acceptor.on_hello(&client_hello).unwrap();
        let (client, proof) = client.on_hello(&server_hello).unwrap();
        let (verdict, accepted) = server.on_proof(&proof);
        let dialer = client.on_verdict(&verdict);
        (client_hello, server_hello, proof, verdict, accepted, dialer)
    }

    #[test]
    fn the_cluster_key_vector_is_the_codes() {
        let v = vectors();
        let (secret, nonce_c, nonce_s) = (&v["secret"], array(&v, "nonce_c"), array(&v, "nonce_s"));
        assert_eq!(secret.as_slice(), b"s3cret", "§1.4 says the secret is `s3cret`");
        assert_eq!((nonce_c, nonce_s), ([7; NONCE_LEN], [9; NONCE_LEN]), "§1.4 says the nonces are 07s and 09s");
        let acceptor = ServerHandshake::new(secret, nonce_s);
        let (ch, sh, proof, verdict, accepted, dialer) = run(KeyId::Cluster, secret, acceptor, nonce_c);
        same(&v, "ClientHello", &ch);
        same(&v, "ServerHello", &sh);
        same(&v, "ClientProof", &proof);
        same(&v, "Verdict", &verdict);
        assert_eq!((accepted, dialer), (Ok(KeyId::Cluster), Ok(())));
        // The formulas of §1.1.
        assert_eq!(proof, hmac(secret, &[b"elasticps client", &nonce_c, &nonce_s]));
        assert_eq!(verdict[..4], [0, 0, 0, 0]);
        assert_eq!(verdict[4..], hmac(secret, &[b"elasticps server", &nonce_c, &nonce_s]));
    }

    #[test]
    fn the_worker_key_vector_is_the_codes() {
        let v = vectors();
        let (secret, worker_secret) = (&v["secret"], &v["worker_secret"]);
        let (nonce_c, nonce_s) = (array(&v, "nonce_c"), array(&v, "nonce_s"));
        assert_eq!(worker_secret.as_slice(), b"w0rker", "§1.4 says the worker secret is `w0rker`");
        let acceptor = ServerHandshake::new(secret, nonce_s).with_worker_secret(Some(worker_secret));
        let (ch, sh, proof, verdict, accepted, dialer) = run(KeyId::Worker, worker_secret, acceptor, nonce_c);
        same(&v, "key1.ClientHello", &ch);
        same(&v, "key1.ServerHello", &sh);
        same(&v, "key1.ClientProof", &proof);
        same(&v, "key1.Verdict", &verdict);
        assert_eq!((accepted, dialer), (Ok(KeyId::Worker), Ok(())));
        assert_eq!((ch[5], sh[5]), (1, 1), "key id 01 in both hellos");
        assert_eq!(proof, hmac(worker_secret, &[b"elasticps client", &nonce_c, &nonce_s]));
        assert_eq!(verdict[4..], hmac(worker_secret, &[b"elasticps server", &nonce_c, &nonce_s]));
        // The same worker at an acceptor without a worker secret: status 01.
        let without = ServerHandshake::new(secret, nonce_s);
        let (_, _, _, verdict, accepted, dialer) = run(KeyId::Worker, worker_secret, without, nonce_c);
        assert_eq!(verdict, [&[1u8][..], &[0; VERDICT_LEN - 1]].concat().as_slice());
        assert!(accepted.is_err());
        assert_eq!(dialer, Err(WireError::Unauthenticated { refused_by_peer: true }));
    }

    #[test]
    fn the_refused_vector_is_the_codes() {
        let v = vectors();
        let (secret, wrong) = (&v["secret"], &v["wrong_secret"]);
        let (nonce_c, nonce_s) = (array(&v, "nonce_c"), array(&v, "nonce_s"));
        assert_eq!(wrong.as_slice(), b"wrong", "§1.4 says the dialer holds `wrong`");
        let acceptor = ServerHandshake::new(secret, nonce_s);
        let (ch, sh, proof, verdict, accepted, dialer) = run(KeyId::Cluster, wrong, acceptor, nonce_c);
        same(&v, "ClientHello", &ch);
        same(&v, "ServerHello", &sh);
        same(&v, "wrong.ClientProof", &proof);
        same(&v, "wrong.Verdict", &verdict);
        assert_eq!(proof, hmac(wrong, &[b"elasticps client", &nonce_c, &nonce_s]));
        assert_eq!(accepted, Err(WireError::Unauthenticated { refused_by_peer: false }));
        assert_eq!(dialer, Err(WireError::Unauthenticated { refused_by_peer: true }));
    }

    #[test]
    fn the_credential_vector_is_the_codes() {
        let v = vectors();
        let secret = &v["secret"];
        let issued = Credential::issue(secret, 42, PeerRole::Worker, 1);
        // The MAC's message, as §1.3 defines it.
        let input = [&b"elasticps credential"[..], &42u64.to_le_bytes(), &[0], &1u32.to_le_bytes()].concat();
        same(&v, "credential.input", &input);
        same(&v, "credential.mac", &issued.mac);
        assert_eq!(issued.mac, hmac(secret, &[&input]));
        let encoded = postcard::to_allocvec(&issued).unwrap();
        same(&v, "credential", &encoded);
        // The document's bytes decode to the credential, which holds.
        let decoded: Credential = postcard::from_bytes(&v["credential"]).unwrap();
        assert_eq!(decoded, issued);
        assert!(decoded.verify_for(secret, 42).is_ok());
        assert!(decoded.verify(&v["worker_secret"]).is_err(), "a credential is made with the cluster secret only");
    }
}
