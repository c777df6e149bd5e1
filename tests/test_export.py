"""Export: the adapter alone in vanilla peft, merged models in vanilla transformers, the verifier, bad input."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from conftest import CHATML_TEMPLATE, copy_run_with_base, train_tiny_run, training_kernel_only
from safetensors.torch import load_file, save_file

from finetune.cli.commands import main
from finetune.data import ALPACA_PROMPT
from finetune.errors import ExportError, MergeCheckFailed, RunDirError
from finetune.export.run import export_run, read_adapter, reference, verify
from finetune.model.shards import ShardWriter, read_header, read_tensor, weight_files

QUANT = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32)


def quiet(_text: str) -> None:
    pass


def vanilla_logits(model_dir, ids, adapter=None, quantized=False):
    """Logits of a model loaded the plain way a user would (transformers [+ peft]), nothing of ours."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    extra = {"quantization_config": BitsAndBytesConfig(**QUANT), "device_map": {"": "cpu"}} if quantized else {}
    model = training_kernel_only(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **extra))
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def test_adapter_export_loads_in_vanilla_peft_with_the_trained_logits(qlora_run, tiny_model_dir, tmp_path):
    out = tmp_path / "adapter"
    result = export_run(qlora_run.path, out, say=quiet)
    names = sorted(p.name for p in out.iterdir())
    for expected in (
        "adapter_config.json",
        "adapter_model.safetensors",
        "tokenizer.json",
        "chat_template.jinja",
        "recipe.yaml",
        "finetune_export.json",
    ):
        assert expected in names
    got = vanilla_logits(tiny_model_dir, qlora_run.ids, adapter=out, quantized=True)
    torch.testing.assert_close(got, qlora_run.logits, rtol=0, atol=1e-5)
    base = vanilla_logits(tiny_model_dir, qlora_run.ids, quantized=True)
    assert (got - base).abs().max() > 1e-2  # the adapter is not a no-op, so equality above means something
    meta = json.loads((out / "finetune_export.json").read_text())
    assert meta == result.metadata
    assert meta["kind"] == "adapter" and meta["data_format"] == "alpaca"
    assert meta["prompt_template"]["with_input"] == ALPACA_PROMPT
    assert (out / "chat_template.jinja").read_text() == CHATML_TEMPLATE
    assert (out / "recipe.yaml").read_text() == (qlora_run.path / "recipe.yaml").read_text()


def test_fp32_merge_loads_in_vanilla_transformers_with_base_plus_adapter_logits(lora_run, tiny_model_dir, tmp_path):
    out = tmp_path / "merged"
    result = export_run(lora_run.path, out, merge=True, dtype="fp32", say=quiet)
    got = vanilla_logits(out, lora_run.ids)
    expected = vanilla_logits(tiny_model_dir, lora_run.ids, adapter=lora_run.path / "adapter")
    assert (got - expected).abs().max() < 1e-5
    torch.testing.assert_close(expected, lora_run.logits, rtol=0, atol=1e-5)
    check = result.metadata["verification"]
    assert check["passed"] and check["max_abs_diff"] < 1e-5 and check["adapter_effect"] > 1e-2
    assert result.metadata["merge"]["merged"] == 14  # 7 linear layers x 2 decoder layers
    # Each merged weight is W + (alpha/r) B @ A, worked out here from the files alone.
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    adapter = load_file(str(lora_run.path / "adapter" / "adapter_model.safetensors"))
    merged = load_file(str(out / "model.safetensors"))
    key = "model.layers.1.mlp.down_proj.weight"
    a = adapter["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"]
    b = adapter["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
    torch.testing.assert_close(merged[key], base[key] + (8 / 4) * b @ a, rtol=0, atol=1e-6)
    assert torch.equal(merged["model.norm.weight"], base["model.norm.weight"])  # untouched tensors pass through
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"


def test_qlora_merge_adds_the_adapter_to_the_dequantized_4bit_weights(qlora_run, tiny_model_dir, tmp_path):
    """The adapter was trained against dequantize(quantize(W)); the merge must use that, not W."""
    import bitsandbytes.functional as bnbf

    from finetune.runs.open import load_trained, open_run

    out = tmp_path / "merged"
    result = export_run(qlora_run.path, out, merge=True, dtype="fp32", say=quiet)
    check = result.metadata["verification"]
    # Stated tolerance for a 4-bit base merged in fp32: 1e-5 (measured ~3e-6: summation order only).
    assert check["passed"] and check["max_abs_diff"] < 1e-5 and check["adapter_effect"] > 1e-2
    assert result.metadata["quantization"]["bits"] == 4 and result.metadata["merge"]["requantized"] == 14
    merged = load_file(str(out / "model.safetensors"))
    trained, _ = load_trained(open_run(qlora_run.path))
    on_disk = load_file(str(tiny_model_dir / "model.safetensors"))
    for name, module in trained.named_modules():
        if not name.endswith("self_attn.v_proj"):
            continue
        key = name.removeprefix("base_model.model.") + ".weight"
        w4 = module.base_layer.weight
        expected = bnbf.dequantize_4bit(w4.data, w4.quant_state) + module.get_delta_weight("default")
        torch.testing.assert_close(merged[key], expected, rtol=0, atol=1e-6)
        # ...which is a different model from merging into the 16/32-bit weights on disk.
        naive = on_disk[key].float() + module.get_delta_weight("default")
        assert (merged[key] - naive).abs().max() > 1e-3


def test_bf16_merge_is_bf16_on_disk_and_within_its_tolerance(qlora_run, tmp_path):
    out = tmp_path / "merged"
    result = export_run(qlora_run.path, out, merge=True, dtype="bf16", say=quiet)
    header = read_header(out / "model.safetensors")
    assert {e["dtype"] for e in header.tensors.values()} == {"BF16"}
    check = result.metadata["verification"]
    assert check["passed"] and 0 < check["max_abs_diff"] <= check["tolerance"]
    assert check["tolerance_rule"].startswith("0.05 (bf16)")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_dora_merge_matches(tiny_model_dir, runs_data, tmp_path):
    run = train_tiny_run(tmp_path / "run", tiny_model_dir, runs_data, lora={"dora": True}, train={"max_steps": 2})
    assert any(k.endswith("lora_magnitude_vector") for k in load_file(str(run.path / "adapter" / "adapter_model.safetensors")))
    result = export_run(run.path, tmp_path / "merged", merge=True, dtype="fp32", say=quiet)
    assert result.metadata["verification"]["max_abs_diff"] < 1e-5
    got = vanilla_logits(tmp_path / "merged", run.ids)
    assert (got - run.logits).abs().max() < 1e-5
    # vLLM refuses DoRA adapters: the adapter export says so, and that the merged model is what it serves.
    assert result.metadata["vllm"] == {"servable": True, "command": f"vllm serve {tmp_path / 'merged'}"}
    said: list[str] = []
    adapter = export_run(run.path, tmp_path / "adapter", say=said.append).metadata["vllm"]
    assert not adapter["servable"] and adapter["refused_by_vllm"] == ["DoRA (use_dora): vLLM does not yet support DoRA"]
    assert "vLLM:       cannot serve this adapter (DoRA" in said[-1] and "vllm serve MERGED_DIR" in said[-1]


def test_adapter_export_says_how_vllm_serves_it(lora_run, tmp_path, capsys):
    out = tmp_path / "my-adapter"
    assert main(["export", str(lora_run.path), "--out", str(out)]) == 0
    meta = json.loads((out / "finetune_export.json").read_text())["vllm"]
    command = f"vllm serve {meta_base(lora_run)} --enable-lora --lora-modules my-adapter={out}"
    assert meta["servable"] and meta["command"] == command and meta["max_lora_rank"] == 16  # r 4: vLLM's default holds it
    assert f"  vLLM:       {command}" in capsys.readouterr().out


def meta_base(run) -> str:
    return str(yaml.safe_load((run.path / "recipe.yaml").read_text())["model"]["path"])


@pytest.mark.parametrize(
    ("config", "servable", "max_rank", "refused"),
    [
        ({"r": 16}, True, 16, []),
        ({"r": 40}, True, 64, []),  # --max-lora-rank takes 1, 8, 16, 32, 64, 128, 256, 320 or 512
        ({"r": 8, "rank_pattern": {"q_proj": 300}}, True, 320, []),
        ({"r": 1024}, False, None, ["rank 1024: above vLLM's largest --max-lora-rank, 512"]),
        (
            {"r": 8, "init_lora_weights": "pissa"},
            False,
            None,
            ["PiSSA (init_lora_weights): vLLM adds the adapter to the original weights, not to PiSSA's residual"],
        ),
        ({"r": 8, "init_lora_weights": True}, True, 16, []),
        (
            {"r": 8, "modules_to_save": ["lm_head"]},
            False,
            None,
            ["modules_to_save ['lm_head']: vLLM only supports modules_to_save being None"],
        ),
    ],
)
def test_vllm_note_names_the_rank_flag_and_what_vllm_refuses(config, servable, max_rank, refused):
    from pathlib import Path

    from finetune.export.serving import vllm_note

    note = vllm_note(config, "BASE", Path("/x/ad"))
    assert (note["servable"], note["max_lora_rank"], note["refused_by_vllm"]) == (servable, max_rank, refused)
    if servable:
        flag = "" if max_rank == 16 else f" --max-lora-rank {max_rank}"
        assert note["command"] == f"vllm serve BASE --enable-lora --lora-modules ad=/x/ad{flag}"


def test_sharded_base_gives_sharded_merge_with_the_same_tensors(lora_run, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from finetune.export.run import stream_merge

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(sharded, max_shard_size="100KB")
    assert len(weight_files(sharded)) > 2
    loras = read_adapter(lora_run.path / "adapter")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    stats = stream_merge(sharded, tmp_path / "a", torch.float32, loras, {})
    stream_merge(tiny_model_dir, tmp_path / "b", torch.float32, loras, {})
    assert stats["merged"] == len(loras) == 14
    index = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == len(weight_files(sharded))
    a = {k: v for f in weight_files(tmp_path / "a") for k, v in load_file(str(f)).items()}
    b = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_shard_writer_round_trips_every_dtype_and_shape(tmp_path):
    tensors = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(4, 2).to(torch.bfloat16),
        "f16": torch.randn(7).to(torch.float16),
        "i64": torch.arange(6).reshape(2, 3),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    from finetune.model.shards import NAMES

    path = tmp_path / "x.safetensors"
    with ShardWriter(path, [(k, NAMES[v.dtype], list(v.shape)) for k, v in tensors.items()]) as w:
        for k, v in tensors.items():
            w.write(k, v)
    back = load_file(str(path))  # the reference reader agrees with ours byte for byte
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], v) for k, v in tensors.items())
    header = read_header(path)
    with path.open("rb") as fh:
        assert all(torch.equal(read_tensor(fh, header, k), v) for k, v in tensors.items())
    with pytest.raises(ValueError, match="expected f32"):
        ShardWriter(tmp_path / "y.safetensors", [("f32", "F32", [3, 5])]).write("f32", torch.zeros(3, 5, dtype=torch.float16))


# --------------------------------------------------------------------------- the verifier catches bad merges


def test_corrupted_merge_fails_loudly_and_leaves_nothing(lora_run, tmp_path, monkeypatch, capsys):
    import finetune.export.merge as merge

    real = merge.merged_weight

    def corrupt_one(weight, lora, quant):
        w = real(weight, lora, quant)
        if lora is not None and w.shape == (64, 128):  # down_proj of each layer: 1% noise, a silent bug's size
            w = w + 0.01 * w.abs().mean() * torch.randn(w.shape, generator=torch.Generator().manual_seed(0))
        return w

    monkeypatch.setattr(merge, "merged_weight", corrupt_one)  # stream_merge's, in finetune/export/merge.py
    out = tmp_path / "merged"
    with pytest.raises(MergeCheckFailed) as err:
        export_run(lora_run.path, out, merge=True, dtype="fp32", say=quiet)
    assert "merged model differs from base + adapter" in str(err.value) and err.value.hint
    assert not out.exists() and not list(tmp_path.glob(".tmp-*"))  # nothing looks like a finished export
    assert main(["export", str(lora_run.path), "--out", str(out), "--merge", "--dtype", "fp32"]) == 2
    assert "merge check FAILED" in capsys.readouterr().out
    assert not out.exists()


def test_verifier_rejects_a_merged_file_corrupted_on_disk(lora_run, tmp_path):
    from finetune.runs.open import open_run

    out = tmp_path / "merged"
    export_run(lora_run.path, out, merge=True, dtype="fp32", say=quiet)
    ref = reference(open_run(lora_run.path))
    assert verify(ref, out, "fp32")["passed"]
    # With a memory budget below the model's size the layers stream from disk: same logits.
    streamed = verify(ref, out, "fp32", max_memory=64 * 1024)
    assert streamed["offloaded"] and not verify(ref, out, "fp32")["offloaded"]
    assert streamed["max_abs_diff"] == verify(ref, out, "fp32")["max_abs_diff"]
    tensors = load_file(str(out / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.weight"] *= 1.05
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    check = verify(ref, out, "fp32")
    assert not check["passed"] and check["max_abs_diff"] > check["tolerance"]


# --------------------------------------------------------------------------- bad input


def test_not_a_run_says_what_is_missing(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(RunDirError) as err:
        export_run(tmp_path, tmp_path.parent / "out", say=quiet)
    assert "missing recipe.yaml" in str(err.value) and "adapter/" in str(err.value) and "found: metrics.jsonl" in str(err.value)
    (tmp_path / "checkpoints").mkdir()
    assert main(["export", str(tmp_path), "--out", str(tmp_path.parent / "out")]) == 2
    err_text = capsys.readouterr().err
    assert "is not a finished run" in err_text and "resume=auto" in err_text and "Traceback" not in err_text
    assert main(["export", str(tmp_path / "nope"), "--out", str(tmp_path.parent / "out")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_out_must_be_new_or_empty_unless_overwrite(lora_run, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="exists and is not empty"):
        export_run(lora_run.path, out, say=quiet)
    with pytest.raises(ExportError, match="is not a finetune export"):  # --overwrite never deletes other files
        export_run(lora_run.path, out, overwrite=True, say=quiet)
    assert (out / "notes.txt").read_text() == "mine"
    export_run(lora_run.path, tmp_path / "exp", say=quiet)
    assert main(["export", str(lora_run.path), "--out", str(tmp_path / "exp")]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["export", str(lora_run.path), "--out", str(tmp_path / "exp"), "--overwrite", "--merge", "--dtype", "fp32"]) == 0
    assert json.loads((tmp_path / "exp" / "finetune_export.json").read_text())["kind"] == "merged"
    for inside in (lora_run.path, lora_run.path.parent, lora_run.path / "adapter" / "x"):
        with pytest.raises(ExportError, match="overlaps the run"):  # even with --overwrite: never replace the run itself
            export_run(lora_run.path, inside, overwrite=True, say=quiet)


def test_merge_of_a_base_that_lost_its_config_json_names_the_file(lora_run, tiny_model_dir, tmp_path, capsys):
    run = copy_run_with_base(lora_run.path, tmp_path, tiny_model_dir)
    (tmp_path / "model" / "config.json").unlink()
    assert main(["export", str(run), "--out", str(tmp_path / "merged"), "--merge"]) == 2
    err = capsys.readouterr().err
    assert (
        f"error: model.path: '{tmp_path / 'model'}' has no config.json; the merge needs the base model's config.json "
        "(it describes the merged model)"
    ) in err
    assert f"or set model.path in '{run / 'recipe.yaml'}' to a complete copy of the base model" in err
    assert "Traceback" not in err and not (tmp_path / "merged").exists()


def test_unknown_dtype_is_refused(lora_run, tmp_path, capsys):
    with pytest.raises(ExportError) as err:
        export_run(lora_run.path, tmp_path / "x", merge=True, dtype="int4", say=quiet)
    assert "--dtype 'int4'" in str(err.value) and "bf16, fp16, fp32" in str(err.value)
    with pytest.raises(SystemExit) as exit_:
        main(["export", str(lora_run.path), "--out", str(tmp_path / "x"), "--merge", "--dtype", "bf32"])
    assert exit_.value.code == 2 and "invalid choice: 'bf32'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_merged_export_keeps_the_training_prompt_format_for_generate(qlora_run, tmp_path, capsys):
    out = tmp_path / "merged"
    export_run(qlora_run.path, out, merge=True, dtype="fp32", say=quiet)
    assert yaml.safe_load((out / "recipe.yaml").read_text())["data"]["format"] == "alpaca"
    args = ["--prompt", "Add the numbers.", "--max-new-tokens", "8"]
    assert main(["generate", str(qlora_run.path), *args]) == 0
    from_run = capsys.readouterr()
    assert main(["generate", str(out), *args]) == 0
    from_export = capsys.readouterr()
    assert "data.format=alpaca" in from_export.err
    assert from_export.out == from_run.out and from_run.out.strip()
    adapter_export = export_run(qlora_run.path, tmp_path / "adapter", say=quiet).out
    assert main(["generate", str(adapter_export), *args]) == 0
    assert capsys.readouterr().out == from_run.out


def test_full_finetune_exports_as_a_verified_standalone_model(tiny_model_dir, runs_data, tmp_path):
    from finetune.runs.open import evaluate_run, open_run

    run = train_tiny_run(tmp_path / "run", tiny_model_dir, runs_data, lora=None, train={"max_steps": 2, "lr": 1e-3})
    assert (run.path / "model" / "config.json").is_file()
    with pytest.raises(ExportError, match="full fine-tune") as err:
        export_run(run.path, tmp_path / "a", say=quiet)
    assert "--merge" in err.value.hint
    result = export_run(run.path, tmp_path / "m", merge=True, dtype="fp32", say=quiet)
    assert result.metadata["kind"] == "full" and result.metadata["verification"]["max_abs_diff"] < 1e-5
    assert (vanilla_logits(tmp_path / "m", run.ids) - run.logits).abs().max() < 1e-5
    records = [{"instruction": "Add the numbers.", "input": "1 + 2", "output": "3"}]
    scores = evaluate_run(open_run(run.path), records, "x").columns
    assert scores["base"].loss != pytest.approx(scores["fine-tuned"].loss, abs=1e-4)  # base loaded apart from the trained model
