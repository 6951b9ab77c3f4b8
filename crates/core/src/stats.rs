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

/// The median of the finite values of `values` (the mean of the middle two for an even
/// count); `None` if there is none. The one median of the workspace: the balancer's
/// straggler bound, the reports' and the benchmarks' tables.
pub fn median(values: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    Some(if v.len() % 2 == 1 { v[m] } else { (v[m - 1] + v[m]) / 2.0 })
}

/// `a / b` for a table, as `2.31x`; `inf` when `b` is zero and `a` positive; `-` when it
/// has no meaning (a value not finite, `b` negative, or both zero).
pub fn ratio(a: f64, b: f64) -> String {
    if a.is_finite() && b.is_finite() && b > 0.0 {
        format!("{:.2}x", a / b)
    } else if a.is_finite() && a > 0.0 && b == 0.0 {
        "inf".into()
    } else {
        "-".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_the_finite_values() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[f64::NAN, f64::INFINITY]), None);
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&[4.0, f64::NAN, 1.0, 2.0, 3.0]), Some(2.5));
    }

    #[test]
    fn ratios_for_tables() {
        assert_eq!(ratio(3.0, 2.0), "1.50x");
        assert_eq!(ratio(0.0, 2.0), "0.00x");
        assert_eq!(ratio(3.0, 0.0), "inf");
        assert_eq!(ratio(0.0, 0.0), "-");
        assert_eq!(ratio(f64::NAN, 2.0), "-");
        assert_eq!(ratio(3.0, f64::NAN), "-");
        assert_eq!(ratio(3.0, -1.0), "-");
    }

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
