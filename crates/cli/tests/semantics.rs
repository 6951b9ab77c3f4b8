//! The sync semantics, proven against real server processes: bsp + aggregate equals
//! sequential large-batch SGD; ssp:S never answers pull(t) while done < t - S, with a
//! straggler present; asp never holds a pull. And the data path: a round's fused
//! push_pulls, more bytes than the sockets buffer, come back exact into the caller's
//! tensors.

use std::path::PathBuf;
use std::time::Duration;

use elasticps_core::model::{Init, TensorSpec};

use crate::common::cluster::{self, JobSpec};
use crate::common::{self, Proc, models};

const FEATURES: usize = 20;
const PER_WORKER: usize = 8;

/// Deterministic regression data of one worker: (x rows, y).
fn data(rank: usize) -> (Vec<[f32; FEATURES]>, Vec<f32>) {
    let mut xs = Vec::new();
    let mut ys = Vec::new();
    for i in 0..PER_WORKER {
        let n = (rank * PER_WORKER + i) as f32;
        let mut x = [0f32; FEATURES];
        for (j, v) in x.iter_mut().enumerate() {
            *v = ((n * 7.0 + j as f32 * 3.0) % 11.0 - 5.0) / 5.0;
        }
        ys.push(x.iter().enumerate().map(|(j, v)| v * (j as f32 - 10.0) / 10.0).sum::<f32>() + 0.5);
        xs.push(x);
    }
    (xs, ys)
}

/// Gradient of the mean squared error 0.5 * (w.x + b - y)^2 over `rows`.
fn gradient(w: &[f32], b: f32, xs: &[[f32; FEATURES]], ys: &[f32]) -> (Vec<f32>, f32) {
    let mut gw = [0f32; FEATURES];
    let mut gb = 0f32;
    for (x, y) in xs.iter().zip(ys) {
        let err = x.iter().zip(w).map(|(a, b)| a * b).sum::<f32>() + b - y;
        for (g, v) in gw.iter_mut().zip(x) {
            *g += err * v;
        }
        gb += err;
    }
    let n = xs.len() as f32;
    (gw.iter().map(|g| g / n).collect(), gb / n)
}

fn model() -> Vec<TensorSpec> {
    vec![
        TensorSpec { name: "w".into(), shape: vec![FEATURES], init: Init::Uniform { low: -1.0, high: 1.0 } },
        TensorSpec { name: "b".into(), shape: vec![1], init: Init::Zeros },
    ]
}

/// The scheduler of `job` and its servers, each tracing to `trace-I.jsonl` in `trace_dir`.
fn cluster(job: &JobSpec, trace_dir: Option<&PathBuf>) -> (Proc, String, Vec<Proc>) {
    let (sched, addr) = job.start_scheduler();
    let procs = (0..job.servers)
        .map(|i| {
            let trace = trace_dir.map(|d| d.join(format!("trace-{i}.jsonl")).display().to_string());
            let mut extra = Vec::new();
            if let Some(t) = &trace {
                extra.extend(["--trace", t.as_str()]);
            }
            common::start_server(&addr, &extra)
        })
        .collect();
    (sched, addr, procs)
}

#[test]
fn bsp_with_aggregate_equals_sequential_large_batch_sgd() {
    const T: u32 = 12;
    const LR: f32 = 0.1;
    // 16-byte blocks: w is cut into 5 blocks spread over both servers.
    let job = JobSpec::exact(2, 2, "bsp").lr("0.1").with(&["--aggregate", "--placement", "roundrobin"]);
    let (_sched, addr, _servers) = cluster(&job, None);
    let rt = common::tokio_rt();
    // Per worker: (parameters at clock 0, parameters after T clocks).
    type Run = (Vec<Vec<f32>>, Vec<Vec<f32>>);
    let results: Vec<Run> = rt.block_on(async {
        let tasks = cluster::spawn_workers(2, &addr, &model(), |mut c| async move {
            let (xs, ys) = data(c.rank() as usize);
            let mut params = c.zeros();
            let mut initial = None;
            for t in 0..T {
                c.pull(t, &mut params).await.expect("pull");
                initial.get_or_insert_with(|| params.clone());
                let (gw, gb) = gradient(&params[0], params[1][0], &xs, &ys);
                c.push(t, &[gw, vec![gb]]).await.expect("push");
            }
            c.pull(T, &mut params).await.expect("final pull");
            c.finish().await.expect("finish");
            (initial.unwrap_or_default(), params)
        });
        common::join_workers(tasks).await
    });
    // Both workers started from the same initial values and ended with the same model.
    assert_eq!(results[0].0, results[1].0);
    assert_eq!(results[0].1, results[1].1);
    // The reference: one worker, the whole batch of 16 examples, plain SGD.
    let (mut w, mut b) = (results[0].0[0].clone(), results[0].0[1][0]);
    let (mut xs, mut ys) = data(0);
    let (x1, y1) = data(1);
    xs.extend(x1);
    ys.extend(y1);
    let loss0 = loss(&w, b, &xs, &ys);
    for _ in 0..T {
        let (gw, gb) = gradient(&w, b, &xs, &ys);
        w.iter_mut().zip(&gw).for_each(|(w, g)| *w -= LR * g);
        b -= LR * gb;
    }
    let got = &results[0].1;
    for (a, e) in got[0].iter().zip(&w) {
        assert!((a - e).abs() <= 1e-5, "w: distributed {a} vs sequential {e}\n{:?}\n{:?}", got[0], w);
    }
    assert!((got[1][0] - b).abs() <= 1e-5, "b: {} vs {b}", got[1][0]);
    assert!(loss(&w, b, &xs, &ys) < loss0 * 0.9, "the model must actually learn");
}

/// The worker's round writes its requests while it reads the replies (the server answers
/// a push_pull as it reads it): with 16 MiB per worker and round in flight at once, in
/// 16 blocks over 2 servers, a round that wrote everything before reading would wait for
/// a server that waits for it. Every pulled value is exact (small integers, sgd lr 1,
/// bsp: the pull of clock t + 1 holds every push up to t), read straight into the
/// caller's tensor.
#[test]
fn push_pulls_larger_than_the_socket_buffers_come_back_exact() {
    const LEN: usize = 4 << 20; // 16 MiB of f32
    const T: u32 = 4;
    let job = JobSpec::exact(2, 2, "bsp").block_bytes(1048576).with(&["--placement", "roundrobin"]);
    let (_sched, addr, _servers) = cluster(&job, None);
    let grad = |rank: u32, t: u32, i: usize| ((i + rank as usize + t as usize) % 5) as f32 - 2.0;
    let rt = common::tokio_rt();
    let pulled: Vec<Vec<f32>> = rt.block_on(async {
        let tasks = cluster::spawn_workers(2, &addr, &models::zeros(&[("w", LEN)]), move |mut c| async move {
            let mut params = cluster::pulled(&mut c, 0).await;
            assert!(params[0].iter().all(|v| *v == 0.0), "the first pull holds the zeros");
            // No worker pushes before every worker pulled (a push of clock 0 is applied at
            // once: a later first pull would hold it).
            c.barrier().await.expect("the barrier after the first pulls");
            let rank = c.rank();
            for t in 0..T {
                let g: Vec<f32> = (0..LEN).map(|i| grad(rank, t, i)).collect();
                c.push_pull(t, &[g], &mut params).await.expect("push_pull");
            }
            c.finish().await.expect("finish");
            params.swap_remove(0)
        });
        common::join_workers(tasks).await
    });
    for (worker, values) in pulled.iter().enumerate() {
        for (i, v) in values.iter().enumerate() {
            let expected: f32 = -(0..T).flat_map(|t| (0..2).map(move |r| grad(r, t, i))).sum::<f32>();
            assert_eq!(*v, expected, "worker {worker}, value {i}");
        }
    }
}

fn loss(w: &[f32], b: f32, xs: &[[f32; FEATURES]], ys: &[f32]) -> f32 {
    xs.iter().zip(ys).map(|(x, y)| (x.iter().zip(w).map(|(a, b)| a * b).sum::<f32>() + b - y).powi(2)).sum::<f32>()
}

#[derive(Debug, serde::Deserialize)]
struct TraceLine {
    block: u32,
    worker: u32,
    clock: u32,
    done: u32,
    held_us: Option<u64>,
}

/// What a traced run produced.
struct Traced {
    /// Every answered pull, per server process (in spawn order).
    per_server: Vec<Vec<TraceLine>>,
    /// Per worker rank: total time each server (by id) took to answer its rounds.
    waits: Vec<Vec<Duration>>,
}

impl Traced {
    fn all(&self) -> Vec<&TraceLine> {
        self.per_server.iter().flatten().collect()
    }
}

/// Runs 3 in-process workers (worker 2 sleeps `straggle` per iteration) against 2 server
/// processes under `sync` (plus `extra` scheduler flags), each iteration one overlapped
/// push(t) + pull(t + 1) round, and returns what the servers traced.
fn traced_run(sync: &str, extra: &[&str], iterations: u32, straggle: Duration) -> Traced {
    let dir = common::temp_dir("trace");
    let job = JobSpec::exact(2, 3, sync).lr("0.01").block_bytes(40).with(extra);
    let (_sched, addr, mut servers) = cluster(&job, Some(&dir));
    let rt = common::tokio_rt();
    let mut waits = rt.block_on(async {
        let tasks = cluster::spawn_workers(3, &addr, &model(), move |mut c| async move {
            let (xs, ys) = data(c.rank() as usize);
            let mut waits = vec![Duration::ZERO; 2];
            let mut params = cluster::pulled(&mut c, 0).await;
            for t in 0..iterations {
                if c.rank() == 2 {
                    tokio::time::sleep(straggle).await;
                }
                let (gw, gb) = gradient(&params[0], params[1][0], &xs, &ys);
                if t + 1 < iterations {
                    c.push_pull(t, &[gw, vec![gb]], &mut params).await.expect("push_pull");
                } else {
                    c.push(t, &[gw, vec![gb]]).await.expect("push");
                }
                for (w, d) in waits.iter_mut().zip(&c.last_waits().per_server) {
                    *w += *d;
                }
            }
            let rank = c.rank();
            c.finish().await.expect("finish");
            (rank, waits)
        });
        common::join_workers(tasks).await
    });
    waits.sort_by_key(|(rank, _)| *rank);
    // The servers flush their traces when the scheduler shuts them down.
    for s in &mut servers {
        assert!(s.wait_success(Duration::from_secs(20)), "server did not exit cleanly");
    }
    let per_server = (0..2)
        .map(|i| {
            let text = std::fs::read_to_string(dir.join(format!("trace-{i}.jsonl"))).expect("trace");
            text.lines().map(|l| serde_json::from_str::<TraceLine>(l).expect("trace line")).collect()
        })
        .collect();
    Traced { per_server, waits: waits.into_iter().map(|(_, w)| w).collect() }
}

#[test]
fn ssp_never_answers_a_pull_while_done_is_more_than_s_behind() {
    const S: u32 = 1;
    const ITER: u32 = 25;
    let traced = traced_run("ssp:1", &[], ITER, Duration::from_millis(4));
    let trace = traced.all();
    // w (20 floats) in 40-byte blocks = 2 blocks, b = 1 block: 3 blocks, 3 workers.
    assert_eq!(trace.len() as u32, 3 * 3 * ITER, "every pull answered exactly once");
    let mut seen = std::collections::HashSet::new();
    for l in &trace {
        assert!(seen.insert((l.block, l.worker, l.clock)), "pull answered twice: {l:?}");
        assert!(
            l.done + S >= l.clock,
            "pull({}) of worker {} answered while done = {} under ssp:{S}",
            l.clock,
            l.worker,
            l.done
        );
    }
    let held = trace.iter().filter(|l| l.held_us.is_some()).count();
    assert!(held > 0, "with a straggler, fast workers must have been held");
}

#[test]
fn asp_never_holds_a_pull() {
    let traced = traced_run("asp", &[], 25, Duration::from_millis(4));
    let trace = traced.all();
    assert_eq!(trace.len(), 3 * 3 * 25);
    assert!(trace.iter().all(|l| l.held_us.is_none()), "asp held a pull");
    // ...even though the workers drifted apart: some pull ran ahead of `done` by more than 1.
    assert!(trace.iter().any(|l| l.clock > l.done + 1), "the straggler never fell behind; the test proves nothing");
}

#[test]
fn lazy_releases_held_pulls_only_at_a_full_catch_up_all_of_a_clock_together() {
    const ITER: u32 = 25;
    let traced = traced_run("lazy:1", &[], ITER, Duration::from_millis(4));
    let trace = traced.all();
    assert_eq!(trace.len() as u32, 3 * 3 * ITER);
    assert!(trace.iter().all(|l| l.done + 1 >= l.clock), "lazy:1 broke the ssp:1 bound");
    let held: Vec<_> = trace.iter().filter(|l| l.held_us.is_some()).collect();
    assert!(!held.is_empty(), "with a straggler, fast workers must have been held");
    // Released only when every worker caught up with the pull's clock...
    assert!(held.iter().all(|l| l.done >= l.clock), "{held:?}");
    // ...and all pulls of one (block, clock) that were held came out at the same `done`.
    for l in &held {
        assert!(held.iter().filter(|m| m.block == l.block && m.clock == l.clock).all(|m| m.done == l.done));
    }
}

#[test]
fn servers_decide_independently_and_each_servers_round_completes_on_its_own() {
    const ITER: u32 = 30;
    // Server 0 runs asp, server 1 bsp, in one job; worker 2 straggles.
    let traced = traced_run("asp", &["--server-sync", "1=bsp"], ITER, Duration::from_millis(5));
    let held: Vec<usize> = traced.per_server.iter().map(|t| t.iter().filter(|l| l.held_us.is_some()).count()).collect();
    // Exactly one of the two server processes (whichever registered as server 1) held pulls.
    assert!(held.contains(&0) && held.iter().any(|h| *h > 0), "held per server: {held:?}");
    let bsp = traced.per_server.iter().find(|t| t.iter().any(|l| l.held_us.is_some())).expect("bsp server");
    assert!(bsp.iter().all(|l| l.done >= l.clock), "the bsp server answered early");
    // The fast workers' rounds with the asp server (id 0) ended long before their rounds
    // with the bsp server (id 1), which waited for the straggler: pushes and pulls of
    // different servers proceed independently.
    for rank in [0, 1] {
        let w = &traced.waits[rank];
        assert!(w[0] * 2 < w[1], "worker {rank}: waited {:?} on the asp server, {:?} on the bsp server", w[0], w[1]);
    }
}
