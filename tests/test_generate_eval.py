"""generate (greedy = a hand-written argmax loop; seeded sampling) and eval (numbers known by construction)."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch
from conftest import (
    BOS_ID,
    EOS_ID,
    SPECIALS,
    add_custom_code,
    build_char_tokenizer,
    build_tiny_llama,
    char_token_id,
    copy_run_with_base,
    write_jsonl,
)

from finetune.cli.commands import main
from finetune.config.schema import build_recipe
from finetune.data import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT, build_datasets
from finetune.data.templates import end_of_turn_ids
from finetune.gpus import GiB
from finetune.metrics import human_bytes
from finetune.plan import loaded_weight_bytes
from finetune.runs.evaluate import generate, prompt_ids
from finetune.runs.open import eval_records, evaluate_run, exceeds_free_memory, load_trained, open_run

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
    {"prompt": "2*21=", "completion": "42"},  # base: exact        tuned: exact
    {"prompt": "6*7=", "completion": "4"},  # base: contains     tuned: contains
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
    recipe = build_recipe(
        {
            "model": {"path": str(base_dir)},
            "data": {"path": str(data), "format": "completion", "max_seq_len": 64},
            "output_dir": str(run),
            "precision": "fp32",
            "quant": {"bits": None},
            "lora": {"r": 1, "alpha": 1, "dropout": 0.0, "target": ["lm_head"]},
            "eval": {"exact_match_path": str(data), "max_new_tokens": 8},
        }
    )
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


# --------------------------------------------------------------------------- what a run's files may and may not make us do


def command_on(command: str, run, runs_data, out) -> list[str]:
    """A short `finetune generate|eval|export --merge` of `run` (each loads its model)."""
    return {
        "generate": ["generate", str(run), "--prompt", PROMPT, "--max-new-tokens", "2"],
        "eval": ["eval", str(run), "--data", str(runs_data), "--limit", "1", "--max-new-tokens", "2"],
        "export": ["export", str(run), "--out", str(out), "--merge", "--dtype", "fp32"],
    }[command]


@pytest.mark.parametrize("command", ["generate", "eval", "export"])
def test_a_runs_recipe_cannot_switch_on_trust_remote_code(command, lora_run, tiny_model_dir, runs_data, tmp_path, capsys):
    run = copy_run_with_base(lora_run.path, tmp_path, tiny_model_dir, trust_remote_code=True)
    marker = tmp_path / "custom_code_ran"
    add_custom_code(tmp_path / "model", marker)
    args = command_on(command, run, runs_data, tmp_path / "merged")

    assert main(args) == 2  # the custom architecture cannot load without its code
    printed = capsys.readouterr()
    assert (
        f"note: {run / 'recipe.yaml'} sets model.trust_remote_code=true; not obeyed: code from the model folder runs only "
        f"when you pass --trust-remote-code (do so only if you trust '{tmp_path / 'model'}')"
    ) in (printed.out + printed.err).splitlines()
    assert "hint: the model may need the code in its folder" in printed.err and "pass --trust-remote-code" in printed.err
    assert "Traceback" not in printed.err
    assert not marker.exists()

    assert main([*args, "--trust-remote-code"]) == 0  # the user's own opt-in
    assert marker.exists()
    assert "not obeyed" not in capsys.readouterr().err


def test_exceeds_free_memory_judges_only_a_cuda_device():
    need = int(37.6 * GiB)  # the 4-bit Llama-3-70B of qlora-stream-70b-1x24gb (test_plan.py) ...
    assert exceeds_free_memory(need, 22 * GiB, "cuda")  # ... on a 24 GB card with 22 GiB free
    assert not exceeds_free_memory(need, 40 * GiB, "cuda")
    assert not exceeds_free_memory(need, need, "cuda")
    assert not exceeds_free_memory(need, None, "cuda")  # the device did not say
    assert not exceeds_free_memory(need, 1, "cpu")  # the CPU is the fallback: RAM is paged, not judged here


def test_generate_eval_export_stop_before_loading_more_than_the_gpu_has_free(qlora_run, runs_data, tmp_path, monkeypatch, capsys):
    # The device is pretended: the check stops every command before anything touches CUDA.
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr("finetune.runs.open.default_device", lambda: cuda)
    monkeypatch.setattr("finetune.export.run.default_device", lambda: cuda)
    asked = []
    monkeypatch.setattr("finetune.runs.open.device_free_bytes", lambda device: asked.append(device) or 100 * 1024)
    cfg = open_run(qlora_run.path).cfg
    four_bit = human_bytes(loaded_weight_bytes(cfg, "fp32"))
    unquantized = cfg.model_copy(update={"quant": cfg.quant.model_copy(update={"bits": None}), "lora": None})
    merged = human_bytes(loaded_weight_bytes(unquantized, "fp32"))
    expected = {
        "generate": f"the model of '{qlora_run.path}' needs {four_bit} on cuda:0 for its weights alone (fp32, 4-bit)",
        "eval": f"the model of '{qlora_run.path}' needs {four_bit} on cuda:0 for its weights alone (fp32, 4-bit)",
        "export": f"the merge check's merged model needs {merged} on cuda:0 for its weights alone (fp32, unquantized)",
    }
    for command, message in expected.items():
        asked.clear()
        assert main(command_on(command, qlora_run.path, runs_data, tmp_path / "merged")) == 2
        err = capsys.readouterr().err
        assert f"error: {message}, and 100.0 KiB is free there; nothing was loaded" in err, err
        assert "hint: pass --device cpu" in err
        assert asked == [cuda]
    assert not (tmp_path / "merged").exists()
    # The way out the hint names: the same run on the CPU.
    assert main([*command_on("generate", qlora_run.path, runs_data, None), "--device", "cpu"]) == 0
    assert asked == [cuda]  # a CPU is not judged


# --------------------------------------------------------------------------- damaged files: what is wrong and where


def test_generate_names_a_corrupt_config_json_not_the_tokenizer(tiny_model_dir, tmp_path, capsys):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "config.json").write_text('{"model_type": "lla')  # cut short, as by a failed copy
    assert main(["generate", str(model), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert f"error: model.path: '{model / 'config.json'}' is not valid JSON (" in err and "line 1, column" in err
    assert "hint: the model folder is damaged: restore its config.json" in err
    assert "tokenizer" not in err and "Traceback" not in err


def test_an_adapter_config_without_its_rank_is_named(lora_run, runs_data, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(lora_run.path, run)
    config_file = run / "adapter" / "adapter_config.json"
    config = json.loads(config_file.read_text())
    del config["r"]  # peft would take its default rank 8 and fail on the rank-4 weights
    config_file.write_text(json.dumps(config))
    for command in ("generate", "eval", "export"):
        assert main(command_on(command, run, runs_data, tmp_path / "merged")) == 2
        err = capsys.readouterr().err
        assert f"error: '{config_file}' lacks 'r' (the LoRA rank): the adapter cannot be loaded as trained" in err
        assert 'add "r": 4 (from the run\'s recipe.yaml)' in err and "Traceback" not in err


def test_qlora_on_cpu_prints_no_bitsandbytes_hub_kernel_notice(qlora_run):
    # On a CPU with AVX512-BF16, importing bitsandbytes logged "Failed to load CPU gemm_4bit_forward from
    # kernels-community ... pip install kernels" on every run, for a kernel our 4-bit layers never use.
    import subprocess
    import sys

    from bitsandbytes.functional import has_avx512bf16

    if not has_avx512bf16():
        pytest.skip("bitsandbytes looks for the hub kernel only on CPUs with AVX512-BF16")
    args = ["generate", str(qlora_run.path), "--prompt", PROMPT, "--max-new-tokens", "2"]
    proc = subprocess.run([sys.executable, "-m", "finetune", *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [f"{qlora_run.path / 'adapter'}: prompts formatted as data.format=alpaca, greedy"]
