#!/usr/bin/env python3
"""Communication time per iteration of the Python client vs the Rust client, same run.

Both clients push a ResNet-50-sized gradient (161 tensors, 25.6 M values, the shapes of
torchvision's resnet50) and pull the parameters of the next clock, with no compute, one
worker against the same kind of cluster (scheduler + servers as processes on 127.0.0.1,
bsp, server-side SGD). The Rust client is `elasticps worker --model synthetic:resnet50
--compute-ms 0`; the Python one is `elasticps.Worker.push_pull` on numpy arrays. Rounds
alternate Rust, Python, Rust, ... so that machine noise hits both alike. Prints the
per-round figures and the ratio of the medians (target: Python <= 1.1x Rust), and writes
`bench-python.json` into --out.

    scripts/bench-python [--quick] [--out DIR] [--bin target/release/elasticps]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def resnet50_shapes():
    """(name, shape) of torchvision.models.resnet50's 161 parameters."""
    shapes = [("conv1.weight", (64, 3, 7, 7)), ("bn1.weight", (64,)), ("bn1.bias", (64,))]
    inplanes = 64
    for layer, (planes, blocks) in enumerate([(64, 3), (128, 4), (256, 6), (512, 3)], start=1):
        for b in range(blocks):
            p = f"layer{layer}.{b}"
            shapes += [
                (f"{p}.conv1.weight", (planes, inplanes, 1, 1)),
                (f"{p}.bn1.weight", (planes,)),
                (f"{p}.bn1.bias", (planes,)),
                (f"{p}.conv2.weight", (planes, planes, 3, 3)),
                (f"{p}.bn2.weight", (planes,)),
                (f"{p}.bn2.bias", (planes,)),
                (f"{p}.conv3.weight", (planes * 4, planes, 1, 1)),
                (f"{p}.bn3.weight", (planes * 4,)),
                (f"{p}.bn3.bias", (planes * 4,)),
            ]
            if b == 0:
                shapes += [
                    (f"{p}.downsample.0.weight", (planes * 4, inplanes, 1, 1)),
                    (f"{p}.downsample.1.weight", (planes * 4,)),
                    (f"{p}.downsample.1.bias", (planes * 4,)),
                ]
            inplanes = planes * 4
    shapes += [("fc.weight", (1000, 2048)), ("fc.bias", (1000,))]
    return shapes


class Cluster:
    """A scheduler and servers as processes; stopped (by PID) on exit."""

    def __init__(self, binary: str, servers: int, flags: list[str], log_dir: Path):
        self.procs: list[subprocess.Popen] = []
        log_dir.mkdir(parents=True, exist_ok=True)
        sched = subprocess.Popen(
            [binary, "scheduler", "--listen", "127.0.0.1:0", "--events", "--servers", str(servers), *flags],
            stdout=subprocess.PIPE,
            stderr=open(log_dir / "scheduler.log", "w"),
            text=True,
        )
        self.procs.append(sched)
        deadline = time.monotonic() + 20
        self.addr = None
        while self.addr is None:
            if time.monotonic() > deadline:
                raise RuntimeError("the scheduler did not print its address within 20 s")
            line = sched.stdout.readline()
            if not line:
                raise RuntimeError(f"the scheduler exited: see {log_dir / 'scheduler.log'}")
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if event.get("event") == "listening":
                self.addr = event["addr"]
        for i in range(servers):
            self.procs.append(
                subprocess.Popen(
                    [binary, "server", "--scheduler", self.addr, "--listen", "127.0.0.1:0"],
                    stdout=subprocess.DEVNULL,
                    stderr=open(log_dir / f"server-{i}.log", "w"),
                )
            )

    def wait(self, timeout: float = 60) -> None:
        for p in self.procs:
            p.wait(timeout=timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def job_flags(workers: int = 1) -> list[str]:
    return ["--workers", str(workers), "--sync", "bsp", "--optimizer", "sgd", "--lr", "1e-6"]


def rust_round(binary: str, iterations: int, servers: int, log_dir: Path) -> float:
    with Cluster(binary, servers, job_flags(), log_dir) as c:
        out = subprocess.run(
            [binary, "worker", "--scheduler", c.addr, "--events", "--model", "synthetic:resnet50",
             "--compute-ms", "0", "--iterations", str(iterations)],
            capture_output=True, text=True, timeout=600,
        )
        if out.returncode != 0:
            raise RuntimeError(f"the Rust worker failed: {out.stderr[-2000:]}")
        done = [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{") and '"worker_done"' in l]
        c.wait()
        return float(done[-1]["comm_ms_per_iter"])


def python_round(binary: str, iterations: int, servers: int, log_dir: Path) -> float:
    # One process per round, as the Rust worker is: the client joins one job only.
    code = f"""
import json, sys, time, numpy as np
sys.path.insert(0, {str(ROOT / 'scripts')!r})
from bench_python import resnet50_shapes
import elasticps
w = elasticps.init(sys.argv[1])
rng = np.random.default_rng(7)
params = {{n: np.zeros(s, np.float32) for n, s in resnet50_shapes()}}
grads = {{n: rng.standard_normal(s, dtype=np.float32) for n, s in resnet50_shapes()}}
w.register_model(params)
t0 = time.perf_counter()
w.pull(0, params)
comm = time.perf_counter() - t0
for t in range({iterations}):
    t0 = time.perf_counter()
    w.push_pull(t, grads, params)
    comm += time.perf_counter() - t0
w.finish()
print(json.dumps({{"comm_ms_per_iter": comm * 1e3 / {iterations}}}))
"""
    with Cluster(binary, servers, job_flags(), log_dir) as c:
        out = subprocess.run([sys.executable, "-c", code, c.addr], capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise RuntimeError(f"the Python worker failed: {out.stderr[-2000:]}")
        c.wait()
        return float(json.loads(out.stdout.strip().splitlines()[-1])["comm_ms_per_iter"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 round of 10 iterations (CI)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--bin", default=os.environ.get("ELASTICPS_BIN", str(ROOT / "target/release/elasticps")))
    ap.add_argument("--out", default=str(ROOT / "target/bench-python"))
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.iterations = 1, 10
    if not Path(args.bin).exists():
        print(f"error: no elasticps binary at {args.bin} (cargo build --release, or --bin)", file=sys.stderr)
        return 2
    shapes = resnet50_shapes()
    values = sum(int(np.prod(s)) for _, s in shapes)
    assert len(shapes) == 161 and values == 25_557_032, (len(shapes), values)
    out = Path(args.out)
    rows = []
    print(f"ResNet-50 ({len(shapes)} tensors, {values * 4 / 1e6:.1f} MB), 1 worker, {args.servers} servers, "
          f"{args.iterations} iterations per round, no compute")
    print(f"{'round':>5}  {'rust ms/iter':>12}  {'python ms/iter':>14}  {'python/rust':>11}")
    for r in range(args.rounds):
        rust = rust_round(args.bin, args.iterations, args.servers, out / f"round-{r}-rust")
        py = python_round(args.bin, args.iterations, args.servers, out / f"round-{r}-python")
        rows.append({"round": r, "rust_ms": rust, "python_ms": py, "ratio": py / rust})
        print(f"{r:>5}  {rust:>12.1f}  {py:>14.1f}  {py / rust:>10.2f}x")
    rust_med = statistics.median(x["rust_ms"] for x in rows)
    py_med = statistics.median(x["python_ms"] for x in rows)
    ratio = py_med / rust_med
    verdict = "met" if ratio <= 1.1 else f"missed by {(ratio / 1.1 - 1) * 100:.0f}%"
    print(f"median: rust {rust_med:.1f} ms, python {py_med:.1f} ms per iteration: python/rust {ratio:.2f}x "
          f"(target <= 1.10x: {verdict})")
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench-python.json").write_text(json.dumps(
        {"model": "resnet50", "servers": args.servers, "iterations": args.iterations, "rounds": rows,
         "rust_ms_median": rust_med, "python_ms_median": py_med, "ratio": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
