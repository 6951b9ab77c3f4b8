//! One block's slot on a server, with a typed phase: a block is served, copied to a new
//! owner (pushes logged), frozen (the last delta in flight, requests parked), arrived by
//! migration and waiting for the scheduler to settle it (requests parked), or gone to its
//! new owner. "Frozen but not migrating" or "parked while serving" cannot be written
//! down.

use elasticps_core::block::Block;
use elasticps_core::model::BlockId;
use elasticps_core::placement::ServerId;
use elasticps_wire::{Dtype, MigrationReport};

use super::request::Request;
use crate::ConnId;

/// Where the answer to a data request goes: the connection and the request id (and the
/// block, for the reply). The token a held pull keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Token {
    /// The connection the request came on.
    pub conn: ConnId,
    /// Its request id.
    pub request_id: u64,
    /// The block asked for.
    pub block: BlockId,
    /// The dtype the answer's values travel in (the request's flags).
    pub reply: Dtype,
}

/// A request that waits: its block is frozen for a handover, arrived and not settled, or
/// not yet at the checkpoint the request's clock is past.
#[derive(Clone, Debug)]
pub struct Parked {
    /// The worker that sent it.
    pub rank: u32,
    /// Where its answer goes.
    pub to: Token,
    /// The request.
    pub request: Request,
}

/// A block slot. (A gone slot is small and owned ones are the rule: not boxed.)
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Slot {
    /// The block is here.
    Owned(Owned),
    /// The block was handed over to `owner` at placement `epoch`.
    Gone {
        /// The new owner.
        owner: ServerId,
        /// The placement epoch of the handover.
        epoch: u64,
    },
}

/// A block held here and the phase of its migration, if one runs.
#[derive(Debug)]
pub struct Owned {
    /// The block's state machine.
    pub block: Block<Token>,
    /// The placement epoch at which the block arrived here (0: initial assignment).
    pub epoch: u64,
    /// Serving, or which step of a migration out.
    pub phase: Phase,
    /// Pushes of a clock at or past the block's next checkpoint, which wait until the
    /// block reaches that clock and its state is taken (so that the checkpoint holds
    /// exactly the pushes of the clocks before it). Frozen for a handover, they join the
    /// parked requests.
    pub checkpoint_parked: Vec<Parked>,
}

impl Owned {
    /// A block served here, not migrating.
    pub fn serving(block: Block<Token>, epoch: u64) -> Self {
        Self::new(block, epoch, Phase::Serving)
    }

    /// A block here in `phase`.
    pub fn new(block: Block<Token>, epoch: u64, phase: Phase) -> Self {
        Self { block, epoch, phase, checkpoint_parked: Vec::new() }
    }
}

/// Where an owned block is in its life here.
#[derive(Debug)]
pub enum Phase {
    /// Served; no migration.
    Serving,
    /// The snapshot was sent to the new owner; pushes are served and logged.
    Copying {
        /// The migration.
        out: Outgoing,
    },
    /// The last delta (or a fresh snapshot) is in flight, or the scheduler is recording
    /// the move: requests are parked.
    Frozen {
        /// The migration.
        out: Outgoing,
        /// What waits for the new owner to take the block over.
        parked: Vec<Parked>,
        /// When the block froze (the server's clock, µs).
        since_us: u64,
        /// The step in flight.
        step: FrozenStep,
    },
    /// Taken over by migration (snapshot and delta applied), but not yet settled by the
    /// scheduler: requests are parked until `Settled` says whether this server owns the
    /// block (serve them) or the move failed (answer them `Moved` to the old owner). Two
    /// live copies never both serve: the old owner cannot tell a lost delta from a lost
    /// acknowledgement of it, and keeps serving when its step fails.
    Arrived {
        /// What waits for the scheduler's word.
        parked: Vec<Parked>,
        /// When the block arrived (the server's clock, µs).
        since_us: u64,
    },
}

/// The step a frozen block waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrozenStep {
    /// A fresh snapshot of the frozen state (the log outweighed it): the delta is empty.
    Snapshot,
    /// The logged pushes.
    Delta,
    /// `MigrateDone` to the scheduler, which answers once its placement says so.
    Recording,
}

/// The old owner's side of one migration.
#[derive(Clone, Debug)]
pub struct Outgoing {
    /// The new owner.
    pub to: ServerId,
    /// Its data address.
    pub to_addr: String,
    /// The placement epoch once it is done.
    pub epoch: u64,
    /// The call id of the step in flight (to the new owner, or to the scheduler); its
    /// deadline is the server's, as every call's.
    pub call: u64,
    /// When the migration started.
    pub started_us: u64,
    /// The report for the scheduler, filled in as the steps go.
    pub report: MigrationReport,
}
