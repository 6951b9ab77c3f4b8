"""The examples in examples/python, run as two real worker processes against a real
cluster (a short run each: the full runs are in the README and docs/BENCHMARKS.md)."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, elasticps_bin, worker_env

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


def ctr_module():
    """examples/python/ctr.py (the CTR example's data and AUC), imported from its folder."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import ctr

    return ctr


def pairwise_auc(labels, scores):
    """AUC by brute force: over every (positive, negative) pair, 1 if the positive scores
    higher, 1/2 on a tie."""
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


@pytest.mark.parametrize("seed", range(6))
def test_ctr_auc_is_the_pairwise_count(seed):
    ctr = ctr_module()
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 300))
    labels = rng.random(n) < 0.3
    labels[:2] = [True, False]  # both classes
    # Few distinct scores on some seeds, so that ties are common.
    scores = rng.integers(0, 4, n).astype(np.float64) if seed % 2 else rng.normal(size=n)
    assert ctr.auc(labels.astype(np.float32), scores) == pytest.approx(pairwise_auc(labels, scores), abs=1e-12)


def test_ctr_auc_edge_cases():
    ctr = ctr_module()
    assert ctr.auc([1, 0, 1, 0], [0.9, 0.1, 0.8, 0.2]) == 1.0
    assert ctr.auc([1, 0, 1, 0], [0.1, 0.9, 0.2, 0.8]) == 0.0
    assert ctr.auc([1, 0, 1, 0], [0.5, 0.5, 0.5, 0.5]) == 0.5
    assert np.isnan(ctr.auc([1, 1], [0.1, 0.2]))


def test_ctr_click_log_is_zipf_and_planted():
    ctr = ctr_module()
    sizes = ctr.table_sizes()
    assert len(sizes) == 26 and sizes[0] == 1000 and sizes[-1] == 1_000_000
    assert ctr.table_sizes(10.0)[-1] == 10_000_000
    ids, dense, labels = ctr.click_log(0, 20_000, sizes)
    assert ids.dtype == np.int64 and ids.shape == (20_000, 26) and dense.shape == (20_000, 13)
    assert (ids >= 0).all() and (ids < np.array(sizes)).all()
    # Zipf with exponent 1.1: id 0 of the largest table is about 8% of its draws, id 1
    # about half as frequent (2^-1.1), and most of the table is never drawn.
    counts = np.bincount(ids[:, -1], minlength=sizes[-1])
    assert 0.05 < counts[0] / 20_000 < 0.12
    assert 0.35 < counts[1] / counts[0] < 0.6
    assert (counts > 0).sum() < 20_000
    # The labels follow the planted model: its own logit ranks them well.
    assert 0.15 < labels.mean() < 0.5
    assert ctr.auc(labels, ctr.planted_logit(0, ids, dense)) > 0.75
    # The same seed draws the same log (every worker and --local see the same examples).
    again = ctr.click_log(0, 20_000, sizes)
    assert all(np.array_equal(a, b) for a, b in zip((ids, dense, labels), again))


CTR = EXAMPLES / "train_ctr_torch.py"
#: How far the CTR example's AUC under elasticps (2 workers, ssp:2: two shards, each
#: worker's own data order, stale reads) may be from plain local torch's on the same data,
#: batches and epochs: issue 21's target, 0.005 (measured: 0.0004 and 0.0005 apart in two runs).
CTR_AUC_TOLERANCE = 0.005


def auc_of(text, label):
    found = [float(m.group(1)) for m in re.finditer(rf"^(?:\[worker \d+\] )?{label} (\d\.\d+)$", text, re.M)]
    assert len(found) == 1, f"expected one {label!r} line: {text}"
    return found[0]


@pytest.mark.deadline(300)
def test_train_ctr_torch_quick_under_launch_learns_as_well_as_local_torch():
    env = worker_env()
    env.pop("ELASTICPS_SCHEDULER", None)
    local = subprocess.run(
        [sys.executable, str(CTR), "--local", "--quick"], env=env, capture_output=True, text=True, timeout=120
    )
    assert local.returncode == 0, local.stderr[-3000:]
    local_auc = auc_of(local.stdout, "local test auc")
    out = subprocess.run(
        [elasticps_bin(), "launch", "--quiet", "--workers", "2", "--sync", "ssp:2", "--", sys.executable, str(CTR), "--quick"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-5000:]
    auc = auc_of(out.stdout, "test auc")
    print(f"ctr --quick: elasticps ssp:2, 2 workers: auc {auc:.4f}; plain local torch: auc {local_auc:.4f}")
    assert auc > 0.6 and local_auc > 0.6
    assert abs(auc - local_auc) <= CTR_AUC_TOLERANCE


def test_train_ctr_torch_needs_a_scheduler_or_local():
    env = worker_env()
    env.pop("ELASTICPS_SCHEDULER", None)
    p = subprocess.run([sys.executable, str(CTR)], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "elasticps launch" in p.stderr and "--local" in p.stderr


def test_click_stream_drifts_with_zipf_popularity_and_planted_labels():
    ctr = ctr_module()
    stream = ctr.ClickStream.for_distinct(10**6, 1000, seed=1)
    ids, labels = stream.batch(0, 20_000)
    assert ids.dtype == np.int64 and ids.shape == (20_000, ctr.STREAM_FIELDS) and labels.shape == (20_000,)
    assert (ids < 0).any() and (ids > 0).any(), "hashed ids span the int64 range"
    again = stream.batch(0, 20_000)
    assert np.array_equal(ids, again[0]) and np.array_equal(labels, again[1])
    # Zipf: the hottest id of a field is drawn far more often than a uniform draw would.
    _, counts = np.unique(ids[:, 0], return_counts=True)
    assert counts.max() > 200 and (counts == 1).sum() > 1000
    # Drift: later steps draw many ids never drawn at step 0, and fewer of step 0's.
    near, far = stream.batch(5, 20_000)[0][:, 0], stream.batch(900, 20_000)[0][:, 0]
    first = set(ids[:, 0].tolist())
    share = [np.isin(x, list(first)).mean() for x in (near, far)]
    assert share[0] > share[1] + 0.1, f"share of step 0's ids at steps 5 and 900: {share}"
    # The labels follow the hidden model.
    items = [stream.items(f, ctr.zipf_ids(np.random.default_rng(2), stream.live, 20_000), 0, np.zeros(20_000, np.int64)) for f in range(stream.fields)]
    assert ctr.auc((np.random.default_rng(3).random(20_000) < 1 / (1 + np.exp(-stream.logit(items)))), stream.logit(items)) > 0.75
    assert 0.1 < labels.mean() < 0.6


STREAM = EXAMPLES / "train_stream_ctr.py"


@pytest.mark.deadline(120)
def test_train_stream_ctr_quick_learns_under_a_bound():
    env = worker_env()
    env.pop("ELASTICPS_SCHEDULER", None)
    max_rows, servers = 5000, 2
    argv = [elasticps_bin(), "launch", "--quiet", "--workers", "1", "--servers", str(servers), "--", sys.executable]
    argv += [str(STREAM), "--quick", "--max-rows", str(max_rows), "--admit-after", "2", "--ttl-steps", "100", "--ranges", "8"]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, (out.stdout + out.stderr)[-5000:]
    auc = auc_of(out.stdout, "test auc")
    seen = float(re.search(r"distinct ids seen ~(\d+)", out.stdout).group(1))
    stored = float(re.search(r"rows stored ~(\d+) per table", out.stdout).group(1))
    print(f"stream --quick: auc {auc:.4f}, {seen:.0f} distinct ids seen, ~{stored:.0f} rows stored")
    assert auc > 0.55
    # The bound holds (the count is estimated from a sample of 4096 ids: 30% slack).
    assert 0 < stored <= 1.3 * max_rows * servers < seen
