"""Across hosts for real: `elasticps launch --nnodes N --rdzv IP:29400` on every host of a
test bed of network namespaces (scripts/testnet), real TCP across a bridge.

These tests need root (they make namespaces): they skip elsewhere, and fail in CI
(`CI=true`) instead of skipping.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Sequence

import pytest

from conftest import REPO, accuracy, descendants
from conftest import elasticps_bin as binary
from testnet import Host, require_root, testbed

SECRET = "hosts-test-secret"
PORT = 29400


def env() -> dict:
    e = dict(os.environ)
    e["ELASTICPS_SECRET"] = SECRET
    e.pop("ELASTICPS_SCHEDULER", None)
    return e


def launch_on(host: Host, rdzv: Host, nnodes: str, flags: Sequence[str], command: Sequence[str], log: Path) -> subprocess.Popen:
    """`elasticps launch` on `host`, its stdout and stderr into `log`."""
    argv = [binary(), "launch", "--quiet", "--nnodes", nnodes, "--rdzv", f"{rdzv.ip}:{PORT}", "--node-name", host.name, *flags, "--", *command]
    f = open(log, "w")
    return host.popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env(), text=True)


def wait_all(procs: List[subprocess.Popen], logs: List[Path], timeout: float) -> List[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for p, log in zip(procs, logs):
        left = deadline - time.monotonic()
        try:
            codes.append(p.wait(timeout=max(left, 1)))
        except subprocess.TimeoutExpired:
            text = "\n".join(f"--- {l.name}\n{l.read_text()[-3000:]}" for l in logs)
            pytest.fail(f"{log.name} did not end within {timeout:.0f} s:\n{text}")
    return codes


def lose(host: Host, launch: subprocess.Popen) -> None:
    """The host dies: its link, then its launch and everything under it (its peers see
    silence, no close)."""
    host.link(False)
    os.killpg(launch.pid, signal.SIGKILL)
    for pid in descendants(launch.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def show(logs: List[Path]) -> str:
    return "\n".join(f"--- {l.name}\n{l.read_text()[-4000:]}" for l in logs)


def check_exact(values: dict, restarted: List[str], workers: int, steps: int) -> None:
    """Every rank's pushes counted once: a rank that ran to the end pushed 1.0 at every
    clock; a restarted one ("restarted rank R at clock C holds H") pushed some clocks in
    its first life (a round it died in may have reached one block of w{R} and not the
    other: --block-bytes 32 cuts it in two) and every clock from C on in its second."""
    lives = {}
    for line in restarted:
        words = line.split()
        rank, clock = int(words[words.index("rank") + 1]), int(words[words.index("clock") + 1])
        lives[rank] = (clock, json.loads(line.split(" holds ", 1)[1]))
    for r in range(workers):
        got = values[f"w{r}"]
        if r in lives:
            clock, held = lives[r]
            assert all(h == int(h) and -clock <= h <= 0 for h in held), (r, clock, held)
            assert got == [h - (steps - clock) for h in held], (r, got, clock, held)
        else:
            assert got == [-float(steps)] * 16, (r, got[:3])


@pytest.mark.deadline(420)
def test_the_kubernetes_manifest_trains_the_mnist_example_on_four_hosts_as_well_as_local_torch(local_accuracy, tmp_path):
    """No Kubernetes API server can be had here: each pod's command line and environment
    are read from deploy/kubernetes/elasticps.yaml and run exactly, on namespace hosts
    named like the pods (`elasticps-0.elasticps.default.svc.cluster.local` resolves to
    host 1), with `elasticps` and `python3` on PATH as in the image. The manifest's
    command is `elasticps launch --nnodes 4 --rdzv <pod 0>:29400 ... -- python3
    examples/python/train_mnist_torch.py` on every pod."""
    require_root()
    from k8s_manifest import pod_commands

    pods = pod_commands(REPO / "deploy" / "kubernetes" / "elasticps.yaml", secret=SECRET)
    assert len(pods) == 4
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "elasticps").symlink_to(binary())
    (bin_dir / "python3").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    (bin_dir / "python3").chmod(0o755)
    aliases = {i + 1: [pod.dns_name, pod.name] for i, pod in enumerate(pods)}
    with testbed(4, "ephm", aliases=aliases) as hosts:
        logs = [tmp_path / f"{pod.name}.log" for pod in pods]
        procs = []
        for host, pod, log in zip(hosts, pods, logs):
            e = env()
            e.update(pod.env)
            e["PATH"] = f"{bin_dir}:{e.get('PATH', '')}"
            argv = list(pod.argv)
            if argv[1:2] == ["launch"] and host is hosts[0]:
                argv[2:2] = ["--report", str(tmp_path / "report")]
            f = open(log, "w")
            procs.append(host.popen(argv, stdout=f, stderr=subprocess.STDOUT, env=e, text=True, cwd=REPO))
        codes = wait_all(procs, logs, 380)
        assert codes == [0, 0, 0, 0], show(logs)
        acc = accuracy(logs[0].read_text(), "test accuracy")
        report = json.loads((tmp_path / "report" / "report.json").read_text())
        print(f"4 hosts x 1 worker, from the manifest: {acc:.2f}%; plain local torch: {local_accuracy:.2f}%")
        assert len(report["workers"]) == 4, report["workers"]
        assert len(report["servers"]) == 4, report["servers"]
        assert abs(acc - local_accuracy) <= 1.0, show(logs)
        for host, log in zip(hosts[1:], logs[1:]):
            assert f"({host.ip}) joined the job" in log.read_text(), show(logs)


# Each rank pushes 1.0 into its own tensor `w{rank}` at every clock (SGD, lr 1): its
# values count its pushes exactly. A restarted rank says where it started and what its
# tensor held then; rank 0 writes every tensor at the end.
EXACT_WORKER = """
import json, os, sys, time
import numpy as np, elasticps
steps, out = int(sys.argv[1]), sys.argv[2]
w = elasticps.init()
n = int(os.environ["ELASTICPS_WORKERS"])
params = {f"w{r}": np.zeros(16, np.float32) for r in range(n)}
w.register_model(params)
start = w.start_clock
print(f"pid {os.getpid()} rank {w.rank} host group rank {os.environ.get('ELASTICPS_HOST_GROUP_RANK', '-')}", flush=True)
if "ELASTICPS_RANK" in os.environ:
    w.pull(start, params)
    print(f"restarted rank {w.rank} at clock {start} holds {json.dumps(params[f'w{w.rank}'].tolist())}", flush=True)
for t in range(start, steps):
    grads = {k: np.zeros(16, np.float32) for k in params}
    grads[f"w{w.rank}"][:] = 1.0
    w.push_pull(t, grads, params)
    if t % 10 == 0:
        print(f"rank {w.rank} step {t}", flush=True)
    time.sleep(0.02)
if w.rank == 0:
    with open(out, "w") as f:
        json.dump({k: v.tolist() for k, v in params.items()}, f)
elasticps.finish()
"""


@pytest.mark.deadline(300)
@pytest.mark.parametrize("kill_at", ["step 0", "step 50"], ids=["early", "mid-run"])
def test_a_host_killed_mid_run_fails_over_restarts_its_worker_and_loses_no_push(tmp_path, kill_at):
    """The host of rank 3's worker and a server is lost mid-run, or early (issue 33: within
    the first clocks, its link down too, the workers waited 300 s for the lost server until
    the scheduler told them of the failover)."""
    require_root()
    script = tmp_path / "exact_worker.py"
    script.write_text(EXACT_WORKER)
    steps = 300
    final = tmp_path / "final.json"
    with testbed(4, "ephk") as hosts:
        logs = [tmp_path / f"{h.name}.log" for h in hosts]
        # Per-push steps (--no-aggregate): each push of 1.0 counts once in the values.
        flags = ["--sync", "bsp", "--no-aggregate", "--optimizer", "sgd", "--lr", "1", "--replicas", "2",
                 "--restart-workers", "1", "--block-bytes", "32"]
        procs = []
        for i, h in enumerate(hosts):
            report = ["--report", str(tmp_path / "report")] if i == 0 else []
            procs.append(launch_on(h, hosts[0], "4", flags + report, [sys.executable, str(script), str(steps), str(final)], logs[i]))
        victim, vlog = hosts[3], logs[3]
        deadline = time.monotonic() + 120
        while kill_at not in vlog.read_text():
            assert time.monotonic() < deadline, f"host 4's worker did not reach {kill_at} in 120 s:\n" + show(logs)
            assert procs[3].poll() is None, show(logs)
            time.sleep(0.01 if kill_at == "step 0" else 0.2)
        lose(victim, procs[3])
        codes = wait_all(procs[:3], logs[:3], 240)
        assert codes == [0, 0, 0], show(logs)
        report = json.loads((tmp_path / "report" / "report.json").read_text())
        events = report["balance"]["scaling"]
        lost = [e for e in events if e["action"] == "host-lost"]
        assert lost and victim.name in lost[0]["reason"], events
        assert any(e["action"] == "failover" for e in events), events
        restarted = [l for log in logs[:3] for l in log.read_text().splitlines() if "restarted rank" in l]
        assert len(restarted) == 1, show(logs)
        print(f"{lost[0]['reason']}; {restarted[0]}")
        check_exact(json.loads(final.read_text()), restarted, 4, steps)


def start_two_groups_of_two(tmp_path: Path, hosts: Sequence[Host], steps: int, final: Path):
    """EXACT_WORKER on two hosts of two workers each, one push per host (the default
    across hosts), with --replicas 2 --restart-workers 2; returns once host 2's workers
    reached step 50: the launches and their logs (host 1's launch writes the report)."""
    script = tmp_path / "exact_worker.py"
    script.write_text(EXACT_WORKER)
    logs = [tmp_path / f"{h.name}.log" for h in hosts]
    flags = ["--sync", "bsp", "--no-aggregate", "--optimizer", "sgd", "--lr", "1", "--replicas", "2",
             "--restart-workers", "2", "--block-bytes", "32", "--workers-per-node", "2", "--worker-slots", "4"]
    procs = []
    for i, h in enumerate(hosts):
        report = ["--report", str(tmp_path / "report")] if i == 0 else []
        procs.append(launch_on(h, hosts[0], "2", flags + report, [sys.executable, str(script), str(steps), str(final)], logs[i]))
    deadline = time.monotonic() + 120
    while "step 50" not in logs[1].read_text():
        assert time.monotonic() < deadline, "host 2's workers did not reach step 50 in 120 s:\n" + show(logs)
        assert procs[1].poll() is None, show(logs)
        time.sleep(0.2)
    return procs, logs


@pytest.mark.deadline(300)
def test_one_push_per_host_survives_a_host_lost_mid_run_and_loses_no_push(tmp_path):
    """Issue 37: two hosts with two workers each push once per host (the default across
    hosts: host group rank 0 sums its host's gradients and pushes the sum; the other
    pushes no gradient and takes the leader's values). Host 2 and everything on it is lost
    mid-run with --replicas 2 --restart-workers: its two workers restart on host 1, each
    pushing alone, the servers fail over, and every push of every rank counts exactly
    once."""
    require_root()
    steps, workers = 300, 4
    final = tmp_path / "final.json"
    with testbed(2, "ephg") as hosts:
        procs, logs = start_two_groups_of_two(tmp_path, hosts, steps, final)
        victim = hosts[1]
        lose(victim, procs[1])
        codes = wait_all(procs[:1], logs[:1], 240)
        assert codes == [0], show(logs)
        text = "\n".join(log.read_text() for log in logs)
        # Both hosts' first workers sat in their host's group; the restarted ones alone.
        seats = sorted(l.split("host group rank ")[1].strip() for l in text.splitlines() if "host group rank" in l)
        assert seats == ["-", "-", "0", "0", "1", "1"], show(logs)
        restarted = [l for l in logs[0].read_text().splitlines() if "restarted rank" in l]
        assert len(restarted) == 2, show(logs)
        report = json.loads((tmp_path / "report" / "report.json").read_text())
        events = report["balance"]["scaling"]
        assert any(e["action"] == "host-lost" and victim.name in e["reason"] for e in events), events
        print("; ".join(restarted))
        check_exact(json.loads(final.read_text()), restarted, workers, steps)


@pytest.mark.deadline(300)
def test_a_host_groups_leader_killed_alone_restarts_it_and_its_member_and_loses_no_push(tmp_path):
    """Only host 2's group leader is killed mid-run (its host and member live on). The
    member's next round fails (its leader is gone) and the exception leaves the job
    without WorkerDone, so the job counts it lost, not done: both are restarted, each
    pushing alone, and every push of every rank counts exactly once. Before, the member
    finished at interpreter exit: never restarted, its pushes stopped counting, and the
    job ended 0."""
    require_root()
    steps, workers = 300, 4
    final = tmp_path / "final.json"
    with testbed(2, "ephl") as hosts:
        procs, logs = start_two_groups_of_two(tmp_path, hosts, steps, final)
        seated = [l.split() for l in logs[1].read_text().splitlines() if "host group rank 0" in l]
        assert len(seated) == 1, show(logs)
        os.kill(int(seated[0][seated[0].index("pid") + 1]), signal.SIGKILL)
        codes = wait_all(procs, logs, 240)
        assert codes == [0, 0], show(logs)
        text = "\n".join(log.read_text() for log in logs)
        restarted = [l for l in text.splitlines() if "restarted rank" in l]
        assert len(restarted) == 2, show(logs)
        check_exact(json.loads(final.read_text()), restarted, workers, steps)


@pytest.mark.deadline(120)
def test_a_missing_host_fails_the_job_in_time_naming_what_never_came(tmp_path):
    require_root()
    with testbed(2, "ephj") as (a, b):
        log = tmp_path / "a.log"
        p = launch_on(a, a, "3", ["--join-timeout-s", "8"], [sys.executable, "-c", "pass"], log)
        q = launch_on(b, a, "3", ["--join-timeout-s", "8"], [sys.executable, "-c", "pass"], tmp_path / "b.log")
        codes = wait_all([p, q], [log, tmp_path / "b.log"], 60)
        text = log.read_text()
        assert codes[0] != 0, text
        assert "scheduler waits for hosts: 2 of at least 3 joined" in text, text
        assert f"{a.name} ({a.ip})" in text and f"{b.name} ({b.ip})" in text, text
        # The other host hears why the job ended (the rendezvous launch's status is the job's).
        assert "this host is done: the job did not assemble within 8 s" in (tmp_path / "b.log").read_text()


@pytest.mark.deadline(120)
def test_a_wrong_or_unreachable_address_is_refused_with_what_to_pass(tmp_path):
    require_root()
    with testbed(2, "ephw") as (a, b):
        # Loopback advertised to a scheduler on another host.
        r = b.run([binary(), "launch", "--nnodes", "2", "--rdzv", f"{a.ip}:{PORT}", "--advertise", "127.0.0.1", "--",
                   sys.executable, "-c", "pass"], capture_output=True, text=True, env=env(), timeout=30)
        assert r.returncode != 0 and "loopback" in r.stderr and "--advertise" in r.stderr, r.stderr
        # A rendezvous nobody runs: the host says what it waits for, then gives up in time.
        start = time.monotonic()
        r = b.run([binary(), "launch", "--nnodes", "2", "--rdzv", f"{a.ip}:{PORT}", "--join-timeout-s", "6", "--",
                   sys.executable, "-c", "pass"], capture_output=True, text=True, env=env(), timeout=60)
        assert r.returncode != 0, r.stdout + r.stderr
        assert f"could not reach the scheduler at {a.ip}:{PORT} within 6 s" in r.stderr, r.stderr
        assert time.monotonic() - start < 30
        # A server started by hand that listens on loopback for a scheduler elsewhere.
        r = b.run([binary(), "server", "--scheduler", f"{a.ip}:{PORT}", "--listen", "127.0.0.1:0"],
                  capture_output=True, text=True, env=env(), timeout=30)
        assert r.returncode != 0 and "loopback" in r.stderr and "--interface" in r.stderr, r.stderr
        # An address that is not this host's.
        r = b.run([binary(), "launch", "--nnodes", "2", "--rdzv", f"{a.ip}:{PORT}", "--advertise", a.ip, "--",
                   sys.executable, "-c", "pass"], capture_output=True, text=True, env=env(), timeout=30)
        assert r.returncode != 0 and "is not an address of this host" in r.stderr, r.stderr
        # An interface that does not exist.
        r = b.run([binary(), "launch", "--nnodes", "2", "--rdzv", f"{a.ip}:{PORT}", "--interface", "nope0", "--",
                   sys.executable, "-c", "pass"], capture_output=True, text=True, env=env(), timeout=30)
        assert r.returncode != 0 and "--interface nope0" in r.stderr and "eth0" in r.stderr, r.stderr


@pytest.mark.deadline(300)
def test_sbatch_of_the_slurm_example_runs_to_completion_on_a_two_node_slurm(tmp_path):
    """A real Slurm: slurmctld, munge and two slurmd (n1, n2), each in its own namespace
    host (scripts/slurm-testbed; .ci/run installs the packages)."""
    require_root()
    testbed = REPO / "scripts" / "slurm-testbed"
    if subprocess.run(["sh", "-c", "command -v slurmctld || test -x /usr/sbin/slurmctld"], capture_output=True).returncode:
        if os.environ.get("CI") == "true":
            pytest.fail("slurm is not installed: scripts/slurm-testbed install")
        pytest.skip("slurm is not installed: scripts/slurm-testbed install")
    up = subprocess.run([str(testbed), "up", "--prefix", "ephs"], capture_output=True, text=True, timeout=120)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        e = env()
        e["ELASTICPS"] = binary()
        run = subprocess.run(
            [str(testbed), "run", "--prefix", "ephs", "--timeout", "200", str(REPO / "examples" / "slurm" / "train.sbatch")],
            capture_output=True, text=True, timeout=260, env=e, cwd=tmp_path,
        )
        out = run.stdout + run.stderr
        assert run.returncode == 0, out[-4000:]
        assert "host n1 (" in out and "runs the scheduler" in out, out[-4000:]
        assert "host n2 (" in out and "this host is done: every worker finished" in out, out[-4000:]
        assert accuracy(out, "test accuracy") >= 85.0, out[-4000:]
        report = json.loads(next(tmp_path.glob("elasticps-report-*/report.json")).read_text())
        assert len(report["workers"]) == 2 and len(report["servers"]) == 2, report
    finally:
        subprocess.run([str(testbed), "down", "--prefix", "ephs"], capture_output=True, timeout=120)
