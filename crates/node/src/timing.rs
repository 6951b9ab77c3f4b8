//! Every timing constant of the roles' links and of the host agent, defined once: the runtime
//! (`elasticps-runtime`) and the deterministic harness (`crate::harness`) both use these,
//! so the proptests run with the heartbeats, timeouts, ticks and backoff that production
//! runs. The roles' own deadlines (a migration step, a drained server's linger, a
//! registration) sit beside their state machines: [`crate::server`]'s `*_US` constants.
//!
//! A test of each side checks that it uses these (`runtime`'s constants are made from
//! them; the harness's defaults are asserted equal in `harness::cluster`).

/// How often a node (worker, server, host agent) sends the scheduler a heartbeat, µs.
pub const HEARTBEAT_EVERY_US: u64 = 500_000;
/// How long the scheduler waits without a frame from a node before it declares the node
/// lost, µs, in a job without replicas (a false alarm would end the job).
pub const HEARTBEAT_TIMEOUT_US: u64 = 10_000_000;
/// [`HEARTBEAT_TIMEOUT_US`] in a job with replicas (`--replicas 2` or more), where a
/// silent server's blocks fail over to their backups: a server that stops answering
/// (hung, or cut off) is detected within 2 s. A killed one is detected at once: its
/// connection closes.
pub const FAILOVER_HEARTBEAT_TIMEOUT_US: u64 = 2_000_000;
/// The scheduler has no fixed tick (its driver sleeps until `Scheduler::poll_timeout`):
/// a deadline that passed at its last timeout and still stands (its rule could not act
/// yet) is checked again this long after, µs.
pub const SCHEDULER_TICK_US: u64 = 500_000;
/// How often a worker reports its load to the scheduler, µs.
pub const WORKER_STATS_US: u64 = 1_000_000;
/// A node that lost the scheduler dials it again after this long, µs; each next attempt
/// waits twice as long as the one before, up to [`MAX_BACKOFF_US`].
pub const FIRST_BACKOFF_US: u64 = 100_000;
/// The longest wait between two redials of the scheduler, µs.
pub const MAX_BACKOFF_US: u64 = 2_000_000;
/// A worker's change of a block that is migrating (`SetValues`, `SetOptState`: refused
/// `NotReady`) is sent again after this long, µs, for at most [`CALL_TIMEOUT_US`].
pub const BLOCK_BUSY_RETRY_US: u64 = 20_000;

/// How long one request of a worker's round (a push, a pull: a held pull waits for the
/// slowest worker, so this is generous) may wait for its server by default, µs.
pub const REQUEST_TIMEOUT_US: u64 = 300_000_000;
/// Requests of a worker's round in flight to one server at most, by default; the round
/// sends the others as answers come back.
pub const DEFAULT_WINDOW: usize = 32;

/// How long a node waits for the scheduler to answer a call (register, layout, barrier
/// aside: those wait for the job), µs.
pub const CALL_TIMEOUT_US: u64 = 120_000_000;
/// How long a TCP connect (with its handshake) may take, µs.
pub const CONNECT_TIMEOUT_US: u64 = 10_000_000;
/// How long a started frame may go without a byte before its peer is dropped, µs
/// (`--frame-timeout-s`).
pub const FRAME_STALL_TIMEOUT_US: u64 = 30_000_000;

/// How long a member of a host group (one push per host, [`crate::worker::group`])
/// waits for its leader to listen and take its `JoinGroup`, µs.
pub const GROUP_JOIN_TIMEOUT_US: u64 = 60_000_000;
/// How often a member of a host group looks for its leader's address until it is written,
/// µs.
pub const GROUP_ADDRESS_POLL_US: u64 = 20_000;
/// How long a host group's leader waits for a member's gradient before it goes on
/// without that member, µs: a request's timeout, as a held pull waits for the slowest
/// worker.
pub const GROUP_GATHER_TIMEOUT_US: u64 = REQUEST_TIMEOUT_US;
/// How long a host group's leader, once its own work is done, waits for its members to
/// take their last values and leave, µs.
pub const GROUP_END_TIMEOUT_US: u64 = 60_000_000;

/// How long a host agent waits for the scheduler to answer its `JoinHost` once a
/// connection is up, µs.
pub const JOIN_CALL_TIMEOUT_US: u64 = 30_000_000;
/// With `--restart-workers`, how long the scheduler of a launched job waits for a
/// restarted worker to rejoin once every other worker is done, µs (its `--rejoin-wait-s`
/// when the flag is not given).
pub const RESTART_REJOIN_WAIT_US: u64 = 60_000_000;
/// How long the scheduler of a local job may take to report its address once started, µs
/// ([`crate::launcher`]).
pub const SCHEDULER_START_TIMEOUT_US: u64 = 20_000_000;
/// How long the scheduler and the servers of a local job may take, by default, to end the
/// job once every worker has exited, µs (`--end-timeout-s`; [`crate::launcher`]'s end wait).
pub const JOB_END_TIMEOUT_US: u64 = 45_000_000;
/// How long a launch that failed or was interrupted waits for the processes it killed to
/// be reaped, µs.
pub const REAP_TIMEOUT_US: u64 = 5_000_000;

/// The scheduler's heartbeat timeout for a job of `replicas` copies per block.
pub fn heartbeat_timeout_us(replicas: u32) -> u64 {
    if replicas > 1 { FAILOVER_HEARTBEAT_TIMEOUT_US } else { HEARTBEAT_TIMEOUT_US }
}

/// The wait before the redial after one that waited `delay_us`.
pub fn next_backoff_us(delay_us: u64) -> u64 {
    delay_us.saturating_mul(2).min(MAX_BACKOFF_US)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backoff_doubles_up_to_its_cap_and_replicas_shorten_the_timeout() {
        let mut d = FIRST_BACKOFF_US;
        let mut seen = vec![d];
        for _ in 0..6 {
            d = next_backoff_us(d);
            seen.push(d);
        }
        assert_eq!(seen, [100_000, 200_000, 400_000, 800_000, 1_600_000, 2_000_000, 2_000_000]);
        assert_eq!((heartbeat_timeout_us(1), heartbeat_timeout_us(2)), (10_000_000, 2_000_000));
        // A node misses a few heartbeats before it counts as lost, even with replicas.
        const { assert!(FAILOVER_HEARTBEAT_TIMEOUT_US >= 4 * HEARTBEAT_EVERY_US) };
    }
}
