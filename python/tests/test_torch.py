"""elasticps.torch.DistributedOptimizer against real clusters: with one worker under bsp,
training through the servers ends with the parameters plain local torch reaches on the
same batches (SGD, SGD with momentum and weight decay, Adam, AdamW, an lr scheduler,
clipping between backward and step, accumulation over backward passes, a parameter that
gets no gradient on some steps); what the servers cannot run is a TypeError."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import elasticps.torch as ept

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
    x, y = batches(1)[0]
    opt.zero_grad()
    torch.nn.CrossEntropyLoss()(model(x), y).backward()
    # Every parameter's push started from its hook, before step().
    assert sorted(opt._handles) == sorted(n for n, _ in model.named_parameters())
    before = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.detach().clone() for p in model.parameters()]
    opt.step()
    for p, b, g in zip(model.parameters(), before, grads):
        np.testing.assert_allclose(p.detach().numpy(), (b - 0.1 * g).numpy(), atol=1e-7)
    w.finish()
