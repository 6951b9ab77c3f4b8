//! Checkpoints against real processes: a job that checkpoints, resumed from its latest
//! checkpoint by a new cluster, ends with exactly the parameters of the uninterrupted job;
//! a server lost without replicas ends the job saying how to resume.

use std::path::Path;
use std::time::Duration;

use elasticps_core::model::TensorSpec;
use elasticps_runtime::client::{Client, ClientOptions};

use crate::common::cluster::{self, Cluster, JobSpec};
use crate::common::{self, models};

const WORKERS: u32 = 2;
const CLOCKS: u32 = 12;
const EVERY: u32 = 5;
const LEN: usize = 40;

fn model() -> Vec<TensorSpec> {
    models::a_and_b(LEN)
}

/// Worker `rank`'s gradient at clock `t`: small integers, different per rank, clock and
/// element. Averaged (`--aggregate`) and run through momentum 0.5, every value stays a
/// dyadic fraction: the arithmetic is exact in f32, so equal runs give equal bits, and a
/// lost or doubled update (or a lost momentum) shows.
fn gradient(rank: u32, t: u32, i: usize) -> f32 {
    -(((rank + 1) * (t % 3 + 1)) as f32) * ((i % 5) + 1) as f32
}

/// A bsp --aggregate job with momentum on two servers (blocks of 4 values).
fn cluster(extra: &[&str]) -> Cluster {
    JobSpec::exact(2, WORKERS, "bsp").optimizer("momentum:0.5").with(&["--aggregate"]).with(extra).start()
}

/// Runs both workers from the job's start clock to `CLOCKS` (`pace` per clock), then
/// pulls clock `CLOCKS`; returns (start clock, final parameters) of each.
fn train(addr: &str, pace: Duration) -> Vec<(u32, Vec<Vec<f32>>)> {
    let rt = common::tokio_rt();
    rt.block_on(async {
        let workers = cluster::spawn_workers(WORKERS, addr, &model(), move |mut c| async move {
            let start = c.start_clock().await.expect("start clock");
            let rank = c.rank();
            let mut params = cluster::pulled(&mut c, start).await;
            for t in start..CLOCKS {
                tokio::time::sleep(pace).await;
                let grads = models::gradients(&model(), gradient, rank, t);
                c.push_pull(t, &grads, &mut params).await.unwrap_or_else(|e| panic!("clock {t}: {e}"));
            }
            c.finish().await.expect("finish");
            (start, params)
        });
        common::join_workers(workers).await
    })
}

fn complete_checkpoints(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok()).filter(|e| e.path().join("MANIFEST.json").exists()))
        .into_iter()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn a_job_resumed_from_its_checkpoint_ends_with_the_parameters_of_the_uninterrupted_job() {
    let dir = common::scratch_dir("checkpoint");
    let d = dir.to_str().unwrap();
    let every = EVERY.to_string();

    // The uninterrupted job, checkpointing every 5 clocks (at 5 and 10), at full speed:
    // the scheduler waits for the servers' last writes before it ends the job.
    let mut job = cluster(&["--checkpoint-dir", d, "--checkpoint-every", &every]);
    let whole = train(&job.addr, Duration::ZERO);
    job.assert_success();
    assert!(whole.iter().all(|(start, _)| *start == 0));
    assert_eq!(whole[0].1, whole[1].1, "both workers pulled the same final model");
    assert_ne!(whole[0].1[0], vec![0.0; LEN], "the job trained");
    assert_eq!(complete_checkpoints(&dir), ["ckpt-0000000005", "ckpt-0000000010"]);

    // A new cluster resumes from the latest checkpoint (clock 10) and runs clocks 10, 11.
    let mut job = cluster(&["--resume", d]);
    let resumed = train(&job.addr, Duration::ZERO);
    job.assert_success();
    for (start, params) in &resumed {
        assert_eq!(*start, 10, "the job went on from the checkpoint's clock");
        assert_eq!(params, &whole[0].1, "the resumed job ends exactly where the uninterrupted one did");
    }

    // A job of another shape refuses the checkpoint, saying why.
    let (mut sched, addr) =
        common::start_scheduler(&["--servers", "1", "--workers", "2", "--block-bytes", "8", "--resume", d]);
    let mut server = common::start_server(&addr, &[]);
    let rt = common::tokio_rt();
    let refused = rt.block_on(async {
        let mut c = Client::connect(ClientOptions::new(addr)).await.expect("connect");
        c.register_model(model()).await.map(|_| ()).expect_err("the model cannot be placed from that checkpoint")
    });
    assert!(!sched.wait_success(common::EXIT_TIMEOUT), "the job failed");
    let says = "holds 11 blocks, this model in blocks of 8 bytes has 22: resume with the same model and --block-bytes";
    assert!(refused.to_string().contains(says), "{refused}");
    let _ = server.wait_exit(common::EXIT_TIMEOUT);
    server.kill();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_lost_server_without_replicas_ends_the_job_saying_how_to_resume() {
    let dir = common::scratch_dir("checkpoint-lost");
    let d = dir.to_str().unwrap();
    let Cluster { mut sched, addr, mut servers } = cluster(&["--checkpoint-dir", d, "--checkpoint-every", "2"]);
    let rt = common::tokio_rt();
    let mut victim = servers.remove(1);
    rt.block_on(async {
        let workers = cluster::spawn_workers(WORKERS, &addr, &model(), |mut c| async move {
            let rank = c.rank();
            let mut params = cluster::pulled(&mut c, 0).await;
            for t in 0..1000 {
                let grads = models::gradients(&model(), gradient, rank, t);
                if c.push_pull(t, &grads, &mut params).await.is_err() {
                    return t;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            panic!("the job went on without a server");
        });
        // Once a checkpoint is complete, kill -9 a server.
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while complete_checkpoints(&dir).is_empty() && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(!complete_checkpoints(&dir).is_empty(), "no checkpoint completed in 60 s");
        victim.kill();
        common::join_workers(workers).await
    });
    assert!(!sched.wait_success(common::EXIT_TIMEOUT), "the job failed");
    let log = sched.log();
    assert!(log.contains(&format!("with --resume {d}")), "{}", sched.log_tail(20));
    for s in &mut servers {
        let _ = s.wait_exit(common::EXIT_TIMEOUT);
        s.kill();
    }
    let _ = std::fs::remove_dir_all(&dir);
}
