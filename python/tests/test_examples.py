"""The examples in examples/python, run as two real worker processes against a real
cluster (a short run each: the full runs are in the README and docs/BENCHMARKS.md)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import REPO, worker_env

EXAMPLES = REPO / "examples" / "python"


def run_workers(cluster, script, *args, n=2, timeout=90.0):
    """Runs `script` as `n` worker processes of `cluster`; returns their outputs."""
    procs = []
    for i in range(n):
        log = cluster.tmp / f"example{i}.out"
        with open(log, "wb") as out:
            p = cluster.popen(
                [sys.executable, str(EXAMPLES / script), *args],
                f"example{i}.err",
                stdout=out,
                env=worker_env({"ELASTICPS_SCHEDULER": cluster.addr}),
            )
        procs.append((p, log))
    outputs = []
    for i, (p, log) in enumerate(procs):
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"timed out after {timeout} s waiting for worker process {i} of {script}")
        text = log.read_text()
        assert rc == 0, f"worker process {i} of {script} exited with {rc}:\n{text}\n{cluster.log(f'example{i}.err')}"
        outputs.append(text)
    return outputs


def accuracy(outputs):
    found = [float(m.group(1)) for out in outputs for m in re.finditer(r"^test accuracy (\d+\.\d\d)%$", out, re.M)]
    assert len(found) == 1, f"expected one 'test accuracy' line (rank 0's): {outputs}"
    return found[0]


@pytest.mark.cluster(workers=2, servers=2, sync="ssp:2")
def test_numpy_loop(cluster):
    outputs = run_workers(cluster, "numpy_loop.py", "--epochs", "2")
    assert accuracy(outputs) > 85.0
    text = "".join(outputs)
    for rank in range(2):  # 5000 examples per shard, 78 batches of 64 per epoch
        assert f"rank {rank}: 156 iterations" in text, text


@pytest.mark.deadline(120)
@pytest.mark.cluster(workers=2, servers=2, sync="ssp:2")
def test_train_mnist_torch_one_epoch(cluster):
    outputs = run_workers(cluster, "train_mnist_torch.py", "--epochs", "1")
    assert accuracy(outputs) > 90.0


def test_train_mnist_torch_needs_a_scheduler_or_local():
    env = worker_env()
    env.pop("ELASTICPS_SCHEDULER", None)
    p = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_mnist_torch.py")], env=env, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 2 and "elasticps launch" in p.stderr and "--local" in p.stderr
