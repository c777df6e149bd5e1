"""finetune.data beyond the basic formats: built-in templates, ShareGPT, train_on, the mask checker,
bad rows, mixing, packing (logits equality), length grouping, the tokenized cache, `finetune data`.

    python -m pytest tests/test_data_pipeline.py -q
"""

from __future__ import annotations

import copy
import json
import math
import random

import pytest
import torch
from conftest import BOS_ID, EOS_ID, IM_END_ID, IM_START_ID, PAD_ID, char_token_id, write_jsonl

from finetune.config.schema import build_recipe
from finetune.data import (
    IGNORE_INDEX,
    Collator,
    TokenizedData,
    build_datasets,
    count_tokens,
    length_grouped,
    pack_rows,
)
from finetune.data.show import marked_text
from finetune.errors import DataError

M = IGNORE_INDEX


def ids(text: str) -> list[int]:
    return [char_token_id(c) for c in text]


def recipe(tmp_path, path, **data):
    data = {"path": str(path), "cache_dir": str(tmp_path / "cache"), **data}
    return build_recipe({"model": {"path": "tiny"}, "data": data, "output_dir": str(tmp_path / "run"), "seed": 0})


def build(tmp_path, tok, rows, name="train.jsonl", **data):
    return build_datasets(recipe(tmp_path, write_jsonl(tmp_path / name, rows), **data), tok)


@pytest.fixture
def plain_tok(tokenizer):
    """The char tokenizer without a chat template (a base model's)."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = None
    return tok


CONVO = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "Q"},
    {"role": "assistant", "content": "A"},
    {"role": "user", "content": "R"},
    {"role": "assistant", "content": "B"},
]
SHAREGPT = [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]} for m in CONVO]


def chatml(role, content):
    return [IM_START_ID] + ids(f"{role}\n{content}") + [IM_END_ID] + ids("\n")


# --------------------------------------------------------------------------- templates, golden


def test_builtin_chatml_golden_on_a_tokenizer_without_template(tmp_path, plain_tok):
    b = build(tmp_path, plain_tok, [{"messages": CONVO}], format="messages", template="chatml")
    gen = [IM_START_ID] + ids("assistant\n")
    expected = [BOS_ID] + chatml("system", "S") + chatml("user", "Q") + chatml("assistant", "A")
    expected += chatml("user", "R") + chatml("assistant", "B")
    reply = lambda c: ids(c) + [IM_END_ID] + ids("\n")  # noqa: E731
    labels = [M] * (1 + len(chatml("system", "S")) + len(chatml("user", "Q")) + len(gen)) + reply("A")
    labels += [M] * (len(chatml("user", "R")) + len(gen)) + reply("B")
    assert b.train[0] == {"input_ids": expected, "labels": labels}
    assert "<|im_start|>" in plain_tok.chat_template  # installed: the saved tokenizer carries it


def test_builtin_mistral_golden_system_folded_into_first_turn(tmp_path, plain_tok):
    b = build(tmp_path, plain_tok, [{"messages": CONVO}], format="messages", template="mistral")
    # "<s>[INST] S\n\nQ [/INST]A</s>[INST] R [/INST]B</s>": the template writes <s>, the tokenizer adds none.
    p1, p2 = ids("[INST] S\n\nQ [/INST]"), ids("[INST] R [/INST]")
    assert b.train[0]["input_ids"] == [BOS_ID] + p1 + ids("A") + [EOS_ID] + p2 + ids("B") + [EOS_ID]
    assert b.train[0]["labels"] == [M] * (1 + len(p1)) + ids("A") + [EOS_ID] + [M] * len(p2) + ids("B") + [EOS_ID]


def test_builtin_alpaca_template_golden(tmp_path, plain_tok):
    b = build(tmp_path, plain_tok, [{"messages": CONVO}], format="messages", template="alpaca")
    p1 = ids("S\n\n### Instruction:\nQ\n\n### Response:\n")
    p2 = ids("\n\n### Instruction:\nR\n\n### Response:\n")
    assert b.train[0]["input_ids"] == [BOS_ID] + p1 + ids("A") + [EOS_ID] + p2 + ids("B") + [EOS_ID]
    assert b.train[0]["labels"] == [M] * (1 + len(p1)) + ids("A") + [EOS_ID] + [M] * len(p2) + ids("B") + [EOS_ID]


def test_builtin_llama3_golden_with_its_special_tokens(tmp_path, plain_tok):
    tok = copy.deepcopy(plain_tok)
    tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    sh, eh, eot = tok.convert_tokens_to_ids(["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    b = build(tmp_path, tok, [{"messages": CONVO[1:3]}], format="messages", template="llama3")
    head = lambda role: [sh] + ids(role) + [eh] + ids("\n\n")  # noqa: E731
    assert b.train[0]["input_ids"] == [BOS_ID] + head("user") + ids("Q") + [eot] + head("assistant") + ids("A") + [eot]
    n_prompt = 1 + len(head("user")) + 2 + len(head("assistant"))
    assert b.train[0]["labels"] == [M] * n_prompt + ids("A") + [eot]


def test_llama3_template_without_its_end_token_is_refused(tmp_path, plain_tok):
    # The char tokenizer has no <|eot_id|> token: replies would end in plain characters the
    # model never learns to stop on. The mask checker says so, naming the record.
    with pytest.raises(
        DataError, match=r"end_untrained: 1 example, first .*train\.jsonl' line 1: reply ends in tokens .*none of them eos"
    ) as err:
        build(tmp_path, plain_tok, [{"messages": CONVO[1:3]}], format="messages", template="llama3")
    assert "data.template=chatml" in err.value.hint


def test_chat_data_without_any_template_names_builtins(tmp_path, plain_tok):
    with pytest.raises(DataError, match="needs a chat template") as err:
        build(tmp_path, plain_tok, [{"messages": CONVO}], format="messages")
    assert "chatml" in err.value.hint and "llama3" in err.value.hint


def test_sharegpt_equals_messages(tmp_path, tokenizer):
    a = build(tmp_path, tokenizer, [{"messages": CONVO}], format="messages", cache=False)
    b = build(tmp_path, tokenizer, [{"conversations": SHAREGPT}], name="sg.jsonl", format="sharegpt", cache=False)
    assert a.train == b.train and a.train_stats.trained_tokens == 6


def test_sharegpt_column_remap_and_unknown_speaker(tmp_path, tokenizer):
    b = build(tmp_path, tokenizer, [{"chat": SHAREGPT}], format="sharegpt", columns={"conversations": "chat"})
    assert b.train_stats.examples == 1
    bad = [{"from": "narrator", "value": "x"}] + SHAREGPT[1:]
    with pytest.raises(DataError, match=r"bad\.jsonl' line 1 conversations\[0\] has speaker 'narrator'"):
        build(tmp_path, tokenizer, [{"conversations": bad}], name="bad.jsonl", format="sharegpt")


# --------------------------------------------------------------------------- train_on


def test_train_on_last_and_all(tmp_path, tokenizer):
    full = build(tmp_path, tokenizer, [{"messages": CONVO}], format="messages", cache=False).train[0]
    last = build(tmp_path, tokenizer, [{"messages": CONVO}], format="messages", train_on="last", cache=False).train[0]
    every = build(tmp_path, tokenizer, [{"messages": CONVO}], format="messages", train_on="all", cache=False).train[0]
    first_reply_end = full["labels"].index(IM_END_ID) + 2  # "A", <|im_end|>, "\n"
    assert last["labels"][:first_reply_end] == [M] * first_reply_end  # reply A not trained
    assert last["labels"][first_reply_end:] == full["labels"][first_reply_end:]  # reply B as before
    assert every["labels"] == [M] + every["input_ids"][1:]  # everything but the first token
    comp = build(tmp_path, tokenizer, [{"prompt": "Q:", "completion": "4"}], name="c.jsonl", format="completion", train_on="all")
    assert comp.train[0]["labels"] == [M] + ids("Q:4") + [EOS_ID]


def test_pad_equal_to_eos_still_trains_eos(tmp_path, tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.pad_token = tok.eos_token
    b = build(tmp_path, tok, [{"prompt": "Q:", "completion": "4"}, {"prompt": "Q:", "completion": "42"}], format="completion")
    batch = Collator(pad_token_id=tok.pad_token_id)(list(b.train))
    assert tok.pad_token_id == EOS_ID
    # Row 0 is padded with eos ids, yet its own eos is a target and the padding is not.
    assert batch["input_ids"][0].tolist() == [BOS_ID] + ids("Q:4") + [EOS_ID, EOS_ID]
    assert batch["labels"][0].tolist() == [M, M, M] + ids("4") + [EOS_ID, M]
    assert batch["labels"][1].tolist()[-1] == EOS_ID


# --------------------------------------------------------------------------- mask checker


def test_template_without_end_token_refused_then_warned(tmp_path, tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
    rows = [{"messages": CONVO[1:3]}] * 3
    with pytest.raises(DataError, match=r"end_untrained: 3 examples, first .*train\.jsonl' line 1"):
        build(tmp_path, tok, rows, format="messages")
    b = build(tmp_path, tok, rows, format="messages", mask_check="warn")
    assert [w.split(",")[0] for w in b.train_stats.warnings] == ["mask check (kept): end_untrained: 3 examples"]
    assert build(tmp_path, tok, rows, format="messages", mask_check="off").train_stats.warnings == []


def test_double_bos_refused(tmp_path, tokenizer):
    # Data that already starts with the BOS string, tokenized by a tokenizer that adds BOS.
    with pytest.raises(DataError, match=r"double_bos: 1 example, first .*train\.jsonl' line 2: tokens \['<s>', '<s>'"):
        build(
            tmp_path,
            tokenizer,
            [{"prompt": "Q:", "completion": "1"}, {"prompt": "<s>Q:", "completion": "4"}],
            format="completion",
        )


def test_inconsistent_chat_template_boundary(tmp_path, tokenizer):
    tok = copy.deepcopy(tokenizer)
    # A short conversation's length written before its generation prompt: the first reply's prompt is one
    # the whole conversation never holds, so that reply cannot be placed (the last one can).
    gen = "{% if add_generation_prompt %}"
    tok.chat_template = tok.chat_template.replace(gen, "{% if messages|length < 3 %}{{ messages|length }}{% endif %}" + gen)
    with pytest.raises(DataError, match=r"boundary: 1 example.*up to message 1 differently"):
        build(tmp_path, tok, [{"messages": CONVO[1:]}], format="messages")


def test_prompt_response_boundary_found_with_a_bpe_tokenizer(tmp_path):
    # Byte-level BPE writes a space with the word after it: "Answer: " + "4" would train
    # [..., "Ġ", "4"] where running text has [..., "Ġ4"]. The shipped tiny tokenizer shows it.
    from transformers import AutoTokenizer

    from finetune.config.schema import resolve_path

    tok = AutoTokenizer.from_pretrained(resolve_path("asset:tiny-llama"))
    rows = [{"prompt": "Answer: ", "completion": "yes"}]
    with pytest.raises(DataError, match=r"boundary: 1 example.*straddles the end of the prompt.*'Answer: '"):
        build(tmp_path, tok, rows, format="completion")
    ok = build(tmp_path, tok, [{"prompt": "Answer:", "completion": " yes"}], name="ok.jsonl", format="completion")
    ex = ok.train[0]
    prompt = tok("Answer:")["input_ids"]
    assert ex["input_ids"][: len(prompt)] == prompt and ex["labels"][: len(prompt)] == [M] * len(prompt)
    assert tok.decode([t for t in ex["labels"] if t != M]) == " yes" + tok.eos_token


# --------------------------------------------------------------------------- bad input


def test_role_problems_name_the_record(tmp_path, tokenizer):
    cases = {
        "role 'robot'": [CONVO[1], {"role": "robot", "content": "x"}],
        "tool result that follows user": [CONVO[1], {"role": "tool", "content": "42"}, CONVO[2]],
    }
    for i, (what, msgs) in enumerate(cases.items()):
        rows = [{"messages": CONVO}, {"messages": msgs}]
        with pytest.raises(DataError, match=rf"train{i}\.jsonl' line 2 .*{what}") as err:
            build(tmp_path, tokenizer, rows, name=f"train{i}.jsonl", format="messages")
        assert "skip_bad_rows" in err.value.hint
    # What a template may accept is left to it: two user turns in a row render fine in ChatML.
    ok = build(tmp_path, tokenizer, [{"messages": [CONVO[1], CONVO[3], CONVO[2]]}], name="ok.jsonl", format="messages")
    assert ok.train_stats.examples == 1


def test_greeting_and_empty_replies_are_not_trained(tmp_path, tokenizer):
    greeting = {"role": "assistant", "content": "Hi!"}
    empty = {"role": "assistant", "content": ""}
    msgs = [CONVO[0], greeting, CONVO[1], empty, CONVO[3], CONVO[4]]
    ex = build(tmp_path, tokenizer, [{"messages": msgs}], format="messages").train[0]
    trained = [t for t in ex["labels"] if t != M]
    assert trained == ids("B") + [IM_END_ID] + ids("\n")  # only the one reply with text
    last_empty = build(
        tmp_path, tokenizer, [{"messages": CONVO[1:3] + [CONVO[3], empty]}], name="e.jsonl", format="messages", train_on="last"
    )
    assert [t for t in last_empty.train[0]["labels"] if t != M] == ids("A") + [IM_END_ID] + ids("\n")


TOOL_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}"
    "{% if m['tool_calls'] is defined %}{% for c in m['tool_calls'] %}{{ 'CALL ' + c['function']['name'] }}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TOOL_CONVO = [
    {"role": "user", "content": "Q"},
    {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "tool", "content": "7", "tool_call_id": "1"},
    {"role": "assistant", "content": "A"},
]


def test_tool_calls_reach_the_template_and_are_trained(tmp_path, tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TOOL_TEMPLATE
    ex = build(tmp_path, tok, [{"messages": TOOL_CONVO}], format="messages").train[0]
    trained = [t for t in ex["labels"] if t != M]
    assert trained == ids("CALL f") + [IM_END_ID] + ids("\n") + ids("A") + [IM_END_ID] + ids("\n")
    # A built-in template would drop the call without a word: it refuses, naming the record.
    with pytest.raises(DataError, match=r"train2\.jsonl' line 1: the chat template failed.*cannot render tool calls"):
        build(tmp_path, tok, [{"messages": TOOL_CONVO}], name="train2.jsonl", format="messages", template="chatml")


def test_skip_bad_rows_counts_them(tmp_path, tokenizer):
    path = tmp_path / "mixed.jsonl"
    good = json.dumps({"prompt": "Q:", "completion": "4"})
    path.write_text("\n".join([good, "{not json", json.dumps({"prompt": 3, "completion": "x"}), good, "[1]"]) + "\n")
    with pytest.raises(DataError, match=r"line 2 is not valid JSON"):
        build_datasets(recipe(tmp_path, path, format="completion"), tokenizer)
    b = build_datasets(recipe(tmp_path, path, format="completion", skip_bad_rows=True), tokenizer)
    assert (b.train_stats.examples, b.train_stats.skipped) == (2, 3)
    assert "2 malformed" not in b.train_stats.summary() and "3 malformed (skipped)" in b.train_stats.summary()
    assert any("line 2 is not valid JSON" in w for w in b.train_stats.warnings)


def test_too_long_truncate_or_drop(tmp_path, tokenizer):
    rows = [{"prompt": "Q:", "completion": "x" * 30}, {"prompt": "Q:", "completion": "y"}]
    t = build(tmp_path, tokenizer, rows, format="completion", max_seq_len=16)
    assert (t.train_stats.examples, t.train_stats.truncated, t.train_stats.too_long) == (2, 1, 0)
    assert len(t.train[0]["input_ids"]) == 16
    d = build(tmp_path, tokenizer, rows, format="completion", max_seq_len=16, truncation="drop")
    assert (d.train_stats.examples, d.train_stats.truncated, d.train_stats.too_long) == (1, 0, 1)
    assert "1 too long (dropped)" in d.train_stats.summary()
    with pytest.raises(DataError, match="no training examples left.*1 longer than data.max_seq_len"):
        build(tmp_path, tokenizer, rows[:1], name="one.jsonl", format="completion", max_seq_len=16, truncation="drop")


# --------------------------------------------------------------------------- mixing


def test_mix_with_weights(tmp_path, tokenizer):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}", "completion": "x"} for i in range(10)])
    b = tmp_path / "b.csv"
    b.write_text("question,answer\n" + "".join(f"b{i},y\n" for i in range(8)))
    cfg = recipe(
        tmp_path,
        a,
        format="completion",
        weight=2.0,
        mix=[{"path": str(b), "weight": 0.5, "columns": {"prompt": "question", "completion": "answer"}}],
    )
    data = build_datasets(cfg, tokenizer)
    texts = [_decode(ex["input_ids"]) for ex in data.train]
    assert sum(t.startswith("a") for t in texts) == 20  # every a-record twice
    assert sum(t.startswith("b") for t in texts) == 4  # a seeded half of b
    assert build_datasets(cfg, tokenizer, use_cache=False).train == data.train  # deterministic


def _decode(input_ids):
    from conftest import CHARS, SPECIALS

    return "".join(CHARS[t - len(SPECIALS)] for t in input_ids if t >= len(SPECIALS))


# --------------------------------------------------------------------------- packing


def test_pack_rows_wastes_little_on_lognormal_lengths():
    rng = random.Random(0)
    lengths = [min(1024, max(8, int(rng.lognormvariate(5.0, 0.8)))) for _ in range(5000)]
    rows = pack_rows(lengths, 1024)
    assert sorted(i for row in rows for i in row) == list(range(5000))  # each example exactly once
    assert max(sum(lengths[i] for i in row) for row in rows) <= 1024
    waste = 1 - sum(lengths) / (len(rows) * 1024)
    assert waste < 0.01, waste  # README: under 1% of a row empty on skewed lengths (0.14% here)
    assert len(rows) <= math.ceil(sum(lengths) / 1024) + 1  # within one row of the bound no packing beats (991 vs 990)


def test_packed_rows_golden_positions_and_collation():
    examples = [([1, 10, 11], [M, 10, 11]), ([1, 12], [M, 12]), ([1, 13, 14, 15], [M, 13, 14, 15])]
    data = TokenizedData.from_examples(examples, rows=[[2], [0, 1]])
    assert data[0] == {"input_ids": [1, 13, 14, 15], "labels": [M, 13, 14, 15], "position_ids": [0, 1, 2, 3]}
    assert data[1] == {"input_ids": [1, 10, 11, 1, 12], "labels": [M, 10, 11, M, 12], "position_ids": [0, 1, 2, 0, 1]}
    batch = Collator(pad_token_id=0)(list(data))
    assert batch["input_ids"].tolist() == [[1, 13, 14, 15, 0], [1, 10, 11, 1, 12]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0], [0, 1, 2, 0, 1]]  # padding: a segment of its own
    assert batch["labels"].tolist() == [[M, 13, 14, 15, M], [M, 10, 11, M, 12]]
    assert "attention_mask" not in batch and count_tokens(batch) == 9
    assert data.example_lengths().tolist() == [4, 3, 2]


def test_packed_logits_equal_unpacked_and_loss_is_the_same(tmp_path, tiny_model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    from finetune.trainer import loss_sum_and_count

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    rows = [{"prompt": f"Q{i}:" * (i + 1), "completion": "ab" * (3 - i % 3)} for i in range(5)]
    plain = build(tmp_path, tokenizer, rows, format="completion", cache=False)
    packed = build(tmp_path, tokenizer, rows, format="completion", cache=False, packing=True, max_seq_len=64)
    assert packed.train.packed and len(packed.train) == 2 and packed.train_stats.rows == 2
    with torch.no_grad():
        separate = {tuple(ex["input_ids"]): model(torch.tensor([ex["input_ids"]])).logits[0] for ex in plain.train}
        batch = Collator(pad_token_id=PAD_ID)(list(packed.train))
        # use_cache=False as the trainer passes it: with a KV cache transformers ignores packing.
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        # Every example's logits inside its packed row equal its logits alone.
        seen = 0
        for r, row in enumerate(packed.train):
            starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["input_ids"])]
            for a, b in zip(starts, starts[1:]):
                alone = separate[tuple(row["input_ids"][a:b])]
                torch.testing.assert_close(out[r, a:b], alone, rtol=0, atol=1e-5)
                seen += 1
        assert seen == 5
        total_packed, n_packed = loss_sum_and_count(out, batch["labels"])
        plain_batch = Collator(pad_token_id=PAD_ID)(list(plain.train))
        logits = model(input_ids=plain_batch["input_ids"], attention_mask=plain_batch["attention_mask"]).logits
        total_plain, n_plain = loss_sum_and_count(logits, plain_batch["labels"])
    assert n_packed == n_plain == plain.train_stats.trained_tokens
    torch.testing.assert_close(total_packed, total_plain, rtol=1e-5, atol=1e-4)


def test_length_grouped_is_a_permutation_sorted_within_groups():
    lengths = [random.Random(1).randint(1, 100) for _ in range(50)]
    order = list(range(50))
    random.Random(2).shuffle(order)
    grouped = length_grouped(order, lengths, 10)
    assert sorted(grouped) == list(range(50))
    for g in range(0, 50, 10):
        chunk = grouped[g : g + 10]
        assert set(chunk) == set(order[g : g + 10])
        assert [lengths[i] for i in chunk] == sorted((lengths[i] for i in chunk), reverse=True)


# --------------------------------------------------------------------------- cache


def test_cache_hit_miss_and_invalidation(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"Q{i}:", "completion": "4"} for i in range(20)])
    cfg = recipe(tmp_path, path, format="completion", eval_fraction=0.2)
    first = build_datasets(cfg, tokenizer)
    again = build_datasets(cfg, tokenizer)
    assert (first.from_cache, again.from_cache) == (False, True)
    assert again.train == first.train and again.eval == first.eval
    assert again.train_stats.summary() == first.train_stats.summary()
    assert len(list((tmp_path / "cache" / "data").iterdir())) == 1

    changed = [
        (recipe(tmp_path, path, format="completion", eval_fraction=0.2, max_seq_len=64), tokenizer),
        (recipe(tmp_path, path, format="completion", eval_fraction=0.1), tokenizer),
        (recipe(tmp_path, path, format="completion", eval_fraction=0.2, packing=True), tokenizer),
    ]
    tok2 = copy.deepcopy(tokenizer)
    tok2.add_special_tokens({"additional_special_tokens": ["<extra>"]})
    changed.append((cfg, tok2))
    for c, tok in changed:
        assert build_datasets(c, tok).from_cache is False
    # Shuffling, num_proc and the mask-check policy do not change the tokens: still a hit.
    same = recipe(tmp_path, path, format="completion", eval_fraction=0.2, shuffle=False, num_proc=2, mask_check="warn")
    assert build_datasets(same, tokenizer).from_cache is True
    # One changed byte in the data: a miss, with the new content.
    path.write_text(path.read_text().replace("Q3:", "Q9:"))
    edited = build_datasets(cfg, tokenizer)
    assert edited.from_cache is False and edited.train != first.train


def test_cache_keeps_mask_findings_and_survives_corruption(tmp_path, tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
    path = write_jsonl(tmp_path / "train.jsonl", [{"messages": CONVO[1:3]}])
    warn = recipe(tmp_path, path, format="messages", mask_check="warn")
    assert build_datasets(warn, tok).from_cache is False
    with pytest.raises(DataError, match="end_untrained"):  # a cache hit still enforces data.mask_check=error
        build_datasets(recipe(tmp_path, path, format="messages"), tok)
    entry = next((tmp_path / "cache" / "data").iterdir())
    (entry / "train.safetensors").write_bytes(b"garbage")
    rebuilt = build_datasets(warn, tok)
    assert rebuilt.from_cache is False and rebuilt.train_stats.examples == 1
    assert build_datasets(warn, tok).from_cache is True  # the torn entry was replaced, not left to fail forever


def test_cache_key_ignores_tokenizer_call_state_but_follows_code(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    import finetune.data.cache as cache
    from finetune.config.schema import resolve_path

    tok = AutoTokenizer.from_pretrained(resolve_path("asset:tiny-llama"))  # its tokenizer.json stores padding
    before = cache.tokenizer_fingerprint(tok)
    tok(["a", "bb cc"], padding=True)
    assert cache.tokenizer_fingerprint(tok) == before
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "Q:", "completion": " 4"}])
    cfg = recipe(tmp_path, path, format="completion")
    assert build_datasets(cfg, tok).from_cache is False and build_datasets(cfg, tok).from_cache is True
    monkeypatch.setattr(cache, "CACHE_VERSION", cache.CACHE_VERSION + 1)  # stands for any change to the data code
    assert build_datasets(cfg, tok).from_cache is False


def test_num_proc_gives_identical_data(tmp_path, tokenizer, monkeypatch):
    import finetune.data.pipeline as pipeline

    monkeypatch.setattr(pipeline, "_CHUNK", 7)  # several chunks from a small file
    rows = [{"messages": CONVO[1:3] if i % 2 else CONVO} for i in range(30)]
    one = build(tmp_path, tokenizer, rows, format="messages", cache=False)
    two = build(tmp_path, tokenizer, rows, format="messages", cache=False, num_proc=2)
    assert one.train == two.train and len(one.train) == 30


# --------------------------------------------------------------------------- show


def test_marked_text_brackets_trained_runs(tokenizer):
    input_ids = [BOS_ID] + ids("Q:4") + [EOS_ID]
    labels = [M, M, M] + ids("4") + [EOS_ID]
    assert marked_text(tokenizer, input_ids, labels, color=False) == "<s>Q:[[4</s>]]"
    assert marked_text(tokenizer, input_ids, labels, color=True) == "\x1b[2m<s>Q:\x1b[0m\x1b[32;1m4</s>\x1b[0m"


def test_held_out_records_are_the_ones_training_held_out(tmp_path, tokenizer):
    # What `finetune eval` scores by default must be exactly the split training held out,
    # also with a second source and a skipped malformed row.
    from finetune.data import build_examples, held_out_records

    a = tmp_path / "a.jsonl"
    a.write_text("".join(json.dumps({"prompt": f"a{i}:", "completion": "x"}) + "\n" for i in range(12)) + "{bad\n")
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"b{i}:", "completion": "y"} for i in range(8)])
    cfg = recipe(tmp_path, a, format="completion", eval_fraction=0.25, skip_bad_rows=True, mix=[{"path": str(b)}])
    held = held_out_records(cfg)
    assert len(held) == 5 and {r["prompt"][0] for r in held} <= {"a", "b"}
    assert build_examples(held, cfg, tokenizer, "eval")[0] == build_datasets(cfg, tokenizer).eval


def test_a_template_that_drops_a_tool_call_is_refused_naming_the_record(tmp_path, tokenizer):
    # Like DeepSeek-R1's template under transformers (which drops a null content before rendering):
    # an assistant turn without text is rendered with its text only, and the call disappears.
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
        "{% if m['content'] %}{{ m['content'] }}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    with pytest.raises(DataError, match=r"train\.jsonl' line 1: the chat template dropped the tool call 'f' of message 1"):
        build(tmp_path, tok, [{"messages": TOOL_CONVO}], format="messages")


def test_a_conversation_whose_first_prompt_exceeds_max_seq_len_is_dropped_and_counted(tmp_path, tokenizer):
    long_first = {"messages": [{"role": "user", "content": "x" * 80}, {"role": "assistant", "content": "A"}]}
    fits = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "B"}]}
    b = build(tmp_path, tokenizer, [long_first, fits], format="messages", max_seq_len=48)
    assert (b.train_stats.examples, b.train_stats.dropped) == (1, 1)
    assert [t for t in b.train[0]["labels"] if t != M] == ids("B") + [IM_END_ID] + ids("\n")


def test_a_lone_surrogate_is_a_data_error_naming_the_record(tmp_path, tokenizer):
    path = tmp_path / "train.jsonl"
    good = json.dumps({"prompt": "Q:", "completion": "4"})
    path.write_text(good + "\n" + '{"prompt": "Q:", "completion": "bad \\ud800 text"}\n')
    with pytest.raises(DataError) as err:
        build_datasets(recipe(tmp_path, path, format="completion"), tokenizer)
    text = str(err.value)
    assert "line 2" in text and "lone surrogate \\ud800 at character 4 of completion" in text and "skip_bad_rows" in text
    skipped = build_datasets(recipe(tmp_path, path, format="completion", skip_bad_rows=True), tokenizer)
    assert (skipped.train_stats.examples, skipped.train_stats.skipped) == (1, 1)
