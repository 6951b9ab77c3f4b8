//! The sync semantics, proven against real server processes: bsp + aggregate equals
//! sequential large-batch SGD; ssp:S never answers pull(t) while done < t - S, with a
//! straggler present; asp never holds a pull.

use std::path::PathBuf;
use std::time::Duration;

use elasticps_core::model::{Init, TensorSpec};
use elasticps_runtime::client::{Client, ClientOptions};

use crate::common::{self, Proc};

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

fn cluster(sched_args: &[&str], servers: usize, trace_dir: Option<&PathBuf>) -> (Proc, String, Vec<Proc>) {
    let (sched, addr) = common::start_scheduler(sched_args);
    let procs = (0..servers)
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
    let args = [
        "--servers",
        "2",
        "--workers",
        "2",
        "--sync",
        "bsp",
        "--optimizer",
        "sgd",
        "--lr",
        "0.1",
        "--aggregate",
        "--block-bytes",
        "16",
        "--placement",
        "roundrobin",
    ];
    let (_sched, addr, _servers) = cluster(&args, 2, None);
    let rt = common::tokio_rt();
    // Per worker: (parameters at clock 0, parameters after T clocks).
    type Run = (Vec<Vec<f32>>, Vec<Vec<f32>>);
    let results: Vec<Run> = rt.block_on(async {
        let tasks: Vec<_> = (0..2)
            .map(|_| {
                let addr = addr.clone();
                tokio::spawn(async move {
                    let mut c = Client::connect(ClientOptions::new(addr)).await.expect("connect");
                    c.register_model(model()).await.expect("register");
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
                })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(
                tokio::time::timeout(Duration::from_secs(60), t)
                    .await
                    .expect("worker timed out")
                    .expect("worker panicked"),
            );
        }
        out
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

/// Runs 3 in-process workers (worker 2 sleeps `straggle` per iteration) against 2 server
/// processes under `sync`, and returns what the servers traced.
fn traced_run(sync: &str, iterations: u32, straggle: Duration) -> Vec<TraceLine> {
    let dir = common::temp_dir("trace");
    let args = [
        "--servers",
        "2",
        "--workers",
        "3",
        "--sync",
        sync,
        "--optimizer",
        "sgd",
        "--lr",
        "0.01",
        "--block-bytes",
        "40",
    ];
    let (_sched, addr, mut servers) = cluster(&args, 2, Some(&dir));
    let rt = common::tokio_rt();
    rt.block_on(async {
        let tasks: Vec<_> = (0..3)
            .map(|_| {
                let addr = addr.clone();
                tokio::spawn(async move {
                    let mut c = Client::connect(ClientOptions::new(addr)).await.expect("connect");
                    c.register_model(model()).await.expect("register");
                    let mut params = c.zeros();
                    let (xs, ys) = data(c.rank() as usize);
                    for t in 0..iterations {
                        c.pull(t, &mut params).await.expect("pull");
                        if c.rank() == 2 {
                            tokio::time::sleep(straggle).await;
                        }
                        let (gw, gb) = gradient(&params[0], params[1][0], &xs, &ys);
                        c.push(t, &[gw, vec![gb]]).await.expect("push");
                    }
                    c.finish().await.expect("finish");
                })
            })
            .collect();
        for t in tasks {
            tokio::time::timeout(Duration::from_secs(60), t).await.expect("worker timed out").expect("worker panicked");
        }
    });
    // The servers flush their traces when the scheduler shuts them down.
    for s in &mut servers {
        assert!(s.wait_success(Duration::from_secs(20)), "server did not exit cleanly");
    }
    let mut lines = Vec::new();
    for i in 0..2 {
        let text = std::fs::read_to_string(dir.join(format!("trace-{i}.jsonl"))).expect("trace");
        lines.extend(text.lines().map(|l| serde_json::from_str::<TraceLine>(l).expect("trace line")));
    }
    lines
}

#[test]
fn ssp_never_answers_a_pull_while_done_is_more_than_s_behind() {
    const S: u32 = 1;
    const ITER: u32 = 25;
    let trace = traced_run("ssp:1", ITER, Duration::from_millis(4));
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
    let trace = traced_run("asp", 25, Duration::from_millis(4));
    assert_eq!(trace.len(), 3 * 3 * 25);
    assert!(trace.iter().all(|l| l.held_us.is_none()), "asp held a pull");
    // ...even though the workers drifted apart: some pull ran ahead of `done` by more than 1.
    assert!(trace.iter().any(|l| l.clock > l.done + 1), "the straggler never fell behind; the test proves nothing");
}
