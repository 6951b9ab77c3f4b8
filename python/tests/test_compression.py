"""DistributedOptimizer(compression=...) against a real cluster: with one worker under bsp,
training through the servers ends with the parameters of a local reference that does what
the wire does (bf16: gradients rounded to bf16 on the way in, the servers' float32
parameters rounded on the way out; top-k: each tensor's largest entries of gradient plus
residual sent, the rest kept), and not with uncompressed training's."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import elasticps.torch as ept
from test_torch import batches, max_diff, mlp

pytestmark = pytest.mark.deadline(60)

STEPS = 12
#: A power of two: lr x gradient is exact, so the reference's arithmetic is the servers'.
LR = 0.5
JOB = dict(workers=1, servers=2, sync="bsp", optimizer="sgd", lr=0.1, block_bytes=1024)


def grads_of(model, x, y):
    model.zero_grad()
    torch.nn.CrossEntropyLoss()(model(x), y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def reference(initial, data, send):
    """SGD through a wire: ``send(i, grad)`` is what reaches the servers of tensor i's
    gradient, ``pull(master)`` is what comes back; the servers hold float32 masters."""
    model = copy.deepcopy(initial)
    masters = [p.detach().clone() for p in model.parameters()]
    for x, y in data:
        for i, g in enumerate(grads_of(model, x, y)):
            masters[i] -= LR * send(i, g)
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters):
                p.copy_(send.pull(m))
    return model


def through_cluster(cluster, initial, data, compression):
    model = copy.deepcopy(initial)
    w = cluster.connect()
    opt = ept.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR), model.named_parameters(), worker=w, compression=compression
    )
    loss_fn = torch.nn.CrossEntropyLoss()
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    w.finish()
    return model


class Bf16:
    def __call__(self, i, g):
        return g.to(torch.bfloat16).float()

    def pull(self, m):
        return m.to(torch.bfloat16).float()


class TopK:
    def __init__(self, ratio):
        self.ratio = ratio
        self.residual = {}

    def __call__(self, i, g):
        r = self.residual.setdefault(i, torch.zeros_like(g)).reshape(-1)
        r += g.reshape(-1)
        k = max(1, math.ceil(self.ratio * r.numel()))
        idx = torch.topk(r.abs(), k).indices
        sent = torch.zeros_like(r)
        sent[idx] = r[idx]
        r[idx] = 0.0
        return sent.reshape(g.shape)

    def pull(self, m):
        return m


@pytest.mark.cluster(**JOB)
def test_bf16_training_is_the_local_bf16_reference(cluster):
    data, initial = batches(STEPS), mlp()
    remote = through_cluster(cluster, initial, data, ept.Compression.bf16)
    want = reference(initial, data, Bf16())
    assert max_diff(remote, want) < 1e-6
    exact = reference(initial, data, _Exact())
    assert max_diff(remote, exact) > 1e-4, "bf16 on the wire changed nothing: the gradients did not travel as bf16"
    for p in remote.parameters():
        assert torch.equal(p, p.to(torch.bfloat16).float()), "pulled parameters are bf16 values"


@pytest.mark.parametrize("how", ["argument", "environment"])
@pytest.mark.cluster(**JOB)
def test_topk_training_is_the_local_error_feedback_reference(cluster, how, monkeypatch):
    data, initial = batches(STEPS), mlp()
    # Every tensor of the model has a multiple of 4 entries: k is exactly a quarter.
    if how == "environment":
        # What `elasticps launch --compress topk:0.25` gives its scripts.
        monkeypatch.setenv("ELASTICPS_COMPRESS", "topk:0.25")
        remote = through_cluster(cluster, initial, data, None)
    else:
        remote = through_cluster(cluster, initial, data, ept.Compression.topk(0.25))
    want = reference(initial, data, TopK(0.25))
    assert max_diff(remote, want) < 1e-6
    exact = reference(initial, data, _Exact())
    assert max_diff(remote, exact) > 1e-4, "top-k changed nothing: the gradients went whole"


class _Exact:
    def __call__(self, i, g):
        return g

    def pull(self, m):
        return m


def test_compression_is_checked():
    with pytest.raises(ValueError, match="unknown compression wire dtype"):
        ept.Compression("int8")
    assert ept.Compression.topk(0.01).sparsify == "topk:0.01"
    assert ept.Compression.randomk(0.5, wire="bf16").wire == "bf16"
