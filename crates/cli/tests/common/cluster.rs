//! Jobs of real processes: a scheduler's job flags, typed ([`JobSpec`]); a scheduler with
//! its servers ([`Cluster`]); workers in process that joined the job ([`join`],
//! [`spawn_workers`], [`pulled`]).

use std::future::Future;

use elasticps_core::model::TensorSpec;
use elasticps_runtime::client::{Client, ClientOptions};
use tokio::task::JoinHandle;

use super::{EXIT_TIMEOUT, Proc, refs, start_scheduler, start_server};

/// The job flags of `elasticps scheduler`: the shape of a job, its sync policy and
/// optimizer, and any other flags.
#[derive(Clone, Debug)]
pub struct JobSpec {
    /// `--servers`.
    pub servers: u32,
    /// `--workers`.
    pub workers: u32,
    /// `--sync`.
    pub sync: String,
    /// `--optimizer`.
    pub optimizer: String,
    /// `--lr`.
    pub lr: String,
    /// `--block-bytes`.
    pub block_bytes: u64,
    /// Every other flag, in order.
    pub extra: Vec<String>,
}

impl JobSpec {
    /// `servers` servers and `workers` workers under `sync`, with exact arithmetic: sgd
    /// with lr 1, blocks of 16 bytes (4 values).
    pub fn exact(servers: u32, workers: u32, sync: &str) -> JobSpec {
        JobSpec {
            servers,
            workers,
            sync: sync.into(),
            optimizer: "sgd".into(),
            lr: "1".into(),
            block_bytes: 16,
            extra: Vec::new(),
        }
    }

    /// With `--optimizer optimizer`.
    pub fn optimizer(mut self, optimizer: &str) -> JobSpec {
        self.optimizer = optimizer.into();
        self
    }

    /// With `--lr lr`.
    pub fn lr(mut self, lr: &str) -> JobSpec {
        self.lr = lr.into();
        self
    }

    /// With `--block-bytes bytes`.
    pub fn block_bytes(mut self, bytes: u64) -> JobSpec {
        self.block_bytes = bytes;
        self
    }

    /// With `flags` too, after the ones given so far.
    pub fn with(mut self, flags: &[&str]) -> JobSpec {
        self.extra.extend(flags.iter().map(|f| f.to_string()));
        self
    }

    /// The scheduler's command-line flags.
    pub fn args(&self) -> Vec<String> {
        let mut args: Vec<String> = [
            "--servers",
            &self.servers.to_string(),
            "--workers",
            &self.workers.to_string(),
            "--sync",
            &self.sync,
            "--optimizer",
            &self.optimizer,
            "--lr",
            &self.lr,
            "--block-bytes",
            &self.block_bytes.to_string(),
        ]
        .map(String::from)
        .to_vec();
        args.extend(self.extra.iter().cloned());
        args
    }

    /// Starts the scheduler (see [`start_scheduler`]); returns it with its address.
    pub fn start_scheduler(&self) -> (Proc, String) {
        start_scheduler(&refs(&self.args()))
    }

    /// Starts the scheduler and its servers (with no flags of their own).
    pub fn start(&self) -> Cluster {
        let (sched, addr) = self.start_scheduler();
        let servers = (0..self.servers).map(|_| start_server(&addr, &[])).collect();
        Cluster { sched, addr, servers }
    }
}

/// A scheduler and its servers, as processes.
pub struct Cluster {
    /// The scheduler.
    pub sched: Proc,
    /// The scheduler's address.
    pub addr: String,
    /// The servers, in start order.
    pub servers: Vec<Proc>,
}

impl Cluster {
    /// Asserts that the scheduler, then every server, exits 0 within [`EXIT_TIMEOUT`].
    pub fn assert_success(&mut self) {
        self.sched.assert_success(EXIT_TIMEOUT);
        for s in &mut self.servers {
            s.assert_success(EXIT_TIMEOUT);
        }
    }
}

/// A worker in process that joined the job of the scheduler at `addr` and registered
/// `model`.
pub async fn join(addr: String, model: Vec<TensorSpec>) -> Client {
    let mut c = Client::connect(ClientOptions::new(addr)).await.expect("connect");
    c.register_model(model).await.expect("register");
    c
}

/// The parameters `c` pulls at `clock`.
pub async fn pulled(c: &mut Client, clock: u32) -> Vec<Vec<f32>> {
    let mut params = c.zeros();
    c.pull(clock, &mut params).await.unwrap_or_else(|e| panic!("pull({clock}): {e}"));
    params
}

/// Spawns `n` workers on the current tokio runtime, each running `body` with a client
/// that [`join`]ed the job at `addr` with `model`.
pub fn spawn_workers<F, Fut>(n: u32, addr: &str, model: &[TensorSpec], body: F) -> Vec<JoinHandle<Fut::Output>>
where
    F: FnOnce(Client) -> Fut + Clone + Send + 'static,
    Fut: Future + Send + 'static,
    Fut::Output: Send + 'static,
{
    (0..n)
        .map(|_| {
            let (addr, model, body) = (addr.to_string(), model.to_vec(), body.clone());
            tokio::spawn(async move { body(join(addr, model).await).await })
        })
        .collect()
}
