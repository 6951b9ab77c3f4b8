//! Per-server service-rate estimates with a confidence: the measuring half of PSLD.
//!
//! Workers report, per interval and per server, how many bytes they pushed to it and how
//! long those pushes took (first push sent to last ack, summed over rounds). Pushes are
//! never held by a synchronization policy, so `bytes / time` is the rate at which that
//! server serves this worker. Each report is one *sample* `r = bytes / seconds`.
//!
//! The model per server:
//!
//! - **Estimate.** A time-decayed weighted mean of the sample rates. When a sample arrives
//!   `dt` after the previous one, every older weight is multiplied by `2^(-dt/half_life)`
//!   and the new sample weighs 1. So once fresh samples arrive, a sample `half_life` old
//!   counts half, and after a change of the true rate the estimate closes
//!   `1 - 2^(-t/half_life)` of the gap in time `t` (about 94% after four half-lives).
//!   Without new samples the estimate stays where it is and only its age grows.
//! - **Change of regime.** Samples [`JUMP`] (3) times above or below the estimate of a
//!   server with samples from at least [`JUMP_REPORTS`] distinct instants are held out; if
//!   the next instant's samples are off the same way, the estimate starts afresh from them,
//!   and otherwise the held-out ones are dropped. A link capped mid-run (4x slower) would
//!   otherwise take several half-lives to show, while the old samples' spread kept every
//!   decision on it waiting; one stray interval (a sender stalled mid-frame) changes
//!   nothing. (A server's report gives several samples at one instant, hence instants.)
//!   History that has decayed below one fresh sample's weight is not held against a jump.
//! - **Spread.** The weighted variance of the sample rates (West's incremental algorithm,
//!   numerically stable), giving the coefficient of variation `cv = sd / mean`.
//! - **Confidence.** `1 - rse`, clamped to `[0, 1]`, where the relative standard error of
//!   the mean is `rse = sqrt((cv^2 + PRIOR_CV^2) / n_eff)` and `n_eff = (Σw)^2 / Σw^2` is
//!   the effective number of samples under the decay. The prior spread [`PRIOR_CV`] (1.0)
//!   stands for "a single sample may be off by its own size", so one sample gives
//!   confidence 0, four agreeing samples 0.5, sixteen 0.75; noisy samples give less. With a
//!   steady stream of samples `n_eff` saturates (e.g. about 9 for one sample per second and
//!   a 3 s half-life, 17 for two), so confidence is bounded below 1 and old, undecayed data
//!   never makes it grow without limit. Confidence does not decay with age: the balancer
//!   looks at [`RateEstimate::age_us`] for staleness.

use std::collections::BTreeMap;

use crate::placement::ServerId;

/// Relative spread assumed a priori for a single sample (see the module doc).
pub const PRIOR_CV: f64 = 1.0;

/// A sample this many times above or below a server's estimate is a change of regime:
/// the estimate starts afresh from it (see the module doc).
pub const JUMP: f64 = 3.0;

/// Distinct instants a server's samples must come from before a jump can restart it.
pub const JUMP_REPORTS: u64 = 4;

/// A link sample whose frames average less than this share of the job's mean block
/// bytes measures per-request costs, not the link: it is not taken ([`link_rate`]).
pub const MIN_FRAME_SHARE: f64 = 0.25;

/// A link sample in which the fixed cost of its requests takes more than this share of
/// the time measures that cost, not the link: it is not taken ([`link_rate`]).
pub const MAX_FIXED_SHARE: f64 = 0.5;

/// What a server measured of its link over one interval (its load report's data frames).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkSample {
    /// Payload bytes of the data frames.
    pub bytes: u64,
    /// Data frames.
    pub frames: u32,
    /// The rate measured: the bytes over the frames' time (on the link, or in the server's
    /// hands if that was longer), bytes/s.
    pub bps: f64,
}

impl LinkSample {
    /// True if the frames average less than [`MIN_FRAME_SHARE`] of `mean_block_bytes`
    /// (the job's mean block): they measure per-request costs, not the link.
    pub fn small_frames(&self, mean_block_bytes: f64) -> bool {
        self.frames > 0 && (self.bytes as f64 / f64::from(self.frames)) < MIN_FRAME_SHARE * mean_block_bytes
    }
}

/// **The fixed cost per request.** A server's time per interval is
/// `frames * fixed_s + bytes / rate`: a frame costs its handling (a system call, a
/// lookup, a reply) whatever its size, and its bytes at the link's rate. The rate of a
/// sample is its bytes over the time left once the frames' fixed cost is taken out.
///
/// A sample that cannot measure the rate gives `None`, so the server's rate stays
/// *unknown* (or what earlier, measurable samples said), never low: frames that average
/// less than [`MIN_FRAME_SHARE`] of `mean_block_bytes` (the job's mean block size), or a
/// fixed cost over [`MAX_FIXED_SHARE`] of the time. A server holding one bias vector
/// would otherwise look hundreds of times slower than its link.
pub fn link_rate(sample: LinkSample, fixed_s: f64, mean_block_bytes: f64) -> Option<f64> {
    let LinkSample { bytes, frames, bps } = sample;
    if frames == 0 || bytes == 0 || !(bps.is_finite() && bps > 0.0) {
        return None;
    }
    if sample.small_frames(mean_block_bytes) {
        return None;
    }
    let seconds = bytes as f64 / bps;
    let fixed = f64::from(frames) * fixed_s.max(0.0);
    if fixed > MAX_FIXED_SHARE * seconds {
        return None;
    }
    Some(bytes as f64 / (seconds - fixed))
}

/// Service-rate estimates of every server that has samples.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadModel {
    half_life_us: u64,
    servers: BTreeMap<ServerId, Stats>,
}

/// Decayed sample statistics of one server.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Stats {
    /// Σw.
    weight: f64,
    /// Σw².
    weight_sq: f64,
    /// Weighted mean rate, bytes/s.
    mean: f64,
    /// Σw (r - mean)².
    m2: f64,
    /// Samples ever observed.
    samples: u64,
    /// Distinct instants they came at.
    reports: u64,
    /// Time of the latest sample.
    last_us: u64,
    /// A jump held out: its instant and whether it was upwards.
    jump: Option<(u64, bool)>,
}

/// The rate estimate of one server.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RateEstimate {
    /// Estimated service rate, bytes per second.
    pub bps: f64,
    /// How much to trust `bps`, from 0 (nothing) to 1 (see the module doc).
    pub confidence: f64,
    /// Relative standard error of `bps`, the weighted mean: `cv / sqrt(n_eff)`, from the
    /// samples' own spread only (no prior, unlike `confidence`; 0 for one sample or
    /// samples that agree). The balancer's rank rule takes a rate as `bps * (1 -+ rse)`.
    pub rse: f64,
    /// Number of samples ever observed for this server.
    pub samples: u64,
    /// Microseconds since the latest sample.
    pub age_us: u64,
}

impl LoadModel {
    /// A model in which old samples weigh half after `half_life_us` (e.g. 3_000_000);
    /// 0 is taken as 1 µs (only the latest instant counts).
    pub fn new(half_life_us: u64) -> Self {
        Self { half_life_us: half_life_us.max(1), servers: BTreeMap::new() }
    }

    /// The half-life of sample weights, in microseconds.
    pub fn half_life_us(&self) -> u64 {
        self.half_life_us
    }

    /// One worker's report about one server over one interval: it pushed `push_bytes`
    /// to that server and the pushes took `push_us` in total (first push sent -> last ack,
    /// summed over rounds). Pushes are never held by sync policies, so bytes/time is the
    /// server's service rate as this worker sees it. Samples with `push_us == 0` or
    /// `push_bytes == 0` are ignored. A sample older than the latest one counts as if it
    /// arrived with it.
    pub fn observe(&mut self, server: ServerId, push_bytes: u64, push_us: u64, now_us: u64) {
        if push_us == 0 || push_bytes == 0 {
            return;
        }
        self.observe_rate(server, push_bytes as f64 * 1e6 / push_us as f64, now_us);
    }

    /// One sample of `server`'s rate, bytes/s, measured some other way (a server's own
    /// arrivals; see `ServerLoad::rx_bps`). Non-finite or non-positive rates are ignored.
    pub fn observe_rate(&mut self, server: ServerId, rate: f64, now_us: u64) {
        if !(rate.is_finite() && rate > 0.0) {
            return;
        }
        let half_life = self.half_life_us as f64;
        let fresh = Stats {
            weight: 0.0,
            weight_sq: 0.0,
            mean: 0.0,
            m2: 0.0,
            samples: 0,
            reports: 0,
            last_us: now_us,
            jump: None,
        };
        let s = self.servers.entry(server).or_insert(fresh);
        let up = rate > s.mean * JUMP;
        // History that has decayed below one fresh sample's weight is outweighed anyway.
        let weighs = s.weight * (-(now_us.saturating_sub(s.last_us) as f64) / half_life).exp2() >= 1.0;
        if weighs && s.reports >= JUMP_REPORTS && (up || rate * JUMP < s.mean) {
            match s.jump {
                // The next instant is off the same way: a change of regime.
                Some((at, was_up)) if now_us > at && was_up == up => {
                    *s = Stats { last_us: s.last_us.max(now_us), ..fresh };
                }
                // Another sample of the instant held out.
                Some((at, was_up)) if now_us == at && was_up == up => return,
                _ => {
                    s.jump = Some((now_us, up));
                    return;
                }
            }
        } else {
            s.jump = None;
        }
        if s.samples == 0 || now_us > s.last_us {
            s.reports += 1;
        }
        let dt = now_us.saturating_sub(s.last_us) as f64;
        let decay = (-dt / half_life).exp2();
        s.weight *= decay;
        s.weight_sq *= decay * decay;
        s.m2 *= decay;
        s.weight += 1.0;
        s.weight_sq += 1.0;
        let delta = rate - s.mean;
        s.mean += delta / s.weight;
        s.m2 += delta * (rate - s.mean);
        s.samples += 1;
        s.last_us = s.last_us.max(now_us);
    }

    /// Forgets a server (removed from the job).
    pub fn remove(&mut self, server: ServerId) {
        self.servers.remove(&server);
    }

    /// The estimate for one server, if it has any samples.
    pub fn estimate(&self, server: ServerId, now_us: u64) -> Option<RateEstimate> {
        let s = self.servers.get(&server)?;
        let n_eff = if s.weight_sq > 0.0 { s.weight * s.weight / s.weight_sq } else { 0.0 };
        let cv2 =
            if s.mean > 0.0 && s.weight > 0.0 { (s.m2 / s.weight).max(0.0) / (s.mean * s.mean) } else { f64::INFINITY };
        let confidence = if n_eff > 0.0 {
            let rse = ((cv2 + PRIOR_CV * PRIOR_CV) / n_eff).sqrt();
            if rse.is_finite() { (1.0 - rse).clamp(0.0, 1.0) } else { 0.0 }
        } else {
            0.0
        };
        let rse = if n_eff > 0.0 { (cv2 / n_eff).sqrt() } else { f64::INFINITY };
        let rse = if rse.is_finite() { rse } else { 1.0 };
        Some(RateEstimate {
            bps: s.mean,
            confidence,
            rse,
            samples: s.samples,
            age_us: now_us.saturating_sub(s.last_us),
        })
    }

    /// bytes/s of every server that has an estimate.
    pub fn rates(&self, now_us: u64) -> BTreeMap<ServerId, f64> {
        self.servers.keys().filter_map(|&id| self.estimate(id, now_us).map(|e| (id, e.bps))).collect()
    }

    /// The servers that have an estimate, in id order.
    pub fn servers(&self) -> impl Iterator<Item = ServerId> + '_ {
        self.servers.keys().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000;
    const MB: u64 = 1_000_000;

    /// `bytes` at `bps` as a push duration in µs.
    fn us(bytes: u64, bps: f64) -> u64 {
        (bytes as f64 / bps * 1e6).round() as u64
    }

    #[test]
    fn a_rate_three_times_off_twice_running_starts_the_estimate_afresh_and_once_does_not() {
        let mut m = LoadModel::new(3 * S);
        // Reports of 8 samples each, as the scheduler feeds a server's report.
        let report = |m: &mut LoadModel, bps: f64, t: u64| {
            for _ in 0..8 {
                m.observe(0, 4 * MB, us(4 * MB, bps), t);
            }
        };
        for t in 0..8 {
            report(&mut m, 200e6, t * S);
        }
        // 2x slower: within the noise the model averages away, the estimate only moves.
        report(&mut m, 100e6, 8 * S);
        let e = m.estimate(0, 8 * S).unwrap();
        assert!(e.bps > 150e6 && e.samples == 72, "{e:?}");
        // One stray report 4x below is held out, and dropped when the next is normal.
        let before = m.estimate(0, 9 * S).unwrap().bps;
        report(&mut m, 50e6, 9 * S);
        assert_eq!(m.estimate(0, 9 * S).unwrap().bps, before, "held out");
        report(&mut m, 200e6, 10 * S);
        let e = m.estimate(0, 10 * S).unwrap();
        assert!(e.bps > before && e.samples == 80, "the stray report dropped: {e:?}");
        // Capped at a quarter: two reports 4x below in a row, and the estimate is that rate.
        report(&mut m, 50e6, 11 * S);
        report(&mut m, 50e6, 12 * S);
        let e = m.estimate(0, 12 * S).unwrap();
        assert!((e.bps - 50e6).abs() < 1e3 && e.samples == 8, "{e:?}");
        assert!(e.confidence >= 0.5, "{e:?}");
        // A server with samples from fewer than JUMP_REPORTS instants keeps averaging,
        // however many samples one report gave.
        let mut m = LoadModel::new(3 * S);
        for _ in 0..8 {
            m.observe(1, 4 * MB, us(4 * MB, 200e6), 0);
        }
        m.observe(1, 4 * MB, us(4 * MB, 20e6), S);
        assert_eq!(m.estimate(1, S).unwrap().samples, 9);
    }

    #[test]
    fn a_link_sample_of_small_frames_or_mostly_fixed_cost_measures_no_rate() {
        let mean_block = 4.0 * MB as f64;
        // 10 frames of 4 MB at 100 MB/s: 0.4 s, of which 10 x 1 ms fixed: the link's 102.6 MB/s.
        let big = LinkSample { bytes: 40 * MB, frames: 10, bps: 100e6 };
        let r = link_rate(big, 1e-3, mean_block).unwrap();
        assert!((r - 40e6 / 0.39).abs() < 1.0, "{r}");
        assert_eq!(link_rate(big, 0.0, mean_block), Some(100e6));
        // One bias vector of 248 bytes a frame: too small to say anything of the link.
        let bias = LinkSample { bytes: 2480, frames: 10, bps: 5e6 };
        assert_eq!(link_rate(bias, 0.0, mean_block), None);
        // Frames large enough, but their fixed cost is most of the time.
        let tiny_job = 1000.0;
        assert_eq!(link_rate(LinkSample { bytes: 10_000, frames: 10, bps: 10e6 }, 600e-6, tiny_job), None);
        assert!(link_rate(LinkSample { bytes: 10_000, frames: 10, bps: 10e6 }, 10e-6, tiny_job).is_some());
        // Nothing measured.
        assert_eq!(link_rate(LinkSample { bytes: 0, frames: 0, bps: 0.0 }, 0.0, 1.0), None);
    }

    #[test]
    fn constant_samples_give_the_rate_with_rising_confidence() {
        let mut m = LoadModel::new(3 * S);
        assert_eq!(m.estimate(0, 0), None);
        let mut last = -1.0;
        for t in 0..10 {
            m.observe(0, 4 * MB, us(4 * MB, 100e6), t * S);
            let e = m.estimate(0, t * S).unwrap();
            assert!((e.bps - 100e6).abs() < 1e3, "{e:?}");
            assert!(e.confidence > last, "confidence must rise with samples: {e:?} after {last}");
            last = e.confidence;
            assert_eq!(e.samples, t + 1);
        }
        assert_eq!(m.estimate(0, 9 * S).unwrap().age_us, 0);
        assert_eq!(m.estimate(0, 12 * S).unwrap().age_us, 3 * S);
        assert!(last >= 0.6, "10 agreeing samples a second apart are trustworthy: {last}");
        // One sample alone says little.
        let mut one = LoadModel::new(3 * S);
        one.observe(7, MB, 10_000, 0);
        assert!(one.estimate(7, 0).unwrap().confidence < 0.1);
        // Several workers reporting in the same interval count as several samples.
        let mut many = LoadModel::new(3 * S);
        for _ in 0..4 {
            many.observe(1, MB, 10_000, 0);
        }
        assert!((many.estimate(1, 0).unwrap().confidence - 0.5).abs() < 1e-9);
    }

    #[test]
    fn noisy_samples_give_lower_confidence() {
        let mut steady = LoadModel::new(3 * S);
        let mut noisy = LoadModel::new(3 * S);
        for t in 0..20 {
            steady.observe(0, MB, us(MB, 100e6), t * S);
            let bps = if t % 2 == 0 { 50e6 } else { 150e6 };
            noisy.observe(0, MB, us(MB, bps), t * S);
        }
        let (s, n) = (steady.estimate(0, 20 * S).unwrap(), noisy.estimate(0, 20 * S).unwrap());
        assert!(n.confidence + 0.02 < s.confidence, "noisy {n:?} vs steady {s:?}");
        assert!((n.bps - 100e6).abs() < 20e6, "{n:?}");
    }

    #[test]
    fn estimate_follows_a_rate_change_within_a_few_half_lives() {
        let half = 3 * S;
        let mut m = LoadModel::new(half);
        for t in 0..30 {
            m.observe(0, MB, us(MB, 100e6), t * S);
        }
        // The rate halves at t = 30 s.
        for t in 30..60 {
            m.observe(0, MB, us(MB, 50e6), t * S);
            let e = m.estimate(0, t * S).unwrap();
            let since = (t - 30) * S;
            if since < half {
                assert!(e.bps > 60e6, "one sample must not swing the estimate: {e:?} at {t} s");
            }
            if since >= 4 * half {
                assert!((e.bps - 50e6).abs() < 5e6, "must follow within 4 half-lives: {e:?} at {t} s");
            }
        }
        // After a long silence the first new samples dominate.
        for _ in 0..3 {
            m.observe(0, MB, us(MB, 200e6), 200 * S);
        }
        assert!(m.estimate(0, 200 * S).unwrap().bps > 190e6);
    }

    #[test]
    fn ignores_empty_samples_and_forgets_removed_servers() {
        let mut m = LoadModel::new(3 * S);
        m.observe(0, 0, 100, 0);
        m.observe(0, 100, 0, 0);
        assert_eq!(m.estimate(0, 0), None);
        m.observe(0, MB, 10_000, 0);
        m.observe(2, MB, 20_000, 0);
        let rates = m.rates(0);
        assert_eq!(rates.len(), 2);
        assert!((rates[&0] - 100e6).abs() < 1.0 && (rates[&2] - 50e6).abs() < 1.0);
        assert_eq!(m.servers().collect::<Vec<_>>(), vec![0, 2]);
        m.remove(0);
        assert_eq!(m.estimate(0, 0), None);
        assert_eq!(m.rates(0).keys().copied().collect::<Vec<_>>(), vec![2]);
        // Zero half-life: only the latest instant counts.
        let mut z = LoadModel::new(0);
        z.observe(0, MB, 10_000, 0);
        z.observe(0, MB, 20_000, S);
        assert!((z.estimate(0, S).unwrap().bps - 50e6).abs() < 1.0);
    }
}
