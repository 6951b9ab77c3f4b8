//! The one contract every process's rules are written on, quinn-proto's: a driver hands a
//! machine what happened with [`Machine::handle`], carries out the effects it appended,
//! then asks [`Machine::poll_timeout`] when to wake it with a timeout. A machine has no
//! clock, no socket, no file and no process of its own: time comes in as `now_us`, and
//! every effect with an outcome (a dial, a write, a spawn) comes back as an input.
//!
//! The call order, for every driver (the tokio one in `elasticps-runtime` and
//! `elasticps-launch`, the virtual-time one in `elasticps-harness`):
//!
//! ```text
//! loop {
//!     let wake = machine.poll_timeout();           // absolute µs, or None
//!     wait for an input or for `wake`;              // a frame, a close, an exit, ...
//!     machine.handle(now_us, input, &mut effects);  // or its timeout input at `wake`
//!     carry out `effects` in order, feeding their outcomes back as inputs;
//! }
//! ```
//!
//! `now_us` never goes backwards between calls on one machine, and a machine never asks
//! to be woken in the past: a `poll_timeout` at or before `now_us` means "wake me now".

/// A process's rules as a state machine without I/O (see the module).
pub trait Machine {
    /// What happened: a frame received, a connection closed or dialled, a file
    /// written, a process spawned or exited, the timeout reached.
    type Input<'a>;
    /// An effect for the driver to carry out: send, reply, dial, close, write a file,
    /// spawn, exit.
    type Output;

    /// Hands the machine one input at `now_us`; its effects are appended to `out`, in
    /// the order the driver must carry them out.
    fn handle(&mut self, now_us: u64, input: Self::Input<'_>, out: &mut Vec<Self::Output>);

    /// When the machine next wants its timeout input (absolute µs on the clock of
    /// `now_us`); `None`: nothing to wake for.
    fn poll_timeout(&self) -> Option<u64>;
}

impl Machine for crate::scheduler::Scheduler {
    type Input<'a> = crate::scheduler::Event;
    type Output = crate::scheduler::Action;

    fn handle(&mut self, now_us: u64, input: Self::Input<'_>, out: &mut Vec<Self::Output>) {
        self.handle_into(now_us, input, out)
    }

    fn poll_timeout(&self) -> Option<u64> {
        crate::scheduler::Scheduler::poll_timeout(self)
    }
}

impl Machine for crate::server::Server {
    type Input<'a> = crate::server::Event;
    type Output = crate::server::Action;

    fn handle(&mut self, now_us: u64, input: Self::Input<'_>, out: &mut Vec<Self::Output>) {
        self.handle_into(now_us, input, out)
    }

    fn poll_timeout(&self) -> Option<u64> {
        crate::server::Server::poll_timeout(self)
    }
}

impl Machine for crate::session::Session {
    type Input<'a> = crate::session::Event<'a>;
    type Output = crate::session::Action;

    fn handle(&mut self, now_us: u64, input: Self::Input<'_>, out: &mut Vec<Self::Output>) {
        self.handle_into(now_us, input, out)
    }

    fn poll_timeout(&self) -> Option<u64> {
        crate::session::Session::poll_timeout(self)
    }
}

impl Machine for crate::launcher::Launcher {
    type Input<'a> = crate::launcher::Input;
    type Output = crate::launcher::Effect;

    fn handle(&mut self, now_us: u64, input: Self::Input<'_>, out: &mut Vec<Self::Output>) {
        self.handle_into(now_us, input, out)
    }

    fn poll_timeout(&self) -> Option<u64> {
        crate::launcher::Launcher::poll_timeout(self)
    }
}
