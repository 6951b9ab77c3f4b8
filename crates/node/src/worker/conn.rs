//! The rules of a worker's connections that every driver of a worker follows (the
//! runtime's client and the harness's worker), written once: what a server's answer to
//! `Hello` means, and how often a row round is planned again after a block of its table
//! was split under it.

use elasticps_wire::{Control, ErrorCode, Message};

use crate::timing::{CALL_TIMEOUT_US, FIRST_BACKOFF_US};
use crate::{NodeError, Result};

/// A row round whose table had a block split under it ([`NodeError::Recut`]) is planned
/// again from the refreshed layout at most this many times.
pub const MAX_RECUTS: u32 = 16;

/// What a server's answer to a worker's `Hello` means ([`hello_answer`]).
#[derive(Debug)]
pub enum HelloAnswer {
    /// `Ok`: the connection serves the worker's requests.
    Accepted,
    /// `NotReady`: the server the layout names has not taken its own `Welcome` yet (it
    /// comes on its scheduler connection, the `Hello` on another): say `Hello` again
    /// after this long.
    Again {
        /// The wait before the next `Hello`, µs.
        after_us: u64,
    },
    /// Anything else, or `NotReady` for longer than [`CALL_TIMEOUT_US`]: the error the
    /// worker fails with.
    Refused(NodeError),
}

/// What `msg`, server `server`'s answer to `Hello`, means after `waited_us` since the
/// first `Hello` on this connection.
pub fn hello_answer(server: u32, msg: &Message, waited_us: u64) -> HelloAnswer {
    let peer = || format!("server {server}");
    match msg {
        Message::Control(Control::Ok) => HelloAnswer::Accepted,
        Message::Error(reply) if reply.code == ErrorCode::NotReady && waited_us < CALL_TIMEOUT_US => {
            tracing::debug!(server, waited_us, "server not registered yet; saying Hello again");
            HelloAnswer::Again { after_us: FIRST_BACKOFF_US }
        }
        Message::Error(reply) => HelloAnswer::Refused(NodeError::Remote { peer: peer(), reply: reply.clone() }),
        other => HelloAnswer::Refused(NodeError::Protocol {
            peer: peer(),
            what: format!("expected Ok, got {:?}", other.kind()),
        }),
    }
}

/// A row round of table `table` was split under it for the `recuts`-th time in one
/// call: plan it again, or, past [`MAX_RECUTS`], the error the call fails with.
pub fn replan_rows(table: u32, recuts: u32) -> Result<()> {
    if recuts <= MAX_RECUTS {
        return Ok(());
    }
    Err(NodeError::Protocol {
        peer: "servers".into(),
        what: format!("a row round of table {table}: its blocks were split under {MAX_RECUTS} rounds running"),
    })
}

#[cfg(test)]
mod tests {
    use elasticps_wire::ErrorReply;

    use super::*;

    fn not_ready() -> Message {
        Message::Error(ErrorReply { code: ErrorCode::NotReady, message: "no Welcome yet".into() })
    }

    #[test]
    fn not_ready_is_said_again_until_the_call_timeout() {
        assert!(matches!(hello_answer(3, &Control::Ok.into(), 0), HelloAnswer::Accepted));
        assert!(matches!(
            hello_answer(3, &not_ready(), CALL_TIMEOUT_US - 1),
            HelloAnswer::Again { after_us: FIRST_BACKOFF_US }
        ));
        let HelloAnswer::Refused(e) = hello_answer(3, &not_ready(), CALL_TIMEOUT_US) else { panic!("refused") };
        assert_eq!(e.to_string(), "server 3 answered NotReady: no Welcome yet");
        let HelloAnswer::Refused(e) = hello_answer(3, &Control::GetLayout.into(), 0) else { panic!("refused") };
        assert_eq!(e.to_string(), "protocol error with server 3: expected Ok, got Control");
    }

    #[test]
    fn a_row_round_is_planned_again_at_most_max_recuts_times() {
        assert!((1..=MAX_RECUTS).all(|n| replan_rows(2, n).is_ok()));
        let e = replan_rows(2, MAX_RECUTS + 1).unwrap_err();
        assert_eq!(
            e.to_string(),
            "protocol error with servers: a row round of table 2: its blocks were split under 16 rounds running"
        );
    }
}
