//! The task that owns the Rust [`Client`] on the runtime and carries out what Python asks,
//! one command at a time. Pushes queued back to back for the same clock (the gradients a
//! backward pass produces, tensor by tensor) go out as one round, so that their requests
//! are in flight together.

use std::collections::BTreeSet;
use std::time::Instant;

use elasticps_core::compress::Sparsifier;
use elasticps_core::dtype::Dtype;
use elasticps_core::model::{TableSpec, TensorSpec};
use elasticps_core::optimizer::{OptState, TensorOptimizer};
use elasticps_core::sync::Clock;
use elasticps_runtime::client::{Client, ClientOptions};
use elasticps_runtime::metrics::MetricsEndpoint;
use tokio::sync::{mpsc, oneshot};

use crate::arrays::{Dst, Keep, Src};
use crate::cancel::{self, Ticket};
use crate::stats::RunStats;

/// A reply to Python: the value, or the error's message.
pub type Reply<T> = oneshot::Sender<Result<T, String>>;

/// What Python asks of the client.
pub enum Cmd {
    /// Define the model; rank 0 of a fresh job also sends its values (`init`; empty on a
    /// resumed job, whose blocks hold the checkpoint's); everyone then meets in a barrier
    /// and pulls clock `start` (the job's first clock) into `pull`.
    Register {
        tensors: Vec<TensorSpec>,
        optimizers: Vec<Option<TensorOptimizer>>,
        tables: Vec<TableSpec>,
        init: Vec<Src>,
        start: Clock,
        pull: Vec<Dst>,
        keep: Keep,
        ticket: Ticket,
        done: Reply<()>,
    },
    /// Push (some tensors' gradients at a clock) and/or pull (some tensors at a clock).
    Round {
        push: Option<(Clock, Vec<(usize, Src)>)>,
        pull: Option<(Clock, Vec<(usize, Dst)>)>,
        keep: Keep,
        ticket: Ticket,
        done: Reply<()>,
    },
    /// Pull rows `ids` of table `table` at `clock`; replies with the rows, in the order
    /// asked.
    PullRows { clock: Clock, table: u32, ids: Vec<u64>, ticket: Ticket, done: Reply<Vec<f32>> },
    /// Push the gradient rows `grads` of rows `ids` of table `table` at `clock`.
    /// `grads` `None`: the table got no gradient this clock.
    PushRows { clock: Clock, table: u32, ids: Vec<u64>, grads: Option<Vec<f32>>, ticket: Ticket, done: Reply<()> },
    /// A tensor's new optimizer.
    SetOptimizer { tensor: u32, optimizer: TensorOptimizer, done: Reply<()> },
    /// How a tensor's pushes and pull replies travel from now on: their dtype, and the
    /// gradient's sparsifier (`None`: pushed whole).
    SetCompression { tensor: u32, dtype: Dtype, sparsifier: Option<Sparsifier>, done: Reply<()> },
    /// A tensor's optimizer state on the servers.
    GetOptState { tensor: u32, done: Reply<OptState> },
    /// Replace a tensor's optimizer state on the servers.
    SetOptState { tensor: u32, state: OptState, done: Reply<()> },
    /// Overwrite a tensor's values on the servers.
    SetValues { tensor: u32, values: Vec<f32>, done: Reply<()> },
    /// Wait for every worker.
    Barrier { done: Reply<()> },
    /// Tell the scheduler this worker is done; the task ends. Replies with the run's numbers.
    Finish { done: Reply<RunStats> },
    /// Leave the job without telling the scheduler it is done (an exception ended the
    /// script): the task ends and its connections close, so the scheduler counts the
    /// worker lost, as a killed one, and `--restart-workers` starts it again.
    Abandon,
}

/// What joining the job tells Python: the worker's rank, the number of workers and the
/// job's first clock (0, or the clock of the checkpoint it resumed from).
#[derive(Clone, Copy, Debug)]
pub struct Joined {
    /// This worker's rank.
    pub rank: u32,
    /// Number of workers in the job.
    pub size: u32,
    /// The job's first clock ([`Client::start_clock`]).
    pub start_clock: Clock,
}

/// Why a worker could not join the job of the scheduler at `scheduler`; when nothing
/// listens there (a script started outside `elasticps launch`), how to run it.
fn cannot_join(scheduler: &str, e: &elasticps_runtime::RuntimeError) -> String {
    match e {
        elasticps_runtime::RuntimeError::Io { source, .. }
            if source.kind() == std::io::ErrorKind::ConnectionRefused =>
        {
            format!(
                "elasticps: no elasticps scheduler at {scheduler} (connection refused); run the script under \
                 `elasticps launch --workers N -- python script.py`, or set ELASTICPS_SCHEDULER=HOST:PORT to a \
                 running scheduler's address"
            )
        }
        _ => format!("elasticps: cannot join the job: {e}"),
    }
}

/// Connects, asks the job's first clock, then serves commands until `Finish` or until
/// every sender is gone. The metrics endpoint, if any, serves as long as this task runs.
pub async fn run(
    opts: ClientOptions,
    _metrics: Option<MetricsEndpoint>,
    ready: Reply<Joined>,
    rx: mpsc::UnboundedReceiver<Cmd>,
) {
    let Some(client) = join(opts, ready).await else { return };
    let mut actor = Actor { client, stats: RunStats::default(), rx, next: None };
    while let Some(cmd) = actor.next_cmd().await {
        if let Cmd::Abandon = cmd {
            tracing::warn!(rank = actor.client.rank(), "the script failed: the worker leaves the job unfinished");
            return;
        }
        if let Some(done) = actor.execute(cmd).await {
            let Actor { client, mut stats, .. } = actor;
            let rank = client.rank();
            let r = client.finish().await;
            stats.finish(rank);
            let _ = done.send(r.map(|()| stats).map_err(|e| format!("elasticps: finish failed: {e}")));
            return;
        }
    }
    // Every handle is gone without finish(): leave the job as a finished worker would.
    let _ = actor.client.finish().await;
}

/// Joins the job and tells Python (through `ready`) the worker's rank, the number of
/// workers and the first clock; `None` (Python told why) if it could not.
async fn join(opts: ClientOptions, ready: Reply<Joined>) -> Option<Client> {
    let scheduler = opts.scheduler.clone();
    let mut client = match Client::connect(opts).await {
        Ok(c) => c,
        Err(e) => {
            let _ = ready.send(Err(cannot_join(&scheduler, &e)));
            return None;
        }
    };
    let start_clock = match client.start_clock().await {
        Ok(c) => c,
        Err(e) => {
            let _ = ready.send(Err(format!("elasticps: cannot ask the scheduler for the job's first clock: {e}")));
            let _ = client.finish().await;
            return None;
        }
    };
    let _ = ready.send(Ok(Joined { rank: client.rank(), size: client.num_workers(), start_clock }));
    Some(client)
}

/// The task's state: the client, the run's numbers, the commands, and one command taken
/// off the queue while gathering pushes that did not belong to them.
struct Actor {
    client: Client,
    stats: RunStats,
    rx: mpsc::UnboundedReceiver<Cmd>,
    next: Option<Cmd>,
}

impl Actor {
    /// The next command; `None` once every sender is gone.
    async fn next_cmd(&mut self) -> Option<Cmd> {
        match self.next.take() {
            Some(c) => Some(c),
            None => self.rx.recv().await,
        }
    }

    /// Carries out one command and replies to it; `Finish` is handed back (its reply),
    /// for [`run`] to end the client with.
    async fn execute(&mut self, cmd: Cmd) -> Option<Reply<RunStats>> {
        let client = &mut self.client;
        match cmd {
            // A command Python cancelled while it was queued (Ctrl-C) never runs; one that
            // runs is dropped, with every borrow of its arrays, when Python asks it to
            // stop, and only then replies. The guard claims the command (`start`): the arms
            // below run only commands it claimed.
            Cmd::Register { keep, ticket, done, .. } | Cmd::Round { keep, ticket, done, .. } if !ticket.start() => {
                drop(keep);
                let _ = done.send(Err(cancel::interrupted("the call")));
            }
            Cmd::PullRows { ticket, done, .. } if !ticket.start() => {
                let _ = done.send(Err(cancel::interrupted("pull_rows")));
            }
            Cmd::PushRows { ticket, done, .. } if !ticket.start() => {
                let _ = done.send(Err(cancel::interrupted("push_rows")));
            }
            Cmd::PullRows { clock, table, ids, ticket, done } => {
                let what = format!("pull_rows(clock {clock}) of table {table}");
                let r = tokio::select! {
                    r = pull_rows(client, clock, table, &ids) => r,
                    () = ticket.stopped() => Err(cancel::interrupted(&what)),
                };
                let _ = done.send(r.map_err(|e| format!("elasticps: worker {} {what} failed: {e}", client.rank())));
            }
            Cmd::PushRows { clock, table, ids, grads, ticket, done } => {
                let what = format!("push_rows(clock {clock}) of table {table}");
                let started = Instant::now();
                let r = tokio::select! {
                    r = async {
                        match &grads {
                            Some(grads) => client.push_rows(clock, table, &ids, grads).await,
                            None => client.push_rows_none(clock, table).await,
                        }
                    } => r.map_err(|e| e.to_string()),
                    () = ticket.stopped() => Err(cancel::interrupted(&what)),
                };
                self.stats.tally.communicated(started.elapsed(), &client.last_waits().per_server);
                let _ = done.send(r.map_err(|e| format!("elasticps: worker {} {what} failed: {e}", client.rank())));
            }
            Cmd::Register { tensors, optimizers, tables, init, start, pull, keep, ticket, done } => {
                let r = tokio::select! {
                    r = register(client, tensors, optimizers, tables, &init, start, &pull) => {
                        r.map_err(|e| format!("elasticps: register_model failed: {e}"))
                    }
                    () = ticket.stopped() => Err(cancel::interrupted("register_model")),
                };
                drop(keep);
                let _ = done.send(r);
            }
            Cmd::Round { push: Some((clock, grads)), pull: None, keep, ticket, done } => {
                self.pushes(clock, grads, keep, ticket, done).await;
            }
            Cmd::Round { push, pull, keep, ticket, done } => {
                let what = what(push.as_ref().map(|(c, _)| *c), pull.as_ref().map(|(c, _)| *c));
                let r = tokio::select! {
                    r = round(client, &mut self.stats, push, pull) => r,
                    () = ticket.stopped() => Err(cancel::interrupted(&what)),
                };
                drop(keep);
                let _ = done.send(r);
            }
            Cmd::Finish { done } => return Some(done),
            // Handled by `run`, before a command is executed.
            Cmd::Abandon => {}
            other => self.control(other).await,
        }
        None
    }

    /// The commands that only talk to the servers' or the scheduler's control path.
    async fn control(&mut self, cmd: Cmd) {
        let client = &mut self.client;
        match cmd {
            Cmd::SetCompression { tensor, dtype, sparsifier, done } => {
                client.set_wire_dtype(tensor, dtype);
                client.set_sparsifier(tensor, sparsifier);
                let _ = done.send(Ok(()));
            }
            Cmd::SetOptimizer { tensor, optimizer, done } => {
                let r = client.set_optimizer(tensor, optimizer).await;
                let _ = done.send(r.map_err(|e| format!("elasticps: set_optimizer failed: {e}")));
            }
            Cmd::GetOptState { tensor, done } => {
                let r = client.opt_state(tensor).await;
                let _ = done.send(r.map_err(|e| format!("elasticps: optimizer_state failed: {e}")));
            }
            Cmd::SetOptState { tensor, state, done } => {
                let r = client.set_opt_state(tensor, &state).await;
                let _ = done.send(r.map_err(|e| format!("elasticps: set_optimizer_state failed: {e}")));
            }
            Cmd::SetValues { tensor, values, done } => {
                let r = client.set_values(tensor, &values).await;
                let _ = done.send(r.map_err(|e| format!("elasticps: set_values failed: {e}")));
            }
            Cmd::Barrier { done } => {
                let _ = done.send(client.barrier().await.map_err(|e| format!("elasticps: barrier failed: {e}")));
            }
            _ => unreachable!("execute carries out the data path's commands and Finish"),
        }
    }

    /// A push of `clock`, with the pushes queued right behind it (same clock, other
    /// tensors) gathered into one round; every one of them gets the round's reply.
    async fn pushes(&mut self, clock: Clock, grads: Vec<(usize, Src)>, keep: Keep, ticket: Ticket, done: Reply<()>) {
        let mut grads = grads;
        let mut keeps = vec![keep];
        let mut tickets = vec![ticket];
        let mut dones = vec![done];
        let mut tensors: BTreeSet<usize> = grads.iter().map(|(t, _)| *t).collect();
        while let Ok(more) = self.rx.try_recv() {
            match more {
                Cmd::Round { push: Some((c, g)), pull: None, keep, ticket, done }
                    if c == clock && g.iter().all(|(t, _)| !tensors.contains(t)) =>
                {
                    if !ticket.start() {
                        drop(keep);
                        let _ = done.send(Err(cancel::interrupted(&format!("push(clock {c})"))));
                        continue;
                    }
                    tensors.extend(g.iter().map(|(t, _)| *t));
                    grads.extend(g);
                    keeps.push(keep);
                    tickets.push(ticket);
                    dones.push(done);
                }
                other => {
                    self.next = Some(other);
                    break;
                }
            }
        }
        // Ctrl-C in any wait of the batch stops all of it (they share one round).
        let r = tokio::select! {
            r = round(&mut self.client, &mut self.stats, Some((clock, grads)), None) => r,
            () = cancel::any_stopped(&tickets) => Err(cancel::interrupted(&format!("push(clock {clock})"))),
        };
        drop(keeps);
        for done in dones {
            let _ = done.send(r.clone());
        }
    }
}

async fn register(
    client: &mut Client,
    tensors: Vec<TensorSpec>,
    optimizers: Vec<Option<TensorOptimizer>>,
    tables: Vec<TableSpec>,
    init: &[Src],
    start: Clock,
    pull: &[Dst],
) -> elasticps_runtime::Result<()> {
    client.register_model_with_tables(tensors, optimizers, tables).await?;
    if client.rejoined() {
        // Restarted with its rank: the others trained on; pull where the job is.
        // SAFETY: as below; Python waits for this command before touching the arrays.
        let mut params: Vec<&mut [f32]> = pull.iter().map(|d| unsafe { d.as_mut_slice() }).collect();
        return client.pull(start, &mut params).await;
    }
    if !init.is_empty() {
        // SAFETY: the arrays are kept alive by the command's `keep` until it ends.
        let values: Vec<&[f32]> = init.iter().map(|s| unsafe { s.as_slice() }).collect();
        client.init_values(&values).await?;
    }
    client.barrier().await?;
    // SAFETY: as above; Python waits for this command before touching the arrays.
    let mut params: Vec<&mut [f32]> = pull.iter().map(|d| unsafe { d.as_mut_slice() }).collect();
    client.pull(start, &mut params).await
}

async fn round(
    client: &mut Client,
    stats: &mut RunStats,
    push: Option<(Clock, Vec<(usize, Src)>)>,
    pull: Option<(Clock, Vec<(usize, Dst)>)>,
) -> Result<(), String> {
    let n = client.layout().map_or(0, |l| l.partition.tensors.len());
    let mut grads: Vec<Option<&[f32]>> = vec![None; n];
    let mut params: Vec<Option<&mut [f32]>> = (0..n).map(|_| None).collect();
    let push_clock = push.as_ref().map(|(c, _)| *c);
    for (t, src) in push.into_iter().flat_map(|(_, g)| g) {
        // SAFETY: the arrays are kept alive by the command's `keep` until it ends.
        grads[t] = Some(unsafe { src.as_slice() });
    }
    let pull_clock = pull.as_ref().map(|(c, _)| *c);
    for (t, dst) in pull.into_iter().flat_map(|(_, p)| p) {
        // SAFETY: as above; Python waits for the handle before reading the array.
        params[t] = Some(unsafe { dst.as_mut_slice() });
    }
    let started = Instant::now();
    if let Some(clock) = push_clock {
        stats.clock_starts(clock);
    }
    let push = push_clock.map(|c| (c, &grads[..]));
    let pull = pull_clock.map(|c| (c, &mut params[..]));
    let r = client.round_tensors(push, pull).await;
    stats.tally.communicated(started.elapsed(), &client.last_waits().per_server);
    r.map_err(|e| format!("elasticps: worker {} {} failed: {e}", client.rank(), what(push_clock, pull_clock)))
}

/// Pulls rows `ids` of table `table` at `clock`: the rows, in the order asked.
async fn pull_rows(client: &mut Client, clock: Clock, table: u32, ids: &[u64]) -> Result<Vec<f32>, String> {
    let dim = client.layout().and_then(|l| l.partition.tables.get(table as usize)).map_or(0, |t| t.dim as usize);
    let mut out = vec![0.0; ids.len() * dim];
    client.pull_rows(clock, table, ids, &mut out).await.map_err(|e| e.to_string())?;
    Ok(out)
}

/// A round's name in errors: `push(clock 3) + pull(clock 4)`.
fn what(push_clock: Option<Clock>, pull_clock: Option<Clock>) -> String {
    match (push_clock, pull_clock) {
        (Some(c), None) => format!("push(clock {c})"),
        (None, Some(c)) => format!("pull(clock {c})"),
        (Some(c), Some(p)) => format!("push(clock {c}) + pull(clock {p})"),
        (None, None) => "round".to_string(),
    }
}
