"""Type stubs of ``elasticps._native``, the Rust half of the package (crates/python).

Arrays are float32, C-contiguous numpy arrays of the tensor's size (anything else raises
``TypeError`` or ``ValueError``); a pulled array must be writeable. Two arrays of one call
that share memory are refused with ``ValueError`` when the call writes one of them. Every
blocking call releases the GIL; Ctrl-C cancels a call that reads or writes arrays and
waits until the client has let go of them before ``KeyboardInterrupt`` is raised.
python/tests/test_stubs.py checks that these stubs name every public attribute.
"""

from typing import Mapping, Optional, Tuple, TypedDict, Union

import numpy as np
import numpy.typing as npt

_F32 = npt.NDArray[np.float32]
_I64 = npt.NDArray[np.int64]

class _Optimizer(TypedDict, total=False):
    """A server-side optimizer: ``kind`` ("sgd", "momentum", "adam", "adamw") and ``lr``
    are required; ``momentum``, ``betas``, ``eps`` and ``weight_decay`` (decoupled for
    "adamw") are optional."""

    kind: str
    lr: float
    momentum: float
    betas: Tuple[float, float]
    eps: float
    weight_decay: float

class _TableOptimizer(TypedDict, total=False):
    """A table's server-side optimizer: ``kind`` ("sgd", "adagrad", "sparse_adam",
    "lazy_adam") and ``lr`` are required; ``lr_decay``, ``initial_accumulator_value``
    (adagrad), ``betas`` (the Adams) and ``eps`` are optional, torch's defaults."""

    kind: str
    lr: float
    lr_decay: float
    initial_accumulator_value: float
    betas: Tuple[float, float]
    eps: float

class _RowInit(TypedDict, total=False):
    """A table's row initializer: ``kind`` "normal" (``mean``, ``std``), "uniform"
    (``low``, ``high``) or "constant" (``value``)."""

    kind: str
    mean: float
    std: float
    low: float
    high: float
    value: float

class _OptState(TypedDict):
    """A tensor's server-side optimizer state: ``steps`` taken, ``m`` and ``v`` (None when
    the optimizer keeps none or took no step yet)."""

    steps: int
    m: Optional[_F32]
    v: Optional[_F32]

class ElasticpsError(RuntimeError):
    """An elasticps operation failed; the message names the server, block and clock involved."""

class Handle:
    """What an asynchronous push or pull returns: ``wait()`` blocks until it is done."""

    def wait(self) -> None:
        """Waits until the operation is done; raises its error if it failed. A second call
        returns (or raises the same error) at once. Interrupted (Ctrl-C), it cancels the operation and waits until the
        client has let go of the array before ``KeyboardInterrupt`` is raised; a later
        ``wait()`` then raises ``ElasticpsError`` unless the operation had completed."""

    def done(self) -> bool:
        """True once the operation has finished (successfully or not); never blocks."""

class Worker:
    """A worker of a running job: connects to the scheduler, then pushes gradients and
    pulls parameters of the model it registered."""

    @property
    def rank(self) -> int:
        """This worker's rank, ``0..size``."""

    @property
    def size(self) -> int:
        """Number of workers in the job."""

    @property
    def start_clock(self) -> int:
        """The job's first clock: 0, or the clock of the checkpoint the job resumed from
        (``--resume DIR``)."""

    @property
    def metrics_addr(self) -> Optional[str]:
        """``host:port`` of this worker's Prometheus metrics (``ELASTICPS_METRICS_LISTEN``),
        or None."""

    def tensor_names(self) -> list[str]:
        """The model's tensor names, in order (empty before ``register_model``)."""

    def table_names(self) -> list[str]:
        """The model's table names, in order (empty before ``register_model``)."""

    def register_model(
        self,
        tensors: Mapping[str, _F32],
        optimizers: Optional[Mapping[str, Union[_Optimizer, _TableOptimizer]]] = None,
        tables: Optional[Mapping[str, Union[Tuple[int, int], Tuple[int, int, _RowInit]]]] = None,
    ) -> None:
        """Defines the model from ``tensors`` (name -> array, in order) and ``tables``
        (name -> ``(rows, dim)`` or ``(rows, dim, init)``: embedding tables whose rows the
        servers create on first use) and waits until every server holds its blocks; the
        parameters of clock ``start_clock`` are written into the arrays in place.
        ``optimizers`` maps tensor and table names to server-side optimizers; tensors not
        named use the job's ``--optimizer`` and ``--lr``, tables SGD with lr 0.01."""

    def pull_rows(self, clock: int, name: str, ids: _I64, out: _F32) -> None:
        """Pulls rows ``ids`` (1-D int64, each in ``0..rows``) of table ``name`` at clock
        ``clock`` into ``out`` (float32, ``(len(ids), dim)``), in the order asked. A bad
        dtype, shape, table name or id raises ``TypeError`` or ``ValueError``."""

    def push_rows(self, clock: int, name: str, ids: Optional[_I64], grads: Optional[_F32]) -> None:
        """Pushes the gradient rows ``grads`` (float32, ``(len(ids), dim)``) of rows ``ids``
        of table ``name`` at clock ``clock`` (duplicates summed). Push every table once per
        clock: with no ids for a table the step used without touching a row, and with
        ``ids=None, grads=None`` for a table the step did not use (no optimizer step, as
        torch skips a parameter whose ``grad`` is None)."""

    def push_rows_async(self, clock: int, name: str, ids: Optional[_I64], grads: Optional[_F32]) -> Handle:
        """Starts ``push_rows`` and returns at once; the arrays are copied first."""

    def pull(self, clock: int, out: Mapping[str, _F32]) -> None:
        """Pulls the parameters of clock ``clock`` into the arrays of ``out`` (every tensor
        or some), in place; the server may hold the pull as its sync policy says."""

    def push(self, clock: int, grads: Mapping[str, Optional[_F32]]) -> None:
        """Pushes the gradients of clock ``clock``; ``None`` for a tensor that got no
        gradient this step (the servers count the push and apply nothing)."""

    def push_pull(self, clock: int, grads: Mapping[str, Optional[_F32]], out: Mapping[str, _F32]) -> None:
        """Pushes the gradients of clock ``clock`` and pulls the parameters of clock
        ``clock + 1`` into ``out``, overlapping the two per server."""

    def push_async(self, clock: int, name: str, grad: Optional[_F32]) -> Handle:
        """Starts pushing the gradient of tensor ``name`` at clock ``clock`` and returns at
        once. Do not change ``grad`` before the handle's ``wait()`` returned. ``None``: the
        tensor got no gradient this step (the servers count the push and apply nothing)."""

    def pull_async(self, clock: int, name: str, out: _F32) -> Handle:
        """Starts pulling tensor ``name`` at clock ``clock`` into ``out`` and returns at
        once. Do not read ``out`` before the handle's ``wait()`` returned."""

    def set_compression(self, name: str, dtype: str, sparsify: Optional[str] = None) -> None:
        """Tensor ``name``'s gradients and pulled values travel in ``dtype`` from now on
        (``"f32"``, ``"bf16"`` or ``"fp16"``), its gradients compressed by ``sparsify``
        (``"topk:0.01"``, ``"randomk:0.01"``, with error feedback; None: whole). The
        servers keep float32 values."""

    def set_optimizer(self, name: str, optimizer: _Optimizer) -> None:
        """Gives tensor ``name`` a new server-side optimizer; every push sent after this
        returns uses it."""

    def optimizer_state(self, name: str) -> _OptState:
        """The server-side optimizer state of tensor ``name`` (what a PyTorch optimizer's
        ``state_dict`` carries): ``steps`` taken, ``m`` (momentum buffer or Adam's first
        moment) and ``v`` (Adam's second moment), each a float32 array of the tensor's size
        or None. Ask between steps (after ``pull``)."""

    def set_optimizer_state(
        self, name: str, steps: int, m: Optional[_F32] = None, v: Optional[_F32] = None
    ) -> None:
        """Replaces the server-side optimizer state of tensor ``name`` (a PyTorch
        optimizer's ``load_state_dict``). Refused in a job with ``--replicas``."""

    def set_values(self, name: str, values: _F32) -> None:
        """Overwrites the values of tensor ``name`` on the servers, leaving its optimizer
        and clock state alone (one worker's buffers that every worker pulls). Call it
        before the push of the clock whose pulls must see them. Refused in a job with
        ``--replicas``."""

    def barrier(self) -> None:
        """Waits until every worker still in the job called ``barrier``."""

    def finish(self) -> None:
        """Tells the scheduler this worker is done and reports the run to the launcher.
        Later calls do nothing."""

    def abandon(self) -> None:
        """Leaves the job unfinished, as a failed worker: the scheduler counts it lost (and
        ``--restart-workers`` starts it again) rather than done. Called at interpreter exit
        when an exception ended the script. Later calls, and ``finish`` after it, do
        nothing."""

def connect(scheduler: Optional[str] = None) -> Worker:
    """Joins the job of the scheduler at ``scheduler`` (``host:port``; default
    ``ELASTICPS_SCHEDULER``, else 127.0.0.1:7000) and returns the worker."""

def log_event(rank: int, step: int, metrics: Mapping[str, Union[int, float]]) -> None:
    """Writes a ``log`` event (``elasticps.log(**metrics)``) for the launcher."""

def cli_main(argv: list[str], self_command: list[str]) -> int:
    """Runs the ``elasticps`` command (``argv[0]`` is the program's name) with the GIL
    released and returns its exit status; ``self_command`` starts this program again
    (``[sys.executable, "-m", "elasticps"]``), for the nodes a launcher starts."""
