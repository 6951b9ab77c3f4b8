"""A factorization machine over hashed feature ids, trained on a drifting click stream
through elasticps, its tables bounded on the servers::

    elasticps launch --workers 1 --servers 2 -- python examples/python/train_stream_ctr.py \\
        --steps 2000 --distinct-ids 10000000 --max-rows 100000 --admit-after 2

The stream (examples/python/ctr.py, ``ClickStream``): 8 fields, each a hashed 64-bit id
(any int64) drawn with Zipf popularity from a population that drifts: new items keep
appearing and old ones fade, about ``--distinct-ids`` items over the run (the ids a run
actually sees are fewer: the Zipf tail is rarely drawn). Labels come from a hidden model
of per-item weights and pairwise dot products of per-item vectors.

The model: a factorization machine (Rendle, 2010), a first-order weight per id
(``HashEmbedding(1)``, starting at 0) and a ``--dim`` vector per id (``HashEmbedding``),
both tables keyed by the raw 64-bit ids and limited alike: ``--max-rows`` per server
(``--eviction`` lru or lfu), ``--ttl-steps``, ``--admit-after``. Adagrad on the tables,
Adam on the global bias, through ``elasticps.torch.DistributedOptimizer``.

It prints the progressive AUC (each batch scored by the model before it trains on it,
over the last fifth of the run), the holdout test AUC (rank 0, after every worker's last
step: ``--test-examples`` drawn from the stream's population at its end, ``test auc
0.XXXX``), and the rows stored, estimated as: the distinct ids rank 0 saw (a KMV sketch,
whose ids are a uniform sample of them) times the fraction of that sample whose
first-order weight is not its initial 0 on the servers (a row never admitted, evicted or
expired reads 0): ``rows stored ~N``. Rank r trains on its own draws of each step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

import ctr

#: Report to the launcher every this many steps.
LOG_EVERY = 50
#: Examples scored per forward pass when testing.
EVAL_BATCH = 4096
#: The vectors' initial values (uniform in +-0.05).
VECTOR_INIT = {"kind": "uniform", "low": -0.05, "high": 0.05}


class FM(torch.nn.Module):
    """A factorization machine over hashed ids: bias + sum_i w_i + sum_{i<j} <v_i, v_j>."""

    def __init__(self, ept, dim: int, limits: dict, table_lr: float) -> None:
        super().__init__()
        opt = ept.table_optimizer("adagrad", lr=table_lr)
        self.w = ept.HashEmbedding(1, init={"kind": "constant", "value": 0.0}, optimizer=opt, **limits)
        self.v = ept.HashEmbedding(dim, init=VECTOR_INIT, optimizer=opt, **limits)
        self.bias = torch.nn.Parameter(torch.zeros(1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        v = self.v(ids)  # (batch, fields, dim)
        pairs = 0.5 * (v.sum(1).pow(2) - v.pow(2).sum(1)).sum(1)
        return self.bias + self.w(ids).sum((1, 2)) + pairs


class DistinctSketch:
    """A KMV sketch of the distinct ids seen: the ``k`` smallest 64-bit hashes and their
    ids, a uniform sample of the distinct ids, and an estimate of their number."""

    def __init__(self, k: int = 4096) -> None:
        self.k = k
        self.hashes = np.empty(0, np.uint64)
        self.ids = np.empty(0, np.int64)

    def add(self, ids: np.ndarray) -> None:
        ids = ids.ravel()
        h = ctr._mix(ids.view(np.uint64) ^ np.uint64(0x5DEECE66D))
        hashes, first = np.unique(np.concatenate([self.hashes, h]), return_index=True)
        both = np.concatenate([self.ids, ids])
        self.hashes, self.ids = hashes[: self.k], both[first[: self.k]]

    def count(self) -> float:
        if len(self.hashes) < self.k:
            return float(len(self.hashes))
        return (self.k - 1) * 2.0**64 / float(self.hashes[-1])


def stored_fraction(worker, clock: int, name: str, ids: np.ndarray) -> float:
    """The fraction of ``ids`` whose first-order weight on the servers is not 0."""
    out = np.zeros((len(ids), 1), np.float32)
    worker.pull_rows(clock, name, ids.astype(np.int64), out)
    return float((out != 0).mean()) if len(ids) else 0.0


@torch.no_grad()
def scores(model: torch.nn.Module, ids: np.ndarray) -> np.ndarray:
    out = [torch.sigmoid(model(torch.from_numpy(ids[i : i + EVAL_BATCH]))) for i in range(0, len(ids), EVAL_BATCH)]
    return torch.cat(out).numpy()


def test_set(stream: "ctr.ClickStream", steps: int, n: int) -> Tuple[np.ndarray, np.ndarray]:
    """``n`` held-out examples (part 1) from the population of the stream's last 10 steps."""
    chunks = [stream.batch(steps - 1 - i, -(-n // 10), part=1) for i in range(10)]
    ids = np.concatenate([c[0] for c in chunks])[:n]
    labels = np.concatenate([c[1] for c in chunks])[:n]
    return ids, labels


def limits_of(args) -> dict:
    return dict(
        ranges=args.ranges,
        max_rows=args.max_rows,
        eviction=args.eviction,
        ttl_steps=args.ttl_steps,
        admit_after=args.admit_after,
    )


def train(args) -> None:
    import elasticps
    import elasticps.torch as ept

    w = elasticps.init(args.scheduler)
    rank = w.rank
    stream = ctr.ClickStream.for_distinct(args.distinct_ids, args.steps, seed=args.seed)
    torch.manual_seed(args.seed)
    model = FM(ept, args.dim, limits_of(args), args.table_lr)
    opt = ept.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=args.lr), model.named_parameters(), tables=ept.named_tables(model)
    )
    sketch = DistinctSketch(args.sketch)
    last: List[Tuple[np.ndarray, np.ndarray]] = []
    window_from = args.steps - max(1, args.steps // 5)
    started = time.monotonic()
    step = w.start_clock
    for step in range(w.start_clock, args.steps):
        ids, labels = stream.batch(step, args.batch_size, part=0, rank=rank)
        sketch.add(ids)
        opt.zero_grad()
        logits = model(torch.from_numpy(ids))  # pulls the batch's rows
        loss = F.binary_cross_entropy_with_logits(logits, torch.from_numpy(labels))
        loss.backward()
        opt.step()  # pushes the rows' gradients
        if step >= window_from:
            last.append((labels, torch.sigmoid(logits.detach()).numpy()))
        if (step + 1) % LOG_EVERY == 0 or step + 1 == args.steps:
            elasticps.log(step=step + 1, total=args.steps, loss=loss.item(), samples=(step + 1) * args.batch_size)
            if args.progress and rank == 0:
                print(f"step {step + 1}/{args.steps} loss {loss.item():.4f}", flush=True)
    train_s = time.monotonic() - started
    progressive = ctr.auc(np.concatenate([a for a, _ in last]), np.concatenate([b for _, b in last]))
    print(f"rank {rank}: {args.steps} steps of {args.batch_size} in {train_s:.1f} s", flush=True)
    print(f"rank {rank}: progressive auc {progressive:.4f} (last {len(last)} steps)", flush=True)
    # Every worker has pushed its last gradients once all are in the barrier.
    w.barrier()
    if rank == 0:
        w.pull(opt.clock, {"bias": model.bias.detach().numpy()})
        ids, labels = test_set(stream, args.steps, args.test_examples)
        a = ctr.auc(labels, scores(model, ids))
        seen = sketch.count()
        frac = stored_fraction(w, opt.clock, "w.weight", sketch.ids)
        stored = seen * frac
        print(f"distinct ids seen ~{seen:.0f} (rank 0; sketch of {len(sketch.ids)})", flush=True)
        print(f"rows stored ~{stored:.0f} per table ({frac:.3f} of the ids seen)", flush=True)
        print(f"test auc {a:.4f}", flush=True)
        elasticps.log(step=args.steps, total=args.steps, auc=a, samples=args.steps * args.batch_size)
    elasticps.finish()


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000, help="steps (default 2000)")
    p.add_argument("--batch-size", type=int, default=512, help="examples per step and worker (default 512)")
    p.add_argument(
        "--distinct-ids", type=int, default=10_000_000, help="items the stream holds over the run, all fields (default 10^7)"
    )
    p.add_argument("--dim", type=int, default=8, help="the FM's vector dimension (default 8)")
    p.add_argument("--max-rows", type=int, help="each table's bound, rows per server (default: none)")
    p.add_argument("--eviction", choices=["lru", "lfu"], default="lru", help="what a bound evicts first (default lru)")
    p.add_argument("--ttl-steps", type=int, help="a row not pushed for this many steps goes (default: never)")
    p.add_argument("--admit-after", type=int, help="a key gets a row at its N-th push (default: the first)")
    p.add_argument("--ranges", type=int, default=16, help="key ranges per table (default 16)")
    p.add_argument("--lr", type=float, default=1e-2, help="Adam's lr for the bias (default 0.01)")
    p.add_argument("--table-lr", type=float, default=0.05, help="the tables' Adagrad lr (default 0.05)")
    p.add_argument("--test-examples", type=int, default=20_000, help="held-out examples (default 20,000)")
    p.add_argument("--sketch", type=int, default=4096, help="ids in the distinct-id sketch (default 4096)")
    p.add_argument("--progress", action="store_true", help="rank 0 prints a line every 50 steps")
    p.add_argument("--quick", action="store_true", help="the CI form: 150 steps of 256, 10^6 distinct ids")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the stream and the model (default 0)")
    p.add_argument(
        "--scheduler",
        default=os.environ.get("ELASTICPS_SCHEDULER"),
        help="the job's scheduler, host:port (default: $ELASTICPS_SCHEDULER, set by elasticps launch)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.batch_size, args.distinct_ids, args.test_examples = 150, 256, 10**6, 5000
    if min(args.steps, args.batch_size, args.distinct_ids, args.dim, args.test_examples, args.sketch, args.threads) < 1:
        p.error("--steps, --batch-size, --distinct-ids, --dim, --test-examples, --sketch and --threads must be at least 1")
    torch.set_num_threads(args.threads)
    if not args.scheduler:
        p.error("no scheduler: run under `elasticps launch [job flags] -- python train_stream_ctr.py`, or pass --scheduler HOST:PORT")
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
