"""The binding is sound: arrays that share memory are refused when a call writes one of
them, and a call interrupted by Ctrl-C never hands the arrays back while the client still
reads or writes them."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

import elasticps

#: Values of the large tensor: 64 MiB of float32.
BIG = 16 << 20
#: The server's bandwidth cap, MB/s each direction: a pull of BIG takes about 2 s.
CAP_MBPS = 32


@pytest.mark.deadline(30)
@pytest.mark.cluster(workers=1, servers=1, sync="bsp", optimizer="sgd", lr=0.5, block_bytes=64)
def test_arrays_that_share_memory_with_a_written_one_are_refused(cluster):
    w = cluster.connect()
    base = np.zeros(20, np.float32)
    with pytest.raises(ValueError, match=r'register_model: tensors\["a"\] and tensors\["b"\] are the same array'):
        w.register_model({"a": base, "b": base})
    with pytest.raises(ValueError, match=r'tensors\["a"\] and tensors\["b"\] share memory'):
        w.register_model({"a": base[:10], "b": base[5:15]})
    # Adjacent views do not overlap: a model of two halves of one buffer is fine.
    base[:] = np.arange(20, dtype=np.float32)
    a, b = base[:10], base[10:]
    w.register_model({"a": a, "b": b})
    assert np.array_equal(base, np.arange(20, dtype=np.float32))

    out = np.zeros(10, np.float32)
    with pytest.raises(ValueError, match=r'pull: out\["a"\] and out\["b"\] are the same array.*writes into out\["a"\] and out\["b"\]'):
        w.pull(0, {"a": out, "b": out})
    other = np.zeros(30, np.float32)
    with pytest.raises(ValueError, match=r'pull: out\["a"\] and out\["b"\] share memory'):
        w.pull(0, {"a": other[:10], "b": other[9:19]})
    g = np.ones(10, np.float32)
    with pytest.raises(ValueError, match=r'push_pull: grads\["a"\] and out\["a"\] are the same array.*writes into out\["a"\]'):
        w.push_pull(0, {"a": g, "b": g}, {"a": g})
    with pytest.raises(ValueError, match=r'push_pull: grads\["b"\] and out\["a"\] share memory'):
        w.push_pull(0, {"b": other[5:15]}, {"a": other[:10]})
    shared = np.zeros((2, 10), np.float32)
    with pytest.raises(ValueError, match=r'push_pull: out\["a"\] and out\["b"\] share memory'):
        w.push_pull(0, {"a": g}, {"a": shared.reshape(20)[:10], "b": shared[0]})

    # None of that sent anything: the job is at clock 0. Two gradients read from one
    # array are fine (neither is written).
    w.push(0, {"a": g, "b": g})
    w.pull(1, {"a": a, "b": b})
    assert np.array_equal(base, np.arange(20, dtype=np.float32) - 0.5)
    w.finish()


def interrupt_after(seconds: float) -> threading.Timer:
    """SIGINT to this process in `seconds` (the main thread raises KeyboardInterrupt)."""
    t = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    t.start()
    return t


@pytest.mark.deadline(90)
@pytest.mark.cluster(workers=1, servers=1, sync="bsp", server_bandwidth=f"0={CAP_MBPS}")
def test_an_interrupted_call_never_writes_the_array_afterwards(cluster):
    w = cluster.connect()
    params = {"w": np.full(BIG, 1.0, np.float32)}
    w.register_model(params)

    # An uninterrupted pull, to know how long one takes here.
    out = np.zeros(BIG, np.float32)
    started = time.monotonic()
    w.pull(0, {"w": out})
    full = time.monotonic() - started
    assert np.all(out == 1.0)
    assert full > 1.0, f"a capped pull of 64 MiB took only {full:.2f} s: too fast to interrupt"

    # Python raises KeyboardInterrupt on SIGINT unless it started with SIGINT ignored (a
    # background job of a non-interactive shell, as CI may be): install the handler an
    # interactive user has.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        # Zero gradients: a push that got through (in part) leaves the parameters at 1.
        zeros = np.zeros(BIG, np.float32)
        for how in ["pull", "pull_async", "push_pull"]:
            out[:] = 0.0
            timer = interrupt_after(full / 4)
            started = time.monotonic()
            try:
                with pytest.raises(KeyboardInterrupt):
                    if how == "pull":
                        w.pull(0, {"w": out})
                    elif how == "pull_async":
                        handle = w.pull_async(0, "w", out)
                        handle.wait()
                    else:  # interrupted while the push is being written
                        w.push_pull(0, {"w": zeros}, {"w": out})
            finally:
                timer.cancel()
                timer.join(5)
            interrupted_after = time.monotonic() - started
            # Cancelled, not waited out: the exception comes soon after the signal.
            assert interrupted_after < full / 4 + 1.0, (how, interrupted_after, full)
            # The array is the caller's again: nothing the pull still had in flight may
            # land in it.
            out[:] = 7.0
            time.sleep(full + 1.0)
            assert np.all(out == 7.0), (
                f"{how}: {int(np.count_nonzero(out != 7.0))} values of the array changed after KeyboardInterrupt"
            )
            if how == "pull_async":
                # The handle knows its operation did not complete.
                with pytest.raises(elasticps.ElasticpsError, match="interrupted"):
                    handle.wait()
    finally:
        signal.signal(signal.SIGINT, previous)

    # The worker goes on working after the cancelled calls.
    w.pull(0, {"w": out})
    assert np.all(out == 1.0)
    w.finish()
