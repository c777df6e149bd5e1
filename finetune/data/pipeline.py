"""build_datasets: load -> check records -> split eval -> weight -> tokenize and mask -> check masks -> truncate -> pack.

from finetune.data import build_datasets, Collator
bundle = build_datasets(cfg, tokenizer)
print(bundle.train_stats.summary())
batch = Collator(pad_token_id=tokenizer.pad_token_id)(bundle.train[:4])
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from finetune.config.schema import RecipeConfig, resolve_path
from finetune.data.cache import cache_key, cache_root, read_cache, write_cache
from finetune.data.dataset import DataBundle, DataStats, TokenizedData
from finetune.data.formats import FORMATS, get_format
from finetune.data.images import absolute_images, image_token_ids, processor_of
from finetune.data.masks import FIXES, Finding, enforce, example_findings, merge_findings
from finetune.data.packing import pack_rows
from finetune.data.pairs import EncodedPair, PreferencePairs, encode_pairs
from finetune.data.records import Item, load_usable, split_held_out, usable_records
from finetune.data.sources import (
    Source,
    _load,
    content_id,
    eval_spec,
    looks_like_hub_name,
    source_specs,
    weighted_indices,
)
from finetune.data.templates import end_of_turn_ids, use_template
from finetune.data.tokenize import CHAT_FORMATS, IGNORE_INDEX, Encoded, encode_records
from finetune.errors import DataError

# Formats whose errors name the source only: prompt/response records (one batched tokenizer call).
PLAIN_FORMATS = tuple(name for name, f in FORMATS.items() if not f.chat and f.pairs is None)
_CHUNK = 2000  # records per tokenizing task: big enough for batched tokenizer calls, small enough to balance
_worker_tokenizer: Any = None


def _init_worker(tokenizer: Any) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _encode_task(args: tuple[list[dict], str, str, list[str], int, list[Path | None]]) -> list[Encoded | EncodedPair | None]:
    records, fmt, train_on, wheres, max_len, folders = args
    if get_format(fmt).pairs is not None:  # each side as its own format trains it; train_on does not apply
        return list(encode_pairs(records, fmt, _worker_tokenizer, wheres, max_len))
    return list(encode_records(records, fmt, _worker_tokenizer, train_on, wheres, max_len, folders))


def _encode_items(
    items: list[Item], sources: list[Source], tokenizer: Any, train_on: str, num_proc: int, max_len: int
) -> dict[Item, Encoded | EncodedPair | None]:
    """Tokenize each distinct item once, in chunks of one source (one format), on num_proc processes."""
    tasks, keys = [], []
    by_source: dict[int, list[int]] = {}
    for s, i in dict.fromkeys(items):
        by_source.setdefault(s, []).append(i)
    for s, idx in by_source.items():
        src = sources[s]
        for c in range(0, len(idx), _CHUNK):
            chunk = idx[c : c + _CHUNK]
            wheres = [src.where(i) for i in chunk] if src.format not in PLAIN_FORMATS else [src.key] * len(chunk)
            chat = get_format(src.format).chat
            folders: list[Path | None] = [src.folder(i) if chat else None for i in chunk]
            tasks.append(([src.records[i] for i in chunk], src.format, train_on, wheres, max_len, folders))
            keys.append([(s, i) for i in chunk])
    if num_proc > 1 and len(tasks) > 1:
        # fork: workers inherit the tokenizer instead of unpickling one each.
        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
        with ProcessPoolExecutor(
            min(num_proc, len(tasks)), mp_context=ctx, initializer=_init_worker, initargs=(tokenizer,)
        ) as pool:
            results = list(pool.map(_encode_task, tasks))
    else:
        _init_worker(tokenizer)
        results = [_encode_task(t) for t in tasks]
    return {k: enc for ks, encs in zip(keys, results) for k, enc in zip(ks, encs)}


def _finish(
    items: list[Item],
    encoded: dict[Item, Encoded | EncodedPair | None],
    sources: list[Source],
    cfg: RecipeConfig,
    tokenizer: Any,
    findings: dict[str, Finding],
    skipped: int,
    pack: bool,
) -> tuple[TokenizedData | PreferencePairs, DataStats]:
    """Mask-check, truncate (or drop) and count the encoded items, then store (and pack) them."""
    d = cfg.data
    bos = getattr(tokenizer, "bos_token_id", None)
    ends = set(end_of_turn_ids(tokenizer))
    pairs = get_format(d.format).pairs is not None  # (objectives: pair data is never mixed with other formats)
    stats = DataStats(0, 0, 0, 0, 0, skipped=skipped)
    examples: list[tuple[list[int], list[int]]] = []
    images: list[list[str]] = []  # each example's image files (vision-language data)
    processor = processor_of(tokenizer)
    image_ids = image_token_ids(processor) if processor is not None else set()
    checked: set[Item] = set()
    flagged: set[Item] = set()
    for item in items:
        enc = encoded[item]
        if enc is None:  # empty reply: nothing to learn
            stats.dropped += 1
            continue
        fmt = sources[item[0]].format
        if item not in checked:  # a weighted repeat is the same example: count its findings once
            checked.add(item)
            for side, chat, train_on in _checked_sides(enc, fmt in CHAT_FORMATS, d.train_on):
                kinds = example_findings(side, chat, train_on, bos, ends)
                if kinds:
                    merge_findings(findings, kinds, tokenizer, side, sources[item[0]].where(item[1]))
                    flagged.add(item)
        if item in flagged and d.mask_check == "drop":
            stats.mask_dropped += 1
            continue
        sides = enc.sides if isinstance(enc, EncodedPair) else (enc,)
        results = [_fit(side, d.max_seq_len, d.truncation, image_ids) for side in sides]
        lost = [r for r in results if isinstance(r, str)]
        if lost:  # a pair goes whole, or not at all
            stats.too_long += lost[0] == "too_long"
            stats.dropped += lost[0] == "dropped"
            continue
        fitted = [r for r in results if not isinstance(r, str)]
        stats.truncated += any(cut for _, _, cut in fitted)
        for ids, labels, _ in fitted:
            stats.tokens += len(ids)
            stats.trained_tokens += len(labels) - labels.count(IGNORE_INDEX)
            examples.append((ids, labels))
        images += [side.images for side in sides]
    stats.examples = len(examples) // (2 if pairs else 1)
    if pairs:
        return PreferencePairs(TokenizedData.from_examples(examples)), stats
    if not pack or not examples:
        return TokenizedData.from_examples(examples, images=images), stats
    rows = pack_rows([len(ids) for ids, _ in examples], d.max_seq_len)
    stats.rows, stats.row_capacity = len(rows), d.max_seq_len
    return TokenizedData.from_examples(examples, rows), stats


def _checked_sides(enc: Encoded | EncodedPair, chat: bool, train_on: str) -> list[tuple[Encoded, bool, str]]:
    """What the mask checker judges: the example, or each side of a pair as its format trains it."""
    if isinstance(enc, EncodedPair):
        return [(side, enc.chat, enc.train_on) for side in enc.sides]
    return [(enc, chat, train_on)]


def _fit(enc: Encoded, max_len: int, truncation: str, image_ids: set[int]) -> tuple[list[int], list[int], bool] | str:
    """(ids, labels, truncated) within max_len, or why the example is left out: "too_long"
    (data.truncation=drop, or a cut through an image's tokens: the model needs all of them) or "dropped"
    (nothing trained within max_len)."""
    ids, labels, cut = enc.input_ids, enc.labels, False
    if len(ids) > max_len:
        if truncation == "drop" or (enc.images and any(t in image_ids for t in ids[max_len:])):
            return "too_long"
        ids, labels, cut = ids[:max_len], labels[:max_len], True
    if labels.count(IGNORE_INDEX) == len(labels):  # (also a mask-check finding for a non-empty reply)
        return "dropped"
    return ids, labels, cut


def held_out_records(cfg: RecipeConfig) -> list[dict]:
    """The records data.eval_fraction held out in training (all sources, bad rows skipped as training did)."""
    sources, pool = [], []
    for s, spec in enumerate(source_specs(cfg)):
        src, keep, _ = load_usable(spec, cfg.data.skip_bad_rows)
        sources.append(src)
        pool += [(s, i) for i in keep]
    formats = {src.format for src in sources}
    if len(formats) > 1:
        raise DataError(
            f"the held-out split mixes data formats ({', '.join(sorted(formats))}), which one eval cannot score",
            hint="pass --data FILE with records of one format",
        )
    held = split_held_out(cfg, pool)[1]
    return [absolute_images([sources[s].records[i]], sources[s].folder(i), sources[s].where(i))[0] for s, i in held]


def build_examples(
    records: list[dict], cfg: RecipeConfig, tokenizer: Any, key: str
) -> tuple[TokenizedData | PreferencePairs, DataStats]:
    """Records (data.columns already applied) formatted, tokenized, masked and truncated as training does them."""
    _chat_template_needed(cfg, tokenizer)
    src = Source(key, records, [(0, key, None)], cfg.data.format)
    keep, _ = usable_records(src, {}, skip_bad=False)
    items = [(0, i) for i in keep]
    encoded = _encode_items(items, [src], tokenizer, cfg.data.train_on, 1, cfg.data.max_seq_len)
    return _finish(items, encoded, [src], cfg, tokenizer, {}, 0, False)


def _content_ids(cfg: RecipeConfig) -> list[str]:
    specs = source_specs(cfg) + [s for s in [eval_spec(cfg)] if s is not None]
    return [f"{spec.key}={content_id(spec)}" for spec in specs]


def _chat_template_needed(cfg: RecipeConfig, tokenizer: Any) -> None:
    if processor_of(tokenizer) is not None and cfg.data.template != "auto":
        raise DataError(
            f"data.template={cfg.data.template} with a vision-language model: its processor's own template places "
            "the image placeholders, and a built-in one would render none",
            hint="set data.template=auto",
        )
    formats = {spec.format for spec in source_specs(cfg)}
    if formats & set(CHAT_FORMATS) or cfg.data.template != "auto":
        use_template(tokenizer, cfg.data.template)


def _cached_bundle(entry: Path, mask_check: str) -> DataBundle | None:
    """The data of a cache entry, its stored mask findings judged by today's data.mask_check; None on a miss."""
    cached = read_cache(entry)
    if cached is None:
        return None
    data, stats, raw_findings = cached
    found = {f["kind"]: Finding(**f) for f in raw_findings}
    train_data, train_stats = data["train"], stats["train"]
    assert train_data is not None and train_stats is not None, "a cache entry always holds the train set"
    train_stats.warnings += enforce(found, mask_check)
    return DataBundle(train_data, data["eval"], train_stats, stats["eval"], from_cache=True)


def build_datasets(cfg: RecipeConfig, tokenizer: Any, *, use_cache: bool | None = None) -> DataBundle:
    """The train (and eval) data of a recipe, tokenized, masked, checked and (with data.packing) packed.

    Eval data comes from data.eval_path when set, else from a seeded split of the
    usable records of all sources (before data.mix weights repeat any). Examples stay
    in file order (sources in recipe order); shuffling is the trainer's. With
    data.template set to a built-in, the tokenizer's chat_template is set to it (so
    the tokenizer saved with the adapter renders prompts as training did).
    use_cache defaults to data.cache.
    """
    _chat_template_needed(cfg, tokenizer)
    if cfg.data.format == "prompt":  # an online objective's prompts: rendered and tokenized, nothing masked or cached
        from finetune.data.prompts import build_prompts

        return build_prompts(cfg, tokenizer)
    return _tokenized(cfg, tokenizer, use_cache)


def _tokenized(cfg: RecipeConfig, tokenizer: Any, use_cache: bool | None) -> DataBundle:
    d = cfg.data
    if d.packing and processor_of(tokenizer) is not None:
        raise DataError(
            "data.packing=true with a vision-language model: a packed row would hand the model one example's image "
            "features with another's tokens (and Qwen2-VL's 3-D rotary positions are computed per row, not per example)",
            hint="set data.packing=false (rows are padded to the longest in the micro-batch)",
        )
    use_cache = d.cache if use_cache is None else use_cache
    entry = cache_root(cfg) / cache_key(cfg, tokenizer, _content_ids(cfg)) if use_cache else None
    cached = _cached_bundle(entry, d.mask_check) if entry is not None else None
    if cached is not None:
        return cached

    sources: list[Source] = []
    skipped: dict[str, list[str]] = {"train": [], "eval": []}
    usable: list[list[int]] = []
    for spec in source_specs(cfg):
        src, keep, bad = load_usable(spec, d.skip_bad_rows)
        sources.append(src)
        usable.append(keep)
        skipped["train"] += bad
    pool = [(s, i) for s, keep in enumerate(usable) for i in keep]
    eval_items: list[Item] = []
    ev_spec = eval_spec(cfg)
    if ev_spec is not None:  # loaded before any tokenizing, so a wrong path fails at once
        ev, keep, bad = load_usable(ev_spec, d.skip_bad_rows)
        skipped["eval"] += bad
        sources.append(ev)
        eval_items = [(len(sources) - 1, i) for i in keep]
        train_pool = pool
    elif d.eval_fraction > 0:
        train_pool, eval_items = split_held_out(cfg, pool)
    else:
        train_pool = pool

    train_items: list[Item] = []
    for s in range(len(usable)):
        mine = [i for src, i in train_pool if src == s]
        train_items += [(s, mine[j]) for j in weighted_indices(len(mine), sources[s].weight, cfg.seed + s)]

    encoded = _encode_items(train_items + eval_items, sources, tokenizer, d.train_on, d.num_proc, d.max_seq_len)
    findings: dict[str, Finding] = {}
    train, train_stats = _finish(train_items, encoded, sources, cfg, tokenizer, findings, len(skipped["train"]), d.packing)
    if not len(train):
        enforce(findings, d.mask_check)  # a mask problem that emptied the data is the one to name
        raise DataError(
            f"data.path: no training examples left: {train_stats.dropped} of {len(train_items)} dropped "
            f"(empty response, or nothing trained within data.max_seq_len={d.max_seq_len})"
            + (f", {train_stats.too_long} longer than data.max_seq_len" if train_stats.too_long else "")
            + (f", {train_stats.mask_dropped} failed the mask check" if train_stats.mask_dropped else ""),
            hint="raise data.max_seq_len (or data.truncation=truncate), or check that the response column holds the answers",
        )
    evals, eval_stats = None, None
    if eval_items:
        evals, eval_stats = _finish(eval_items, encoded, sources, cfg, tokenizer, findings, len(skipped["eval"]), False)
        if not len(evals):
            key = "data.eval_path" if ev_spec is not None else "data.path"
            lost = eval_stats.dropped + eval_stats.too_long + eval_stats.mask_dropped
            raise DataError(
                f"{key}: no eval examples left: all {lost} were dropped (empty response, too long, or failed the mask check)",
                hint="raise data.max_seq_len, or check the eval data's response column",
            )
    train_stats.warnings = [f"skipped: {s}" for s in (skipped["train"] + skipped["eval"])[:5]]
    if entry is not None:  # findings are stored, not enforced, so a later data.mask_check still applies
        try:
            write_cache(
                entry,
                {"train": train, "eval": evals},
                {"train": train_stats, "eval": eval_stats},
                [f.__dict__ for f in findings.values()],
            )
        except OSError as exc:  # a full disk or read-only cache must not cost the tokenizing just done
            train_stats.warnings.append(f"could not write the tokenized cache at {entry.parent}: {exc}")
    train_stats.warnings += enforce(findings, d.mask_check)
    return DataBundle(train, evals, train_stats, eval_stats)


def check_sample(cfg: RecipeConfig, tokenizer: Any, limit: int = 64) -> list[str]:
    """The mask checker on the first `limit` records of each local source: what `validate` can say in a second.

    Record-shape problems are check_data_source's to report; rows it would refuse are skipped here.
    """
    d = cfg.data
    try:
        _chat_template_needed(cfg, tokenizer)
    except DataError as exc:
        return [f"{exc.message}. {exc.hint}"]
    if d.mask_check in ("off", "drop"):
        return []
    problems = []
    for spec in source_specs(cfg):
        if not os.path.exists(resolve_path(spec.path)) and looks_like_hub_name(resolve_path(spec.path)):
            continue  # hub: validate does not fetch
        try:
            records, origins = _load(spec, limit=limit, skipped=[])
            src = Source(spec.key, records, origins, spec.format, columns=spec.columns)
            keep, _ = usable_records(src, spec.columns, skip_bad=True)
            encoded = _encode_items([(0, i) for i in keep], [src], tokenizer, d.train_on, 1, d.max_seq_len)
            findings: dict[str, Finding] = {}
            _finish([(0, i) for i in keep], encoded, [src], cfg, tokenizer, findings, 0, False)
        except DataError as exc:
            problems.append(f"{exc.message}. {exc.hint}" if exc.hint else exc.message)
            continue
        if d.mask_check == "error":
            problems += [
                f"{spec.key}: mask check on the first {len(keep)} records: {f.describe()}. {FIXES[f.kind]}"
                for f in findings.values()
            ]
    return problems
