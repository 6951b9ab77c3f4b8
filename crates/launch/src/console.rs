//! What the operator sees of a local job and what its run records: one progress bar per
//! worker and the lines above them ([`Bars`]), the nodes' events turned into a
//! [`RunOutcome`] ([`Recorder`]), and where to scrape each node's metrics.

use std::collections::BTreeMap;

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

use elasticps_report::CurvePoint;
use elasticps_run::outcome::RunOutcome;
use elasticps_runtime::events::Event;

/// Keys of a `log` event that the runner reads itself; every other key is kept in the
/// curve point's `metrics`.
const READ_KEYS: [&str; 4] = ["loss", "accuracy", "test_accuracy", "total"];

/// Turns the event lines of a job's nodes into its [`RunOutcome`], and moves the progress
/// bars.
pub struct Recorder<'b> {
    /// What the events so far recorded.
    pub out: RunOutcome,
    bars: &'b Bars,
    eval_rank: Option<u32>,
}

impl<'b> Recorder<'b> {
    /// A recorder that draws on `bars`.
    pub fn new(bars: &'b Bars) -> Self {
        Self { out: RunOutcome::default(), bars, eval_rank: None }
    }

    /// Records one event, `t_s` seconds into the run; returns the rank of the worker that
    /// sent it, if it is a worker's joining or progress.
    pub fn event(&mut self, t_s: f64, event: Event) -> Option<u32> {
        let mut named = None;
        match event {
            Event::Joined { rank } => named = Some(rank),
            Event::Progress { rank, iteration, total, loss } => {
                named = Some(rank);
                self.bars.update(rank, iteration.into(), Some(total.into()), Some(f64::from(loss)));
                self.out.curve.push(CurvePoint {
                    t_s,
                    iteration: iteration.into(),
                    rank,
                    loss: Some(loss.into()),
                    test_accuracy: None,
                    metrics: BTreeMap::new(),
                });
            }
            Event::Eval { rank, iteration, accuracy, loss } => {
                if self.eval_rank.is_none_or(|r| rank <= r) {
                    (self.eval_rank, self.out.final_eval) = (Some(rank), Some((accuracy, loss)));
                }
                self.out.curve.push(CurvePoint {
                    t_s,
                    iteration: iteration.into(),
                    rank,
                    loss: None,
                    test_accuracy: Some(accuracy.into()),
                    metrics: BTreeMap::new(),
                });
            }
            Event::Log { rank, step, metrics } => {
                named = Some(rank);
                let loss = metrics.get("loss").copied();
                let total = metrics.get("total").copied().filter(|t| t.is_finite() && *t >= 0.0);
                self.bars.update(rank, step, total.map(|t| t as u64), loss);
                let accuracy = metrics.get("accuracy").or_else(|| metrics.get("test_accuracy")).copied();
                if let Some(acc) = accuracy
                    && self.eval_rank.is_none_or(|r| rank <= r)
                {
                    let test_loss = metrics.get("test_loss").copied().unwrap_or(f64::NAN);
                    (self.eval_rank, self.out.final_eval) = (Some(rank), Some((acc as f32, test_loss as f32)));
                }
                let metrics = metrics.into_iter().filter(|(k, _)| !READ_KEYS.contains(&k.as_str())).collect();
                self.out.curve.push(CurvePoint { t_s, iteration: step, rank, loss, test_accuracy: accuracy, metrics });
            }
            Event::WorkerDone(w) => {
                self.out.workers.insert(w.rank, w);
            }
            Event::ServerStats(s) => {
                self.out.servers.insert(s.server_id, s);
            }
            Event::Balance(log) => self.out.balance = Some(log),
            Event::Listening { .. } => {}
            Event::Waiting { what } => self.bars.println(false, &what),
            Event::Metrics { .. } => {}
        }
        named
    }
}

/// One progress bar per worker rank, and the lines printed above them.
pub struct Bars {
    multi: MultiProgress,
    bars: std::cell::RefCell<BTreeMap<u32, ProgressBar>>,
}

impl Bars {
    /// Bars on stderr, or none at all if `quiet`.
    pub fn new(quiet: bool) -> Self {
        let target = if quiet { ProgressDrawTarget::hidden() } else { ProgressDrawTarget::stderr() };
        Self { multi: MultiProgress::with_draw_target(target), bars: Default::default() }
    }

    /// Moves rank `rank`'s bar to `position` (of `total`, if known), showing `loss`.
    pub fn update(&self, rank: u32, position: u64, total: Option<u64>, loss: Option<f64>) {
        let mut bars = self.bars.borrow_mut();
        let bar = bars.entry(rank).or_insert_with(|| {
            let b = self.multi.add(ProgressBar::new(total.unwrap_or(0)));
            b.set_style(
                ProgressStyle::with_template(
                    "worker {prefix:>2} [{bar:30.cyan/blue}] {pos:>6}/{len} it  {per_sec:>10}  loss {msg}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            b.set_prefix(rank.to_string());
            b
        });
        if let Some(total) = total {
            bar.set_length(total);
        }
        bar.set_position(position);
        if let Some(loss) = loss {
            bar.set_message(format!("{loss:.4}"));
        }
    }

    /// Prints `line` on stdout (or stderr) above the bars, without garbling them.
    pub fn println(&self, stderr: bool, line: &str) {
        self.multi.suspend(|| {
            use std::io::Write;
            if stderr {
                let _ = writeln!(std::io::stderr().lock(), "{line}");
            } else {
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "{line}");
                let _ = out.flush();
            }
        });
    }

    /// Leaves every bar where it is.
    pub fn clear(&self) {
        for b in self.bars.borrow().values() {
            b.finish();
        }
    }
}

/// Where to scrape each node (`--metrics`): printed once every node started reports its
/// address, then one line per node that joins later (a server the scheduler launched).
pub(crate) struct ScrapeList {
    enabled: bool,
    expected: usize,
    nodes: Vec<(String, String)>,
    printed: bool,
}

impl ScrapeList {
    /// A list of `expected` nodes, printed if `enabled`.
    pub(crate) fn new(enabled: bool, expected: usize) -> Self {
        Self { enabled, expected, nodes: Vec::new(), printed: false }
    }

    /// Lists `node`, scraped at `addr` (printed with the others once every node started
    /// reported, at once after that).
    pub(crate) fn add(&mut self, node: String, addr: String) {
        if !self.enabled {
            return;
        }
        let url = format!("http://{addr}/metrics");
        if self.printed {
            println!("metrics: {node} {url}");
            return;
        }
        self.nodes.push((node, url));
        if self.nodes.len() >= self.expected {
            // scheduler first, then servers and workers by id.
            let key = |n: &str| {
                let (role, id) = n.split_once(' ').unwrap_or((n, ""));
                let order = match role {
                    "scheduler" => 0,
                    "server" => 1,
                    _ => 2,
                };
                (order, id.parse::<u32>().unwrap_or(0))
            };
            self.nodes.sort_by_key(|(n, _)| key(n));
            let list: Vec<String> = self.nodes.iter().map(|(n, u)| format!("{n} {u}")).collect();
            println!("metrics: {}", list.join(", "));
            self.printed = true;
        }
    }
}
