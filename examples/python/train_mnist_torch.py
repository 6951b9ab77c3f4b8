"""A small PyTorch CNN on the bundled MNIST subset, trained through elasticps.

Distributed (each worker trains on its own shard of the training set; the servers run the
optimizer)::

    elasticps launch --workers 2 --servers 2 --sync ssp:2 -- python examples/python/train_mnist_torch.py

The same model, trained by plain local torch on the same number of samples (the same
epochs over the whole training set, the same batch size), for comparison::

    python examples/python/train_mnist_torch.py --local

Under ``elasticps launch`` (``ELASTICPS_SCHEDULER`` set), or with ``--scheduler ADDR``
when the roles were started by hand, it joins the job; rank r trains on every size-th
example starting at r. Every few iterations it reports to the launcher
(``elasticps.log``); at the end every worker meets in a barrier, rank 0 pulls the final
parameters, evaluates them on the test set, prints ``test accuracy XX.XX%`` and logs
``accuracy=``. The learning rate decays by ``--lr-decay`` after every epoch
(``ExponentialLR``; through ``DistributedOptimizer`` the new value reaches the servers).

Defaults (Adam, lr 1e-3, 6 epochs, batch 32) reach about 97.5% on the subset, within a
point of ``--local``, in 10 to 20 s of training with 2 workers on a 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import mnist

#: The learning rate of each optimizer when --lr is not given.
DEFAULT_LR = {"sgd": 0.1, "momentum": 0.02, "adam": 1e-3}
#: Report to the launcher every this many iterations.
LOG_EVERY = 10


class Net(torch.nn.Module):
    """Two 3x3 convolutions with max pooling, then three fully connected layers (278k
    parameters: fc1 and fc2 are large enough that each server of a 2-server job holds a
    real share of the bytes, so a bandwidth-capped server is a real straggler)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3)  # 28 -> 26, pooled to 13
        self.conv2 = torch.nn.Conv2d(16, 32, 3)  # 13 -> 11, pooled to 5
        self.fc1 = torch.nn.Linear(32 * 5 * 5, 256)
        self.fc2 = torch.nn.Linear(256, 256)
        self.fc3 = torch.nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def make_optimizer(kind: str, params, lr: float) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if kind == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.Adam(params, lr=lr)


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: np.ndarray, y: np.ndarray, batch: int = 500) -> float:
    model.eval()
    correct = 0
    for i in range(0, len(x), batch):
        logits = model(torch.from_numpy(x[i : i + batch]))
        correct += int((logits.argmax(1) == torch.from_numpy(y[i : i + batch])).sum())
    model.train()
    return correct / len(x)


def batches(n: int, batch_size: int, rng: np.random.Generator):
    """One epoch: a fresh permutation of ``range(n)`` cut into full batches."""
    order = rng.permutation(n)
    for i in range(n // batch_size):
        yield order[i * batch_size : (i + 1) * batch_size]


def train_local(args, x, y, xt, yt) -> None:
    """Plain torch on the whole training set."""
    torch.manual_seed(args.seed)
    model = Net()
    opt = make_optimizer(args.optimizer, model.parameters(), args.lr)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, args.lr_decay)
    rng = np.random.default_rng(args.seed)
    started = time.monotonic()
    for epoch in range(args.epochs):
        for idx in batches(len(x), args.batch_size, rng):
            opt.zero_grad()
            loss = F.cross_entropy(model(torch.from_numpy(x[idx])), torch.from_numpy(y[idx]))
            loss.backward()
            opt.step()
        print(f"epoch {epoch + 1}/{args.epochs}: loss {loss.item():.4f}", flush=True)
        sched.step()
    train_s = time.monotonic() - started
    acc = accuracy(model, xt, yt)
    print(f"trained {args.epochs} epochs on {len(x)} samples in {train_s:.1f} s")
    print(f"local test accuracy {100 * acc:.2f}%", flush=True)


def train_distributed(args, x, y, xt, yt) -> None:
    elasticps = mnist.import_elasticps()
    import elasticps.torch  # noqa: F401 - DistributedOptimizer

    w = elasticps.init(args.scheduler)
    rank, size = w.rank, w.size
    shard = np.arange(rank, len(x), size)  # every size-th example, starting at rank
    xs, ys = x[shard], y[shard]
    torch.manual_seed(args.seed)  # the same initial model everywhere (rank 0's wins anyway)
    model = Net()
    opt = elasticps.torch.DistributedOptimizer(
        make_optimizer(args.optimizer, model.parameters(), args.lr), model.named_parameters()
    )
    # The schedule changes the groups' lr; the next push sends it to the servers.
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, args.lr_decay)
    rng = np.random.default_rng(args.seed + 1 + rank)
    per_epoch = len(xs) // args.batch_size
    total = per_epoch * args.epochs
    step = samples = 0
    started = time.monotonic()
    for epoch in range(args.epochs):
        for idx in batches(len(xs), args.batch_size, rng):
            opt.zero_grad()
            loss = F.cross_entropy(model(torch.from_numpy(xs[idx])), torch.from_numpy(ys[idx]))
            loss.backward()  # gradients are pushed from here, tensor by tensor
            opt.step()  # waits for the pushes, pulls the next parameters
            step += 1
            samples += len(idx)
            if step % LOG_EVERY == 0 or step == total:
                elasticps.log(step=step, total=total, loss=loss.item(), samples=samples)
        print(f"rank {rank}: epoch {epoch + 1}/{args.epochs}: loss {loss.item():.4f}", flush=True)
        sched.step()
    train_s = time.monotonic() - started
    print(f"rank {rank}: {step} iterations on {len(xs)} samples in {train_s:.1f} s", flush=True)
    # Every worker has pushed its last gradients once all are in the barrier: the
    # parameters rank 0 pulls then are the final ones.
    w.barrier()
    if rank == 0:
        w.pull(opt.clock, {name: p.detach().numpy() for name, p in model.named_parameters()})
        acc = accuracy(model, xt, yt)
        elasticps.log(step=step, total=total, accuracy=acc, samples=samples)
        print(f"test accuracy {100 * acc:.2f}%", flush=True)
    elasticps.finish()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=6, help="passes over the training set (default 6)")
    p.add_argument("--batch-size", type=int, default=32, help="examples per iteration and worker (default 32)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: sgd 0.1, momentum 0.02, adam 2e-3)")
    p.add_argument("--lr-decay", type=float, default=0.5, help="lr factor after each epoch (default 0.5)")
    p.add_argument("--optimizer", choices=["sgd", "momentum", "adam"], default="adam", help="default adam")
    p.add_argument("--local", action="store_true", help="train with plain local torch instead (no elasticps)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the data order (default 0)")
    p.add_argument(
        "--scheduler",
        default=os.environ.get("ELASTICPS_SCHEDULER"),
        help="the job's scheduler, host:port (default: $ELASTICPS_SCHEDULER, set by elasticps launch)",
    )
    p.add_argument("--data-dir", default=str(mnist.DATA), help="the four IDX files (default: the bundled subset)")
    args = p.parse_args(argv)
    if args.lr is None:
        args.lr = DEFAULT_LR[args.optimizer]
    if args.epochs < 1 or args.batch_size < 1 or args.threads < 1:
        p.error("--epochs, --batch-size and --threads must be at least 1")
    torch.set_num_threads(args.threads)
    data_dir = Path(args.data_dir)
    x, y = mnist.load("train", data_dir)
    xt, yt = mnist.load("t10k", data_dir)
    if args.local:
        train_local(args, x, y, xt, yt)
    elif args.scheduler:
        train_distributed(args, x, y, xt, yt)
    else:
        p.error(
            "no scheduler: run under `elasticps launch [job flags] -- python train_mnist_torch.py`, pass "
            "--scheduler HOST:PORT, or train locally with --local"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
