"""``elasticps export`` against a real cluster, read back with ``elasticps.load_export``:
a full export taken mid-run and the chain of its deltas (the last one after evictions of a
bounded hashed table) load back exactly the values a final pull reads, evicted keys
absent; and broken exports raise clear errors."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

import elasticps
from elasticps.export import ExportError

pytestmark = pytest.mark.deadline(120)

DIM, IDX_ROWS, IDX_DIM = 4, 40, 3
EMB_INIT, IDX_INIT = 0.5, 0.25
#: Two servers, bsp, small blocks: the dense tensor and the indexed table span both.
JOB = dict(workers=1, servers=2, sync="bsp", optimizer="sgd", lr=0.1, block_bytes=64)
TABLES = {
    # 4 key ranges, at most 2 rows per server: 4 rows in all, 1 per range; pushing new
    # keys evicts the old ones.
    "emb": {"dim": DIM, "keys": "hashed", "ranges": 4, "max_rows": 2, "init": {"kind": "constant", "value": EMB_INIT}},
    "idx": {"dim": IDX_DIM, "rows": IDX_ROWS, "init": {"kind": "constant", "value": IDX_INIT}},
}


def export(cluster, out, since=None):
    args = [cluster.bin, "export", "--scheduler", cluster.addr, "--out", str(out)]
    if since is not None:
        args += ["--since", str(since)]
    p = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, f"export failed ({p.returncode}): {p.stderr[-3000:]}"
    return json.loads((out / "MANIFEST.json").read_text())


class Trainer:
    """One worker training "w", "emb" and "idx" one clock at a time."""

    def __init__(self, w):
        self.w, self.clock = w, 0
        self.params = {"w": np.zeros(6, np.float32)}
        self.used = set()
        w.register_model(self.params, tables=TABLES)

    def step(self, keys, rows):
        keys = np.asarray(keys, np.int64)
        rows = np.asarray(rows, np.int64)
        self.used.update(keys.tolist())
        t = self.clock
        self.w.pull(t, self.params)
        self.w.pull_rows(t, "emb", keys, np.zeros((len(keys), DIM), np.float32))
        g = (np.abs(keys) % 7 + 1).astype(np.float32)[:, None] * np.full((1, DIM), 0.5, np.float32)
        self.w.push_rows(t, "emb", keys, np.ascontiguousarray(g))
        gi = np.tile(np.arange(1, IDX_DIM + 1, dtype=np.float32), (len(rows), 1)) * (t + 1)
        self.w.push_rows(t, "idx", rows, gi)
        self.w.push(t, {"w": np.arange(6, dtype=np.float32) - t})
        self.clock += 1


def as_u64(keys):
    return np.asarray(sorted(keys), np.int64).view(np.uint64)


@pytest.mark.cluster(**JOB)
def test_a_full_export_and_its_deltas_load_back_equal_to_a_final_pull(cluster, tmp_path):
    tr = Trainer(cluster.connect())
    first = [3, -5, 1 << 40, 77]  # a negative int64 is the key of its bit pattern
    for _ in range(3):
        tr.step(first, [0, 5, 39])
    full = export(cluster, tmp_path / "full")
    assert full["parent"] is None
    assert {t["name"] for t in full["tables"]} == {"emb", "idx"} and full["tensors"][0]["shape"] == [6]

    for _ in range(3):
        tr.step([3, 1 << 40, 1000], [5, 6])
    d1 = export(cluster, tmp_path / "d1", since=tmp_path / "full")
    assert d1["parent"] == "../full"
    d1_rows = {t["name"]: sum(s["rows"] for s in t["shards"]) for t in d1["tables"]}
    assert d1_rows["idx"] == 2, "only rows 5 and 6 changed since the full export"

    # Many new keys: the bounded table evicts the old ones.
    for i in range(4):
        tr.step([10_000 + 10 * i + j for j in range(8)], [7])
    d2 = export(cluster, tmp_path / "d2", since=tmp_path / "d1")
    deleted = sum(
        (tmp_path / "d2" / s["deleted"]).stat().st_size // 8 for t in d2["tables"] for s in t["shards"]
    )
    assert deleted > 0, "evictions of exported keys are in the delta"

    # The final pull of everything ever used.
    t = tr.clock
    w = np.zeros(6, np.float32)
    tr.w.pull(t, {"w": w})
    keys = np.asarray(sorted(tr.used), np.int64)
    pulled = np.zeros((len(keys), DIM), np.float32)
    tr.w.pull_rows(t, "emb", keys, pulled)
    rows = np.zeros((IDX_ROWS, IDX_DIM), np.float32)
    tr.w.pull_rows(t, "idx", np.arange(IDX_ROWS, dtype=np.int64), rows)

    got = elasticps.load_export(tmp_path / "d2")
    np.testing.assert_array_equal(got["tensors"]["w"], w)
    assert got["tensors"]["w"].dtype == np.float32 and got["tensors"]["w"].shape == (6,)

    emb = got["tables"]["emb"]
    assert emb["ids"].dtype == np.uint64 and emb["values"].shape == (len(emb["ids"]), DIM)
    assert list(emb["ids"]) == sorted(emb["ids"].tolist()), "ascending"
    by_key = dict(zip(emb["ids"].tolist(), emb["values"]))
    present = [k for k in keys.view(np.uint64).tolist() if k in by_key]
    assert set(by_key) <= set(keys.view(np.uint64).tolist()), "no key the job never used"
    evicted = 0
    for k, row in zip(keys.view(np.uint64).tolist(), pulled):
        if k in by_key:
            np.testing.assert_array_equal(by_key[k], row, err_msg=f"key {k}")
        else:
            evicted += 1
            np.testing.assert_array_equal(row, np.full(DIM, EMB_INIT, np.float32), err_msg=f"evicted key {k}")
    assert evicted > 0 and present, f"{evicted} evicted, {len(present)} present"
    # Every key the first export had that is gone now was deleted by a delta.
    before = set(elasticps.load_export(tmp_path / "full")["tables"]["emb"]["ids"].tolist())
    assert before - set(by_key), "some exported keys were evicted since"

    idx = got["tables"]["idx"]
    assert idx["ids"].tolist() == [0, 5, 6, 7, 39], "the rows pushed, each once"
    np.testing.assert_array_equal(idx["values"], rows[idx["ids"].astype(np.int64)])
    untouched = np.setdiff1d(np.arange(IDX_ROWS), idx["ids"].astype(np.int64))
    np.testing.assert_array_equal(rows[untouched], np.full((len(untouched), IDX_DIM), IDX_INIT, np.float32))

    # The chain matters: the full export alone is behind.
    stale = elasticps.load_export(tmp_path / "full")
    assert not np.array_equal(stale["tensors"]["w"], w)
    # Writing over an export is refused.
    p = subprocess.run(
        [cluster.bin, "export", "--scheduler", cluster.addr, "--out", str(tmp_path / "d2")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 1 and "holds an export already" in p.stderr
    tr.w.finish()


def test_broken_exports_raise_clear_errors(tmp_path):
    with pytest.raises(ExportError, match="cannot read the export manifest"):
        elasticps.load_export(tmp_path / "nothing")
    d = tmp_path / "bad"
    d.mkdir()
    (d / "MANIFEST.json").write_text("{not json")
    with pytest.raises(ExportError, match="is not JSON"):
        elasticps.load_export(d)
    (d / "MANIFEST.json").write_text(json.dumps({"format": 9, "tensors": [], "tables": []}))
    with pytest.raises(ExportError, match="format 9"):
        elasticps.load_export(d)
    m = {"format": 1, "parent": None, "tables": [], "tensors": [{"name": "w", "shape": [3], "file": "w.f32"}]}
    (d / "MANIFEST.json").write_text(json.dumps(m))
    (d / "w.f32").write_bytes(np.zeros(2, np.float32).tobytes())
    with pytest.raises(ExportError, match="holds 2 values, the manifest says 3"):
        elasticps.load_export(d)
    m["parent"] = "."
    (d / "w.f32").write_bytes(np.zeros(3, np.float32).tobytes())
    (d / "MANIFEST.json").write_text(json.dumps(m))
    with pytest.raises(ExportError, match="loops back"):
        elasticps.load_export(d)
    m["parent"] = None
    m["tensors"][0]["file"] = "../w.f32"
    (d / "MANIFEST.json").write_text(json.dumps(m))
    with pytest.raises(ExportError, match="names no file inside the export"):
        elasticps.load_export(d)
