"""A numpy-only training loop through elasticps: softmax regression on the bundled MNIST
subset, gradients by hand, through the numpy API (register_model, push_pull, pull,
barrier, log, finish).

    elasticps launch --workers 2 --servers 2 --sync ssp:2 -- python examples/python/numpy_loop.py

Under ``elasticps launch`` (``ELASTICPS_SCHEDULER`` set), or with ``--scheduler ADDR``,
it joins the job; rank r trains on every size-th training example starting at r. The
servers run the optimizer this script names per tensor (``--optimizer``, ``--lr``), so
the job's own ``--optimizer`` does not matter. At the end rank 0 prints
``test accuracy XX.XX%``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

import mnist

#: The learning rate of each optimizer when --lr is not given.
DEFAULT_LR = {"sgd": 0.02, "momentum": 0.002, "adam": 1e-3}
LOG_EVERY = 10


def forward(params, x):
    """Class probabilities of a batch: softmax(x W + b)."""
    logits = x @ params["W"] + params["b"]
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    return p


def loss_and_grads(params, x, y):
    """Mean cross-entropy of a batch and its gradients, by hand: d(loss)/d(logits) is
    ``(p - onehot(y)) / B``."""
    p = forward(params, x)
    n = len(y)
    loss = float(-np.log(p[np.arange(n), y] + 1e-12).mean())
    p[np.arange(n), y] -= 1.0
    p /= n
    # float32 and C-contiguous, as the client requires.
    grads = {"W": np.ascontiguousarray(x.T @ p, dtype=np.float32), "b": p.sum(axis=0).astype(np.float32)}
    return loss, grads


def server_optimizer(kind: str, lr: float) -> dict:
    if kind == "sgd":
        return {"kind": "sgd", "lr": lr}
    if kind == "momentum":
        return {"kind": "momentum", "lr": lr, "momentum": 0.9}
    return {"kind": "adam", "lr": lr, "betas": (0.9, 0.999), "eps": 1e-8}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=5, help="passes over the training set (default 5)")
    p.add_argument("--batch-size", type=int, default=64, help="examples per iteration and worker (default 64)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: sgd 0.02, momentum 0.002, adam 1e-3)")
    p.add_argument("--optimizer", choices=["sgd", "momentum", "adam"], default="sgd", help="default sgd")
    p.add_argument("--seed", type=int, default=0, help="seed of the data order (default 0)")
    p.add_argument(
        "--scheduler",
        default=os.environ.get("ELASTICPS_SCHEDULER"),
        help="the job's scheduler, host:port (default: $ELASTICPS_SCHEDULER, set by elasticps launch)",
    )
    p.add_argument("--data-dir", default=str(mnist.DATA), help="the four IDX files (default: the bundled subset)")
    args = p.parse_args(argv)
    if not args.scheduler:
        p.error("no scheduler: run under `elasticps launch [job flags] -- python numpy_loop.py` or pass --scheduler")
    if args.epochs < 1 or args.batch_size < 1:
        p.error("--epochs and --batch-size must be at least 1")
    lr = DEFAULT_LR[args.optimizer] if args.lr is None else args.lr

    data_dir = Path(args.data_dir)
    x, y = mnist.load("train", data_dir)
    xt, yt = mnist.load("t10k", data_dir)
    x, xt = x.reshape(len(x), -1), xt.reshape(len(xt), -1)

    elasticps = mnist.import_elasticps()
    w = elasticps.init(args.scheduler)
    rank, size = w.rank, w.size
    xs, ys = x[rank::size], y[rank::size]

    # Rank 0's values (zeros here) become every worker's: register_model writes them in place.
    params = {"W": np.zeros((x.shape[1], 10), np.float32), "b": np.zeros(10, np.float32)}
    opt = server_optimizer(args.optimizer, lr)
    w.register_model(params, optimizers={name: opt for name in params})

    rng = np.random.default_rng(args.seed + 1 + rank)
    per_epoch = len(xs) // args.batch_size
    total = per_epoch * args.epochs
    clock = 0
    started = time.monotonic()
    for epoch in range(args.epochs):
        order = rng.permutation(len(xs))
        for i in range(per_epoch):
            idx = order[i * args.batch_size : (i + 1) * args.batch_size]
            loss, grads = loss_and_grads(params, xs[idx], ys[idx])
            # Push this clock's gradients and pull the next clock's parameters into
            # `params`, in place (the servers hold the pull as the sync policy says).
            w.push_pull(clock, grads, params)
            clock += 1
            if clock % LOG_EVERY == 0 or clock == total:
                elasticps.log(step=clock, total=total, loss=loss, samples=clock * args.batch_size)
        print(f"rank {rank}: epoch {epoch + 1}/{args.epochs}: loss {loss:.4f}", flush=True)
    print(f"rank {rank}: {clock} iterations in {time.monotonic() - started:.1f} s", flush=True)

    w.barrier()  # everyone's last push is in: rank 0 pulls the final parameters
    if rank == 0:
        w.pull(clock, params)
        acc = float((forward(params, xt).argmax(axis=1) == yt).mean())
        elasticps.log(step=clock, total=total, accuracy=acc, samples=clock * args.batch_size)
        print(f"test accuracy {100 * acc:.2f}%", flush=True)
    elasticps.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
