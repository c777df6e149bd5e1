"""build_datasets: load -> check records -> split eval -> weight -> tokenize and mask -> check masks -> truncate -> pack.

    from finetune.data import build_datasets, Collator
    bundle = build_datasets(cfg, tokenizer)
    print(bundle.train_stats.summary())
    batch = Collator(pad_token_id=tokenizer.pad_token_id)(bundle.train[:4])
"""

from __future__ import annotations

import multiprocessing
import os
import random
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from finetune.config import RecipeConfig, resolve_path
from finetune.data.cache import cache_key, cache_root, read_cache, write_cache
from finetune.data.dataset import DataBundle, DataStats, TokenizedData
from finetune.data.masks import FIXES, Finding, enforce, example_findings, merge_findings
from finetune.data.packing import pack_rows
from finetune.data.records import usable_records
from finetune.data.sources import Source, _load, content_id, load_sources, looks_like_hub_name, source_specs, weighted_indices
from finetune.data.templates import end_of_turn_ids, use_template
from finetune.data.tokenize import CHAT_FORMATS, IGNORE_INDEX, Encoded, encode_records
from finetune.errors import DataError

Item = tuple[int, int]  # (source index, record index)
_CHUNK = 2000  # records per tokenizing task: big enough for batched tokenizer calls, small enough to balance
_worker_tokenizer: Any = None


def _init_worker(tokenizer: Any) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _encode_task(args: tuple[list[dict], str, str, list[str]]) -> list[Encoded | None]:
    records, fmt, train_on, wheres = args
    return encode_records(records, fmt, _worker_tokenizer, train_on, wheres)


def _encode_items(items: list[Item], sources: list[Source], tokenizer: Any, train_on: str, num_proc: int) -> dict[Item, Encoded | None]:
    """Tokenize each distinct item once, in chunks of one source (one format), on num_proc processes."""
    tasks, keys = [], []
    by_source: dict[int, list[int]] = {}
    for s, i in dict.fromkeys(items):
        by_source.setdefault(s, []).append(i)
    for s, idx in by_source.items():
        src = sources[s]
        for c in range(0, len(idx), _CHUNK):
            chunk = idx[c : c + _CHUNK]
            wheres = [src.where(i) for i in chunk] if src.format in CHAT_FORMATS else [src.key] * len(chunk)
            tasks.append(([src.records[i] for i in chunk], src.format, train_on, wheres))
            keys.append([(s, i) for i in chunk])
    if num_proc > 1 and len(tasks) > 1:
        # fork: workers inherit the tokenizer instead of unpickling one each.
        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
        with ProcessPoolExecutor(min(num_proc, len(tasks)), mp_context=ctx, initializer=_init_worker, initargs=(tokenizer,)) as pool:
            results = list(pool.map(_encode_task, tasks))
    else:
        _init_worker(tokenizer)
        results = [_encode_task(t) for t in tasks]
    return {k: enc for ks, encs in zip(keys, results) for k, enc in zip(ks, encs)}


def _finish(
    items: list[Item],
    encoded: dict[Item, Encoded | None],
    sources: list[Source],
    cfg: RecipeConfig,
    tokenizer: Any,
    findings: dict[str, Finding],
    skipped: int,
    pack: bool,
) -> tuple[TokenizedData, DataStats]:
    """Mask-check, truncate (or drop) and count the encoded items, then store (and pack) them."""
    d = cfg.data
    bos = getattr(tokenizer, "bos_token_id", None)
    ends = set(end_of_turn_ids(tokenizer))
    stats = DataStats(0, 0, 0, 0, 0, skipped=skipped)
    examples: list[tuple[list[int], list[int]]] = []
    checked: set[Item] = set()
    for item in items:
        enc = encoded[item]
        if enc is None:  # empty reply: nothing to learn
            stats.dropped += 1
            continue
        if item not in checked:  # a weighted repeat is the same example: count its findings once
            checked.add(item)
            kinds = example_findings(enc, sources[item[0]].format in CHAT_FORMATS, d.train_on, bos, ends)
            if kinds:
                merge_findings(findings, kinds, tokenizer, enc, sources[item[0]].where(item[1]))
        ids, labels = enc.input_ids, enc.labels
        if len(ids) > d.max_seq_len:
            if d.truncation == "drop":
                stats.too_long += 1
                continue
            ids, labels = ids[: d.max_seq_len], labels[: d.max_seq_len]
            if labels.count(IGNORE_INDEX) == len(labels):  # the prompt alone fills max_seq_len
                stats.dropped += 1
                continue
            stats.truncated += 1
        elif labels.count(IGNORE_INDEX) == len(labels):
            stats.dropped += 1  # (also a mask-check finding: a non-empty reply with nothing trained)
            continue
        stats.tokens += len(ids)
        stats.trained_tokens += len(labels) - labels.count(IGNORE_INDEX)
        examples.append((ids, labels))
    stats.examples = len(examples)
    if not pack or not examples:
        return TokenizedData.from_examples(examples), stats
    rows = pack_rows([len(ids) for ids, _ in examples], d.max_seq_len)
    stats.rows, stats.row_capacity = len(rows), d.max_seq_len
    return TokenizedData.from_examples(examples, rows), stats


def _split_eval(cfg: RecipeConfig, pool: list[Item]) -> tuple[list[Item], list[Item]]:
    """(train, eval) items: eval is max(1, round(n * eval_fraction)) items chosen with random.Random(seed)."""
    n_eval = max(1, round(len(pool) * cfg.data.eval_fraction))
    if n_eval >= len(pool):
        raise DataError(
            f"data.eval_fraction={cfg.data.eval_fraction} of {len(pool)} records leaves nothing to train on",
            hint="lower data.eval_fraction or pass data.eval_path=FILE",
        )
    chosen = set(random.Random(cfg.seed).sample(range(len(pool)), n_eval))
    return [x for j, x in enumerate(pool) if j not in chosen], [x for j, x in enumerate(pool) if j in chosen]


def _content_ids(cfg: RecipeConfig) -> list[str]:
    ids = [content_id(path, split, key) for key, path, _, _, split, _ in source_specs(cfg)]
    if cfg.data.eval_path:
        ids.append("eval:" + content_id(cfg.data.eval_path, cfg.data.split, "data.eval_path"))
    return ids


def build_datasets(cfg: RecipeConfig, tokenizer: Any, *, use_cache: bool | None = None) -> DataBundle:
    """The train (and eval) data of a recipe, tokenized, masked, checked and (with data.packing) packed.

    Eval data comes from data.eval_path when set, else from a seeded split of the
    usable records of all sources (before data.mix weights repeat any). Examples stay
    in file order (sources in recipe order); shuffling is the trainer's. With
    data.template set to a built-in, the tokenizer's chat_template is set to it (so
    the tokenizer saved with the adapter renders prompts as training did).
    use_cache defaults to data.cache.
    """
    d = cfg.data
    formats = {fmt for _, _, fmt, _, _, _ in source_specs(cfg)}
    if formats & set(CHAT_FORMATS) or d.template != "auto":
        use_template(tokenizer, d.template)

    use_cache = d.cache if use_cache is None else use_cache
    entry = cache_root(cfg) / cache_key(cfg, tokenizer, _content_ids(cfg)) if use_cache else None
    cached = read_cache(entry) if entry is not None else None
    if cached is not None:
        data, stats, raw_findings = cached
        findings = {f["kind"]: Finding(**f) for f in raw_findings}
        stats["train"].warnings += enforce(findings, d.mask_check)
        return DataBundle(data["train"], data["eval"], stats["train"], stats["eval"], from_cache=True)

    sources = load_sources(cfg)
    skipped = {"train": [], "eval": []}
    usable: list[list[int]] = []
    for src in sources:
        keep, bad = usable_records(src, src.columns, d.skip_bad_rows)
        usable.append(keep)
        skipped["train"] += src.skipped + bad
    pool = [(s, i) for s, keep in enumerate(usable) for i in keep]
    if not pool:
        raise DataError(
            f"data: every record was skipped as malformed ({len(skipped['train'])}); first: {skipped['train'][0]}",
            hint="fix the data, or check data.format and data.columns",
        )
    eval_items: list[Item] = []
    if d.eval_path:  # loaded before any tokenizing, so a wrong path fails at once
        eval_cfg = cfg.model_copy(update={"data": d.model_copy(update={"path": d.eval_path, "mix": [], "weight": 1.0})})
        ev = load_sources(eval_cfg)[0]
        ev.key = "data.eval_path"
        keep, bad = usable_records(ev, d.columns, d.skip_bad_rows)
        skipped["eval"] += ev.skipped + bad
        sources.append(ev)
        eval_items = [(len(sources) - 1, i) for i in keep]
        train_pool = pool
    elif d.eval_fraction > 0:
        train_pool, eval_items = _split_eval(cfg, pool)
    else:
        train_pool = pool

    train_items: list[Item] = []
    for s in range(len(usable)):
        mine = [i for src, i in train_pool if src == s]
        train_items += [(s, mine[j]) for j in weighted_indices(len(mine), sources[s].weight, cfg.seed + s)]

    encoded = _encode_items(train_items + eval_items, sources, tokenizer, d.train_on, d.num_proc)
    findings: dict[str, Finding] = {}
    train, train_stats = _finish(train_items, encoded, sources, cfg, tokenizer, findings, len(skipped["train"]), d.packing)
    if not len(train):
        raise DataError(
            f"data.path: no training examples left: {train_stats.dropped} of {len(train_items)} dropped "
            f"(empty response, or nothing trained within data.max_seq_len={d.max_seq_len})"
            + (f", {train_stats.too_long} longer than data.max_seq_len" if train_stats.too_long else ""),
            hint="raise data.max_seq_len (or data.truncation=truncate), or check that the response column holds the answers",
        )
    evals, eval_stats = None, None
    if eval_items or d.eval_path:
        evals, eval_stats = _finish(eval_items, encoded, sources, cfg, tokenizer, findings, len(skipped["eval"]), False)
        if not len(evals):
            key = "data.eval_path" if d.eval_path else "data.path"
            raise DataError(
                f"{key}: no eval examples left: all {eval_stats.dropped + eval_stats.too_long} were dropped",
                hint="raise data.max_seq_len, or check the eval data's response column",
            )
    train_stats.warnings = [f"skipped: {s}" for s in (skipped["train"] + skipped["eval"])[:5]]
    if entry is not None:  # findings are stored, not enforced, so a later data.mask_check still applies
        write_cache(entry, {"train": train, "eval": evals}, {"train": train_stats, "eval": eval_stats},
                    [f.__dict__ for f in findings.values()])
    train_stats.warnings += enforce(findings, d.mask_check)
    return DataBundle(train, evals, train_stats, eval_stats)



def check_sample(cfg: RecipeConfig, tokenizer: Any, limit: int = 64) -> list[str]:
    """The mask checker on the first `limit` records of each local source: what `validate` can say in a second.

    Record-shape problems are check_data_source's to report; rows it would refuse are skipped here.
    """
    d = cfg.data
    formats = {fmt for _, _, fmt, _, _, _ in source_specs(cfg)}
    try:
        if formats & set(CHAT_FORMATS) or d.template != "auto":
            use_template(tokenizer, d.template)
    except DataError as exc:
        return [f"{exc.message}. {exc.hint}"]
    problems = []
    for key, path, fmt, columns, split, _ in source_specs(cfg):
        if not os.path.exists(resolve_path(path)) and looks_like_hub_name(resolve_path(path)):
            continue  # hub: validate does not fetch
        try:
            records, origins = _load(path, d, key, limit=limit, columns=columns, skipped=[])
            src = Source(key, records, origins, fmt, columns=columns)
            keep, _ = usable_records(src, columns, skip_bad=True)
            encoded = _encode_items([(0, i) for i in keep], [src], tokenizer, d.train_on, 1)
            findings: dict[str, Finding] = {}
            _finish([(0, i) for i in keep], encoded, [src], cfg, tokenizer, findings, 0, False)
        except DataError as exc:
            problems.append(f"{exc.message}. {exc.hint}" if exc.hint else exc.message)
            continue
        if d.mask_check == "error":
            problems += [f"{key}: mask check on the first {len(keep)} records: {f.describe()}. {FIXES[f.kind]}" for f in findings.values()]
    return problems
