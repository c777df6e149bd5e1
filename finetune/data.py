"""Data: load -> format/template -> tokenize -> mask labels -> truncate -> collate.

    from finetune.data import build_datasets, Collator
    bundle = build_datasets(cfg, tokenizer)
    print(bundle.train_stats.summary())
    batch = Collator(pad_token_id=tokenizer.pad_token_id)(bundle.train[:4])

Every example is {"input_ids": [...], "labels": [...]} of equal length. A label of
IGNORE_INDEX (-100) means "not trained": the model shifts labels by one inside its
loss, so labels[t] is the target predicted from positions < t.

Local files are read directly (json / csv / pyarrow) rather than through
`datasets`, which would hash the file and write an Arrow cache next to it: reading
a 50k-line JSONL this way takes well under a second and writes nothing. Only hub
names go through `datasets.load_dataset`.
"""

from __future__ import annotations

import contextlib
import csv
import difflib
import itertools
import json
import math
import os
import random
import re
import reprlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from finetune.config import DataConfig, RecipeConfig, resolve_path
from finetune.errors import DataError

IGNORE_INDEX = -100

SUPPORTED_EXTENSIONS = (".json", ".jsonl", ".csv", ".parquet")

# Columns each format reads (after data.columns is applied). alpaca's "input" is optional.
REQUIRED_COLUMNS: dict[str, tuple[str, ...]] = {
    "alpaca": ("instruction", "output"),
    "completion": ("prompt", "completion"),
    "messages": ("messages",),
    "text": ("text",),
}

ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)

# Column names datasets commonly use for ours; used only to suggest a data.columns fix.
_SYNONYMS: dict[str, tuple[str, ...]] = {
    "instruction": ("prompt", "question", "query", "task"),
    "output": ("answer", "response", "completion", "target", "solution", "label"),
    "prompt": ("question", "instruction", "query", "input", "source"),
    "completion": ("answer", "response", "output", "target", "solution"),
    "text": ("content", "document", "body", "sentence"),
    "messages": ("conversations", "conversation", "chat", "dialog", "turns"),
}

# "owner/name" or "name": what a hub dataset id looks like (a file path usually does not).
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")

# --------------------------------------------------------------------------- results


@dataclass
class DataStats:
    examples: int  # kept examples
    dropped: int  # empty response, or nothing left to train after truncation
    truncated: int  # kept examples cut to max_seq_len
    tokens: int  # total tokens of kept examples
    trained_tokens: int  # tokens with a label != IGNORE_INDEX

    def summary(self) -> str:
        pct = 100.0 * self.trained_tokens / self.tokens if self.tokens else 0.0
        return (
            f"{self.examples} example{'s' if self.examples != 1 else ''}, {self.tokens:,} tokens "
            f"({pct:.1f}% trained), {self.truncated} truncated, {self.dropped} dropped"
        )


@dataclass
class DataBundle:
    train: list[dict]
    eval: list[dict] | None
    train_stats: DataStats
    eval_stats: DataStats | None


# --------------------------------------------------------------------------- loading


def looks_like_hub_name(path: str) -> bool:
    """True for 'tatsu-lab/alpaca' or 'gsm8k'; False for anything shaped like a local file path."""
    return bool(_HUB_NAME.match(path)) and not path.lower().endswith(SUPPORTED_EXTENSIONS)


def _read_json(path: Path, limit: int | None) -> Any:
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
                raise DataError(
                    f"'{path}' line {lineno} is not valid JSON: {exc.msg} (column {exc.colno}): {line.strip()[:80]!r}",
                    hint="each line of a JSONL file must be one complete JSON object",
                ) from None
        return rows


def _read_csv(path: Path, limit: int | None) -> list[dict]:
    with path.open(encoding="utf-8-sig", newline="") as f:
        rows = list(itertools.islice(csv.DictReader(f), limit))
    for row in rows:
        row.pop(None, None)  # cells beyond the header: DictReader files them under the key None
    return rows


def _read_parquet(path: Path, limit: int | None) -> list[dict]:
    import pyarrow.parquet as pq  # lazily: only parquet users pay for the import

    if limit is None:
        return pq.read_table(path).to_pylist()
    first = next(pq.ParquetFile(path).iter_batches(batch_size=limit), None)
    return first.to_pylist() if first is not None else []


_READERS = {".json": _read_json, ".jsonl": _read_json, ".csv": _read_csv, ".parquet": _read_parquet}


def _read_file(path: Path, key: str, limit: int | None) -> list[dict]:
    reader = _READERS.get(path.suffix.lower())
    if reader is None:
        raise DataError(
            f"{key}: '{path}' has unsupported extension '{path.suffix}'",
            hint=f"convert it to one of {', '.join(SUPPORTED_EXTENSIONS)}",
        )
    try:
        rows = reader(path, limit)
    except DataError as exc:
        raise DataError(f"{key}: {exc.message}", exc.hint) from None
    except Exception as exc:  # OSError, UnicodeDecodeError, csv.Error, pyarrow's own types for corrupt files
        hint = "check the file's permissions, format and encoding (UTF-8)"
        raise DataError(f"{key}: cannot read '{path}': {exc}", hint) from None
    if not isinstance(rows, list):
        found = f"an object with keys {list(rows)[:8]}" if isinstance(rows, dict) else type(rows).__name__
        hint = "store the records as a JSON list or as JSON lines"
        raise DataError(f"{key}: '{path}' holds {found}, not a list of records", hint)
    bad = next((i for i, row in enumerate(rows) if not isinstance(row, dict)), None)
    if bad is not None:
        raise DataError(
            f"{key}: '{path}' record {bad} (0-based) is a {type(rows[bad]).__name__}, not an object",
            hint='each record must be an object such as {"instruction": ..., "output": ...}',
        )
    if not rows:
        raise DataError(f"{key}: '{path}' is empty: no records", hint="check that the file is the one you meant")
    return rows


Origins = list[tuple[int, str]]  # (index of a file's first record, file): lets errors name file and record


def _load(path: str, data_cfg: DataConfig, key: str, limit: int | None = None) -> tuple[list[dict], Origins]:
    resolved = resolve_path(path)
    p = Path(resolved)
    records: list[dict] = []
    origins: Origins = []
    if p.is_dir():
        # Sorted, so shards (train-00000.parquet, ...) keep their order; hidden files are OS litter.
        files = sorted(f for f in p.iterdir() if f.suffix.lower() in SUPPORTED_EXTENSIONS and f.name[0] != ".")
        if not files:
            raise DataError(
                f"{key}: folder '{p}' holds no {'/'.join(SUPPORTED_EXTENSIONS)} files "
                f"(found: {sorted(f.name for f in p.iterdir())[:10] or 'nothing'})",
                hint=f"point {key} at a data file or a folder of them",
            )
        for f in files:
            if limit is not None and len(records) >= limit:
                break
            origins.append((len(records), str(f)))
            records.extend(_read_file(f, key, None if limit is None else limit - len(records)))
    elif p.is_file():
        origins, records = [(0, str(p))], _read_file(p, key, limit)
    elif looks_like_hub_name(resolved):
        origins, records = [(0, resolved)], _load_hub(resolved, data_cfg.split, key)
    else:
        raise DataError(
            f"{key}: file '{path}' not found (cwd: {os.getcwd()})",
            hint=f"pass an absolute path or {key}=..., or a hub dataset id such as 'tatsu-lab/alpaca'",
        )
    return [_remap(r, data_cfg.columns) for r in records], origins


def _load_hub(name: str, split: str, key: str) -> list[dict]:
    try:
        import datasets  # lazily: a slow import, and only hub datasets need it

        rows = datasets.load_dataset(name, split=split).to_list()
    except Exception as exc:
        first_line = (str(exc).splitlines() or [""])[0]
        raise DataError(
            f"{key}: '{name}' is not a local path (cwd: {os.getcwd()}) and could not be loaded as a hub dataset: "
            f"{type(exc).__name__}: {first_line}",
            hint=f"pass an existing file or folder, or a hub dataset id and split (data.split={split}); "
            "hub datasets need network access unless already cached",
        ) from None
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
    return _load(path, data_cfg, key)[0]


# --------------------------------------------------------------------------- record checks


def _column_hint(missing: str, found: list[str], fmt: str, columns: dict[str, str]) -> str:
    fixes: list[str] = []
    fits = [f for f in ("messages", "completion", "alpaca", "text") if set(REQUIRED_COLUMNS[f]) <= set(found)]
    fixes += [f"data.format={fits[0]}"] if fits and fits[0] != fmt else []
    free = [c for c in found if c not in REQUIRED_COLUMNS[fmt] and c != "input"]
    cand = next((s for s in _SYNONYMS.get(missing, ()) if s in free), None)
    cand = cand or next(iter(difflib.get_close_matches(missing, free, n=1, cutoff=0.6)), None)
    if cand or not fixes:
        fixes.append(f"data.columns.{missing}={cand or 'YOUR_COLUMN'}")
    mapped = f" (data.columns maps it from '{columns[missing]}', which is not there)" if missing in columns else ""
    return "set " + " or ".join(fixes) + mapped


def _record_problem(rec: dict, fmt: str, columns: dict[str, str]) -> tuple[str, str] | None:
    """(what is wrong, how to fix) for a record that `fmt` cannot use, else None."""
    missing = next((c for c in REQUIRED_COLUMNS[fmt] if c not in rec), None)
    if missing:
        found = ", ".join(rec) or "none"
        what = f"has no column '{missing}' needed by data.format={fmt} (found columns: {found})"
        return what, _column_hint(missing, list(rec), fmt, columns)
    if fmt == "messages":
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not msgs:
            what = f"column 'messages' is {type(msgs).__name__} {reprlib.repr(msgs)}, expected a non-empty list"
            return what, 'store each conversation as a list such as [{"role": "user", "content": "..."}, ...]'
        for j, m in enumerate(msgs):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                what = f'messages[{j}] is {reprlib.repr(m)}, expected {{"role": str, "content": str}}'
                return what, "convert ShareGPT-style {from, value} turns to {role, content}"
        return None
    for col in REQUIRED_COLUMNS[fmt] + (("input",) if fmt == "alpaca" else ()):
        value = rec.get(col)
        if not isinstance(value, str) and not (col == "input" and value is None):  # input: missing/null = none
            what = f"column '{col}' is {type(value).__name__} {reprlib.repr(value)}, expected a string"
            return what, "convert the column to strings"
    return None


def _locate(origins: Origins, i: int) -> str:
    start, file = next((o for o in reversed(origins) if o[0] <= i), (0, "?"))
    return f"'{file}' record {i - start} (0-based)"


# --------------------------------------------------------------------------- validate


def check_data_source(cfg: RecipeConfig) -> list[str]:
    """Problems `finetune validate` can find without a tokenizer; [] when the data looks usable.

    Checks data.path, data.eval_path and eval.exact_match_path: they exist (or look like
    a hub id, which is not fetched here), are readable and non-empty, and their first
    ~100 records have the columns and types data.format needs.
    """
    problems = []
    sources = {"data.path": cfg.data.path, "data.eval_path": cfg.data.eval_path}
    sources["eval.exact_match_path"] = cfg.eval.exact_match_path
    for key, path in sources.items():
        if not path:
            continue
        resolved = resolve_path(path)
        if not os.path.exists(resolved) and looks_like_hub_name(resolved):
            continue  # a hub id: checking it needs the network, which validate must not need
        try:
            # 100 records catch a wrong column or type and stay cheap on a multi-GB file.
            records, origins = _load(path, cfg.data, key, limit=100)
        except DataError as exc:
            problems.append(f"{exc.message}. {exc.hint}" if exc.hint else exc.message)
            continue
        for i, rec in enumerate(records):
            problem = _record_problem(rec, cfg.data.format, cfg.data.columns)
            if problem:
                # One problem per source: the same mistake usually repeats in every record.
                problems.append(f"{key}: {_locate(origins, i)} {problem[0]}; {problem[1]}")
                break
    return problems


# --------------------------------------------------------------------------- formatting


Pair = tuple[list[int], list[int]]  # (input_ids, labels)


def _encode_many(tokenizer: Any, texts: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
    # One batched call: for short texts the per-call overhead costs more than the tokenizing.
    if not texts:
        return []
    return [list(x) for x in tokenizer(list(texts), add_special_tokens=add_special_tokens)["input_ids"]]


def _encode_rendered(tokenizer: Any, text: str) -> list[int]:
    """Tokenize chat-template output without a double BOS: templates like Llama 3's already write it."""
    bos = getattr(tokenizer, "bos_token", None)
    has_bos = bool(bos) and text.startswith(bos)
    return list(tokenizer(text, add_special_tokens=not has_bos)["input_ids"])


def _render(tokenizer: Any, messages: list[dict], where: str, add_generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as exc:
        raise DataError(
            f"{where}: the chat template failed on this conversation: {type(exc).__name__}: {exc}",
            hint="check the roles and their order (many templates require user/assistant alternation)",
        ) from None


def _alpaca_prompt(rec: dict) -> str:
    inp = rec.get("input") or ""
    if inp.strip():
        return ALPACA_PROMPT.format(instruction=rec["instruction"], input=inp)
    return ALPACA_PROMPT_NO_INPUT.format(instruction=rec["instruction"])


def _split_text(rec: dict, fmt: str) -> tuple[str, str]:
    """(prompt, response) text; text trains all of itself, so its prompt is empty (BOS only)."""
    if fmt == "alpaca":
        return _alpaca_prompt(rec), rec["output"]
    if fmt == "completion":
        return rec["prompt"], rec["completion"]
    return "", rec["text"]


def _prompt_response(records: list[dict], fmt: str, tokenizer: Any) -> list[Pair | None]:
    """alpaca, completion, text: the prompt tokenized alone (the tokenizer adds BOS), response + EOS trained.

    Tokenizing the two parts separately makes the mask boundary exact and the prompt
    identical to the one generation sees. Char tokenizer, completion prompt "Q: 2+2=",
    completion "4":
        input_ids = [<s>, Q, :, ' ', 2, +, 2, =, 4, </s>]
        labels    = [-100] * 8                + [4, </s>]
    alpaca: the prompt is ALPACA_PROMPT (ALPACA_PROMPT_NO_INPUT when input is missing or
    empty), the response is output. text "hi": the prompt is "" so only BOS is masked
    (nothing predicts it):
        input_ids = [<s>, h, i, </s>]
        labels    = [-100, h, i, </s>]
    An empty or whitespace-only response gives None (dropped).
    """
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise DataError("the tokenizer has no eos_token, so the model could not learn to stop", hint="use one that has")
    prompts, responses = zip(*(_split_text(r, fmt) for r in records)) if records else ((), ())
    out: list[Pair | None] = []
    for p, r, text in zip(_encode_many(tokenizer, prompts, True), _encode_many(tokenizer, responses, False), responses):
        out.append((p + r + [eos], [IGNORE_INDEX] * len(p) + r + [eos]) if text.strip() else None)
    return out


def _messages(rec: dict, tokenizer: Any, where: str) -> Pair | None:
    """messages: the chat-template render; every assistant reply (with its end-of-turn tokens) trained.

    Works for any Jinja template by rendering prefixes: the i-th assistant reply spans
    tokens [len(tok(render(msgs[:i], add_generation_prompt))), len(tok(render(msgs[:i+1])))).
    ChatML, [user "hi", assistant "yo"] (char tokenizer; no EOS appended: <|im_end|> stops):
        text      = "<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\nyo<|im_end|>\\n"
        input_ids = [<s>, <|im_start|>, u,s,e,r,\\n, h,i, <|im_end|>, \\n, <|im_start|>, a,s,s,i,s,t,a,n,t,\\n,
                     y, o, <|im_end|>, \\n]
        labels    = [-100] * 22 + [y, o, <|im_end|>, \\n]
    An assistant turn that opens the conversation is context (nothing precedes it to
    condition on). No non-empty assistant reply: None (dropped).
    """
    msgs = rec["messages"]
    if not any(m["role"] == "assistant" and m["content"].strip() for m in msgs):
        return None
    ids = _encode_rendered(tokenizer, _render(tokenizer, msgs, where))
    labels = [IGNORE_INDEX] * len(ids)
    for i, m in enumerate(msgs):
        if m["role"] != "assistant" or i == 0:
            continue
        start = _encode_rendered(tokenizer, _render(tokenizer, msgs[:i], where, add_generation_prompt=True))
        upto = _encode_rendered(tokenizer, _render(tokenizer, msgs[: i + 1], where))
        if ids[: len(start)] != start or ids[: len(upto)] != upto:
            # Templates that rewrite earlier turns (e.g. strip reasoning from all but the
            # last reply) render a prefix unlike the start of the whole: no exact mask exists.
            raise DataError(
                f"{where}: the chat template renders the conversation up to message {i} differently "
                "from the start of the whole conversation, so the assistant span cannot be masked exactly",
                hint="use a tokenizer whose chat template renders prefixes consistently, or data.format=completion",
            )
        labels[len(start) : len(upto)] = ids[len(start) : len(upto)]
    return ids, labels


def _check_chat_template(tokenizer: Any) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "data.format=messages needs a chat template, but the tokenizer has none",
            hint="use a chat/instruct model's tokenizer (model.tokenizer=...), or convert to data.format=completion",
        )


def _build(
    records: list[dict], origins: Origins, indices: list[int], cfg: RecipeConfig, tokenizer: Any, key: str
) -> tuple[list[dict], DataStats]:
    """Check, format, tokenize, mask and truncate records[indices] -> (examples, DataStats)."""
    fmt, max_len = cfg.data.format, cfg.data.max_seq_len
    recs = [records[i] for i in indices]
    for i, rec in zip(indices, recs):
        problem = _record_problem(rec, fmt, cfg.data.columns)
        if problem:
            raise DataError(f"{key}: {_locate(origins, i)} {problem[0]}", hint=problem[1])
    if fmt == "messages":
        _check_chat_template(tokenizer)
        pairs = [_messages(rec, tokenizer, f"{key}: {_locate(origins, i)}") for i, rec in zip(indices, recs)]
    else:
        pairs = _prompt_response(recs, fmt, tokenizer)

    examples: list[dict] = []
    stats = DataStats(0, 0, 0, 0, 0)
    for pair in pairs:
        ids, labels = pair if pair is not None else ([], [])
        n_trained = sum(1 for lab in labels[:max_len] if lab != IGNORE_INDEX)
        if n_trained == 0:  # empty response, or the prompt alone fills max_seq_len: no gradient, only cost
            stats.dropped += 1
            continue
        stats.truncated += len(ids) > max_len
        ids, labels = ids[:max_len], labels[:max_len]
        stats.tokens += len(ids)
        stats.trained_tokens += n_trained
        examples.append({"input_ids": ids, "labels": labels})
    stats.examples = len(examples)
    return examples, stats


def held_out_indices(n_records: int, cfg: RecipeConfig) -> list[int]:
    """Which of data.path's records form the eval split (sorted): the same ones in training and in `finetune eval`."""
    n_eval = max(1, round(n_records * cfg.data.eval_fraction))
    if n_eval >= n_records:
        raise DataError(
            f"data.eval_fraction={cfg.data.eval_fraction} of {n_records} records leaves nothing to train on",
            hint="lower data.eval_fraction or pass data.eval_path=FILE",
        )
    return sorted(random.Random(cfg.seed).sample(range(n_records), n_eval))


def build_examples(records: list[dict], cfg: RecipeConfig, tokenizer: Any, key: str) -> tuple[list[dict], DataStats]:
    """Records formatted, tokenized, masked and truncated exactly as training does them (`key` names them in errors)."""
    return _build(records, [(0, key)], list(range(len(records))), cfg, tokenizer, key)


def build_datasets(cfg: RecipeConfig, tokenizer: Any) -> DataBundle:
    """load -> split off eval -> format -> tokenize -> mask labels -> truncate.

    Eval data comes from data.eval_path when set, else from a seeded split of data.path
    (max(1, round(n * data.eval_fraction)) records chosen with random.Random(cfg.seed);
    both parts keep file order). Shuffling for training is the trainer's sampler's job
    (data.shuffle), so the examples here stay in file order.
    """
    records, origins = _load(cfg.data.path, cfg.data, "data.path")
    train_idx = list(range(len(records)))
    eval_src: tuple[list[dict], Origins, list[int], str] | None = None
    if cfg.data.eval_path:  # loaded before any tokenizing, so a wrong path fails at once
        ev_records, ev_origins = _load(cfg.data.eval_path, cfg.data, "data.eval_path")
        eval_src = (ev_records, ev_origins, list(range(len(ev_records))), "data.eval_path")
    elif cfg.data.eval_fraction > 0:
        chosen = held_out_indices(len(records), cfg)
        train_idx = [i for i in train_idx if i not in set(chosen)]
        eval_src = (records, origins, chosen, "data.path")

    train, train_stats = _build(records, origins, train_idx, cfg, tokenizer, "data.path")
    if not train:
        raise DataError(
            f"data.path: no training examples left: {train_stats.dropped} of {len(train_idx)} dropped "
            f"(empty response, or nothing trained within data.max_seq_len={cfg.data.max_seq_len})",
            hint="raise data.max_seq_len, or check that the response column holds the answers",
        )
    if eval_src is None:
        return DataBundle(train, None, train_stats, None)
    evals, eval_stats = _build(*eval_src[:3], cfg, tokenizer, eval_src[3])
    if not evals:
        raise DataError(
            f"{eval_src[3]}: no eval examples left: all {eval_stats.dropped} were dropped",
            hint="raise data.max_seq_len, or check the eval data's response column",
        )
    return DataBundle(train, evals, train_stats, eval_stats)


def prompt_and_answer(record: dict, fmt: str, tokenizer: Any) -> tuple[list[int], str]:
    """The prompt ids exactly as training saw them, and the expected answer, for generation-based eval.

    alpaca: (tok(alpaca prompt), output); completion: (tok(prompt), completion);
    messages: (tok(render(messages before the last assistant reply, add_generation_prompt)),
    that reply's content). `record` is one of load_records' (data.columns already applied).
    """
    problem = _record_problem(record, fmt, {})
    if problem:
        raise DataError(f"record {problem[0]}", hint=problem[1])
    if fmt in ("alpaca", "completion"):
        prompt, answer = _split_text(record, fmt)
        return _encode_many(tokenizer, [prompt], True)[0], answer
    if fmt == "messages":
        _check_chat_template(tokenizer)
        msgs = record["messages"]
        last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant" and i > 0), default=None)
        if last is None:
            hint = "each conversation needs an assistant turn after a user turn"
            raise DataError("record has no assistant reply after a prompt to score", hint)
        text = _render(tokenizer, msgs[:last], "record", add_generation_prompt=True)
        return _encode_rendered(tokenizer, text), msgs[last]["content"]
    raise DataError(
        f"data.format={fmt} has no prompt/answer split, so exact-match eval cannot score it",
        hint="use eval.exact_match_path with alpaca, completion or messages data, or set eval.exact_match_path=null",
    )


# --------------------------------------------------------------------------- collate


@dataclass
class Collator:
    """Right-pad a list of examples to the longest (rounded up to pad_to_multiple_of).

    [{"input_ids": [1, 7, 8], "labels": [-100, 7, 8]}, {"input_ids": [1, 9], "labels": [-100, 9]}], pad 0 ->
        input_ids      = [[1, 7, 8], [1, 9, 0]]
        labels         = [[-100, 7, 8], [-100, 9, -100]]
        attention_mask = [[1, 1, 1], [1, 1, 0]]
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, examples: list[dict]) -> dict[str, Any]:
        import torch  # lazily: `finetune validate` imports this module without needing torch

        if not examples:
            raise ValueError("Collator got an empty batch")
        width = max(len(ex["input_ids"]) for ex in examples)
        if self.pad_to_multiple_of:
            width = math.ceil(width / self.pad_to_multiple_of) * self.pad_to_multiple_of
        ids = torch.full((len(examples), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full_like(ids, IGNORE_INDEX)
        mask = torch.zeros_like(ids)
        for row, ex in enumerate(examples):
            n = len(ex["input_ids"])
            ids[row, :n] = torch.tensor(ex["input_ids"], dtype=torch.long)
            labels[row, :n] = torch.tensor(ex.get("labels", ex["input_ids"]), dtype=torch.long)
            mask[row, :n] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}
