"""Fixtures for the Python tests: a real elasticps cluster (a scheduler and N server
processes of the `elasticps` binary) per test, and helpers to join it as a worker from the
test process or from a second Python process.

A test chooses the job's flags with a marker::

    @pytest.mark.cluster(workers=2, servers=2, sync="bsp", optimizer="sgd", lr=0.5)
    def test_something(cluster):
        w = cluster.connect()            # a worker in this process
        other = cluster.spawn_worker(CODE)

Keyword names are the scheduler's flags with ``_`` for ``-``; ``True`` passes a bare flag
(``aggregate=True`` -> ``--aggregate``), a list repeats the flag. The binary is
``$ELASTICPS_BIN``, else ``<repo>/target/debug/elasticps``.

Every test runs under a deadline (``@pytest.mark.deadline(seconds)``, default 120 s): a
SIGALRM raises ``TimeoutError`` in the test, which interrupts any elasticps wait (they
check for signals every 100 ms), so teardown still kills the cluster. Every process a
fixture starts is killed by PID at teardown, and on Linux also dies with the test process
(``PR_SET_PDEATHSIG``), so not even a killed pytest leaves an orphan.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
from testnet import CAN_DIE_WITH_PARENT, die_with_parent

REPO = Path(__file__).resolve().parents[2]

#: How long the scheduler may take to print its address.
LISTEN_TIMEOUT_S = 20.0
#: How long a killed process may take to be reaped.
REAP_TIMEOUT_S = 10.0
#: Terminal colour codes (stripped from logs before matching).
ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: Default per-test deadline.
DEFAULT_DEADLINE_S = 120.0


def pytest_configure(config):
    config.addinivalue_line("markers", "cluster(**flags): job flags of the `cluster` fixture's scheduler")
    config.addinivalue_line("markers", "deadline(seconds): the test's time limit (default 120 s)")


def elasticps_bin() -> str:
    """The `elasticps` binary: ``$ELASTICPS_BIN`` or the workspace's debug build."""
    path = Path(os.environ.get("ELASTICPS_BIN", REPO / "target" / "debug" / "elasticps"))
    if not path.is_file() or not os.access(path, os.X_OK):
        pytest.exit(
            f"elasticps binary not found at {path}: build it with `cargo build -p elasticps` "
            "or point ELASTICPS_BIN at it",
            returncode=2,
        )
    return str(path)


def _flags(options: Dict[str, object]) -> List[str]:
    out: List[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            for v in value:
                out += [flag, str(v)]
        else:
            out += [flag, str(value)]
    return out


def worker_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment of a Python worker process: the package under test first on
    ``PYTHONPATH``."""
    # Where the package the tests import lives (the source tree with the built module
    # copied in, or an installed wheel): worker processes import the same one.
    import elasticps

    parent = Path(elasticps.__file__).resolve().parent.parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(parent)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.pop("ELASTICPS_EVENTS_FD", None)
    if extra:
        env.update(extra)
    return env


class Cluster:
    """A running job: the scheduler and its servers, started by the `cluster` fixture."""

    def __init__(self, tmp: Path, flags: Dict[str, object]):
        self.tmp = tmp
        self.bin = elasticps_bin()
        self.flags = dict(flags)
        self.flags.setdefault("launcher", "none")
        self.flags.setdefault("join_timeout_s", 30)
        self.procs: List[subprocess.Popen] = []
        self.servers: List[subprocess.Popen] = []
        self.events: "queue.Queue[dict]" = queue.Queue()
        self.addr = ""
        self._workers: List[object] = []

    # -- processes -------------------------------------------------------------------

    def popen(self, args: List[str], log_name: str, **kw) -> subprocess.Popen:
        """Starts a process that teardown kills (stderr into ``<tmp>/<log_name>``)."""
        log = open(self.tmp / log_name, "wb")
        kw.setdefault("stdout", log)
        try:
            p = subprocess.Popen(
                args, stderr=log, preexec_fn=die_with_parent if CAN_DIE_WITH_PARENT else None, **kw
            )
        finally:
            log.close()
        self.procs.append(p)
        return p

    def start(self) -> None:
        n_servers = int(self.flags.get("servers", 2))
        args = [self.bin, "scheduler", "--listen", "127.0.0.1:0", "--events"] + _flags(self.flags)
        sched = self.popen(args, "scheduler.log", stdout=subprocess.PIPE)
        threading.Thread(target=self._read_events, args=(sched,), daemon=True).start()
        deadline = time.monotonic() + LISTEN_TIMEOUT_S
        while not self.addr:
            left = deadline - time.monotonic()
            if left <= 0 or sched.poll() is not None:
                raise RuntimeError(
                    f"the scheduler did not print its listening address within {LISTEN_TIMEOUT_S} s "
                    f"(exit code {sched.poll()}); log: {self.log('scheduler.log')}"
                )
            try:
                ev = self.events.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if ev.get("event") == "listening":
                self.addr = ev["addr"]
        for i in range(n_servers):
            self.servers.append(self.popen([self.bin, "server", "--scheduler", self.addr], f"server{i}.log"))

    def _read_events(self, p: subprocess.Popen) -> None:
        for line in p.stdout:
            try:
                self.events.put(json.loads(line))
            except ValueError:
                pass

    def log(self, name: str) -> str:
        """The tail of a process's log, for failure messages."""
        try:
            return (self.tmp / name).read_text(errors="replace")[-5000:]
        except OSError:
            return "(no log)"

    def server_identity(self, i: int, timeout: float = 10.0) -> Tuple[int, str]:
        """The scheduler's index and the address of the `i`-th server process started
        (from its log line ``server registered server=N addr=A``)."""
        deadline = time.monotonic() + timeout
        while True:
            text = ANSI.sub("", self.log(f"server{i}.log"))
            m = re.search(r"server registered server=(\d+) addr=(\S+)", text)
            if m:
                return int(m.group(1)), m.group(2)
            if time.monotonic() > deadline:
                pytest.fail(f"server process {i} did not log its registration within {timeout} s: {text}")
            time.sleep(0.05)

    def kill(self, p: subprocess.Popen) -> None:
        """Kills `p` by PID and reaps it."""
        if p.poll() is None:
            p.kill()
        try:
            p.wait(timeout=REAP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass

    def stop(self) -> None:
        for p in reversed(self.procs):
            self.kill(p)

    # -- workers -----------------------------------------------------------------------

    def connect(self):
        """A new worker of this job in the test process (``elasticps.init`` keeps one per
        process; tests need one per cluster, so they connect directly)."""
        from elasticps import _native

        w = _native.connect(self.addr)
        self._workers.append(w)
        return w

    def spawn_worker(self, code: str, *args: str, env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
        """Runs ``python -c code args...`` as another worker process (stdin, stdout: pipes,
        text; ``ELASTICPS_SCHEDULER`` set); teardown kills it."""
        n = sum(1 for p in self.procs if p.args[:2] == [sys.executable, "-c"])
        extra = {"ELASTICPS_SCHEDULER": self.addr}
        extra.update(env or {})
        return self.popen(
            [sys.executable, "-c", code, *args],
            f"worker{n}.log",
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=worker_env(extra),
        )

    def wait_exit(self, p: subprocess.Popen, timeout: float, what: str) -> int:
        """Waits for `p` to exit; fails the test naming `what` if it does not in time."""
        try:
            return p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"timed out after {timeout} s waiting for {what} to exit")

    def __str__(self) -> str:
        return self.addr


def read_line(p: subprocess.Popen, timeout: float, what: str) -> str:
    """One line of `p`'s stdout within `timeout` seconds, else the test fails naming `what`."""
    box: "queue.Queue[str]" = queue.Queue()
    threading.Thread(target=lambda: box.put(p.stdout.readline()), daemon=True).start()
    try:
        line = box.get(timeout=timeout)
    except queue.Empty:
        pytest.fail(f"timed out after {timeout} s waiting for {what}")
    if not line:
        pytest.fail(f"the process ended (exit code {p.poll()}) before {what}")
    return line


@pytest.fixture
def cluster(request, tmp_path):
    """A real cluster with the flags of the test's ``cluster`` marker; killed at teardown."""
    marker = request.node.get_closest_marker("cluster")
    flags = dict(marker.kwargs) if marker else {}
    c = Cluster(tmp_path, flags)
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture(autouse=True)
def deadline(request):
    """Bounds every test in time (SIGALRM raises ``TimeoutError`` in the test)."""
    marker = request.node.get_closest_marker("deadline")
    seconds = float(marker.args[0]) if marker else DEFAULT_DEADLINE_S

    def expired(signum, frame):
        raise TimeoutError(f"test {request.node.name} exceeded its deadline of {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# The MNIST example, for the tests that train it under elasticps and compare with plain
# local torch. Epochs of those runs, the same for local torch and elasticps (the example's
# default is 6; 3 reach about 97% on the bundled subset and halve these tests' time).
MNIST = REPO / "examples" / "python" / "train_mnist_torch.py"
EPOCHS = "3"


def accuracy(text: str, label: str) -> float:
    """The percentage printed after ``label`` (``test accuracy 97.12%``)."""
    m = re.search(rf"{label} ([0-9.]+)%", text)
    assert m, f"no {label!r} in:\n{text}"
    return float(m.group(1))


@pytest.fixture(scope="session")
def local_accuracy() -> float:
    """The example's accuracy with plain local torch (once per session)."""
    out = subprocess.run(
        [sys.executable, str(MNIST), "--local", "--epochs", EPOCHS], capture_output=True, text=True, timeout=240, cwd=REPO
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return accuracy(out.stdout, "local test accuracy")


def alive(pid: int) -> bool:
    """Whether process `pid` runs (exists and is not a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (by /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out
