"""Hashed embedding tables against real clusters: ``elasticps.torch.HashEmbedding`` and
``HashEmbeddingBag`` keyed by random 64-bit ids (negative int64 values too) end where a
local torch reference ends on the same batches (a dict of key -> row of a plain
``nn.Embedding(sparse=True)``, started from the servers' initial rows, and the same torch
optimizer): SGD, Adagrad, SparseAdam. With ``admit_after`` a key seen once gets no row,
and with ``max_rows`` the rows stored stay under the bound while training goes on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import elasticps.torch as ept
from table_optimizers import TABLE_OPTIMIZERS

#: A hang fails fast: every test here takes seconds.
pytestmark = pytest.mark.deadline(60)

STEPS = 6
TOLERANCE = 1e-6
DIM = 4
SERVERS = 2
JOB = dict(workers=1, servers=SERVERS, sync="bsp", optimizer="sgd", lr=0.1)
INT64 = np.iinfo(np.int64)


class Net(torch.nn.Module):
    """A HashEmbedding and a HashEmbeddingBag (sum) into a linear layer, or the same with
    the local reference's tables (``emb`` and ``bag`` take the reference's row indices)."""

    def __init__(self, emb, bag):
        super().__init__()
        self.emb = emb
        self.bag = bag
        self.out = torch.nn.Linear(2 * DIM, 1)

    def forward(self, ids, bag_ids, offsets):
        return self.out(torch.cat([self.emb(ids), self.bag(bag_ids, offsets)], 1)).squeeze(1)


def batches(seed=3):
    """Batches of random 64-bit ids: a few hot keys repeated within and across batches
    (the extremes of int64 among them), and keys seen in one batch only."""
    rng = np.random.default_rng(seed)
    hot = np.concatenate([[INT64.min, INT64.max, -1, 0], rng.integers(INT64.min, INT64.max, 8, dtype=np.int64)])
    out = []
    for _ in range(STEPS):
        once = rng.integers(INT64.min, INT64.max, 6, dtype=np.int64)  # fresh: seen this once
        ids = np.concatenate([rng.choice(hot, 10), once[:3], hot[:3]])  # 16, with repeats
        bag_ids = np.concatenate([rng.choice(hot, 18), once[3:], [hot[1]] * 3])  # 24
        offsets = np.array([0, 3, 9, 10, 15, 20, 21, 22, 23, 23, 23, 23, 23, 23, 23, 23])
        out.append((ids, bag_ids, offsets, torch.from_numpy(rng.normal(size=16).astype(np.float32))))
    return out




def pull(w, clock, name, keys, dim=DIM):
    out = np.full((len(keys), dim), np.nan, np.float32)
    w.pull_rows(clock, name, np.asarray(keys, np.int64), out)
    return out


@pytest.mark.parametrize("kind", list(TABLE_OPTIMIZERS))
@pytest.mark.cluster(**JOB)
def test_hash_embeddings_match_a_local_reference(cluster, kind):
    make_local, spec = TABLE_OPTIMIZERS[kind]
    w = cluster.connect()
    torch.manual_seed(0)
    remote = Net(ept.HashEmbedding(DIM, ranges=8), ept.HashEmbeddingBag(DIM, mode="sum", ranges=8))
    dopt = ept.DistributedOptimizer(
        torch.optim.SGD(remote.parameters(), lr=0.1),
        remote.named_parameters(),
        worker=w,
        tables=ept.named_tables(remote),
        table_optimizer=spec,
    )
    assert w.table_names() == ["emb.weight", "bag.weight"]
    data = batches()
    # The reference: every key the batches use, in a dict key -> row of a local table
    # whose rows start at the servers' initial values (N(0, 1), seeded by the key's bits).
    keys = {}
    for name, cols in (("emb.weight", 0), ("bag.weight", 1)):
        seen = sorted({int(k) for b in data for k in b[cols]})
        keys[name] = {k: i for i, k in enumerate(seen)}
    local_tables = {}
    with torch.no_grad():
        for name, mode in (("emb.weight", None), ("bag.weight", "sum")):
            n = len(keys[name])
            t = torch.nn.Embedding(n, DIM, sparse=True) if mode is None else torch.nn.EmbeddingBag(n, DIM, mode="sum", sparse=True)
            rows = pull(w, 0, name, list(keys[name]))
            assert rows.std() > 0.5 and len(np.unique(rows[:, 0])) == n, "rows start from per-key values"
            t.weight.copy_(torch.from_numpy(rows))
            local_tables[name] = t
    initial = {name: t.weight.detach().clone() for name, t in local_tables.items()}
    local = Net(local_tables["emb.weight"], local_tables["bag.weight"])
    local.out.load_state_dict(remote.out.state_dict())
    dense = torch.optim.SGD(local.out.parameters(), lr=0.1)
    sparse = make_local([local.emb.weight, local.bag.weight])

    def index(name, ids):
        return torch.tensor([keys[name][int(k)] for k in ids], dtype=torch.int64)

    for ids, bag_ids, offsets, y in data:
        local_in = (index("emb.weight", ids), index("bag.weight", bag_ids), torch.from_numpy(offsets))
        remote_in = (torch.from_numpy(ids), torch.from_numpy(bag_ids), torch.from_numpy(offsets))
        for model, opts, inputs in ((local, (dense, sparse), local_in), (remote, (dopt,), remote_in)):
            for o in opts:
                o.zero_grad()
            torch.nn.functional.mse_loss(model(*inputs), y).backward()
            for o in opts:
                o.step()
    assert dopt.clock == STEPS
    for name, t in local_tables.items():
        got = pull(w, STEPS, name, list(keys[name]))
        want = t.weight.detach().numpy()
        moved = np.abs(want - initial[name].numpy()).max(axis=1) > 1e-4
        assert moved.all(), f"{name}: training did not move {int((~moved).sum())} of the rows"
        np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=TOLERANCE)
    np.testing.assert_allclose(remote.out.weight.detach().numpy(), local.out.weight.detach().numpy(), atol=TOLERANCE)
    w.finish()


class Pair(torch.nn.Module):
    """Two hashed tables seeing the same ids: one with admission only, one also bounded."""

    def __init__(self, max_rows, ranges):
        super().__init__()
        zero = {"kind": "constant", "value": 0.0}
        sgd = ept.table_optimizer("sgd", lr=1.0)
        self.free = ept.HashEmbedding(DIM, ranges=ranges, admit_after=2, init=zero, optimizer=sgd)
        self.bounded = ept.HashEmbeddingBag(
            DIM, mode="sum", ranges=ranges, admit_after=2, max_rows=max_rows, eviction="lru", init=zero, optimizer=sgd
        )
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, ids):
        # d loss / d row = 1 per occurrence: a stored row holds -(pushes applied to it).
        return self.scale * (self.free(ids).sum() + self.bounded(ids, torch.tensor([0])).sum())


@pytest.mark.cluster(**JOB)
def test_admission_and_a_bound_limit_the_rows_stored(cluster):
    max_rows, ranges, per_step, steps = 40, 4, 30, 16
    w = cluster.connect()
    model = Pair(max_rows, ranges)
    opt = ept.DistributedOptimizer(
        torch.optim.SGD([model.scale], lr=0.0), model.named_parameters(), worker=w, tables=ept.named_tables(model)
    )
    rng = np.random.default_rng(5)
    fresh = [rng.integers(INT64.min, INT64.max, per_step, dtype=np.int64) for _ in range(steps)]
    # Step t pushes the keys new at t and those new at t - 1: each key is pushed in two
    # steps (admitted at the second), but the last step's new keys only once.
    for t in range(steps):
        ids = np.concatenate([fresh[t]] + ([fresh[t - 1]] if t else []))
        opt.zero_grad()
        model(torch.from_numpy(ids)).backward()
        opt.step()
    admitted = np.concatenate(fresh[:-1])
    free = pull(w, steps, "free.weight", admitted)
    # Admission: every key pushed twice has a row, which took the second push only.
    np.testing.assert_array_equal(free, np.full_like(free, -1.0))
    # A key pushed once has none: a pull reads its initial value.
    np.testing.assert_array_equal(pull(w, steps, "free.weight", fresh[-1]), np.zeros((per_step, DIM), np.float32))
    bounded = pull(w, steps, "bounded.weight", admitted)
    stored = int((bounded != 0).any(axis=1).sum())
    # Each of the `ranges` blocks holds at most its share of max_rows * servers (rounded up).
    bound = max_rows * SERVERS + ranges
    assert stored <= bound < len(admitted), f"{stored} rows stored for a bound of {bound}"
    # What is stored is what the bound keeps (the most recent rows, evicted ones reading
    # their initial zeros), and the rows of the last admitted keys are all there.
    assert set(np.unique(bounded)) <= {0.0, -1.0}
    assert (bounded[-per_step:] == -1.0).all()
    assert stored >= per_step
    w.finish()


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="eviction must be 'lru' or 'lfu'"):
        ept.HashEmbedding(8, eviction="fifo")
    with pytest.raises(ValueError, match=r"max_rows=-1\) must be at least 0"):
        ept.HashEmbedding(8, max_rows=-1)
    with pytest.raises(ValueError, match=r"ranges=0\) must be in 1..=65536"):
        ept.HashEmbeddingBag(8, ranges=0)
    with pytest.raises(TypeError, match=r"admit_after=...\) must be an int"):
        ept.HashEmbedding(8, admit_after=1.5)
    with pytest.raises(ValueError, match="at least one dimension"):
        ept.HashEmbedding(0)
    with pytest.raises(ValueError, match="mode must be"):
        ept.HashEmbeddingBag(8, mode="median")
    with pytest.raises(TypeError, match="ids must be an int64 or int32 tensor, got torch.float32"):
        ept.HashEmbedding(8)(torch.tensor([1.0, 2.0]))
    e = ept.HashEmbedding(8, max_rows=10, ttl_steps=5, admit_after=2, eviction="lfu")
    assert e.num_embeddings is None and e.embedding_dim == 8
    assert e.spec() == {
        "keys": "hashed", "ranges": 16, "eviction": "lfu", "max_rows": 10, "ttl_steps": 5, "admit_after": 2, "dim": 8
    }
