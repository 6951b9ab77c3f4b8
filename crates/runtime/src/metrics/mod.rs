//! Prometheus metrics of every role, served at `GET /metrics` by [`MetricsEndpoint`].
//!
//! Each node has its own [`Registry`] inside its role's metrics struct (no global
//! registry), so several nodes in one process stay apart:
//!
//! - [`ServerMetrics`]: read at scrape time from the counters the server keeps anyway
//!   (its blocks' [`elasticps_core::block::BlockStats`] and hold-time histograms, the same numbers as
//!   `GetStats`), so serving pushes and pulls takes no extra lock.
//! - [`WorkerMetrics`]: updated by the worker [`crate::client::Client`] once per round.
//! - [`SchedulerMetrics`]: set by the scheduler on its timeouts from its membership state.
//!
//! Names start with `elasticps_` and carry their unit (`_seconds`, `_bytes`, `_total`);
//! docs/MANUAL.md ("Metrics") lists them.

mod http;

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use elasticps_core::placement::ServerId;
use elasticps_core::sync::Clock;
use elasticps_wire::ClusterStatus;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};
use tokio::sync::watch;

pub use http::{CONTENT_TYPE, MAX_CONNECTIONS, MAX_REQUEST_BYTES, MetricsEndpoint, READ_TIMEOUT};

use elasticps_node::scheduler::BalanceLog;

/// Something an endpoint can serve: a node's metrics in the OpenMetrics text format.
pub trait Scrape: Send + Sync + 'static {
    /// Appends the exposition (ending with `# EOF`) to `out`.
    fn encode(&self, out: &mut String) -> std::fmt::Result;
}

/// Waits until the node registered; returns its id (server id or worker rank). No
/// deadline: a node that never registers fails on its own (its scheduler calls have
/// theirs), and the process ends with this wait.
async fn wait_node(node: &watch::Sender<Option<u32>>) -> Option<u32> {
    let mut rx = node.subscribe();
    let id = rx.wait_for(Option::is_some).await.ok()?;
    *id
}

// ---------------------------------------------------------------------------------------
// Server.

pub use elasticps_node::server::{ServerSnapshot, staleness_bound};

/// Reads a server's counters for a scrape.
pub trait ServerSource: Send + Sync + 'static {
    /// The counters now.
    fn snapshot(&self) -> ServerSnapshot;
}

/// The metric families of one server, read from its counters at scrape time.
pub struct ServerMetrics {
    registry: Registry,
    collector: Arc<ServerCollector>,
    node: watch::Sender<Option<u32>>,
}

impl std::fmt::Debug for ServerMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerMetrics").field("server", &*self.node.borrow()).finish_non_exhaustive()
    }
}

impl ServerMetrics {
    /// Metrics with no server behind them yet (every family at zero).
    pub fn new() -> Arc<ServerMetrics> {
        let collector = Arc::new(ServerCollector::default());
        let mut registry = Registry::default();
        registry.register_collector(Box::new(collector.clone()));
        Arc::new(ServerMetrics { registry, collector, node: watch::channel(None).0 })
    }

    /// Reads `source` from now on, for server `id`.
    pub fn attach(&self, id: ServerId, source: Arc<dyn ServerSource>) {
        *lock(&self.collector.source) = Some(source);
        self.node.send_replace(Some(id));
    }

    /// Waits until a server is attached; returns its id.
    pub async fn registered(&self) -> Option<ServerId> {
        wait_node(&self.node).await
    }

    /// The counters as the next scrape shows them.
    pub fn snapshot(&self) -> ServerSnapshot {
        self.collector.read()
    }
}

impl Scrape for ServerMetrics {
    fn encode(&self, out: &mut String) -> std::fmt::Result {
        prometheus_client::encoding::text::encode(out, &self.registry)
    }
}

#[derive(Default)]
struct ServerCollector {
    source: Mutex<Option<Arc<dyn ServerSource>>>,
    /// The counters of the last scrape: counters never go down, even if a block that
    /// is handed over meanwhile is counted twice in one snapshot.
    last: Mutex<ServerSnapshot>,
}

impl std::fmt::Debug for ServerCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerCollector").finish_non_exhaustive()
    }
}

impl ServerCollector {
    /// A fresh snapshot whose counters are at least those of the last one.
    fn read(&self) -> ServerSnapshot {
        let source = lock(&self.source).clone();
        let mut s = source.map(|src| src.snapshot()).unwrap_or_default();
        let mut last = lock(&self.last);
        let (t, l) = (&mut s.totals, &last.totals);
        for (v, prev) in [
            (&mut t.pushes, l.pushes),
            (&mut t.pulls, l.pulls),
            (&mut t.pulls_held, l.pulls_held),
            (&mut t.hold_us, l.hold_us),
            (&mut t.releases, l.releases),
            (&mut t.bytes_in, l.bytes_in),
            (&mut t.bytes_out, l.bytes_out),
            (&mut s.migrations_in, last.migrations_in),
            (&mut s.migrations_out, last.migrations_out),
            (&mut s.rows.counters.created, last.rows.counters.created),
            (&mut s.rows.counters.evicted, last.rows.counters.evicted),
            (&mut s.rows.counters.expired, last.rows.counters.expired),
            (&mut s.rows.counters.refused_grads, last.rows.counters.refused_grads),
            (&mut s.rows.counters.init_reads, last.rows.counters.init_reads),
        ] {
            *v = (*v).max(prev);
        }
        if s.hold.len() < last.hold.len() {
            s.hold.resize(last.hold.len(), 0);
        }
        for (now, prev) in s.hold.iter_mut().zip(&last.hold) {
            *now = (*now).max(*prev);
        }
        *last = s.clone();
        s
    }
}

/// The upper bounds (in seconds) of the hold-time histogram's buckets: every other
/// power of two of microseconds, from 0 to about 67 s. Each is exact for the server's
/// log2 histogram: bucket `2i` of the exposition sums its buckets up to `2i`.
const HOLD_BUCKETS: u32 = 14;

fn hold_buckets(counts: &[u64]) -> Vec<(f64, u64)> {
    let mut out = Vec::with_capacity(HOLD_BUCKETS as usize + 1);
    let mut taken = 0;
    for k in 0..HOLD_BUCKETS {
        let upto = (2 * k) as usize; // log2 buckets 0..=upto hold values <= 2^upto - 1 us
        let cumulative: u64 = counts.iter().take(upto + 1).sum();
        let le = ((1u64 << upto) - 1) as f64 / 1e6;
        out.push((le, cumulative - taken));
        taken = cumulative;
    }
    out.push((f64::INFINITY, counts.iter().sum::<u64>() - taken));
    out
}

impl Collector for ServerCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = self.read();
        let t = &s.totals;
        if let (Some(id), Some(sync)) = (s.server_id, s.sync) {
            let m =
                enc.encode_descriptor("elasticps_server", "This server and its sync policy.", None, MetricType::Info)?;
            let labels = [("server", id.to_string()), ("sync", sync.to_string())];
            encode_info(m, &labels)?;
        } else {
            enc.encode_descriptor("elasticps_server", "This server and its sync policy.", None, MetricType::Info)?;
        }
        let counters: [(&str, &str, Option<Unit>, u64); 5] = [
            ("elasticps_server_pushes", "Pushes applied (duplicates excluded).", None, t.pushes),
            ("elasticps_server_pulls", "Pulls answered.", None, t.pulls),
            ("elasticps_server_pulls_held", "Pulls the sync policy held before answering them.", None, t.pulls_held),
            ("elasticps_server_received", "Gradient payload bytes received in pushes.", Some(Unit::Bytes), t.bytes_in),
            ("elasticps_server_sent", "Parameter payload bytes sent in pull replies.", Some(Unit::Bytes), t.bytes_out),
        ];
        for (name, help, unit, value) in counters {
            let m = enc.encode_descriptor(name, help, unit.as_ref(), MetricType::Counter)?;
            encode_counter(m, value)?;
        }
        let r = &s.rows.counters;
        let more: [(&str, &str, u64); 8] = [
            ("elasticps_server_sync_releases", "Times held pulls were released (sync events).", t.releases),
            ("elasticps_server_migrations_in", "Blocks that arrived here by live migration.", s.migrations_in),
            ("elasticps_server_migrations_out", "Blocks handed over to another server.", s.migrations_out),
            ("elasticps_server_rows_created", "Embedding rows created in this server's row blocks.", r.created),
            ("elasticps_server_rows_evicted", "Embedding rows evicted by a table's memory bound.", r.evicted),
            ("elasticps_server_rows_expired", "Embedding rows evicted by a table's expiry (TTL).", r.expired),
            (
                "elasticps_server_row_grads_refused",
                "Row gradients dropped because their key was not admitted yet.",
                r.refused_grads,
            ),
            (
                "elasticps_server_row_init_reads",
                "Reads of rows that did not exist, answered with initial values.",
                r.init_reads,
            ),
        ];
        for (name, help, value) in more {
            let m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
            encode_counter(m, value)?;
        }
        let mut m = enc.encode_descriptor(
            "elasticps_server_pull_hold",
            "Time held pulls waited before their answer.",
            Some(&Unit::Seconds),
            MetricType::Histogram,
        )?;
        m.encode_histogram::<NoLabelSet>(t.hold_us as f64 / 1e6, s.hold.iter().sum(), &hold_buckets(&s.hold), None)?;
        let gauges: [(&str, &str, Option<Unit>, i64); 4] = [
            ("elasticps_server_blocks", "Blocks this server owns now.", None, s.blocks.into()),
            (
                "elasticps_server_live_rows",
                "Embedding rows that exist in the row blocks this server owns now.",
                None,
                s.rows.live_rows as i64,
            ),
            ("elasticps_server_owned", "Bytes of parameters this server owns now.", Some(Unit::Bytes), s.bytes as i64),
            (
                "elasticps_server_staleness_bound",
                "Staleness bound in force: bsp 0, ssp/lazy/pssp/dpssp s, adaptive its current s, asp -1.",
                None,
                s.staleness_bound,
            ),
        ];
        for (name, help, unit, value) in gauges {
            let mut m = enc.encode_descriptor(name, help, unit.as_ref(), MetricType::Gauge)?;
            m.encode_gauge(&value)?;
        }
        Ok(())
    }
}

fn encode_counter(mut m: prometheus_client::encoding::MetricEncoder, value: u64) -> std::fmt::Result {
    m.encode_counter::<NoLabelSet, _, u64>(&value, None)
}

fn encode_info(mut m: prometheus_client::encoding::MetricEncoder, labels: &[(&str, String)]) -> std::fmt::Result {
    m.encode_info(&labels)
}

// ---------------------------------------------------------------------------------------
// Worker.

/// The `server` label of a worker's per-server families.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServerLabel {
    /// The server id.
    pub server: u32,
}

/// The metric families of one worker, updated by its [`crate::client::Client`] once per
/// round (never per request).
pub struct WorkerMetrics {
    registry: Registry,
    node: watch::Sender<Option<u32>>,
    iterations: Counter,
    iteration_seconds: Histogram,
    wait_seconds: Family<ServerLabel, Counter<f64, AtomicU64>>,
    clock: Gauge,
}

impl std::fmt::Debug for WorkerMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerMetrics").field("rank", &*self.node.borrow()).finish_non_exhaustive()
    }
}

impl WorkerMetrics {
    /// Fresh metrics, for [`crate::client::ClientOptions::metrics`].
    pub fn new() -> Arc<WorkerMetrics> {
        let mut registry = Registry::default();
        let node = watch::channel(None).0;
        registry.register_collector(Box::new(RankInfo(node.subscribe())));
        let iterations = Counter::default();
        registry.register(
            "elasticps_worker_iterations",
            "Training iterations (rounds that pushed a clock)",
            iterations.clone(),
        );
        // 1 ms .. about 33 s.
        let iteration_seconds = Histogram::new(exponential_buckets(0.001, 2.0, 16));
        registry.register_with_unit(
            "elasticps_worker_iteration",
            "Time from one push round to the next (one iteration)",
            Unit::Seconds,
            iteration_seconds.clone(),
        );
        let wait_seconds = Family::<ServerLabel, Counter<f64, AtomicU64>>::default();
        registry.register_with_unit(
            "elasticps_worker_wait",
            "Time rounds waited for each server: from the round's start to that server's last reply",
            Unit::Seconds,
            wait_seconds.clone(),
        );
        let clock = Gauge::default();
        registry.register("elasticps_worker_clock", "The last clock this worker pushed", clock.clone());
        Arc::new(WorkerMetrics { registry, node, iterations, iteration_seconds, wait_seconds, clock })
    }

    /// This worker registered with rank `rank`.
    pub(crate) fn registered_as(&self, rank: u32) {
        self.node.send_replace(Some(rank));
    }

    /// Waits until the worker registered; returns its rank.
    pub async fn registered(&self) -> Option<u32> {
        wait_node(&self.node).await
    }

    /// A round pushes `clock`; `since_last` is the time since the previous push round.
    pub(crate) fn iteration(&self, clock: Clock, since_last: Option<Duration>) {
        self.iterations.inc();
        self.clock.set(clock.into());
        if let Some(d) = since_last {
            self.iteration_seconds.observe(d.as_secs_f64());
        }
    }

    /// A round waited `waited` for `server`.
    pub(crate) fn waited(&self, server: u32, waited: Duration) {
        self.wait_seconds.get_or_create(&ServerLabel { server }).inc_by(waited.as_secs_f64());
    }

    /// Iterations counted so far.
    pub fn iterations(&self) -> u64 {
        self.iterations.get()
    }
}

impl Scrape for WorkerMetrics {
    fn encode(&self, out: &mut String) -> std::fmt::Result {
        prometheus_client::encoding::text::encode(out, &self.registry)
    }
}

/// `elasticps_worker_info{rank="N"} 1` once the worker registered.
struct RankInfo(watch::Receiver<Option<u32>>);

impl std::fmt::Debug for RankInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("RankInfo").field(&*self.0.borrow()).finish()
    }
}

impl Collector for RankInfo {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let rank = *self.0.borrow();
        let m = enc.encode_descriptor("elasticps_worker", "This worker's rank.", None, MetricType::Info)?;
        match rank {
            Some(r) => encode_info(m, &[("rank", r.to_string())]),
            None => Ok(()),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Scheduler.

/// The `state` label of the scheduler's servers and workers gauges.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    /// The state.
    pub state: String,
}

/// The `action` label of the scaling events counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActionLabel {
    /// The action: `scale-out`, `joined`, `kept`, `scale-out-failed`, `scale-in`, `removed`.
    pub action: String,
}

/// Server states as `elasticps status` names them: always exported, 0 when empty.
const SERVER_STATES: [&str; 5] = ["registered", "joining", "serving", "draining", "gone"];

/// The scaling actions the scheduler records: exported from the start, at 0.
const SCALING_ACTIONS: [&str; 6] = ["scale-out", "joined", "kept", "scale-out-failed", "scale-in", "removed"];

/// The metric families of the scheduler, set on its timeouts ([`SchedulerMetrics::update`]).
pub struct SchedulerMetrics {
    registry: Registry,
    servers: Family<StateLabel, Gauge>,
    workers: Family<StateLabel, Gauge>,
    epoch: Gauge,
    stragglers: Gauge,
    migrations: Counter,
    scaling: Family<ActionLabel, Counter>,
    /// Scaling events and migrations already counted.
    seen: Mutex<(usize, u64)>,
}

impl std::fmt::Debug for SchedulerMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SchedulerMetrics").field("epoch", &self.epoch.get()).finish_non_exhaustive()
    }
}

impl SchedulerMetrics {
    /// Fresh metrics, for [`crate::scheduler::SchedulerOptions::metrics`].
    pub fn new() -> Arc<SchedulerMetrics> {
        let mut registry = Registry::default();
        let servers = Family::<StateLabel, Gauge>::default();
        registry.register(
            "elasticps_scheduler_servers",
            "Servers by state (registered, joining, serving, draining, gone)",
            servers.clone(),
        );
        let workers = Family::<StateLabel, Gauge>::default();
        registry.register("elasticps_scheduler_workers", "Workers by state (running, done)", workers.clone());
        let epoch = Gauge::default();
        registry.register("elasticps_scheduler_placement_epoch", "The placement's epoch", epoch.clone());
        let stragglers = Gauge::default();
        registry.register(
            "elasticps_scheduler_stragglers",
            "Servers the load model flags as stragglers now",
            stragglers.clone(),
        );
        let migrations = Counter::default();
        registry.register("elasticps_scheduler_migrations", "Block migrations completed", migrations.clone());
        let scaling = Family::<ActionLabel, Counter>::default();
        registry.register("elasticps_scheduler_scaling_events", "Scaling events, by action", scaling.clone());
        for state in SERVER_STATES {
            servers.get_or_create(&StateLabel { state: state.into() }).set(0);
        }
        for action in SCALING_ACTIONS {
            let _ = scaling.get_or_create(&ActionLabel { action: action.into() });
        }
        for state in ["running", "done"] {
            workers.get_or_create(&StateLabel { state: state.into() }).set(0);
        }
        Arc::new(SchedulerMetrics {
            registry,
            servers,
            workers,
            epoch,
            stragglers,
            migrations,
            scaling,
            seen: Mutex::new((0, 0)),
        })
    }

    /// Sets every family from the cluster's status and balancing history.
    pub fn update(&self, status: &ClusterStatus, log: &BalanceLog) {
        let mut by_state: Vec<(&str, i64)> = SERVER_STATES.iter().map(|s| (*s, 0)).collect();
        for s in &status.servers {
            match by_state.iter_mut().find(|(name, _)| *name == s.state) {
                Some((_, n)) => *n += 1,
                None => by_state.push((&s.state, 1)),
            }
        }
        for (state, n) in by_state {
            self.servers.get_or_create(&StateLabel { state: state.into() }).set(n);
        }
        let done = status.workers.iter().filter(|w| w.done).count() as i64;
        self.workers.get_or_create(&StateLabel { state: "running".into() }).set(status.workers.len() as i64 - done);
        self.workers.get_or_create(&StateLabel { state: "done".into() }).set(done);
        self.epoch.set(status.epoch as i64);
        self.stragglers.set(status.servers.iter().filter(|s| s.straggler).count() as i64);
        let mut seen = lock(&self.seen);
        for e in log.scaling.iter().skip(seen.0) {
            self.scaling.get_or_create(&ActionLabel { action: e.action.clone() }).inc();
        }
        seen.0 = seen.0.max(log.scaling.len());
        let migrations = u64::from(status.migrations);
        if migrations > seen.1 {
            self.migrations.inc_by(migrations - seen.1);
            seen.1 = migrations;
        }
    }
}

impl Scrape for SchedulerMetrics {
    fn encode(&self, out: &mut String) -> std::fmt::Result {
        prometheus_client::encoding::text::encode(out, &self.registry)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use elasticps_wire::{ServerStatus, WorkerStatus};

    use elasticps_core::stats::Histogram as LogHistogram;

    use super::*;
    use elasticps_core::block::BlockStats;
    use elasticps_core::rows::RowCounters;
    use elasticps_core::sync::SyncPolicy;
    use elasticps_node::scheduler::ScaleEvent;
    use elasticps_node::server::RowTotals;

    struct Fixed(Mutex<ServerSnapshot>);

    impl ServerSource for Fixed {
        fn snapshot(&self) -> ServerSnapshot {
            lock(&self.0).clone()
        }
    }

    fn text(m: &dyn Scrape) -> String {
        let mut out = String::new();
        m.encode(&mut out).expect("encodes");
        out
    }

    /// The value of the sample line that starts with `series ` (name and labels).
    fn sample(text: &str, series: &str) -> Option<f64> {
        text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn server_families_come_from_its_counters_and_never_go_down() {
        let m = ServerMetrics::new();
        let before = text(m.as_ref());
        assert_eq!(sample(&before, "elasticps_server_pushes_total"), Some(0.0), "{before}");
        assert!(!before.contains("elasticps_server_info{"), "no info before registration: {before}");

        let mut hold = LogHistogram::default();
        for us in [0, 3, 900, 2_000_000] {
            hold.record(us);
        }
        let snap = ServerSnapshot {
            server_id: Some(1),
            sync: Some(SyncPolicy::Ssp(3)),
            staleness_bound: 3,
            blocks: 4,
            bytes: 64,
            totals: BlockStats {
                pushes: 10,
                pulls: 9,
                pulls_held: 4,
                hold_us: 2_000_903,
                bytes_in: 640,
                ..Default::default()
            },
            hold: hold.buckets().to_vec(),
            migrations_in: 1,
            migrations_out: 2,
            rows: RowTotals {
                live_rows: 12,
                counters: RowCounters { created: 20, evicted: 6, expired: 2, refused_grads: 5, init_reads: 7 },
            },
        };
        let source = Arc::new(Fixed(Mutex::new(snap.clone())));
        m.attach(1, source.clone());
        let t = text(m.as_ref());
        assert!(t.contains(r#"elasticps_server_info{server="1",sync="ssp:3"} 1"#), "{t}");
        for (series, v) in [
            ("elasticps_server_pushes_total", 10.0),
            ("elasticps_server_pulls_total", 9.0),
            ("elasticps_server_pulls_held_total", 4.0),
            ("elasticps_server_received_bytes_total", 640.0),
            ("elasticps_server_migrations_in_total", 1.0),
            ("elasticps_server_migrations_out_total", 2.0),
            ("elasticps_server_rows_created_total", 20.0),
            ("elasticps_server_rows_evicted_total", 6.0),
            ("elasticps_server_rows_expired_total", 2.0),
            ("elasticps_server_row_grads_refused_total", 5.0),
            ("elasticps_server_row_init_reads_total", 7.0),
            ("elasticps_server_live_rows", 12.0),
            ("elasticps_server_blocks", 4.0),
            ("elasticps_server_owned_bytes", 64.0),
            ("elasticps_server_staleness_bound", 3.0),
            ("elasticps_server_pull_hold_seconds_count", 4.0),
            ("elasticps_server_pull_hold_seconds_sum", 2.000903),
            (r#"elasticps_server_pull_hold_seconds_bucket{le="0.0"}"#, 1.0),
            (r#"elasticps_server_pull_hold_seconds_bucket{le="0.000003"}"#, 2.0),
            (r#"elasticps_server_pull_hold_seconds_bucket{le="0.001023"}"#, 3.0),
            (r#"elasticps_server_pull_hold_seconds_bucket{le="1.048575"}"#, 3.0),
            (r#"elasticps_server_pull_hold_seconds_bucket{le="4.194303"}"#, 4.0),
            (r#"elasticps_server_pull_hold_seconds_bucket{le="+Inf"}"#, 4.0),
        ] {
            assert_eq!(sample(&t, series), Some(v), "{series} in\n{t}");
        }
        assert!(t.ends_with("# EOF\n"));

        // A snapshot that counts less (a block counted twice a moment ago) does not
        // lower any counter; gauges follow the source.
        let rows = RowTotals { live_rows: 3, counters: RowCounters { evicted: 1, ..snap.rows.counters } };
        *lock(&source.0) =
            ServerSnapshot { totals: BlockStats { pushes: 7, ..snap.totals }, blocks: 2, hold: vec![1], rows, ..snap };
        let t = text(m.as_ref());
        assert_eq!(sample(&t, "elasticps_server_rows_evicted_total"), Some(6.0), "{t}");
        assert_eq!(sample(&t, "elasticps_server_live_rows"), Some(3.0), "{t}");
        assert_eq!(sample(&t, "elasticps_server_pushes_total"), Some(10.0), "{t}");
        assert_eq!(sample(&t, "elasticps_server_pull_hold_seconds_count"), Some(4.0), "{t}");
        assert_eq!(sample(&t, r#"elasticps_server_pull_hold_seconds_bucket{le="+Inf"}"#), Some(4.0), "{t}");
        assert_eq!(sample(&t, "elasticps_server_blocks"), Some(2.0), "{t}");
    }

    #[test]
    fn staleness_bounds_per_policy() {
        assert_eq!(staleness_bound(SyncPolicy::Bsp, 5), 0);
        assert_eq!(staleness_bound(SyncPolicy::Asp, 5), -1);
        assert_eq!(staleness_bound(SyncPolicy::Ssp(2), 5), 2);
        assert_eq!(staleness_bound(SyncPolicy::Lazy(4), 5), 4);
        assert_eq!(staleness_bound(SyncPolicy::Pssp { s: 3, p: 0.5 }, 5), 3);
        assert_eq!(staleness_bound(SyncPolicy::Dpssp(6), 5), 6);
        assert_eq!(staleness_bound(SyncPolicy::Adaptive { min: 0, max: 8 }, 5), 5);
        assert_eq!(staleness_bound(SyncPolicy::Adaptive { min: 0, max: 8 }, 20), 8, "clamped as the policy is");
    }

    #[test]
    fn worker_families_count_rounds_and_waits_per_server() {
        let m = WorkerMetrics::new();
        m.registered_as(3);
        m.iteration(0, None);
        m.iteration(1, Some(Duration::from_millis(20)));
        m.waited(0, Duration::from_millis(5));
        m.waited(0, Duration::from_millis(5));
        m.waited(2, Duration::from_millis(250));
        let t = text(m.as_ref());
        assert!(t.contains(r#"elasticps_worker_info{rank="3"} 1"#), "{t}");
        assert_eq!(sample(&t, "elasticps_worker_iterations_total"), Some(2.0), "{t}");
        assert_eq!(sample(&t, "elasticps_worker_clock"), Some(1.0), "{t}");
        assert_eq!(sample(&t, "elasticps_worker_iteration_seconds_count"), Some(1.0), "{t}");
        assert_eq!(sample(&t, r#"elasticps_worker_iteration_seconds_bucket{le="0.032"}"#), Some(1.0), "{t}");
        assert_eq!(sample(&t, r#"elasticps_worker_iteration_seconds_bucket{le="0.016"}"#), Some(0.0), "{t}");
        assert_eq!(sample(&t, r#"elasticps_worker_wait_seconds_total{server="0"}"#), Some(0.01), "{t}");
        assert_eq!(sample(&t, r#"elasticps_worker_wait_seconds_total{server="2"}"#), Some(0.25), "{t}");
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        assert_eq!(rt.block_on(m.registered()), Some(3));
        let fresh = WorkerMetrics::new();
        let waited = rt.block_on(async { tokio::time::timeout(Duration::from_millis(20), fresh.registered()).await });
        assert!(waited.is_err(), "an unregistered worker has no rank: {waited:?}");
        assert_eq!(sample(&text(fresh.as_ref()), "elasticps_worker_iterations_total"), Some(0.0), "registries apart");
    }

    #[test]
    fn scheduler_families_follow_the_status_and_count_each_event_once() {
        let m = SchedulerMetrics::new();
        let t = text(m.as_ref());
        assert_eq!(sample(&t, r#"elasticps_scheduler_servers{state="serving"}"#), Some(0.0), "{t}");
        assert_eq!(sample(&t, r#"elasticps_scheduler_scaling_events_total{action="scale-in"}"#), Some(0.0), "{t}");
        let server = |id, state: &str, straggler| ServerStatus {
            id,
            addr: String::new(),
            state: state.into(),
            blocks: 0,
            bytes: 0,
            rate_bps: 0.0,
            confidence: 0.0,
            service_ms: 0.0,
            straggler,
        };
        let status = ClusterStatus {
            balance: "psld".into(),
            epoch: 7,
            migrations: 3,
            servers: vec![server(0, "serving", true), server(1, "serving", false), server(2, "draining", false)],
            workers: vec![
                WorkerStatus { rank: 0, clock: 5, iter_ms: 1.0, done: false },
                WorkerStatus { rank: 1, clock: 9, iter_ms: 1.0, done: true },
            ],
        };
        let event = |action: &str| ScaleEvent { at_s: 1.0, action: action.into(), server: None, reason: String::new() };
        let mut log = BalanceLog { scaling: vec![event("scale-out"), event("joined")], ..Default::default() };
        m.update(&status, &log);
        log.scaling.push(event("scale-out"));
        m.update(&status, &log);
        let t = text(m.as_ref());
        for (series, v) in [
            (r#"elasticps_scheduler_servers{state="serving"}"#, 2.0),
            (r#"elasticps_scheduler_servers{state="draining"}"#, 1.0),
            (r#"elasticps_scheduler_servers{state="gone"}"#, 0.0),
            (r#"elasticps_scheduler_workers{state="running"}"#, 1.0),
            (r#"elasticps_scheduler_workers{state="done"}"#, 1.0),
            ("elasticps_scheduler_placement_epoch", 7.0),
            ("elasticps_scheduler_stragglers", 1.0),
            ("elasticps_scheduler_migrations_total", 3.0),
            (r#"elasticps_scheduler_scaling_events_total{action="scale-out"}"#, 2.0),
            (r#"elasticps_scheduler_scaling_events_total{action="joined"}"#, 1.0),
        ] {
            assert_eq!(sample(&t, series), Some(v), "{series} in\n{t}");
        }
    }
}
