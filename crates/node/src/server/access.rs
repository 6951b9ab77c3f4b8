//! Who may send what to the server: a data connection's proven identity (its `Hello`
//! and the credential it presents), and the checks beyond the authorization table.

use elasticps_core::placement::ServerId;
use elasticps_wire::{Control, Credential, ErrorCode, KeyId, Message, PeerRole};

use super::{Action, Phase, Server, Slot, error};
use crate::ConnId;
use crate::authz::{self, Class, Receiver, Verdict};

/// One data connection as the server sees it.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Conn {
    /// The key its handshake proved.
    pub(super) key: KeyId,
    /// The identity its `Hello` proved (a worker's rank, a server's id).
    pub(super) proven: Option<(PeerRole, u32)>,
}

impl Conn {
    /// The worker rank it proved, if it is a worker's.
    pub(super) fn rank(&self) -> Option<u32> {
        match self.proven {
            Some((PeerRole::Worker, r)) => Some(r),
            _ => None,
        }
    }

    /// The server id it proved, if it is a server's.
    pub(super) fn server(&self) -> Option<ServerId> {
        match self.proven {
            Some((PeerRole::Server, id)) => Some(id),
            _ => None,
        }
    }

    /// Its class in the authorization table.
    pub(super) fn class(&self) -> Class {
        Class::of(self.key, self.proven.map(|(role, _)| role))
    }
}

impl Server {
    /// The refusal of `msg` on connection `conn` (`c`), if its sender may not send it:
    /// by the authorization table (docs/PROTOCOL.md §7.1), or by a check beyond it.
    pub(super) fn refused(&self, now_us: u64, conn: ConnId, c: &Conn, msg: &Message) -> Option<Message> {
        let name = authz::name_of(msg);
        // Named only in a refusal (no allocation on the data path).
        let proven = || authz::proven_name(c.proven, c.key);
        let forbidden = match authz::check(Receiver::Server, c.class(), name) {
            Verdict::Allowed => self.sender_may_not(c, msg),
            Verdict::Forbidden => {
                let hint = if authz::check(Receiver::Server, Class::Scheduler, name) == Verdict::Allowed {
                    " (it goes to the scheduler, which sends it on to every server)"
                } else if c.proven.is_none() {
                    " (say Hello with a credential first)"
                } else {
                    ""
                };
                Some(format!(
                    "{} may not send {name} to a server{hint} (docs/PROTOCOL.md §7.1); nothing changed",
                    proven()
                ))
            }
            Verdict::NotTaken => {
                let what = format!("a server does not take {name} messages (docs/PROTOCOL.md §7.1)");
                // Well-formed but out of turn: refuse it and keep the connection (PROTOCOL.md §7).
                if self.refusal_log.admit(now_us) {
                    tracing::warn!(server = self.id, conn, %what, "request refused");
                }
                return Some(error(ErrorCode::BadRequest, what));
            }
        };
        let refused = forbidden?;
        if self.refusal_log.admit(now_us) {
            tracing::warn!(server = self.id, conn, message = name, claimed = %authz::claimed(msg), proven = %proven(), %refused, "forbidden message refused");
        }
        Some(error(ErrorCode::Forbidden, refused))
    }

    /// A `Hello` on connection `conn` (`c`): the connection proves who it is, or its
    /// credential is refused (and the connection closed if it does not hold at all).
    pub(super) fn hello(
        &mut self,
        now_us: u64,
        conn: ConnId,
        request_id: u64,
        c: Conn,
        credential: Credential,
        out: &mut Vec<Action>,
    ) -> Option<Message> {
        match self.check_credential(&c, &credential) {
            Ok(()) => {
                tracing::debug!(server = self.id, conn, peer = %credential, "connection introduced");
                self.conns.insert(conn, Conn { proven: Some((credential.role, credential.id)), ..c });
                Some(Control::Ok.into())
            }
            Err((code, message)) => {
                let proven = authz::proven_name(c.proven, c.key);
                if self.refusal_log.admit(now_us) {
                    tracing::warn!(server = self.id, conn, claimed = %credential, %proven, %message, "hello refused");
                }
                out.push(Action::Reply { conn, request_id, msg: error(code, message) });
                if code == ErrorCode::Unauthenticated {
                    self.conns.remove(&conn);
                    out.push(Action::Close { conn });
                }
                None
            }
        }
    }

    /// Whether the credential of a `Hello` on connection `c` holds: made with this
    /// cluster's secret, for this job, of a role the connection's key may be, and naming
    /// a worker of the job. `Unauthenticated` closes the connection.
    pub(super) fn check_credential(&self, c: &Conn, credential: &Credential) -> Result<(), (ErrorCode, String)> {
        let Some(own) = &self.credential else {
            return Err((ErrorCode::NotReady, "this server is not registered yet: say Hello again later".into()));
        };
        let refuse = |message: String| Err((ErrorCode::Unauthenticated, message));
        if let Err(e) = credential.verify_for(&self.secret, own.job) {
            return refuse(e.to_string());
        }
        if c.key == KeyId::Worker && credential.role != PeerRole::Worker {
            return refuse(format!("a connection of the worker secret cannot be {credential}"));
        }
        if credential.role == PeerRole::Worker
            && let Some(shard) = &self.shard
            && credential.id >= shard.config.workers
        {
            return refuse(format!("{credential} is not in this job of {} workers", shard.config.workers));
        }
        Ok(())
    }

    /// Why connection `c`'s proven server may not send `msg`, a check beyond the table: a
    /// copy of a block this server serves comes only from a server that owned the block
    /// before (a promoted backup's old primary, forwarding what it applied). A copy of a
    /// block served elsewhere is taken from any proven server: this server's placement
    /// may lag the scheduler's (it learns a promotion or a settled move by a broadcast),
    /// and refusing the block's new primary there would leave its pushes unacknowledged.
    pub(super) fn sender_may_not(&self, c: &Conn, msg: &Message) -> Option<String> {
        let sender = c.server()?;
        let block = match msg {
            Message::Control(Control::Replicate { block, .. }) | Message::Forward { block, .. } => *block,
            Message::Control(Control::ReplicaSnapshot(state)) => state.spec.id,
            _ => return None,
        };
        let shard = self.shard.as_ref()?;
        let serving =
            self.slots.get(&block).is_some_and(|s| matches!(s, Slot::Owned(o) if matches!(o.phase, Phase::Serving)));
        if serving && !shard.owned_before(block, sender) {
            return Some(format!(
                "server {sender} sent a copy of block {block}, which this server serves (server {sender} never owned it)"
            ));
        }
        None
    }
}
