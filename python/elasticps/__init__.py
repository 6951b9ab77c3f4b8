"""elasticps: a parameter server for distributed deep-learning training.

The numpy level mirrors the Rust client::

    import numpy as np, elasticps
    w = elasticps.init()                      # ELASTICPS_SCHEDULER etc. from the environment
    params = {"w": np.zeros(10, np.float32)}
    w.register_model(params)                  # rank 0's values become everyone's
    for t in range(w.start_clock, 100):       # 0, or the checkpoint's clock (--resume)
        w.pull(t, params)                     # in place, no copy
        grads = {"w": compute(params)}
        w.push(t, grads)
        elasticps.log(step=t, loss=...)
    elasticps.finish()

A job resumed from a checkpoint (``--resume DIR``) starts at ``w.start_clock``, the
checkpoint's clock: ``register_model`` then fills the arrays with the checkpoint's
parameters (no values are broadcast), so the same loop goes on where the job stopped.

Arrays must be float32 and C-contiguous (anything else raises ``TypeError``); two arrays of
one call that share memory raise ``ValueError`` when the call writes one of them. Every
wait releases the GIL and can be interrupted with Ctrl-C; a call that reads or writes
arrays is then cancelled, and the client has let go of them before ``KeyboardInterrupt``
reaches the caller. A forked child (a DataLoader worker)
that touches the client gets ``ElasticpsError``. ``elasticps.torch.DistributedOptimizer``
wraps a torch optimizer.
"""

from __future__ import annotations

import atexit
import sys
import threading
from typing import Optional

from ._native import ElasticpsError, Handle, Worker, connect, log_event
from .export import ExportError, load_export

__all__ = [
    "ElasticpsError",
    "ExportError",
    "load_export",
    "Handle",
    "Worker",
    "init",
    "worker",
    "rank",
    "size",
    "start_clock",
    "finish",
    "log",
]

_lock = threading.Lock()
_default: Optional[Worker] = None
_steps = 0


def init(scheduler: Optional[str] = None) -> Worker:
    """Joins the job as a worker and returns it; it is also the process's default worker.

    ``scheduler`` is ``host:port``; by default ``ELASTICPS_SCHEDULER`` (set by
    ``elasticps launch``), else ``127.0.0.1:7000``. Calling ``init`` again returns the same
    worker. A script that ends without ``finish()`` finishes at interpreter exit, so the
    job does not count it as lost; one that an exception ends does not (the job counts it
    lost, and ``--restart-workers`` starts it again).
    """
    global _default, _steps
    with _lock:
        if _default is None:
            _default = connect(scheduler)
            # A resumed job's log steps go on from its checkpoint's clock.
            _steps = int(_default.start_clock)
            atexit.register(_finish_at_exit)
        return _default


def worker() -> Worker:
    """The process's default worker (``init`` first)."""
    if _default is None:
        raise ElasticpsError("elasticps: call elasticps.init() first")
    return _default


def rank() -> int:
    """This worker's rank, ``0..size()``."""
    return worker().rank


def size() -> int:
    """Number of workers in the job."""
    return worker().size


def start_clock() -> int:
    """The job's first clock: 0, or the clock of the checkpoint it resumed from
    (``--resume DIR``)."""
    return worker().start_clock


def finish() -> None:
    """Tells the job this worker is done and reports its run to the launcher."""
    if _default is not None:
        _default.finish()


def _finish_at_exit() -> None:
    """At interpreter exit, finishes the worker the script did not finish, unless an
    exception ended the script (the interpreter printed it, and set ``sys.last_value``):
    that worker failed, and finishing it would count it done, so the job would neither
    restart it nor fail, and its pushes would silently stop. It leaves unfinished instead
    (``Worker.abandon``), and the job counts it lost, as a killed worker."""
    if _default is None:
        return
    if getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None:
        _default.abandon()
    else:
        _default.finish()


def log(**metrics: float) -> None:
    """Reports metrics (``loss``, ``accuracy``, ``samples``, ``total``, ...) to the
    launcher's progress bars and report. ``step`` is the iteration (default: one more
    than the last call's)."""
    global _steps
    step = metrics.pop("step", None)
    step = _steps + 1 if step is None else int(step)
    _steps = step
    log_event(worker().rank, step, metrics)
