//! Virtual time's event queue, ordered by time and, among equal times, by the order
//! events were scheduled (FIFO), so a run is a function of its inputs alone.
//!
//! Time in a simulation only moves forward, so the queue is a radix heap (a monotone
//! priority queue): an event sits in the bucket of the highest bit where its time
//! differs from `last`, the time of the front. That invariant holds for every event at
//! every moment, so events of equal time always share a bucket, and since buckets keep
//! their order (appends, order-preserving redistribution) equal times stay FIFO. The
//! front bucket (time == `last`) is a queue. Pushes are O(1); a pop is O(1) amortised
//! per bit of time, with sequential memory access instead of a binary heap's cache
//! misses at 100,000s of events in flight.

use std::collections::VecDeque;

/// A time-ordered queue of `T`, FIFO among equal times. Times earlier than the last
/// event taken out count as that time (the past is now).
#[derive(Debug)]
pub struct EventQueue<T> {
    /// Events at time `last`, in the order they were scheduled.
    front: VecDeque<T>,
    /// Bucket i (1..=64) at index i - 1: events whose time differs from `last` first at
    /// bit i - 1.
    buckets: Vec<Vec<(u64, T)>>,
    /// Bit i - 1 set: bucket i holds something.
    nonempty: u64,
    last: u64,
    /// The time of the last event taken out: nothing is scheduled before it.
    floor: u64,
    len: usize,
    seq: u64,
}

impl<T> Default for EventQueue<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> EventQueue<T> {
    /// An empty queue.
    pub fn new() -> Self {
        Self {
            front: VecDeque::new(),
            buckets: (0..64).map(|_| Vec::new()).collect(),
            nonempty: 0,
            last: 0,
            floor: 0,
            len: 0,
            seq: 0,
        }
    }

    /// Schedules `event` at `time` (after every event already scheduled at that time).
    pub fn push(&mut self, time: u64, event: T) {
        let time = time.max(self.floor);
        self.seq += 1;
        self.len += 1;
        if time < self.last {
            // Only after a peek past this time (a run that stopped at a limit): re-bucket
            // everything around the new front time, keeping each bucket's order.
            let old = self.last;
            self.last = time;
            self.nonempty = 0;
            let front: Vec<T> = self.front.drain(..).collect();
            let mut all: Vec<(u64, T)> = Vec::new();
            for b in self.buckets.iter_mut() {
                all.append(b);
            }
            // The old front is later than `time` and earlier than every bucketed event.
            for e in front {
                self.put(old, e);
            }
            for (t, e) in all {
                self.put(t, e);
            }
        }
        self.put(time, event);
    }

    fn put(&mut self, time: u64, event: T) {
        if time == self.last {
            self.front.push_back(event);
        } else {
            let b = 64 - (time ^ self.last).leading_zeros() as usize; // 1..=64
            self.nonempty |= 1 << (b - 1);
            self.buckets[b - 1].push((time, event));
        }
    }

    /// The time of the next event, if any (it moves the next events to the front).
    pub fn peek_time(&mut self) -> Option<u64> {
        self.settle()?;
        Some(self.last)
    }

    /// Takes the next event out: its time and the event.
    pub fn pop(&mut self) -> Option<(u64, T)> {
        self.settle()?;
        let event = self.front.pop_front()?;
        self.len -= 1;
        self.floor = self.last;
        Some((self.last, event))
    }

    /// Moves the earliest events to the front (their time becomes `last`); `None` if empty.
    fn settle(&mut self) -> Option<()> {
        if self.front.is_empty() {
            if self.nonempty == 0 {
                return None;
            }
            let i = self.nonempty.trailing_zeros() as usize;
            self.nonempty &= !(1 << i);
            let mut moving = std::mem::take(&mut self.buckets[i]);
            self.last = moving.iter().map(|(t, _)| *t).min()?;
            for (time, event) in moving.drain(..) {
                self.put(time, event);
            }
            // Keep the bucket's allocation for later pushes.
            if self.buckets[i].capacity() < moving.capacity() {
                self.buckets[i] = moving;
            }
        }
        Some(())
    }

    /// Number of events scheduled.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True if nothing is scheduled.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of events scheduled since the queue was made.
    pub fn scheduled(&self) -> u64 {
        self.seq
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn events_come_out_by_time_and_fifo_among_equal_times() {
        let mut q = EventQueue::new();
        for (t, e) in [(5, "c"), (1, "a"), (5, "d"), (3, "b"), (5, "e"), (0, "z")] {
            q.push(t, e);
        }
        let mut out = Vec::new();
        while let Some((t, e)) = q.pop() {
            out.push((t, e));
            if e == "a" {
                q.push(5, "f"); // scheduled later at an equal time: comes after c, d, e
                q.push(0, "past"); // in the past: now, after everything already due now
                assert_eq!(q.peek_time(), Some(1));
            }
            if e == "b" {
                assert_eq!(q.peek_time(), Some(5));
                q.push(4, "after a peek"); // earlier than the peeked event, later than now
            }
        }
        assert_eq!(
            out,
            [(0, "z"), (1, "a"), (1, "past"), (3, "b"), (4, "after a peek"), (5, "c"), (5, "d"), (5, "e"), (5, "f")]
        );
        assert!(q.is_empty());
        assert_eq!(q.scheduled(), 9);
    }

    proptest! {
        /// The radix heap takes events out in the order a sort by (time, push order) gives.
        #[test]
        fn pops_in_time_then_push_order(steps in proptest::collection::vec((0u64..3, 0u64..1_000_000, 0u8..4), 1..300)) {
            let mut q = EventQueue::new();
            let mut model: Vec<(u64, u64)> = Vec::new(); // (time, push index)
            let (mut now, mut pushed, mut out, mut want) = (0u64, 0u64, Vec::new(), Vec::new());
            for (pops, delay, burst) in steps {
                for _ in 0..=burst {
                    let t = now + delay % (1 << (delay % 40));
                    q.push(t, pushed);
                    model.push((t, pushed));
                    pushed += 1;
                }
                if burst == 3 {
                    model.sort();
                    prop_assert_eq!(q.peek_time(), model.first().map(|m| m.0));
                }
                for _ in 0..pops {
                    model.sort();
                    if model.is_empty() { break; }
                    let (t, i) = model.remove(0);
                    want.push((t, i));
                    let got = q.pop().unwrap();
                    now = got.0;
                    out.push(got);
                }
            }
            prop_assert_eq!(out, want);
            prop_assert_eq!(q.len(), model.len());
        }
    }
}
