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
