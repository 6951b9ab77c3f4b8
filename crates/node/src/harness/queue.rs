//! Virtual time's event queue: a binary heap ordered by (time, sequence number), so
//! events at the same time come out in the order they were scheduled (FIFO) and a run
//! is a function of its inputs alone.
//!
//! The heap holds 24-byte keys; the events themselves sit in a slab with a free list,
//! so sifting moves no message.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// A time-ordered queue of `T`, FIFO among equal times.
#[derive(Debug)]
pub struct EventQueue<T> {
    heap: BinaryHeap<Reverse<(u64, u64, u32)>>,
    slab: Vec<Option<T>>,
    free: Vec<u32>,
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
        Self { heap: BinaryHeap::new(), slab: Vec::new(), free: Vec::new(), seq: 0 }
    }

    /// Schedules `event` at `time` (after every event already scheduled at that time).
    pub fn push(&mut self, time: u64, event: T) {
        let slot = match self.free.pop() {
            Some(i) => {
                self.slab[i as usize] = Some(event);
                i
            }
            None => {
                self.slab.push(Some(event));
                (self.slab.len() - 1) as u32
            }
        };
        self.heap.push(Reverse((time, self.seq, slot)));
        self.seq += 1;
    }

    /// The time of the next event, if any.
    pub fn peek_time(&self) -> Option<u64> {
        self.heap.peek().map(|Reverse((t, _, _))| *t)
    }

    /// Takes the next event out: its time and the event.
    pub fn pop(&mut self) -> Option<(u64, T)> {
        let Reverse((time, _, slot)) = self.heap.pop()?;
        self.free.push(slot);
        self.slab[slot as usize].take().map(|e| (time, e))
    }

    /// Number of events scheduled.
    pub fn len(&self) -> usize {
        self.heap.len()
    }

    /// True if nothing is scheduled.
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    /// Number of events scheduled since the queue was made (the next sequence number).
    pub fn scheduled(&self) -> u64 {
        self.seq
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            }
        }
        assert_eq!(out, [(0, "z"), (1, "a"), (3, "b"), (5, "c"), (5, "d"), (5, "e"), (5, "f")]);
        assert!(q.is_empty());
        assert_eq!(q.scheduled(), 7);
        assert!(q.slab.len() <= 6, "slots are reused: {}", q.slab.len());
    }
}
