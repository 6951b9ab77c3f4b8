"""Embedding tables against real clusters: ``Worker.pull_rows`` and ``push_rows`` (rows
in the order asked, duplicates summed, bad input a clear error that leaves the worker
usable), and ``elasticps.torch.Embedding`` / ``EmbeddingBag`` trained through the servers
with one worker under bsp, ending where plain torch (``nn.Embedding(sparse=True)`` and
the same torch optimizer) ends on the same batches: SGD, Adagrad, SparseAdam."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import elasticps.torch as ept
from table_optimizers import TABLE_OPTIMIZERS

#: A hang fails fast: every test here takes seconds.
pytestmark = pytest.mark.deadline(60)

STEPS = 8
TOLERANCE = 1e-5
ROWS, DIM = 50, 4
#: Small blocks, so that a table is many row ranges over both servers.
JOB = dict(workers=1, servers=2, sync="bsp", optimizer="sgd", lr=0.1, block_bytes=64)


def table_worker(cluster, rows=ROWS, dim=DIM, init=None, optimizer=None):
    """A worker with one dense tensor ``w`` and one table ``emb``."""
    w = cluster.connect()
    spec = (rows, dim) if init is None else (rows, dim, init)
    opts = {"emb": optimizer} if optimizer else None
    w.register_model({"w": np.zeros(3, np.float32)}, optimizers=opts, tables={"emb": spec})
    return w


def pull(w, clock, ids, dim=DIM):
    out = np.full((len(ids), dim), np.nan, np.float32)
    w.pull_rows(clock, "emb", np.asarray(ids, np.int64), out)
    return out


@pytest.mark.cluster(**JOB)
def test_rows_come_back_in_the_order_asked_and_duplicate_pushes_are_summed(cluster):
    w = table_worker(cluster, init={"kind": "constant", "value": 1.0}, optimizer={"kind": "sgd", "lr": 0.5})
    assert w.table_names() == ["emb"] and w.tensor_names() == ["w"]
    np.testing.assert_array_equal(pull(w, 0, [3, 49, 0, 3]), np.ones((4, DIM), np.float32))
    # Row 7 twice (summed), row 40 once; every other block gets an empty push.
    ids = np.array([7, 40, 7], np.int64)
    grads = np.array([[1, 2, 3, 4], [2, 2, 2, 2], [1, 0, 1, 0]], np.float32)
    w.push_rows(0, "emb", ids, grads)
    w.push(0, {"w": np.zeros(3, np.float32)})
    got = pull(w, 1, [40, 7, 8, 7])
    np.testing.assert_allclose(got[0], 1 - 0.5 * np.array([2, 2, 2, 2]))
    np.testing.assert_allclose(got[1], 1 - 0.5 * np.array([2, 2, 4, 4]))
    np.testing.assert_allclose(got[2], np.ones(DIM))
    np.testing.assert_array_equal(got[1], got[3])
    # An empty pull and an empty push are fine.
    w.pull_rows(1, "emb", np.empty(0, np.int64), np.empty((0, DIM), np.float32))
    w.push_rows(1, "emb", np.empty(0, np.int64), np.empty((0, DIM), np.float32))
    w.finish()


@pytest.mark.cluster(**JOB)
def test_bad_row_calls_raise_clear_errors_and_the_worker_stays_usable(cluster):
    w = table_worker(cluster, init={"kind": "constant", "value": 0.0})
    ids = np.array([1, 2], np.int64)
    out = np.zeros((2, DIM), np.float32)
    with pytest.raises(TypeError, match="int64, got int32"):
        w.pull_rows(0, "emb", ids.astype(np.int32), out)
    with pytest.raises(TypeError, match="float32, got float64"):
        w.pull_rows(0, "emb", ids, out.astype(np.float64))
    with pytest.raises(ValueError, match=r"shape \(2, 4\)"):
        w.pull_rows(0, "emb", ids, np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="1-dimensional"):
        w.pull_rows(0, "emb", ids.reshape(2, 1), out)
    with pytest.raises(ValueError, match='id 50 is out of range: table "emb" has 50 rows'):
        w.pull_rows(0, "emb", np.array([1, 50], np.int64), out)
    with pytest.raises(ValueError, match="id -1 is out of range"):
        w.push_rows(0, "emb", np.array([-1, 2], np.int64), out)
    with pytest.raises(ValueError, match='no table "nope"'):
        w.push_rows(0, "nope", ids, out)
    with pytest.raises(ValueError, match="dense tensor"):
        w.pull_rows(0, "w", ids, out)
    with pytest.raises(KeyError, match="it is a table"):
        w.pull(0, {"emb": np.zeros(3, np.float32)})
    with pytest.raises(TypeError, match="float32"):
        w.push_rows(0, "emb", ids, [[0.0] * DIM] * 2)
    # Nothing was sent: the worker goes on as if the bad calls never happened.
    w.push_rows(0, "emb", ids, np.ones((2, DIM), np.float32))
    w.push(0, {"w": np.zeros(3, np.float32)})
    got = pull(w, 1, [1, 2, 3])
    np.testing.assert_allclose(got[:2], np.full((2, DIM), -0.01))  # default table optimizer: sgd, lr 0.01
    np.testing.assert_array_equal(got[2], np.zeros(DIM))
    w.finish()


@pytest.mark.cluster(**JOB)
def test_register_model_refuses_bad_tables(cluster):
    w = cluster.connect()
    t = {"w": np.zeros(3, np.float32)}
    with pytest.raises(ValueError, match="both a tensor and a table"):
        w.register_model(t, tables={"w": (10, 2)})
    with pytest.raises(ValueError, match="at least 1"):
        w.register_model(t, tables={"e": (0, 2)})
    with pytest.raises(TypeError, match=r"\(rows, dim\)"):
        w.register_model(t, tables={"e": 10})
    with pytest.raises(ValueError, match='unknown kind "rmsprop"'):
        w.register_model(t, optimizers={"e": {"kind": "rmsprop", "lr": 0.1}}, tables={"e": (10, 2)})
    with pytest.raises(ValueError, match='unknown kind "gauss"'):
        w.register_model(t, tables={"e": (10, 2, {"kind": "gauss"})})
    assert w.tensor_names() == [] and w.table_names() == []
    w.register_model(t, tables={"e": (10, 2)})
    assert w.table_names() == ["e"]
    w.finish()


class Net(torch.nn.Module):
    """An Embedding and an EmbeddingBag (sum) into a linear layer."""

    def __init__(self, emb, bag):
        super().__init__()
        self.emb = emb(ROWS, DIM)
        self.bag = bag(30, DIM)
        self.out = torch.nn.Linear(2 * DIM, 1)

    def forward(self, ids, bag_ids, offsets):
        return self.out(torch.cat([self.emb(ids), self.bag(bag_ids, offsets)], 1)).squeeze(1)


def batches(n=STEPS, seed=1):
    """Batches whose ids repeat within a batch (duplicates) and across batches."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 12, (16,), generator=g)  # few distinct rows: many duplicates
        ids[:3] = 5
        bag_ids = torch.randint(0, 30, (24,), generator=g)
        offsets = torch.tensor([0, 3, 9, 10, 15, 20, 21, 22, 23, 23, 23, 23, 23, 23, 23, 23])
        out.append((ids, bag_ids, offsets, torch.randn(16, generator=g)))
    return out




@pytest.mark.parametrize("kind", list(TABLE_OPTIMIZERS))
@pytest.mark.cluster(**JOB)
def test_tables_match_torch(cluster, kind):
    make_local, spec = TABLE_OPTIMIZERS[kind]
    w = cluster.connect()
    torch.manual_seed(0)
    remote = Net(lambda n, d: ept.Embedding(n, d), lambda n, d: ept.EmbeddingBag(n, d, mode="sum"))
    dopt = ept.DistributedOptimizer(
        torch.optim.SGD(remote.parameters(), lr=0.1),
        remote.named_parameters(),
        worker=w,
        tables=ept.named_tables(remote),
        table_optimizer=spec,
    )
    assert w.table_names() == ["emb.weight", "bag.weight"]
    local = Net(
        lambda n, d: torch.nn.Embedding(n, d, sparse=True), lambda n, d: torch.nn.EmbeddingBag(n, d, mode="sum", sparse=True)
    )
    local.out.load_state_dict(remote.out.state_dict())
    # The servers' initial rows (N(0, 1), seeded by row id) become the local tables'.
    with torch.no_grad():
        for name, t in (("emb.weight", local.emb), ("bag.weight", local.bag)):
            rows = np.zeros(tuple(t.weight.shape), np.float32)
            w.pull_rows(0, name, np.arange(len(rows), dtype=np.int64), rows)
            assert rows.std() > 0.5
            t.weight.copy_(torch.from_numpy(rows))
    initial = copy.deepcopy(local)
    dense = torch.optim.SGD(local.out.parameters(), lr=0.1)
    sparse = make_local([local.emb.weight, local.bag.weight])
    for ids, bag_ids, offsets, y in batches():
        for model, opts in ((local, (dense, sparse)), (remote, (dopt,))):
            for o in opts:
                o.zero_grad()
            torch.nn.functional.mse_loss(model(ids, bag_ids, offsets), y).backward()
            for o in opts:
                o.step()
    assert dopt.clock == STEPS
    for name, t, t0 in (("emb.weight", local.emb, initial.emb), ("bag.weight", local.bag, initial.bag)):
        rows = np.zeros(tuple(t.weight.shape), np.float32)
        w.pull_rows(STEPS, name, np.arange(len(rows), dtype=np.int64), rows)
        want = t.weight.detach().numpy()
        assert np.abs(want - t0.weight.detach().numpy()).max() > 1e-3, "training did not move the rows"
        np.testing.assert_allclose(rows, want, atol=TOLERANCE, rtol=0)
    np.testing.assert_allclose(remote.out.weight.detach().numpy(), local.out.weight.detach().numpy(), atol=TOLERANCE)
    w.finish()


@pytest.mark.cluster(**JOB)
def test_an_embedding_module_refuses_what_it_cannot_do(cluster):
    with pytest.raises(ValueError, match="padding_idx"):
        ept.Embedding(10, 2, padding_idx=0)
    with pytest.raises(ValueError, match="max_norm"):
        ept.EmbeddingBag(10, 2, max_norm=1.0)
    with pytest.raises(TypeError, match="RMSprop cannot run on a table"):
        ept.table_optimizer(torch.optim.RMSprop, lr=0.1)
    e = ept.Embedding(10, 2)
    with pytest.raises(RuntimeError, match="not registered"):
        e(torch.tensor([1]))
    w = cluster.connect()
    model = torch.nn.Sequential(ept.Embedding(10, 2), torch.nn.Linear(2, 1))
    opt = ept.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), worker=w, tables=ept.named_tables(model)
    )
    with pytest.raises(IndexError, match="id 10 is out of range"):
        model(torch.tensor([3, 10]))
    # The worker goes on.
    opt.zero_grad()
    model(torch.tensor([3, 4])).sum().backward()
    opt.step()
    assert opt.clock == 1
    w.finish()


@pytest.mark.cluster(**JOB)
def test_a_table_untouched_in_some_steps_matches_torch_sparse_adam(cluster):
    w = cluster.connect()
    torch.manual_seed(0)
    remote = Net(lambda n, d: ept.Embedding(n, d), lambda n, d: ept.EmbeddingBag(n, d, mode="sum"))
    dopt = ept.DistributedOptimizer(
        torch.optim.SGD(remote.parameters(), lr=0.1),
        remote.named_parameters(),
        worker=w,
        tables=ept.named_tables(remote),
        table_optimizer=ept.table_optimizer(torch.optim.SparseAdam, lr=0.05),
    )
    local = Net(
        lambda n, d: torch.nn.Embedding(n, d, sparse=True), lambda n, d: torch.nn.EmbeddingBag(n, d, mode="sum", sparse=True)
    )
    local.out.load_state_dict(remote.out.state_dict())
    with torch.no_grad():
        rows = np.zeros((ROWS, DIM), np.float32)
        w.pull_rows(0, "emb.weight", np.arange(ROWS, dtype=np.int64), rows)
        local.emb.weight.copy_(torch.from_numpy(rows))
        rows = np.zeros((30, DIM), np.float32)
        w.pull_rows(0, "bag.weight", np.arange(30, dtype=np.int64), rows)
        local.bag.weight.copy_(torch.from_numpy(rows))
    dense = torch.optim.SGD(local.out.parameters(), lr=0.1)
    sparse = torch.optim.SparseAdam([local.emb.weight, local.bag.weight], lr=0.05)
    # Steps 0 and 2 use the bag, step 1 does not: until step 2's update of the bag's rows
    # everything else is unaffected by how the servers counted step 1.
    for step, (ids, bag_ids, offsets, y) in enumerate(batches(3)):
        for model, opts in ((local, (dense, sparse)), (remote, (dopt,))):
            for o in opts:
                o.zero_grad()
            if step % 2:  # the bag is left out: its table gets no gradient this step
                out = model.out(torch.cat([model.emb(ids), torch.zeros(16, DIM)], 1)).squeeze(1)
            else:
                out = model(ids, bag_ids, offsets)
            torch.nn.functional.mse_loss(out, y).backward()
            for o in opts:
                o.step()
    # The table used on every step matches; the one left out of step 1 does not.
    rows = np.zeros((ROWS, DIM), np.float32)
    w.pull_rows(3, "emb.weight", np.arange(ROWS, dtype=np.int64), rows)
    np.testing.assert_allclose(rows, local.emb.weight.detach().numpy(), atol=TOLERANCE, rtol=0)
    rows = np.zeros((30, DIM), np.float32)
    w.pull_rows(3, "bag.weight", np.arange(30, dtype=np.int64), rows)
    np.testing.assert_allclose(rows, local.bag.weight.detach().numpy(), atol=TOLERANCE, rtol=0)
    w.finish()
