//! A worker with gradient compression (`ClientOptions::compress`) against an in-process
//! scheduler and two servers: what the servers apply is what the worker's error feedback
//! sent, and sent plus residual is every gradient.

use std::time::Duration;

use elasticps_core::compress::{ErrorFeedback, Sparsifier};
use elasticps_core::model::{Init, TensorSpec};
use elasticps_runtime::client::{Client, ClientOptions};

use crate::testkit::cluster;

/// Elements of the one tensor: two blocks of 4 (16-byte blocks), one per server.
const LEN: usize = 8;

/// Gradient of clock `t`: small integers, so every sum is exact.
fn grad(t: u32) -> Vec<f32> {
    (0..LEN).map(|i| (((t as usize * 5 + i * 3) % 7) as f32) - 3.0).collect()
}

/// A worker of `opts` with the one tensor registered.
async fn worker(mut opts: ClientOptions) -> Client {
    opts.scheduler_retry = Duration::ZERO;
    let mut client = Client::connect(opts).await.unwrap();
    client.register_model(vec![TensorSpec { name: "w".into(), shape: vec![LEN], init: Init::Zeros }]).await.unwrap();
    client
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compressed_push_applies_what_the_error_feedback_sent() {
    let (addr, scheduler) = cluster(1, false).await;
    let sparsifier = Sparsifier::TopK { ratio: 0.25 };
    let mut opts = ClientOptions::new(addr);
    opts.compress = Some(sparsifier);
    let run = async {
        let mut client = worker(opts).await;
        // The worker's error feedback, replayed here (top-k draws nothing at random).
        let mut mirror = ErrorFeedback::new(sparsifier, 0);
        let mut sent = vec![0f32; LEN];
        let mut pushed = vec![0f32; LEN];
        let mut params = client.zeros();
        for t in 0..6 {
            let g = grad(t);
            client.push_pull(t, std::slice::from_ref(&g), &mut params).await.unwrap();
            let s = mirror.compress(&g);
            assert_eq!(s.indices.len(), 2, "top-k of 25% of 8");
            for (i, v) in s.indices.iter().zip(&s.values) {
                sent[*i as usize] += v;
            }
            for (p, g) in pushed.iter_mut().zip(&g) {
                *p += g;
            }
            let expected: Vec<f32> = sent.iter().map(|s| -s).collect();
            assert_eq!(params[0], expected, "clock {t}: the servers applied what was sent");
            for i in 0..LEN {
                assert_eq!(sent[i] + mirror.residual()[i], pushed[i]);
            }
        }
        assert_ne!(sent, pushed, "compression held some gradient back");
        client.finish().await.unwrap();
    };
    tokio::time::timeout(Duration::from_secs(60), run).await.expect("the job ends within a minute");
    scheduler.abort();
}

/// A job on bf16: the servers add the bf16 gradients in f32, and a pull brings their
/// values back rounded to bf16 (1/3 is not a bf16: every step shows it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bf16_pushes_and_pulls_round_at_the_edges_and_the_servers_add_in_f32() {
    use elasticps_wire::Dtype;
    let (addr, scheduler) = cluster(1, false).await;
    let mut opts = ClientOptions::new(addr);
    opts.wire_dtype = Dtype::Bf16;
    let run = async {
        let mut client = worker(opts).await;
        let mut server = [0f32; LEN];
        let mut params = client.zeros();
        for t in 0..4 {
            let g: Vec<f32> = (0..LEN).map(|i| (t * 8 + i as u32 + 1) as f32 / 3.0).collect();
            client.push_pull(t, std::slice::from_ref(&g), &mut params).await.unwrap();
            for (s, g) in server.iter_mut().zip(&g) {
                *s -= Dtype::Bf16.round(*g);
            }
            let want: Vec<f32> = server.iter().map(|v| Dtype::Bf16.round(*v)).collect();
            assert_eq!(params[0], want, "clock {t}: bf16 of the f32 sum of bf16 gradients");
        }
        assert!(server.iter().any(|v| Dtype::Bf16.round(*v) != *v), "the test needs sums that are not bf16");
        client.finish().await.unwrap();
    };
    tokio::time::timeout(Duration::from_secs(60), run).await.expect("the job ends within a minute");
    scheduler.abort();
}

/// `--balance psld --balance-compress bf16` with server 1's link capped to half of server
/// 0's: moving its one block would only move the straggler, so the balancer compresses
/// it. From the round the worker follows the layout that marks the block bf16, that block
/// travels bf16 both ways: the server subtracts the bf16 of each gradient from its f32
/// master value, and the pull brings that back rounded to bf16; block 0 stays exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_the_balancer_marks_bf16_travels_bf16_both_ways() {
    use elasticps_wire::{Dtype, Injection};
    // Two blocks of 1,024 values: 4 KiB a frame, 10 ms on server 0's link, 20 ms on 1's.
    const N: usize = 2048;
    let cap = |bps| Injection { bandwidth_bps: bps, interference: 1.0, at_us: 0 };
    let (addr, scheduler) = capped_cluster(vec![(0, cap(400_000)), (1, cap(200_000))]).await;
    let mut opts = ClientOptions::new(addr);
    opts.scheduler_retry = Duration::ZERO;
    let run = async {
        let mut client = Client::connect(opts).await.unwrap();
        client.register_model(vec![TensorSpec { name: "w".into(), shape: vec![N], init: Init::Zeros }]).await.unwrap();
        let blocks = client.layout().unwrap().partition.blocks.clone();
        assert_eq!(blocks.len(), 2);
        assert_eq!(client.layout().unwrap().placement.owners, [0, 1], "one block a server");
        let mut master = vec![0f32; N];
        let mut params = client.zeros();
        let mut narrowed = 0;
        for t in 0.. {
            let g: Vec<f32> = (0..N).map(|i| ((t as usize * 7 + i) % 11 + 1) as f32 / 3.0).collect();
            client.push_pull(t, std::slice::from_ref(&g), &mut params).await.unwrap();
            // The layout the round followed (a pushed one is installed before it starts).
            let bf16 = client.layout().unwrap().wire.get(1) == Some(&Dtype::Bf16);
            let b = &blocks[1];
            for (i, m) in master.iter_mut().enumerate() {
                let in_1 = (b.offset..b.offset + b.len).contains(&i);
                *m -= if in_1 && bf16 { Dtype::Bf16.round(g[i]) } else { g[i] };
            }
            for (i, (p, m)) in params[0].iter().zip(&master).enumerate() {
                let in_1 = (b.offset..b.offset + b.len).contains(&i);
                let want = if in_1 && bf16 { Dtype::Bf16.round(*m) } else { *m };
                assert_eq!(*p, want, "clock {t}, element {i} (block 1 in bf16: {bf16})");
            }
            if bf16 {
                narrowed += 1;
                assert!(params[0][b.offset..].iter().any(|v| *v != 0.0));
                assert!(master[..b.offset].iter().any(|v| Dtype::Bf16.round(*v) != *v), "block 0 is not bf16");
            }
            if narrowed == 3 {
                break;
            }
        }
        client.finish().await.unwrap();
    };
    tokio::time::timeout(Duration::from_secs(90), run).await.expect("the balancer compresses block 1 within 90 s");
    scheduler.abort();
}

/// An in-process psld scheduler (`--balance-compress bf16`, SGD, lr 1, bsp, one worker,
/// blocks of 4 KiB placed by range) and two servers injected with `inject`; the
/// scheduler's address and task.
async fn capped_cluster(
    inject: Vec<(u32, elasticps_wire::Injection)>,
) -> (String, tokio::task::JoinHandle<elasticps_runtime::Result<String>>) {
    use elasticps_core::balance::BalanceMode;
    use elasticps_core::placement::PlacementKind;
    let job = elasticps_runtime::scheduler::JobConfig {
        block_bytes: 4096,
        placement: PlacementKind::Range,
        inject,
        balance: BalanceMode::Psld,
        balance_compress: Some(elasticps_wire::Dtype::Bf16),
        ..crate::testkit::job(1, false)
    };
    crate::testkit::start(job).await
}
