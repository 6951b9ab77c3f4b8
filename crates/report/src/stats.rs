//! Latency percentiles and throughput of one measured phase (the lanes of `bench transport`
//! and `bench hosts`: connections or workers side by side).

use std::time::{Duration, Instant};

use serde::Serialize;

/// What one connection (or one worker) did during a phase.
#[derive(Clone, Debug)]
pub struct Lane {
    /// When its first timed operation started.
    pub start: Instant,
    /// When its last timed operation ended.
    pub end: Instant,
    /// Payload bytes it moved.
    pub bytes: u64,
    /// Duration of each operation (empty for a stream).
    pub ops: Vec<Duration>,
}

/// The summary of a phase, over all its lanes.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Measured {
    /// Operations timed (0 for a stream).
    pub ops: u64,
    /// Payload bytes moved by every lane.
    pub bytes: u64,
    /// From the first lane's start to the last lane's end, in seconds.
    pub seconds: f64,
    /// `bytes / seconds`, in GB/s (10^9 bytes per second).
    pub gbps: f64,
    /// Median operation time, in microseconds.
    pub p50_us: Option<f64>,
    /// 99th percentile operation time, in microseconds.
    pub p99_us: Option<f64>,
    /// GB/s of each round, when the phase ran in rounds (`gbps` is then their median).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rounds_gbps: Vec<f64>,
}

impl Measured {
    /// Sums lanes that ran side by side.
    pub fn of(lanes: &[Lane]) -> Self {
        let (Some(start), Some(end)) = (lanes.iter().map(|l| l.start).min(), lanes.iter().map(|l| l.end).max()) else {
            return Self::default();
        };
        let seconds = end.saturating_duration_since(start).as_secs_f64();
        let bytes: u64 = lanes.iter().map(|l| l.bytes).sum();
        let mut all: Vec<Duration> = lanes.iter().flat_map(|l| l.ops.iter().copied()).collect();
        all.sort_unstable();
        Measured {
            ops: all.len() as u64,
            bytes,
            seconds,
            gbps: if seconds > 0.0 { bytes as f64 / seconds / 1e9 } else { 0.0 },
            p50_us: quantile(&all, 0.50),
            p99_us: quantile(&all, 0.99),
            rounds_gbps: Vec::new(),
        }
    }

    /// A phase that ran in rounds (each a set of side-by-side lanes), interleaved with
    /// the phases it is compared with: GB/s is the median of the rounds' (robust to a
    /// round that another process disturbed), latencies are over every operation.
    pub fn of_rounds(rounds: &[Vec<Lane>]) -> Self {
        let all: Vec<Lane> = rounds.iter().flatten().cloned().collect();
        let mut ops: Vec<Duration> = all.iter().flat_map(|l| l.ops.iter().copied()).collect();
        ops.sort_unstable();
        let rounds_gbps: Vec<f64> = rounds.iter().map(|r| Measured::of(r).gbps).collect();
        let seconds = rounds.iter().map(|r| Measured::of(r).seconds).sum();
        Measured {
            ops: ops.len() as u64,
            bytes: all.iter().map(|l| l.bytes).sum(),
            seconds,
            gbps: elasticps_core::stats::median(&rounds_gbps).unwrap_or(0.0),
            p50_us: quantile(&ops, 0.50),
            p99_us: quantile(&ops, 0.99),
            rounds_gbps,
        }
    }
}

/// Nearest-rank quantile of sorted durations, in microseconds.
pub fn quantile(sorted: &[Duration], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    Some(sorted[rank - 1].as_secs_f64() * 1e6)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_quantiles() {
        let v: Vec<Duration> = (1..=100).map(Duration::from_micros).collect();
        assert_eq!(quantile(&v, 0.5), Some(50.0));
        assert_eq!(quantile(&v, 0.99), Some(99.0));
        assert_eq!(quantile(&v[..1], 0.99), Some(1.0));
        assert_eq!(quantile(&[], 0.5), None);
    }

    #[test]
    fn lanes_add_bytes_and_span_time() {
        let t0 = Instant::now();
        let lane = |s: u64, e: u64, bytes| Lane {
            start: t0 + Duration::from_millis(s),
            end: t0 + Duration::from_millis(e),
            bytes,
            ops: vec![Duration::from_micros(10); 3],
        };
        let m = Measured::of(&[lane(0, 500, 1_000_000_000), lane(100, 1000, 1_000_000_000)]);
        assert_eq!(m.ops, 6);
        assert!((m.seconds - 1.0).abs() < 1e-9);
        assert!((m.gbps - 2.0).abs() < 1e-9);
        assert_eq!(m.p50_us, Some(10.0));

        let r = Measured::of_rounds(&[
            vec![lane(0, 1000, 1_000_000_000)],
            vec![lane(0, 1000, 3_000_000_000)],
            vec![lane(0, 1000, 2_000_000_000)],
        ]);
        assert!((r.gbps - 2.0).abs() < 1e-9, "median of 1, 3, 2");
        assert_eq!(r.ops, 9);
        assert_eq!(r.bytes, 6_000_000_000);
        assert!((r.seconds - 3.0).abs() < 1e-9);
    }
}
