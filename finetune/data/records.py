"""Which records a data.format can use, and the checks `validate` runs.

What each format's records hold, and how they become examples, is in the format's
module (finetune/data/formats/); this module applies those checks to sources and
suggests fixes (data.format=..., data.columns.X=...) when columns are missing.
"""

from __future__ import annotations

import difflib
import os
import random

from finetune.config.schema import RecipeConfig, resolve_path
from finetune.data.formats import FORMATS, get_format
from finetune.data.formats.base import Problem
from finetune.data.sources import Source, Spec, _load, eval_spec, load_source, looks_like_hub_name, source_specs
from finetune.errors import DataError


def _column_hint(missing: str, found: list[str], fmt: str, columns: dict[str, str]) -> str:
    fixes: list[str] = []
    # Formats whose required columns are all there, the one that reads the most of them first.
    fits = [f for f in FORMATS.values() if set(f.columns) <= set(found)]
    fits.sort(key=lambda f: -len(set(f.reads) & set(found)))
    fixes += [f"data.format={fits[0].name}"] if fits and fits[0].name != fmt else []
    own = get_format(fmt)
    free = [c for c in found if c not in own.reads]
    cand = next((s for s in own.synonyms.get(missing, ()) if s in free), None)
    cand = cand or next(iter(difflib.get_close_matches(missing, free, n=1, cutoff=0.6)), None)
    if cand or not fixes:
        fixes.append(f"data.columns.{missing}={cand or 'YOUR_COLUMN'}")
    mapped = f" (data.columns maps it from '{columns[missing]}', which is not there)" if missing in columns else ""
    return "set " + " or ".join(fixes) + mapped


def record_problem(rec: dict, fmt: str, columns: dict[str, str]) -> Problem | None:
    """(what is wrong, how to fix) for a record that `fmt` cannot use, else None."""
    f = get_format(fmt)
    missing = next((c for c in f.columns if c not in rec), None)
    if missing:
        found = ", ".join(rec) or "none"
        what = f"has no column '{missing}' needed by data.format={fmt} (found columns: {found})"
        return what, _column_hint(missing, list(rec), fmt, columns)
    return _unencodable_text(rec) or f.problem(rec)


def _unencodable_text(value: object, at: str = "") -> Problem | None:
    """A string no tokenizer can take: a lone UTF-16 surrogate such as "\\ud800" (JSON allows the
    escape; UTF-8 has no encoding for it), found anywhere in the record."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            char = value[exc.start]
            what = f"has text with a lone surrogate \\u{ord(char):04x} at character {exc.start}{' of ' + at if at else ''}"
            return what, "fix the file's encoding (a broken emoji or a cut UTF-16 pair), or data.skip_bad_rows=true to skip it"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _unencodable_text(item, f"{at}.{key}" if at else str(key))
        if found:
            return found
    return None


def to_messages(rec: dict, fmt: str) -> list[dict]:
    """The conversation of a chat format's record as [{"role", "content", ...}, ...]."""
    return get_format(fmt).messages(rec)


def has_reply(message: dict) -> bool:
    """An assistant turn with something to learn: text, or tool calls."""
    return message["role"] == "assistant" and (bool((message["content"] or "").strip()) or bool(message.get("tool_calls")))


def usable_records(source: Source, columns: dict[str, str], skip_bad: bool) -> tuple[list[int], list[str]]:
    """Indices of records the format can use, and descriptions of those skipped (only when skip_bad).

    Without skip_bad, the first bad record raises a DataError naming file and record.
    """
    keep, skipped = [], []
    for i, rec in enumerate(source.records):
        problem = record_problem(rec, source.format, columns)
        if problem is None:
            keep.append(i)
        elif skip_bad:
            skipped.append(f"{source.where(i)} {problem[0]}")
        else:
            raise DataError(f"{source.where(i)} {problem[0]}", hint=problem[1])
    return keep, skipped


def check_data_source(cfg: RecipeConfig) -> list[str]:
    """Problems `finetune validate` can find without a tokenizer; [] when the data looks usable.

    Checks data.path, every data.mix path, data.eval_path and eval.exact_match_path:
    they exist (or look like a hub id, which is not fetched here), are readable and
    non-empty, and their first ~100 records have the columns and types the format needs.
    """
    problems = []
    d = cfg.data
    specs = source_specs(cfg) + [s for s in [eval_spec(cfg)] if s is not None]
    if cfg.eval.exact_match_path:
        specs.append(Spec("eval.exact_match_path", cfg.eval.exact_match_path, d.format, d.columns, d.split, d.subset))
    for spec in specs:
        resolved = resolve_path(spec.path)
        if not os.path.exists(resolved) and looks_like_hub_name(resolved):
            continue  # a hub id: checking it needs the network, which validate must not need
        try:
            # 100 records catch a wrong column or type and stay cheap on a multi-GB file.
            records, origins = _load(spec, limit=100, skipped=[] if d.skip_bad_rows else None)
        except DataError as exc:
            problems.append(f"{exc.message}. {exc.hint}" if exc.hint else exc.message)
            continue
        source = Source(spec.key, records, origins, spec.format)
        for i, rec in enumerate(records):
            problem = record_problem(rec, spec.format, spec.columns)
            if problem and not d.skip_bad_rows:
                # One problem per source: the same mistake usually repeats in every record.
                problems.append(f"{source.where(i)} {problem[0]}; {problem[1]}")
                break
    return problems


Item = tuple[int, int]  # (source index, record index)


def load_usable(spec: Spec, skip_bad_rows: bool) -> tuple[Source, list[int], list[str]]:
    """(source, indices of usable records, descriptions of skipped rows); a source with none usable is an error."""
    src = load_source(spec, skip_bad_rows)
    keep, bad = usable_records(src, src.columns, skip_bad_rows)
    if not keep:
        raise DataError(
            f"{spec.key}: every one of its {len(src.records) + len(src.skipped)} records is malformed; "
            f"first: {(src.skipped + bad)[0]}",
            hint="fix the data, or check this source's format and columns",
        )
    return src, keep, src.skipped + bad


def held_out_indices(n_records: int, cfg: RecipeConfig) -> list[int]:
    """Which of n usable records form the eval split (sorted): max(1, round(n * eval_fraction)), seeded.

    The same function picks them in training and in `finetune eval` (runs/open.py).
    """
    n_eval = max(1, round(n_records * cfg.data.eval_fraction))
    if n_eval >= n_records:
        raise DataError(
            f"data.eval_fraction={cfg.data.eval_fraction} of {n_records} records leaves nothing to train on",
            hint="lower data.eval_fraction or pass data.eval_path=FILE",
        )
    return sorted(random.Random(cfg.seed).sample(range(n_records), n_eval))


def split_held_out(cfg: RecipeConfig, pool: list[Item]) -> tuple[list[Item], list[Item]]:
    """(train, eval) items of the pool of usable records of all sources."""
    chosen = set(held_out_indices(len(pool), cfg))
    return [x for j, x in enumerate(pool) if j not in chosen], [x for j, x in enumerate(pool) if j in chosen]
