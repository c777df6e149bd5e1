"""finetune.data: golden label masks (char tokenizer: one character = one token), loading, errors, collation.

python -m pytest tests/test_data.py -q
"""

from __future__ import annotations

import ast
import copy
import csv
import json
import os
from pathlib import Path

import pytest
from conftest import BOS_ID, EOS_ID, IM_END_ID, IM_START_ID, PAD_ID, char_token_id, write_jsonl

from finetune.config.schema import build_recipe
from finetune.data import (
    IGNORE_INDEX,
    Collator,
    DataStats,
    build_datasets,
    check_data_source,
    generation_prompt,
    load_records,
    prompt_and_answer,
)
from finetune.errors import DataError

M = IGNORE_INDEX

ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


def test_fixture_tokenizer_is_one_token_per_character(tokenizer):
    # The golden masks below rely on it, newlines included.
    assert tokenizer("a\n\nb", add_special_tokens=False).input_ids == ids("a\n\nb")


def ids(text: str) -> list[int]:
    return [char_token_id(c) for c in text]


def recipe(tmp_path: Path, path, seed: int = 0, **data):
    data = {"path": str(path), **data}
    return build_recipe({"model": {"path": "tiny"}, "data": data, "output_dir": str(tmp_path / "run"), "seed": seed})


def build(tmp_path, tokenizer, rows, name="train.jsonl", **data):
    return build_datasets(recipe(tmp_path, write_jsonl(tmp_path / name, rows), **data), tokenizer)


# --------------------------------------------------------------------------- golden masks


def test_alpaca_with_input_golden(tmp_path, tokenizer):
    b = build(tmp_path, tokenizer, [{"instruction": "Add.", "input": "1 + 2", "output": "3"}])
    prompt = ids(ALPACA_WITH_INPUT.format(instruction="Add.", input="1 + 2"))
    assert b.train == [
        {"input_ids": [BOS_ID] + prompt + ids("3") + [EOS_ID], "labels": [M] * (1 + len(prompt)) + ids("3") + [EOS_ID]}
    ]
    s = b.train_stats
    assert (s.examples, s.dropped, s.truncated, s.tokens, s.trained_tokens) == (1, 0, 0, len(prompt) + 3, 2)
    assert b.eval is None and b.eval_stats is None


@pytest.mark.parametrize("extra", [{}, {"input": ""}, {"input": None}, {"input": "  "}])
def test_alpaca_without_input_golden(tmp_path, tokenizer, extra):
    b = build(tmp_path, tokenizer, [{"instruction": "Say hi", "output": "hi", **extra}])
    prompt = [BOS_ID] + ids(ALPACA_NO_INPUT.format(instruction="Say hi"))
    assert b.train[0]["input_ids"] == prompt + ids("hi") + [EOS_ID]
    assert b.train[0]["labels"] == [M] * len(prompt) + ids("hi") + [EOS_ID]


def test_completion_golden(tmp_path, tokenizer):
    b = build(tmp_path, tokenizer, [{"prompt": "Q: 2+2=", "completion": "4"}], format="completion")
    assert b.train[0]["input_ids"] == [1] + ids("Q: 2+2=") + ids("4") + [2]
    assert b.train[0]["labels"] == [M] * 8 + ids("4") + [2]
    assert b.train_stats.summary() == "1 example, 10 tokens (20.0% trained), 0 truncated, 0 dropped"


def test_text_golden(tmp_path, tokenizer):
    b = build(tmp_path, tokenizer, [{"text": "hello"}], format="text")
    assert b.train[0]["input_ids"] == [BOS_ID] + ids("hello") + [EOS_ID]
    assert b.train[0]["labels"] == [M] + ids("hello") + [EOS_ID]
    assert b.train_stats.trained_tokens == 6


CONVO = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "3+3?"},
    {"role": "assistant", "content": "6"},
]


def turn(role: str, content: str) -> list[int]:
    return [IM_START_ID] + ids(f"{role}\n{content}") + [IM_END_ID] + ids("\n")


def test_messages_golden_system_and_two_assistant_turns(tmp_path, tokenizer):
    b = build(tmp_path, tokenizer, [{"messages": CONVO}], format="messages")
    head = [IM_START_ID] + ids("assistant\n")
    expected_ids = (
        [BOS_ID]
        + turn("system", "Be brief.")
        + turn("user", "2+2?")
        + turn("assistant", "4")
        + turn("user", "3+3?")
        + turn("assistant", "6")
    )
    reply1 = ids("4") + [IM_END_ID] + ids("\n")
    reply2 = ids("6") + [IM_END_ID] + ids("\n")
    n_ctx1 = 1 + len(turn("system", "Be brief.")) + len(turn("user", "2+2?")) + len(head)
    n_ctx2 = len(head) + len(turn("user", "3+3?"))  # "<|im_start|>assistant\n" of turn 2 belongs to the prompt
    expected_labels = [M] * n_ctx1 + reply1 + [M] * n_ctx2 + reply2
    assert b.train[0]["input_ids"] == expected_ids
    assert b.train[0]["labels"] == expected_labels
    assert b.train_stats.trained_tokens == 6  # "4", <|im_end|>, "\n" twice; no EOS appended


def test_messages_template_with_bos_gets_no_double_bos(tmp_path, tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = "{{ bos_token }}" + tok.chat_template
    b = build(tmp_path, tok, [{"messages": CONVO[1:3]}], format="messages")
    assert b.train[0]["input_ids"] == [BOS_ID] + turn("user", "2+2?") + turn("assistant", "4")
    assert b.train[0]["input_ids"].count(BOS_ID) == 1
    assert b.train[0]["labels"][-3:] == ids("4") + [IM_END_ID] + ids("\n")


def test_messages_inconsistent_template_names_example(tmp_path, tokenizer):
    tok = copy.deepcopy(tokenizer)
    # A short conversation's length written before its generation prompt: the first reply's prompt is one
    # the whole conversation never holds, so that reply cannot be placed (the last one can).
    gen = "{% if add_generation_prompt %}"
    tok.chat_template = tok.chat_template.replace(gen, "{% if messages|length < 3 %}{{ messages|length }}{% endif %}" + gen)
    no_reply = {"messages": CONVO[:2]}  # dropped before rendering, so record 1 is the first one checked
    with pytest.raises(
        DataError,
        match=r"boundary: 1 example, first .*train\.jsonl' line 2: the chat template renders the conversation up to message 2 differently",
    ):
        build(tmp_path, tok, [no_reply, {"messages": CONVO}], format="messages")


def test_data_emptied_by_unplaceable_replies_names_the_mask_problem(tmp_path, tokenizer):
    # Every record's only reply cannot be placed, so nothing is left to train: the error is the
    # mask check's (what went wrong, with its fix), not a bare "no training examples left".
    tok = copy.deepcopy(tokenizer)
    gen = "{% if add_generation_prompt %}"
    tok.chat_template = tok.chat_template.replace(gen, "{% if messages|length < 3 %}{{ messages|length }}{% endif %}" + gen)
    with pytest.raises(DataError, match=r"boundary: 2 examples") as e:
        build(tmp_path, tok, [{"messages": CONVO[:2] + [CONVO[2]]}] * 2, format="messages")
    assert "no training examples left" not in e.value.message


def test_messages_without_chat_template(tmp_path, tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = None
    with pytest.raises(DataError, match="chat template") as e:
        build(tmp_path, tok, [{"messages": CONVO}], format="messages")
    assert "data.format=completion" in e.value.hint


# --------------------------------------------------------------------------- truncation, drops, splits


def test_truncation_and_drop_counts(tmp_path, tokenizer):
    rows = [
        {"prompt": "ab", "completion": "cd"},  # 1+2+2+1 = 6 tokens: fits
        {"prompt": "abcd", "completion": "efghij"},  # 12 tokens: cut to 8, 3 trained left
        {"prompt": "abcdefghij", "completion": "k"},  # prompt alone fills 8: nothing trained -> dropped
        {"prompt": "ab", "completion": ""},  # empty response -> dropped
        {"prompt": "ab", "completion": "  "},  # whitespace-only response -> dropped
    ]
    b = build(tmp_path, tokenizer, rows, format="completion", max_seq_len=8)
    assert [len(ex["input_ids"]) for ex in b.train] == [6, 8]
    assert b.train[1]["input_ids"] == [BOS_ID] + ids("abcdefg")
    assert b.train[1]["labels"] == [M] * 5 + ids("efg")
    s = b.train_stats
    assert (s.examples, s.dropped, s.truncated, s.tokens, s.trained_tokens) == (2, 3, 1, 14, 6)
    assert s.summary() == "2 examples, 14 tokens (42.9% trained), 1 truncated, 3 dropped"


def test_all_dropped_raises(tmp_path, tokenizer):
    with pytest.raises(DataError, match="no training examples left: 1 of 1 dropped"):
        build(tmp_path, tokenizer, [{"prompt": "abcdefghij", "completion": "k"}], format="completion", max_seq_len=8)


def test_messages_without_assistant_reply_dropped(tmp_path, tokenizer):
    empty_reply = CONVO[:2] + [{"role": "assistant", "content": ""}]
    rows = [{"messages": CONVO}, {"messages": CONVO[:2]}, {"messages": empty_reply}]
    b = build(tmp_path, tokenizer, rows, format="messages")
    assert (b.train_stats.examples, b.train_stats.dropped) == (1, 2)


def test_eval_fraction_split_sizes_and_determinism(tmp_path, tokenizer):
    rows = [{"prompt": f"p{i:02d}", "completion": f"c{i:02d}"} for i in range(20)]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    cfg = recipe(tmp_path, path, format="completion", eval_fraction=0.25)
    a, b = build_datasets(cfg, tokenizer), build_datasets(cfg, tokenizer)
    assert (len(a.train), len(a.eval), a.eval_stats.examples) == (15, 5, 5)
    assert a.train == b.train and a.eval == b.eval
    key = lambda ex: tuple(ex["input_ids"])  # noqa: E731
    full = {key(ex) for ex in build(tmp_path, tokenizer, rows, format="completion").train}
    assert {key(ex) for ex in a.train} | {key(ex) for ex in a.eval} == full
    assert not {key(ex) for ex in a.train} & {key(ex) for ex in a.eval}
    other = build_datasets(recipe(tmp_path, path, seed=1, format="completion", eval_fraction=0.25), tokenizer)
    assert len(other.eval) == 5 and other.eval != a.eval
    # A tiny fraction still yields one eval example; one that takes everything is an error.
    assert len(build_datasets(recipe(tmp_path, path, format="completion", eval_fraction=0.01), tokenizer).eval) == 1
    one = write_jsonl(tmp_path / "one.jsonl", rows[:1])
    with pytest.raises(DataError, match="leaves nothing to train on"):
        build_datasets(recipe(tmp_path, one, format="completion", eval_fraction=0.5), tokenizer)


def test_eval_path(tmp_path, tokenizer):
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "a", "completion": "b"}] * 3)
    ev = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "x", "completion": "y"}, {"prompt": "x", "completion": ""}])
    b = build_datasets(recipe(tmp_path, train, format="completion", eval_path=str(ev), eval_fraction=0.5), tokenizer)
    assert len(b.train) == 3  # eval_path wins over eval_fraction: train is not split
    assert b.eval == [{"input_ids": [BOS_ID] + ids("xy") + [EOS_ID], "labels": [M, M] + ids("y") + [EOS_ID]}]
    assert (b.eval_stats.examples, b.eval_stats.dropped) == (1, 1)


def test_columns_remapping(tmp_path, tokenizer):
    rows = [{"question": "Q: 2+2=", "answer": "4", "extra": 1}]
    b = build(tmp_path, tokenizer, rows, format="completion", columns={"prompt": "question", "completion": "answer"})
    assert b.train[0]["input_ids"] == [1] + ids("Q: 2+2=4") + [2]
    recs = load_records(str(tmp_path / "train.jsonl"), recipe(tmp_path, "x", columns={"output": "answer"}).data)
    assert recs == [{"question": "Q: 2+2=", "output": "4", "extra": 1}]


# --------------------------------------------------------------------------- loading


ROWS = [
    {"instruction": "Add.", "input": "1 + 2", "output": "3"},
    {"instruction": "Say hi", "input": "", "output": "hi"},
]


def test_all_file_kinds_load_the_same_records(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    cfg = recipe(tmp_path, "x").data
    (tmp_path / "list.json").write_text(json.dumps(ROWS, indent=2), encoding="utf-8")
    write_jsonl(tmp_path / "lines.json", ROWS)
    write_jsonl(tmp_path / "a.jsonl", ROWS)
    with (tmp_path / "a.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(ROWS[0]))
        w.writeheader()
        w.writerows(ROWS)
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "a.parquet")
    folder = tmp_path / "folder"
    folder.mkdir()
    write_jsonl(folder / "b.jsonl", ROWS[1:])
    write_jsonl(folder / "a.jsonl", ROWS[:1])
    (folder / "README.md").write_text("not data")
    for name in ["list.json", "lines.json", "a.jsonl", "a.csv", "a.parquet", "folder"]:
        assert load_records(str(tmp_path / name), cfg) == ROWS, name


def test_parquet_nested_messages(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"messages": CONVO}]), tmp_path / "m.parquet")
    b = build_datasets(recipe(tmp_path, tmp_path / "m.parquet", format="messages"), tokenizer)
    assert b.train_stats.trained_tokens == 6


def test_hub_name_goes_through_datasets(tmp_path, monkeypatch, tokenizer):
    import datasets

    from finetune.data.sources import _hub_dataset

    _hub_dataset.cache_clear()  # loads are memoized per process; this test counts them
    calls = []

    def fake_load_dataset(name, split):
        calls.append((name, split))
        return datasets.Dataset.from_list([{"question": "Q", "answer": "A"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    columns = {"prompt": "question", "completion": "answer"}
    cfg = recipe(tmp_path, "someone/qa", format="completion", split="test", columns=columns)
    assert build_datasets(cfg, tokenizer).train[0]["input_ids"] == [BOS_ID] + ids("QA") + [EOS_ID]
    assert calls == [("someone/qa", "test")]  # the cache key's fingerprint and the records share one load
    _hub_dataset.cache_clear()


def test_hub_name_unavailable_offline(tmp_path):
    # conftest sets HF_HUB_OFFLINE=1, so this never reaches the network.
    with pytest.raises(DataError, match="'nobody-here/no-such-dataset' is not a local path .*could not be loaded"):
        load_records("nobody-here/no-such-dataset", recipe(tmp_path, "x").data)


def test_missing_file_names_cwd(tmp_path):
    with pytest.raises(DataError) as e:
        load_records("nope/train.jsonl", recipe(tmp_path, "x").data)
    assert "data.path: file 'nope/train.jsonl' not found" in str(e.value)
    assert f"(cwd: {os.getcwd()})" in str(e.value)


def test_unsupported_extension(tmp_path):
    (tmp_path / "d.txt").write_text("hello")
    with pytest.raises(DataError, match=r"unsupported extension '\.txt'"):
        load_records(str(tmp_path / "d.txt"), recipe(tmp_path, "x").data)


def test_malformed_json_line_number(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"instruction": "a", "output": "b"}\n\n{"instruction": "a", "output": }\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad\.jsonl' line 3 is not valid JSON"):
        load_records(str(p), recipe(tmp_path, "x").data)
    q = tmp_path / "bad.json"
    q.write_text('[\n  {"a": 1},\n  {"a": 2,}\n]', encoding="utf-8")
    with pytest.raises(DataError, match=r"not valid JSON: .* at line 3"):
        load_records(str(q), recipe(tmp_path, "x").data)


@pytest.mark.parametrize(
    "name,content", [("e.jsonl", ""), ("e.json", "  \n"), ("l.json", "[]"), ("h.csv", "instruction,output\n")]
)
def test_empty_file(tmp_path, name, content):
    (tmp_path / name).write_text(content, encoding="utf-8")
    with pytest.raises(DataError, match="empty|no records"):
        load_records(str(tmp_path / name), recipe(tmp_path, "x").data)


def test_json_object_not_list(tmp_path):
    (tmp_path / "o.json").write_text('{\n  "data": [{"a": 1}]\n}', encoding="utf-8")
    with pytest.raises(DataError, match=r"holds an object with keys \['data'\]"):
        load_records(str(tmp_path / "o.json"), recipe(tmp_path, "x").data)


def test_missing_column_lists_found_columns(tmp_path, tokenizer):
    rows = [{"instruction": "a", "output": "b"}, {"instruction": "a", "answer": "b"}]
    with pytest.raises(DataError) as e:
        build(tmp_path, tokenizer, rows)
    msg = str(e.value)
    assert "train.jsonl' line 2 has no column 'output'" in msg
    assert "found columns: instruction, answer" in msg
    assert e.value.hint == "set data.columns.output=answer"


def test_wrong_type_names_record(tmp_path, tokenizer):
    with pytest.raises(DataError, match=r"line 3 column 'completion' is int 4, expected a string"):
        rows = [{"prompt": "a", "completion": "b"}] * 2 + [{"prompt": "a", "completion": 4}]
        build(tmp_path, tokenizer, rows, format="completion")
    with pytest.raises(DataError, match=r"line 1 messages\[1\]"):
        sharegpt = [{"role": "user", "content": "a"}, {"from": "gpt", "value": "b"}]
        build(tmp_path, tokenizer, [{"messages": sharegpt}], format="messages")


def test_folder_error_names_file(tmp_path, tokenizer):
    folder = tmp_path / "f"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", [{"text": "x"}] * 2)
    write_jsonl(folder / "b.jsonl", [{"text": "x"}, {"txt": "y"}])
    with pytest.raises(DataError, match=r"b\.jsonl' line 2 has no column 'text'"):
        build_datasets(recipe(tmp_path, folder, format="text"), tokenizer)


# --------------------------------------------------------------------------- check_data_source


def test_check_data_source(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", ROWS)
    assert check_data_source(recipe(tmp_path, good)) == []
    assert check_data_source(recipe(tmp_path, "tatsu-lab/alpaca")) == []  # hub id: not fetched by validate

    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVO}])
    assert check_data_source(recipe(tmp_path, chat)) == [
        f"data.path: '{chat}' line 1 has no column 'instruction' needed by data.format=alpaca "
        "(found columns: messages); set data.format=messages"
    ]
    qa = write_jsonl(tmp_path / "qa.jsonl", [{"instruction": "a", "answer": "b"}])
    problems = check_data_source(recipe(tmp_path, qa, eval_path=str(tmp_path / "missing.jsonl")))
    assert len(problems) == 2
    assert problems[0].endswith("(found columns: instruction, answer); set data.columns.output=answer")
    assert problems[1].startswith("data.eval_path: file '") and f"(cwd: {os.getcwd()})" in problems[1]
    (tmp_path / "empty.jsonl").write_text("")
    assert check_data_source(recipe(tmp_path, tmp_path / "empty.jsonl"))[0].startswith("data.path: '")
    both = write_jsonl(tmp_path / "both.jsonl", [{"messages": CONVO, "instruction": "a", "answer": "b"}])
    (problem,) = check_data_source(recipe(tmp_path, both))
    assert problem.endswith("set data.format=messages or data.columns.output=answer")


def test_check_data_source_exact_match_path(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", ROWS)
    em = write_jsonl(tmp_path / "em.jsonl", [{"prompt": "Q", "completion": "A"}])
    cfg = build_recipe(
        {
            "model": {"path": "tiny"},
            "data": {"path": str(good)},
            "eval": {"exact_match_path": str(em)},
            "output_dir": str(tmp_path / "run"),
        }
    )
    (problem,) = check_data_source(cfg)
    assert problem.startswith("eval.exact_match_path: ") and "set data.format=completion" in problem


def test_check_data_source_only_reads_first_records(tmp_path):
    p = tmp_path / "big.jsonl"
    p.write_text("".join(json.dumps(ROWS[0]) + "\n" for _ in range(150)) + "{broken\n", encoding="utf-8")
    assert check_data_source(recipe(tmp_path, p)) == []


# --------------------------------------------------------------------------- prompt_and_answer, collator, stats


def test_prompt_and_answer_alpaca_matches_training(tmp_path, tokenizer):
    b = build(tmp_path, tokenizer, ROWS[:1])
    prompt, answer = prompt_and_answer(ROWS[0], "alpaca", tokenizer)
    assert prompt == [BOS_ID] + ids(ALPACA_WITH_INPUT.format(instruction="Add.", input="1 + 2"))
    assert answer == "3"
    assert b.train[0]["input_ids"][: len(prompt)] == prompt
    assert b.train[0]["labels"][len(prompt) - 1] == M and b.train[0]["labels"][len(prompt)] != M


def test_prompt_and_answer_messages(tmp_path, tokenizer):
    prompt, answer = prompt_and_answer({"messages": CONVO}, "messages", tokenizer)
    trained = build(tmp_path, tokenizer, [{"messages": CONVO}], format="messages").train[0]
    assert trained["input_ids"][: len(prompt)] == prompt  # generation sees exactly what training saw
    history = turn("system", "Be brief.") + turn("user", "2+2?") + turn("assistant", "4") + turn("user", "3+3?")
    assert prompt == [BOS_ID] + history + [IM_START_ID] + ids("assistant\n")
    assert answer == "6"
    assert prompt_and_answer({"prompt": "Q", "completion": "A"}, "completion", tokenizer) == ([BOS_ID] + ids("Q"), "A")
    with pytest.raises(DataError, match="no prompt/answer split"):
        prompt_and_answer({"text": "x"}, "text", tokenizer)


def test_collator_pads_right_exactly():
    batch = [{"input_ids": [1, 7, 8], "labels": [M, 7, 8]}, {"input_ids": [1, 9], "labels": [M, 9]}]
    out = Collator(pad_token_id=PAD_ID)(batch)
    assert {k: v.tolist() for k, v in out.items()} == {
        "input_ids": [[1, 7, 8], [1, 9, 0]],
        "labels": [[M, 7, 8], [M, 9, M]],
        "attention_mask": [[1, 1, 1], [1, 1, 0]],
    }
    assert all(v.dtype.is_floating_point is False and str(v.dtype) == "torch.int64" for v in out.values())
    out4 = Collator(pad_token_id=PAD_ID, pad_to_multiple_of=4)(batch)
    assert out4["input_ids"].tolist() == [[1, 7, 8, 0], [1, 9, 0, 0]]
    assert out4["labels"].tolist() == [[M, 7, 8, M], [M, 9, M, M]]
    assert out4["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]


def test_stats_summary_format():
    expected = "2000 examples, 123,456 tokens (34.5% trained), 3 truncated, 0 dropped"
    assert DataStats(2000, 0, 3, 123456, 42600).summary() == expected
    assert DataStats(0, 0, 0, 0, 0).summary() == "0 examples, 0 tokens (0.0% trained), 0 truncated, 0 dropped"


def test_data_imports_only_config_and_errors():
    # The data package stands early in the flow: nothing but config and errors from outside it.
    names = set()
    for path in (Path(__file__).resolve().parents[1] / "finetune" / "data").glob("*.py"):
        tree = ast.parse(path.read_text())
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    outside = {n for n in names if n.startswith("finetune") and not n.startswith("finetune.data")}
    assert outside == {"finetune.config.schema", "finetune.errors"}


# --------------------------------------------------------------------------- the format registry, input_output


def test_input_output_golden_with_system(tmp_path, tokenizer):
    row = {"system": "Be brief.", "input": "2+2?", "output": "4"}
    b = build(tmp_path, tokenizer, [row], format="input_output")
    head = [IM_START_ID] + ids("assistant\n")
    prompt = [BOS_ID] + turn("system", "Be brief.") + turn("user", "2+2?") + head
    assert b.train[0]["input_ids"] == [BOS_ID] + turn("system", "Be brief.") + turn("user", "2+2?") + turn("assistant", "4")
    assert b.train[0]["labels"] == [M] * len(prompt) + ids("4") + [IM_END_ID] + ids("\n")
    assert [t for t in b.train[0]["labels"] if t != M] == [char_token_id("4"), IM_END_ID, char_token_id("\n")]
    # The same conversation as data.format=messages trains exactly the same tokens.
    same = build(tmp_path, tokenizer, [{"messages": CONVO[:3]}], name="m.jsonl", format="messages")
    assert same.train == b.train


@pytest.mark.parametrize("system", [{}, {"system": None}, {"system": ""}, {"system": "  "}])
def test_input_output_golden_without_system(tmp_path, tokenizer, system):
    b = build(tmp_path, tokenizer, [{"input": "hi", "output": "yo", **system}], format="input_output")
    prompt = [BOS_ID] + turn("user", "hi") + [IM_START_ID] + ids("assistant\n")
    assert b.train[0]["input_ids"] == prompt + ids("yo") + [IM_END_ID] + ids("\n")
    assert b.train[0]["labels"] == [M] * len(prompt) + ids("yo") + [IM_END_ID] + ids("\n")
    # Evaluation and `finetune generate` prompt with exactly the tokens before the reply.
    assert prompt_and_answer({"input": "hi", "output": "yo", **system}, "input_output", tokenizer) == (prompt, "yo")
    assert generation_prompt("hi", "input_output", tokenizer) == prompt


def test_input_output_bad_records_name_file_and_record(tmp_path, tokenizer):
    rows = [{"input": "a", "output": "b"}, {"input": "a", "answer": "b"}]
    with pytest.raises(DataError) as e:
        build(tmp_path, tokenizer, rows, format="input_output")
    assert str(e.value).startswith(
        f"data.path: '{tmp_path / 'train.jsonl'}' line 2 has no column 'output' needed by data.format=input_output "
        "(found columns: input, answer)"
    )
    assert e.value.hint == "set data.columns.output=answer"
    with pytest.raises(DataError, match=r"line 1 column 'system' is int 3, expected a string"):
        build(tmp_path, tokenizer, [{"input": "a", "output": "b", "system": 3}], format="input_output")
    # No reply to learn from: dropped and counted, like an empty messages reply.
    b = build(tmp_path, tokenizer, [{"input": "a", "output": "b"}, {"input": "a", "output": " "}], format="input_output")
    assert (b.train_stats.examples, b.train_stats.dropped) == (1, 1)


def test_column_hints_suggest_the_format_that_reads_most_columns(tmp_path):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"input": "a", "output": "b"}])
    (problem,) = check_data_source(recipe(tmp_path, pairs))  # data.format=alpaca
    assert problem.endswith(
        "has no column 'instruction' needed by data.format=alpaca (found columns: input, output); set data.format=input_output"
    )
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", ROWS)  # fits input_output too, but alpaca reads all three columns
    (problem,) = check_data_source(recipe(tmp_path, alpaca, format="completion"))
    assert "set data.format=alpaca" in problem


def test_registry_names_agree_with_config_and_modules():
    from typing import get_args

    from finetune.config.schema import DataFormat
    from finetune.data.formats import FORMATS

    assert tuple(FORMATS) == get_args(DataFormat)
    folder = Path(__file__).resolve().parents[1] / "finetune" / "data" / "formats"
    assert {p.stem for p in folder.glob("*.py")} - {"__init__", "base"} == set(FORMATS)
    for name, f in FORMATS.items():
        assert f.name == name and set(f.columns).isdisjoint(f.optional)
        assert f.problem(f.prompt_record("hi", "")) is None, name  # generate's records pass the format's own check
    from finetune.errors import ConfigError

    with pytest.raises(ConfigError, match="data.format: Input should be 'alpaca', 'completion', 'input_output', "):
        build_recipe({"model": {"path": "tiny"}, "data": {"path": "d", "format": "input_ouput"}, "output_dir": "r"})


def test_get_format_did_you_mean():
    from finetune.data.formats import get_format

    assert get_format("sharegpt").name == "sharegpt"
    with pytest.raises(DataError, match="unknown data.format 'sharegtp'") as e:
        get_format("sharegtp")
    assert e.value.hint.startswith("did you mean 'sharegpt'? formats: alpaca, completion, input_output, ")


def test_readme_data_table_is_the_registry():
    from finetune.data.formats import FORMATS

    lines = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8").splitlines()
    start = lines.index("| `data.format` | a record | trained by default |") + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append(tuple(cell.strip() for cell in line.strip().strip("|").split(" | ")))
    expected = [(f"`{name}`", f.example, f.trained) for name, f in FORMATS.items()]
    table = "\n".join(f"| {' | '.join(row)} |" for row in expected)
    assert rows == expected, f"README's Data table should read:\n{table}"


def test_recipes_and_cli_offer_every_format():
    import argparse

    from finetune.cli.commands import build_parser
    from finetune.config.schema import shipped_recipes
    from finetune.data.formats import FORMATS

    for name, path in shipped_recipes().items():
        (line,) = [ln for ln in path.read_text().splitlines() if ln.strip().startswith("format:")]
        assert all(fmt in line.split("#", 1)[1] for fmt in FORMATS), f"{name}: {line!r} should name {list(FORMATS)}"
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    (fmt_option,) = [a for a in sub.choices["generate"]._actions if a.dest == "format"]
    assert fmt_option.choices == list(FORMATS)


def test_format_modules_import_only_base():
    # A format is self-contained: it may lean on base.py, nothing else of the package.
    folder = Path(__file__).resolve().parents[1] / "finetune" / "data" / "formats"
    for path in folder.glob("*.py"):
        if path.stem == "__init__":
            continue
        tree = ast.parse(path.read_text())
        names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        ours = {n for n in names if n.startswith("finetune")}
        assert ours <= {"finetune.data.formats.base"}, f"{path.name} imports {ours}"
