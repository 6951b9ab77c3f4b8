"""elasticps against torch DDP, head to head: the same model, data, batch, optimizer and
steps, trained by torch DDP (gloo, ``torch.distributed.run``, 2 ranks) and by elasticps
(``elasticps launch``, 2 workers: bsp --aggregate with 1 and 2 servers, ssp:2, asp), on one
host and on two network-namespace hosts whose links are capped with ``tc tbf`` (one server
and one worker per host), without and with transient stragglers (every rank sleeps
100-300 ms with probability 0.2 per step, seeded)::

    python python/benchmarks/vs_ddp.py                  # the full table (root for the capped hosts)
    python python/benchmarks/vs_ddp.py --quick          # a few steps of each row (CI)

Models: ``cnn``, the CNN of ``examples/python/train_mnist_torch.py`` on the bundled MNIST
subset, and ``mlp``, a 25 MB MLP (784-2048-2048-256-10) on the same data. Both train with
Adam (lr 1e-3), batch 32 per rank, one torch thread per rank; rank r trains on every
2nd example starting at r, in the same seeded order under both systems.

It prints, per row, the job's samples/s (all ranks' samples over the span from the first
rank's start to the last rank's end), the time to a fixed test accuracy (rank 0's
parameters are copied every few steps inside the timed loop and evaluated after it), the
test accuracy after the same number of samples (rank 0's final parameters; under
elasticps pulled after every worker pushed its last step), and the ratios elasticps/DDP of
the row's group (same model, hosts and stragglers); also each step's mean time in forward
and backward and in ``optimizer.step()``, and across the capped hosts the bytes their links
carried per step (their tbf counters). ``--out DIR`` also gets ``vs-ddp.json``,
``vs-ddp.md`` and every run's log and ranks' results (a worker given ``--trace`` records
every step's phase stamps there, to line them up with a link's byte counters).

The ``elasticps`` binary is ``--elasticps PATH``, else ``$ELASTICPS_BIN``, else
``elasticps`` on PATH, else the repository's target/release or target/debug build. The
workers run this interpreter (``sys.executable``), which must import torch and elasticps.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples" / "python"))  # mnist: the bundled subset's loader
sys.path.insert(0, str(REPO / "python" / "tests"))  # testnet: the namespace hosts

from testnet import CAN_DIE_WITH_PARENT, die_with_parent  # noqa: E402

#: Every rank's batch.
BATCH = 32
#: Adam's learning rate, for both systems.
LR = 1e-3
#: Transient stragglers: each step, each rank sleeps with this probability ...
STRAGGLE_P = 0.2
#: ... for a uniform draw from this range of seconds.
STRAGGLE_S = (0.1, 0.3)
#: The capped hosts' link rate (tc tbf, both directions, scripts/testnet's burst and queue).
CAP_MBIT = 500
#: Ports of the capped bed: torch's rendezvous and elasticps's.
DDP_PORT, EPS_PORT = 29500, 29400
# The cluster secret of the launches across the capped hosts (a launch across hosts refuses
# to start without one); one per benchmark run.
EPS_SECRET = os.urandom(16).hex()
#: Once one process of a run failed, how long the others may take to end.
FAIL_GRACE_S = 20.0
#: The namespace bed's prefix (scripts/testnet).
BED = "epvd"
#: The systems: a name, and for elasticps the sync policy, --aggregate, the servers and
#: further launch flags (how the gradients travel).
SYSTEMS = {
    "ddp": None,
    "bsp-agg/1": ("bsp", True, 1, []),
    "bsp-agg/2": ("bsp", True, 2, []),
    "ssp:2/2": ("ssp:2", False, 2, []),
    "asp/2": ("asp", False, 2, []),
    # ssp:2 with DDP's arithmetic (one step per clock on the mean), not in the default set
    "ssp:2-agg/2": ("ssp:2", True, 2, []),
    # Fewer bytes on the wire (issue 37), not in the default set: bf16 pushes and pulls,
    # top-k 1% with error feedback, and both.
    "bf16/2": ("bsp", True, 2, ["--wire-dtype", "bf16"]),
    "topk1%/2": ("bsp", True, 2, ["--compress", "topk:0.01"]),
    "topk1%-bf16/2": ("bsp", True, 2, ["--compress", "topk:0.01", "--wire-dtype", "bf16"]),
    # Two workers on each host (issue 37), not in the default set: DDP, elasticps with
    # every worker pushing its own, and elasticps pushing once per host (the default
    # across hosts: one worker of each host sums the host's gradients).
    "ddp/2x2": None,
    "bsp-agg/2x2": ("bsp", True, 2, ["--no-host-aggregation"]),
    "host-agg/2x2": ("bsp", True, 2, []),
}
#: Workers per host of a system, where not 1.
PER_HOST = {"ddp/2x2": 2, "bsp-agg/2x2": 2, "host-agg/2x2": 2}
#: The DDP run a system's "x DDP" compares with, where not "ddp" (the same ranks).
DDP_OF = {"bsp-agg/2x2": "ddp/2x2", "host-agg/2x2": "ddp/2x2"}
#: The system another is compared with in its "x f32" column (compression: the same job
#: uncompressed), and what that column is called where not "f32".
F32_OF = {"bf16/2": "bsp-agg/2", "topk1%/2": "bsp-agg/2", "topk1%-bf16/2": "bsp-agg/2", "host-agg/2x2": "bsp-agg/2x2"}
BASE_NAME = {"host-agg/2x2": "separate"}
#: The systems run by default.
DEFAULT_SYSTEMS = "ddp,bsp-agg/1,bsp-agg/2,ssp:2/2,asp/2"


# ----------------------------------------------------------------------------- worker


def build_model(kind: str):
    """The benchmark's model, seeded identically on every rank and under both systems."""
    import torch

    torch.manual_seed(0)
    if kind == "cnn":
        from train_mnist_torch import Net

        return Net()
    return torch.nn.Sequential(
        torch.nn.Flatten(),
        torch.nn.Linear(784, 2048),
        torch.nn.ReLU(),
        torch.nn.Linear(2048, 2048),
        torch.nn.ReLU(),
        torch.nn.Linear(2048, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )


def worker_main(args) -> int:
    """One rank of a run, under torchrun (``--system ddp``) or ``elasticps launch``."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    import mnist
    from train_mnist_torch import accuracy, batches

    torch.set_num_threads(1)
    x, y = mnist.load("train")
    xt, yt = mnist.load("t10k")
    model = build_model(args.model)
    if args.system == "ddp":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.Adam(net.parameters(), lr=LR)
        barrier = dist.barrier
    else:
        import elasticps
        import elasticps.torch

        w = elasticps.init()
        rank, size = w.rank, w.size
        net = model
        opt = elasticps.torch.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=LR), model.named_parameters())
        barrier = w.barrier
    xs, ys = x[rank::size], y[rank::size]
    order = np.random.default_rng(args.seed + 1 + rank)
    straggle = random.Random(args.seed * 1000 + rank)
    stream = (idx for _ in iter(int, 1) for idx in batches(len(xs), BATCH, order))
    snaps, losses = [], []
    backward_s = step_s = 0.0
    trace = []  # (start, backward done, step done) of every step, perf_counter
    barrier()
    t0 = time.time()
    for step in range(1, args.steps + 1):
        idx = next(stream)
        opt.zero_grad()
        a = time.perf_counter()
        loss = F.cross_entropy(net(torch.from_numpy(xs[idx])), torch.from_numpy(ys[idx]))
        loss.backward()
        b = time.perf_counter()
        opt.step()
        c = time.perf_counter()
        step_s += c - b
        backward_s += b - a
        if args.trace:
            trace.append((a, b, c))
        losses.append(loss.item())
        if args.straggle and straggle.random() < STRAGGLE_P:
            time.sleep(straggle.uniform(*STRAGGLE_S))
        if rank == 0 and (step % args.snap_every == 0 or step == args.steps):
            snaps.append((step, time.time() - t0, {k: v.detach().clone() for k, v in model.state_dict().items()}))
    t1 = time.time()
    barrier()
    out = {"rank": rank, "size": size, "t0": t0, "t1": t1, "steps": args.steps, "samples": args.steps * BATCH, "losses": losses}
    # where a step's time goes: forward and backward (DDP's all-reduce overlaps the
    # backward; elasticps's pushes start in it), and optimizer.step()
    out.update(forward_backward_ms=1e3 * backward_s / args.steps, step_ms=1e3 * step_s / args.steps)
    if args.trace:
        out["trace"] = trace
    if rank == 0:
        if args.system != "ddp":
            # every worker pushed its last step once all are in the barrier
            w.pull(opt.clock, {n: p.detach().numpy() for n, p in model.named_parameters()})
        out["accuracy"] = accuracy(model, xt, yt)
        curve = []
        final = {k: v.detach().clone() for k, v in model.state_dict().items()}
        for step, elapsed, state in snaps:
            model.load_state_dict(state)
            curve.append((step, elapsed, accuracy(model, xt, yt)))
        model.load_state_dict(final)
        out["curve"] = curve
    Path(args.result, f"rank{rank}.json").write_text(json.dumps(out))
    if args.system == "ddp":
        # Both ranks leave their last collective before either tears gloo down: a rank
        # torn down while its peer still talks aborts ("terminate called without an
        # active exception").
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    else:
        elasticps.finish()
    return 0


# ----------------------------------------------------------------------------- driver


@dataclass
class Row:
    """One run's figures."""

    model: str
    hosts: str
    stragglers: bool
    system: str
    samples_s: float = float("nan")
    accuracy: float = float("nan")
    to_target_s: Optional[float] = None
    to_target_step: Optional[int] = None
    first_loss: float = float("nan")
    last_loss: float = float("nan")
    wall_s: float = float("nan")
    error: Optional[str] = None
    ratio: Optional[float] = None
    extra: Dict[str, float] = field(default_factory=dict)


def elasticps_binary(flag: Optional[str]) -> str:
    """The `elasticps` binary (see the module's doc)."""
    for candidate in (flag, os.environ.get("ELASTICPS_BIN"), shutil.which("elasticps")):
        if candidate:
            return candidate
    for profile in ("release", "debug"):
        path = REPO / "target" / profile / "elasticps"
        if path.is_file():
            return str(path)
    raise SystemExit("vs_ddp: no elasticps binary: pass --elasticps, set ELASTICPS_BIN or cargo build -p elasticps")


def worker_argv(args, model: str, system: str, straggle: bool, result: Path) -> List[str]:
    argv = [str(Path(__file__).resolve()), "worker", "--system", "ddp" if is_ddp(system) else "eps", "--model", model]
    argv += ["--steps", str(args.steps[model]), "--snap-every", str(args.snap_every), "--seed", str(args.seed)]
    argv += ["--result", str(result)]
    return argv + (["--straggle"] if straggle else [])


def is_ddp(system: str) -> bool:
    return SYSTEMS[system] is None


def ranks_of(system: str) -> int:
    """Ranks of a run: two hosts' (or one host's as many)."""
    return 2 * PER_HOST.get(system, 1)


def eps_flags(system: str) -> List[str]:
    sync, aggregate, _, extra = SYSTEMS[system]
    return ["--quiet", "--sync", sync, "--join-timeout-s", "120"] + (["--aggregate"] if aggregate else []) + extra


def one_host_procs(args, model: str, system: str, straggle: bool, result: Path) -> List[List[str]]:
    """The command lines of a run on this host."""
    py = [sys.executable, *worker_argv(args, model, system, straggle, result)]
    n = str(ranks_of(system))
    if is_ddp(system):
        return [[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", n, *py[1:]]]
    servers = SYSTEMS[system][2]
    return [[args.binary, "launch", "--workers", n, "--servers", str(servers), *eps_flags(system), "--", *py]]


def two_host_procs(args, hosts, model: str, system: str, straggle: bool, result: Path) -> List[List[str]]:
    """The command lines of a run on the capped hosts, one per host (run there)."""
    py = worker_argv(args, model, system, straggle, result)
    a = hosts[0]
    out = []
    for i, h in enumerate(hosts):
        per_host = str(PER_HOST.get(system, 1))
        if is_ddp(system):
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", per_host]
            argv += ["--node-rank", str(i), "--master-addr", a.ip, "--master-port", str(DDP_PORT), *py]
        else:
            servers = 1 if (i == 0 or SYSTEMS[system][2] == 2) else 0
            argv = [args.binary, "launch", "--nnodes", "2", "--rdzv", f"{a.ip}:{EPS_PORT}", "--node-name", h.name]
            argv += ["--secret", EPS_SECRET]
            argv += ["--servers-per-node", str(servers), "--workers-per-node", per_host, *eps_flags(system)]
            argv += ["--", sys.executable, *py]
        out.append(h.argv(argv))
    return out


def run_procs(argvs: Sequence[Sequence[str]], log: Path, timeout_s: float, env: Dict[str, str]) -> Optional[str]:
    """Runs the command lines at once; None, or what went wrong. Each leads its own
    session; all are killed by process group once one failed and the others had
    ``FAIL_GRACE_S`` to end, or when they outlive ``timeout_s``."""
    procs: List[subprocess.Popen] = []
    with open(log, "w") as f:
        try:
            for argv in argvs:
                procs.append(
                    subprocess.Popen(
                        argv,
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        env=env,
                        preexec_fn=die_with_parent if CAN_DIE_WITH_PARENT else None,
                    )
                )
            deadline = time.monotonic() + timeout_s
            while any(p.poll() is None for p in procs):
                if any(p.returncode not in (None, 0) for p in procs):
                    deadline = min(deadline, time.monotonic() + FAIL_GRACE_S)
                if time.monotonic() > deadline:
                    return f"did not finish within {timeout_s:.0f} s, exits {[p.returncode for p in procs]} (log: {log})"
                time.sleep(0.2)
            bad = [p.returncode for p in procs if p.returncode != 0]
            return f"exited with {bad} (log: {log})" if bad else None
        finally:
            for p in procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    p.wait(timeout=10)


def collect(row: Row, result: Path, target: float) -> None:
    """Fills a row from its ranks' result files."""
    ranks = [json.loads(p.read_text()) for p in sorted(result.glob("rank*.json"))]
    n = ranks_of(row.system)
    if len(ranks) != n:
        row.error = row.error or f"{len(ranks)} of {n} ranks wrote results"
        return
    span = max(r["t1"] for r in ranks) - min(r["t0"] for r in ranks)
    row.samples_s = sum(r["samples"] for r in ranks) / span
    zero = next(r for r in ranks if r["rank"] == 0)
    row.accuracy = zero["accuracy"]
    row.first_loss = sum(r["losses"][0] for r in ranks) / n
    tail = [v for r in ranks for v in r["losses"][-10:]]
    row.last_loss = sum(tail) / len(tail)
    for key in ("forward_backward_ms", "step_ms"):
        row.extra[key] = sum(r[key] for r in ranks) / n
    reached = next(((step, elapsed) for step, elapsed, acc in zero["curve"] if acc >= target), None)
    row.to_target_step, row.to_target_s = reached if reached else (None, None)


def run_row(args, row: Row, hosts, work: Path) -> Row:
    result = work / f"{row.model}-{row.hosts}-{'strag' if row.stragglers else 'none'}-{row.system.replace('/', '_')}"
    result.mkdir(parents=True, exist_ok=True)
    if hosts is None:
        argvs = one_host_procs(args, row.model, row.system, row.stragglers, result)
    else:
        argvs = two_host_procs(args, hosts, row.model, row.system, row.stragglers, result)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if hosts is not None:
        env["GLOO_SOCKET_IFNAME"] = "eth0"  # gloo would take the bed's name for 127.0.0.1
    sent = link_bytes(hosts)
    started = time.monotonic()
    row.error = run_procs(argvs, result / "log.txt", args.timeout_s, env)
    row.wall_s = time.monotonic() - started
    collect(row, result, args.target[row.model])
    if hosts is not None:
        row.extra["link_mb_per_step"] = (link_bytes(hosts) - sent) / args.steps[row.model] / 1e6
    return row


def link_bytes(hosts) -> int:
    """Bytes the capped hosts sent over their links so far (their eth0 tbf's counters)."""
    total = 0
    for h in hosts or []:
        r = h.run(["tc", "-j", "-s", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True, check=True)
        total += sum(q.get("bytes", 0) for q in json.loads(r.stdout) if q.get("kind") == "tbf")
    return total


@contextmanager
def capped_hosts(enabled: bool, prefix: str) -> Iterator[Optional[list]]:
    """Two namespace hosts with 500 Mbit/s links, torn down on exit (even on failure)."""
    if not enabled:
        yield None
        return
    from testnet import testbed

    with testbed(2, prefix) as hosts:
        for h in hosts:
            h.cap(CAP_MBIT)
        yield hosts


def fmt(v: Optional[float], spec: str, none: str = "-") -> str:
    return none if v is None or v != v else format(v, spec)


def table(rows: List[Row], targets: Dict[str, float]) -> str:
    head = "| model | hosts | stragglers | system | samples/s | x DDP | time to target | test accuracy | loss first -> last | fwd+bwd, step() ms | link MB/step |"
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        tgt = (
            f"{fmt(r.to_target_s, '.1f')} s, step {r.to_target_step}"
            if r.to_target_s is not None
            else f"not reached ({100 * targets[r.model]:.0f}%)"
        )
        if "x_f32" in r.extra:
            tgt += f"; x {BASE_NAME.get(r.system, 'f32')} {r.extra['x_f32']:.2f}"
        lines.append(
            f"| {r.model} | {r.hosts} | {'0.2 x 100-300 ms' if r.stragglers else 'none'} | {r.system} | "
            f"{fmt(r.samples_s, '.0f')} | {fmt(r.ratio, '.2f')}x | {tgt} | {fmt(100 * r.accuracy, '.2f')}% | "
            f"{fmt(r.first_loss, '.3f')} -> {fmt(r.last_loss, '.3f')} | "
            f"{fmt(r.extra.get('forward_backward_ms'), '.0f')}, {fmt(r.extra.get('step_ms'), '.0f')} | "
            f"{fmt(r.extra.get('link_mb_per_step'), '.1f')} |"
            + (f" FAILED: {r.error}" if r.error else "")
        )
    return "\n".join(lines)


def driver_main(args) -> int:
    args.binary = elasticps_binary(args.elasticps)
    quick = args.quick
    args.steps = {"cnn": args.cnn_steps or (40 if quick else 400), "mlp": args.mlp_steps or (20 if quick else 60)}
    args.snap_every = args.snap_every or (10 if quick else 20)
    args.target = {"cnn": args.cnn_target, "mlp": args.mlp_target}
    models = (args.models or ("cnn" if quick else "cnn,mlp")).split(",")
    systems = (args.systems or ("ddp,bsp-agg/2,ssp:2/2" if quick else DEFAULT_SYSTEMS)).split(",")
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"vs_ddp: unknown systems {unknown}; known: {list(SYSTEMS)}")
    if "ddp" not in systems:
        systems.insert(0, "ddp")
    conditions = args.hosts.split(",")
    if "capped" in conditions and os.geteuid() != 0:
        print("vs_ddp: not root: the capped hosts are left out (network namespaces need root)", file=sys.stderr)
        conditions.remove("capped")
    stragglers = [s == "on" for s in (args.stragglers or ("on" if quick else "off,on")).split(",")]
    work = Path(args.out or tempfile.mkdtemp(prefix="vs-ddp-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"vs_ddp: elasticps {args.binary}, python {sys.executable}, results in {work}", flush=True)
    rows: List[Row] = []
    for cond in conditions:
        with capped_hosts(cond == "capped", args.bed) as hosts:
            for model in models:
                for straggle in stragglers:
                    for rep in range(args.repeat):
                        group = []
                        for system in systems:
                            row = run_row(args, Row(model, "one" if hosts is None else "2 capped", straggle, system), hosts, work / f"rep{rep}")
                            group.append(row)
                            print(f"  {model} {row.hosts} stragglers={straggle} {system}: {fmt(row.samples_s, '.0f')} samples/s, "
                                  f"accuracy {fmt(100 * row.accuracy, '.2f')}%, wall {row.wall_s:.1f} s"
                                  + (f" FAILED: {row.error}" if row.error else ""), flush=True)
                        by_name = {r.system: r for r in group}
                        for r in group:
                            ddp = by_name.get(DDP_OF.get(r.system, "ddp"))
                            base = ddp.samples_s if ddp is not None else float("nan")
                            r.ratio = r.samples_s / base if base == base and base > 0 else None
                            f32 = by_name.get(F32_OF.get(r.system, ""))
                            if f32 is not None and f32.samples_s > 0:
                                r.extra["x_f32"] = r.samples_s / f32.samples_s
                        rows += group
    md = table(rows, args.target)
    print(md)
    (work / "vs-ddp.md").write_text(md + "\n")
    (work / "vs-ddp.json").write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    failed = [r for r in rows if r.error or r.samples_s != r.samples_s]
    return 1 if failed else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd")
    w = sub.add_parser("worker", help="one rank (run by torchrun or elasticps launch)")
    w.add_argument("--system", choices=["ddp", "eps"], required=True)
    w.add_argument("--model", choices=["cnn", "mlp"], required=True)
    w.add_argument("--steps", type=int, required=True)
    w.add_argument("--snap-every", type=int, required=True)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--straggle", action="store_true")
    w.add_argument("--trace", action="store_true", help="record every step's phases (perf_counter)")
    w.add_argument("--result", required=True)
    p.add_argument("--quick", action="store_true", help="a few steps per row (the CI form)")
    p.add_argument("--models", help="cnn,mlp (default both; quick: cnn)")
    p.add_argument("--hosts", default="one,capped", help="one,capped (default both; capped needs root)")
    p.add_argument("--stragglers", help="off,on (default both; quick: on)")
    p.add_argument("--systems", help=f"of {','.join(SYSTEMS)} (default {DEFAULT_SYSTEMS}; quick: ddp,bsp-agg/2,ssp:2/2; ddp always runs)")
    p.add_argument("--cnn-steps", type=int, help="steps per rank (default 400, quick 40)")
    p.add_argument("--mlp-steps", type=int, help="steps per rank (default 60, quick 20)")
    p.add_argument("--snap-every", type=int, help="steps between rank 0's snapshots (default 20, quick 10)")
    p.add_argument("--cnn-target", type=float, default=0.95, help="the accuracy timed (default 0.95)")
    p.add_argument("--mlp-target", type=float, default=0.85, help="the accuracy timed (default 0.85)")
    p.add_argument("--repeat", type=int, default=1, help="runs of each group (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=600.0, help="limit of one run (default 600)")
    p.add_argument("--bed", default=BED, help=f"prefix of the namespace hosts (scripts/testnet; default {BED})")
    p.add_argument("--elasticps", help="the elasticps binary (see the module's doc)")
    p.add_argument("--out", help="results, logs, vs-ddp.json and vs-ddp.md (default: a new temporary directory)")
    args = p.parse_args(argv)
    return worker_main(args) if args.cmd == "worker" else driver_main(args)


if __name__ == "__main__":
    sys.exit(main())
