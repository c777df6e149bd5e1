"""generate (greedy = a hand-written argmax loop; seeded sampling) and eval (numbers known by construction)."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch

from conftest import BOS_ID, EOS_ID, SPECIALS, build_char_tokenizer, build_tiny_llama, char_token_id, write_jsonl
from finetune.cli import main
from finetune.config import build_recipe
from finetune.data import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT, build_datasets
from finetune.data.templates import end_of_turn_ids
from finetune.evaluate import generate, prompt_ids
from finetune.runs import eval_records, evaluate_run, load_trained, open_run

PROMPT = "Add the numbers."


def test_prompt_ids_are_the_training_prompts(tokenizer):
    chars = lambda text: [char_token_id(c) for c in text]  # noqa: E731
    assert prompt_ids("hi", "completion", tokenizer) == [BOS_ID] + chars("hi")
    assert prompt_ids("hi", "text", tokenizer) == [BOS_ID] + chars("hi")
    assert prompt_ids("hi", "alpaca", tokenizer) == [BOS_ID] + chars(ALPACA_PROMPT_NO_INPUT.format(instruction="hi"))
    with_input = ALPACA_PROMPT.format(instruction="hi", input="1 2")
    assert prompt_ids("hi", "alpaca", tokenizer, context="1 2") == [BOS_ID] + chars(with_input)
    im_start, im_end = SPECIALS.index("<|im_start|>"), SPECIALS.index("<|im_end|>")
    expected = [BOS_ID, im_start] + chars("user\nhi") + [im_end] + chars("\n") + [im_start] + chars("assistant\n")
    assert prompt_ids("hi", "messages", tokenizer) == expected


def test_greedy_generate_equals_a_hand_written_argmax_loop(lora_run, capsys):
    model, tok = load_trained(open_run(lora_run.path))
    ids = prompt_ids(PROMPT, "alpaca", tok)
    stops = end_of_turn_ids(tok)
    by_hand = []
    with torch.no_grad():
        for _ in range(12):  # no KV cache, no generate(): the whole sequence again for every token
            nxt = int(model(input_ids=torch.tensor([ids + by_hand])).logits[0, -1].argmax())
            if nxt in stops:
                break
            by_hand.append(nxt)
    assert len(by_hand) >= 3  # long enough to compare something
    assert generate(model, tok, [ids], 12) == [by_hand]
    outputs = []
    for _ in range(2):
        assert main(["generate", str(lora_run.path), "--prompt", PROMPT, "--max-new-tokens", "12"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] == tok.decode(by_hand, skip_special_tokens=True) + "\n"


def test_sampling_is_reproducible_per_seed(lora_run, capsys):
    def sample(seed):
        args = ["generate", str(lora_run.path), "--prompt", PROMPT, "--max-new-tokens", "16", "--temperature", "2.0"]
        assert main([*args, "--top-p", "0.95", "--seed", str(seed)]) == 0
        return capsys.readouterr().out

    first = sample(1)
    assert sample(1) == first
    assert sample(2) != first
    assert main(["generate", str(lora_run.path), "--prompt", PROMPT]) == 0
    greedy = capsys.readouterr().out
    assert greedy != first


def test_generate_reads_prompts_from_stdin_and_checks_options(lora_run, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("ab\n\ncd\n"))
    assert main(["generate", str(lora_run.path), "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 2  # two prompts (the blank line is skipped), one line each
    assert main(["generate", str(lora_run.path), "--prompt", "x", "--top-p", "0", "--temperature", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--temperature -1.0: must be 0 (greedy) or more" in err and "--top-p 0.0: must be in (0, 1]" in err


# --------------------------------------------------------------------------- eval, with answers known by construction

L = 5.0  # the logit the machine gives its one successor token; every other logit is 0
SUCCESSOR = {"=": "4", "4": "2", "2": "</s>", "?": "n", "n": "o", "o": "</s>", "y": "e", "e": "s", "s": "</s>"}
RECORDS = [
    {"prompt": "2*21=", "completion": "42"},     # base: exact        tuned: exact
    {"prompt": "6*7=", "completion": "4"},       # base: contains     tuned: contains
    {"prompt": "is 1 > 2?", "completion": "no"},  # base: exact        tuned: "yes", wrong
    {"prompt": "is 2 > 1?", "completion": "yes"},  # base: "no", wrong  tuned: exact
    {"prompt": "is 3 > 1?", "completion": "yes"},  # base: "no", wrong  tuned: exact
]


def tid(tok: str) -> int:
    return EOS_ID if tok == "</s>" else char_token_id(tok)


def expected_logits(token: str, tuned: bool, vocab: int) -> list[float]:
    v = [0.0] * vocab
    if token in SUCCESSOR:
        v[tid(SUCCESSOR[token])] = L
    if tuned and token == "?":  # what the adapter adds: prefer "y" over "n" after "?"
        v[tid("y")] += 2 * L
        v[tid("n")] -= 2 * L
    return v


def expected_loss(tuned: bool, vocab: int) -> float:
    """Mean cross-entropy over completion tokens + EOS, from the logits the construction dictates."""
    total, n = 0.0, 0
    for r in RECORDS:
        context = [r["prompt"][-1]] + list(r["completion"])
        targets = list(r["completion"]) + ["</s>"]
        for token, target in zip(context, targets):
            v = expected_logits(token, tuned, vocab)
            total += math.log(sum(math.exp(x) for x in v)) - v[tid(target)]
            n += 1
    return total / n


def build_successor_machine(out_dir):
    """A Llama whose next token depends only on the current one, by SUCCESSOR, with logit exactly L.

    Attention and MLP outputs are zeroed (o_proj, down_proj = 0), so the last hidden
    state is RMSNorm(embedding). The tokens that matter get orthogonal embeddings of
    RMS 1, so lm_head row s = (L/64) * sum of the hidden states of the tokens whose
    successor is s gives exactly L to the successor and 0 to everything else.
    """
    from transformers import LlamaForCausalLM

    tok = build_char_tokenizer(out_dir)
    build_tiny_llama(out_dir, vocab_size=len(tok), layers=1)
    model = LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    hidden = model.config.hidden_size
    q, _ = torch.linalg.qr(torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(0)))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        directions = {}
        for i, token in enumerate(SUCCESSOR):
            directions[token] = q[i]
            model.model.embed_tokens.weight[tid(token)] = q[i] * math.sqrt(hidden)  # RMS 1: the norm leaves it be
        for token, nxt in SUCCESSOR.items():
            model.lm_head.weight[tid(nxt)] += (L / hidden) * directions[token] * math.sqrt(hidden)
    model.save_pretrained(out_dir)
    return tok, directions


def make_successor_run(tmp_path):
    """A finished run by hand: the machine as base, an lm_head LoRA (r=1) that answers "yes" after "?"."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    base_dir = tmp_path / "machine"
    tok, directions = build_successor_machine(base_dir)
    data = write_jsonl(tmp_path / "toy.jsonl", RECORDS)
    run = tmp_path / "run"
    recipe = build_recipe({
        "model": {"path": str(base_dir)},
        "data": {"path": str(data), "format": "completion", "max_seq_len": 64},
        "output_dir": str(run), "precision": "fp32", "quant": {"bits": None},
        "lora": {"r": 1, "alpha": 1, "dropout": 0.0, "target": ["lm_head"]},
        "eval": {"exact_match_path": str(data), "max_new_tokens": 8},
    })
    model = get_peft_model(
        LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
        LoraConfig(r=1, lora_alpha=1, lora_dropout=0.0, target_modules=["lm_head"]),
    )
    head = model.base_model.model.lm_head
    hidden = head.in_features
    with torch.no_grad():
        head.lora_A["default"].weight.copy_(directions["?"][None, :] / math.sqrt(hidden))  # A @ h("?") = 1, 0 for the rest
        b = torch.zeros(head.out_features, 1)
        b[tid("y")], b[tid("n")] = 2 * L, -2 * L
        head.lora_B["default"].weight.copy_(b)
    model.save_pretrained(run / "adapter", save_embedding_layers=False)  # the LoRA only, not a copy of lm_head
    tok.save_pretrained(run / "adapter")
    (run / "recipe.yaml").write_text(recipe.to_yaml())
    return run, len(tok)


def rows(text: str) -> str:
    """The printed table with runs of spaces folded, so assertions do not depend on column widths."""
    return "\n".join(" ".join(line.split()) for line in text.splitlines())


def test_eval_scores_base_and_fine_tuned_exactly_as_constructed(tmp_path, capsys):
    run_dir, vocab = make_successor_run(tmp_path)
    run = open_run(run_dir)
    records, source = eval_records(run)
    assert records == RECORDS and source.endswith("toy.jsonl")  # eval.exact_match_path comes first
    result = evaluate_run(run, records, source)
    base, tuned = result.columns["base"], result.columns["fine-tuned"]
    assert (base.match.correct, base.match.contained, base.match.total) == (2, 3, 5)
    assert (tuned.match.correct, tuned.match.contained, tuned.match.total) == (3, 4, 5)
    assert base.tokens == tuned.tokens == sum(len(r["completion"]) + 1 for r in RECORDS) == 16
    assert base.loss == pytest.approx(expected_loss(False, vocab), abs=1e-4)
    assert tuned.loss == pytest.approx(expected_loss(True, vocab), abs=1e-4)
    assert tuned.perplexity == pytest.approx(math.exp(tuned.loss))

    out_json = tmp_path / "eval.json"
    assert main(["eval", str(run_dir), "--json", str(out_json)]) == 0
    table = rows(capsys.readouterr().out)
    assert "exact match 40.0% 60.0%" in table and "contains match 60.0% 80.0%" in table
    numbers = json.loads(out_json.read_text())
    assert numbers["records"] == 5 and numbers["fine-tuned"]["exact_match"] == pytest.approx(0.6)
    assert numbers["base"]["loss"] == pytest.approx(expected_loss(False, vocab), abs=1e-4)


def test_eval_data_option_and_limit(tmp_path, capsys):
    run_dir, _ = make_successor_run(tmp_path)
    only_yes = write_jsonl(tmp_path / "yes.jsonl", RECORDS[3:])
    assert main(["eval", str(run_dir), "--data", str(only_yes), "--limit", "1"]) == 0
    out = rows(capsys.readouterr().out)
    assert "1 records from" in out and "exact match 0.0% 100.0%" in out


def test_eval_split_is_the_one_training_held_out(recipe_dict, tokenizer, tmp_path):
    cfg = build_recipe({**recipe_dict, "data": {**recipe_dict["data"], "eval_fraction": 0.1}})
    run = tmp_path / "held"
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / "adapter_config.json").write_text("{}")
    (run / "adapter" / "adapter_model.safetensors").write_bytes(b"")
    (run / "recipe.yaml").write_text(cfg.to_yaml())
    from finetune.data import build_examples

    records, source = eval_records(open_run(run))
    assert len(records) == 6 and "held-out" in source
    assert build_examples(records, cfg, tokenizer, "x")[0] == build_datasets(cfg, tokenizer).eval
