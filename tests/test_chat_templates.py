"""Real chat templates (tests/fixtures/chat_templates/: the chat_template of each model's published
tokenizer_config.json, as data): every reply trains exactly the tokens the template renders for it in
the whole conversation.

Each template runs on the bundled tiny BPE tokenizer with the model's special tokens added.
Masks are asserted token by token against an independent rendering: a Python function per
template, written from the model's documented format, that returns the conversation as
(text, is_reply) segments, a reply segment running from the end of the generation prompt
through the end-of-turn text up to the next message.

python -m pytest tests/test_chat_templates.py -q
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from conftest import write_jsonl

from finetune.config.schema import build_recipe, resolve_path
from finetune.data import IGNORE_INDEX, build_datasets
from finetune.data.masks import example_findings
from finetune.data.replies import Conversation
from finetune.data.templates import end_of_turn_ids
from finetune.data.tokenize import encode_chat
from finetune.errors import DataError

M = IGNORE_INDEX
FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"

# Per template: bos and eos as the model's tokenizer has them, the special tokens its template writes
# (listed as special, or only added as Phi-3's are), other added tokens, and what the tokenizer puts first.
_DEEPSEEK_TOOL = [f"<｜{n}｜>" for n in ("tool▁calls▁begin", "tool▁calls▁end", "tool▁call▁begin", "tool▁call▁end", "tool▁sep")]
_DEEPSEEK_OUT = [f"<｜{n}｜>" for n in ("tool▁outputs▁begin", "tool▁outputs▁end", "tool▁output▁begin", "tool▁output▁end")]
TOKENIZERS = {
    "llama-3.1": {
        "bos": "<|begin_of_text|>",
        "eos": "<|eot_id|>",
        "special": ["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"],
    },
    "qwen2.5": {
        "bos": None,
        "eos": "<|im_end|>",
        "special": ["<|im_start|>", "<|endoftext|>"],
        "added": ["<tool_call>", "</tool_call>"],
    },
    "qwen3": {
        "bos": None,
        "eos": "<|im_end|>",
        "special": ["<|im_start|>", "<|endoftext|>"],
        "added": ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"],
    },
    "mistral-v3": {
        "bos": "<s>",
        "eos": "</s>",
        "special": [
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ],
    },
    "gemma-2": {"bos": "<bos>", "eos": "<eos>", "special": ["<start_of_turn>", "<end_of_turn>"]},
    "gemma-3": {"bos": "<bos>", "eos": "<eos>", "special": ["<start_of_turn>", "<end_of_turn>"]},
    "phi-3": {
        "bos": "<s>",
        "eos": "<|endoftext|>",
        "added_special": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
        "head": ["<s>"],
    },
    "deepseek-r1-distill": {
        "bos": "<｜begin▁of▁sentence｜>",
        "eos": "<｜end▁of▁sentence｜>",
        "special": ["<｜User｜>", "<｜Assistant｜>", *_DEEPSEEK_TOOL, *_DEEPSEEK_OUT],
        "added": ["<think>", "</think>"],
    },
}


def make_tokenizer(name: str):
    from tokenizers import processors
    from transformers import AutoTokenizer

    spec = TOKENIZERS[name]
    tok = AutoTokenizer.from_pretrained(resolve_path("asset:tiny-llama"))
    tok.add_tokens(spec.get("added", []))
    tok.add_tokens(spec.get("added_special", []), special_tokens=True)
    tok.add_special_tokens({"eos_token": spec["eos"], "additional_special_tokens": spec.get("special", [])})
    if spec["bos"]:
        tok.add_special_tokens({"bos_token": spec["bos"]})
    if not spec.get("head") and not spec["bos"]:  # Qwen's tokenizers add no BOS
        tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B")
        tok.bos_token = None
    tok.chat_template = (FIXTURES / f"{name}.jinja").read_text(encoding="utf-8")
    return tok


@pytest.fixture(scope="module")
def tokenizers():
    return {name: make_tokenizer(name) for name in TOKENIZERS}


# --------------------------------------------------------------------------- conversations

SYSTEM = {"role": "system", "content": "Be brief."}
Q1 = {"role": "user", "content": "Capital of France?"}
A1 = {"role": "assistant", "content": "Paris."}
Q2 = {"role": "user", "content": "And of Italy?"}
A2 = {"role": "assistant", "content": "Rome."}
WEATHER = {"role": "user", "content": "Weather in Paris?"}
CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
}
RESULT = {"role": "tool", "content": "18C", "tool_call_id": "call12345"}
SAID = {"role": "assistant", "content": "It is 18C."}
R1 = {"role": "assistant", "content": "<think>\nIts capital.\n</think>\n\nParis."}
R2 = {"role": "assistant", "content": "<think>\nSame question.\n</think>\n\nRome."}
F1 = {"role": "assistant", "content": "Paris.", "reasoning_content": "Its capital."}
F2 = {"role": "assistant", "content": "Rome.", "reasoning_content": "Same question."}

RECORDS = {
    "system": [SYSTEM, Q1, A1, Q2, A2],
    "no_system": [Q1, A1, Q2, A2],
    "tool_call": [SYSTEM, WEATHER, CALL, RESULT, SAID, Q2, A2],
    "reasoning": [SYSTEM, Q1, R1, Q2, R2],
    "reasoning_field": [Q1, F1, Q2, F2],
}
# What each template cannot take, and the error that says so (the rest is asserted token by token).
REFUSED = {
    ("gemma-2", "system"): "System role not supported",
    ("gemma-2", "reasoning"): "System role not supported",
    ("gemma-2", "tool_call"): "System role not supported",
    ("gemma-3", "tool_call"): "roles must alternate",
    ("phi-3", "tool_call"): "the chat template dropped the tool call 'get_weather'",  # Phi-3 renders neither calls nor results
    ("deepseek-r1-distill", "tool_call"): "the chat template dropped the tool call 'get_weather'",  # content "" skips the call
}


# --------------------------------------------------------------------------- independent renderings


def _reply(gen_prompt: str, text: str) -> list[tuple[str, bool]]:
    return [(gen_prompt, False), (text, True)]


def _call_json(m: dict, key: str) -> str:
    fn = m["tool_calls"][0]["function"]
    return '{"name": "' + fn["name"] + '", "' + key + '": ' + json.dumps(fn["arguments"]) + "}"


def render_llama31(msgs: list[dict]) -> list[tuple[str, bool]]:
    def head(role: str) -> str:
        return f"<|start_header_id|>{role}<|end_header_id|>\n\n"

    system = msgs[0]["content"].strip() if msgs[0]["role"] == "system" else ""
    dated = "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
    out = [("<|begin_of_text|>" + head("system") + dated + system + "<|eot_id|>", False)]
    for m in msgs[1:] if system else msgs:
        if m["role"] == "assistant":
            body = _call_json(m, "parameters") if m.get("tool_calls") else m["content"].strip()
            out += _reply(head("assistant"), body + "<|eot_id|>")
        elif m["role"] == "tool":  # strings are iterable to Jinja: the template writes the result as JSON
            out.append((head("ipython") + json.dumps(m["content"]) + "<|eot_id|>", False))
        else:
            out.append((head(m["role"]) + m["content"].strip() + "<|eot_id|>", False))
    return out


def render_qwen25(msgs: list[dict]) -> list[tuple[str, bool]]:
    system = (
        msgs[0]["content"]
        if msgs[0]["role"] == "system"
        else "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    )
    out = [(f"<|im_start|>system\n{system}<|im_end|>\n", False)]
    for m in msgs[1:] if msgs[0]["role"] == "system" else msgs:
        if m["role"] == "assistant" and m.get("tool_calls"):
            out += _reply("<|im_start|>assistant\n", "<tool_call>\n" + _call_json(m, "arguments") + "\n</tool_call><|im_end|>\n")
        elif m["role"] == "assistant":
            out += _reply("<|im_start|>assistant\n", m["content"] + "<|im_end|>\n")
        elif m["role"] == "tool":
            out.append((f"<|im_start|>user\n<tool_response>\n{m['content']}\n</tool_response><|im_end|>\n", False))
        else:
            out.append((f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n", False))
    return out


def render_qwen3(msgs: list[dict]) -> list[tuple[str, bool]]:
    """Reasoning is kept for replies after the last user turn (with an empty block on the final one), dropped before."""
    last_query = max(j for j, m in enumerate(msgs) if m["role"] == "user")
    out = [(f"<|im_start|>system\n{msgs[0]['content']}<|im_end|>\n", False)] if msgs[0]["role"] == "system" else []
    for j, m in enumerate(msgs):
        if m["role"] == "assistant":
            content, reasoning = m["content"], m.get("reasoning_content", "")
            if "</think>" in content and "reasoning_content" not in m:
                reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                content = content.split("</think>")[-1].lstrip("\n")
            if j > last_query and (j == len(msgs) - 1 or reasoning):
                content = f"<think>\n{reasoning}\n</think>\n\n{content}"
            if m.get("tool_calls"):
                content += "<tool_call>\n" + _call_json(m, "arguments") + "\n</tool_call>"
            out += _reply("<|im_start|>assistant\n", content + "<|im_end|>\n")
        elif m["role"] == "tool":
            out.append((f"<|im_start|>user\n<tool_response>\n{m['content']}\n</tool_response><|im_end|>\n", False))
        elif m["role"] == "user":
            out.append((f"<|im_start|>user\n{m['content']}<|im_end|>\n", False))
    return out


def render_mistral_v3(msgs: list[dict]) -> list[tuple[str, bool]]:
    """The system prompt goes into the user turn that ends the conversation: in training data, none."""
    system = msgs[0]["content"] if msgs[0]["role"] == "system" else None
    turns = msgs[1:] if system is not None else msgs
    out = [("<s>", False)]
    for j, m in enumerate(turns):
        if m["role"] == "user":
            text = f"{system}\n\n{m['content']}" if system is not None and j == len(turns) - 1 else m["content"]
            out.append((f"[INST] {text}[/INST]", False))
        elif m.get("tool_calls"):
            call = m["tool_calls"][0]
            out.append(("[TOOL_CALLS] [" + json.dumps(call["function"])[:-1] + f', "id": "{call["id"]}"}}]</s>', True))
        elif m["role"] == "assistant":
            out.append((" " + m["content"].strip() + "</s>", True))
        else:
            out.append((f'[TOOL_RESULTS] {{"content": {m["content"]}, "call_id": "{m["tool_call_id"]}"}}[/TOOL_RESULTS]', False))
    return out


def render_gemma(msgs: list[dict]) -> list[tuple[str, bool]]:
    """Gemma 2 and 3 alike (Gemma 3 puts a system prompt in front of the first user turn; Gemma 2 refuses one)."""
    prefix = msgs[0]["content"] + "\n\n" if msgs[0]["role"] == "system" else ""
    out = [("<bos>", False)]
    for m in msgs[1:] if prefix else msgs:
        if m["role"] == "assistant":
            out += _reply("<start_of_turn>model\n", m["content"].strip() + "<end_of_turn>\n")
        else:
            out.append((f"<start_of_turn>user\n{prefix}{m['content'].strip()}<end_of_turn>\n", False))
            prefix = ""
    return out


def render_phi3(msgs: list[dict]) -> list[tuple[str, bool]]:
    """eos after the last message: part of the final reply's text (each record here ends with a reply)."""
    out: list[tuple[str, bool]] = []
    for m in msgs:
        if m["role"] == "assistant":
            out += _reply("<|assistant|>\n", m["content"] + "<|end|>\n")
        else:
            out.append((f"<|{m['role']}|>\n{m['content']}<|end|>\n", False))
    text, is_reply = out[-1]
    return out[:-1] + [(text + "<|endoftext|>", is_reply)]


def render_deepseek(msgs: list[dict]) -> list[tuple[str, bool]]:
    """The system prompt first; a reply keeps only what follows its reasoning, and its generation
    prompt's "<think>\\n" is not in it (generation starts from "<｜Assistant｜><think>\\n")."""
    system = "".join(m["content"] for m in msgs if m["role"] == "system")
    out = [("<｜begin▁of▁sentence｜>" + system, False)]
    for m in msgs:
        if m["role"] == "user":
            out.append(("<｜User｜>" + m["content"], False))
        elif m["role"] == "assistant":
            out += _reply("<｜Assistant｜>", m["content"].split("</think>")[-1] + "<｜end▁of▁sentence｜>")
    return out


RENDER = {
    "llama-3.1": render_llama31,
    "qwen2.5": render_qwen25,
    "qwen3": render_qwen3,
    "mistral-v3": render_mistral_v3,
    "gemma-2": render_gemma,
    "gemma-3": render_gemma,
    "phi-3": render_phi3,
    "deepseek-r1-distill": render_deepseek,
}


def expected(tok, name: str, msgs: list[dict], train_on: str) -> tuple[list[int], list[int]]:
    """(input_ids, labels) from the independent rendering, each segment tokenized on its own."""
    segments = RENDER[name](msgs)
    replies = [j for j, (_, is_reply) in enumerate(segments) if is_reply]
    trained = set(replies[-1:] if train_on == "last" else replies)
    ids = tok.convert_tokens_to_ids(TOKENIZERS[name].get("head", []))
    labels = [M] * len(ids)
    for j, (text, _) in enumerate(segments):
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids, labels = ids + piece, labels + (piece if j in trained else [M] * len(piece))
    # The segments' tokens are the whole text's: no token crosses a segment edge.
    assert (
        ids[len(TOKENIZERS[name].get("head", [])) :]
        == tok("".join(t for t, _ in segments), add_special_tokens=False)["input_ids"]
    )
    return ids, [M] + labels[1:]


CASES = [(name, rec) for name in TOKENIZERS for rec in RECORDS if (name, rec) not in REFUSED]


@pytest.mark.parametrize("train_on", ["assistant", "last"])
@pytest.mark.parametrize(("name", "record"), CASES)
def test_masks_equal_the_independent_rendering(tokenizers, name, record, train_on):
    tok, msgs = tokenizers[name], RECORDS[record]
    enc = encode_chat({"messages": copy.deepcopy(msgs)}, "messages", tok, train_on, "record")
    ids, labels = expected(tok, name, msgs, train_on)
    assert enc.input_ids == ids
    assert enc.labels == labels, _show_diff(tok, enc.labels, labels)
    # The mask checker finds nothing: every reply's trained tokens hold its end-of-turn token.
    assert example_findings(enc, True, train_on, tok.bos_token_id, set(end_of_turn_ids(tok))) == []


def _show_diff(tok, got: list[int], want: list[int]) -> str:
    def trained(labels):
        return tok.convert_ids_to_tokens([t for t in labels if t != M])

    return f"trained {trained(got)}, expected {trained(want)}"


@pytest.mark.parametrize(("name", "record"), list(REFUSED))
def test_what_a_template_cannot_render_is_refused_by_name(tokenizers, name, record):
    with pytest.raises(DataError, match=REFUSED[name, record]) as err:
        encode_chat({"messages": copy.deepcopy(RECORDS[record])}, "messages", tokenizers[name], "assistant", "train.jsonl line 3")
    assert "train.jsonl line 3" in err.value.message


def trained_texts(tok, labels: list[int]) -> list[str]:
    """Each run of trained tokens, decoded."""
    runs: list[list[int]] = []
    for k, label in enumerate(labels):
        if label != M:
            if not runs or labels[k - 1] == M:
                runs.append([])
            runs[-1].append(label)
    return [tok.decode(run) for run in runs]


def test_the_issue_s_four_templates_train_exactly_their_replies(tokenizers):
    """Qwen3, Mistral v3 with a system prompt, Phi-3 and DeepSeek-R1-distill were refused as `boundary`."""

    def texts(name, msgs, train_on="assistant"):
        enc = encode_chat({"messages": msgs}, "messages", tokenizers[name], train_on, "record")
        assert enc.boundary is None
        return trained_texts(tokenizers[name], enc.labels)

    # Qwen3 drops the first reply's reasoning in the whole conversation; the last keeps its own.
    assert texts("qwen3", RECORDS["reasoning"]) == [
        "Paris.<|im_end|>\n",
        "<think>\nSame question.\n</think>\n\nRome.<|im_end|>\n",
    ]
    # Mistral v3: no user text (the system prompt is not in the whole at all).
    assert texts("mistral-v3", RECORDS["system"]) == [" Paris.</s>", " Rome.</s>"]
    # Phi-3: eos is trained once, after the last reply, where the template writes it.
    assert texts("phi-3", RECORDS["system"]) == ["Paris.<|end|>\n", "Rome.<|end|>\n<|endoftext|>"]
    # DeepSeek-R1-distill, train_on=last as well: the reply after "<｜Assistant｜>", reasoning dropped.
    assert texts("deepseek-r1-distill", RECORDS["reasoning"], "last") == ["\n\nRome.<｜end▁of▁sentence｜>"]
    # A reply that starts like the missing "<think>\n" is cut at the token boundary, not inside "<b".
    bold = {"role": "assistant", "content": "<b>Rome</b>"}
    assert texts("deepseek-r1-distill", [Q2, bold]) == ["<b>Rome</b><｜end▁of▁sentence｜>"]


@pytest.mark.parametrize("name", ["llama-3.1", "qwen2.5", "gemma-3"])
def test_placing_replies_agrees_with_the_prefix_method_where_both_apply(tokenizers, name):
    for msgs in (RECORDS["system"], RECORDS["tool_call"] if name != "gemma-3" else RECORDS["no_system"]):
        conv = Conversation(tokenizers[name], msgs, "record")
        for i in (j for j, m in enumerate(msgs) if m["role"] == "assistant"):
            start, end = conv.start(i), conv.end(i)
            prompt = tokenizers[name].apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True)
            upto = tokenizers[name].apply_chat_template(msgs[: i + 1], tokenize=False)
            assert conv._start_after(i, i - 1, prompt) == start  # the located method, forced
            assert conv._end_after(i, upto) == end


def test_a_reply_merging_with_its_generation_prompt_is_a_boundary_where_placed_too(tokenizers):
    """The generation prompt ends in a space that byte-level BPE writes with the reply's first word
    ("Ġy"): a prompt the model never saw. The message count up front makes the prefix method fail,
    so the start is placed by the located method, which finds the merge as the prefix method does."""
    tok = copy.deepcopy(tokenizers["qwen2.5"])
    tok.chat_template = (
        "{{ messages|length }}{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '<|im_end|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    enc = encode_chat({"messages": [Q1, {"role": "assistant", "content": "yes"}]}, "messages", tok, "assistant", "record")
    assert enc.boundary == (
        "reply 1 starts with 'yes', which merges with the template's '>assistant: ' into token(s) ['Ġy', 'es']: "
        "the prompt the model sees at generation ends differently than in training"
    )
    assert trained_texts(tok, enc.labels) == [" yes<|im_end|>"]  # with mask_check=warn: the merged token too


def test_a_reply_that_cannot_be_placed_is_refused_never_trained_and_train_on_last_named(tmp_path, tokenizers):
    """A template whose generation prompt after a short conversation holds text the whole never has."""
    tok = copy.deepcopy(tokenizers["qwen2.5"])
    tok.chat_template = tok.chat_template.replace(
        "{%- if add_generation_prompt %}",
        "{%- if messages|length < 3 %}{{- 'Think first.' }}{%- endif %}{%- if add_generation_prompt %}",
    )
    rows = [{"messages": RECORDS["no_system"]}]

    def build(**data):
        path = write_jsonl(tmp_path / "train.jsonl", rows)
        cfg = build_recipe(
            {
                "model": {"path": "tiny"},
                "data": {"path": str(path), "format": "messages", **data},
                "output_dir": str(tmp_path / "run"),
            }
        )
        return build_datasets(cfg, tok, use_cache=False)

    with pytest.raises(DataError, match=r"boundary: 1 example, .*reply 1 cannot be placed") as err:
        build()
    assert "data.train_on=last trains only the final reply, which is placed exactly" in err.value.message
    assert "data.train_on=last" in err.value.hint
    warned = build(mask_check="warn")
    assert trained_texts(tok, warned.train[0]["labels"]) == ["Rome.<|im_end|>\n"]  # reply 1 untrained, never guessed
    assert [w.split(",")[0] for w in warned.train_stats.warnings] == ["mask check (kept): boundary: 1 example"]
    last = build(train_on="last")
    assert last.train[0] == warned.train[0] and last.train_stats.warnings == []
