"""Test hosts for pytest: network namespaces on a bridge, made by ``scripts/testnet``.

Standard library only (plus pytest for ``require_root``)::

    from testnet import require_root, testbed

    def test_two_hosts():
        require_root()
        with testbed(2, "ept", aliases={1: ["n1"]}) as (a, b):
            srv = a.popen(["python3", "-m", "http.server", "8000"])
            b.cap(100)                      # b's link: 100 Mbit/s both ways (tc tbf)
            ...
            b.link(False)                   # b is lost
            b.link(True)

``testbed`` always tears the bed down on exit, also on an exception or KeyboardInterrupt,
and first kills (SIGKILL, by process group) every process started with ``Host.popen``
that is still running. Inside a host, the bed's names (``ept1``, aliases) resolve through a
private ``/etc/hosts``; ``/sys`` is not remounted (see ``scripts/testnet``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Union

REPO = Path(__file__).resolve().parents[2]
TESTNET = REPO / "scripts" / "testnet"

ROOT_MESSAGE = "needs root (network namespaces)"


def require_root() -> None:
    """Skip the test when not root; fail it instead when CI is "true" (CI must run it)."""
    import pytest

    if os.geteuid() == 0:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(ROOT_MESSAGE)
    pytest.skip(ROOT_MESSAGE)


def _testnet(*args: str, capture: bool = False) -> str:
    r = subprocess.run(
        [str(TESTNET), *args],
        stdout=subprocess.PIPE if capture else subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    if r.returncode != 0:
        raise RuntimeError(f"scripts/testnet {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout if capture else ""


def _load_prctl():
    """libc's prctl, loaded here in the parent: the child between fork and exec must not
    load libraries (another thread may hold the loader's lock at fork time)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return prctl


_PRCTL = _load_prctl() if sys.platform.startswith("linux") else None
_PR_SET_PDEATHSIG = 1
#: Whether ``die_with_parent`` works here (Linux).
CAN_DIE_WITH_PARENT = _PRCTL is not None


def die_with_parent() -> None:
    """A ``preexec_fn``: in the child before exec, ask for SIGKILL when the process that
    started it dies (Linux), so not even a killed test or benchmark leaves an orphan."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


class Host:
    """One namespace host of a test bed."""

    def __init__(self, name: str, ip: str, procs: Optional[List[subprocess.Popen]] = None):
        self.name = name
        self.ip = ip
        self._procs = procs if procs is not None else []

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.ip!r})"

    def argv(self, argv: Sequence[str]) -> List[str]:
        """The command line that runs ``argv`` on this host."""
        return [str(TESTNET), "exec", self.name, "--", *map(str, argv)]

    def popen(self, argv: Sequence[str], **kw) -> subprocess.Popen:
        """Start ``argv`` on this host. Its PID is the command's own (exec chain), and it
        leads a new session, so ``os.killpg(p.pid, sig)`` reaches all it started."""
        kw.setdefault("start_new_session", True)
        if CAN_DIE_WITH_PARENT:
            kw.setdefault("preexec_fn", die_with_parent)
        p = subprocess.Popen(self.argv(argv), **kw)
        self._procs.append(p)
        return p

    def run(self, argv: Sequence[str], **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` on this host to completion (``subprocess.run`` keywords)."""
        return subprocess.run(self.argv(argv), **kw)

    def cap(self, mbit: int) -> None:
        """Cap this host's link to ``mbit`` Mbit/s in both directions (tc tbf)."""
        _testnet("cap", self.name, str(int(mbit)))

    def uncap(self) -> None:
        _testnet("uncap", self.name)

    def link(self, up: bool) -> None:
        """Set this host's link up or down (down: the host is lost to the others)."""
        _testnet("link", self.name, "up" if up else "down")


def _kill_all(procs: Iterable[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                try:
                    p.kill()
                except ProcessLookupError:
                    pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


@contextmanager
def testbed(
    n: int,
    prefix: str = "ept",
    aliases: Optional[Mapping[int, Union[str, Sequence[str]]]] = None,
) -> Iterator[List[Host]]:
    """Hosts ``{prefix}1..{prefix}n`` for the duration of the block.

    ``aliases`` maps a host's number (from 1) to one extra name or a list of them, e.g.
    ``{1: "n1", 2: ["n2", "elasticps-1.elasticps"]}``. The prefix is at most 6 characters;
    tests running at the same time need different prefixes.
    """
    args = ["up", str(n), "--prefix", prefix]
    for i, names in (aliases or {}).items():
        for name in [names] if isinstance(names, str) else names:
            args += ["--alias", f"{i}={name}"]
    procs: List[subprocess.Popen] = []
    try:
        out = _testnet(*args, capture=True)
        hosts = [Host(name, ip, procs) for name, ip in (line.split() for line in out.splitlines() if line.strip())]
        if len(hosts) != n:
            raise RuntimeError(f"scripts/testnet up {n} printed {len(hosts)} hosts: {out!r}")
        yield hosts
    finally:
        try:
            _kill_all(procs)
        finally:
            subprocess.run([str(TESTNET), "down", "--prefix", prefix], stdout=subprocess.DEVNULL)


# `from testnet import testbed` in a test module must not make pytest collect it as a test
testbed.__test__ = False  # type: ignore[attr-defined]
