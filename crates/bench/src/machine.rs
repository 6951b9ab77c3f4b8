//! What the benchmarks report about the machine: CPU model, kernel, and how much of the
//! CPU other processes took while a benchmark ran (other work skews every number).
//!
//! [`Machine`] is the `machine` object of every benchmark's JSON and the machine line of
//! its Markdown ([`Machine::markdown`]); a [`MachineWatch`] started before the runs builds
//! it after them ([`crate::pipeline`]). [`CpuSample`] is the CPU probe underneath.

use serde::Serialize;

/// CPU time in clock ticks: of the whole machine (/proc/stat) and of this process with
/// its reaped children, the cluster nodes (/proc/self/stat).
#[derive(Clone, Copy, Debug)]
pub struct CpuSample {
    /// Every state of every CPU.
    pub total: u64,
    /// Time in processes: user, nice and system (interrupt time is left out: most of it is
    /// the benchmark's own network traffic).
    pub busy: u64,
    /// Time the hypervisor took (steal).
    pub steal: u64,
    /// utime + stime + cutime + cstime of this process.
    pub own: u64,
}

impl CpuSample {
    /// Reads the counters now; `None` where /proc is not readable.
    pub fn now() -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let cpu: Vec<u64> =
            stat.lines().next()?.split_whitespace().skip(1).take(8).map(|v| v.parse().ok()).collect::<Option<_>>()?;
        // user nice system idle iowait irq softirq steal
        let (total, busy, steal) = (cpu.iter().sum(), cpu.first()? + cpu.get(1)? + cpu.get(2)?, *cpu.get(7)?);
        let me = std::fs::read_to_string("/proc/self/stat").ok()?;
        // Fields after "pid (comm)": state is field 3, utime..cstime are fields 14..17.
        let fields: Vec<&str> = me.rsplit_once(')')?.1.split_whitespace().collect();
        let own = (11..=14).map(|i| fields.get(i)?.parse::<u64>().ok()).sum::<Option<u64>>()?;
        Some(CpuSample { total, busy, steal, own })
    }

    /// The share of the machine's CPU time that other processes used between `self` and
    /// `later`.
    pub fn others(self, later: Self) -> Option<f64> {
        let total = later.total.checked_sub(self.total).filter(|t| *t > 0)? as f64;
        let others = (later.busy.saturating_sub(self.busy)).saturating_sub(later.own.saturating_sub(self.own));
        Some(others as f64 / total)
    }

    /// The share of the machine's CPU time the hypervisor stole between `self` and `later`.
    pub fn steal(self, later: Self) -> Option<f64> {
        let total = later.total.checked_sub(self.total).filter(|t| *t > 0)? as f64;
        Some(later.steal.saturating_sub(self.steal) as f64 / total)
    }
}

/// A file's content, trimmed, or "unknown".
pub fn read_trim(path: &str) -> String {
    std::fs::read_to_string(path).map_or_else(|_| "unknown".into(), |s| s.trim().to_string())
}

/// The CPU model from /proc/cpuinfo, or "unknown".
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

/// The machine a benchmark ran on (the `machine` object of its JSON).
#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    /// CPUs available to this process.
    pub nproc: usize,
    /// The CPU model.
    pub cpu: String,
    /// The kernel release.
    pub kernel: String,
    /// /proc/loadavg when the benchmark started.
    pub loadavg_before: String,
    /// /proc/loadavg when it ended.
    pub loadavg_after: String,
    /// Share of the machine's CPU time that processes outside this benchmark used during
    /// the run (from /proc/stat; other work slows every run, and not every run alike).
    pub other_cpu_share: Option<f64>,
    /// Share of the machine's CPU time the hypervisor took (steal) during the run.
    pub steal_share: Option<f64>,
}

impl Machine {
    /// A machine of 2 CPUs, for tests.
    #[cfg(test)]
    pub fn example() -> Self {
        Machine {
            nproc: 2,
            cpu: "cpu".into(),
            kernel: "6".into(),
            loadavg_before: "0.1 0 0".into(),
            loadavg_after: "1 0 0".into(),
            other_cpu_share: Some(0.1),
            steal_share: None,
        }
    }

    /// The Markdown paragraph on the machine (with the blank line after it), `took_s` being
    /// the benchmark's whole time.
    pub fn markdown(&self, took_s: f64) -> String {
        format!(
            "{} CPUs ({}), Linux {}, loopback; {:.0} s in all. Other processes used {} of the machine's CPU \
             time during the run (load average before {}, after {}).\n\n",
            self.nproc,
            self.cpu,
            self.kernel,
            took_s,
            percent(self.other_cpu_share),
            first_field(&self.loadavg_before),
            first_field(&self.loadavg_after),
        )
    }
}

/// The machine's state when a benchmark starts: [`MachineWatch::start`] before the runs,
/// [`MachineWatch::finish`] after them gives the [`Machine`] to report.
#[derive(Clone, Debug)]
pub struct MachineWatch {
    loadavg_before: String,
    cpu_before: Option<CpuSample>,
}

impl MachineWatch {
    /// Reads the load average and the CPU counters now.
    pub fn start() -> Self {
        let loadavg_before = read_trim("/proc/loadavg");
        MachineWatch { loadavg_before, cpu_before: CpuSample::now() }
    }

    /// Describes the machine, with what other processes took since [`MachineWatch::start`].
    pub fn finish(self) -> Machine {
        let after = CpuSample::now();
        Machine {
            nproc: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cpu: cpu_model(),
            kernel: read_trim("/proc/sys/kernel/osrelease"),
            loadavg_before: self.loadavg_before,
            loadavg_after: read_trim("/proc/loadavg"),
            other_cpu_share: self.cpu_before.zip(after).and_then(|(a, b)| a.others(b)),
            steal_share: self.cpu_before.zip(after).and_then(|(a, b)| a.steal(b)),
        }
    }
}

/// A share as `12%`, or "an unknown share".
pub fn percent(share: Option<f64>) -> String {
    share.map_or_else(|| "an unknown share".into(), |s| format!("{:.0}%", s * 100.0))
}

/// The first whitespace-separated field (the 1-minute load average of a /proc/loadavg line).
fn first_field(s: &str) -> &str {
    s.split_whitespace().next().unwrap_or(s)
}
