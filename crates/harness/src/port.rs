//! One direction of a node's limited link, shared by its connections: each connection's
//! messages wait in their own queue, and the link serves the connections that have one
//! waiting in turn, one whole message each.
//!
//! That is what a real node's shaper does: its token bucket grants one frame at a time to
//! each connection's reader or writer task, so frames of different connections interleave
//! round-robin. One connection's backlog (a worker's window of pushes, a server's pull
//! replies to one worker) delays another connection's message (the `PushAck` that frees
//! another worker's window, a pull sent as an answer freed room) by one message, not by
//! the whole backlog.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

/// A connection's end as a port knows it: `conn * 2 + end`.
pub(crate) type Key = u64;

/// The key of end `end` of connection `conn`.
pub(crate) fn key(conn: u32, end: u8) -> Key {
    u64::from(conn) * 2 + u64::from(end)
}

/// The connection and end a [`Key`] names.
pub(crate) fn unkey(key: Key) -> (u32, u8) {
    ((key / 2) as u32, (key % 2) as u8)
}

/// Hashes a [`Key`] with one multiplication: keys are small integers, nobody chooses them
/// against the map, and every message that waits costs a lookup or two (the default,
/// SipHash, is made for the opposite).
#[derive(Clone, Copy, Debug, Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(self.0.rotate_left(8) ^ u64::from(*b));
        }
    }

    fn write_u64(&mut self, x: u64) {
        self.0 = x.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// A shared link direction: per-connection queues of `T` served in turn.
#[derive(Debug)]
pub(crate) struct Port<T> {
    queues: HashMap<Key, VecDeque<T>, BuildHasherDefault<KeyHasher>>,
    /// Connections with something waiting, in turn order.
    turns: VecDeque<Key>,
    /// The connection whose message is on the link, and when the link is free again.
    busy: Option<(Key, u64)>,
    /// An event frees the link when its message is through ([`Port::free`]). Without one,
    /// a link whose message is through is free (nothing waited when it went on).
    wake: bool,
}

impl<T> Default for Port<T> {
    fn default() -> Self {
        Self { queues: HashMap::default(), turns: VecDeque::new(), busy: None, wake: false }
    }
}

impl<T> Port<T> {
    /// Offers `item` of connection `key` at `now`: if the link is free and nothing waits,
    /// it is given back (the caller puts it on the link: [`Port::occupy`]); else it waits
    /// in its connection's queue (and the caller makes sure an event frees the link:
    /// [`Port::wake_at`]).
    pub(crate) fn offer(&mut self, now: u64, key: Key, item: T) -> Option<T> {
        if let Some((_, until)) = self.busy
            && until <= now
            && !self.wake
        {
            self.busy = None;
        }
        if self.busy.is_none() && self.turns.is_empty() {
            return Some(item);
        }
        self.push(key, item);
        None
    }

    /// When an event must free the link (its message's end), if messages wait and none is
    /// due yet; the caller schedules it and calls [`Port::free`] then.
    pub(crate) fn wake_at(&mut self) -> Option<u64> {
        let (_, until) = self.busy?;
        if self.wake || self.turns.is_empty() {
            return None;
        }
        self.wake = true;
        Some(until)
    }

    /// Queues `item` on connection `key`'s queue; true if the link is free (the caller
    /// then puts the next message on it: [`Port::next`]).
    pub(crate) fn push(&mut self, key: Key, item: T) -> bool {
        let queue = self.queues.entry(key).or_default();
        queue.push_back(item);
        if queue.len() == 1 {
            self.turns.push_back(key);
        }
        self.busy.is_none()
    }

    /// Whether messages wait (a message going on the link then needs a wake event).
    pub(crate) fn waiting(&self) -> bool {
        !self.turns.is_empty()
    }

    /// The next message in turn, taken off its queue (its connection goes to the back of
    /// the turns if it has more); `None` if nothing waits. The caller marks the link busy
    /// ([`Port::occupy`]) if it puts the message on it.
    pub(crate) fn next(&mut self) -> Option<(Key, T)> {
        while let Some(key) = self.turns.pop_front() {
            let Some(queue) = self.queues.get_mut(&key) else { continue };
            let Some(item) = queue.pop_front() else { continue };
            if queue.is_empty() {
                self.queues.remove(&key);
            } else {
                self.turns.push_back(key);
            }
            return Some((key, item));
        }
        None
    }

    /// Connection `key`'s message is on the link until `until_ns` (`wake`: an event frees
    /// the link then, whatever waits).
    pub(crate) fn occupy(&mut self, key: Key, until_ns: u64, wake: bool) {
        self.busy = Some((key, until_ns));
        self.wake = wake;
    }

    /// The link is free again (its wake event).
    pub(crate) fn free(&mut self) {
        self.busy = None;
        self.wake = false;
    }

    /// When the link is free again, if connection `key` still has a message on it or
    /// waiting for it (a close waits for them).
    pub(crate) fn holds(&self, key: Key) -> Option<u64> {
        let (_, until) = self.busy?;
        let mine = self.busy.is_some_and(|(k, _)| k == key) || self.queues.contains_key(&key);
        mine.then_some(until)
    }

    /// Takes everything connection `key` has waiting (it is gone).
    pub(crate) fn drain(&mut self, key: Key) -> VecDeque<T> {
        self.queues.remove(&key).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_take_turns_one_message_each_and_each_stays_fifo() {
        let mut port = Port::default();
        let (a, b) = (key(1, 0), key(2, 1));
        assert_eq!(unkey(b), (2, 1));
        for i in 0..3 {
            assert!(port.push(a, ("a", i)), "the link is free");
        }
        let (k, first) = port.next().unwrap();
        port.occupy(k, 10, true);
        assert!(!port.push(b, ("b", 0)), "the link is busy");
        assert_eq!((port.holds(a), port.holds(b), port.holds(key(3, 0))), (Some(10), Some(10), None));
        port.free();
        let mut order = vec![first];
        while let Some((_, item)) = port.next() {
            order.push(item);
        }
        // b's one message waits behind one of a's, not behind a's whole backlog.
        assert_eq!(order, [("a", 0), ("a", 1), ("b", 0), ("a", 2)]);
        assert!(port.drain(a).is_empty());
    }

    #[test]
    fn a_free_link_takes_an_offer_at_once_and_a_busy_one_asks_for_a_wake_once() {
        let mut port = Port::default();
        let (a, b) = (key(1, 0), key(2, 0));
        assert_eq!(port.offer(0, a, 1), Some(1), "free: on the link now");
        port.occupy(a, 10, port.waiting());
        assert_eq!(port.offer(5, b, 2), None, "busy until 10: it waits");
        assert_eq!(port.wake_at(), Some(10));
        assert_eq!(port.offer(6, a, 3), None);
        assert_eq!(port.wake_at(), None, "one wake is due already");
        port.free();
        assert_eq!(port.next(), Some((b, 2)));
        port.occupy(b, 20, port.waiting());
        assert_eq!(port.next(), Some((a, 3)));
        port.occupy(a, 30, port.waiting());
        // Nothing waited when it went on: once it is through, the link is free without
        // an event.
        assert_eq!(port.offer(30, b, 4), Some(4));
    }
}
