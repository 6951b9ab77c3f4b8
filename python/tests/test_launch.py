"""`elasticps launch -- python ...` end to end: real processes, real TCP, real training."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import elasticps_bin as binary

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parent / "workers" / "numpy_worker.py"
from conftest import EPOCHS, MNIST, accuracy, alive, descendants  # noqa: E402


def launch(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([binary(), "launch", "--quiet", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.deadline(300)
def test_mnist_under_ssp_learns_as_well_as_local_torch(local_accuracy, tmp_path):
    out = launch(["--workers", "2", "--sync", "ssp:2", "--report", str(tmp_path), "--", sys.executable, str(MNIST), "--epochs", EPOCHS])
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    acc = accuracy(out.stdout, "test accuracy")
    print(f"elasticps ssp:2, 2 workers: {acc:.2f}%; plain local torch: {local_accuracy:.2f}%")
    assert acc >= 95.0
    assert abs(acc - local_accuracy) <= 1.0
    assert (tmp_path / "report.json").exists() and (tmp_path / "curves.png").exists()


@pytest.mark.deadline(300)
def test_mnist_with_psld_moves_blocks_off_a_slow_server(local_accuracy, tmp_path):
    import json

    out = launch([
        "--workers", "2", "--sync", "ssp:2", "--balance", "psld", "--server-bandwidth", "1=20",
        "--max-servers", "3", "--report", str(tmp_path), "--", sys.executable, str(MNIST),
        "--epochs", EPOCHS,
    ])
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    acc = accuracy(out.stdout, "test accuracy")
    report = json.loads((tmp_path / "report.json").read_text())
    moved = [m for m in report["balance"]["migrations"] if m.get("error") is None]
    print(f"psld: {len(moved)} migrations, accuracy {acc:.2f}% (local {local_accuracy:.2f}%)")
    assert len(moved) >= 1, report["balance"]
    assert acc >= 95.0 and abs(acc - local_accuracy) <= 1.0


def test_a_killed_python_worker_ends_the_job_naming_it_with_no_orphans():
    proc = subprocess.Popen(
        [binary(), "launch", "--quiet", "--workers", "2", "--", sys.executable, str(WORKER), "100000", "0.01"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 60
        started = 0
        while started < 2:
            assert time.monotonic() < deadline, "the workers did not start within 60 s"
            line = proc.stdout.readline()
            assert line, "the launcher ended before the workers started"
            started += "started" in line
        tree = descendants(proc.pid)
        workers = [p for p in tree if "numpy_worker.py" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")]
        assert len(workers) == 2, workers
        victim = max(workers)
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert re.search(rf"worker \d \(pid {victim}: .*numpy_worker\.py.*\) was killed by signal 9", err), err[-3000:]
    left = [p for p in tree if alive(p)]
    assert not left, f"processes left behind: {left}"


def test_metrics_of_every_server_count_pushes_during_a_run():
    proc = subprocess.Popen(
        [binary(), "launch", "--quiet", "--metrics", "--workers", "2", "--", sys.executable, str(WORKER), "3000", "0.002"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        urls = None
        deadline = time.monotonic() + 60
        while urls is None:
            assert time.monotonic() < deadline, "no metrics line within 60 s"
            line = proc.stdout.readline()
            assert line, "the launcher ended before it printed where to scrape"
            if line.startswith("metrics: "):
                urls = dict(re.findall(r"(\w+ \d+|scheduler) (http://\S+/metrics)", line))
        servers = {k: v for k, v in urls.items() if k.startswith("server")}
        assert len(servers) == 2 and any(k.startswith("worker") for k in urls), urls
        pushes = {}
        while not all(pushes.get(k, 0) > 0 for k in servers):
            assert time.monotonic() < deadline, f"push counters stayed at {pushes}"
            assert proc.poll() is None, "the job ended before every server counted a push"
            for name, url in servers.items():
                text = urllib.request.urlopen(url, timeout=5).read().decode()
                m = re.search(r"^elasticps_server_pushes_total\S* (\d+)", text, re.M)
                pushes[name] = int(m.group(1)) if m else 0
            time.sleep(0.2)
        worker_text = urllib.request.urlopen(urls["worker 0"], timeout=5).read().decode()
        assert "elasticps_worker_iterations_total" in worker_text
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_a_script_that_forgets_finish_still_ends_the_job_cleanly(tmp_path):
    script = tmp_path / "no_finish.py"
    script.write_text(
        "import numpy as np, elasticps\n"
        "w = elasticps.init()\n"
        "p = {'w': np.zeros(8, np.float32)}\n"
        "w.register_model(p)\n"
        "w.push_pull(0, {'w': np.ones(8, np.float32)}, p)\n"
        "print('trained', flush=True)\n"
    )
    out = launch(["--workers", "2", "--", sys.executable, str(script)], timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.count("trained") == 2


def dies_once(tmp_path: Path, death: str, steps: int, logs: bool) -> Path:
    """A worker script whose rank 1 dies by `death` at step 30 of its first life (a
    restarted one has ELASTICPS_RANK) and says where each life starts; `logs`: it logs
    every step (the launcher's progress bars)."""
    log = f"    elasticps.log(step=t + 1, total={steps}, loss=float(p['w'][0]))\n" if logs else ""
    script = tmp_path / "dies_once.py"
    script.write_text(
        "import os, numpy as np, elasticps\n"
        "w = elasticps.init()\n"
        "p = {'w': np.zeros(64, np.float32)}\n"
        "w.register_model(p)\n"
        "restarted = 'ELASTICPS_RANK' in os.environ\n"
        "print(f'rank {w.rank} starts at {w.start_clock} restarted {restarted}', flush=True)\n"
        f"for t in range(w.start_clock, {steps}):\n"
        "    if w.rank == 1 and not restarted and t == 30:\n"
        f"        {death}\n"
        "    w.push_pull(t, {'w': np.full(64, 0.01, np.float32)}, p)\n"
        f"{log}"
        "elasticps.finish()\n"
    )
    return script


def test_a_python_worker_that_dies_is_restarted_with_its_rank_and_the_job_completes(tmp_path):
    # Rank 1 dies at step 30 of its first life (kill -9 would do the same); the launcher
    # restarts it with ELASTICPS_RANK=1, and it goes on from where the job is.
    script = dies_once(tmp_path, "os._exit(9)", steps=200, logs=True)
    out = launch(["--workers", "2", "--sync", "ssp:2", "--restart-workers", "1", "--", sys.executable, str(script)], timeout=180)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "restarting it as rank 1" in out.stderr, out.stderr[-3000:]
    m = re.search(r"rank 1 starts at (\d+) restarted True", out.stdout)
    assert m and int(m.group(1)) >= 30, out.stdout[-2000:]


@pytest.mark.parametrize("restarts", [0, 1], ids=["no-restart", "restarted"])
def test_a_script_that_raises_is_not_counted_finished(tmp_path, restarts):
    # Rank 1's script raises at step 30 of its first life. The exception escapes it, so
    # the interpreter's exit leaves the job without WorkerDone (`Worker.abandon`; a script
    # that ends well finishes at exit): the job counts the worker lost, not done. Without a
    # restart the job fails naming it; with one, it is started again and the job
    # completes. Before, it counted as finished: the launcher failed the job instead of
    # restarting it, and across hosts it was never restarted and its pushes silently
    # stopped counting (the job ended 0). The script logs nothing: the launcher learns
    # its rank from its `joined` event line.
    script = dies_once(tmp_path, "raise RuntimeError('the data loader broke')", steps=100, logs=False)
    out = launch(["--workers", "2", "--sync", "bsp", "--restart-workers", str(restarts), "--",
                  sys.executable, str(script)], timeout=180)
    text = out.stdout[-2000:] + out.stderr[-3000:]
    assert "RuntimeError: the data loader broke" in out.stderr, text
    if restarts:
        assert out.returncode == 0, text
        assert "restarting it as rank 1" in out.stderr, text
        assert re.search(r"rank 1 starts at (\d+) restarted True", out.stdout), text
    else:
        assert out.returncode != 0, text
        assert "the job ended without worker 1" in out.stderr, text
