"""A DLRM-style click-through-rate model with 26 embedding tables, trained through elasticps.

Distributed (the tables live on the servers, cut into row ranges; each forward pulls only
the rows its batch uses, each step pushes only their gradients)::

    elasticps launch --workers 2 --servers 2 --sync ssp:2 -- python examples/python/train_ctr_torch.py

The same model, trained by plain local torch (``torch.nn.Embedding(sparse=True)`` with
``torch.optim.SparseAdam`` or ``Adagrad`` for the tables, Adam for the rest) on the same
examples with the same batch size and epochs::

    python examples/python/train_ctr_torch.py --local

The data is a generated click log (examples/python/ctr.py): 26 categorical features with
Zipf-distributed ids (exponent 1.1) into tables of 10^3 to 10^6 rows (``--rows-scale``
grows them: the servers create a row only when it is first touched), 13 dense features,
and labels drawn from a planted logistic model. The model: the dense features through a
bottom MLP to one more vector of the embedding dimension, the dot products of every pair
of the 27 vectors concatenated with that vector, a top MLP, binary cross-entropy.

Under ``elasticps launch`` rank r trains on every size-th example starting at r. Every few
iterations it reports to the launcher (``elasticps.log``); at the end every worker meets
in a barrier, rank 0 evaluates the final model on the test log, prints ``test auc 0.XXXX``
and logs ``auc=``. ``--local`` prints ``local test auc 0.XXXX``. The AUC is the rank
statistic (ctr.auc), checked in python/tests/test_examples.py against a pairwise count.

The defaults (200,000 examples, 1 epoch, batch 256, Adagrad on the tables) reach a test
AUC of about 0.70 both ways (measured: 0.6963 with ``--local``, 0.6952 with 2 workers
under ssp:2; the planted model's own AUC is about 0.83, most ids being too rare to learn).
``--quick`` (the CI form) trains 1 epoch on 60,000 examples and tests on 10,000; it runs
in well under a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, List

import numpy as np
import torch
import torch.nn.functional as F

import ctr
import mnist

#: Report to the launcher every this many iterations.
LOG_EVERY = 10
#: Examples scored per forward pass when testing.
EVAL_BATCH = 4096


def mlp(sizes: List[int], last_relu: bool) -> torch.nn.Sequential:
    layers: List[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(sizes) - 2 or last_relu:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


class DLRM(torch.nn.Module):
    """DLRM's shape (Naumov et al., 2019): embeddings of the categorical features, a
    bottom MLP for the dense ones, pairwise dot-product interaction, a top MLP."""

    def __init__(self, sizes: List[int], dim: int, embedding: Callable[[int, int], torch.nn.Module]) -> None:
        super().__init__()
        self.tables = torch.nn.ModuleList([embedding(rows, dim) for rows in sizes])
        self.bottom = mlp([ctr.N_DENSE, 64, dim], last_relu=True)
        n = len(sizes) + 1
        self.pairs = torch.triu_indices(n, n, offset=1)
        self.top = mlp([dim + n * (n - 1) // 2, 64, 32, 1], last_relu=False)

    def forward(self, ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        vecs = [self.bottom(dense)] + [table(ids[:, t]) for t, table in enumerate(self.tables)]
        z = torch.stack(vecs, 1)  # (batch, 27, dim)
        dots = torch.bmm(z, z.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([vecs[0], dots], 1)).squeeze(1)


#: The tables' initial values: uniform in +-0.05 (the servers draw elasticps's rows from it).
TABLE_INIT = {"kind": "uniform", "low": -0.05, "high": 0.05}


def init_table(weight: torch.Tensor) -> None:
    """The tables' initial values in --local (TABLE_INIT)."""
    with torch.no_grad():
        weight.uniform_(TABLE_INIT["low"], TABLE_INIT["high"])


def local_embedding(rows: int, dim: int) -> torch.nn.Module:
    e = torch.nn.Embedding(rows, dim, sparse=True)
    init_table(e.weight)
    return e


def sparse_optimizer(kind: str, params, lr: float) -> torch.optim.Optimizer:
    if kind == "adagrad":
        return torch.optim.Adagrad(params, lr=lr)
    return torch.optim.SparseAdam(params, lr=lr)


@torch.no_grad()
def scores(model: torch.nn.Module, ids: np.ndarray, dense: np.ndarray) -> np.ndarray:
    model.eval()
    out = [
        torch.sigmoid(model(torch.from_numpy(ids[i : i + EVAL_BATCH]), torch.from_numpy(dense[i : i + EVAL_BATCH])))
        for i in range(0, len(ids), EVAL_BATCH)
    ]
    model.train()
    return torch.cat(out).numpy()


def batches(n: int, batch_size: int, rng: np.random.Generator):
    """One epoch: a fresh permutation of ``range(n)`` cut into full batches."""
    order = rng.permutation(n)
    for i in range(n // batch_size):
        yield order[i * batch_size : (i + 1) * batch_size]


def train_local(args, sizes, train, test) -> None:
    """Plain torch on the whole training log."""
    ids, dense, labels = train
    torch.manual_seed(args.seed)
    model = DLRM(sizes, args.dim, local_embedding)
    sparse = sparse_optimizer(args.table_optimizer, model.tables.parameters(), args.table_lr)
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("tables.")]
    opt = torch.optim.Adam(dense_params, lr=args.lr)
    rng = np.random.default_rng(args.seed)
    started = time.monotonic()
    step = 0
    for epoch in range(args.epochs):
        for idx in batches(len(ids), args.batch_size, rng):
            opt.zero_grad()
            sparse.zero_grad()
            logits = model(torch.from_numpy(ids[idx]), torch.from_numpy(dense[idx]))
            loss = F.binary_cross_entropy_with_logits(logits, torch.from_numpy(labels[idx]))
            loss.backward()
            opt.step()
            sparse.step()
            step += 1
        print(f"epoch {epoch + 1}/{args.epochs}: loss {loss.item():.4f}", flush=True)
    train_s = time.monotonic() - started
    a = ctr.auc(test[2], scores(model, test[0], test[1]))
    print(f"trained {step} iterations on {len(ids)} examples in {train_s:.1f} s")
    print(f"local test auc {a:.4f}", flush=True)


def train_distributed(args, sizes, train, test) -> None:
    elasticps = mnist.import_elasticps()
    import elasticps.torch as ept

    w = elasticps.init(args.scheduler)
    rank, size = w.rank, w.size
    shard = np.arange(rank, len(train[0]), size)  # every size-th example, starting at rank
    ids, dense, labels = (a[shard] for a in train)
    torch.manual_seed(args.seed)  # the same initial dense model everywhere (rank 0's wins anyway)
    table_opt = ept.table_optimizer(args.table_optimizer, lr=args.table_lr)
    model = DLRM(sizes, args.dim, lambda rows, dim: ept.Embedding(rows, dim, optimizer=table_opt, init=TABLE_INIT))
    opt = ept.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=args.lr), model.named_parameters(), tables=ept.named_tables(model)
    )
    rng = np.random.default_rng(args.seed + 1 + rank)
    per_epoch = len(ids) // args.batch_size
    total = per_epoch * args.epochs
    step = samples = 0
    started = time.monotonic()
    for epoch in range(args.epochs):
        for idx in batches(len(ids), args.batch_size, rng):
            opt.zero_grad()
            logits = model(torch.from_numpy(ids[idx]), torch.from_numpy(dense[idx]))  # pulls the batch's rows
            loss = F.binary_cross_entropy_with_logits(logits, torch.from_numpy(labels[idx]))
            loss.backward()  # dense gradients are pushed from here
            opt.step()  # pushes the rows' gradients, waits, pulls the next dense parameters
            step += 1
            samples += len(idx)
            if step % LOG_EVERY == 0 or step == total:
                elasticps.log(step=step, total=total, loss=loss.item(), samples=samples)
        print(f"rank {rank}: epoch {epoch + 1}/{args.epochs}: loss {loss.item():.4f}", flush=True)
    train_s = time.monotonic() - started
    print(f"rank {rank}: {step} iterations on {len(ids)} examples in {train_s:.1f} s", flush=True)
    # Every worker has pushed its last gradients once all are in the barrier: what rank 0
    # pulls then (dense parameters here, rows in the forward passes) is the final model.
    w.barrier()
    if rank == 0:
        w.pull(opt.clock, {name: p.detach().numpy() for name, p in model.named_parameters()})
        a = ctr.auc(test[2], scores(model, test[0], test[1]))
        elasticps.log(step=step, total=total, auc=a, samples=samples)
        print(f"test auc {a:.4f}", flush=True)
    elasticps.finish()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=200_000, help="training examples (default 200,000)")
    p.add_argument("--test-examples", type=int, default=50_000, help="test examples (default 50,000)")
    p.add_argument("--epochs", type=int, default=1, help="passes over the training log (default 1: a second pass overfits the rare ids)")
    p.add_argument("--batch-size", type=int, default=256, help="examples per iteration and worker (default 256)")
    p.add_argument("--dim", type=int, default=16, help="embedding dimension (default 16)")
    p.add_argument("--rows-scale", type=float, default=1.0, help="multiplies every table's rows (default 1: 10^3..10^6)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam's lr for the MLPs (default 1e-3)")
    p.add_argument(
        "--table-optimizer", choices=["sparse_adam", "adagrad"], default="adagrad", help="the tables' optimizer (default adagrad)"
    )
    p.add_argument("--table-lr", type=float, default=0.05, help="the tables' lr (default 0.05)")
    p.add_argument("--quick", action="store_true", help="the CI form: 60,000 examples, 1 epoch, 10,000 to test")
    p.add_argument("--local", action="store_true", help="train with plain local torch instead (no elasticps)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data, the model and the data order (default 0)")
    p.add_argument(
        "--scheduler",
        default=os.environ.get("ELASTICPS_SCHEDULER"),
        help="the job's scheduler, host:port (default: $ELASTICPS_SCHEDULER, set by elasticps launch)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.examples, args.test_examples, args.epochs = 60_000, 10_000, 1
    if min(args.examples, args.test_examples, args.epochs, args.batch_size, args.dim, args.threads) < 1:
        p.error("--examples, --test-examples, --epochs, --batch-size, --dim and --threads must be at least 1")
    if args.rows_scale <= 0:
        p.error("--rows-scale must be positive")
    torch.set_num_threads(args.threads)
    sizes = ctr.table_sizes(args.rows_scale)
    train = ctr.click_log(args.seed, args.examples, sizes, part=0)
    test = ctr.click_log(args.seed, args.test_examples, sizes, part=1)
    if args.local:
        train_local(args, sizes, train, test)
    elif args.scheduler:
        train_distributed(args, sizes, train, test)
    else:
        p.error(
            "no scheduler: run under `elasticps launch [job flags] -- python train_ctr_torch.py`, pass "
            "--scheduler HOST:PORT, or train locally with --local"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
