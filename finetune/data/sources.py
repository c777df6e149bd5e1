"""Reading records: local .json/.jsonl/.csv/.parquet files, folders of them, hub datasets, mixes.

Local files are read directly (json / csv / pyarrow) rather than through
`datasets`, which would hash the file and write an Arrow cache next to it: reading
a 50k-line JSONL this way takes well under a second and writes nothing. Only hub
names go through `datasets.load_dataset`.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import hashlib
import itertools
import json
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.config import DataConfig, RecipeConfig, resolve_path
from finetune.errors import DataError

SUPPORTED_EXTENSIONS = (".json", ".jsonl", ".csv", ".parquet")

# "owner/name" or "name": what a hub dataset id looks like (a file path usually does not).
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")

Origins = list[tuple[int, str]]  # (index of a file's first record, file): lets errors name file and record


@dataclass
class Source:
    """The records of one dataset (data.path or one data.mix entry), with where each came from."""

    key: str  # recipe key, for messages: "data.path", "data.mix[1].path"
    records: list[dict]
    origins: Origins
    format: str
    weight: float = 1.0
    skipped: list[str] = field(default_factory=list)  # rows skipped as unreadable (data.skip_bad_rows)
    columns: dict[str, str] = field(default_factory=dict)  # its data.columns (already applied; kept for hints)

    def where(self, i: int) -> str:
        start, file = next((o for o in reversed(self.origins) if o[0] <= i), (0, "?"))
        return f"{self.key}: '{file}' record {i - start} (0-based)"


def looks_like_hub_name(path: str) -> bool:
    """True for 'tatsu-lab/alpaca' or 'gsm8k'; False for anything shaped like a local file path."""
    return bool(_HUB_NAME.match(path)) and not path.lower().endswith(SUPPORTED_EXTENSIONS)


def _read_json(path: Path, limit: int | None, skipped: list[str] | None) -> Any:
    with path.open(encoding="utf-8-sig") as f:
        head = f.read(4096)
        if not head.strip():
            raise DataError(f"'{path}' is empty", hint="write one JSON object per line, or a JSON list of objects")
        if head.lstrip().startswith("["):  # one JSON document: the stdlib can only parse it whole
            try:
                data = json.loads(head + f.read())
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"'{path}' is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}",
                    hint="fix the file, or write one JSON object per line (JSONL)",
                ) from None
            return data[:limit] if isinstance(data, list) else data
        f.seek(0)
        rows: list[Any] = []
        for lineno, line in enumerate(f, start=1):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                if not rows and path.suffix.lower() == ".json":
                    # Perhaps one pretty-printed object ({"data": [...]}): parse it whole so the
                    # caller can say what it holds instead of blaming line 1.
                    with contextlib.suppress(json.JSONDecodeError):
                        return json.loads(path.read_text(encoding="utf-8-sig"))
                what = f"'{path}' line {lineno} is not valid JSON: {exc.msg} (column {exc.colno}): {line.strip()[:80]!r}"
                if skipped is not None:
                    skipped.append(what)
                    continue
                raise DataError(
                    what,
                    hint="each line of a JSONL file must be one complete JSON object; "
                    "data.skip_bad_rows=true skips such lines (and counts them)",
                ) from None
        return rows


def _read_csv(path: Path, limit: int | None, skipped: list[str] | None) -> list[dict]:
    with path.open(encoding="utf-8-sig", newline="") as f:
        rows = list(itertools.islice(csv.DictReader(f), limit))
    for row in rows:
        row.pop(None, None)  # cells beyond the header: DictReader files them under the key None
    return rows


def _read_parquet(path: Path, limit: int | None, skipped: list[str] | None) -> list[dict]:
    import pyarrow.parquet as pq  # lazily: only parquet users pay for the import

    if limit is None:
        return pq.read_table(path).to_pylist()
    first = next(pq.ParquetFile(path).iter_batches(batch_size=limit), None)
    return first.to_pylist() if first is not None else []


_READERS = {".json": _read_json, ".jsonl": _read_json, ".csv": _read_csv, ".parquet": _read_parquet}


def _read_file(path: Path, key: str, limit: int | None, skipped: list[str] | None = None) -> list[dict]:
    reader = _READERS.get(path.suffix.lower())
    if reader is None:
        raise DataError(
            f"{key}: '{path}' has unsupported extension '{path.suffix}'",
            hint=f"convert it to one of {', '.join(SUPPORTED_EXTENSIONS)}",
        )
    try:
        rows = reader(path, limit, skipped)
    except DataError as exc:
        raise DataError(f"{key}: {exc.message}", exc.hint) from None
    except Exception as exc:  # OSError, UnicodeDecodeError, csv.Error, pyarrow's own types for corrupt files
        hint = "check the file's permissions, format and encoding (UTF-8)"
        raise DataError(f"{key}: cannot read '{path}': {exc}", hint) from None
    if not isinstance(rows, list):
        found = f"an object with keys {list(rows)[:8]}" if isinstance(rows, dict) else type(rows).__name__
        hint = "store the records as a JSON list or as JSON lines"
        raise DataError(f"{key}: '{path}' holds {found}, not a list of records", hint)
    bad = [i for i, row in enumerate(rows) if not isinstance(row, dict)]
    if bad and skipped is not None:
        skipped.extend(f"'{path}' record {i} (0-based) is a {type(rows[i]).__name__}, not an object" for i in bad)
        rows = [row for row in rows if isinstance(row, dict)]
    elif bad:
        raise DataError(
            f"{key}: '{path}' record {bad[0]} (0-based) is a {type(rows[bad[0]]).__name__}, not an object",
            hint='each record must be an object such as {"instruction": ..., "output": ...}',
        )
    if not rows:
        raise DataError(f"{key}: '{path}' is empty: no records", hint="check that the file is the one you meant")
    return rows


def _files_of(p: Path, key: str) -> list[Path]:
    if not p.is_dir():
        return [p]
    # Sorted, so shards (train-00000.parquet, ...) keep their order; hidden files are OS litter.
    files = sorted(f for f in p.iterdir() if f.suffix.lower() in SUPPORTED_EXTENSIONS and f.name[0] != ".")
    if not files:
        raise DataError(
            f"{key}: folder '{p}' holds no {'/'.join(SUPPORTED_EXTENSIONS)} files "
            f"(found: {sorted(f.name for f in p.iterdir())[:10] or 'nothing'})",
            hint=f"point {key} at a data file or a folder of them",
        )
    return files


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes (streamed: a multi-GB dataset never sits in memory for this)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _load(
    path: str,
    data_cfg: DataConfig,
    key: str,
    limit: int | None = None,
    *,
    columns: dict[str, str] | None = None,
    split: str | None = None,
    skipped: list[str] | None = None,
) -> tuple[list[dict], Origins]:
    """(records with columns remapped, origins)."""
    columns = data_cfg.columns if columns is None else columns
    resolved = resolve_path(path)
    p = Path(resolved)
    records: list[dict] = []
    origins: Origins = []
    if p.exists():
        for f in _files_of(p, key):
            if limit is not None and len(records) >= limit:
                break
            origins.append((len(records), str(f)))
            records.extend(_read_file(f, key, None if limit is None else limit - len(records), skipped))
    elif looks_like_hub_name(resolved):
        origins = [(0, resolved)]
        records = _load_hub(resolved, split or data_cfg.split, key)
    else:
        raise DataError(
            f"{key}: file '{path}' not found (cwd: {os.getcwd()})",
            hint=f"pass an absolute path or {key}=..., or a hub dataset id such as 'tatsu-lab/alpaca'",
        )
    return [_remap(r, columns) for r in records], origins


def content_id(path: str, split: str, key: str) -> str:
    """What identifies a source's content without parsing it: its files' sha256, or a hub fingerprint."""
    resolved = resolve_path(path)
    p = Path(resolved)
    if p.exists():
        return ";".join(f"{f.name}:{file_digest(f)}" for f in _files_of(p, key))
    if looks_like_hub_name(resolved):
        return f"hub:{resolved}:{split}:{_hub_fingerprint(resolved, split, key)}"
    raise DataError(
        f"{key}: file '{path}' not found (cwd: {os.getcwd()})",
        hint=f"pass an absolute path or {key}=..., or a hub dataset id such as 'tatsu-lab/alpaca'",
    )


@functools.lru_cache(maxsize=8)  # the cache key and the records both need it: one load per process
def _hub_dataset(name: str, split: str, key: str) -> Any:
    """The hub dataset (Arrow, memory-mapped: holding it costs little heap)."""
    try:
        import datasets  # lazily: a slow import, and only hub datasets need it

        return datasets.load_dataset(name, split=split)
    except Exception as exc:
        first_line = (str(exc).splitlines() or [""])[0]
        raise DataError(
            f"{key}: '{name}' is not a local path (cwd: {os.getcwd()}) and could not be loaded as a hub dataset: "
            f"{type(exc).__name__}: {first_line}",
            hint=f"pass an existing file or folder, or a hub dataset id and split (data.split={split}); "
            "hub datasets need network access unless already cached",
        ) from None


def _load_hub(name: str, split: str, key: str) -> list[dict]:
    rows = _hub_dataset(name, split, key).to_list()
    if not rows:
        raise DataError(f"{key}: hub dataset '{name}' split '{split}' is empty", hint="choose another data.split")
    return rows


def _hub_fingerprint(name: str, split: str, key: str) -> str:
    """Changes with the downloaded revision, so our tokenized cache follows it."""
    ds = _hub_dataset(name, split, key)
    return str(getattr(ds, "_fingerprint", "")) or hashlib.sha256(repr(ds[:100]).encode()).hexdigest()


def _remap(record: dict, columns: dict[str, str]) -> dict:
    """Apply data.columns (ours -> theirs): {"output": "answer"} turns record["answer"] into record["output"]."""
    if not columns:
        return record
    out = {k: v for k, v in record.items() if k not in set(columns.values())}
    out.update({ours: record[theirs] for ours, theirs in columns.items() if theirs in record})
    return out


def load_records(path: str, data_cfg: DataConfig, *, key: str = "data.path") -> list[dict]:
    """Read a local .json/.jsonl/.csv/.parquet file, a folder of them (sorted by name), or a hub dataset.

    data_cfg.columns is applied to every record. `key` names the recipe key in error
    messages (data.eval_path, eval.exact_match_path, ...).
    """
    return _load(path, data_cfg, key)[0]


def source_specs(cfg: RecipeConfig) -> list[tuple[str, str, str, dict[str, str], str, float]]:
    """(key, path, format, columns, split, weight) of data.path and each data.mix entry."""
    d = cfg.data
    specs = [("data.path", d.path, d.format, d.columns, d.split, d.weight)]
    specs += [
        (f"data.mix[{i}].path", m.path, m.format or d.format, m.columns, m.split or d.split, m.weight)
        for i, m in enumerate(d.mix)
    ]
    return specs


def load_sources(cfg: RecipeConfig) -> list[Source]:
    """data.path and every data.mix entry, read (not yet tokenized)."""
    sources = []
    for key, path, fmt, columns, split, weight in source_specs(cfg):
        skipped: list[str] | None = [] if cfg.data.skip_bad_rows else None
        records, origins = _load(path, cfg.data, key, columns=columns, split=split, skipped=skipped)
        sources.append(Source(key, records, origins, fmt, weight, skipped or [], columns))
    return sources


def weighted_indices(n: int, weight: float, seed: int) -> list[int]:
    """Which records of a source (of n) one epoch uses: weight 1 = all once, 2.5 = all twice plus a seeded half.

    Chosen once, in file order, so data.mix is deterministic and the tokenized cache stays valid.
    """
    whole, frac = divmod(weight, 1.0)
    extra = sorted(random.Random(seed).sample(range(n), round(n * frac))) if frac else []
    return list(range(n)) * int(whole) + extra
