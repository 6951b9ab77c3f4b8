//! The one event loop of the runtime: every process's machine (`elasticps_node`'s
//! scheduler, server, session, worker client, host agent) runs in [`drive`], on the call
//! order of [`Machine`]. What differs between processes is their [`World`]: where their
//! inputs come from (sockets, a child process's exit, a signal) and how their effects are
//! carried out (a write, a dial, a spawn). A world holds no rule: it turns what happened
//! into the machine's input and the machine's effects into I/O, and hands every effect's
//! outcome straight back to the machine ([`feed_back`]).
//!
//! The harness's virtual-time driver (`elasticps-harness`) runs the same machines on the
//! same contract, so what a proptest proves of a machine holds for the process.

use std::collections::VecDeque;
use std::future::Future;
use std::ops::ControlFlow;

use elasticps_node::Machine;

use crate::timer::Timer;

/// A machine's surroundings as [`drive`] sees them (see the module).
pub trait World<M: Machine> {
    /// What woke the loop (a frame, a closed connection, a dial's outcome, an exit),
    /// before it is the machine's input.
    type Woken;
    /// How a run ends.
    type End;

    /// Waits for the next thing that happens. Cancel-safe: the loop selects it against
    /// the machine's timer.
    fn wait(&mut self) -> impl Future<Output = Self::Woken>;

    /// Hands the machine what woke the loop (`None`: its `poll_timeout` came), appending
    /// its effects to `out`; `Break` ends the run. Outside the select, so nothing cancels
    /// it: a world may first finish reading what woke it (a frame's payload after the
    /// header [`World::wait`] read, straight into the caller's buffer).
    fn feed(
        &mut self,
        machine: &mut M,
        now_us: u64,
        woken: Option<Self::Woken>,
        out: &mut Vec<M::Output>,
    ) -> impl Future<Output = ControlFlow<Self::End>>;

    /// Carries out one effect (the next ones wait in `queue`, in order; a world may take
    /// several at once, as one write). An outcome known at once goes back to the machine
    /// with [`feed_back`]; `Break` ends the run.
    fn carry_out(
        &mut self,
        machine: &mut M,
        now_us: u64,
        effect: M::Output,
        queue: &mut VecDeque<M::Output>,
    ) -> impl Future<Output = ControlFlow<Self::End>>;

    /// Asked once every effect is carried out, before the loop waits: whether the run is
    /// over (a worker's round once its writes are done). By default it goes on.
    fn settled(&mut self, _machine: &M) -> ControlFlow<Self::End> {
        ControlFlow::Continue(())
    }
}

/// Hands `input` to `machine` at `now_us` and queues its effects behind those waiting:
/// how a world gives an effect's outcome back.
pub fn feed_back<M: Machine>(machine: &mut M, now_us: u64, input: M::Input<'_>, queue: &mut VecDeque<M::Output>) {
    let mut out = Vec::new();
    machine.handle(now_us, input, &mut out);
    queue.extend(out);
}

/// Runs `machine` in `world` until the world ends the run: carries out `queue` (effects
/// from before the loop) and every effect after, then waits for the world or for the
/// machine's `poll_timeout` on `timer`, and hands the machine what came.
pub async fn drive<M: Machine, W: World<M>>(
    machine: &mut M,
    world: &mut W,
    timer: &mut Timer,
    mut queue: VecDeque<M::Output>,
) -> W::End {
    let mut out = Vec::new();
    // The deadline the timer is armed at: re-armed only when the machine moves it.
    let mut armed = None;
    loop {
        while let Some(effect) = queue.pop_front() {
            if let ControlFlow::Break(end) = world.carry_out(machine, timer.now_us(), effect, &mut queue).await {
                return end;
            }
        }
        if let ControlFlow::Break(end) = world.settled(machine) {
            return end;
        }
        let wake = machine.poll_timeout();
        if wake != armed {
            timer.arm(wake);
            armed = wake;
        }
        let woken = tokio::select! {
            woken = world.wait() => Some(woken),
            () = timer.fired() => {
                armed = None;
                None
            }
        };
        if let ControlFlow::Break(end) = world.feed(machine, timer.now_us(), woken, &mut out).await {
            return end;
        }
        queue.extend(out.drain(..));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Micros;

    /// A machine that counts to `until` on its timeouts, one every millisecond, and asks
    /// for an `Echo` of every input it gets.
    struct Counter {
        next_us: u64,
        count: u32,
        until: u32,
    }

    enum Input {
        Timeout,
        Said(u32),
        Echoed(u32),
    }

    #[derive(Debug, PartialEq)]
    enum Effect {
        Echo(u32),
        Done(u32),
    }

    impl Machine for Counter {
        type Input<'a> = Input;
        type Output = Effect;

        fn handle(&mut self, now_us: u64, input: Input, out: &mut Vec<Effect>) {
            match input {
                Input::Timeout => {
                    self.count += 1;
                    self.next_us = now_us + 1_000;
                    if self.count >= self.until {
                        out.push(Effect::Done(self.count));
                    }
                }
                Input::Said(n) => out.push(Effect::Echo(n)),
                Input::Echoed(n) => self.count += n,
            }
        }

        fn poll_timeout(&self) -> Option<u64> {
            Some(self.next_us)
        }
    }

    /// Says 100 once, then nothing; records what it carried out.
    struct Quiet {
        said: bool,
        log: Vec<Effect>,
    }

    impl World<Counter> for Quiet {
        type Woken = u32;
        type End = u32;

        async fn wait(&mut self) -> u32 {
            if self.said {
                std::future::pending().await
            } else {
                self.said = true;
                100
            }
        }

        async fn feed(
            &mut self,
            m: &mut Counter,
            now: u64,
            woken: Option<u32>,
            out: &mut Vec<Effect>,
        ) -> ControlFlow<u32> {
            m.handle(now, woken.map_or(Input::Timeout, Input::Said), out);
            ControlFlow::Continue(())
        }

        async fn carry_out(
            &mut self,
            m: &mut Counter,
            now: u64,
            effect: Effect,
            queue: &mut VecDeque<Effect>,
        ) -> ControlFlow<u32> {
            let done = match effect {
                Effect::Echo(n) => {
                    feed_back(m, now, Input::Echoed(n), queue);
                    None
                }
                Effect::Done(n) => Some(n),
            };
            self.log.push(effect);
            done.map_or(ControlFlow::Continue(()), ControlFlow::Break)
        }
    }

    #[tokio::test]
    async fn the_loop_feeds_inputs_timeouts_and_outcomes_until_the_world_ends_it() {
        let mut m = Counter { next_us: 0, count: 0, until: 105 };
        let mut world = Quiet { said: false, log: Vec::new() };
        let mut timer = Timer::new(Micros::new());
        // On a task of its own, as every driver runs: the loop's future is `Send`.
        let run = tokio::spawn(async move {
            let end = drive(&mut m, &mut world, &mut timer, VecDeque::new()).await;
            (end, world)
        });
        let (end, world) = tokio::time::timeout(std::time::Duration::from_secs(10), run)
            .await
            .expect("the counter reached its end within 10 s")
            .unwrap();
        // The echo's outcome counted 100 at once: a few timeouts were left to count.
        assert!((105..=106).contains(&end), "ended at {end}");
        assert_eq!(world.log.first(), Some(&Effect::Echo(100)));
        assert_eq!(world.log.last(), Some(&Effect::Done(end)));
    }
}
