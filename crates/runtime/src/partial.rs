//! The memory that partial frames hold, bounded per node (docs/PROTOCOL.md §8).
//!
//! A frame's payload buffer is allocated once its header passed the checks, before its
//! bytes come; a peer that sends most of a large frame and then trickles (one byte per
//! stall timeout) pins that buffer. Every payload buffer is therefore reserved against
//! one budget per process, [`MAX_PARTIAL_BYTES`] by default (`--max-partial-mib`,
//! [`set_max_partial_bytes`]), from its header until its last byte came. A frame whose
//! reservation would pass the budget takes the place of the partial frames that went
//! longest without a byte ([`PartialFrames::reserve`]): their connections are closed and
//! logged, as the oldest handshake is when every handshake place is taken.
//!
//! Why the least recently progressed rather than the one that began longest ago: an
//! honest large frame on a slow link (a 64 MiB block snapshot over a capped link) began
//! long ago but keeps coming, while a trickling peer's frame is the one that waits for
//! its next byte; honest frames that keep coming are never behind a trickling one, and
//! a new frame never waits for room.
//!
//! The accounting is a plain struct ([`PartialFrames`]); the process-wide budget that
//! every [`crate::conn::FrameReader`] reserves from wraps it with the notifications that
//! tell an evicted reader to give up ([`reserve`]).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;

/// The most bytes that partial frames (payload buffers whose frame has not fully come)
/// may hold in one process by default: 1,024 MiB, 16 frames of the largest payload
/// (64 MiB). `--max-partial-mib` sets it ([`set_max_partial_bytes`]).
pub const MAX_PARTIAL_BYTES: u64 = 1024 << 20;

/// One partial frame's reservation.
#[derive(Debug)]
struct Frame<T> {
    bytes: u64,
    /// When a byte of it last came, in the budget's own order of events.
    tick: u64,
    tag: T,
}

/// The reservations of the partial frames of one process, and its budget. `T` is what
/// tells an evicted frame's reader to give up (the runtime's notification; `()` in tests).
#[derive(Debug)]
pub struct PartialFrames<T> {
    max: u64,
    used: u64,
    /// The next id and progress tick (one counter: both only grow).
    next: u64,
    frames: BTreeMap<u64, Frame<T>>,
    /// The frames by when a byte of theirs last came: the first went longest without one.
    by_progress: BTreeSet<(u64, u64)>,
}

impl<T> PartialFrames<T> {
    /// A budget of `max` bytes (a frame larger than it is still admitted, alone).
    pub const fn new(max: u64) -> Self {
        Self { max, used: 0, next: 0, frames: BTreeMap::new(), by_progress: BTreeSet::new() }
    }

    /// Changes the budget (it applies from the next reservation).
    pub fn set_max(&mut self, max: u64) {
        self.max = max;
    }

    /// The budget, bytes.
    pub fn max(&self) -> u64 {
        self.max
    }

    /// The bytes reserved now.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// The partial frames that hold a reservation.
    pub fn len(&self) -> usize {
        self.frames.len()
    }

    /// Whether no partial frame holds a reservation.
    pub fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }

    /// Reserves `bytes` for a frame whose header just passed its checks (`tag` tells its
    /// reader to give up if it is evicted later). When the budget would be passed, the
    /// frames that went longest without a byte are evicted (their reservations released)
    /// until it fits, or none is left: returns the new frame's id and the tags of the
    /// evicted frames, whose readers must give up.
    pub fn reserve(&mut self, bytes: u64, tag: T) -> (u64, Vec<T>) {
        let mut evicted = Vec::new();
        while self.used.saturating_add(bytes) > self.max {
            let Some((_, id)) = self.by_progress.first().copied() else { break };
            if let Some(f) = self.release(id) {
                evicted.push(f);
            }
        }
        let id = self.tick();
        self.used = self.used.saturating_add(bytes);
        self.by_progress.insert((id, id));
        self.frames.insert(id, Frame { bytes, tick: id, tag });
        (id, evicted)
    }

    /// Bytes of frame `id` came: it is the last to be evicted now.
    pub fn progressed(&mut self, id: u64) {
        let tick = self.tick();
        if let Some(f) = self.frames.get_mut(&id) {
            self.by_progress.remove(&(f.tick, id));
            f.tick = tick;
            self.by_progress.insert((tick, id));
        }
    }

    /// Frame `id` came whole, failed, or was evicted: its reservation is released.
    /// Returns its tag if it still held one.
    pub fn release(&mut self, id: u64) -> Option<T> {
        let f = self.frames.remove(&id)?;
        self.by_progress.remove(&(f.tick, id));
        self.used = self.used.saturating_sub(f.bytes);
        Some(f.tag)
    }

    fn tick(&mut self) -> u64 {
        self.next += 1;
        self.next
    }
}

/// This process's partial frames.
static BUDGET: Mutex<PartialFrames<Arc<Notify>>> = Mutex::new(PartialFrames::new(MAX_PARTIAL_BYTES));

fn budget() -> MutexGuard<'static, PartialFrames<Arc<Notify>>> {
    BUDGET.lock().unwrap_or_else(|e| e.into_inner())
}

/// Sets this process's budget for partial frames (`--max-partial-mib`); call it once at
/// the start of a node.
pub fn set_max_partial_bytes(max: u64) {
    budget().set_max(max);
}

/// This process's budget for partial frames, bytes ([`MAX_PARTIAL_BYTES`] unless set).
pub fn max_partial_bytes() -> u64 {
    budget().max()
}

/// The bytes this process's partial frames hold now.
pub fn partial_bytes() -> u64 {
    budget().used()
}

/// A partial frame's reservation in this process's budget, released when dropped.
#[derive(Debug)]
pub struct Reservation {
    id: u64,
    evicted: Arc<Notify>,
}

impl Reservation {
    /// Bytes of the frame came (it is the last to be evicted now).
    pub fn progressed(&self) {
        budget().progressed(self.id);
    }

    /// Resolves once the frame was evicted (its reader gives up and closes the connection).
    pub async fn evicted(&self) {
        self.evicted.notified().await;
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        budget().release(self.id);
    }
}

/// Reserves `bytes` for a frame's payload in this process's budget; the frames it evicts
/// are told to give up (their readers close their connections, and log it).
pub fn reserve(bytes: u64) -> Reservation {
    let evicted = Arc::new(Notify::new());
    let (id, gone) = budget().reserve(bytes, evicted.clone());
    for g in gone {
        // `notify_one` keeps a permit: the reader sees it even before it waits.
        g.notify_one();
    }
    Reservation { id, evicted }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_past_the_budget_evicts_the_ones_that_went_longest_without_a_byte() {
        let mut b = PartialFrames::new(100);
        let (a, gone) = b.reserve(40, 'a');
        assert!(gone.is_empty());
        let (c, _) = b.reserve(40, 'c');
        // `a` began first but keeps coming; `c` stalls.
        b.progressed(a);
        assert_eq!(b.used(), 80);
        let (_, gone) = b.reserve(40, 'd');
        assert_eq!(gone, ['c'], "the frame that went longest without a byte goes, not the oldest");
        assert_eq!((b.used(), b.len()), (80, 2));
        assert_eq!(b.release(c), None, "already released by its eviction");
        // Two at once when one is not enough.
        let (_, gone) = b.reserve(100, 'e');
        assert_eq!(gone, ['a', 'd']);
        assert_eq!((b.used(), b.len()), (100, 1));
    }

    #[test]
    fn frames_within_the_budget_evict_nothing_and_release_what_they_reserved() {
        let mut b = PartialFrames::new(100);
        let ids: Vec<u64> = (0..10).map(|_| b.reserve(10, ()).0).collect();
        assert_eq!(b.used(), 100);
        for id in ids {
            assert_eq!(b.release(id), Some(()));
        }
        assert_eq!((b.used(), b.len()), (0, 0));
        assert!(b.is_empty());
    }

    #[test]
    fn a_frame_larger_than_the_budget_is_admitted_alone() {
        let mut b = PartialFrames::new(100);
        b.reserve(60, 1);
        let (id, gone) = b.reserve(150, 2);
        assert_eq!(gone, [1]);
        assert_eq!(b.used(), 150);
        b.release(id);
        assert_eq!(b.used(), 0);
    }

    #[tokio::test]
    async fn an_evicted_reservation_is_told_and_a_release_gives_its_bytes_back() {
        // The process-wide budget, as a reader uses it (the only test that touches it).
        set_max_partial_bytes(1 << 30);
        let first = reserve(600 << 20);
        let _second = reserve(600 << 20);
        tokio::time::timeout(std::time::Duration::from_secs(5), first.evicted()).await.expect("told at once");
        assert_eq!(partial_bytes(), 600 << 20, "the evicted one no longer counts");
        drop(_second);
        drop(first);
        assert_eq!(partial_bytes(), 0);
        set_max_partial_bytes(MAX_PARTIAL_BYTES);
    }
}
