//! Server straggler injection, as in PSLD's experiments (DESIGN.md §6): a cap on a
//! server's socket bandwidth (one token bucket per direction, shared by all its
//! connections) and CPU interference (real extra work after each request).
//!
//! A [`Shaper`] starts inactive and costs one atomic load per frame until
//! [`Shaper::configure`] arms it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use elasticps_wire::Injection;

/// Bytes a bucket lets through at once before it throttles: a frame larger than this
/// goes into debt and waits for it.
pub const BURST_BYTES: u64 = 64 * 1024;

const IN: usize = 0;
const OUT: usize = 1;

/// A server's injected slowness, shared by all its connections. Starts inactive.
#[derive(Debug, Default)]
pub struct Shaper {
    /// Whether `configure` set a bandwidth cap or an interference factor (fast path).
    armed: AtomicBool,
    state: Mutex<State>,
    /// Microseconds frames waited in the buckets since the last `take_shaped_us`.
    shaped_us: AtomicU64,
}

#[derive(Debug, Default)]
struct State {
    /// When the injection starts (`None`: never).
    start: Option<Instant>,
    /// Bytes per second per direction (0: no cap).
    rate: u64,
    /// CPU time multiplier (<= 1: none).
    factor: f64,
    /// Per direction: when the bucket is full again (GCRA's theoretical arrival time).
    /// A frame waits until that time minus the burst's worth of time.
    full_at: [Option<Instant>; 2],
}

impl Shaper {
    /// An inactive shaper.
    pub fn new() -> Arc<Shaper> {
        Arc::new(Shaper::default())
    }

    /// Applies `inject` starting `inject.at_us` after now. May be called again to change
    /// it (the buckets then start full again); an injection with no cap and a factor <= 1
    /// disarms the shaper.
    pub fn configure(&self, inject: &Injection) {
        let factor = f64::from(inject.interference);
        let factor = if factor.is_finite() && factor > 1.0 { factor } else { 1.0 };
        let armed = inject.bandwidth_bps > 0 || factor > 1.0;
        // An `at_us` too far out for the clock means never.
        let start = Instant::now().checked_add(Duration::from_micros(inject.at_us)).filter(|_| armed);
        let mut s = self.lock();
        *s = State { start, rate: inject.bandwidth_bps, factor, full_at: [None; 2] };
        self.armed.store(armed, Ordering::Release);
    }

    /// Whether a bandwidth cap is configured (active now or later): writes then wait in
    /// the outgoing bucket, and a task that must keep reading should not make them.
    pub fn caps_bandwidth(&self) -> bool {
        self.armed.load(Ordering::Acquire) && self.lock().rate > 0
    }

    /// A frame of `bytes` arrived (call after reading it): waits as the incoming bucket says,
    /// once the injection is active.
    pub async fn take_in(&self, bytes: usize) {
        self.wait(self.reserve(IN, bytes)).await;
    }

    /// A frame of `bytes` is about to be sent: waits as the outgoing bucket says, once the
    /// injection is active.
    pub async fn take_out(&self, bytes: usize) {
        self.wait(self.reserve(OUT, bytes)).await;
    }

    /// Work that took `spent` was just done for a request: if interference is active,
    /// busy-spins (real CPU, on the calling thread) for `(factor - 1) * spent`, and returns
    /// that time (zero when inactive), which the request's handling took too.
    pub fn interfere(&self, spent: Duration) -> Duration {
        if !self.armed.load(Ordering::Acquire) {
            return Duration::ZERO;
        }
        let extra = {
            let s = self.lock();
            match s.start {
                Some(start) if s.factor > 1.0 && Instant::now() >= start => spent.mul_f64(s.factor - 1.0),
                _ => return Duration::ZERO,
            }
        };
        let until = Instant::now() + extra;
        let mut x = 0u64;
        while Instant::now() < until {
            for _ in 0..256 {
                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407));
            }
        }
        std::hint::black_box(x);
        extra
    }

    /// Microseconds frames waited in the buckets since the last call (the counter is reset),
    /// for load reports.
    pub fn take_shaped_us(&self) -> u64 {
        self.shaped_us.swap(0, Ordering::Relaxed)
    }

    /// Takes `bytes` from the bucket of `dir` and returns how long the frame must wait
    /// (zero while inactive or within the burst).
    pub(crate) fn reserve_out(&self, bytes: usize) -> Duration {
        self.reserve(OUT, bytes)
    }

    /// Sleeps `wait` (as returned by a reservation) and counts it as shaped time.
    // The token bucket of an injected link cap: it slows the socket down, as a slow link
    // would, and decides nothing (clippy.toml keeps sleeps in the drivers' Timer otherwise).
    #[allow(clippy::disallowed_methods)]
    pub(crate) async fn wait(&self, wait: Duration) {
        if wait.is_zero() {
            return;
        }
        let t = Instant::now();
        tokio::time::sleep(wait).await;
        self.shaped_us.fetch_add(t.elapsed().as_micros() as u64, Ordering::Relaxed);
    }

    fn reserve(&self, dir: usize, bytes: usize) -> Duration {
        if !self.armed.load(Ordering::Acquire) {
            return Duration::ZERO;
        }
        let mut s = self.lock();
        let Some(start) = s.start else { return Duration::ZERO };
        let rate = u128::from(s.rate);
        let now = Instant::now();
        if rate == 0 || now < start {
            return Duration::ZERO;
        }
        let nanos = |b: u128| Duration::from_nanos(u64::try_from(b * 1_000_000_000 / rate).unwrap_or(u64::MAX));
        let from = s.full_at[dir].map_or(now, |t| t.max(now));
        let full_at = from + nanos(bytes as u128);
        s.full_at[dir] = Some(full_at);
        (full_at - now).saturating_sub(nanos(u128::from(BURST_BYTES)))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // tests wait out an injection's start
mod tests {
    use super::*;

    fn cap(bandwidth_bps: u64, at_us: u64) -> Injection {
        Injection { bandwidth_bps, interference: 0.0, at_us }
    }

    async fn timed(f: impl Future<Output = ()>) -> Duration {
        let t = Instant::now();
        f.await;
        t.elapsed()
    }

    #[tokio::test]
    async fn an_inactive_shaper_never_waits() {
        let s = Shaper::new();
        let took = timed(async {
            s.take_in(50 << 20).await;
            s.take_out(50 << 20).await;
            s.interfere(Duration::from_secs(5));
        })
        .await;
        assert!(took < Duration::from_millis(100), "{took:?}");
        s.configure(&Injection { bandwidth_bps: 0, interference: 1.0, at_us: 0 });
        let took = timed(async {
            s.take_in(50 << 20).await;
            s.interfere(Duration::from_secs(5));
        })
        .await;
        assert!(took < Duration::from_millis(100), "{took:?}");
        assert_eq!(s.take_shaped_us(), 0);
    }

    #[tokio::test]
    async fn a_1_mb_per_s_bucket_delays_500_kb_by_half_a_second() {
        let s = Shaper::new();
        s.configure(&cap(1_000_000, 0));
        // 500 KB cost 0.5 s, minus the 64 KiB burst the full bucket lets through at once.
        let expected = Duration::from_millis(500) - Duration::from_nanos(BURST_BYTES * 1000);
        let took = timed(async {
            for _ in 0..10 {
                s.take_in(50_000).await;
            }
        })
        .await;
        assert!(took >= expected && took < expected + Duration::from_millis(400), "{took:?}");
        let shaped = s.take_shaped_us();
        assert!(shaped + 5_000 >= expected.as_micros() as u64 && shaped <= took.as_micros() as u64, "{shaped}");
        assert_eq!(s.take_shaped_us(), 0, "the counter resets");

        // The outgoing bucket is separate (still full); one frame larger than the burst
        // goes into debt instead of failing.
        let took = timed(s.take_out(500_000)).await;
        assert!(took >= expected && took < expected + Duration::from_millis(400), "{took:?}");
    }

    #[tokio::test]
    async fn concurrent_frames_share_the_bucket() {
        let s = Shaper::new();
        s.configure(&cap(2_000_000, 0));
        let expected = Duration::from_millis(500) - Duration::from_nanos(BURST_BYTES * 500);
        let took = timed(async {
            let a = async {
                for _ in 0..5 {
                    s.take_out(100_000).await;
                }
            };
            tokio::join!(a, s.take_out(500_000));
        })
        .await;
        assert!(took >= expected && took < expected + Duration::from_millis(400), "{took:?}");
    }

    #[tokio::test]
    async fn at_us_delays_the_start() {
        let s = Shaper::new();
        s.configure(&Injection { bandwidth_bps: 1_000_000, interference: 4.0, at_us: 300_000 });
        let took = timed(async {
            s.take_in(1_000_000).await;
            s.interfere(Duration::from_secs(1));
        })
        .await;
        assert!(took < Duration::from_millis(150), "{took:?}");
        tokio::time::sleep(Duration::from_millis(350)).await;
        let took = timed(s.take_in(200_000)).await;
        let expected = Duration::from_millis(200) - Duration::from_nanos(BURST_BYTES * 1000);
        assert!(took >= expected && took < expected + Duration::from_millis(400), "{took:?}");
        // Configuring again restarts the delay.
        s.configure(&cap(1_000, 10_000_000));
        let took = timed(s.take_in(1_000_000)).await;
        assert!(took < Duration::from_millis(100), "{took:?}");
    }

    #[test]
    fn interference_spins_about_factor_minus_one_times_the_work() {
        let s = Shaper::new();
        s.configure(&Injection { bandwidth_bps: 0, interference: 3.0, at_us: 0 });
        let t = Instant::now();
        s.interfere(Duration::from_millis(40));
        let took = t.elapsed();
        assert!(took >= Duration::from_millis(80) && took < Duration::from_millis(600), "{took:?}");
        s.configure(&Injection::default());
        let t = Instant::now();
        s.interfere(Duration::from_millis(40));
        assert!(t.elapsed() < Duration::from_millis(20));
    }
}
