//! `elasticps bench hot-rows`: an embedding table whose ids follow a Zipf law, under
//! static placement and under the PSLD balancer, side by side (issue 21, item 5).
//!
//! Each run is a local cluster of child processes (a scheduler and `--servers` servers,
//! `--sync asp`, every server's link capped at `--mbps` Mbit/s each way, so that the
//! server holding the hot rows is the straggler) and `--workers` in-process workers. The
//! model is one table of `--rows` rows x 64 dims (`Constant(0)` rows, SGD with lr 1) cut
//! into row blocks of `--block-bytes`, placed best fit (the job's default placement:
//! equal blocks go to the servers in turn, so the hot block shares its server with cold
//! ones). Every step a worker draws
//! `--batch` ids from a Zipf law of exponent `--exponent` over the rows (row 0 the
//! hottest, as ids numbered by frequency are), pulls their unique rows, and pushes a
//! gradient of 1.0 to each. Under psld the balancer splits the hot row block
//! (`Decision::Split`) and moves the pieces as any block; under static nothing moves.
//!
//! Reported per run: steps per second of all workers over the whole run and over its
//! second half (after psld settled), the table's live blocks and the servers holding
//! them at the end (from worker 0's layout), and the exactly-once check: after the
//! workers stopped, every row touched is pulled, and it must hold exactly `-n` in every
//! value, `n` the pushes that named it (each push applied once, across splits and
//! migrations). The target, psld at least 1.5x static in steps per second, is
//! reported on the second halves, never enforced. `--quick` (CI) runs 10 s per mode and
//! checks the exactly-once property of both runs and that psld split the hot block.
//!
//! `--keys` (issue 36) runs the same on a hashed table ([`TableSpec::hashed`]) of as many
//! key ranges as the indexed table has blocks: the id of Zipf rank `k` is a random-looking
//! 64-bit key whose [`key_position`](elasticps_core::rows::key_position) is where row `k` falls in the indexed table, scaled
//! to the key space ([`rank_key`]), so the hot keys fall in the first key range as the hot
//! rows fall in the first row block, and psld splits and moves that range.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use elasticps_core::balance::BalanceMode;
use elasticps_core::model::TableSpec;
use elasticps_core::placement::PlacementKind;
use elasticps_core::rows::{KEY_POSITIONS, RowInit, SparseOptimizer};
use elasticps_launch::args::{JobArgs, NetArgs};
use elasticps_launch::process::Cluster;
use elasticps_report::table::markdown_table;
use elasticps_runtime::client::Client;
use elasticps_wire::Codec;
use serde::Serialize;

use crate::checks::{Check, Target, checks_and_targets_markdown};
use crate::error::Context as _;
use crate::pipeline::{Bench, Written};
use crate::roles;
use crate::sparse::{connect, wind_down};
use crate::transport::guarded;

/// Values per row.
const DIM: u32 = 64;
/// The target: psld's steps per second over static's, second halves.
pub const TARGET_RATIO: f64 = 1.5;

/// `elasticps bench hot-rows`.
#[derive(Args, Clone, Debug)]
pub struct HotRowsCmd {
    /// A short run for CI: 10 s per mode; fails only if a push was lost or applied twice,
    /// or if psld did not split the hot block.
    #[arg(long)]
    pub quick: bool,
    /// Servers of each run.
    #[arg(long, default_value_t = 4)]
    pub servers: u32,
    /// Workers of each run (in-process clients).
    #[arg(long, default_value_t = 2)]
    pub workers: u32,
    /// Rows of the table (64 dims each).
    #[arg(long, default_value_t = 1 << 16)]
    pub rows: u64,
    /// Ids drawn per step and worker (their unique rows are pulled and pushed).
    #[arg(long, default_value_t = 4096)]
    pub batch: usize,
    /// Exponent of the Zipf law of the ids.
    #[arg(long, default_value_t = 1.1)]
    pub exponent: f64,
    /// Seconds of each run (default 40, quick 10).
    #[arg(long)]
    pub seconds: Option<f64>,
    /// Every server's link cap, Mbit/s each way.
    #[arg(long, default_value_t = 80.0)]
    pub mbps: f64,
    /// Bytes of a row block (1 MiB: 4,096 rows).
    #[arg(long, default_value_t = 1 << 20)]
    pub block_bytes: usize,
    /// A hashed table keyed by random 64-bit keys, one key range per block of the
    /// indexed table, instead of the indexed table.
    #[arg(long)]
    pub keys: bool,
    /// Write bench-hot-rows.json, bench-hot-rows.md and the nodes' logs here.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Transport settings of the clusters.
    #[command(flatten)]
    pub net: NetArgs,
}

/// What is run, resolved from the flags.
#[derive(Clone, Debug, Serialize)]
struct Plan {
    quick: bool,
    servers: u32,
    workers: u32,
    rows: u64,
    batch: usize,
    exponent: f64,
    seconds: f64,
    mbps: f64,
    block_bytes: usize,
    keys: bool,
}

impl Plan {
    fn new(cmd: &HotRowsCmd) -> crate::Result<Self> {
        let seconds = cmd.seconds.unwrap_or(if cmd.quick { 10.0 } else { 40.0 });
        crate::error::ensure_flags!((2..=64).contains(&cmd.servers), "--servers must be from 2 to 64");
        crate::error::ensure_flags!((1..=16).contains(&cmd.workers), "--workers must be from 1 to 16");
        crate::error::ensure_flags!((64..=1 << 24).contains(&cmd.rows), "--rows must be from 64 to 2^24");
        crate::error::ensure_flags!((1..=1 << 20).contains(&cmd.batch), "--batch must be from 1 to 2^20");
        crate::error::ensure_flags!(cmd.exponent > 0.0 && cmd.exponent <= 4.0, "--exponent must be in (0, 4]");
        crate::error::ensure_flags!((2.0..=3600.0).contains(&seconds), "--seconds must be from 2 to 3600");
        crate::error::ensure_flags!(cmd.mbps.is_finite() && cmd.mbps >= 1.0, "--mbps must be at least 1");
        crate::error::ensure_flags!(
            cmd.block_bytes >= DIM as usize * 4 && cmd.block_bytes.is_multiple_of(DIM as usize * 4),
            "--block-bytes must be a whole number of 256-byte rows"
        );
        Ok(Plan {
            quick: cmd.quick,
            servers: cmd.servers,
            workers: cmd.workers,
            rows: cmd.rows,
            batch: cmd.batch,
            exponent: cmd.exponent,
            seconds,
            mbps: cmd.mbps,
            block_bytes: cmd.block_bytes,
            keys: cmd.keys,
        })
    }

    /// Blocks of the table as the job starts (row blocks, or key ranges).
    fn blocks_at_start(&self) -> u64 {
        self.rows.div_ceil((self.block_bytes / (DIM as usize * 4)) as u64)
    }

    fn table(&self) -> TableSpec {
        let table = if self.keys {
            let ranges = u32::try_from(self.blocks_at_start()).unwrap_or(u32::MAX);
            TableSpec::hashed("hot", DIM, ranges)
        } else {
            TableSpec::new("hot", self.rows, DIM)
        };
        table.with_init(RowInit::Constant(0.0)).with_optimizer(SparseOptimizer::Sgd { lr: 1.0 })
    }

    /// The id each Zipf rank is sent as: the row itself, or [`rank_key`].
    fn ids(&self) -> Vec<u64> {
        (0..self.rows).map(|k| if self.keys { rank_key(k, self.rows) } else { k }).collect()
    }
}

/// One mode's run.
#[derive(Clone, Debug, Serialize)]
struct Run {
    mode: String,
    /// Steps of all workers.
    steps: u64,
    /// Steps per second of all workers, whole run.
    steps_per_s: f64,
    /// Steps per second of all workers, second half of the run.
    late_steps_per_s: f64,
    /// Unique rows per step and worker, mean.
    rows_per_step: f64,
    /// Live blocks of the table at the end, and how many the model started with.
    blocks: usize,
    blocks_at_start: usize,
    /// Servers holding live blocks of the table at the end.
    servers_holding: usize,
    /// Rows the exactly-once check pulled, and those whose values were not `-pushes`.
    rows_checked: usize,
    rows_wrong: usize,
}

/// What the runs measured (the body of bench-hot-rows.json).
#[derive(Clone, Debug, Serialize)]
pub struct Body {
    plan: Plan,
    runs: Vec<Run>,
}

impl Body {
    fn run(&self, mode: &str) -> Option<&Run> {
        self.runs.iter().find(|r| r.mode == mode)
    }
}

/// `elasticps bench hot-rows`, its plan resolved.
pub struct HotRowsBench {
    cmd: HotRowsCmd,
    plan: Plan,
}

impl HotRowsBench {
    /// The plan of `cmd`.
    pub fn new(cmd: HotRowsCmd) -> crate::Result<Self> {
        Ok(HotRowsBench { plan: Plan::new(&cmd)?, cmd })
    }
}

impl Bench for HotRowsBench {
    const STEM: &'static str = "bench-hot-rows";
    type Body = Body;

    fn out(&self) -> Option<&Path> {
        self.cmd.out.as_deref()
    }

    // The sleep lets the launcher reap the last nodes: the benchmark pacing itself, no
    // rule of the job under test (clippy.toml keeps sleeps in the drivers' Timer otherwise).
    #[allow(clippy::disallowed_methods)]
    async fn run(&self) -> crate::Result<Body> {
        let (cmd, plan) = (&self.cmd, &self.plan);
        cmd.net.install()?;
        let log_dir = crate::log_dir(cmd.out.as_deref());
        let driver = crate::multi_thread_runtime(2)?;
        let cdf = Arc::new(zipf_cdf(plan.rows, plan.exponent));
        let result = async {
            let mut runs = Vec::new();
            for mode in [BalanceMode::Static, BalanceMode::Psld] {
                eprintln!("bench hot-rows: {mode}, {} s ...", plan.seconds);
                runs.push(run_mode(&driver, plan, &cmd.net, &log_dir, mode, &cdf).await?);
            }
            Ok::<_, crate::BenchError>(runs)
        }
        .await;
        driver.shutdown_background();
        tokio::time::sleep(Duration::from_millis(300)).await;
        Ok(Body { plan: plan.clone(), runs: result? })
    }

    fn verdicts(&self, body: &Body) -> (Vec<Check>, Vec<Target>) {
        (checks(body), targets(body))
    }

    fn markdown(&self, written: &Written<Body>) -> String {
        render(written)
    }
}

/// The cumulative Zipf law over `0..rows`: entry `k` is P(id <= k).
fn zipf_cdf(rows: u64, exponent: f64) -> Vec<f64> {
    let mut acc = 0.0;
    let mut cdf: Vec<f64> = (0..rows)
        .map(|k| {
            acc += 1.0 / ((k + 1) as f64).powf(exponent);
            acc
        })
        .collect();
    let total = acc;
    for c in &mut cdf {
        *c /= total;
    }
    cdf
}

/// `y = x ^ (x >> s)` solved for `x`.
fn unxorshift(y: u64, s: u32) -> u64 {
    let mut x = y;
    for _ in 0..64 / s + 1 {
        x = y ^ (x >> s);
    }
    x
}

/// The inverse of odd `m` modulo 2^64 (Newton's iteration: each step doubles the bits).
fn inverse(m: u64) -> u64 {
    let mut x = m;
    for _ in 0..5 {
        x = x.wrapping_mul(2u64.wrapping_sub(m.wrapping_mul(x)));
    }
    x
}

/// The key of Zipf rank `k` of `rows`: the 64-bit key whose
/// [`key_position`](elasticps_core::rows::key_position) is
/// `k * KEY_POSITIONS / rows` plus a pseudo-random offset under the next rank's (the
/// mix of `key_position` inverted), so the ranks keep their order in the key space.
fn rank_key(k: u64, rows: u64) -> u64 {
    let slot = KEY_POSITIONS / rows.max(1);
    let mut d = Draws(k ^ 0xfeed);
    let pos = k * slot + (d.next() * slot as f64) as u64 % slot.max(1);
    let low = (d.next() * (1u64 << 32) as f64) as u64;
    let mixed = (pos << 32) | low;
    // key_position: z = id + G; z = (z ^ z >> 30) * M1; z = (z ^ z >> 27) * M2; mixed = z ^ z >> 31.
    let z = unxorshift(mixed, 31).wrapping_mul(inverse(0x94d0_49bb_1331_11eb));
    let z = unxorshift(z, 27).wrapping_mul(inverse(0xbf58_476d_1ce4_e5b9));
    unxorshift(z, 30).wrapping_sub(0x9e37_79b9_7f4a_7c15)
}

/// A fixed stream of uniform draws in [0, 1) (splitmix64).
struct Draws(u64);

impl Draws {
    fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The unique ids of one step: `batch` draws from the law `cdf`, sorted.
fn step_ids(cdf: &[f64], batch: usize, draws: &mut Draws) -> Vec<u64> {
    let mut ids: Vec<u64> = (0..batch)
        .map(|_| {
            let u = draws.next();
            cdf.partition_point(|c| *c <= u).min(cdf.len() - 1) as u64
        })
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// What one worker did: its client (not finished), how often it pushed each row, and
/// when each of its steps ended.
struct Worked {
    client: Client,
    counts: Vec<u32>,
    ends: Vec<Instant>,
    rows: u64,
}

/// One worker: registers the table, then steps (pull the step's rows, push 1.0 to each)
/// until `until`.
async fn worker(
    addr: String,
    codec: Codec,
    plan: Plan,
    rank: u64,
    until: Instant,
    cdf: Arc<Vec<f64>>,
) -> crate::Result<Worked> {
    let mut client = connect(addr, codec).await?;
    client
        .register_model_with_tables(Vec::new(), Vec::new(), vec![plan.table()])
        .await
        .context("registering the table")?;
    let (table, _) =
        client.table("hot").ok_or_else(|| crate::BenchError::Failed("the table is not in the layout".into()))?;
    let mut draws = Draws(0x5eed ^ (rank << 32));
    let keys = plan.ids();
    let mut counts = vec![0u32; plan.rows as usize];
    let (mut ends, mut rows, mut out) = (Vec::new(), 0u64, Vec::new());
    let mut clock = 0;
    while Instant::now() < until {
        let ranks = step_ids(&cdf, plan.batch, &mut draws);
        let ids: Vec<u64> = ranks.iter().map(|k| keys[*k as usize]).collect();
        out.resize(ids.len() * DIM as usize, 0.0);
        client.pull_rows(clock, table, &ids, &mut out).await.with_context(|| format!("pull_rows at clock {clock}"))?;
        let grads = vec![1.0f32; ids.len() * DIM as usize];
        client.push_rows(clock, table, &ids, &grads).await.with_context(|| format!("push_rows at clock {clock}"))?;
        for k in &ranks {
            counts[*k as usize] += 1;
        }
        rows += ids.len() as u64;
        clock += 1;
        ends.push(Instant::now());
    }
    Ok(Worked { client, counts, ends, rows })
}

/// One mode: the cluster, the workers for `plan.seconds`, the exactly-once check.
async fn run_mode(
    driver: &tokio::runtime::Runtime,
    plan: &Plan,
    net: &NetArgs,
    log_dir: &Path,
    mode: BalanceMode,
    cdf: &Arc<Vec<f64>>,
) -> crate::Result<Run> {
    let tag = format!("hot-rows {mode}");
    let job = JobArgs {
        servers: plan.servers,
        workers: plan.workers,
        sync: "asp".parse()?,
        optimizer: "sgd".parse()?,
        placement: PlacementKind::BestFit,
        block_bytes: plan.block_bytes,
        balance: mode,
        min_servers: Some(plan.servers),
        max_servers: Some(plan.servers),
        server_bandwidth: (0..plan.servers).map(|s| (s, plan.mbps)).collect(),
        ..JobArgs::default()
    };
    let mut cluster = Cluster::new(log_dir)?;
    let env = [("ELASTICPS_SECRET", net.secret.as_str())];
    let addr = roles::scheduler(&mut cluster, &job, net, &format!("scheduler {tag}"), &env).await?;
    for s in 0..plan.servers {
        roles::server(&mut cluster, &addr, "127.0.0.1:0", net, &format!("server {s} {tag}"), &env)?;
    }
    let start = Instant::now();
    let until = start + Duration::from_secs_f64(plan.seconds);
    let tasks: Vec<_> = (0..plan.workers)
        .map(|w| driver.spawn(worker(addr.clone(), net.codec(), plan.clone(), u64::from(w), until, Arc::clone(cdf))))
        .collect();
    let result = guarded(&mut cluster, async {
        let mut done = Vec::new();
        for t in tasks {
            done.push(t.await.context("a worker panicked")??);
        }
        check(plan, &mode.to_string(), start, done).await
    })
    .await
    .with_context(|| tag.clone());
    wind_down(&mut cluster).await;
    result
}

/// The run's figures, and the exactly-once check by worker 0 (then every worker finishes).
async fn check(plan: &Plan, mode: &str, start: Instant, mut done: Vec<Worked>) -> crate::Result<Run> {
    let mut counts = vec![0u32; plan.rows as usize];
    for w in &done {
        for (c, n) in counts.iter_mut().zip(&w.counts) {
            *c += n;
        }
    }
    let ends: Vec<Instant> = done.iter().flat_map(|w| w.ends.iter().copied()).collect();
    let last = ends.iter().max().copied().unwrap_or(start);
    let secs = last.duration_since(start).as_secs_f64().max(1e-9);
    let half = start + Duration::from_secs_f64(secs / 2.0);
    let steps = ends.len() as u64;
    let late = ends.iter().filter(|e| **e > half).count() as f64 / (secs / 2.0);
    let rows: u64 = done.iter().map(|w| w.rows).sum();
    let blocks_at_start = plan.blocks_at_start() as usize;
    // Every row touched, pulled after every push was acknowledged.
    let touched: Vec<u64> = (0..plan.rows).filter(|r| counts[*r as usize] > 0).collect();
    let keys = plan.ids();
    let touched_ids: Vec<u64> = touched.iter().map(|k| keys[*k as usize]).collect();
    let clock = done[0].ends.len() as u32;
    let w0 = &mut done[0].client;
    let (table, _) = w0.table("hot").ok_or_else(|| crate::BenchError::Failed("the table is gone".into()))?;
    let mut values = vec![0f32; touched.len() * DIM as usize];
    for (ids, out) in touched_ids.chunks(4096).zip(values.chunks_mut(4096 * DIM as usize)) {
        w0.pull_rows(clock, table, ids, out).await.context("pulling the touched rows")?;
    }
    let rows_wrong = touched
        .iter()
        .zip(values.chunks_exact(DIM as usize))
        .filter(|(r, v)| v.iter().any(|x| *x != -(counts[**r as usize] as f32)))
        .count();
    let (blocks, servers_holding) = w0.layout().map_or((0, 0), |l| {
        let live = l.partition.table_blocks(table);
        let mut holders: Vec<u32> = live.iter().filter_map(|b| l.placement.owner(b.id)).collect();
        holders.sort_unstable();
        holders.dedup();
        (live.len(), holders.len())
    });
    for w in done {
        w.client.finish().await.context("finishing")?;
    }
    Ok(Run {
        mode: mode.to_string(),
        steps,
        steps_per_s: steps as f64 / secs,
        late_steps_per_s: late,
        rows_per_step: rows as f64 / steps.max(1) as f64,
        blocks,
        blocks_at_start,
        servers_holding,
        rows_checked: touched.len(),
        rows_wrong,
    })
}

/// Both runs applied every push exactly once; psld split the hot block (quick only).
fn checks(body: &Body) -> Vec<Check> {
    let mut out: Vec<Check> = body
        .runs
        .iter()
        .map(|r| Check {
            what: format!("{}: every touched row holds exactly its pushes (each applied once)", r.mode),
            measured: format!("{} of {} rows wrong", r.rows_wrong, r.rows_checked),
            pass: Some(r.rows_wrong == 0 && r.rows_checked > 0),
        })
        .collect();
    if body.plan.quick
        && let Some(p) = body.run("psld")
    {
        out.push(Check {
            what: "psld split the hot row block".into(),
            measured: format!("{} live blocks, from {}", p.blocks, p.blocks_at_start),
            pass: Some(p.blocks > p.blocks_at_start),
        });
    }
    out
}

/// psld at least 1.5x static in steps per second (second halves).
fn targets(body: &Body) -> Vec<Target> {
    let (s, p) = (body.run("static"), body.run("psld"));
    vec![Target::compare(
        format!("psld at least {TARGET_RATIO}x static in steps per second (second half of each run)"),
        (p.map(|r| r.late_steps_per_s), s.map(|r| r.late_steps_per_s)),
        |a, b| format!("{:.2}x ({a:.1} vs {b:.1} steps/s)", a / b.max(1e-9)),
        |a, b| a >= TARGET_RATIO * b,
    )]
}

fn render(out: &Written<Body>) -> String {
    let headers = [
        "mode",
        "steps/s",
        "steps/s, 2nd half",
        "rows/step",
        "table blocks (start -> end)",
        "servers holding them",
        "rows checked",
        "rows wrong",
    ];
    let rows: Vec<Vec<String>> = out
        .body
        .runs
        .iter()
        .map(|r| {
            vec![
                r.mode.clone(),
                format!("{:.1}", r.steps_per_s),
                format!("{:.1}", r.late_steps_per_s),
                format!("{:.0}", r.rows_per_step),
                format!("{} -> {}", r.blocks_at_start, r.blocks),
                r.servers_holding.to_string(),
                r.rows_checked.to_string(),
                r.rows_wrong.to_string(),
            ]
        })
        .collect();
    let p = &out.body.plan;
    let mut s = out.heading("bench hot-rows");
    if p.keys {
        s.push_str(&format!(
            "Keyed: a hashed table of {} key ranges, the Zipf ranks sent as random 64-bit keys whose positions \
             keep the ranks' order (the hot keys in the first range); the rest as below.\n\n",
            p.blocks_at_start()
        ));
    }
    s.push_str(&format!(
        "{} servers capped at {} Mbit/s each way, {} in-process workers, asp; one table of {} rows x {DIM} in \
         blocks of {} rows, best fit (the job's default: block k on server k mod servers); {} Zipf({}) ids a step; {} s per mode.\n\n",
        p.servers,
        p.mbps,
        p.workers,
        p.rows,
        p.block_bytes / (DIM as usize * 4),
        p.batch,
        p.exponent,
        p.seconds
    ));
    s.push_str(&markdown_table(&headers, &rows));
    s.push_str(
        "\nA step pulls its unique rows and pushes 1.0 to each. Rows checked: every row touched, pulled after the \
         workers stopped; wrong: any value other than minus the number of pushes that named the row.\n",
    );
    s.push_str(&checks_and_targets_markdown(&out.checks, &out.targets));
    s
}

#[cfg(test)]
mod tests {
    use elasticps_core::rows::key_position;

    use super::*;

    #[test]
    fn a_ranks_key_falls_where_its_row_falls_in_the_key_space() {
        let rows = 1 << 16;
        let keys: Vec<u64> = (0..rows).map(|k| rank_key(k, rows)).collect();
        for (k, key) in keys.iter().enumerate() {
            assert_eq!(key_position(*key) >> 16, k as u64, "rank {k}: key {key:#x}");
        }
        // Random-looking 64-bit keys, every one distinct.
        assert!(keys.iter().filter(|k| **k > 1 << 63).count() > 30_000);
        let mut sorted = keys.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), keys.len());
    }

    #[test]
    fn zipf_ids_are_in_range_and_the_first_rows_are_the_hottest() {
        let cdf = zipf_cdf(1000, 1.1);
        assert!((cdf[999] - 1.0).abs() < 1e-12);
        let mut draws = Draws(1);
        let mut hits = [0u32; 1000];
        for _ in 0..50 {
            for id in step_ids(&cdf, 1000, &mut draws) {
                hits[id as usize] += 1;
            }
        }
        // Row 0 is in every step; rows past 500 are in few.
        assert_eq!(hits[0], 50);
        assert!(hits[500..].iter().map(|h| *h as f64).sum::<f64>() / 500.0 < 10.0);
    }
}
