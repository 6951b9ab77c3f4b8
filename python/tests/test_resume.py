"""Resuming a Python job from a checkpoint, against real processes: the same torch script
run on a job started with ``--resume DIR`` goes on from the checkpoint's clock
(``Worker.start_clock``, ``DistributedOptimizer.clock``) and ends with exactly the
parameters of the uninterrupted job; a model of another shape is refused, saying why."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from typing import Callable, Dict, List

import numpy as np
import pytest
import torch

import elasticps
from conftest import Cluster, read_line

#: Every job here takes seconds (a torch import per worker process is most of it).
pytestmark = pytest.mark.deadline(150)

#: Steps of the script, and the checkpoint period: checkpoints at clocks 3 and 6.
STEPS = 8
EVERY = 3
LATEST = STEPS // EVERY * EVERY
#: Under bsp with the aggregate the servers sum the two workers' gradients before they
#: apply them, and a sum of two floats does not depend on their order: the comparison is
#: exact.
JOB = dict(workers=2, servers=2, sync="bsp", aggregate=True, block_bytes=64)
#: How long a worker may take to import torch, join and register, or to train.
STEP_TIMEOUT_S = 60.0
#: How long the latest checkpoint may take to complete after the workers trained past it.
CHECKPOINT_TIMEOUT_S = 30.0

#: The user's script: a torch model trained through DistributedOptimizer (SGD with
#: momentum, so the optimizer's state is in the checkpoint too), on batches drawn per
#: (rank, step), skipping those of the steps before the checkpoint as a resuming PyTorch
#: loop does. Prints its clocks and parameters (bytes, in hex) after registering, its
#: parameters after training, and finishes when the test writes a line on its stdin.
TRAIN = r"""
import json, sys
import torch
import elasticps, elasticps.torch
steps = int(sys.argv[1])
torch.set_num_threads(1)
w = elasticps.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
opt = elasticps.torch.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model.named_parameters())
def params():
    return {n: p.detach().numpy().tobytes().hex() for n, p in model.named_parameters()}
print(json.dumps({"rank": w.rank, "start_clock": w.start_clock, "clock": opt.clock, "params": params()}), flush=True)
loss_fn = torch.nn.CrossEntropyLoss()
for step in range(w.start_clock, steps):
    g = torch.Generator().manual_seed(1000 * w.rank + step)
    x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()
    assert opt.clock == step + 1, (opt.clock, step)
print(json.dumps({"clock": opt.clock, "params": params()}), flush=True)
sys.stdin.readline()
elasticps.finish()
print("finished", flush=True)
"""


def complete_checkpoints(d: Path) -> List[str]:
    """The checkpoints of `d` that have their manifest, oldest first."""
    return sorted(p.parent.name for p in d.glob("ckpt-*/MANIFEST.json"))


def line(c: Cluster, p: subprocess.Popen, i: int, what: str) -> dict:
    """The next JSON line of worker process `i`; a failure shows its log."""
    try:
        return json.loads(read_line(p, STEP_TIMEOUT_S, what))
    except pytest.fail.Exception as e:
        pytest.fail(f"{e}\nworker {i}'s log:\n{c.log(f'worker{i}.log')}\nscheduler:\n{c.log('scheduler.log')}")


def run_job(tmp: Path, name: str, flags: Dict[str, object], before_finish: Callable[[Cluster], None]):
    """Runs the script on a new cluster of 2 workers; returns each process's two JSON
    lines (after registering, after training), in the order the processes started."""
    (tmp / name).mkdir()
    c = Cluster(tmp / name, {**JOB, **flags})
    try:
        c.start()
        procs = [c.spawn_worker(TRAIN, str(STEPS)) for _ in range(2)]
        starts = [line(c, p, i, f"worker {i} of the {name} job to register") for i, p in enumerate(procs)]
        ends = [line(c, p, i, f"worker {i} of the {name} job to train") for i, p in enumerate(procs)]
        before_finish(c)
        for i, p in enumerate(procs):
            p.stdin.write("finish\n")
            p.stdin.flush()
        for i, p in enumerate(procs):
            assert read_line(p, STEP_TIMEOUT_S, f"worker {i} of the {name} job to finish").strip() == "finished"
            assert c.wait_exit(p, STEP_TIMEOUT_S, f"worker {i} of the {name} job") == 0
        return starts, ends
    finally:
        c.stop()


def test_a_resumed_torch_job_ends_with_the_parameters_of_the_uninterrupted_one(tmp_path):
    ckpt = tmp_path / "ckpt"
    latest = f"ckpt-{LATEST:010d}"

    def wait_for_latest_checkpoint(c: Cluster) -> None:
        # The job does not wait for a checkpoint under way when its workers finish.
        deadline = time.monotonic() + CHECKPOINT_TIMEOUT_S
        while latest not in complete_checkpoints(ckpt):
            if time.monotonic() > deadline:
                pytest.fail(
                    f"checkpoint {latest} not complete within {CHECKPOINT_TIMEOUT_S} s "
                    f"(complete: {complete_checkpoints(ckpt)}); scheduler:\n{c.log('scheduler.log')}"
                )
            time.sleep(0.05)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    initial = {n: p.detach().numpy().tobytes().hex() for n, p in model.named_parameters()}

    flags = dict(checkpoint_dir=str(ckpt), checkpoint_every=EVERY)
    starts, whole = run_job(tmp_path, "whole", flags, wait_for_latest_checkpoint)
    assert sorted(s["rank"] for s in starts) == [0, 1]
    assert all(s["start_clock"] == 0 and s["clock"] == 0 for s in starts), starts
    assert all(s["params"] == initial for s in starts), "a fresh job starts from rank 0's values"
    assert all(e["clock"] == STEPS for e in whole), whole
    assert whole[0]["params"] == whole[1]["params"], "both workers hold the same final model"
    assert whole[0]["params"] != initial, "the job trained"
    assert complete_checkpoints(ckpt)[-1] == latest

    starts, resumed = run_job(tmp_path, "resumed", dict(resume=str(ckpt)), lambda c: None)
    for s in starts:
        assert s["start_clock"] == LATEST, f"the job went on from the checkpoint's clock: {starts}"
        assert s["clock"] == LATEST, f"the optimizer's clock starts at the checkpoint's: {starts}"
        # register_model wrote the checkpoint's values over the script's initial ones.
        assert s["params"] != initial
        assert s["params"] not in (initial, whole[0]["params"])
    for e in resumed:
        assert e["clock"] == STEPS
        assert e["params"] == whole[0]["params"], "the resumed job ends exactly where the uninterrupted one did"



def test_a_resumed_job_refuses_a_model_of_another_shape(tmp_path):
    ckpt = tmp_path / "ckpt"

    # A numpy job of one tensor, checkpointed at clock 2.
    (tmp_path / "first").mkdir()
    c = Cluster(tmp_path / "first", {**JOB, "workers": 1, "checkpoint_dir": str(ckpt), "checkpoint_every": 2})
    try:
        c.start()
        w = c.connect()
        assert w.start_clock == 0
        params = {"w": np.arange(40, dtype=np.float32)}
        w.register_model(params)
        snapshot = None
        for t in range(3):
            w.push_pull(t, {"w": np.arange(40, dtype=np.float32) % 3}, params)
            if t == 1:
                snapshot = params["w"].copy()  # the parameters of clock 2
        final = params["w"].copy()
        deadline = time.monotonic() + CHECKPOINT_TIMEOUT_S
        while "ckpt-0000000002" not in complete_checkpoints(ckpt):
            assert time.monotonic() < deadline, f"no checkpoint within {CHECKPOINT_TIMEOUT_S} s: {c.log('scheduler.log')}"
            time.sleep(0.05)
        w.finish()
    finally:
        c.stop()
    assert complete_checkpoints(ckpt) == ["ckpt-0000000002"]

    # The same model resumes: its arrays get the checkpoint's values (no Init is sent: the
    # servers would refuse it).
    (tmp_path / "same").mkdir()
    c = Cluster(tmp_path / "same", {**JOB, "workers": 1, "resume": str(ckpt)})
    try:
        c.start()
        w = c.connect()
        assert w.start_clock == 2
        assert "resumed at clock 2" in repr(w)
        params = {"w": np.full(40, -7.0, np.float32)}
        w.register_model(params)
        assert not np.array_equal(snapshot, np.arange(40, dtype=np.float32)), "the job trained"
        np.testing.assert_array_equal(params["w"], snapshot)
        # It goes on from there like the uninterrupted job.
        w.push_pull(2, {"w": np.arange(40, dtype=np.float32) % 3}, params)
        np.testing.assert_array_equal(params["w"], final)
        w.finish()
    finally:
        c.stop()

    # Another model (twice as many values: twice the blocks) is refused, saying why.
    (tmp_path / "other").mkdir()
    c = Cluster(tmp_path / "other", {**JOB, "workers": 1, "resume": str(ckpt)})
    try:
        c.start()
        w = c.connect()
        assert w.start_clock == 2
        with pytest.raises(elasticps.ElasticpsError, match="resume with the same model and --block-bytes") as e:
            w.register_model({"w": np.zeros(80, np.float32)})
        assert re.search(r"checkpoint of clock 2 holds \d+ blocks", str(e.value)), str(e.value)
    finally:
        c.stop()
