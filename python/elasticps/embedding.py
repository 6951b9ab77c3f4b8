"""Embedding tables that live on the servers: ``elasticps.torch.Embedding`` and
``EmbeddingBag`` (re-exported there), drop-in for ``torch.nn.Embedding(sparse=True)`` and
``torch.nn.EmbeddingBag(sparse=True)``.

A table of ``num_embeddings x embedding_dim`` float32 rows is declared to the servers when
``DistributedOptimizer`` registers the model (``tables=elasticps.torch.named_tables(model)``),
and cut into row ranges there; rows are created on first touch with the table's
initializer, so a table of 10^7 rows costs memory for the rows used. The module holds no
parameter. Its forward pulls only the rows the batch uses, at the optimizer's clock::

    unique ids, inverse = unique(input)   ->  rows = pull_rows(clock, name, unique ids)
    rows: a leaf with requires_grad       ->  F.embedding(inverse, rows)

and ``DistributedOptimizer.step()`` pushes the gradient of those rows (duplicates summed,
as torch sums a sparse gradient's duplicate indices) with ``push_rows(clock, name, ids,
grads)``, beside the dense gradients. Every table is pushed on every step, with no rows
when the step did not touch it, so that the servers' sync counts every worker's clock on
every row range. The table's server-side optimizer (``table_optimizer``) applies each
row's gradient as torch's sparse optimizers do: ``SparseAdam``, ``Adagrad`` on sparse
gradients, ``SGD``.

Not supported (``ValueError``): ``padding_idx`` and ``max_norm`` (both write the weights
from the forward pass), ``_weight`` (the servers initialize the rows).
"""

from __future__ import annotations

from typing import Dict, Iterable, Iterator, List, Optional, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["Embedding", "EmbeddingBag", "named_tables", "table_optimizer"]

#: Table optimizers the servers run, with their torch counterparts.
TABLE_OPTIMIZERS = {
    "sgd": "torch.optim.SGD on sparse gradients",
    "adagrad": "torch.optim.Adagrad on sparse gradients",
    "sparse_adam": "torch.optim.SparseAdam",
    "lazy_adam": "Adam with per-row step counts (only the rows a step touches take a step)",
}


def table_optimizer(kind: Union[str, type], lr: float, **hyper) -> dict:
    """A table's server-side optimizer (a dict for ``Embedding(optimizer=...)`` and
    ``Worker.register_model(optimizers=...)``).

    ``kind``: ``"sgd"``, ``"adagrad"`` (``lr_decay`` 0, ``eps`` 1e-10,
    ``initial_accumulator_value`` 0),
    ``"sparse_adam"`` (``betas`` (0.9, 0.999), ``eps`` 1e-8; torch.optim.SparseAdam's
    semantics) or ``"lazy_adam"`` (the same, with each row's own step count), or the torch
    class ``torch.optim.SGD``, ``torch.optim.Adagrad``, ``torch.optim.SparseAdam``. Defaults
    are torch's.
    """
    if isinstance(kind, type):
        names = {torch.optim.SGD: "sgd", torch.optim.Adagrad: "adagrad", torch.optim.SparseAdam: "sparse_adam"}
        if kind not in names:
            raise TypeError(
                f"elasticps.torch: {kind.__name__} cannot run on a table: the servers run "
                "torch.optim.SGD, Adagrad and SparseAdam on rows"
            )
        kind = names[kind]
    if kind not in TABLE_OPTIMIZERS:
        raise ValueError(f"elasticps.torch: unknown table optimizer {kind!r} (known: {', '.join(TABLE_OPTIMIZERS)})")
    spec: dict = {"kind": kind, "lr": float(lr)}
    allowed = {
        "sgd": {},
        "adagrad": {"lr_decay": 0.0, "eps": 1e-10, "initial_accumulator_value": 0.0},
        "sparse_adam": {"betas": (0.9, 0.999), "eps": 1e-8},
        "lazy_adam": {"betas": (0.9, 0.999), "eps": 1e-8},
    }[kind]
    for key, value in hyper.items():
        if key not in allowed:
            raise TypeError(
                f"elasticps.torch: table optimizer {kind!r} takes no {key!r} (it takes lr"
                + "".join(f", {k}" for k in allowed)
                + ")"
            )
    for key, default in allowed.items():
        value = hyper.get(key, default)
        spec[key] = (float(value[0]), float(value[1])) if key == "betas" else float(value)
    return spec


class _Binding:
    """What ties a table module to the optimizer that registered it: the worker, the
    table's name on the servers, the clock to pull at, and this step's pulled rows."""

    def __init__(self, worker, name: str, clock) -> None:
        self.worker = worker
        self.name = name
        self.clock = clock  # a callable: the optimizer's current clock
        self.pulled: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (unique ids, leaf rows)

    def take_gradient(self, dim: int) -> Tuple[Optional[np.ndarray], Optional[np.ndarray]]:
        """This step's row gradients: unique ids (int64) and their summed rows (float32),
        then forgets the step's pulls. Rows that got no gradient are left out; ``(None,
        None)`` when no pull of the step got one (the table was not used: torch's ``grad
        is None``, so the servers take no optimizer step for it)."""
        ids, grads = [], []
        for u, leaf in self.pulled:
            if leaf.grad is not None:
                ids.append(u)
                grads.append(leaf.grad)
        self.pulled.clear()
        if not ids:
            return None, None
        if len(ids) == 1:
            u, g = ids[0], grads[0]
        else:
            # Several forward passes (accumulation, a table used twice): sum per row.
            u, inverse = torch.unique(torch.cat(ids), return_inverse=True)
            g = torch.zeros(len(u), dim, dtype=torch.float32).index_add_(0, inverse, torch.cat(grads))
        return u.numpy(), g.detach().contiguous().numpy()


class _Table(torch.nn.Module):
    """What Embedding and EmbeddingBag share: the table's shape, its optimizer, and the
    forward pass's pull of the rows a batch uses."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, optimizer: Optional[dict], init: Optional[dict]
    ) -> None:
        super().__init__()
        if int(num_embeddings) < 1 or int(embedding_dim) < 1:
            raise ValueError(
                f"elasticps.torch: a table needs at least one row and one dimension, got "
                f"{num_embeddings} x {embedding_dim}"
            )
        self.num_embeddings = int(num_embeddings)
        self.embedding_dim = int(embedding_dim)
        if optimizer is not None and not isinstance(optimizer, dict):
            raise TypeError("elasticps.torch: a table's optimizer is a dict (elasticps.torch.table_optimizer(...))")
        self.optimizer = optimizer
        if init is not None and not isinstance(init, dict):
            raise TypeError(
                "elasticps.torch: a table's init is a dict: {'kind': 'normal', 'mean': 0.0, 'std': 1.0}, "
                "{'kind': 'uniform', 'low': -0.1, 'high': 0.1} or {'kind': 'constant', 'value': 0.0}"
            )
        self.init = init
        self._binding: Optional[_Binding] = None

    def _bind(self, binding: Optional[_Binding]) -> None:
        self._binding = binding

    @property
    def table_name(self) -> Optional[str]:
        """The table's name on the servers (None until an optimizer registered it)."""
        return self._binding.name if self._binding is not None else None

    def _rows(self, input: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Pulls the rows of the ids in ``input``: (rows of the unique ids, a leaf that
        requires grad when grad is enabled; the inverse index, shaped like ``input``)."""
        b = self._binding
        if b is None:
            raise RuntimeError(
                f"elasticps.torch: this {type(self).__name__} is not registered: pass "
                "tables=elasticps.torch.named_tables(model) to DistributedOptimizer"
            )
        if input.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"elasticps.torch: {b.name}: ids must be int64 or int32, got {input.dtype}")
        ids = input.detach().to("cpu", torch.int64)
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.num_embeddings:
                bad = lo if lo < 0 else hi
                raise IndexError(f"elasticps.torch: {b.name}: id {bad} is out of range (the table has {self.num_embeddings} rows)")
        unique, inverse = torch.unique(ids, return_inverse=True)
        rows = torch.empty(len(unique), self.embedding_dim, dtype=torch.float32)
        b.worker.pull_rows(b.clock(), b.name, unique.numpy(), rows.numpy())
        if torch.is_grad_enabled():
            rows.requires_grad_(True)
            b.pulled.append((unique, rows))
        device = input.device
        if device.type != "cpu":
            return rows.to(device), inverse.to(device)
        return rows, inverse

    def extra_repr(self) -> str:
        name = f", name={self.table_name!r}" if self.table_name else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{name}"


def _refuse(cls: str, padding_idx, max_norm, _weight) -> None:
    if padding_idx is not None:
        raise ValueError(f"elasticps.torch: {cls}(padding_idx=...) is not supported (the servers own the rows)")
    if max_norm is not None:
        raise ValueError(f"elasticps.torch: {cls}(max_norm=...) is not supported (it writes rows in the forward pass)")
    if _weight is not None:
        raise ValueError(f"elasticps.torch: {cls}(_weight=...) is not supported (the servers initialize the rows)")


class Embedding(_Table):
    """``torch.nn.Embedding`` whose table lives on the servers (see the module's doc).

    ``optimizer``: the table's server-side optimizer (``table_optimizer(...)``); default:
    the ``table_optimizer`` given to ``DistributedOptimizer``, else SGD with lr 0.01.
    ``init``: how the servers draw a row's first values (a dict: ``{"kind": "normal",
    "mean": 0.0, "std": 1.0}``, torch's default; ``{"kind": "uniform", "low": -0.1,
    "high": 0.1}``; ``{"kind": "constant", "value": 0.0}``), seeded by the job's seed, the
    table's name and the row id. ``sparse`` is accepted and ignored (the gradient is always
    a set of rows); ``scale_grad_by_freq`` is torch's.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: Optional[int] = None,
        max_norm: Optional[float] = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = True,
        _weight: Optional[torch.Tensor] = None,
        *,
        optimizer: Optional[dict] = None,
        init: Optional[dict] = None,
    ) -> None:
        _refuse("Embedding", padding_idx, max_norm, _weight)
        super().__init__(num_embeddings, embedding_dim, optimizer, init)
        self.scale_grad_by_freq = bool(scale_grad_by_freq)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows, inverse = self._rows(input)
        return F.embedding(inverse, rows, scale_grad_by_freq=self.scale_grad_by_freq)


class EmbeddingBag(_Table):
    """``torch.nn.EmbeddingBag`` whose table lives on the servers (see the module's doc):
    ``mode`` "sum", "mean" or "max", ``offsets``, ``per_sample_weights`` and
    ``include_last_offset`` as in torch; ``optimizer`` and ``init`` as ``Embedding``'s."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        max_norm: Optional[float] = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        mode: str = "mean",
        sparse: bool = True,
        _weight: Optional[torch.Tensor] = None,
        include_last_offset: bool = False,
        padding_idx: Optional[int] = None,
        *,
        optimizer: Optional[dict] = None,
        init: Optional[dict] = None,
    ) -> None:
        _refuse("EmbeddingBag", padding_idx, max_norm, _weight)
        if mode not in ("sum", "mean", "max"):
            raise ValueError(f"elasticps.torch: EmbeddingBag mode must be 'sum', 'mean' or 'max', got {mode!r}")
        super().__init__(num_embeddings, embedding_dim, optimizer, init)
        self.scale_grad_by_freq = bool(scale_grad_by_freq)
        self.mode = mode
        self.include_last_offset = bool(include_last_offset)

    def forward(
        self,
        input: torch.Tensor,
        offsets: Optional[torch.Tensor] = None,
        per_sample_weights: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        rows, inverse = self._rows(input)
        return F.embedding_bag(
            inverse,
            rows,
            offsets,
            scale_grad_by_freq=self.scale_grad_by_freq,
            mode=self.mode,
            per_sample_weights=per_sample_weights,
            include_last_offset=self.include_last_offset,
        )


def named_tables(module: torch.nn.Module, prefix: str = "") -> Iterator[Tuple[str, _Table]]:
    """Every Embedding and EmbeddingBag of ``module`` with its name on the servers: the
    module's name plus ``.weight``, what ``named_parameters`` calls the same table in a
    plain torch model (``tables.3.weight``)."""
    for name, m in module.named_modules(prefix=prefix):
        if isinstance(m, _Table):
            yield (f"{name}.weight" if name else "weight"), m


class TableSync:
    """The tables of one ``DistributedOptimizer``: checks them, declares them to
    ``register_model``, and pushes each step's row gradients."""

    def __init__(self, tables: Optional[Iterable[Tuple[str, _Table]]], default_optimizer: Optional[dict]) -> None:
        self.tables: List[Tuple[str, _Table]] = []
        seen: Dict[str, _Table] = {}
        for name, t in tables or ():
            if not isinstance(t, _Table):
                raise TypeError(
                    f"elasticps.torch: table {name!r} is a {type(t).__name__}, not an "
                    "elasticps.torch.Embedding or EmbeddingBag"
                )
            if name in seen:
                raise ValueError(f"elasticps.torch: table name {name!r} is used twice")
            if any(t is u for u in seen.values()):
                raise ValueError(f"elasticps.torch: table {name!r} is named twice")
            if t._binding is not None:
                raise ValueError(f"elasticps.torch: table {name!r} is already registered (as {t.table_name!r})")
            seen[name] = t
            self.tables.append((name, t))
        if default_optimizer is not None and not isinstance(default_optimizer, dict):
            raise TypeError("elasticps.torch: table_optimizer is a dict (elasticps.torch.table_optimizer(...))")
        self.default_optimizer = default_optimizer

    def names(self) -> List[str]:
        return [name for name, _ in self.tables]

    def shapes(self) -> Dict[str, tuple]:
        """``tables=`` of ``register_model``: (rows, dim), or (rows, dim, init)."""
        return {
            name: (t.num_embeddings, t.embedding_dim) + ((t.init,) if t.init is not None else ())
            for name, t in self.tables
        }

    def optimizers(self) -> Dict[str, dict]:
        """The tables' entries of ``register_model``'s ``optimizers``."""
        out = {}
        for name, t in self.tables:
            spec = t.optimizer if t.optimizer is not None else self.default_optimizer
            if spec is not None:
                out[name] = spec
        return out

    def bind(self, worker, clock) -> None:
        for name, t in self.tables:
            t._bind(_Binding(worker, name, clock))

    def push(self, clock: int) -> list:
        """Starts pushing every table's gradient rows of ``clock`` (no rows for a table
        this step did not touch); returns what to wait for."""
        handles = []
        for name, t in self.tables:
            ids, grads = t._binding.take_gradient(t.embedding_dim)
            # The arrays are copied by the call: the handle is all there is to wait for.
            handles.append(t._binding.worker.push_rows_async(clock, name, ids, grads))
        return handles

    def forget(self) -> None:
        """Drops this step's pulled rows without pushing them (zero_grad's counterpart)."""
        for _, t in self.tables:
            t._binding.pulled.clear()
