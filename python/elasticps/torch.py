"""PyTorch integration: ``DistributedOptimizer`` (the shape of BytePS's and Horovod's).

The servers run the optimizer (MXNet's ``update_on_kvstore``): the torch optimizer only
supplies its hyperparameters, per parameter group. During ``loss.backward()`` each
gradient is pushed as soon as it is ready (``register_post_accumulate_grad_hook``), so
communication overlaps the rest of the backward pass; ``step()`` waits for the pushes and
pulls the new parameters into ``p.data`` in place::

    import elasticps, elasticps.torch
    elasticps.init()
    opt = elasticps.torch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model.named_parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)   # reaches the servers
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()                              # pushes start here
        opt.step()                                                   # new parameters
        sched.step()
    elasticps.finish()

Resuming from a checkpoint (``elasticps launch ... --resume DIR``, the job's servers
holding the checkpoint's blocks) needs no change to such a loop: registering the model
fills the parameters with the checkpoint's (instead of broadcasting rank 0's), and the
optimizer's clock starts at ``worker.start_clock`` (the checkpoint's clock; 0 in a fresh
job). A loop that must not see again the batches it trained on before the checkpoint
skips them by that clock, as PyTorch users resume from ``checkpoint["step"]``::

    w = elasticps.init()
    opt = elasticps.torch.DistributedOptimizer(torch.optim.SGD(...), model.named_parameters())
    for step in range(w.start_clock, steps):                          # opt.clock == step
        x, y = batch(step)
        ...

To change gradients before they are pushed (clipping), pass ``push_on_backward=False``:
the pushes then start in ``step()``, after your code ran::

    loss.backward(); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step()

A parameter that gets no gradient in a step (unused in the forward pass: ``p.grad is
None`` after backward) is pushed as "no gradient": the servers count the push for the
clock and apply nothing, so its momentum or Adam state does not move, as torch skips it.
(``zero_grad(set_to_none=False)`` leaves zeros instead, which are pushed and stepped on,
as torch steps on them.)

Embedding tables live on the servers (``elasticps.torch.Embedding`` and ``EmbeddingBag``,
drop-in for torch's with ``sparse=True``; ``elasticps.embedding`` explains them): a forward
pass pulls only the rows its batch uses, and ``step()`` pushes their gradients beside the
dense ones::

    model.emb = elasticps.torch.Embedding(10**6, 64)
    opt = elasticps.torch.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-3), model.named_parameters(),
        tables=elasticps.torch.named_tables(model),
        table_optimizer=elasticps.torch.table_optimizer("adagrad", lr=0.05))

Supported: ``torch.optim.SGD`` (with or without momentum; ``dampening=0``,
``nesterov=False``), ``torch.optim.Adam`` and ``torch.optim.AdamW`` (decoupled weight
decay; also ``Adam(decoupled_weight_decay=True)``), with ``amsgrad=False``, and
``weight_decay``, ``maximize=False``. Anything else raises ``TypeError``. Parameters must
be float32; CUDA parameters go through pinned host buffers.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import torch

import elasticps
from elasticps.embedding import Embedding, EmbeddingBag, TableSync, named_tables, table_optimizer

__all__ = ["DistributedOptimizer", "Embedding", "EmbeddingBag", "named_tables", "server_optimizer", "table_optimizer"]


def server_optimizer(optimizer: torch.optim.Optimizer, group: dict) -> dict:
    """The server-side optimizer (a dict for ``Worker.register_model``) of one parameter
    group of ``optimizer``; ``TypeError`` for what the servers cannot run."""
    name = type(optimizer).__name__
    lr = float(group["lr"])
    wd = float(group.get("weight_decay", 0.0))
    if group.get("maximize", False):
        raise TypeError(f"elasticps.torch: {name}(maximize=True) is not supported")
    if isinstance(optimizer, torch.optim.SGD):
        momentum = float(group.get("momentum", 0.0))
        if momentum == 0.0:
            return {"kind": "sgd", "lr": lr, "weight_decay": wd}
        if float(group.get("dampening", 0.0)) != 0.0 or group.get("nesterov", False):
            raise TypeError("elasticps.torch: SGD with dampening or nesterov is not supported (servers: heavy-ball momentum)")
        return {"kind": "momentum", "lr": lr, "momentum": momentum, "weight_decay": wd}
    if isinstance(optimizer, torch.optim.Adam):
        # torch.optim.AdamW is Adam with decoupled_weight_decay=True in its groups (torch
        # >= 2.6); an older AdamW is not a subclass of Adam and is taken below.
        decoupled = bool(group.get("decoupled_weight_decay", False))
        return _adam(name, group, lr, wd, decoupled)
    adamw = getattr(torch.optim, "AdamW", None)
    if adamw is not None and isinstance(optimizer, adamw):
        return _adam(name, group, lr, wd, True)
    raise TypeError(
        f"elasticps.torch: {name} is not supported: the servers run SGD, SGD with momentum, Adam and AdamW "
        "(torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)"
    )


def _adam(name: str, group: dict, lr: float, wd: float, decoupled: bool) -> dict:
    """The server-side optimizer of an Adam or AdamW parameter group."""
    if group.get("amsgrad", False):
        raise TypeError(f"elasticps.torch: {name}(amsgrad=True) is not supported")
    b1, b2 = group["betas"]
    return {
        "kind": "adamw" if decoupled else "adam",
        "lr": lr,
        "betas": (float(b1), float(b2)),
        "eps": float(group["eps"]),
        "weight_decay": wd,
    }


class _DistributedOptimizer(torch.optim.Optimizer):
    """The methods mixed into a subclass of the user's optimizer class."""

    def __init__(
        self, params, defaults, named_parameters, worker, push_on_backward, backward_passes_per_step, tables=None
    ):
        super(self.__class__, self).__init__(params)
        # Embedding tables on the servers (elasticps.embedding), checked before anything
        # is registered.
        self._tables: TableSync = tables if tables is not None else TableSync(None, None)
        # The wrapped optimizer's defaults (its constructor's arguments), not the class's.
        self.defaults = dict(defaults)
        self._worker = worker if worker is not None else elasticps.worker()
        self._push_on_backward = push_on_backward
        self._passes = int(backward_passes_per_step)
        if self._passes < 1:
            raise ValueError("elasticps.torch: backward_passes_per_step must be at least 1")
        in_groups = [p for g in self.param_groups for p in g["params"]]
        if named_parameters is None:
            named = [(f"param.{i}", p) for i, p in enumerate(in_groups)]
        else:
            named = list(named_parameters)
        self._names: Dict[int, str] = {}
        for name, p in named:
            if not any(p is q for q in in_groups):
                raise ValueError(f"elasticps.torch: parameter {name!r} is not one of the optimizer's")
            if id(p) in self._names:
                raise ValueError(f"elasticps.torch: parameter {name!r} is named twice")
            if p.dtype != torch.float32:
                raise TypeError(f"elasticps.torch: parameter {name!r} is {p.dtype}; the servers hold float32")
            self._names[id(p)] = name
        missing = [i for i, p in enumerate(in_groups) if id(p) not in self._names]
        if missing:
            raise ValueError(f"elasticps.torch: {len(missing)} of the optimizer's parameters have no name in named_parameters")
        self._params: List[Tuple[str, torch.Tensor]] = [(self._names[id(p)], p) for p in in_groups]
        self._cuda = any(p.is_cuda for _, p in self._params)
        # Host buffers for CUDA parameters (pinned, so copies can be asynchronous).
        self._host_param: Dict[str, torch.Tensor] = {}
        self._host_grad: Dict[str, torch.Tensor] = {}
        for name, p in self._params:
            if p.is_cuda:
                self._host_param[name] = torch.empty(p.shape, dtype=torch.float32, pin_memory=True)
                self._host_grad[name] = torch.empty(p.shape, dtype=torch.float32, pin_memory=True)
        self._sent: Dict[str, dict] = {}
        specs = {}
        for g in self.param_groups:
            spec = server_optimizer(self, g)
            for p in g["params"]:
                specs[self._names[id(p)]] = spec
        values = {name: self._param_buffer(name, p, fill=True) for name, p in self._params}
        if self._tables.tables:
            clash = sorted(set(values) & set(self._tables.names()))
            if clash:
                raise ValueError(f"elasticps.torch: {clash} name both a parameter and a table")
            specs.update(self._tables.optimizers())
            self._worker.register_model(values, optimizers=specs, tables=self._tables.shapes())
            self._tables.bind(self._worker, lambda: self._clock)
        else:
            self._worker.register_model(values, optimizers=specs)
        self._sent = {name: spec for name, spec in specs.items() if name in values}
        for name, p in self._params:
            self._param_from_buffer(name, p)
        # A resumed job goes on from its checkpoint's clock (register_model pulled it).
        self._clock = int(self._worker.start_clock)
        self._handles: Dict[str, "elasticps.Handle"] = {}
        self._keep: Dict[str, object] = {}
        self._counts: Dict[str, int] = {}
        # Whether this step's hyperparameters were sent (before its first push; a hook
        # counts a backward pass before it pushes, so the counts cannot tell).
        self._step_started = False
        self._hooks = []
        for name, p in self._params:
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(name)))

    # -- buffers ---------------------------------------------------------------------

    def _param_buffer(self, name: str, p: torch.Tensor, fill: bool = False):
        """A float32 numpy view of a parameter's values (CPU), or of its host buffer."""
        if p.is_cuda:
            host = self._host_param[name]
            if fill:
                host.copy_(p.detach())
            return host.numpy()
        return p.detach().numpy()

    def _param_from_buffer(self, name: str, p: torch.Tensor) -> None:
        if p.is_cuda:
            p.data.copy_(self._host_param[name], non_blocking=True)

    def _grad_array(self, name: str, p: torch.Tensor):
        """The gradient to push (a float32 numpy array) and what keeps it alive; ``None``
        and ``None`` for a parameter without a gradient this step."""
        g = p.grad
        if g is None:
            return None, None
        if g.is_cuda:
            host = self._host_grad[name]
            host.copy_(g.detach(), non_blocking=True)
            torch.cuda.current_stream(g.device).synchronize()
            return host.numpy(), host
        g = g.detach()
        if not g.is_contiguous():
            g = g.contiguous()
        return g.numpy(), g

    # -- pushes ------------------------------------------------------------------------

    def _sync_hyperparams(self) -> None:
        """Sends every changed group's hyperparameters (an lr scheduler's step) before the
        next push uses them."""
        for g in self.param_groups:
            spec = server_optimizer(self, g)
            for p in g["params"]:
                name = self._names[id(p)]
                if self._sent.get(name) != spec:
                    self._worker.set_optimizer(name, spec)
                    self._sent[name] = spec

    def _start_step(self) -> None:
        """Before the first push of a step: send changed hyperparameters."""
        if not self._step_started:
            self._sync_hyperparams()
            self._step_started = True

    def _push(self, name: str, p: torch.Tensor) -> None:
        self._start_step()
        array, keep = self._grad_array(name, p)
        self._keep[name] = keep
        self._handles[name] = self._worker.push_async(self._clock, name, array)

    def _make_hook(self, name: str):
        def hook(p: torch.Tensor) -> None:
            if not self._push_on_backward or name in self._handles:
                return
            n = self._counts.get(name, 0) + 1
            self._counts[name] = n
            if n >= self._passes:
                self._push(name, p)

        return hook

    def synchronize(self) -> None:
        """Pushes every gradient not pushed yet and waits for all pushes of this step."""
        self._start_step()
        for name, p in self._params:
            if name not in self._handles:
                self._push(name, p)
        rows = self._tables.push(self._clock)
        try:
            for h in self._handles.values():
                h.wait()
            for h in rows:
                h.wait()
        finally:
            self._handles.clear()
            self._keep.clear()
            self._counts.clear()
            self._step_started = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients, and forgets the rows the tables pulled since the last step."""
        self._tables.forget()
        super(self.__class__, self).zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        """Waits for this step's pushes (pushing what backward did not), then pulls the
        parameters of the next clock into ``p.data``. Returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.synchronize()
        self._clock += 1
        out = {name: self._param_buffer(name, p) for name, p in self._params}
        self._worker.pull(self._clock, out)
        if self._cuda:
            for name, p in self._params:
                self._param_from_buffer(name, p)
            torch.cuda.synchronize()
        return loss

    @property
    def clock(self) -> int:
        """The clock of the parameters the model holds (steps taken, counting those before
        the checkpoint a resumed job started from)."""
        return self._clock


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
    *,
    worker: Optional["elasticps.Worker"] = None,
    push_on_backward: bool = True,
    backward_passes_per_step: int = 1,
    tables: Optional[Iterable[Tuple[str, torch.nn.Module]]] = None,
    table_optimizer: Optional[dict] = None,
) -> torch.optim.Optimizer:
    """Wraps ``optimizer`` so that the servers run it (see the module's doc).

    ``named_parameters``: ``model.named_parameters()`` (names are the tensors' names on the
    servers; default ``param.0``, ``param.1``, ...). Registers the model: rank 0's values
    become every worker's (in a resumed job, the checkpoint's; ``clock`` then starts at
    ``worker.start_clock``). ``worker``: default ``elasticps.init()``'s. ``push_on_backward``:
    push each gradient during backward (default), or only in ``step()`` (to clip or
    otherwise change gradients first). ``backward_passes_per_step``: gradients accumulate
    over this many backward passes before they are pushed. ``tables``:
    ``elasticps.torch.named_tables(model)``, the model's ``Embedding`` and ``EmbeddingBag``
    tables (they live on the servers; each step pushes the rows its forward passes pulled,
    see ``elasticps.embedding``); ``table_optimizer``: the optimizer of the tables that
    name none (``elasticps.torch.table_optimizer(...)``; default: the job's).

    The result is an instance of a subclass of ``optimizer``'s class, so that learning-rate
    schedulers accept it; its ``param_groups`` are the ones a scheduler changes.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"elasticps.torch: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    for g in optimizer.param_groups:
        server_optimizer(optimizer, g)
    table_sync = TableSync(tables, table_optimizer)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(
        optimizer.param_groups,
        optimizer.defaults,
        named_parameters,
        worker,
        push_on_backward,
        backward_passes_per_step,
        table_sync,
    )
