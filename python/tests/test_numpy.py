"""The numpy API against real clusters: register_model's broadcast, exact push/pull
arithmetic, asynchronous handles, argument errors, fork, Ctrl-C and a dead server."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import warnings

import numpy as np
import pytest

import elasticps
from conftest import read_line

#: A hang fails fast: every test here takes seconds.
pytestmark = pytest.mark.deadline(30)

#: A second worker process: joins, registers a model of the shapes the test passes (filled
#: with -7), prints its arrays after register_model as JSON, then does what the test
#: writes on its stdin ("push CLOCK VALUE": push VALUE everywhere; "none CLOCK": push no
#: gradient anywhere; "pull CLOCK": pull and print; "finish").
CHILD = r"""
import json, sys
import numpy as np
import elasticps
shapes = json.loads(sys.argv[1])
w = elasticps.init()
params = {name: np.full(shape, -7.0, np.float32) for name, shape in shapes.items()}
ids = {name: id(a) for name, a in params.items()}
w.register_model(params)
assert all(id(params[n]) == ids[n] for n in params)
print(json.dumps({"rank": w.rank, "size": w.size, "params": {n: a.tolist() for n, a in params.items()}}), flush=True)
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "push":
        w.push(int(cmd[1]), {n: np.full(a.shape, float(cmd[2]), np.float32) for n, a in params.items()})
        print("pushed", flush=True)
    elif cmd[0] == "none":
        w.push(int(cmd[1]), {n: None for n in params})
        print("pushed", flush=True)
    elif cmd[0] == "pull":
        w.pull(int(cmd[1]), params)
        print(json.dumps({n: a.tolist() for n, a in params.items()}), flush=True)
    elif cmd[0] == "finish":
        break
elasticps.finish()
print("finished", flush=True)
"""


def model():
    """Integer-valued float32 tensors of a few shapes (several blocks each when the job
    uses small blocks)."""
    return {
        "layer1.weight": np.arange(60, dtype=np.float32).reshape(6, 10),
        "layer1.bias": np.arange(6, dtype=np.float32) - 3,
        "layer2.weight": np.arange(35, dtype=np.float32).reshape(5, 7) * 2,
    }


def shapes(params):
    return json.dumps({n: list(a.shape) for n, a in params.items()})


def finish_child(cluster, child):
    child.stdin.write("finish\n")
    child.stdin.flush()
    assert read_line(child, 20, "the second worker to finish").strip() == "finished"
    assert cluster.wait_exit(child, 20, "the second worker") == 0


@pytest.mark.cluster(workers=2, servers=2, sync="bsp", block_bytes=64)
def test_register_model_broadcasts_rank_0s_values(cluster):
    w = cluster.connect()
    assert (w.rank, w.size) == (0, 2)
    params = model()
    expected = {n: a.copy() for n, a in params.items()}
    child = cluster.spawn_worker(CHILD, shapes(params))
    w.register_model(params)
    assert w.tensor_names() == list(params)
    got = json.loads(read_line(child, 20, "the second worker's arrays after register_model"))
    assert (got["rank"], got["size"]) == (1, 2)
    for name, a in expected.items():
        # Rank 0 keeps its values; rank 1's arrays (filled with -7) were overwritten.
        assert np.array_equal(params[name], a), name
        assert np.array_equal(np.array(got["params"][name], np.float32), a), name
    with pytest.raises(elasticps.ElasticpsError, match="already"):
        w.register_model(params)
    finish_child(cluster, child)
    w.finish()


@pytest.mark.cluster(workers=1, servers=2, sync="bsp", optimizer="sgd", lr=0.5, block_bytes=64)
def test_pull_push_and_push_pull_are_exact(cluster):
    w = cluster.connect()
    params = model()
    w.register_model(params)
    ref = {n: a.copy() for n, a in params.items()}
    out = {n: np.zeros_like(a) for n, a in params.items()}
    w.pull(0, out)
    for n in ref:
        assert np.array_equal(out[n], ref[n]), n

    rng = np.random.default_rng(1)
    for clock in range(4):
        grads = {n: rng.integers(-8, 9, a.shape).astype(np.float32) for n, a in ref.items()}
        for n in ref:
            ref[n] -= 0.5 * grads[n]
        if clock % 2 == 0:
            w.push(clock, grads)
            w.pull(clock + 1, out)
        else:
            w.push_pull(clock, grads, out)
        for n in ref:
            assert np.array_equal(out[n], ref[n]), (clock, n)

    # A pull of some tensors only, into arrays of another shape with the same size.
    flat = np.zeros(60, np.float32)
    w.pull(4, {"layer1.weight": flat})
    assert np.array_equal(flat, ref["layer1.weight"].ravel())
    w.finish()
    with pytest.raises(elasticps.ElasticpsError, match="finished"):
        w.pull(4, out)


@pytest.mark.cluster(workers=2, servers=2, sync="bsp", optimizer="sgd", lr=0.5, aggregate=True, block_bytes=64)
def test_two_workers_aggregate_takes_the_mean(cluster):
    w = cluster.connect()
    params = model()
    child = cluster.spawn_worker(CHILD, shapes(params))
    w.register_model(params)
    read_line(child, 20, "the second worker's arrays after register_model")
    ref = {n: a.copy() for n, a in params.items()}
    for clock, (mine, theirs) in enumerate([(4.0, 2.0), (-6.0, 10.0)]):
        child.stdin.write(f"push {clock} {theirs}\n")
        child.stdin.flush()
        w.push(clock, {n: np.full(a.shape, mine, np.float32) for n, a in params.items()})
        assert read_line(child, 20, f"the second worker's push of clock {clock}").strip() == "pushed"
        for n in ref:
            ref[n] -= 0.5 * (mine + theirs) / 2
        w.pull(clock + 1, params)
        for n in ref:
            assert np.array_equal(params[n], ref[n]), (clock, n)
    child.stdin.write("pull 2\n")
    child.stdin.flush()
    theirs = json.loads(read_line(child, 20, "the second worker's pull of clock 2"))
    for n in ref:
        assert np.array_equal(np.array(theirs[n], np.float32), ref[n]), n
    finish_child(cluster, child)
    w.finish()


@pytest.mark.cluster(workers=2, servers=2, sync="bsp", optimizer="momentum", lr=0.5, aggregate=True, block_bytes=64)
def test_pushes_without_a_gradient_count_as_zeros_and_a_clock_without_any_takes_no_step(cluster):
    w = cluster.connect()
    params = model()
    child = cluster.spawn_worker(CHILD, shapes(params))
    w.register_model(params)
    read_line(child, 20, "the second worker's arrays after register_model")
    ref = {n: a.copy() for n, a in params.items()}
    momentum = {n: np.zeros_like(a) for n, a in params.items()}
    beta, lr = np.float32(0.9), np.float32(0.5)
    # Clock 0: no gradient for layer1.bias from this worker (the mean is the other's over
    # 2); clock 1: none from anyone (no step, the momentum does not decay); clock 2: both.
    for clock, (mine, theirs) in enumerate([(2.0, 4.0), (None, None), (1.0, 1.0)]):
        child.stdin.write(f"push {clock} {theirs}\n" if theirs is not None else f"none {clock}\n")
        child.stdin.flush()
        grads = {n: None if mine is None else np.full(a.shape, mine, np.float32) for n, a in params.items()}
        if clock == 0:
            grads["layer1.bias"] = None
        w.push(clock, grads)
        assert read_line(child, 20, f"the second worker's push of clock {clock}").strip() == "pushed"
        if mine is not None:
            for n in ref:
                g = np.float32(theirs if grads[n] is None else mine + theirs) * np.float32(0.5)
                momentum[n] = beta * momentum[n] + g
                ref[n] -= lr * momentum[n]
        w.pull(clock + 1, params)
        for n in ref:
            np.testing.assert_allclose(params[n], ref[n], rtol=0, atol=1e-5, err_msg=f"clock {clock}, {n}")
    finish_child(cluster, child)
    w.finish()


@pytest.mark.cluster(workers=1, servers=2, sync="bsp", optimizer="sgd", lr=0.5, block_bytes=64)
def test_async_handles(cluster):
    w = cluster.connect()
    params = model()
    w.register_model(params)
    ref = {n: a.copy() for n, a in params.items()}
    grads = {n: np.full(a.shape, 2.0, np.float32) for n, a in params.items()}
    handles = [w.push_async(0, n, g) for n, g in grads.items()]
    assert "push(clock 0)" in repr(handles[0])
    for h in handles:
        h.wait()
        assert h.done()
        h.wait()  # a second wait returns at once
    out = {n: np.zeros_like(a) for n, a in params.items()}
    pulls = {n: w.pull_async(1, n, out[n]) for n in out}
    deadline = time.monotonic() + 10
    while not all(h.done() for h in pulls.values()):
        assert time.monotonic() < deadline, "pull handles not done within 10 s"
        time.sleep(0.01)
    for n, h in pulls.items():
        h.wait()
        assert np.array_equal(out[n], ref[n] - 1.0), n
    w.finish()


@pytest.mark.cluster(workers=1, servers=1, sync="bsp", optimizer="sgd", lr=0.5)
def test_bad_arrays_raise_errors_naming_the_tensor(cluster):
    w = cluster.connect()
    good = {"enc.weight": np.zeros((4, 6), np.float32), "enc.bias": np.zeros(4, np.float32)}
    with pytest.raises(elasticps.ElasticpsError, match="register_model first"):
        w.pull(0, good)
    with pytest.raises(TypeError, match=r'"enc\.weight".*float32.*float64'):
        w.register_model({"enc.weight": np.zeros((4, 6))})
    w.register_model(good)

    with pytest.raises(TypeError, match=r'"enc\.weight".*dtype float64'):
        w.push(0, {"enc.weight": np.ones((4, 6))})
    with pytest.raises(TypeError, match=r'"enc\.weight".*non-contiguous'):
        w.push(0, {"enc.weight": np.ones((6, 4), np.float32).T})
    with pytest.raises(TypeError, match=r'"enc\.weight".*non-contiguous'):
        w.pull(0, {"enc.weight": np.zeros((4, 12), np.float32)[:, ::2]})
    with pytest.raises(TypeError, match=r'"enc\.bias".*numpy array, got a list'):
        w.push(0, {"enc.bias": [0.0, 0.0, 0.0, 0.0]})
    with pytest.raises(ValueError, match=r'"enc\.bias" holds 5 values.*holds 4'):
        w.pull(0, {"enc.bias": np.zeros(5, np.float32)})
    with pytest.raises(ValueError, match=r'"enc\.bias" holds 3 values'):
        w.push_async(0, "enc.bias", np.zeros(3, np.float32))
    with pytest.raises(KeyError, match=r'"dec\.weight"'):
        w.pull(0, {"dec.weight": np.zeros(4, np.float32)})
    with pytest.raises(KeyError, match=r'"dec\.weight"'):
        w.push_async(0, "dec.weight", np.zeros(4, np.float32))
    frozen = np.zeros((4, 6), np.float32)
    frozen.setflags(write=False)
    with pytest.raises(ValueError, match=r'"enc\.weight" is read-only'):
        w.pull(0, {"enc.weight": frozen})
    with pytest.raises(ValueError, match=r'"enc\.weight" is read-only'):
        w.pull_async(0, "enc.weight", frozen)

    # None of that sent anything: the job is still at clock 0 and works. A read-only
    # array is fine to push from.
    w.push(0, {"enc.weight": frozen + 2, "enc.bias": np.ones(4, np.float32)})
    w.pull(1, good)
    assert np.array_equal(good["enc.weight"], np.full((4, 6), -1.0, np.float32))
    assert np.array_equal(good["enc.bias"], np.full(4, -0.5, np.float32))
    w.finish()


@pytest.mark.cluster(workers=1, servers=1, sync="bsp", optimizer="sgd", lr=0.5)
def test_a_forked_child_gets_an_error_and_the_parent_still_works(cluster):
    w = cluster.connect()
    params = {"w": np.arange(8, dtype=np.float32)}
    w.register_model(params)
    handle = w.push_async(0, "w", np.ones(8, np.float32))
    r, wr = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12+ warns about fork in a multi-threaded process: that is the point.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: report what happened and leave without running pytest's code
        report = {}
        try:
            for what, call in [
                ("pull", lambda: w.pull(1, params)),
                ("wait", handle.wait),
                ("push_async", lambda: w.push_async(1, "w", np.ones(8, np.float32))),
            ]:
                try:
                    call()
                    report[what] = "no error"
                except elasticps.ElasticpsError as e:
                    report[what] = str(e)
                except BaseException as e:  # noqa: BLE001 - anything else is a failure to report
                    report[what] = f"{type(e).__name__}: {e}"
            os.write(wr, json.dumps(report).encode())
        finally:
            os._exit(0)
    os.close(wr)
    deadline = time.monotonic() + 10
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child did not exit within 10 s (a deadlock?)")
        time.sleep(0.02)
    report = json.loads(os.read(r, 1 << 16).decode())
    os.close(r)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    for what, message in report.items():
        assert "fork" in message and f"pid {os.getpid()}" in message, (what, message)
    handle.wait()
    w.pull(1, params)
    assert np.array_equal(params["w"], np.arange(8, dtype=np.float32) - 0.5)
    w.finish()


@pytest.mark.cluster(workers=2, servers=1, sync="bsp", optimizer="sgd", lr=0.5)
def test_ctrl_c_interrupts_a_held_pull(cluster):
    w = cluster.connect()
    params = {"w": np.zeros(16, np.float32)}
    child = cluster.spawn_worker(CHILD, shapes(params))
    w.register_model(params)
    read_line(child, 20, "the second worker's arrays after register_model")
    w.push(0, {"w": np.full(16, 2.0, np.float32)})

    # bsp: clock 1 needs the second worker's push of clock 0, which it does not send.
    def interrupt():
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGINT)

    # Python raises KeyboardInterrupt on SIGINT unless it started with SIGINT ignored (a
    # background job of a non-interactive shell, as CI may be): install the handler an
    # interactive user has.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    t = threading.Thread(target=interrupt)
    started = time.monotonic()
    t.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            w.pull(1, params)
    finally:
        t.join(5)
        signal.signal(signal.SIGINT, previous)
    elapsed = time.monotonic() - started
    assert 0.9 <= elapsed < 4.0, f"KeyboardInterrupt after {elapsed:.2f} s"

    # The interrupted pull was cancelled (test_sound.py checks that it never writes the
    # array afterwards); the worker keeps working.
    child.stdin.write("push 0 4\n")
    child.stdin.flush()
    assert read_line(child, 20, "the second worker's push").strip() == "pushed"
    w.pull(1, params)
    assert np.array_equal(params["w"], np.full(16, -3.0, np.float32))
    finish_child(cluster, child)
    w.finish()


@pytest.mark.cluster(workers=1, servers=2, sync="bsp", optimizer="sgd", lr=0.5, block_bytes=64)
def test_a_killed_server_makes_the_next_call_fail_naming_it(cluster, monkeypatch):
    monkeypatch.setenv("ELASTICPS_REQUEST_TIMEOUT", "2")
    w = cluster.connect()
    params = model()
    w.register_model(params)
    grads = {n: np.ones_like(a) for n, a in params.items()}
    w.push_pull(0, grads, params)
    index, addr = cluster.server_identity(1)
    cluster.kill(cluster.servers[1])
    started = time.monotonic()
    with pytest.raises(elasticps.ElasticpsError) as err:
        for clock in range(1, 50):  # bounded: the first call after the kill should fail
            w.push_pull(clock, grads, params)
    elapsed = time.monotonic() - started
    message = str(err.value)
    # The client sees the connection close, or the scheduler's shutdown saying which
    # server is gone ("server 1 (127.0.0.1:port) is gone"), whichever comes first.
    assert re.search(rf"server {index}\b", message) and "clock" in message, message
    assert addr in message or "closed the connection" in message, message
    assert elapsed < 15, f"the error came after {elapsed:.1f} s"
