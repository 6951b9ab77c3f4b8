"""Reading what ``elasticps export`` writes (docs/EXPORT.md): a full export, or a delta
and the chain of exports it follows, as numpy arrays for serving.

::

    import elasticps
    model = elasticps.load_export("exports/d2")   # follows d2 -> d1 -> full
    w = model["tensors"]["fc.weight"]             # np.ndarray of the tensor's shape
    emb = model["tables"]["emb"]
    emb["ids"], emb["values"]                     # uint64 keys ascending, float32 [n, dim]

A key a table does not list is one the servers do not hold (never pushed, or evicted):
its pull reads the table's initializer.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List, Union

import numpy as np

__all__ = ["ExportError", "load_export", "MANIFEST", "FORMAT"]

#: The manifest's name in an export's directory.
MANIFEST = "MANIFEST.json"
#: The manifest format this module reads.
FORMAT = 1
#: Longest chain of deltas followed (a cycle of ``parent`` links is an error).
MAX_CHAIN = 100_000


class ExportError(ValueError):
    """An export that cannot be read: a missing or corrupt manifest or shard."""


def _manifest(dir: Path) -> dict:
    path = dir / MANIFEST
    try:
        text = path.read_text()
    except OSError as e:
        raise ExportError(f"cannot read the export manifest {path}: {e.strerror or e} (is {dir} an export?)") from None
    try:
        m = json.loads(text)
    except ValueError as e:
        raise ExportError(f"{path} is not JSON: {e}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        got = m.get("format") if isinstance(m, dict) else None
        raise ExportError(f"{path} is an export manifest of format {got!r}; this reads format {FORMAT}")
    for key in ("tensors", "tables"):
        if not isinstance(m.get(key), list):
            raise ExportError(f"{path} has no {key!r} list")
    return m


def _array(dir: Path, file: object, dtype, count: int, what: str) -> np.ndarray:
    if not isinstance(file, str) or not file or os.path.isabs(file) or ".." in Path(file).parts:
        raise ExportError(f"{dir / MANIFEST}: {what} names no file inside the export ({file!r})")
    path = dir / file
    try:
        data = np.fromfile(path, dtype=np.dtype(dtype).newbyteorder("<"))
    except OSError as e:
        raise ExportError(f"cannot read {path} ({what}): {e.strerror or e}") from None
    if count >= 0 and data.size != count:
        raise ExportError(f"{path} ({what}) holds {data.size} values, the manifest says {count}")
    return data.astype(dtype, copy=False)


def _chain(dir: Path) -> List[Path]:
    """The exports from the full one to ``dir``."""
    chain = [dir]
    seen = {dir.resolve()}
    while True:
        parent = _manifest(chain[-1]).get("parent")
        if parent is None:
            return list(reversed(chain))
        if not isinstance(parent, str):
            raise ExportError(f"{chain[-1] / MANIFEST}: parent {parent!r} is not a path")
        p = Path(parent)
        nxt = p if p.is_absolute() else chain[-1] / p
        if nxt.resolve() in seen or len(chain) >= MAX_CHAIN:
            raise ExportError(f"{chain[-1] / MANIFEST}: the chain of parents loops back to {nxt}")
        seen.add(nxt.resolve())
        chain.append(nxt)


def load_export(dir: Union[str, os.PathLike]) -> Dict[str, dict]:
    """The values an export holds, with every delta before it applied.

    Follows the ``parent`` links of ``dir``'s manifest back to a full export (relative
    paths are resolved against the directory of the manifest that names them), then
    applies each export from the oldest on: a table's rows overwrite the ones before, its
    deleted keys are removed; dense tensors are whole in every export (the last one's).

    Returns ``{"tensors": {name: np.ndarray (float32, the tensor's shape)}, "tables":
    {name: {"ids": np.ndarray (uint64, ascending), "values": np.ndarray (float32,
    [len(ids), dim]), "dim": int, "hashed": bool}}}``. Raises :class:`ExportError` for a
    missing or corrupt manifest or shard.
    """
    chain = _chain(Path(dir))
    tensors: Dict[str, np.ndarray] = {}
    tables: Dict[str, dict] = {}
    rows: Dict[str, Dict[int, np.ndarray]] = {}
    for d in chain:
        m = _manifest(d)
        tensors = {}
        for t in m["tensors"]:
            try:
                name, shape = str(t["name"]), tuple(int(s) for s in t["shape"])
            except (KeyError, TypeError, ValueError):
                raise ExportError(f"{d / MANIFEST}: a tensor entry without a name and a shape: {t!r}") from None
            n = int(np.prod(shape, dtype=np.int64))
            tensors[name] = _array(d, t.get("file"), np.float32, n, f"tensor {name!r}").reshape(shape)
        for t in m["tables"]:
            try:
                name, dim, hashed, shards = str(t["name"]), int(t["dim"]), bool(t["hashed"]), list(t["shards"])
            except (KeyError, TypeError, ValueError):
                raise ExportError(f"{d / MANIFEST}: a table entry without name, dim, hashed and shards: {t!r}") from None
            if dim < 1:
                raise ExportError(f"{d / MANIFEST}: table {name!r} has dim {dim}")
            prev = tables.get(name)
            if prev is not None and prev["dim"] != dim:
                raise ExportError(f"{d / MANIFEST}: table {name!r} has dim {dim}, its parent's has {prev['dim']}")
            tables[name] = {"dim": dim, "hashed": hashed}
            table = rows.setdefault(name, {})
            for s in shards:
                what = f"table {name!r} block {s.get('block')!r}"
                try:
                    n = int(s["rows"])
                except (KeyError, TypeError, ValueError):
                    raise ExportError(f"{d / MANIFEST}: {what} has no row count") from None
                ids = _array(d, s.get("ids"), np.uint64, n, f"{what} ids")
                values = _array(d, s.get("values"), np.float32, n * dim, f"{what} values").reshape(n, dim)
                for k in _array(d, s.get("deleted"), np.uint64, -1, f"{what} deleted keys").tolist():
                    table.pop(k, None)
                for k, v in zip(ids.tolist(), values):
                    table[k] = v
    out_tables = {}
    for name, meta in tables.items():
        keys = sorted(rows[name])
        dim = meta["dim"]
        values = np.stack([rows[name][k] for k in keys]) if keys else np.empty((0, dim), np.float32)
        out_tables[name] = {
            "ids": np.asarray(keys, dtype=np.uint64),
            "values": values.astype(np.float32, copy=False),
            "dim": dim,
            "hashed": meta["hashed"],
        }
    return {"tensors": tensors, "tables": out_tables}
