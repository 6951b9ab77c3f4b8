//! Checks against the full datasets that `scripts/fetch-data` installs. Ignored by default
//! (they need the downloads); run with `cargo test -p elasticps-train -- --ignored`.

use std::time::Instant;

use elasticps_train::{Batcher, DatasetKind, Mlp, as_slices, load, sgd_step};

#[test]
#[ignore = "needs scripts/fetch-data (MNIST in ~/.cache/elasticps/mnist)"]
fn full_mnist_loads() {
    let (train, test) = load(DatasetKind::Mnist, None).unwrap();
    assert_eq!((train.len(), test.len()), (60_000, 10_000));
    assert_eq!(train.features(), 784);
    // The bundled subset is a prefix of full MNIST.
    let (sub_train, sub_test) = load(DatasetKind::MnistSubset, None).unwrap();
    assert_eq!(train.labels[..10_000], sub_train.labels[..]);
    assert_eq!(train.images.row(9_999), sub_train.images.row(9_999));
    assert_eq!(test.labels[..2_000], sub_test.labels[..]);
}

#[test]
#[ignore = "needs scripts/fetch-data (apt package dataset-fashion-mnist)"]
fn full_fashion_mnist_loads() {
    let (train, test) = load(DatasetKind::FashionMnist, None).unwrap();
    assert_eq!((train.len(), test.len()), (60_000, 10_000));
    assert_eq!(test.features(), 784);
    // First Fashion-MNIST labels: ankle boot (9), t-shirt (0), t-shirt (0).
    assert_eq!(&train.labels[..3], &[9, 0, 0]);
}

fn train_full(kind: DatasetKind, epochs: usize) -> f32 {
    let start = Instant::now();
    let (train, test) = load(kind, None).unwrap();
    let mlp = Mlp::default();
    let mut params = mlp.init_params(1);
    let mut grads = vec![Vec::new(); params.len()];
    let mut batches = Batcher::new(&train, 32, 2).unwrap();
    while batches.epoch() < epochs {
        let batch = batches.next_batch();
        mlp.loss_and_grad_into(&as_slices(&params), batch.x, batch.y, &mut grads);
        sgd_step(&mut params, &grads, 0.1);
    }
    let eval = mlp.evaluate(&as_slices(&params), &test);
    eprintln!("{kind}, {epochs} epochs: {eval}, {:.2?}", start.elapsed());
    eval.accuracy
}

#[test]
#[ignore = "needs scripts/fetch-data; trains for a while"]
fn full_mnist_reaches_97_percent() {
    assert!(train_full(DatasetKind::Mnist, 5) >= 0.97);
}

#[test]
#[ignore = "needs scripts/fetch-data; trains for a while"]
fn full_fashion_mnist_reaches_85_percent() {
    assert!(train_full(DatasetKind::FashionMnist, 5) >= 0.85);
}
