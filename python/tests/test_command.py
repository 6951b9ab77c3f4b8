"""The ``elasticps`` command that ``pip install ./python`` installs (the venv's console
script, not ``$ELASTICPS_BIN``): a launch that trains, Ctrl-C, the summary of a script
that logs no samples, and ``elasticps.init()`` outside a launch."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import MNIST, accuracy, alive, descendants


def command() -> str:
    """The console script installed beside this interpreter."""
    path = Path(sys.executable).parent / "elasticps"
    assert path.is_file(), f"pip install ./python installs no elasticps command beside {sys.executable}"
    return str(path)


def clean_env() -> dict:
    """This environment without the variables of a launch (the tests may run under one)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("ELASTICPS_")}


@pytest.mark.deadline(150)
def test_the_installed_command_launches_the_mnist_example_and_it_learns(tmp_path):
    out = subprocess.run(
        [command(), "launch", "--quiet", "--workers", "2", "--", sys.executable, str(MNIST), "--epochs", "1"],
        capture_output=True, text=True, timeout=140, cwd=tmp_path, env=clean_env(),
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    acc = accuracy(out.stdout, "test accuracy")
    print(f"1 epoch, 2 workers, launched by {command()}: {acc:.2f}%")
    assert acc >= 90.0, out.stdout[-2000:]
    # The default arithmetic under bsp is DDP's.
    assert "2 servers, 2 workers, bsp --aggregate: " in out.stdout, out.stdout[-2000:]


def test_ctrl_c_stops_a_role_run_by_the_installed_command():
    # A role has no handler of its own: Ctrl-C ends it, as it ends the binary.
    proc = subprocess.Popen(
        [command(), "scheduler", "--listen", "127.0.0.1:0", "--events"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
    )
    try:
        line = proc.stdout.readline()
        assert '"listening"' in line, "the scheduler did not say where it listens: " + proc.stderr.read()[-2000:]
        proc.send_signal(2)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            pytest.fail("the scheduler ignored Ctrl-C for 10 s")
    assert proc.returncode != 0


def test_ctrl_c_stops_a_launch_by_the_installed_command_and_every_node(tmp_path):
    script = tmp_path / "forever.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(300)\n")
    proc = subprocess.Popen(
        [command(), "launch", "--quiet", "--workers", "2", "--", sys.executable, str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
    )
    try:
        deadline = time.monotonic() + 60
        started = 0
        while started < 2:
            assert time.monotonic() < deadline, "the workers did not start within 60 s"
            line = proc.stdout.readline()
            assert line, "the launcher ended before the workers started: " + proc.stderr.read()[-2000:]
            started += "started" in line
        tree = descendants(proc.pid)
        assert len(tree) >= 5, f"scheduler, 2 servers, 2 workers: {tree}"
        proc.send_signal(2)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "interrupted: every node was stopped" in err, err[-2000:]
    assert not [p for p in tree if alive(p)], "processes left behind"


def test_a_script_that_logs_no_samples_has_unknown_throughput(tmp_path):
    script = tmp_path / "no_samples.py"
    script.write_text(
        "import numpy as np, elasticps\n"
        "w = elasticps.init()\n"
        "p = {'w': np.zeros(8, np.float32)}\n"
        "w.register_model(p)\n"
        "for t in range(3):\n"
        "    w.push_pull(t, {'w': np.ones(8, np.float32)}, p)\n"
        "elasticps.finish()\n"
    )
    out = subprocess.run(
        [command(), "launch", "--quiet", "--workers", "2", "--", sys.executable, str(script)],
        capture_output=True, text=True, timeout=120, env=clean_env(),
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "bsp --aggregate: unknown samples/s" in out.stdout, out.stdout


def test_init_outside_launch_says_how_to_run_the_script():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    # Nothing listens there any more.
    env = dict(clean_env(), ELASTICPS_SCHEDULER=addr)
    out = subprocess.run(
        [sys.executable, "-c", "import elasticps; elasticps.init()"], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode != 0
    assert f"no elasticps scheduler at {addr} (connection refused)" in out.stderr, out.stderr[-2000:]
    assert "elasticps launch --workers N -- python script.py" in out.stderr, out.stderr[-2000:]
    assert "ELASTICPS_SCHEDULER" in out.stderr
