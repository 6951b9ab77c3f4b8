//! How fast this server's link delivers data: the balancer's rate of a server, measured
//! where the bytes arrive.
//!
//! A worker's view of a server (first push sent to last acknowledgement) says little at
//! scale: the time includes the worker's own link, queued behind its pushes to every other
//! server, and in the fused round the pull's hold until every worker pushed (the barrier),
//! so a server that holds one small block looks slow and a capped server holding a large
//! one looks fast. And the gaps between a server's arrivals say little either: under a
//! synchronous round the slowest server paces every worker, so every server sees frames
//! at the straggler's pace. What the server's driver can measure is how long each data
//! frame took to come in, from its first byte to its last (a real connection: the read of
//! its payload, with the bandwidth cap's wait; the simulated network: its time on the
//! server's downlink). The link's rate over an interval is the bytes of those frames over
//! their summed times: a capped link shows its cap, an idle one its speed.
//!
//! A server is as fast as the slower of its link and its CPU: frames come in while earlier
//! ones are handled, so over an interval the server absorbs its bytes in the longer of the
//! frames' time on the link and the time it spent handling requests (its busy time, which
//! a CPU slowed by other work stretches). The rate is the bytes over that longer time.

/// The data frames of one stats interval.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Capacity {
    bytes: u64,
    ns: u64,
    frames: u32,
}

/// What [`Capacity::take`] measured over an interval.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Measured {
    /// The link's rate, bytes per second.
    pub bps: f64,
    /// Data frames it was measured from.
    pub frames: u32,
}

impl Capacity {
    /// A data frame of `bytes` took `transfer_ns` from its first byte to its last (0 is
    /// taken as 1 ns: the frame was already there).
    pub fn received(&mut self, bytes: u64, transfer_ns: u64) {
        if bytes == 0 {
            return;
        }
        self.bytes = self.bytes.saturating_add(bytes);
        self.ns = self.ns.saturating_add(transfer_ns.max(1));
        self.frames = self.frames.saturating_add(1);
    }

    /// The interval's rate (none without frames), over the longer of the frames' time on
    /// the link and `busy_us`, the time the server spent handling requests in it; and a
    /// fresh interval.
    pub fn take(&mut self, busy_us: u64) -> Option<Measured> {
        let Capacity { bytes, ns, frames } = std::mem::take(self);
        let ns = ns.max(busy_us.saturating_mul(1_000));
        (frames > 0).then(|| Measured { bps: bytes as f64 * 1e9 / ns as f64, frames })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rate_is_the_frames_bytes_over_their_transfer_times() {
        let mut c = Capacity::default();
        assert_eq!(c.take(0), None);
        // 4 MB in 40 ms and 1 MB in 10 ms: 100 MB/s, whatever the gaps between them.
        c.received(4_000_000, 40_000_000);
        c.received(1_000_000, 10_000_000);
        c.received(0, 5);
        let m = c.take(0).unwrap();
        assert_eq!(m.frames, 2);
        assert!((m.bps - 100e6).abs() < 1e-6, "{m:?}");
        assert_eq!(c.take(0), None, "a fresh interval");
        // A frame that was already buffered counts as 1 ns.
        c.received(1_000, 0);
        assert!((c.take(0).unwrap().bps - 1e12).abs() < 1.0);
    }

    #[test]
    fn a_server_busier_than_its_link_is_as_fast_as_its_cpu() {
        let mut c = Capacity::default();
        // 5 MB in 50 ms on the link; handling took 20 ms: the link is the limit.
        c.received(5_000_000, 50_000_000);
        assert!((c.take(20_000).unwrap().bps - 100e6).abs() < 1e-6);
        // The same frames, but a CPU slowed by other work spent 200 ms on them: 25 MB/s.
        c.received(5_000_000, 50_000_000);
        assert!((c.take(200_000).unwrap().bps - 25e6).abs() < 1e-6);
        // Busy time without frames measures nothing.
        assert_eq!(c.take(200_000), None);
    }
}
