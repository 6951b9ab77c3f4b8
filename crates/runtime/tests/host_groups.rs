//! One push per host (`ClientOptions::group`): four workers in two host groups of two
//! train exactly as four separate workers do, under bsp with the clock's pushes
//! aggregated, against an in-process scheduler and two servers.

use std::time::Duration;

use elasticps_core::model::{Init, TensorSpec};
use elasticps_runtime::client::{Client, ClientOptions, GroupOptions};

use crate::testkit::cluster;

/// Elements of each tensor: two blocks of 4 for `a` (16-byte blocks), one for `b`.
const LENS: [usize; 2] = [8, 3];

/// Rank `r`'s gradient of tensor `k` at clock `t`: small integers, so every sum is exact
/// in any order; rank 3 has no gradient of `b` at odd clocks (an unused parameter).
fn grad(t: u32, r: u32, k: usize) -> Vec<f32> {
    if k == 1 && r == 3 && t % 2 == 1 {
        return Vec::new();
    }
    (0..LENS[k]).map(|i| ((t as usize * 5 + i * 3 + r as usize * 11 + k) % 7) as f32 - 3.0).collect()
}

/// Trains `workers` workers for `steps` clocks (push_pull of every tensor, bsp,
/// aggregated, SGD lr 1), worker r in host group `groups[r]` if any (its directory, size
/// and local rank); returns each rank's values after every clock.
async fn train(groups: Vec<Option<GroupOptions>>, steps: u32) -> Vec<Vec<Vec<Vec<f32>>>> {
    let workers = groups.len() as u32;
    let (addr, scheduler) = cluster(workers, true).await;
    let mut clients = Vec::new();
    for g in &groups {
        let mut opts = ClientOptions::new(addr.clone());
        opts.scheduler_retry = Duration::ZERO;
        opts.group = g.clone();
        // Connected one after the other: ranks in this order.
        clients.push(Client::connect(opts).await.unwrap());
    }
    let runs = clients.into_iter().enumerate().map(|(r, mut client)| {
        tokio::spawn(async move {
            assert_eq!(client.rank(), r as u32);
            let specs = LENS.iter().zip(["a", "b"]).map(|(l, n)| TensorSpec {
                name: n.into(),
                shape: vec![*l],
                init: Init::Zeros,
            });
            client.register_model(specs.collect()).await.unwrap();
            let mut params = client.zeros();
            client.pull(0, &mut params).await.unwrap();
            let mut seen = Vec::new();
            for t in 0..steps {
                let grads: Vec<Vec<f32>> = (0..LENS.len()).map(|k| grad(t, r as u32, k)).collect();
                client.push_pull(t, &grads, &mut params).await.unwrap();
                seen.push(params.clone());
            }
            client.finish().await.unwrap();
            seen
        })
    });
    let all = futures::future::join_all(runs);
    let seen = tokio::time::timeout(Duration::from_secs(60), all).await.expect("the job ends within a minute");
    scheduler.abort();
    seen.into_iter().map(|s| s.unwrap()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_host_groups_of_two_train_exactly_as_four_separate_workers() {
    let steps = 6;
    let separate = train(vec![None; 4], steps).await;
    let dirs: Vec<std::path::PathBuf> = (0..2)
        .map(|g| {
            let d = std::env::temp_dir().join(format!("elasticps-host-group-test-{}-{g}", std::process::id()));
            let _ = std::fs::remove_dir_all(&d);
            std::fs::create_dir_all(&d).unwrap();
            d
        })
        .collect();
    let groups =
        (0..4).map(|r| Some(GroupOptions { dir: dirs[r / 2].clone(), size: 2, local_rank: r as u32 % 2 })).collect();
    let grouped = train(groups, steps).await;
    for d in dirs {
        let _ = std::fs::remove_dir_all(d);
    }
    // The mean of the four gradients, every clock: the values move, by quarters.
    let mut want = vec![vec![0f32; LENS[0]], vec![0f32; LENS[1]]];
    for t in 0..steps {
        for (k, w) in want.iter_mut().enumerate() {
            let mut sum = vec![0f32; LENS[k]];
            for r in 0..4 {
                for (s, g) in sum.iter_mut().zip(grad(t, r, k)) {
                    *s += g;
                }
            }
            for (w, s) in w.iter_mut().zip(sum) {
                *w -= s / 4.0;
            }
        }
        for r in 0..4 {
            assert_eq!(separate[r][t as usize], want, "separate rank {r}, clock {t}");
            assert_eq!(grouped[r][t as usize], want, "grouped rank {r}, clock {t}: the same values, bit for bit");
        }
    }
    assert!(want[0].iter().any(|v| v.fract() != 0.0), "the test needs means that are not the sums");
}
