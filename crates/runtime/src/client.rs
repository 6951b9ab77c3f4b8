//! The worker client: the API a user's training loop calls.
//!
//! ```text
//! let mut client = Client::connect(ClientOptions::new("127.0.0.1:7000")).await?;
//! client.register_model(tensors).await?;          // waits until every server holds its blocks
//! for t in 0..iterations {
//!     client.pull(t, &mut params).await?;          // one request per block, all in flight at once
//!     let grads = compute(&params);
//!     client.push(t, &grads).await?;
//! }
//! client.finish().await?;
//! ```
//!
//! A server that no longer owns a block answers `Moved`; the client then refreshes the
//! layout from the scheduler and resends only the moved blocks.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use elasticps_core::model::{BlockSpec, TensorSpec};
use elasticps_core::sync::Clock;
use elasticps_wire::{Codec, Control, Layout, Message};
use futures::StreamExt;
use futures::stream::FuturesUnordered;

use crate::error::{Result, RuntimeError};
use crate::peer::Peer;
use crate::{CALL_TIMEOUT, HEARTBEAT_EVERY};

/// How a worker connects.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// The scheduler's address.
    pub scheduler: String,
    /// Frame codec (cluster secret, maximum payload).
    pub codec: Codec,
    /// How long one push or pull may wait for its server (a held pull waits for the
    /// slowest worker, so this is generous).
    pub request_timeout: Duration,
}

impl ClientOptions {
    /// Defaults: no secret, 64 MiB frames, 5-minute request timeout.
    pub fn new(scheduler: impl Into<String>) -> Self {
        Self {
            scheduler: scheduler.into(),
            codec: Codec::new(b"", elasticps_wire::DEFAULT_MAX_PAYLOAD),
            request_timeout: Duration::from_secs(300),
        }
    }
}

/// Time a worker spent waiting on each server during the last `pull` or `push`.
#[derive(Clone, Debug, Default)]
pub struct Waits {
    /// `per_server[s]`: time from sending the first request to server `s` until its
    /// last reply arrived.
    pub per_server: Vec<Duration>,
}

/// A connected worker.
pub struct Client {
    rank: u32,
    num_workers: u32,
    opts: ClientOptions,
    sched: Peer,
    layout: Option<Layout>,
    servers: HashMap<u32, Peer>,
    shutdown: Arc<Mutex<Option<String>>>,
    heartbeat: tokio::task::JoinHandle<()>,
    waits: Waits,
}

impl Client {
    /// Registers with the scheduler and learns this worker's rank.
    pub async fn connect(opts: ClientOptions) -> Result<Client> {
        let (sched, mut notes) = Peer::connect(&opts.scheduler, opts.codec.clone(), "scheduler").await?;
        let (rank, num_workers) =
            match sched.call(Control::RegisterWorker.into(), CALL_TIMEOUT, || "the scheduler to accept this worker".into()).await? {
                Message::Control(Control::Welcome { node_id, num_workers, .. }) => (node_id, num_workers),
                other => return Err(unexpected("scheduler", "Welcome", &other)),
            };
        let shutdown = Arc::new(Mutex::new(None));
        let flag = shutdown.clone();
        tokio::spawn(async move {
            while let Some(msg) = notes.recv().await {
                if let Message::Control(Control::Shutdown { reason }) = msg {
                    tracing::info!(%reason, "scheduler ends the job");
                    *flag.lock().unwrap_or_else(|e| e.into_inner()) = Some(reason);
                }
            }
        });
        let hb = sched.clone();
        let heartbeat = tokio::spawn(async move {
            let mut tick = tokio::time::interval(HEARTBEAT_EVERY);
            while hb.notify(Control::Heartbeat.into()).is_ok() {
                tick.tick().await;
            }
        });
        tracing::info!(rank, num_workers, "worker registered");
        Ok(Client { rank, num_workers, opts, sched, layout: None, servers: HashMap::new(), shutdown, heartbeat, waits: Waits::default() })
    }

    /// This worker's rank, `0..num_workers`.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Number of workers in the job.
    pub fn num_workers(&self) -> u32 {
        self.num_workers
    }

    /// The model's layout (tensors, blocks, owners), once registered.
    pub fn layout(&self) -> Option<&Layout> {
        self.layout.as_ref()
    }

    /// Time waited per server in the last pull or push.
    pub fn last_waits(&self) -> &Waits {
        &self.waits
    }

    /// Defines the model (the first worker's definition wins; others must be equal) and
    /// waits until every server holds its blocks. Returns the tensors, in order.
    pub async fn register_model(&mut self, tensors: Vec<TensorSpec>) -> Result<&[TensorSpec]> {
        let reply = self
            .sched
            .call(Control::DefineModel { tensors }.into(), CALL_TIMEOUT, || {
                "the scheduler to place the model (every server must join and load its blocks)".into()
            })
            .await?;
        self.install_layout(reply).await?;
        Ok(self.layout.as_ref().map(|l| &l.partition.tensors[..]).unwrap_or_default())
    }

    /// Fresh zeroed buffers shaped like the model's tensors, for [`Client::pull`].
    pub fn zeros(&self) -> Vec<Vec<f32>> {
        self.layout.as_ref().map_or_else(Vec::new, |l| l.partition.tensors.iter().map(|t| vec![0.0; t.len()]).collect())
    }

    /// Pulls every tensor at clock `clock` into `params` (shaped like [`Client::zeros`]).
    /// The server holds the pull as its sync policy says.
    pub async fn pull(&mut self, clock: Clock, params: &mut [Vec<f32>]) -> Result<()> {
        self.check_shapes(params.iter().map(Vec::len))?;
        self.exchange(clock, |b| Message::Pull { block: b.id, clock }, |b, reply| match reply {
            Message::PullReply { values, .. } if values.len() == b.len => {
                values.copy_into(&mut params[b.tensor as usize][b.offset..b.offset + b.len]);
                Ok(())
            }
            other => Err(format!("expected PullReply of {} values, got {:?}", b.len, other.kind())),
        })
        .await
    }

    /// Pushes the gradient of every tensor for clock `clock`.
    pub async fn push(&mut self, clock: Clock, grads: &[Vec<f32>]) -> Result<()> {
        self.check_shapes(grads.iter().map(Vec::len))?;
        self.exchange(
            clock,
            |b| Message::Push {
                block: b.id,
                clock,
                values: crate::conn::copy_values(&grads[b.tensor as usize][b.offset..b.offset + b.len]),
            },
            |_, reply| match reply {
                Message::PushAck { .. } => Ok(()),
                other => Err(format!("expected PushAck, got {:?}", other.kind())),
            },
        )
        .await
    }

    /// Tells the scheduler this worker is done. Servers stop waiting for it.
    pub async fn finish(self) -> Result<()> {
        let reply = self
            .sched
            .call(Control::WorkerDone { rank: self.rank }.into(), CALL_TIMEOUT, || "the scheduler to acknowledge WorkerDone".into())
            .await;
        self.heartbeat.abort();
        reply.map(|_| ())
    }

    /// Sends one request per block (all in flight at once, to every server), handles each
    /// reply with `on_reply`, and resends the blocks whose server answered `Moved`.
    async fn exchange(
        &mut self,
        clock: Clock,
        request: impl Fn(&BlockSpec) -> Message,
        mut on_reply: impl FnMut(&BlockSpec, Message) -> std::result::Result<(), String>,
    ) -> Result<()> {
        let layout = self.layout.clone().ok_or_else(|| RuntimeError::Usage("register_model first".into()))?;
        let mut todo: Vec<BlockSpec> = layout.partition.blocks.clone();
        let started = Instant::now();
        let mut waits = vec![Duration::ZERO; layout.servers.len()];
        for _attempt in 0..8 {
            let layout = self.layout.clone().ok_or_else(|| RuntimeError::Usage("register_model first".into()))?;
            let mut inflight = FuturesUnordered::new();
            for b in &todo {
                let owner = layout.placement.owner(b.id).ok_or(elasticps_core::CoreError::UnknownBlock(b.id))?;
                let peer = self.servers.get(&owner).ok_or_else(|| RuntimeError::Protocol {
                    peer: "scheduler".into(),
                    what: format!("layout names server {owner}, which it does not list"),
                })?;
                let rx = peer.send_request(request(b))?;
                let limit = self.opts.request_timeout;
                let block = *b;
                inflight.push(async move { (block, owner, tokio::time::timeout(limit, rx).await) });
            }
            let mut moved = Vec::new();
            while let Some((b, owner, reply)) = inflight.next().await {
                let what = |verb: &str| format!("server {owner} to answer {verb}(clock {clock}) of block {}", b.id);
                let reply = match reply {
                    Ok(Ok(r)) => r,
                    Ok(Err(_)) => return Err(self.closed(owner)),
                    Err(_) => {
                        return Err(RuntimeError::Timeout {
                            what: format!("worker {} waits for {}", self.rank, what("request")),
                            after: self.opts.request_timeout,
                        });
                    }
                };
                if let Some(w) = waits.get_mut(owner as usize) {
                    *w = started.elapsed();
                }
                match reply {
                    Message::Control(Control::Moved { .. }) => moved.push(b),
                    Message::Error(reply) => return Err(RuntimeError::Remote { peer: format!("server {owner}"), reply }),
                    other => on_reply(&b, other).map_err(|what| RuntimeError::Protocol { peer: format!("server {owner}"), what })?,
                }
            }
            if moved.is_empty() {
                self.waits = Waits { per_server: waits };
                return Ok(());
            }
            tracing::debug!(blocks = moved.len(), "blocks moved; refreshing the layout");
            let reply = self.sched.call(Control::GetLayout.into(), CALL_TIMEOUT, || "the scheduler to send the layout".into()).await?;
            self.install_layout(reply).await?;
            todo = moved;
        }
        Err(RuntimeError::Protocol { peer: "servers".into(), what: "blocks kept moving through 8 layout refreshes".into() })
    }

    async fn install_layout(&mut self, reply: Message) -> Result<()> {
        let layout = match reply {
            Message::Control(Control::Layout(l)) => l,
            other => return Err(unexpected("scheduler", "Layout", &other)),
        };
        for s in &layout.servers {
            if self.servers.contains_key(&s.id) {
                continue;
            }
            let name = format!("server {}", s.id);
            let (peer, _notes) = Peer::connect(&s.addr, self.opts.codec.clone(), &name).await?;
            match peer.call(Control::Hello { rank: self.rank }.into(), CALL_TIMEOUT, || format!("{name} to accept Hello")).await? {
                Message::Control(Control::Ok) => {}
                other => return Err(unexpected(&name, "Ok", &other)),
            }
            self.servers.insert(s.id, peer);
        }
        self.layout = Some(layout);
        Ok(())
    }

    fn check_shapes(&self, lens: impl ExactSizeIterator<Item = usize>) -> Result<()> {
        let layout = self.layout.as_ref().ok_or_else(|| RuntimeError::Usage("register_model first".into()))?;
        let want: Vec<usize> = layout.partition.tensors.iter().map(TensorSpec::len).collect();
        let got: Vec<usize> = lens.collect();
        if want != got {
            return Err(RuntimeError::Usage(format!("tensor lengths {got:?} do not match the model's {want:?}")));
        }
        Ok(())
    }

    fn closed(&self, owner: u32) -> RuntimeError {
        match self.shutdown.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            Some(reason) => RuntimeError::Shutdown(reason),
            None => RuntimeError::Closed(format!("server {owner}")),
        }
    }
}

fn unexpected(peer: &str, wanted: &str, got: &Message) -> RuntimeError {
    RuntimeError::Protocol { peer: peer.into(), what: format!("expected {wanted}, got {:?}", got.kind()) }
}
