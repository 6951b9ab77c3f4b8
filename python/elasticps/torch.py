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

Gradients changed between ``backward()`` and ``step()`` (clipping, unscaling) are what
the servers apply, as under DDP::

    loss.backward(); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step()

How: the first step holds its pushes until ``step()``, and ``step()`` compares each
gradient with what backward left (the tensor, and torch's ``_version`` of it, which every
in-place change bumps). A loop that changed one is a loop that changes gradients: its
pushes start in ``step()`` from then on, from the gradients as they are then. A loop that
changed none pushes from the hooks during backward from its second step on, so
communication overlaps backward. A push that left cannot be taken back (without
aggregation each push is an optimizer step as it arrives; with it, the clock's step is
taken when the last worker's push arrives, usually during backward), so a gradient found
changed after its push was sent raises ``ElasticpsError`` before the step pulls anything:
a loop that changes gradients on some steps only (clipping after a warm-up) passes
``push_on_backward=False``, or calls ``opt.synchronize()`` before it changes them.
Horovod's pattern works as written::

    loss.backward()
    opt.synchronize()                                    # p.grad is final: change it now
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with opt.skip_synchronize():
        opt.step()                                       # pushes the clipped gradients

(Each worker clips its own gradient, whose mean the servers apply; DDP and Horovod clip
the mean of the workers' gradients. The two agree when clipping does not bind, or binds
to zero.)

Buffers (``broadcast_buffers=True``, the default, as DDP's): the model's buffers
(BatchNorm's ``running_mean``, ``running_var``, ``num_batches_tracked``) are one more
tensor on the servers. At every ``step()`` rank 0 writes its buffers there (``SetValues``)
before it pushes, and every worker's pull of the next clock brings them back, so every
rank's buffers are rank 0's after each step (DDP copies them at the next forward pass:
the same values). The module is ``named_parameters``'s own (``model.named_parameters()``,
or the module itself), or ``model=``. Buffers travel as float32 (integers exactly up to
2^24).

Optimizer state: ``opt.state_dict()`` carries the servers' state in torch's own format
(Adam's ``step``, ``exp_avg``, ``exp_avg_sq``; SGD's ``momentum_buffer``) beside the
parameter groups, and ``opt.load_state_dict()`` writes it back to the servers, so a
torch-style checkpoint resumes exactly, in this job or a new one::

    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    ...                                                   # a new job
    model.load_state_dict(ck["model"])                    # before the optimizer: registered
    opt = elasticps.torch.DistributedOptimizer(torch.optim.Adam(...), model.named_parameters())
    opt.load_state_dict(ck["opt"])

Call them between steps (after ``step()``): under bsp with aggregation (``elasticps
launch``'s default) every push before is then applied on every server.

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

Tables keyed by hashed 64-bit feature ids, growing while they train, are
``elasticps.torch.HashEmbedding(dim, max_rows=..., eviction="lru", ttl_steps=...,
admit_after=...)`` and ``HashEmbeddingBag`` (ids any int64; bounded per server).

Supported: ``torch.optim.SGD`` (with or without momentum; ``dampening=0``,
``nesterov=False``), ``torch.optim.Adam`` and ``torch.optim.AdamW`` (decoupled weight
decay; also ``Adam(decoupled_weight_decay=True)``), with ``amsgrad=False``, and
``weight_decay``, ``maximize=False``. Anything else raises ``TypeError``. Parameters must
be float32; CUDA parameters go through pinned host buffers.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np
import torch

import elasticps
from elasticps.embedding import (
    Embedding,
    EmbeddingBag,
    HashEmbedding,
    HashEmbeddingBag,
    TableSync,
    named_tables,
    table_optimizer,
)

__all__ = [
    "Compression",
    "DistributedOptimizer",
    "Embedding",
    "EmbeddingBag",
    "HashEmbedding",
    "HashEmbeddingBag",
    "named_tables",
    "server_optimizer",
    "table_optimizer",
]


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


#: The servers' name of the tensor that carries a model's buffers.
BUFFERS = "elasticps.buffers"


def _module_of(named_parameters, model: Optional[torch.nn.Module]) -> Optional[torch.nn.Module]:
    """The module whose buffers are broadcast: ``model``, ``named_parameters`` itself if it
    is a module, or the module whose ``named_parameters()`` generator it is."""
    if model is not None:
        return model
    if isinstance(named_parameters, torch.nn.Module):
        return named_parameters
    frame = getattr(named_parameters, "gi_frame", None)
    owner = frame.f_locals.get("self") if frame is not None else None
    return owner if isinstance(owner, torch.nn.Module) else None


class _Buffers:
    """A module's buffers as one flat float32 tensor on the servers (``BUFFERS``): rank 0
    writes it before each step's pushes, every rank pulls it with the step's parameters."""

    def __init__(self, module: torch.nn.Module):
        # Floating and integer buffers (BatchNorm's num_batches_tracked is int64).
        self.buffers = [b for _, b in module.named_buffers() if not (b.dtype.is_complex or b.dtype == torch.bool)]
        self.host = np.zeros(sum(b.numel() for b in self.buffers), dtype=np.float32)

    def __bool__(self) -> bool:
        return bool(self.buffers)

    def gather(self) -> np.ndarray:
        """The buffers' current values, flat, in ``host``."""
        flat = torch.from_numpy(self.host)
        offset = 0
        for b in self.buffers:
            n = b.numel()
            flat[offset : offset + n].copy_(b.detach().reshape(-1))
            offset += n
        return self.host

    def scatter(self) -> None:
        """Copies ``host`` (what was pulled) into the buffers."""
        flat = torch.from_numpy(self.host)
        offset = 0
        with torch.no_grad():
            for b in self.buffers:
                n = b.numel()
                b.copy_(flat[offset : offset + n].view(b.shape))
                offset += n


#: torch's optimizer state keys for the servers' ``m`` and ``v``, per optimizer kind.
_STATE_KEYS = {"sgd": (None, None), "momentum": ("momentum_buffer", None), "adam": ("exp_avg", "exp_avg_sq")}
_STATE_KEYS["adamw"] = _STATE_KEYS["adam"]


def _flat(t: Optional[torch.Tensor]) -> Optional[np.ndarray]:
    """A state tensor as the servers take it (float32, flat, on the CPU), or None."""
    return None if t is None else t.detach().to("cpu", torch.float32).reshape(-1).contiguous().numpy()


class Compression:
    """How a ``DistributedOptimizer``'s gradients and pulled parameters travel (Horovod's
    ``hvd.Compression``, BytePS's ``compression=``):

    - ``Compression.none`` (float32), ``Compression.bf16``, ``Compression.fp16``: half the
      bytes each way; the servers keep float32 parameters and optimizer state, and the
      initial values travel exact;
    - ``Compression.topk(0.01)``, ``Compression.randomk(0.01)``: each gradient's largest
      (or random) 1% of entries, with error feedback: what is not sent is kept and added
      to the next step's gradient (``wire=`` also picks their dtype).

    The job's default is ``elasticps launch --wire-dtype`` and ``--compress``."""

    none: "Compression"
    bf16: "Compression"
    fp16: "Compression"

    def __init__(self, wire: str = "f32", sparsify: Optional[str] = None):
        if wire not in ("f32", "bf16", "fp16"):
            raise ValueError(f"elasticps.torch: unknown compression wire dtype {wire!r}: use f32, bf16 or fp16")
        self.wire = wire
        self.sparsify = sparsify

    @staticmethod
    def topk(ratio: float, wire: str = "f32") -> "Compression":
        """Each gradient's ``ratio`` largest-magnitude entries, with error feedback."""
        return Compression(wire, f"topk:{float(ratio)!r}")

    @staticmethod
    def randomk(ratio: float, wire: str = "f32") -> "Compression":
        """``ratio`` of each gradient's entries drawn at random, with error feedback."""
        return Compression(wire, f"randomk:{float(ratio)!r}")

    def __repr__(self) -> str:
        return f"Compression({self.wire!r}, {self.sparsify!r})"


Compression.none = Compression("f32")
Compression.bf16 = Compression("bf16")
Compression.fp16 = Compression("fp16")


class _DistributedOptimizer(torch.optim.Optimizer):
    """The methods mixed into a subclass of the user's optimizer class."""

    def __init__(
        self,
        params,
        defaults,
        named_parameters,
        worker,
        push_on_backward,
        backward_passes_per_step,
        tables,
        buffers,
        compression,
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
        self._params = self._named(named_parameters)
        self._cuda = any(p.is_cuda for _, p in self._params)
        # Host buffers for CUDA parameters (pinned, so copies can be asynchronous).
        self._host_param: Dict[str, torch.Tensor] = {}
        self._host_grad: Dict[str, torch.Tensor] = {}
        for name, p in self._params:
            if p.is_cuda:
                self._host_param[name] = torch.empty(p.shape, dtype=torch.float32, pin_memory=True)
                self._host_grad[name] = torch.empty(p.shape, dtype=torch.float32, pin_memory=True)
        self._buffers: Optional[_Buffers] = buffers if buffers else None
        self._register()
        if compression is not None:
            for name, _ in self._params:
                self._worker.set_compression(name, compression.wire, compression.sparsify)
        if self._buffers is not None:
            # Buffers (BatchNorm's statistics) travel exact, whatever the job's default.
            self._worker.set_compression(BUFFERS, "f32", None)
        # A resumed job goes on from its checkpoint's clock (register_model pulled it).
        self._clock = int(self._worker.start_clock)
        self._handles: Dict[str, "elasticps.Handle"] = {}
        self._keep: Dict[str, object] = {}
        self._counts: Dict[str, int] = {}
        # What each hook saw this step: the gradient tensor and its version.
        self._seen: Dict[str, Tuple[Optional[torch.Tensor], int]] = {}
        # Hooks push during backward (a step found no gradient changed after backward);
        # never again once the loop changed one (or called synchronize()).
        self._eager = False
        self._changes_grads = False
        # Whether this step's hyperparameters were sent (before its first push; a hook
        # counts a backward pass before it pushes, so the counts cannot tell).
        self._step_started = False
        self._hooks = []
        for name, p in self._params:
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(name)))

    def _named(self, named_parameters) -> List[Tuple[str, torch.Tensor]]:
        """The optimizer's parameters with their names, in the groups' order (checked)."""
        in_groups = [p for g in self.param_groups for p in g["params"]]
        if named_parameters is None:
            named = [(f"param.{i}", p) for i, p in enumerate(in_groups)]
        elif isinstance(named_parameters, torch.nn.Module):
            named = list(named_parameters.named_parameters())
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
        return [(self._names[id(p)], p) for p in in_groups]

    def _register(self) -> None:
        """Registers the model (parameters, buffers, tables) and takes its initial values:
        rank 0's, or the checkpoint's."""
        specs = {}
        for g in self.param_groups:
            spec = server_optimizer(self, g)
            for p in g["params"]:
                specs[self._names[id(p)]] = spec
        values = {name: self._param_buffer(name, p, fill=True) for name, p in self._params}
        if self._buffers is not None:
            if BUFFERS in values:
                raise ValueError(f"elasticps.torch: a parameter is named {BUFFERS!r}, the name of the model's buffers")
            values[BUFFERS] = self._buffers.gather()
            # Never stepped: every push of it is without a gradient.
            specs[BUFFERS] = {"kind": "sgd", "lr": 0.0}
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
        if self._buffers is not None:
            self._buffers.scatter()

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
                g = p.grad
                self._seen[name] = (g, g._version if g is not None else 0)
                if self._eager:
                    self._push(name, p)

        return hook

    def _changed(self) -> List[str]:
        """The parameters whose gradient changed after their hook saw it (replaced, or
        changed in place: torch bumps the tensor's version)."""
        out = []
        for name, p in self._params:
            seen = self._seen.get(name)
            if seen is not None and (p.grad is not seen[0] or (p.grad is not None and p.grad._version != seen[1])):
                out.append(name)
        return out

    def _flush(self) -> None:
        """Pushes every gradient not pushed yet (the gradients as they are now), the
        buffers (rank 0 writes them first), the tables' rows, and waits for all pushes of
        this step. A gradient changed after its push left raises ``ElasticpsError``."""
        self._start_step()
        changed = self._changed()
        stale = [name for name in changed if name in self._handles]
        if changed:
            self._changes_grads = True
            self._eager = False
        try:
            if stale:
                raise elasticps.ElasticpsError(
                    f"elasticps.torch: the gradient of {stale[0]!r} (and {len(stale) - 1} more) changed after it was "
                    f"pushed during backward at clock {self._clock}; the servers took the gradient backward left. "
                    "Earlier steps did not change gradients after backward, so their pushes started during backward: "
                    "a loop that changes gradients on some steps only must pass push_on_backward=False to "
                    "DistributedOptimizer, or call opt.synchronize() before it changes them"
                )
            for name, p in self._params:
                if name not in self._handles:
                    self._push(name, p)
            if self._buffers is not None:
                if self._worker.rank == 0:
                    self._send_buffers()
                self._handles[BUFFERS] = self._worker.push_async(self._clock, BUFFERS, None)
            rows = self._tables.push(self._clock)
            for h in self._handles.values():
                h.wait()
            for h in rows:
                h.wait()
        finally:
            for h in self._handles.values():
                # Let go of the gradients (an interrupted step): each wait returns at once
                # if it already did, and a failure was raised above.
                with contextlib.suppress(Exception):
                    h.wait()
            hooked = bool(self._seen)
            self._handles.clear()
            self._keep.clear()
            self._counts.clear()
            self._seen.clear()
            self._step_started = False
        if hooked and not self._changes_grads:
            self._eager = True

    def _send_buffers(self) -> None:
        """Rank 0: writes the model's buffers to the servers (before its push of them)."""
        try:
            self._worker.set_values(BUFFERS, self._buffers.gather())
        except elasticps.ElasticpsError as e:
            raise elasticps.ElasticpsError(
                f"{e} (elasticps.torch broadcasts rank 0's buffers through the servers; a job with --replicas "
                "cannot: pass broadcast_buffers=False to DistributedOptimizer)"
            ) from e

    def synchronize(self) -> None:
        """Horovod's ``synchronize()``: backward's gradients are final in ``p.grad``, and
        may be changed (clipped) before ``step()``, which pushes them as they are then.
        From now on every step's pushes start in ``step()``."""
        self._changes_grads = True
        self._eager = False

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Horovod's ``with opt.skip_synchronize(): opt.step()`` after ``synchronize()``:
        here ``step()`` pushes each gradient once either way, so the block changes nothing."""
        yield

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients, and forgets the rows the tables pulled since the last step."""
        self._tables.forget()
        super(self.__class__, self).zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        """Pushes the gradients backward did not push (as they are now), waits for this
        step's pushes, then pulls the parameters of the next clock into ``p.data`` (and
        rank 0's buffers into the model's). Returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._flush()
        self._clock += 1
        out = {name: self._param_buffer(name, p) for name, p in self._params}
        if self._buffers is not None:
            out[BUFFERS] = self._buffers.host
        self._worker.pull(self._clock, out)
        if self._buffers is not None:
            self._buffers.scatter()
        if self._cuda:
            for name, p in self._params:
                self._param_from_buffer(name, p)
            torch.cuda.synchronize()
        return loss

    # -- optimizer state ------------------------------------------------------------------

    def state_dict(self):
        """torch's ``state_dict()``, with the servers' optimizer state of every parameter
        (Adam's ``step``, ``exp_avg``, ``exp_avg_sq``; SGD's ``momentum_buffer``): what
        ``load_state_dict`` here, or on the wrapped torch optimizer, resumes from. Call it
        between steps."""
        self.state = defaultdict(dict)
        try:
            for g in self.param_groups:
                m_key, v_key = _STATE_KEYS[server_optimizer(self, g)["kind"]]
                for p in g["params"]:
                    got = self._worker.optimizer_state(self._names[id(p)])
                    st = {}
                    if got["steps"] > 0 and v_key is not None:
                        st["step"] = torch.tensor(float(got["steps"]), dtype=torch.float32)
                    for key, value in ((m_key, got["m"]), (v_key, got["v"])):
                        if key is not None and value is not None:
                            st[key] = torch.from_numpy(value).view(p.shape).to(p.device)
                    if st:
                        self.state[p] = st
            return super(self.__class__, self).state_dict()
        finally:
            self.state = defaultdict(dict)

    def load_state_dict(self, state_dict) -> None:
        """torch's ``load_state_dict()``: the parameter groups' hyperparameters, and the
        optimizer state of every parameter written to the servers (a parameter without
        state in ``state_dict`` starts afresh). Call it between steps."""
        super(self.__class__, self).load_state_dict(state_dict)
        try:
            for g in self.param_groups:
                m_key, v_key = _STATE_KEYS[server_optimizer(self, g)["kind"]]
                for p in g["params"]:
                    st = self.state.get(p, {})
                    arrays = [_flat(st.get(key)) if key is not None else None for key in (m_key, v_key)]
                    steps = int(st["step"]) if "step" in st else (1 if arrays[0] is not None else 0)
                    self._worker.set_optimizer_state(self._names[id(p)], steps, arrays[0], arrays[1])
        finally:
            self.state = defaultdict(dict)
        self._sync_hyperparams()

    @property
    def clock(self) -> int:
        """The clock of the parameters the model holds (steps taken, counting those before
        the checkpoint a resumed job started from)."""
        return self._clock


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters=None,
    *,
    worker: Optional["elasticps.Worker"] = None,
    push_on_backward: bool = True,
    backward_passes_per_step: int = 1,
    tables: Optional[Iterable[Tuple[str, torch.nn.Module]]] = None,
    table_optimizer: Optional[dict] = None,
    broadcast_buffers: bool = True,
    model: Optional[torch.nn.Module] = None,
    compression: Optional[Compression] = None,
) -> torch.optim.Optimizer:
    """Wraps ``optimizer`` so that the servers run it (see the module's doc).

    ``named_parameters``: ``model.named_parameters()`` or the model (names are the tensors'
    names on the servers; default ``param.0``, ``param.1``, ...). Registers the model:
    rank 0's values become every worker's (in a resumed job, the checkpoint's; ``clock``
    then starts at ``worker.start_clock``). ``worker``: default ``elasticps.init()``'s.

    ``push_on_backward``: push each gradient during backward, from the second step on, for
    as long as no step finds a gradient changed after backward (default); or only in
    ``step()``. Either way the servers apply the gradients as ``step()`` finds them
    (clipped, unscaled): a change is noticed by comparing each gradient with what backward
    left (the tensor and its ``_version``), and a loop that changes gradients has its
    pushes held until ``step()``. Holding, rather than sending a correction after the
    push, because a push is an optimizer step (or, aggregated, part of one) the moment the
    last worker's arrives: it cannot be taken back. A gradient changed after its push left
    (a loop that changes gradients on some steps only) raises ``ElasticpsError`` naming
    ``push_on_backward=False``. ``opt.synchronize()`` / ``with opt.skip_synchronize():
    opt.step()`` (Horovod) work as written.

    ``backward_passes_per_step``: gradients accumulate over this many backward passes
    before they are pushed. ``tables``: ``elasticps.torch.named_tables(model)``, the
    model's ``Embedding``, ``EmbeddingBag``, ``HashEmbedding`` and ``HashEmbeddingBag``
    tables (they live on the servers; each step pushes the rows its forward passes
    pulled, see ``elasticps.embedding``);
    ``table_optimizer``: the optimizer of the tables that name none
    (``elasticps.torch.table_optimizer(...)``; default: the job's).

    ``broadcast_buffers`` (default True, as DDP's): after every step each rank's buffers
    (BatchNorm's running statistics) are rank 0's, through the servers (the module's doc
    says how). The module is ``model``, or the one ``named_parameters`` came from;
    ``False``: each rank keeps its own.

    ``compression``: how the gradients and pulled parameters travel
    (``elasticps.torch.Compression.bf16``, ``.fp16``, ``.topk(0.01)``, ``.none``); default:
    the job's (``elasticps launch --wire-dtype``, ``--compress``). Buffers travel exact.

    The result is an instance of a subclass of ``optimizer``'s class, so that learning-rate
    schedulers accept it; its ``param_groups`` are the ones a scheduler changes;
    ``state_dict()`` and ``load_state_dict()`` carry the servers' optimizer state.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"elasticps.torch: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if compression is not None and not isinstance(compression, Compression):
        raise TypeError(f"elasticps.torch: compression must be an elasticps.torch.Compression, got {compression!r}")
    for g in optimizer.param_groups:
        server_optimizer(optimizer, g)
    table_sync = TableSync(tables, table_optimizer)
    module = _module_of(named_parameters, model) if broadcast_buffers else None
    buffers = _Buffers(module) if module is not None else None
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(
        optimizer.param_groups,
        optimizer.defaults,
        named_parameters,
        worker,
        push_on_backward,
        backward_passes_per_step,
        table_sync,
        buffers,
        compression,
    )
