"""GGUF export: the file read back by transformers' GGUF loader equals the run as trained; Modelfiles; refusals."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import copy_run_with_base, train_tiny_run

from finetune.cli.commands import main
from finetune.config.files import resolve_path
from finetune.data.templates import BUILTIN_TEMPLATES
from finetune.errors import ExportError, MergeCheckFailed
from finetune.export import gguf_export, gguf_file
from finetune.export.gguf_export import export_gguf
from finetune.export.modelfile import modelfile

pytest.importorskip("gguf", reason="the GGUF export needs the gguf package: pip install -e '.[test]' (or '.[gguf]')")

TINY = Path(resolve_path("asset:tiny-llama"))  # byte-level BPE tokenizer, ChatML template, tied embeddings


def quiet(_text: str) -> None:
    pass


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory, runs_data):
    """QLoRA on the bundled tiny Llama: its merge adds the adapter to dequantize(quantize(W))."""
    return train_tiny_run(tmp_path_factory.mktemp("gguf_run") / "run", TINY, runs_data, quant={"bits": 4})


def read_back(out, name, ids):
    """The logits of the GGUF loaded the plain way a user would (transformers), nothing of ours."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out), gguf_file=name, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("gguf_type", ["f16", "q8_0"])
def test_gguf_read_back_by_transformers_gives_the_trained_logits_and_tokens(bpe_run, tmp_path, gguf_type):
    import gguf
    from transformers import AutoTokenizer

    from finetune.runs.open import open_run, run_tokenizer

    out = tmp_path / "gguf"
    result = export_gguf(bpe_run.path, out, gguf_type=gguf_type, say=quiet)
    name = f"model-{gguf_type}.gguf"
    assert sorted(p.name for p in out.iterdir()) == ["Modelfile", "finetune_export.json", name, "recipe.yaml"]
    got = read_back(out, name, bpe_run.ids)
    scale = float(bpe_run.logits.abs().max())
    diff = float((got - bpe_run.logits).abs().max())
    # f16: one rounding of each weight (measured 3e-4 relative); q8_0: 8-bit blocks (measured ~1e-2).
    assert diff / scale < {"f16": 1e-3, "q8_0": 3e-2}[gguf_type]
    check = result.metadata["verification"]
    assert check["passed"] and check["same_token_ids"] and check["same_chat_template"]
    assert check["max_abs_diff"] <= check["tolerance"]
    assert json.loads((out / "finetune_export.json").read_text()) == result.metadata
    # The adapter moves the logits far more than the tolerance: a file without it would fail the check.
    assert check["adapter_effect"] > 3 * check["tolerance"]
    # The tokenizer and chat template read back equal the run's.
    run_tok = run_tokenizer(open_run(bpe_run.path))
    back = AutoTokenizer.from_pretrained(str(out), gguf_file=name)
    for text in ("Add the numbers.\n\n1 + 2", "<|im_start|>user\nhé, ça va?<|im_end|>"):
        assert back(text).input_ids == run_tok(text).input_ids
    assert back.chat_template == run_tok.chat_template
    reader = gguf.GGUFReader(str(out / name))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == gguf_type.upper() and types["blk.0.attn_norm.weight"] == "F32"
    assert "output.weight" not in types  # tied embeddings: llama.cpp writes token_embd only
    field = reader.fields["tokenizer.ggml.model"]
    assert bytes(field.parts[field.data[0]]).decode() == "gpt2"
    assert result.metadata["gguf"]["tokenizer"]["special_ids"] == {"bos": 1, "eos": 2, "unk": 0, "pad": 3}
    assert result.metadata["k_quants"] == f"llama-quantize {out / name} {out / 'model-Q4_K_M.gguf'} Q4_K_M"


def test_cli_prints_the_ollama_and_llama_quantize_commands(bpe_run, tmp_path, capsys):
    out = tmp_path / "gguf"
    assert main(["export", str(bpe_run.path), "--gguf", "--gguf-type", "q8_0", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"ollama create NAME -f {out / 'Modelfile'}" in printed and "gguf check passed" in printed
    assert f"llama-quantize {out / 'model-q8_0.gguf'} {out / 'model-Q4_K_M.gguf'} Q4_K_M" in printed
    assert (out / "Modelfile").read_text().startswith("# Ollama: ollama create NAME -f Modelfile")
    assert main(["export", str(bpe_run.path), "--gguf", "--merge", "--out", str(tmp_path / "x")]) == 2
    assert "a GGUF export always merges" in capsys.readouterr().err and not (tmp_path / "x").exists()


@pytest.mark.parametrize("damage", ["flip_bytes", "unpermuted", "swapped_tokens"])
def test_a_damaged_gguf_fails_the_check_exits_2_and_leaves_nothing(bpe_run, tmp_path, monkeypatch, capsys, damage):
    if damage == "unpermuted":  # q/k rows in HF's rotary layout: the file llama.cpp would read wrongly
        monkeypatch.setattr(gguf_file, "permute_rotary", lambda w, n_head: w)
    elif damage == "swapped_tokens":  # the weights intact, two vocabulary entries swapped: only the ids tell
        add = gguf_export.add_vocab

        def add_swapped(writer, tok_dir, vocab_size):
            write_list = writer.add_token_list

            def swapped(tokens):
                tokens = list(tokens)
                i, j = tokens.index("e"), tokens.index("t")
                tokens[i], tokens[j] = tokens[j], tokens[i]
                write_list(tokens)

            writer.add_token_list = swapped
            return add(writer, tok_dir, vocab_size)

        monkeypatch.setattr(gguf_export, "add_vocab", add_swapped)
    else:
        write = gguf_export.write_gguf

        def write_then_flip(merged_dir, path, *args, **kwargs):
            stats = write(merged_dir, path, *args, **kwargs)
            import gguf

            tensor = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.1.ffn_down.weight")
            with path.open("r+b") as f:  # overwrite the first half of one weight with a byte pattern
                f.seek(tensor.data_offset)
                f.write(bytes(np.full(tensor.n_bytes // 2, 0x5A, dtype=np.uint8)))
            return stats

        monkeypatch.setattr(gguf_export, "write_gguf", write_then_flip)
    out = tmp_path / "gguf"
    if damage != "flip_bytes":
        with pytest.raises(MergeCheckFailed, match="nothing was written") as err:
            export_gguf(bpe_run.path, out, gguf_type="f16", say=quiet)
        assert ("token ids equal: False" in str(err.value)) == (damage == "swapped_tokens")
    else:
        assert main(["export", str(bpe_run.path), "--gguf", "--out", str(out)]) == 2
        assert "gguf check FAILED" in capsys.readouterr().out
    assert not out.exists() and not list(tmp_path.glob(".tmp-*"))


def test_the_gguf_write_holds_one_tensor_at_a_time_and_stages_nothing(bpe_run, tmp_path, monkeypatch):
    """Counting hooks, not RSS: each tensor read from the base checkpoint, each merged tensor and each array handed
    to gguf's writer (add_tensor, which holds it until write_tensors_to_file, or write_tensor_data) is counted
    until it is freed."""
    import weakref

    import gguf

    from finetune.export import merge

    alive, most, seen = ({"read": 0, "merged": 0, "writer": 0} for _ in range(3))
    staged: list[Path] = []

    def gone(kind: str) -> None:
        alive[kind] -= 1

    def track(kind: str, obj):
        alive[kind] += 1
        seen[kind] += 1
        most[kind] = max(most[kind], alive[kind])
        weakref.finalize(obj, gone, kind)
        staged.extend(tmp_path.rglob("*.safetensors"))  # a merged model written out beside the GGUF
        return obj

    read, merged, add, write = (
        merge.read_tensor,
        merge.MergedTensors.tensor,
        gguf.GGUFWriter.add_tensor,
        gguf.GGUFWriter.write_tensor_data,
    )
    monkeypatch.setattr(merge, "read_tensor", lambda *args: track("read", read(*args)))
    monkeypatch.setattr(merge.MergedTensors, "tensor", lambda self, name: track("merged", merged(self, name)))
    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", lambda w, name, t, *a, **k: add(w, name, track("writer", t), *a, **k))
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", lambda w, t, *a, **k: write(w, track("writer", t), *a, **k))
    result = export_gguf(bpe_run.path, tmp_path / "gguf", gguf_type="q8_0", say=quiet)
    tensors = result.metadata["gguf"]["tensors"]
    assert result.metadata["verification"]["passed"] and seen == {"read": tensors, "merged": tensors, "writer": tensors}
    assert most == {"read": 1, "merged": 1, "writer": 1}, f"tensors alive at once: {most} of {tensors}"
    assert staged == []


def test_the_read_back_checks_memory_is_said_before_any_work_when_ram_is_short(bpe_run, tmp_path, monkeypatch):
    class Stop(Exception):
        pass

    def say(text: str) -> None:
        said.append(text)
        if text.startswith("warning"):
            raise Stop  # said before the reference model loads: nothing more to run

    said: list[str] = []
    monkeypatch.setattr(gguf_export, "available_memory_bytes", lambda: 2**20)
    with pytest.raises(Stop):
        export_gguf(bpe_run.path, tmp_path / "gguf", say=say)
    # The tiny Llama's 1,417,120 parameters (tied: the embedding once) x 4 bytes (the check's fp32 on a CPU)
    assert gguf_export.readback_bytes(TINY, json.loads((TINY / "config.json").read_text()), "fp32") == 1_417_120 * 4
    assert said == [
        "warning: the read-back check will hold ~5 MiB (transformers' GGUF loader dequantizes the whole model at once), "
        "more than the 1 MiB of RAM available now; the merge holds one tensor at a time"
    ]
    assert not (tmp_path / "gguf").exists()


def test_a_family_gguf_does_not_write_is_refused_before_anything_is_written(bpe_run, tmp_path, capsys):
    run = copy_run_with_base(bpe_run.path, tmp_path, TINY)
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    (tmp_path / "model" / "config.json").write_text(json.dumps({**config, "model_type": "olmo2"}))
    out = tmp_path / "gguf"
    assert main(["export", str(run), "--gguf", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    supported = "llama, mistral, qwen2, qwen3, gemma2, gemma3_text, phi3, qwen2_moe, qwen3_moe"
    assert f"model_type 'olmo2' is not a family --gguf writes (supported: {supported})" in err
    assert "convert_hf_to_gguf.py" in err and not out.exists() and not list(tmp_path.glob(".tmp-*"))


def test_a_tokenizer_gguf_cannot_describe_is_refused_before_anything_is_written(lora_run, tmp_path):
    out = tmp_path / "gguf"
    with pytest.raises(ExportError, match="the run's tokenizer is WordLevel, decoder Fuse; --gguf writes byte-level BPE"):
        export_gguf(lora_run.path, out, say=quiet)
    assert not out.exists()


def test_without_the_gguf_package_the_error_says_how_to_install_it(bpe_run, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ExportError) as err:
        export_gguf(bpe_run.path, tmp_path / "gguf", say=quiet)
    assert "pip install 'finetune[gguf]'" in err.value.hint and not (tmp_path / "gguf").exists()


CHATML_MODELFILE = '''# Ollama: ollama create NAME -f Modelfile (in this directory)
FROM ./model-q8_0.gguf
TEMPLATE """{{- range .Messages }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
"""
PARAMETER stop "<|im_end|>"
PARAMETER stop "</s>"
SYSTEM """You are terse."""
'''

LLAMA3_MODELFILE = '''# Ollama: ollama create NAME -f Modelfile (in this directory)
FROM ./model-f16.gguf
TEMPLATE """{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>

{{ .Content }}<|eot_id|>{{ end }}<|start_header_id|>assistant<|end_header_id|>

"""
PARAMETER stop "<|eot_id|>"
PARAMETER stop "</s>"
'''


def test_modelfile_golden_for_chatml_and_llama3_templates(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TINY))  # its own ChatML, written differently from the built-in
    assert tok.chat_template != BUILTIN_TEMPLATES["chatml"]
    assert modelfile("model-q8_0.gguf", tok, "messages", system="You are terse.") == CHATML_MODELFILE
    tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.chat_template = BUILTIN_TEMPLATES["llama3"]
    assert modelfile("model-f16.gguf", tok, "messages") == LLAMA3_MODELFILE
    tok.chat_template = BUILTIN_TEMPLATES["mistral"]  # no Ollama template here: Ollama reads the GGUF's own
    text = modelfile("model-f16.gguf", tok, "messages")
    assert "Ollama uses the GGUF's tokenizer.chat_template" in text and "TEMPLATE" not in text
    alpaca = modelfile("model-f16.gguf", tok, "alpaca")
    assert "### Instruction:\n{{ .Prompt }}\n\n### Response:\n" in alpaca


def build_tiny_family(family: str, out, **own):
    """A tiny random-init model of one family (untied unless own says so), 2 KV heads, with the bundled
    byte-level BPE tokenizer beside it."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(TINY / name, out / name)
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    cfg = AutoConfig.for_model(
        family,
        vocab_size=912,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        **{"tie_word_embeddings": False, "initializer_range": 0.1, **shape, **own},
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


# family: its own config keys. Qwen3: head_dim 128, the one transformers' GGUF reader assumes; Gemma: tied
# (llama.cpp writes no lm_head for Gemma 2) and a sliding window, written as metadata and read back.
FAMILY_KEYS = {
    "qwen2": {},
    "mistral": {},
    "qwen3": {"head_dim": 128},
    "gemma2": {"head_dim": 16, "sliding_window": 64, "tie_word_embeddings": True},
    "gemma3_text": {"head_dim": 16, "sliding_window": 64, "tie_word_embeddings": True},
    "phi3": {},
}


@pytest.mark.parametrize("family", sorted(FAMILY_KEYS))
def test_each_family_export_reads_back_equal_in_f32_f16_and_q8_0(family, tmp_path, runs_data):
    import gguf

    (tmp_path / "model").mkdir()
    model_dir = build_tiny_family(family, tmp_path / "model", **FAMILY_KEYS[family])
    run = train_tiny_run(tmp_path / "run", model_dir, runs_data)
    result = export_gguf(run.path, tmp_path / "gguf", gguf_type="f32", say=quiet)
    check = result.metadata["verification"]
    assert check["passed"] and check["max_abs_diff"] < 1e-4 and check["adapter_effect"] > 1e-2
    got = read_back(tmp_path / "gguf", "model-f32.gguf", run.ids)
    assert float((got - run.logits).abs().max()) < 1e-4
    reader = gguf.GGUFReader(str(tmp_path / "gguf" / "model-f32.gguf"))
    names = {t.name for t in reader.tensors}
    assert ("output.weight" in names) != FAMILY_KEYS[family].get("tie_word_embeddings", False)
    assert ("blk.0.attn_q.bias" in names) == (family == "qwen2")
    assert ("blk.0.attn_q_norm.weight" in names) == (family in ("qwen3", "gemma3_text"))
    assert ("blk.0.attn_qkv.weight" in names) == (family == "phi3")  # Phi-3's fused qkv_proj stays fused
    if family.startswith("gemma"):  # stored as llama.cpp's converter stores it: w + 1 (HF's w starts at 0)
        norm = next(t for t in reader.tensors if t.name == "blk.0.attn_norm.weight")
        assert abs(float(np.asarray(norm.data).mean()) - 1.0) < 0.1
        assert int(reader.fields[f"{family[:6]}.attention.sliding_window"].parts[-1][0]) == 64
    if family == "gemma2":
        assert float(reader.fields["gemma2.attn_logit_softcapping"].parts[-1][0]) == 50.0
    # The issue's types: f16 within rounding, q8_0 within its tolerance (relative to the largest logit).
    scale = float(run.logits.abs().max())
    for gguf_type, bound in (("f16", 3e-3), ("q8_0", 5e-2)):  # measured: f16 <= 1.1e-3, q8_0 <= 2.9e-2
        typed = export_gguf(run.path, tmp_path / gguf_type, gguf_type=gguf_type, say=quiet).metadata["verification"]
        assert typed["passed"] and typed["max_abs_diff"] / scale < bound, (gguf_type, typed["max_abs_diff"], scale)


@pytest.mark.parametrize(
    ("family", "keys", "message"),
    [
        (
            "qwen3",
            {"head_dim": 64},
            "head_dim is 64, but transformers' GGUF loader, which checks the file, reads every qwen3 GGUF back with 128",
        ),
        ("gemma2", {"query_pre_attn_scalar": 144}, "query_pre_attn_scalar is 144"),
        ("gemma3_text", {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0}}}, "rope type 'linear'"),
        ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' (scaled rotary"),
        ("qwen2", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "rope type 'llama3' (scaled rotary"),
        ("phi3", {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75}}, "partial_rotary_factor is 0.75"),
        # the reader takes the expert sizes from its config class, not the file (measured: a size mismatch on load)
        ("qwen3_moe", {"moe_intermediate_size": 32}, "moe_intermediate_size is 32, but transformers' GGUF loader"),
        ("qwen2_moe", {"shared_expert_intermediate_size": 128}, "shared_expert_intermediate_size is 128"),
        ("qwen3_moe", {"norm_topk_prob": False}, "norm_topk_prob is False"),
    ],
)
def test_a_model_the_gguf_reader_would_read_back_wrongly_is_refused(family, keys, message):
    config = {"model_type": family, "num_hidden_layers": 2, **keys}
    with pytest.raises(ExportError, match="export with --merge") as err:
        gguf_file.gguf_family(config, "model.path 'x'")
    assert message in str(err.value)


def test_qwen3_30b_a3b_is_a_moe_the_gguf_reader_reads_back():
    config = json.loads((Path(__file__).parent / "fixtures/configs/qwen3-30b-a3b/config.json").read_text())
    assert gguf_file.gguf_family(config, "x").arch == "QWEN3MOE"


# MoE families at the expert sizes transformers' GGUF reader assumes (Family.reader_fixed), 4 experts, LoRA on
# attention, every expert and Qwen2-MoE's shared expert. Qwen3-MoE routes each token to all 4 experts: with top-k
# routing, q8_0 rounding flips a token's expert choice (measured: 1 token of 46 routed elsewhere, logits off by 1.9).
# Weights drawn at 0.05, not the dense families' 0.1: at 0.1 this random net amplifies q8_0 rounding to 3.2-4.2% of
# its largest logit over 6 training seeds here and 5.07% on a CI machine (the rule is 5%); at 0.05, 1.5-2.3%.
MOE_KEYS = {
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 1408, "initializer_range": 0.05},
    "qwen3_moe": {
        "initializer_range": 0.05,
        "num_experts": 4,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "head_dim": 16,
    },
}
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj", "experts"]
SHARED = ["shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"]


@pytest.fixture(scope="module", params=sorted(MOE_KEYS))
def moe_run(request, tmp_path_factory, runs_data):
    family, tmp = request.param, tmp_path_factory.mktemp(request.param)
    (tmp / "model").mkdir()
    model_dir = build_tiny_family(family, tmp / "model", **MOE_KEYS[family])
    target = ATTENTION + (SHARED if family == "qwen2_moe" else [])
    return family, model_dir, train_tiny_run(tmp / "run", model_dir, runs_data, lora={"target": target})


def test_moe_experts_are_stacked_and_read_back_equal(moe_run, tmp_path, monkeypatch):
    import gguf
    from safetensors.torch import load_file

    family, model_dir, run = moe_run
    ff, arch = MOE_KEYS[family]["moe_intermediate_size"], family.replace("_", "")
    for gguf_type in ("f32", "q8_0") if family == "qwen3_moe" else ("f32",):
        result = export_gguf(run.path, tmp_path / gguf_type, gguf_type=gguf_type, say=quiet)
        check = result.metadata["verification"]
        assert check["passed"] and check["adapter_effect"] > 1e-2, check
        assert gguf_type != "f32" or check["max_abs_diff"] < 1e-4
        # attention's 8 linears (+ the shared expert's 6) and the 4 fused expert parameters, each adapted
        assert result.metadata["merge"]["merged"] == 8 + 4 + 6 * (family == "qwen2_moe")
    reader = gguf.GGUFReader(str(tmp_path / gguf_type / f"model-{gguf_type}.gguf"))
    tensors = {t.name: t for t in reader.tensors}
    assert [int(n) for n in tensors["blk.1.ffn_gate_exps.weight"].shape] == [64, ff, 4]  # GGML order: in, out, experts
    assert [int(n) for n in tensors["blk.1.ffn_down_exps.weight"].shape] == [ff, 64, 4]
    assert tensors["blk.1.ffn_gate_inp.weight"].tensor_type.name == "F32"  # the router, as llama.cpp keeps it
    assert int(reader.fields[f"{arch}.expert_count"].parts[-1][0]) == 4
    assert int(reader.fields[f"{arch}.expert_feed_forward_length"].parts[-1][0]) == ff
    shared = {n for n in tensors if "shexp" in n}
    assert len(shared) == 8 * (family == "qwen2_moe")  # 2 layers x gate, up, down, gate_inp
    if family == "qwen2_moe":
        assert int(reader.fields["qwen2moe.expert_shared_feed_forward_length"].parts[-1][0]) == 5632
        assert [int(n) for n in tensors["blk.0.ffn_gate_inp_shexp.weight"].shape] == [64]  # (1, 64) squeezed
        # f32: the stack is each expert's merged weight in expert order, and the adapter moved it off the base
        base = load_file(str(model_dir / "model.safetensors"))
        stacked = torch.stack([base[f"model.layers.1.mlp.experts.{e}.up_proj.weight"] for e in range(4)])
        written = torch.from_numpy(np.array(tensors["blk.1.ffn_up_exps.weight"].data))
        assert written.shape == stacked.shape and 1e-4 < float((written - stacked).abs().max()) < 0.1
        # experts stacked in reverse order: the check fails and nothing is kept
        grouped = gguf_file._grouped
        monkeypatch.setattr(gguf_file, "_grouped", lambda *a: [(n, s[::-1]) for n, s in grouped(*a)])
        with pytest.raises(MergeCheckFailed, match="nothing was written"):
            export_gguf(run.path, tmp_path / "reversed", gguf_type="f32", say=quiet)
        assert not (tmp_path / "reversed").exists()
