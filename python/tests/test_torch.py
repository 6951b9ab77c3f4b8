"""elasticps.torch.DistributedOptimizer against real clusters: with one worker under bsp,
training through the servers ends with the parameters plain local torch reaches on the
same batches (SGD, SGD with momentum and weight decay, Adam, AdamW, an lr scheduler,
clipping between backward and step, accumulation over backward passes, a parameter that
gets no gradient on some steps); what the servers cannot run is a TypeError."""

from __future__ import annotations

import copy
import io
import json

import numpy as np
import pytest
import torch

import elasticps
import elasticps.torch as ept
from conftest import Cluster, read_line

#: A hang fails fast: every test here takes seconds.
pytestmark = pytest.mark.deadline(30)

STEPS = 20
TOLERANCE = 1e-5

#: The job's own optimizer flags: deliberately not what the tests use, since the torch
#: optimizer's hyperparameters are sent per tensor and must win.
JOB = dict(workers=1, servers=2, sync="bsp", optimizer="adam", lr=0.5, block_bytes=1024)


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)
    )


def batches(n: int = STEPS, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 20, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(n)]


def train(model, opt, data, *, scheduler=None, clip=None, passes=1):
    loss_fn = torch.nn.CrossEntropyLoss()
    for i in range(0, len(data), passes):
        opt.zero_grad()
        for x, y in data[i : i + passes]:
            loss_fn(model(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if scheduler is not None:
            scheduler.step()


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def run_both(cluster, make_opt, *, make_sched=None, clip=None, passes=1, push_on_backward=True):
    """Trains the same model locally and through the cluster; returns (local, remote,
    initial) models."""
    data = batches(STEPS * passes)
    initial = mlp()
    local, remote = copy.deepcopy(initial), copy.deepcopy(initial)

    opt = make_opt(local.parameters())
    train(local, opt, data, scheduler=make_sched(opt) if make_sched else None, clip=clip, passes=passes)

    w = cluster.connect()
    dopt = ept.DistributedOptimizer(
        make_opt(remote.parameters()),
        remote.named_parameters(),
        worker=w,
        push_on_backward=push_on_backward,
        backward_passes_per_step=passes,
    )
    assert isinstance(dopt, type(opt))
    assert dopt.defaults == opt.defaults
    assert w.tensor_names() == [n for n, _ in remote.named_parameters()]
    train(remote, dopt, data, scheduler=make_sched(dopt) if make_sched else None, clip=clip, passes=passes)
    assert dopt.clock == STEPS
    w.finish()
    return local, remote, initial


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adam_wd": lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamw_betas": lambda ps: torch.optim.AdamW(ps, lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05),
    "adam_decoupled": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
}


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
@pytest.mark.cluster(**JOB)
def test_matches_local_torch(cluster, kind):
    local, remote, initial = run_both(cluster, OPTIMIZERS[kind])
    assert max_diff(local, initial) > 1e-3, "training did not move the parameters"
    assert max_diff(local, remote) < TOLERANCE


@pytest.mark.cluster(**JOB)
def test_param_groups_have_their_own_hyperparameters(cluster):
    def make(ps):
        ps = list(ps)
        return torch.optim.SGD([{"params": ps[:2], "lr": 0.3}, {"params": ps[2:]}], lr=0.05, momentum=0.5)

    local, remote, _ = run_both(cluster, make)
    assert max_diff(local, remote) < TOLERANCE


@pytest.mark.cluster(**JOB)
def test_adamw_decay_is_decoupled_and_per_group(cluster):
    # A group without decay (as transformers leave biases and norms undecayed; groups in
    # the model's order, which names the tensors). The decoupled decay is not Adam's L2.
    def make(ps):
        ps = list(ps)
        return torch.optim.AdamW([{"params": ps[:4]}, {"params": ps[4:], "weight_decay": 0.0}], lr=1e-2, weight_decay=0.2)

    local, remote, _ = run_both(cluster, make)
    assert max_diff(local, remote) < TOLERANCE
    coupled = copy.deepcopy(mlp())
    train(coupled, torch.optim.Adam(coupled.parameters(), lr=1e-2, weight_decay=0.2), batches())
    assert max_diff(coupled, local) > 1e-3


class Branches(torch.nn.Module):
    """A trunk and two heads: odd steps use one head, even steps the other, so each head
    gets no gradient (``p.grad is None``) every other step; a third head is never used."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = torch.nn.Linear(20, 16)
        self.odd = torch.nn.Linear(16, 4)
        self.even = torch.nn.Linear(16, 4)
        self.never = torch.nn.Linear(16, 4)

    def forward(self, x, step):
        h = torch.tanh(self.trunk(x))
        return (self.odd if step % 2 else self.even)(h)


def train_branches(model, opt, data, *, set_to_none=True):
    loss_fn = torch.nn.CrossEntropyLoss()
    for step, (x, y) in enumerate(data):
        opt.zero_grad(set_to_none=set_to_none)
        loss_fn(model(x, step), y).backward()
        opt.step()


UNUSED = {
    "momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-2),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
}


def check_unused_parameters(cluster, make):
    data = batches()
    initial = Branches()
    local, remote, zeros = copy.deepcopy(initial), copy.deepcopy(initial), copy.deepcopy(initial)
    train_branches(local, make(local.parameters()), data)

    w = cluster.connect()
    dopt = ept.DistributedOptimizer(make(remote.parameters()), remote.named_parameters(), worker=w)
    train_branches(remote, dopt, data)
    assert dopt.clock == STEPS
    w.finish()
    assert max_diff(local, initial) > 1e-3, "training did not move the parameters"
    assert max_diff(local, remote) < TOLERANCE
    # The skipped steps mattered: torch stepping on zero gradients ends elsewhere (what
    # pushing zeros for a missing gradient would give), and the head never used is where
    # it started.
    train_branches(zeros, make(zeros.parameters()), data, set_to_none=False)
    assert max_diff(zeros, local) > 1e-3
    for p, q in zip(remote.never.parameters(), initial.never.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("kind", list(UNUSED))
@pytest.mark.cluster(**JOB)
def test_a_parameter_without_a_gradient_is_not_stepped(cluster, kind):
    check_unused_parameters(cluster, UNUSED[kind])


@pytest.mark.cluster(**dict(JOB, aggregate=True))
def test_a_parameter_without_a_gradient_is_not_stepped_in_aggregate_mode(cluster):
    check_unused_parameters(cluster, UNUSED["adam"])


@pytest.mark.cluster(**JOB)
def test_an_lr_scheduler_reaches_the_servers(cluster):
    make = OPTIMIZERS["momentum"]
    sched = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.3)  # noqa: E731
    local, remote, _ = run_both(cluster, make, make_sched=sched)
    assert max_diff(local, remote) < TOLERANCE
    # The schedule mattered: without it the parameters end elsewhere.
    unscheduled = copy.deepcopy(mlp())
    train(unscheduled, make(unscheduled.parameters()), batches())
    assert max_diff(unscheduled, local) > 1e-3


@pytest.mark.cluster(**JOB)
def test_clipping_between_backward_and_step(cluster):
    make = OPTIMIZERS["sgd"]
    local, remote, _ = run_both(cluster, make, clip=0.05, push_on_backward=False)
    assert max_diff(local, remote) < TOLERANCE
    # The clipping mattered.
    unclipped = copy.deepcopy(mlp())
    train(unclipped, make(unclipped.parameters()), batches())
    assert max_diff(unclipped, local) > 1e-3


@pytest.mark.cluster(**JOB)
def test_gradients_accumulate_over_backward_passes(cluster):
    local, remote, _ = run_both(cluster, OPTIMIZERS["adam"], passes=2)
    assert max_diff(local, remote) < TOLERANCE


@pytest.mark.parametrize(
    "make, what",
    [
        (lambda ps: torch.optim.RMSprop(ps, lr=0.01), "RMSprop"),
        (lambda ps: torch.optim.AdamW(ps, lr=0.01, amsgrad=True), r"AdamW\(amsgrad=True\)"),
        (lambda ps: torch.optim.AdamW(ps, lr=0.01, maximize=True), "maximize"),
        (lambda ps: torch.optim.Adagrad(ps, lr=0.01), "Adagrad"),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True), "nesterov"),
        (lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True), "amsgrad"),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, maximize=True), "maximize"),
    ],
)
@pytest.mark.cluster(**JOB)
def test_unsupported_optimizers_raise_type_error(cluster, make, what):
    w = cluster.connect()
    model = mlp()
    with pytest.raises(TypeError, match=what):
        ept.DistributedOptimizer(make(model.parameters()), model.named_parameters(), worker=w)
    # Nothing was registered: a supported optimizer still works.
    opt = ept.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), worker=w)
    train(model, opt, batches(2))
    assert opt.clock == 2
    w.finish()


@pytest.mark.cluster(**JOB)
def test_a_float64_parameter_raises_type_error(cluster):
    w = cluster.connect()
    model = mlp()
    model[2].double()
    with pytest.raises(TypeError, match=r"'2\.weight' is torch\.float64"):
        ept.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), worker=w)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        ept.DistributedOptimizer(model.parameters(), worker=w)
    assert w.tensor_names() == []


@pytest.mark.cluster(**JOB)
def test_gradients_are_pushed_during_backward(cluster):
    w = cluster.connect()
    model = mlp()
    opt = ept.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), worker=w)
    data = batches(2)
    loss_fn = torch.nn.CrossEntropyLoss()
    # The first step holds its pushes until step() (it finds out whether the loop changes
    # gradients after backward); this one does not, so the next pushes during backward.
    opt.zero_grad()
    loss_fn(model(data[0][0]), data[0][1]).backward()
    assert opt._handles == {}
    opt.step()
    opt.zero_grad()
    loss_fn(model(data[1][0]), data[1][1]).backward()
    # Every parameter's push started from its hook, before step().
    assert sorted(opt._handles) == sorted(n for n, _ in model.named_parameters())
    before = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.detach().clone() for p in model.parameters()]
    opt.step()
    for p, b, g in zip(model.parameters(), before, grads):
        np.testing.assert_allclose(p.detach().numpy(), (b - 0.1 * g).numpy(), atol=1e-7)
    w.finish()


# -- issue 34: clipping, buffers, optimizer state ----------------------------------------


def train_clipped_to_zero(model, opt, data, *, horovod=False):
    """Steps on `data` with every gradient clipped to zero between backward and step
    (DDP's loop, or Horovod's synchronize/skip_synchronize)."""
    loss_fn = torch.nn.CrossEntropyLoss()
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        if horovod:
            opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.0)
        if horovod:
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()


@pytest.mark.parametrize("horovod", [False, True], ids=["ddp_loop", "synchronize"])
@pytest.mark.cluster(**dict(JOB, aggregate=True))
def test_clipping_to_zero_leaves_the_weights_unchanged(cluster, horovod):
    w = cluster.connect()
    initial = mlp()
    model = copy.deepcopy(initial)
    # Default push_on_backward=True; several steps, so that a loop whose clipping was not
    # noticed would push during backward after the first.
    opt = ept.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model.named_parameters(), worker=w)
    train_clipped_to_zero(model, opt, batches(5), horovod=horovod)
    assert opt.clock == 5
    assert max_diff(model, initial) == 0.0
    # The same loop unclipped moves the weights: the clipping is what kept them.
    train(model, opt, batches(1))
    assert max_diff(model, initial) > 1e-3
    w.finish()


@pytest.mark.cluster(**JOB)
def test_a_gradient_changed_after_its_push_left_raises(cluster):
    w = cluster.connect()
    model = mlp()
    opt = ept.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), worker=w)
    data = batches(2)
    train(model, opt, data[:1])  # no clipping: the next step pushes during backward
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    torch.nn.CrossEntropyLoss()(model(data[1][0]), data[1][1]).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.0)
    with pytest.raises(elasticps.ElasticpsError, match="push_on_backward=False"):
        opt.step()
    # Nothing was pulled into the model.
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    w.finish()


#: A worker process with a BatchNorm model: each rank trains on its own data (so its
#: running statistics differ), then prints its rank, its buffers after `steps` steps, and
#: rank 0 also the buffers its own forward passes computed before the last step's pull.
BN_WORKER = r"""
import json, sys
import torch
import elasticps, elasticps.torch
steps, broadcast = int(sys.argv[1]), sys.argv[2] == "1"
torch.set_num_threads(1)
w = elasticps.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
opt = elasticps.torch.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), broadcast_buffers=broadcast)
loss_fn = torch.nn.CrossEntropyLoss()
for step in range(steps):
    g = torch.Generator().manual_seed(1000 * w.rank + step)
    x, y = 3 * w.rank + torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    own = {n: b.tolist() for n, b in model.named_buffers()}
    opt.step()
bufs = {n: b.tolist() for n, b in model.named_buffers()}
print(json.dumps({"rank": w.rank, "buffers": bufs, "own": own}), flush=True)
elasticps.finish()
"""


def bn_buffers(cluster, steps: int, broadcast: bool) -> dict:
    """Rank -> what BN_WORKER printed, from two worker processes."""
    procs = [cluster.spawn_worker(BN_WORKER, str(steps), "1" if broadcast else "0") for _ in range(2)]
    out = {}
    for p in procs:
        got = json.loads(read_line(p, 50, "a BatchNorm worker's buffers"))
        out[got["rank"]] = got
    for p in procs:
        assert cluster.wait_exit(p, 20, "a BatchNorm worker") == 0
    return out


@pytest.mark.deadline(60)
@pytest.mark.cluster(workers=2, servers=2, sync="bsp", aggregate=True, block_bytes=256)
def test_batchnorm_running_stats_are_rank_0s_on_every_rank(cluster):
    got = bn_buffers(cluster, 3, True)
    zero, one = got[0], got[1]
    assert set(zero["buffers"]) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    # Equal on every rank, and what rank 0's forward passes computed.
    assert zero["buffers"] == one["buffers"]
    np.testing.assert_array_equal(np.array(zero["buffers"]["1.running_mean"]), np.array(zero["own"]["1.running_mean"]))
    assert zero["buffers"]["1.num_batches_tracked"] == 3
    # The ranks' own statistics differ (their data does): the broadcast is what made them equal.
    assert zero["own"]["1.running_mean"] != one["own"]["1.running_mean"]


@pytest.mark.deadline(60)
@pytest.mark.cluster(workers=2, servers=2, sync="bsp", aggregate=True, block_bytes=256)
def test_broadcast_buffers_false_keeps_each_ranks_own(cluster):
    got = bn_buffers(cluster, 2, False)
    assert got[0]["buffers"]["1.running_mean"] != got[1]["buffers"]["1.running_mean"]
    assert got[1]["buffers"] == got[1]["own"]


def adam(ps):
    return torch.optim.Adam(ps, lr=1e-2, betas=(0.8, 0.99))


def train_steps(cluster_or_worker, model, data, *, state=None):
    """Trains `model` with Adam through a worker of `cluster_or_worker` on `data`; loads
    `state` (an `opt.state_dict()`) first if given. Returns the optimizer."""
    opt = ept.DistributedOptimizer(adam(model.parameters()), model.named_parameters(), worker=cluster_or_worker)
    if state is not None:
        opt.load_state_dict(state)
    train(model, opt, data)
    return opt


@pytest.mark.deadline(60)
@pytest.mark.cluster(**dict(JOB, aggregate=True))
def test_state_dict_round_trips_adams_moments_into_a_new_job(cluster, tmp_path):
    data = batches(10)
    model = mlp()
    w = cluster.connect()
    opt = train_steps(w, model, data[:5])
    # A torch-style checkpoint, through torch.save.
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    ck = torch.load(io.BytesIO(buf.getvalue()))
    state = ck["opt"]["state"]
    assert sorted(state) == list(range(len(list(model.parameters()))))
    assert set(state[0]) == {"step", "exp_avg", "exp_avg_sq"} and int(state[0]["step"]) == 5
    # The state is torch's: plain local Adam on the same batches holds the same moments.
    local = mlp()
    local_opt = adam(local.parameters())
    train(local, local_opt, data[:5])
    for i, p in enumerate(local.parameters()):
        np.testing.assert_allclose(state[i]["exp_avg"].numpy(), local_opt.state[p]["exp_avg"].numpy(), atol=1e-7)
    # No interruption: five more steps in this job.
    train(model, opt, data[5:])
    w.finish()

    # A new job, resumed from the checkpoint: the same five steps end at the same weights.
    resumed, fresh = mlp(seed=5), mlp(seed=5)
    resumed.load_state_dict(ck["model"])
    fresh.load_state_dict(ck["model"])
    for state, target in ((ck["opt"], resumed), (None, fresh)):
        job = Cluster(tmp_path / ("resumed" if state else "fresh"), dict(JOB, aggregate=True))
        (tmp_path / ("resumed" if state else "fresh")).mkdir()
        try:
            job.start()
            w2 = job.connect()
            train_steps(w2, target, data[5:], state=state)
            w2.finish()
        finally:
            job.stop()
    assert max_diff(resumed, model) <= 1e-7
    # Without the moments (a fresh Adam) the same steps end elsewhere.
    assert max_diff(fresh, model) > 1e-4


@pytest.mark.cluster(**dict(JOB, aggregate=True))
def test_a_momentum_state_dict_resumes_in_plain_torch(cluster):
    # torch's own format: plain torch.optim.SGD loads it and goes on as the servers do.
    make = OPTIMIZERS["momentum"]
    data = batches(10)
    model = mlp()
    w = cluster.connect()
    opt = ept.DistributedOptimizer(make(model.parameters()), model.named_parameters(), worker=w)
    train(model, opt, data[:5])
    sd = opt.state_dict()
    assert len(sd["state"]) == 6 and all(set(s) == {"momentum_buffer"} for s in sd["state"].values())
    at5 = copy.deepcopy(model)
    train(model, opt, data[5:])
    w.finish()
    local = copy.deepcopy(at5)
    local_opt = make(local.parameters())
    local_opt.load_state_dict(sd)
    train(local, local_opt, data[5:])
    assert max_diff(local, model) < TOLERANCE
    # Without the momentum buffers plain torch ends elsewhere.
    fresh = copy.deepcopy(at5)
    train(fresh, make(fresh.parameters()), data[5:])
    assert max_diff(fresh, model) > 1e-3
