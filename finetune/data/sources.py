"""Reading records: local .json/.jsonl/.csv/.parquet files, folders of them, hub datasets, mixes.

Local files are read directly (json / csv / pyarrow) rather than through
`datasets`, which would hash the file and write an Arrow cache next to it: reading
a 50k-line JSONL this way takes well under a second and writes nothing. Only hub
names go through `datasets.load_dataset`.
"""

from __future__ import annotations

import bisect
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

from finetune.config.schema import DataConfig, RecipeConfig, resolve_path
from finetune.errors import DataError

SUPPORTED_EXTENSIONS = (".json", ".jsonl", ".csv", ".parquet")

# "owner/name" or "name": what a hub dataset id looks like (a file path usually does not).
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")

# (index of a file's first record, file, line of each record or None): lets errors name file and line/record.
Origins = list[tuple[int, str, "list[int] | None"]]


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

    @functools.cached_property
    def _file_starts(self) -> list[int]:
        # Errors name records of sources with thousands of shards: a binary search, not a scan.
        return [o[0] for o in self.origins]

    def folder(self, i: int) -> Path | None:
        """The folder of the local file record i came from (relative image paths start there), or None."""
        k = bisect.bisect_right(self._file_starts, i) - 1
        file = Path(self.origins[k][1]) if k >= 0 else None
        return file.parent if file is not None and file.is_file() else None

    def where(self, i: int) -> str:
        """'data.path: 'train.jsonl' line 12' (JSONL) or '... record 11 (0-based)' (other files)."""
        k = bisect.bisect_right(self._file_starts, i) - 1
        start, file, lines = self.origins[k] if k >= 0 else (0, "?", None)
        if lines is not None:
            return f"{self.key}: '{file}' line {lines[i - start]}"
        return f"{self.key}: '{file}' record {i - start} (0-based)"


def looks_like_hub_name(path: str) -> bool:
    """True for 'tatsu-lab/alpaca' or 'gsm8k'; False for anything shaped like a local file path."""
    return bool(_HUB_NAME.match(path)) and not path.lower().endswith(SUPPORTED_EXTENSIONS)


def _read_json(path: Path, limit: int | None, skipped: list[str] | None, lines: list[int] | None = None) -> Any:
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
                if lines is not None:
                    lines.append(lineno)
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


def _read_csv(path: Path, limit: int | None, skipped: list[str] | None, lines: list[int] | None = None) -> list[dict]:
    with path.open(encoding="utf-8-sig", newline="") as f:
        rows = list(itertools.islice(csv.DictReader(f), limit))
    for row in rows:
        row.pop(None, None)  # cells beyond the header: DictReader files them under the key None
    return rows


def _read_parquet(path: Path, limit: int | None, skipped: list[str] | None, lines: list[int] | None = None) -> list[dict]:
    import pyarrow.parquet as pq  # lazily: only parquet users pay for the import

    if limit is None:
        return pq.read_table(path).to_pylist()
    first = next(pq.ParquetFile(path).iter_batches(batch_size=limit), None)
    return first.to_pylist() if first is not None else []


_READERS = {".json": _read_json, ".jsonl": _read_json, ".csv": _read_csv, ".parquet": _read_parquet}


def _read_file(
    path: Path, key: str, limit: int | None, skipped: list[str] | None = None, lines: list[int] | None = None
) -> list[dict]:
    """Records of one file; `lines` (JSONL only) receives each record's line number."""
    reader = _READERS.get(path.suffix.lower())
    if reader is None:
        raise DataError(
            f"{key}: '{path}' has unsupported extension '{path.suffix}'",
            hint=f"convert it to one of {', '.join(SUPPORTED_EXTENSIONS)}",
        )
    try:
        rows = reader(path, limit, skipped, lines)
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
        at = (lambda i: f"line {lines[i]}") if lines else (lambda i: f"record {i} (0-based)")
        skipped.extend(f"'{path}' {at(i)} is a {type(rows[i]).__name__}, not an object" for i in bad)
        if lines:
            lines[:] = [n for n, row in zip(lines, rows) if isinstance(row, dict)]
        rows = [row for row in rows if isinstance(row, dict)]
    elif bad:
        where = f"line {lines[bad[0]]}" if lines else f"record {bad[0]} (0-based)"
        raise DataError(
            f"{key}: '{path}' {where} is a {type(rows[bad[0]]).__name__}, not an object",
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


@dataclass
class Spec:
    """Where one source comes from and how to read it: data.path, a data.mix entry, or data.eval_path."""

    key: str
    path: str
    format: str
    columns: dict[str, str]
    split: str
    subset: str | None = None
    weight: float = 1.0


def _load(spec: Spec, limit: int | None = None, skipped: list[str] | None = None) -> tuple[list[dict], Origins]:
    """(records with columns remapped, origins)."""
    resolved = resolve_path(spec.path)
    p = Path(resolved)
    records: list[dict] = []
    origins: Origins = []
    if p.exists():
        for f in _files_of(p, spec.key):
            if limit is not None and len(records) >= limit:
                break
            lines: list[int] = []
            start = len(records)
            records.extend(_read_file(f, spec.key, None if limit is None else limit - len(records), skipped, lines))
            # JSON lists and non-JSON files have no lines per record: name records by index there.
            origins.append((start, str(f), lines if len(lines) == len(records) - start else None))
    elif looks_like_hub_name(resolved):
        origins = [(0, resolved, None)]
        records = _load_hub(resolved, spec.subset, spec.split, spec.key)[:limit]
    else:
        raise _not_found(spec)
    return [_remap(r, spec.columns) for r in records], origins


def _not_found(spec: Spec) -> DataError:
    return DataError(
        f"{spec.key}: file '{spec.path}' not found (cwd: {os.getcwd()})",
        hint=f"pass an absolute path or {spec.key}=..., or a hub dataset id such as 'tatsu-lab/alpaca'",
    )


def content_id(spec: Spec) -> str:
    """What identifies a source's content without parsing it: its files' sha256, or a hub fingerprint."""
    resolved = resolve_path(spec.path)
    p = Path(resolved)
    if p.exists():
        return ";".join(f"{f.name}:{file_digest(f)}" for f in _files_of(p, spec.key))
    if looks_like_hub_name(resolved):
        ds = _hub_dataset(resolved, spec.subset, spec.split, spec.key)
        # datasets' fingerprint changes with the downloaded revision, so our tokenized cache follows it.
        fingerprint = str(getattr(ds, "_fingerprint", "")) or hashlib.sha256(repr(ds[:100]).encode()).hexdigest()
        return f"hub:{resolved}:{spec.subset}:{spec.split}:{fingerprint}"
    raise _not_found(spec)


@functools.lru_cache(maxsize=8)  # the cache key and the records both need it: one load per process
def _hub_dataset(name: str, subset: str | None, split: str, key: str) -> Any:
    """The hub dataset (Arrow, memory-mapped: holding it costs little heap)."""
    try:
        import datasets  # lazily: a slow import, and only hub datasets need it

        return datasets.load_dataset(name, subset, split=split) if subset else datasets.load_dataset(name, split=split)
    except Exception as exc:
        first_line = (str(exc).splitlines() or [""])[0]
        raise DataError(
            f"{key}: '{name}' is not a local path (cwd: {os.getcwd()}) and could not be loaded as a hub dataset: "
            f"{type(exc).__name__}: {first_line}",
            hint=f"pass an existing file or folder, or a hub dataset id with its split (data.split={split}) and, "
            "for datasets with several configurations, data.subset=NAME; hub datasets need network access unless cached",
        ) from None


def _load_hub(name: str, subset: str | None, split: str, key: str) -> list[dict]:
    rows = _hub_dataset(name, subset, split, key).to_list()
    if not rows:
        raise DataError(f"{key}: hub dataset '{name}' split '{split}' is empty", hint="choose another data.split")
    return rows


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
    spec = Spec(key, path, data_cfg.format, data_cfg.columns, data_cfg.split, data_cfg.subset)
    return _load(spec)[0]


def source_specs(cfg: RecipeConfig) -> list[Spec]:
    """data.path and each data.mix entry (a mix entry inherits format, columns, split and subset it leaves unset)."""
    d = cfg.data
    specs = [Spec("data.path", d.path, d.format, d.columns, d.split, d.subset, d.weight)]
    for i, m in enumerate(d.mix):
        columns = d.columns if m.columns is None else m.columns
        specs.append(Spec(f"data.mix[{i}].path", m.path, m.format or d.format, columns, m.split or d.split, m.subset, m.weight))
    return specs


def eval_spec(cfg: RecipeConfig) -> Spec | None:
    d = cfg.data
    return Spec("data.eval_path", d.eval_path, d.format, d.columns, d.split, d.subset) if d.eval_path else None


def load_source(spec: Spec, skip_bad_rows: bool) -> Source:
    skipped: list[str] | None = [] if skip_bad_rows else None
    records, origins = _load(spec, skipped=skipped)
    return Source(spec.key, records, origins, spec.format, spec.weight, skipped or [], spec.columns)


def weighted_indices(n: int, weight: float, seed: int) -> list[int]:
    """Which records of a source (of n) one epoch uses: weight 1 = all once, 2.5 = all twice plus a seeded half.

    Chosen once, in file order, so data.mix is deterministic and the tokenized cache stays valid.
    """
    whole, frac = divmod(weight, 1.0)
    extra = sorted(random.Random(seed).sample(range(n), round(n * frac))) if frac else []
    return list(range(n)) * int(whole) + extra
