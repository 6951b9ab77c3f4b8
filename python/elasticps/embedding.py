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

Hashed tables (``HashEmbedding`` and ``HashEmbeddingBag``, recommendation models' feature
tables): no row count; the ids are any int64 values (hashed 64-bit feature ids, negative
ones too, each taken as its 64 bits), and the servers cut the table's key space into
``ranges`` key ranges by a hash of the id, each range a block. Rows are created on first
push; the table may be bounded (``max_rows`` per server, ``eviction`` "lru" or "lfu"),
expire rows not pushed for ``ttl_steps`` steps of the table, and create a row only at a
key's ``admit_after``-th push (before, a pull reads the row's initial values and its
gradients are dropped). An evicted or expired row comes back from its initializer::

    model.user = elasticps.torch.HashEmbeddingBag(
        16, mode="sum", max_rows=10**6, eviction="lru", ttl_steps=100_000, admit_after=2)
    model.user(torch.tensor([-8071772395398164521, 42, 42]), torch.tensor([0, 1]))

They share the pull and push path above with ``Embedding`` and ``EmbeddingBag`` (they are
subclasses of them), and take the same ``optimizer`` and ``init``.

Not supported (``ValueError``): ``padding_idx`` and ``max_norm`` (both write the weights
from the forward pass), ``_weight`` (the servers initialize the rows).
"""

from __future__ import annotations

from typing import Dict, Iterable, Iterator, List, Optional, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["Embedding", "EmbeddingBag", "HashEmbedding", "HashEmbeddingBag", "named_tables", "table_optimizer"]

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


#: Eviction policies of a bounded hashed table.
EVICTIONS = ("lru", "lfu")
#: Most key ranges a hashed table may be cut into (the servers' bound).
MAX_KEY_RANGES = 1 << 16


def _count(cls: str, what: str, value, least: int, most: Optional[int] = None) -> int:
    """An int argument, checked: ``least`` up to ``most``; bools, floats and strings refused."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"elasticps.torch: {cls}({what}=...) must be an int, got {value!r}")
    value = int(value)
    if value < least or (most is not None and value > most):
        bound = f"in {least}..={most}" if most is not None else f"at least {least}"
        raise ValueError(f"elasticps.torch: {cls}({what}={value}) must be {bound}")
    return value


def hashed_table_spec(
    cls: str,
    ranges: int = 16,
    max_rows: Optional[int] = None,
    eviction: str = "lru",
    ttl_steps: Optional[int] = None,
    admit_after: Optional[int] = None,
) -> dict:
    """A hashed table's keys and limits, checked, as ``register_model``'s table dict takes
    them (``None``: no bound, no expiry, a row at the first push)."""
    if not isinstance(eviction, str) or eviction not in EVICTIONS:
        raise ValueError(f"elasticps.torch: {cls}(eviction={eviction!r}): eviction must be 'lru' or 'lfu'")
    spec = {"keys": "hashed", "ranges": _count(cls, "ranges", ranges, 1, MAX_KEY_RANGES), "eviction": eviction}
    for key, value in (("max_rows", max_rows), ("ttl_steps", ttl_steps), ("admit_after", admit_after)):
        spec[key] = 0 if value is None else _count(cls, key, value, 0)
    return spec


class _Table(torch.nn.Module):
    """What every table module shares: the table's shape (rows, or a hashed key space),
    its optimizer, and the forward pass's pull of the rows a batch uses."""

    def __init__(
        self,
        num_embeddings: Optional[int],
        embedding_dim: int,
        optimizer: Optional[dict],
        init: Optional[dict],
        hashed: Optional[dict] = None,
    ) -> None:
        super().__init__()
        cls = type(self).__name__
        if isinstance(embedding_dim, bool) or not isinstance(embedding_dim, (int, np.integer)):
            raise TypeError(f"elasticps.torch: {cls}: embedding_dim must be an int, got {embedding_dim!r}")
        if hashed is None and (int(num_embeddings) < 1 or int(embedding_dim) < 1):
            raise ValueError(
                f"elasticps.torch: a table needs at least one row and one dimension, got "
                f"{num_embeddings} x {embedding_dim}"
            )
        if hashed is not None and int(embedding_dim) < 1:
            raise ValueError(f"elasticps.torch: {cls} needs at least one dimension, got {embedding_dim}")
        #: Rows (ids ``0..num_embeddings``); None for a hashed table (any int64 id).
        self.num_embeddings = None if hashed is not None else int(num_embeddings)
        self.embedding_dim = int(embedding_dim)
        #: A hashed table's keys and limits (``register_model``'s table dict), else None.
        self.hashed = hashed
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
        if not isinstance(input, torch.Tensor) or input.dtype not in (torch.int64, torch.int32):
            got = input.dtype if isinstance(input, torch.Tensor) else type(input).__name__
            where = f"{b.name}: " if b is not None else f"{type(self).__name__}: "
            raise TypeError(f"elasticps.torch: {where}ids must be an int64 or int32 tensor, got {got}")
        if b is None:
            raise RuntimeError(
                f"elasticps.torch: this {type(self).__name__} is not registered: pass "
                "tables=elasticps.torch.named_tables(model) to DistributedOptimizer"
            )
        ids = input.detach().to("cpu", torch.int64)
        if self.hashed is None and ids.numel():
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

    def spec(self):
        """The table as ``register_model``'s ``tables`` takes it: ``(rows, dim)`` or
        ``(rows, dim, init)``, or a hashed table's dict."""
        if self.hashed is not None:
            out = dict(self.hashed, dim=self.embedding_dim)
            if self.init is not None:
                out["init"] = self.init
            return out
        return (self.num_embeddings, self.embedding_dim) + ((self.init,) if self.init is not None else ())

    def extra_repr(self) -> str:
        name = f", name={self.table_name!r}" if self.table_name else ""
        if self.hashed is not None:
            h = self.hashed
            limits = "".join(f", {k}={h[k]}" for k in ("max_rows", "ttl_steps", "admit_after") if h[k])
            evict = f", eviction={h['eviction']!r}" if h["max_rows"] else ""
            return f"{self.embedding_dim}, ranges={h['ranges']}{limits}{evict}{name}"
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
        _check_mode("EmbeddingBag", mode)
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


def _check_mode(cls: str, mode: str) -> None:
    if mode not in ("sum", "mean", "max"):
        raise ValueError(f"elasticps.torch: {cls} mode must be 'sum', 'mean' or 'max', got {mode!r}")


class HashEmbedding(Embedding):
    """An ``Embedding`` keyed by any int64 id (hashed feature ids), whose rows the servers
    create on first push, optionally bounded (see the module's doc). Its forward is
    ``Embedding``'s: ``emb(ids)`` with ids an int64 tensor of any values and shape.

    ``embedding_dim``: values per row. ``ranges``: key ranges (blocks) the key space is cut
    into (default 16; more spread a table over more servers). ``max_rows``: at most this
    many rows per server (default None: no bound), past it the rows ``eviction`` puts first
    go: ``"lru"`` (least recently pushed, default) or ``"lfu"`` (least pushed).
    ``ttl_steps``: a row not pushed for more than this many steps of the table goes
    (default None: never). ``admit_after``: a key gets a row at its ``admit_after``-th push
    (default None: at its first). ``optimizer``, ``init`` and ``scale_grad_by_freq`` as
    ``Embedding``'s. ``num_embeddings`` is None.
    """

    def __init__(
        self,
        embedding_dim: int,
        *,
        ranges: int = 16,
        max_rows: Optional[int] = None,
        eviction: str = "lru",
        ttl_steps: Optional[int] = None,
        admit_after: Optional[int] = None,
        optimizer: Optional[dict] = None,
        init: Optional[dict] = None,
        scale_grad_by_freq: bool = False,
    ) -> None:
        spec = hashed_table_spec("HashEmbedding", ranges, max_rows, eviction, ttl_steps, admit_after)
        _Table.__init__(self, None, embedding_dim, optimizer, init, hashed=spec)
        self.scale_grad_by_freq = bool(scale_grad_by_freq)


class HashEmbeddingBag(EmbeddingBag):
    """An ``EmbeddingBag`` keyed by any int64 id: ``HashEmbedding``'s table (``ranges``,
    ``max_rows``, ``eviction``, ``ttl_steps``, ``admit_after``, ``optimizer``, ``init``)
    with ``EmbeddingBag``'s forward (``mode`` "sum", "mean" or "max", ``offsets``,
    ``per_sample_weights``, ``include_last_offset``)."""

    def __init__(
        self,
        embedding_dim: int,
        *,
        mode: str = "mean",
        ranges: int = 16,
        max_rows: Optional[int] = None,
        eviction: str = "lru",
        ttl_steps: Optional[int] = None,
        admit_after: Optional[int] = None,
        optimizer: Optional[dict] = None,
        init: Optional[dict] = None,
        scale_grad_by_freq: bool = False,
        include_last_offset: bool = False,
    ) -> None:
        _check_mode("HashEmbeddingBag", mode)
        spec = hashed_table_spec("HashEmbeddingBag", ranges, max_rows, eviction, ttl_steps, admit_after)
        _Table.__init__(self, None, embedding_dim, optimizer, init, hashed=spec)
        self.scale_grad_by_freq = bool(scale_grad_by_freq)
        self.mode = mode
        self.include_last_offset = bool(include_last_offset)


def named_tables(module: torch.nn.Module, prefix: str = "") -> Iterator[Tuple[str, _Table]]:
    """Every Embedding, EmbeddingBag, HashEmbedding and HashEmbeddingBag of ``module`` with
    its name on the servers: the module's name plus ``.weight``, what ``named_parameters``
    calls the same table in a plain torch model (``tables.3.weight``)."""
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
                    "elasticps.torch.Embedding, EmbeddingBag, HashEmbedding or HashEmbeddingBag"
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
        """``tables=`` of ``register_model``: (rows, dim), (rows, dim, init), or a hashed
        table's dict."""
        return {name: t.spec() for name, t in self.tables}

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
