//! A tiny job with exact arithmetic, for tests that attack or garble its nodes: a scheduler
//! and servers (processes) with a cluster secret, and well-behaved workers in process whose
//! every pull is checked value for value ([`Job::round`]). The model is `w` (2x3, all 1.0)
//! and `b` (2, all -1.0) in blocks of 16 bytes (3 blocks); every gradient is 0.5 and the
//! optimizer sgd with lr 1, so every value stays exact in f32.

use std::time::Duration;

use elasticps_core::model::{Init, TensorSpec};
use elasticps_runtime::client::{Client, ClientOptions};
use elasticps_wire::{Codec, Control, Credential, DEFAULT_MAX_PAYLOAD, Layout, Message};

use super::cluster::JobSpec;
use super::{EXIT_TIMEOUT, Proc, START_TIMEOUT, start_server_on};

/// The in-process workers' request timeout; a round waits at most twice as long.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// The tiny model: `w` (2x3) of 1.0 and `b` (2) of -1.0.
pub fn model() -> Vec<TensorSpec> {
    vec![
        TensorSpec { name: "w".into(), shape: vec![2, 3], init: Init::Constant(1.0) },
        TensorSpec { name: "b".into(), shape: vec![2], init: Init::Constant(-1.0) },
    ]
}

/// A well-behaved worker that joined with `opts` and has the model's layout, within
/// [`START_TIMEOUT`].
fn connect(rt: &tokio::runtime::Runtime, opts: ClientOptions) -> Client {
    rt.block_on(async {
        tokio::time::timeout(START_TIMEOUT, async {
            let mut client = Client::connect(opts).await.expect("a worker joins");
            client.register_model(model()).await.expect("the model is placed");
            client
        })
        .await
        .expect("a worker joins within the start timeout")
    })
}

/// A job's shape: how many servers and workers, the sync policy, secrets and extra flags.
pub struct Shape {
    /// `--servers`.
    pub servers: usize,
    /// `--workers`.
    pub workers: u32,
    /// `--sync`.
    pub sync: &'static str,
    /// The cluster secret (`--secret`) of every node.
    pub secret: &'static str,
    /// A worker secret (`--worker-secret` of every node): the in-process worker dials with it.
    pub worker_secret: Option<&'static str>,
    /// Flags for the scheduler and every server.
    pub flags: Vec<&'static str>,
    /// Flags for the scheduler only.
    pub sched_flags: Vec<&'static str>,
}

impl Shape {
    /// 2 servers, 1 worker, bsp, the cluster secret `secret`, no other flags.
    pub fn new(secret: &'static str) -> Shape {
        Shape { servers: 2, workers: 1, sync: "bsp", secret, worker_secret: None, flags: vec![], sched_flags: vec![] }
    }

    /// The codec of a connection with the cluster secret.
    pub fn codec(&self) -> Codec {
        Codec::new(self.secret.as_bytes(), DEFAULT_MAX_PAYLOAD)
    }

    /// A well-behaved worker's options: the worker secret if the job has one and
    /// `worker_key`, else the cluster secret.
    pub fn options(&self, sched_addr: &str, worker_key: bool) -> ClientOptions {
        let mut opts = ClientOptions::new(sched_addr);
        opts.codec = match self.worker_secret {
            Some(ws) if worker_key => Codec::for_worker_secret(ws.as_bytes(), DEFAULT_MAX_PAYLOAD),
            _ => self.codec(),
        };
        opts.request_timeout = CALL_TIMEOUT;
        opts
    }

    /// Flags of the scheduler and every server: the secrets and [`Shape::flags`].
    fn node_flags(&self) -> Vec<&'static str> {
        let mut flags = vec!["--secret", self.secret];
        if let Some(ws) = self.worker_secret {
            flags.extend(["--worker-secret", ws]);
        }
        flags.extend(&self.flags);
        flags
    }
}

/// A scheduler and servers (processes), and one well-behaved worker in process (rank 0)
/// with exact arithmetic: SGD with lr 1 from constant values, every gradient 0.5.
pub struct Job {
    /// The runtime of the in-process workers.
    pub rt: tokio::runtime::Runtime,
    /// The well-behaved worker (rank 0), `None` only while a call is under way.
    pub client: Option<Client>,
    /// The scheduler.
    pub sched: Proc,
    /// The scheduler's address.
    pub sched_addr: String,
    /// `servers[s]`: server `s` (by the id the scheduler gave it), `None` once killed.
    pub servers: Vec<Option<Proc>>,
    /// `addrs[s]`: data address of server `s`.
    pub addrs: Vec<String>,
    /// The job's first layout.
    pub layout: Layout,
    /// `blocks[b]`: (tensor, offset, len).
    pub blocks: Vec<(usize, usize, usize)>,
    /// The next clock the worker pushes.
    pub clock: u32,
    /// Workers that joined later ([`Job::join`]), with their next clocks.
    pub others: Vec<(Option<Client>, u32)>,
    /// Pushes of every well-behaved worker so far.
    pub pushes: u64,
    /// The values a pull at `clock` returns.
    pub expected: Vec<Vec<f32>>,
    /// The job's shape.
    pub shape: Shape,
}

/// What the servers counted over a job ([`Job::finish`]).
pub struct Served {
    /// Pushes applied, over all servers.
    pub pushes: u64,
    /// Blocks held at the end, over all servers.
    pub blocks: u64,
    /// Pushes the well-behaved workers made.
    pub worker_pushes: u64,
}

impl Job {
    /// Starts the processes (servers on known ports), then the well-behaved worker joins
    /// and defines the model; the job runs.
    pub fn start(shape: Shape) -> Job {
        let node_flags = shape.node_flags();
        let job = JobSpec::exact(shape.servers as u32, shape.workers, shape.sync)
            .with(&node_flags)
            .with(&shape.sched_flags)
            .with(&["--join-timeout-s", "60"]);
        let (sched, sched_addr) = job.start_scheduler();
        let started: Vec<(Proc, String)> =
            (0..shape.servers).map(|_| start_server_on(&sched_addr, &node_flags)).collect();

        let rt = super::tokio_rt();
        let opts = shape.options(&sched_addr, true);
        let client = connect(&rt, opts);
        assert_eq!(client.rank(), 0, "the well-behaved worker registers first");
        let layout = client.layout().expect("a layout").clone();
        let mut addrs = vec![String::new(); layout.servers.len()];
        for s in &layout.servers {
            addrs[s.id as usize] = s.addr.clone();
        }
        let mut servers: Vec<Option<Proc>> = (0..addrs.len()).map(|_| None).collect();
        for (p, addr) in started {
            let id = addrs.iter().position(|a| *a == addr).unwrap_or_else(|| panic!("{addr} is not in {addrs:?}"));
            servers[id] = Some(p);
        }
        let owners = &layout.placement.owners;
        assert_eq!(owners.len(), 3, "6 + 2 values in blocks of at most 4: {owners:?}");
        let blocks = layout.partition.blocks.iter().map(|b| (b.tensor as usize, b.offset, b.len)).collect();
        Job {
            rt,
            client: Some(client),
            sched,
            sched_addr,
            servers,
            addrs,
            layout,
            blocks,
            clock: 0,
            others: Vec::new(),
            pushes: 0,
            expected: vec![vec![1.0; 6], vec![-1.0; 2]],
            shape,
        }
    }

    /// The codec of a connection with the cluster secret.
    pub fn codec(&self) -> Codec {
        self.shape.codec()
    }

    /// The worker's credential (what a compromised script on its host holds).
    pub fn credential(&self) -> Credential {
        self.client.as_ref().expect("the worker is connected").credential().clone()
    }

    /// The `Hello` of the worker (rank 0), with the credential its scheduler issued.
    pub fn hello(&self) -> Message {
        Control::Hello { credential: self.credential() }.into()
    }

    /// The owner of block `b` by the job's first layout.
    pub fn owner(&self, b: u32) -> u32 {
        self.layout.placement.owners[b as usize]
    }

    /// The values of block `b` a pull at the current clock returns.
    pub fn block_values(&self, b: u32) -> Vec<f32> {
        let (t, off, len) = self.blocks[b as usize];
        self.expected[t][off..off + len].to_vec()
    }

    /// Server `s`'s stderr so far (empty once killed).
    pub fn server_log(&self, s: u32) -> String {
        self.servers[s as usize].as_ref().map(Proc::log).unwrap_or_default()
    }

    /// One iteration of the well-behaved worker: pull (checked exactly), push 0.5 everywhere.
    pub fn round(&mut self, after: &str) {
        let client = self.client.take().expect("the client is connected");
        self.client = Some(self.round_of(client, self.clock, after));
        self.clock += 1;
    }

    /// One iteration of `client` at clock `t`: its pull must see every push so far (the
    /// job's other workers' too: under asp the test runs the workers' rounds in turn).
    pub fn round_of(&mut self, mut client: Client, t: u32, after: &str) -> Client {
        let rank = client.rank();
        let (client, params) = self.rt.block_on(async move {
            let mut params = client.zeros();
            match tokio::time::timeout(CALL_TIMEOUT * 2, client.pull(t, &mut params)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => panic!("worker {rank}: pull({t}) after {after} failed: {e}"),
                Err(_) => panic!("worker {rank}: pull({t}) after {after} timed out"),
            }
            let grads: Vec<Vec<f32>> = params.iter().map(|p| vec![0.5; p.len()]).collect();
            match tokio::time::timeout(CALL_TIMEOUT * 2, client.push(t, &grads)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => panic!("worker {rank}: push({t}) after {after} failed: {e}"),
                Err(_) => panic!("worker {rank}: push({t}) after {after} timed out"),
            }
            (client, params)
        });
        assert_eq!(params, self.expected, "values pulled by worker {rank} at clock {t} after {after}");
        for v in self.expected.iter_mut().flatten() {
            *v -= 0.5; // sgd, lr 1: exact in f32
        }
        self.pushes += 1;
        client
    }

    /// Another well-behaved worker joins the running job (an asp job of more workers).
    pub fn join(&mut self, opts: ClientOptions) {
        let client = connect(&self.rt, opts);
        self.others.push((Some(client), 0));
    }

    /// One iteration of the `i`-th worker that joined with [`Job::join`].
    pub fn round_other(&mut self, i: usize, after: &str) {
        let (client, t) = (self.others[i].0.take().expect("the worker is connected"), self.others[i].1);
        let client = self.round_of(client, t, after);
        self.others[i] = (Some(client), t + 1);
    }

    /// Ends the job: with `last_pull`, a last pull at the current clock (exact);
    /// `WorkerDone` of every worker; every live process exits 0. Returns what the servers
    /// counted (their last `server_stats`).
    pub fn finish(mut self, last_pull: bool) -> Served {
        let t = self.clock;
        let mut client = self.client.take().expect("the client is connected");
        let others: Vec<Client> = self.others.iter_mut().filter_map(|(c, _)| c.take()).collect();
        let expected = self.expected.clone();
        self.rt.block_on(async {
            if last_pull {
                let mut params = client.zeros();
                tokio::time::timeout(CALL_TIMEOUT * 2, client.pull(t, &mut params))
                    .await
                    .expect("the last pull in time")
                    .expect("the last pull");
                assert_eq!(params, expected, "the job's final values");
            }
            for c in others.into_iter().chain([client]) {
                tokio::time::timeout(CALL_TIMEOUT, c.finish())
                    .await
                    .expect("WorkerDone is acknowledged in time")
                    .expect("WorkerDone is acknowledged");
            }
        });
        self.sched.assert_success(EXIT_TIMEOUT);
        let (mut pushes, mut blocks) = (0, 0);
        for s in self.servers.iter_mut().flatten() {
            s.assert_success(EXIT_TIMEOUT);
            let stats = s.server_stats();
            pushes += stats["totals"]["pushes"].as_u64().expect("pushes");
            blocks += stats["blocks"].as_u64().expect("blocks");
        }
        Served { pushes, blocks, worker_pushes: self.pushes }
    }
}
