//! Small measurement helpers shared by servers, workers and reports.

use serde::{Deserialize, Serialize};

/// A log2-bucketed histogram of durations in microseconds: bucket `i` counts values in
/// `[2^(i-1), 2^i)` (bucket 0 counts zeros). Cheap to record and to merge.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Histogram {
    buckets: Vec<u64>,
}

impl Histogram {
    /// Counts one value.
    pub fn record(&mut self, us: u64) {
        let i = (64 - us.leading_zeros()) as usize;
        if self.buckets.len() <= i {
            self.buckets.resize(i + 1, 0);
        }
        self.buckets[i] += 1;
    }

    /// Adds every count of `other`.
    pub fn merge(&mut self, other: &Histogram) {
        if self.buckets.len() < other.buckets.len() {
            self.buckets.resize(other.buckets.len(), 0);
        }
        for (a, b) in self.buckets.iter_mut().zip(&other.buckets) {
            *a += b;
        }
    }

    /// The counts per bucket: `buckets()[i]` counts values in `[2^(i-1), 2^i)` (index 0
    /// counts zeros); buckets past the end are empty.
    pub fn buckets(&self) -> &[u64] {
        &self.buckets
    }

    /// Number of values recorded.
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }

    /// Upper bound of the bucket holding the `q` quantile (0 <= q <= 1); 0 when empty.
    pub fn quantile(&self, q: f64) -> u64 {
        let n = self.count();
        if n == 0 {
            return 0;
        }
        let rank = ((q.clamp(0.0, 1.0) * n as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, c) in self.buckets.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return if i == 0 { 0 } else { (1u64 << i) - 1 };
            }
        }
        u64::MAX
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_bound_the_recorded_values() {
        let mut h = Histogram::default();
        assert_eq!(h.quantile(0.99), 0);
        for v in 1..=100 {
            h.record(v);
        }
        h.record(10_000);
        assert_eq!(h.count(), 101);
        assert_eq!(h.quantile(0.5), 63);
        assert_eq!(h.quantile(1.0), 16383);
        let mut g = Histogram::default();
        g.merge(&h);
        assert_eq!(g, h);
    }
}
