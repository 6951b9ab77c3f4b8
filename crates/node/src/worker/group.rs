//! One push per host (issue 37): the workers `elasticps launch` starts together on one
//! host of a job across hosts form a group. Local rank 0, the leader, sums the group's
//! gradients and pushes the sum; every other member sends the leader its gradient over
//! loopback, pushes "no gradient" to the same blocks itself, and takes the values the
//! leader pulled instead of pulling them across the link.
//!
//! Why the members still push, empty: every block keeps counting each worker's clock, so
//! the quorum, a lost or restarted worker and the sync policies stay what they are, and
//! aggregate mode still divides the clock's sum by the number of pushes, which is the
//! number of workers: the step the servers take from one sum per host is the step they
//! take from every worker's push (bit for bit when the gradients' sums are exact, as
//! integers are). An empty push is a header: the bytes across hosts per step are one
//! gradient and one copy of the values per host, not one per worker.
//!
//! [`Leader`] holds the leader's rules, without bytes (its world keeps the gradients and
//! the values, `elasticps-runtime`'s `client::group`):
//! - who may join: local ranks `1..size`, each once, nobody before it said who it is;
//! - a member has at most one gradient in hand per tensor, and it is acknowledged once
//!   the leader summed it (so a member runs at most one round ahead, and what it can make
//!   the leader hold is one model's gradient);
//! - the leader's first round waits for every member to join, for
//!   [`GROUP_JOIN_TIMEOUT_US`] at most (then the group goes on without those that did not,
//!   and refuses them later);
//! - the leader's round ([`Input::Gather`]) goes on once every member's gradient of its
//!   clock is in hand for the tensors it pushes ([`Effect::Gathered`], members in local
//!   rank order: the sum's order is fixed), or without a member that closed or stayed
//!   silent past [`GROUP_GATHER_TIMEOUT_US`] (that member is dropped, with why);
//! - a member's request for a tensor's values at clock c is answered once the leader
//!   pulled values of clock c or later ([`Input::Published`]); one request per tensor.
//!
//! A member's own rules (dial the leader, send, wait for the acknowledgement and the
//! values within the request timeout) are in the runtime's `client::group`, on
//! [`GROUP_JOIN_TIMEOUT_US`] and the request timeout.

use std::collections::{BTreeMap, BTreeSet};

use elasticps_core::sync::Clock;

use crate::ConnId;
pub use crate::timing::{GROUP_END_TIMEOUT_US, GROUP_GATHER_TIMEOUT_US, GROUP_JOIN_TIMEOUT_US};

/// What happened at the leader.
#[derive(Debug)]
pub enum Input<'a> {
    /// A member's connection said who it is (`JoinGroup { local_rank }`).
    Join {
        /// Its connection.
        conn: ConnId,
        /// The local rank it says it has.
        local: u32,
    },
    /// A member's gradient of `tensor` at `clock` arrived (the world keeps it).
    Gradient {
        /// The member's connection.
        conn: ConnId,
        /// The tensor.
        tensor: u32,
        /// The clock.
        clock: Clock,
    },
    /// A member asks for the values of `tensor` at `clock` or later.
    Wants {
        /// The member's connection.
        conn: ConnId,
        /// The tensor.
        tensor: u32,
        /// The oldest clock it takes.
        clock: Clock,
    },
    /// A connection closed (or failed).
    Closed {
        /// The connection.
        conn: ConnId,
    },
    /// The leader's round pushes `tensors` at `clock`: it wants every member's gradient
    /// of them.
    Gather {
        /// The clock pushed.
        clock: Clock,
        /// The tensors pushed.
        tensors: &'a [u32],
    },
    /// The leader pulled the values of `tensors` at `clock` (the world keeps them).
    Published {
        /// The clock pulled.
        clock: Clock,
        /// The tensors pulled.
        tensors: &'a [u32],
    },
    /// A member's connection sent what a member never sends (`kind`).
    Unexpected {
        /// The connection.
        conn: ConnId,
        /// What it sent.
        kind: &'static str,
    },
    /// The leader's own work is done: it ends once every member left, or
    /// [`GROUP_END_TIMEOUT_US`] after this ([`Effect::Over`]).
    Ending,
    /// [`Leader::poll_timeout`] came.
    Timeout,
}

/// What the leader's world carries out.
#[derive(Debug, PartialEq, Eq)]
pub enum Effect {
    /// Answer a `JoinGroup`: welcome.
    Welcome {
        /// The member's connection.
        conn: ConnId,
    },
    /// Answer with an error saying `why`, then close the connection (its gradients in
    /// hand are dropped).
    Refuse {
        /// The connection.
        conn: ConnId,
        /// Why.
        why: String,
    },
    /// Every member's gradient of the gathered tensors is in hand: the world hands the
    /// leader's round these members' gradients of `clock` (of each tensor gathered),
    /// `members` in local rank order, and forgets them; their acknowledgements follow as
    /// [`Effect::Ack`].
    Gathered {
        /// The clock gathered.
        clock: Clock,
        /// The members whose gradients are summed, in local rank order.
        members: Vec<ConnId>,
    },
    /// Acknowledge a member's gradient of `tensor` at `clock` (it was summed).
    Ack {
        /// The member's connection.
        conn: ConnId,
        /// The tensor.
        tensor: u32,
        /// The clock.
        clock: Clock,
    },
    /// Send a member the values in hand of `tensor` (their clock answers its request).
    Send {
        /// The member's connection.
        conn: ConnId,
        /// The tensor.
        tensor: u32,
    },
    /// The group is over ([`Input::Ending`]): `left` members had not left yet.
    Over {
        /// The local ranks still connected (the end wait ran out).
        left: Vec<u32>,
    },
}

/// A member that joined.
#[derive(Debug)]
struct Member {
    local: u32,
    /// The clock of the gradient in hand, per tensor.
    grads: BTreeMap<u32, Clock>,
    /// The clock asked for, per tensor, not yet answered.
    wants: BTreeMap<u32, Clock>,
}

/// The leader's round waiting for the members' gradients.
#[derive(Debug)]
struct Gathering {
    clock: Clock,
    tensors: Vec<u32>,
    since_us: u64,
}

/// The leader's rules (see the module).
#[derive(Debug)]
pub struct Leader {
    size: u32,
    tensors: u32,
    gather_timeout_us: u64,
    members: BTreeMap<ConnId, Member>,
    gathering: Option<Gathering>,
    /// The clock of the values in hand, per tensor.
    published: Vec<Option<Clock>>,
    /// Since when the leader's own work is done ([`Input::Ending`]).
    ending_since: Option<u64>,
    /// [`Effect::Over`] was said.
    over: bool,
    /// Until when the leader waits for members to join (set by its first round); `None`
    /// once the wait is over.
    join_deadline: Option<u64>,
    /// Whether the join wait began.
    join_began: bool,
    /// Local ranks that joined, and those that left or were dropped since.
    joined: BTreeSet<u32>,
}

impl Leader {
    /// The leader of a group of `size` workers (itself included) over a model of
    /// `tensors` tensors.
    pub fn new(size: u32, tensors: u32) -> Self {
        Self {
            size,
            tensors,
            gather_timeout_us: GROUP_GATHER_TIMEOUT_US,
            members: BTreeMap::new(),
            gathering: None,
            published: vec![None; tensors as usize],
            ending_since: None,
            over: false,
            join_deadline: None,
            join_began: false,
            joined: BTreeSet::new(),
        }
    }

    /// Waits this long for a member's gradient instead of [`GROUP_GATHER_TIMEOUT_US`].
    pub fn with_gather_timeout(mut self, us: u64) -> Self {
        self.gather_timeout_us = us;
        self
    }

    /// The members that joined, in local rank order.
    pub fn members(&self) -> Vec<(u32, ConnId)> {
        let mut m: Vec<(u32, ConnId)> = self.members.iter().map(|(c, m)| (m.local, *c)).collect();
        m.sort_unstable();
        m
    }

    /// Whether the leader's round waits for members' gradients.
    pub fn is_gathering(&self) -> bool {
        self.gathering.is_some()
    }

    /// Hands the leader one input at `now_us`; its effects are appended to `out`.
    pub fn handle_into(&mut self, now_us: u64, input: Input<'_>, out: &mut Vec<Effect>) {
        match input {
            Input::Join { conn, local } => self.join(conn, local, out),
            Input::Gradient { conn, tensor, clock } => {
                let Some(m) = self.member_of(conn, tensor, "a gradient", out) else { return };
                if let Some(held) = m.grads.get(&tensor) {
                    let why = format!(
                        "a second gradient of tensor {tensor} (clock {clock}) before the first (clock {held}) was summed"
                    );
                    return self.drop_member(conn, why, out);
                }
                m.grads.insert(tensor, clock);
                self.try_gather(now_us, out);
            }
            Input::Wants { conn, tensor, clock } => {
                let in_hand = self.published.get(tensor as usize).copied().flatten().is_some_and(|p| p >= clock);
                let Some(m) = self.member_of(conn, tensor, "a request for values", out) else { return };
                if m.wants.contains_key(&tensor) {
                    let why = format!("a second request for tensor {tensor} before the first was answered");
                    return self.drop_member(conn, why, out);
                }
                if in_hand {
                    out.push(Effect::Send { conn, tensor });
                } else {
                    m.wants.insert(tensor, clock);
                }
            }
            Input::Closed { conn } => {
                if let Some(m) = self.members.remove(&conn) {
                    if self.ending_since.is_none() {
                        tracing::warn!(local_rank = m.local, "host group member left; the leader goes on without it");
                    }
                    self.try_gather(now_us, out);
                    self.try_end(now_us, out);
                }
            }
            Input::Unexpected { conn, kind } => {
                self.drop_member(conn, format!("a member never sends {kind} to its leader"), out);
            }
            Input::Ending => {
                self.ending_since.get_or_insert(now_us);
                self.try_end(now_us, out);
            }
            Input::Gather { clock, tensors } => {
                debug_assert!(self.gathering.is_none(), "one leader round at a time");
                if !self.join_began {
                    self.join_began = true;
                    if self.joined.len() as u32 + 1 < self.size {
                        self.join_deadline = Some(now_us.saturating_add(GROUP_JOIN_TIMEOUT_US));
                    }
                }
                self.gathering = Some(Gathering { clock, tensors: tensors.to_vec(), since_us: now_us });
                self.try_gather(now_us, out);
            }
            Input::Published { clock, tensors } => {
                for &t in tensors {
                    if let Some(p) = self.published.get_mut(t as usize) {
                        *p = Some(p.map_or(clock, |p| p.max(clock)));
                    }
                }
                for (conn, m) in &mut self.members {
                    m.wants.retain(|t, want| {
                        let answered = self.published[*t as usize].is_some_and(|p| p >= *want);
                        if answered {
                            out.push(Effect::Send { conn: *conn, tensor: *t });
                        }
                        !answered
                    });
                }
            }
            Input::Timeout => {
                self.try_end(now_us, out);
                if self.join_deadline.is_some_and(|d| now_us >= d) {
                    let never: Vec<u32> = (1..self.size).filter(|l| !self.joined.contains(l)).collect();
                    tracing::error!(?never, "host group members never joined; the group goes on without them");
                    self.join_deadline = None;
                    self.try_gather(now_us, out);
                }
                let Some(g) = &self.gathering else { return };
                if now_us < g.since_us.saturating_add(self.gather_timeout_us) {
                    return;
                }
                let (clock, waited_s) = (g.clock, (now_us - g.since_us) as f64 / 1e6);
                for (conn, local, missing) in self.missing() {
                    let why = format!(
                        "no gradient of tensor {missing} at clock {clock} from local rank {local} in {waited_s:.0} s"
                    );
                    self.drop_member(conn, why, out);
                }
                self.try_gather(now_us, out);
            }
        }
    }

    /// When the leader wants [`Input::Timeout`]: its round's gather deadline.
    pub fn poll_timeout(&self) -> Option<u64> {
        let gather = self.gathering.as_ref().map(|g| g.since_us.saturating_add(self.gather_timeout_us));
        let end = self.ending_since.filter(|_| !self.over).map(|s| s.saturating_add(GROUP_END_TIMEOUT_US));
        let join = self.join_deadline.filter(|_| self.gathering.is_some());
        gather.into_iter().chain(end).chain(join).min()
    }

    /// Ends the group once the leader's work is done and every member left, or the end
    /// wait ran out.
    fn try_end(&mut self, now_us: u64, out: &mut Vec<Effect>) {
        let Some(since) = self.ending_since.filter(|_| !self.over) else { return };
        if self.members.is_empty() || now_us >= since.saturating_add(GROUP_END_TIMEOUT_US) {
            let left = self.members().into_iter().map(|(l, _)| l).collect();
            self.over = true;
            out.push(Effect::Over { left });
        }
    }

    /// The member of `conn`, if it joined and `tensor` is in the model; otherwise
    /// refuses what it sent (`what`), or drops it.
    fn member_of(&mut self, conn: ConnId, tensor: u32, what: &str, out: &mut Vec<Effect>) -> Option<&mut Member> {
        if !self.members.contains_key(&conn) {
            refuse(out, conn, format!("{what} before JoinGroup"));
            return None;
        }
        if tensor >= self.tensors {
            let why = format!("tensor {tensor} is not in the model ({} tensors)", self.tensors);
            self.drop_member(conn, why, out);
            return None;
        }
        self.members.get_mut(&conn)
    }

    fn join(&mut self, conn: ConnId, local: u32, out: &mut Vec<Effect>) {
        let why = if local == 0 || local >= self.size {
            Some(format!("local rank {local} is not a member's (1..{})", self.size))
        } else if self.members.contains_key(&conn) {
            return self.drop_member(conn, "JoinGroup said twice".into(), out);
        } else if self.joined.contains(&local) {
            Some(format!("local rank {local} already joined"))
        } else if self.join_began && self.join_deadline.is_none() {
            Some(format!("local rank {local} joined too late: the group went on without it"))
        } else {
            None
        };
        match why {
            Some(why) => refuse(out, conn, why),
            None => {
                tracing::info!(local_rank = local, size = self.size, "host group member joined");
                self.members.insert(conn, Member { local, grads: BTreeMap::new(), wants: BTreeMap::new() });
                self.joined.insert(local);
                out.push(Effect::Welcome { conn });
                if self.joined.len() as u32 + 1 == self.size {
                    self.join_deadline = None;
                }
            }
        }
    }

    /// The members whose gradient of the gathered clock is missing for some tensor (the
    /// first such tensor), with their local rank.
    fn missing(&self) -> Vec<(ConnId, u32, u32)> {
        let Some(g) = &self.gathering else { return Vec::new() };
        self.members
            .iter()
            .filter_map(|(c, m)| g.tensors.iter().find(|t| m.grads.get(t) != Some(&g.clock)).map(|t| (*c, m.local, *t)))
            .collect()
    }

    /// Ends the gathering once every member's gradient is in hand. A member whose
    /// gradient of a gathered tensor is of another clock is out of step: dropped.
    fn try_gather(&mut self, _now_us: u64, out: &mut Vec<Effect>) {
        let Some(g) = &self.gathering else { return };
        let clock = g.clock;
        let out_of_step: Vec<(ConnId, String)> = self
            .members
            .iter()
            .filter_map(|(c, m)| {
                g.tensors.iter().find_map(|t| {
                    m.grads.get(t).filter(|held| **held != clock).map(|held| {
                        (*c, format!("its gradient of tensor {t} is of clock {held}, the leader pushes clock {clock}"))
                    })
                })
            })
            .collect();
        for (conn, why) in out_of_step {
            self.drop_member(conn, why, out);
        }
        if !self.missing().is_empty() || self.join_deadline.is_some() {
            return;
        }
        let g = self.gathering.take().expect("checked above");
        let members: Vec<ConnId> = self.members().into_iter().map(|(_, c)| c).collect();
        out.push(Effect::Gathered { clock, members: members.clone() });
        for conn in members {
            let m = self.members.get_mut(&conn).expect("listed above");
            for &tensor in &g.tensors {
                m.grads.remove(&tensor);
                out.push(Effect::Ack { conn, tensor, clock });
            }
        }
    }

    fn drop_member(&mut self, conn: ConnId, why: String, out: &mut Vec<Effect>) {
        if let Some(m) = self.members.remove(&conn) {
            tracing::error!(local_rank = m.local, %why, "host group member dropped");
        }
        refuse(out, conn, why);
    }
}

fn refuse(out: &mut Vec<Effect>, conn: ConnId, why: String) {
    out.push(Effect::Refuse { conn, why });
}

impl crate::Machine for Leader {
    type Input<'a> = Input<'a>;
    type Output = Effect;
    fn handle(&mut self, now_us: u64, input: Self::Input<'_>, out: &mut Vec<Self::Output>) {
        self.handle_into(now_us, input, out)
    }
    fn poll_timeout(&self) -> Option<u64> {
        Leader::poll_timeout(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(l: &mut Leader, now: u64, input: Input<'_>) -> Vec<Effect> {
        let mut out = Vec::new();
        l.handle_into(now, input, &mut out);
        out
    }

    /// A group of three over two tensors with members 1 (conn 11) and 2 (conn 12).
    fn three() -> Leader {
        let mut l = Leader::new(3, 2);
        assert_eq!(run(&mut l, 0, Input::Join { conn: 12, local: 2 }), [Effect::Welcome { conn: 12 }]);
        assert_eq!(run(&mut l, 0, Input::Join { conn: 11, local: 1 }), [Effect::Welcome { conn: 11 }]);
        l
    }

    #[test]
    fn the_round_goes_on_once_every_members_gradient_is_in_hand_in_local_rank_order() {
        let mut l = three();
        assert!(run(&mut l, 1, Input::Gradient { conn: 12, tensor: 0, clock: 0 }).is_empty());
        assert!(run(&mut l, 2, Input::Gather { clock: 0, tensors: &[0] }).is_empty(), "member 1 is missing");
        let out = run(&mut l, 3, Input::Gradient { conn: 11, tensor: 0, clock: 0 });
        assert_eq!(
            out,
            [
                Effect::Gathered { clock: 0, members: vec![11, 12] },
                Effect::Ack { conn: 11, tensor: 0, clock: 0 },
                Effect::Ack { conn: 12, tensor: 0, clock: 0 },
            ]
        );
        assert!(!l.is_gathering());
        assert_eq!(l.poll_timeout(), None);
        // The next clock's gradient is taken once the first was summed.
        assert!(run(&mut l, 4, Input::Gradient { conn: 11, tensor: 0, clock: 1 }).is_empty());
    }

    #[test]
    fn a_member_that_closes_or_stays_silent_is_gone_on_without() {
        let mut l = three();
        run(&mut l, 0, Input::Gradient { conn: 11, tensor: 1, clock: 4 });
        assert!(run(&mut l, 10, Input::Gather { clock: 4, tensors: &[1] }).is_empty());
        let out = run(&mut l, 20, Input::Closed { conn: 12 });
        assert_eq!(out[0], Effect::Gathered { clock: 4, members: vec![11] });

        let mut l = three().with_gather_timeout(1_000);
        run(&mut l, 0, Input::Gradient { conn: 11, tensor: 0, clock: 0 });
        run(&mut l, 10, Input::Gather { clock: 0, tensors: &[0] });
        assert_eq!(l.poll_timeout(), Some(1_010));
        assert!(run(&mut l, 500, Input::Timeout).is_empty(), "not yet");
        let out = run(&mut l, 1_010, Input::Timeout);
        assert!(matches!(&out[0], Effect::Refuse { conn: 12, why } if why.contains("local rank 2")), "{out:?}");
        assert_eq!(out[1], Effect::Gathered { clock: 0, members: vec![11] });
        assert_eq!(l.members(), [(1, 11)]);
    }

    #[test]
    fn what_a_member_may_make_the_leader_hold_is_bounded() {
        let mut l = three();
        // Nobody may send before joining, join twice, as the leader or past the group.
        assert!(matches!(
            &run(&mut l, 0, Input::Gradient { conn: 9, tensor: 0, clock: 0 })[..],
            [Effect::Refuse { conn: 9, .. }]
        ));
        for (conn, local) in [(9, 0), (9, 3), (9, 1), (11, 2)] {
            let out = run(&mut l, 0, Input::Join { conn, local });
            assert!(matches!(&out[..], [Effect::Refuse { .. }]), "{conn} as {local}: {out:?}");
        }
        // A second gradient of a tensor before the first was summed drops the member.
        run(&mut l, 0, Input::Gradient { conn: 12, tensor: 0, clock: 0 });
        let out = run(&mut l, 0, Input::Gradient { conn: 12, tensor: 0, clock: 1 });
        assert!(matches!(&out[..], [Effect::Refuse { conn: 12, .. }]), "{out:?}");
        assert_eq!(l.members().len(), 0, "11 was refused a second join: dropped too");
        let mut l = three();
        let out = run(&mut l, 0, Input::Gradient { conn: 12, tensor: 2, clock: 0 });
        assert!(matches!(&out[..], [Effect::Refuse { conn: 12, why }] if why.contains("not in the model")), "{out:?}");
        // So does a second request for a tensor, and a gradient of another clock.
        let mut l = three();
        run(&mut l, 0, Input::Wants { conn: 11, tensor: 1, clock: 3 });
        assert!(matches!(&run(&mut l, 0, Input::Wants { conn: 11, tensor: 1, clock: 3 })[..], [Effect::Refuse { .. }]));
        run(&mut l, 0, Input::Gradient { conn: 12, tensor: 0, clock: 5 });
        let out = run(&mut l, 0, Input::Gather { clock: 6, tensors: &[0] });
        assert!(
            matches!(&out[..], [Effect::Refuse { conn: 12, why }, Effect::Gathered { .. }] if why.contains("clock 5")),
            "{out:?}"
        );
    }

    #[test]
    fn a_request_for_values_is_answered_once_values_of_its_clock_or_later_are_in_hand() {
        let mut l = three();
        assert!(run(&mut l, 0, Input::Wants { conn: 11, tensor: 0, clock: 2 }).is_empty());
        assert!(run(&mut l, 0, Input::Published { clock: 1, tensors: &[0, 1] }).is_empty(), "too old");
        assert_eq!(
            run(&mut l, 0, Input::Published { clock: 2, tensors: &[0] }),
            [Effect::Send { conn: 11, tensor: 0 }]
        );
        assert_eq!(
            run(&mut l, 0, Input::Wants { conn: 12, tensor: 0, clock: 1 }),
            [Effect::Send { conn: 12, tensor: 0 }]
        );
        assert!(run(&mut l, 0, Input::Wants { conn: 12, tensor: 1, clock: 2 }).is_empty());
        assert!(run(&mut l, 0, Input::Published { clock: 2, tensors: &[0] }).is_empty(), "another tensor");
    }

    #[test]
    fn the_first_round_waits_for_every_member_to_join_and_not_forever() {
        let mut l = Leader::new(3, 1);
        run(&mut l, 0, Input::Join { conn: 11, local: 1 });
        run(&mut l, 0, Input::Gradient { conn: 11, tensor: 0, clock: 0 });
        assert!(run(&mut l, 5, Input::Gather { clock: 0, tensors: &[0] }).is_empty(), "local rank 2 has not joined");
        assert_eq!(l.poll_timeout(), Some(5 + GROUP_JOIN_TIMEOUT_US));
        let out = run(&mut l, 5 + GROUP_JOIN_TIMEOUT_US, Input::Timeout);
        assert_eq!(out[0], Effect::Gathered { clock: 0, members: vec![11] }, "{out:?}");
        let out = run(&mut l, 6 + GROUP_JOIN_TIMEOUT_US, Input::Join { conn: 12, local: 2 });
        assert!(matches!(&out[..], [Effect::Refuse { conn: 12, why }] if why.contains("too late")), "{out:?}");
        // On time, it is waited for.
        let mut l = Leader::new(2, 1);
        assert!(run(&mut l, 5, Input::Gather { clock: 0, tensors: &[0] }).is_empty());
        run(&mut l, 6, Input::Join { conn: 11, local: 1 });
        let out = run(&mut l, 7, Input::Gradient { conn: 11, tensor: 0, clock: 0 });
        assert_eq!(out[0], Effect::Gathered { clock: 0, members: vec![11] });
    }

    #[test]
    fn the_group_ends_once_its_members_left_or_the_end_wait_ran_out() {
        let mut l = three();
        assert!(run(&mut l, 0, Input::Ending).is_empty());
        assert!(run(&mut l, 1, Input::Closed { conn: 11 }).is_empty());
        assert_eq!(run(&mut l, 2, Input::Closed { conn: 12 }), [Effect::Over { left: vec![] }]);
        let mut l = three();
        run(&mut l, 10, Input::Ending);
        assert_eq!(l.poll_timeout(), Some(10 + GROUP_END_TIMEOUT_US));
        assert_eq!(run(&mut l, 10 + GROUP_END_TIMEOUT_US, Input::Timeout), [Effect::Over { left: vec![1, 2] }]);
        assert!(run(&mut l, u64::MAX - 1, Input::Timeout).is_empty(), "over once");
    }
}
