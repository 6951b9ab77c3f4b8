//! `elasticps sim`'s flags: the same job flags as `train`, plus the simulated machine.

use clap::Args;
use elasticps_run::args::{DataArgs, JobArgs, RunArgs};
use elasticps_train::synthetic::ModelKind;

use crate::{Result, SimError};

/// `elasticps sim`.
#[derive(Args, Clone, Debug)]
pub struct SimCmd {
    /// The job (servers, workers, sync, optimizer, placement, balance, stragglers...).
    #[command(flatten)]
    pub job: JobArgs,
    /// The model and schedule (a synthetic model; --compute-ms, --worker-delay, --worker-jitter,
    /// --iterations).
    #[command(flatten)]
    pub data: DataArgs,
    /// Report and progress.
    #[command(flatten)]
    pub run: RunArgs,
    /// The simulated machine.
    #[command(flatten)]
    pub sim: SimArgs,
}

/// The machine the sim models.
#[derive(Args, Clone, Debug)]
pub struct SimArgs {
    /// One-way latency of every link, microseconds.
    #[arg(long = "latency-us", default_value_t = 50.0)]
    pub latency_us: f64,
    /// Every node's network bandwidth, each direction, megabytes (10^6 bytes) per second
    /// (a server's --server-bandwidth caps it lower).
    #[arg(long = "link-mbps", default_value_t = 1250.0)]
    pub link_mbps: f64,
    /// How fast a server applies pushes, megabytes of gradient per second (its CPU; a
    /// server's --server-interference multiplies the time).
    #[arg(long = "apply-mbps", default_value_t = 2000.0)]
    pub apply_mbps: f64,
    /// One simulated value stands for this many of the model's values (0: pick one that
    /// keeps the simulated model under 8,192 values).
    #[arg(long, default_value_t = 0)]
    pub scale: u64,
    /// Seed of the simulation (delays, coins, link jitter): one seed, one run.
    #[arg(long = "sim-seed", default_value_t = 1)]
    pub sim_seed: u64,
    /// Noisy links: every message takes an extra delay drawn uniformly from 0 to this many
    /// microseconds (each connection stays FIFO, as TCP is).
    #[arg(long = "jitter-us", default_value_t = 0)]
    pub jitter_us: u64,
    /// A straggler that recovers: --server-bandwidth and --server-interference end this
    /// many seconds after they started (at --straggler-at); without it they last to the end.
    #[arg(long = "straggler-for", value_name = "SECONDS")]
    pub straggler_for_s: Option<f64>,
    /// Give up when the simulated job has not ended after this many simulated seconds.
    #[arg(long = "time-limit-s", default_value_t = 3600.0)]
    pub time_limit_s: f64,
}

impl SimCmd {
    /// Checks what the sim cannot model and returns the synthetic profile's tensors.
    pub fn tensors(&self) -> Result<Vec<elasticps_core::model::TensorSpec>> {
        match self.data.model {
            ModelKind::Synthetic(p) => Ok(p.tensors()),
            ModelKind::Mlp => Err(SimError::Usage(
                "the sim carries tensor sizes, not data: pick a synthetic model, e.g. --model synthetic:resnet50"
                    .into(),
            )),
        }
    }

    /// The sim's checks of its own flags.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("--latency-us", self.sim.latency_us, 0.0),
            ("--link-mbps", self.sim.link_mbps, f64::MIN_POSITIVE),
            ("--apply-mbps", self.sim.apply_mbps, f64::MIN_POSITIVE),
            ("--time-limit-s", self.sim.time_limit_s, f64::MIN_POSITIVE),
        ];
        for (flag, value, min) in positive {
            if !value.is_finite() || value < min {
                return Err(SimError::Usage(format!("{flag} must be a finite number above {min}, got {value}")));
            }
        }
        if let Some(s) = self.sim.straggler_for_s
            && !(s.is_finite() && s > 0.0)
        {
            return Err(SimError::Usage(format!("--straggler-for must be a positive number of seconds, got {s}")));
        }
        if self.run.metrics {
            return Err(SimError::Usage("--metrics: a simulated job has no endpoints to scrape".into()));
        }
        self.job.job_config()?;
        // Every rank's draws can be made (a worker's compute time and straggler delays).
        for rank in self.data.worker_delay.iter().flat_map(|d| d.ranks.iter()).chain([&0]) {
            self.data.delays(*rank)?;
        }
        self.tensors().map(|_| ())
    }

    /// The scale: as given, or the smallest that keeps the simulated model under 8,192 values.
    pub fn scale(&self, nominal_values: u64) -> u64 {
        match self.sim.scale {
            0 => nominal_values.div_ceil(8192).max(1),
            s => s,
        }
    }
}
