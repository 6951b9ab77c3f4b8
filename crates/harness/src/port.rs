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

/// A shared link direction: per-connection queues of `T` served in turn.
#[derive(Debug)]
pub(crate) struct Port<T> {
    queues: HashMap<Key, VecDeque<T>>,
    /// Connections with something waiting, in turn order.
    turns: VecDeque<Key>,
    /// The connection whose message is on the link, and when the link is free again.
    busy: Option<(Key, u64)>,
}

impl<T> Default for Port<T> {
    fn default() -> Self {
        Self { queues: HashMap::new(), turns: VecDeque::new(), busy: None }
    }
}

impl<T> Port<T> {
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

    /// Connection `key`'s message is on the link until `until_ns`.
    pub(crate) fn occupy(&mut self, key: Key, until_ns: u64) {
        self.busy = Some((key, until_ns));
    }

    /// The link is free again.
    pub(crate) fn free(&mut self) {
        self.busy = None;
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
        port.occupy(k, 10);
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
}
