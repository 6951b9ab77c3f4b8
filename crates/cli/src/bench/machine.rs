//! What the benchmarks report about the machine: CPU model, kernel, and how much of the
//! CPU other processes took while a benchmark ran (other work skews every number).

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
