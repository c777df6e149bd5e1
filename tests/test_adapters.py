"""Adapter methods (finetune/adapters/): the registry drives lora.method; rsLoRA's scale, PiSSA's
residual, the DoRA alias (old recipes and checkpoints), and adapters that load in vanilla peft."""

from __future__ import annotations

import json
import math
import typing
from pathlib import Path

import pytest
import torch
import yaml
from conftest import train_tiny_run
from safetensors.torch import load_file
from test_export import quiet, vanilla_logits

from finetune import adapters
from finetune.config.schema import LoraConfig, build_recipe
from finetune.errors import ConfigError
from finetune.export.run import export_run
from finetune.model.load import load_model
from finetune.runs.checkpoint import recipe_changes


def lora_modules(model):
    return [(name, m) for name, m in model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A]


def test_lora_method_takes_exactly_the_registered_methods():
    assert set(typing.get_args(LoraConfig.model_fields["method"].annotation)) == set(adapters.NAMES)
    modules = {p.stem for p in Path(adapters.__file__).parent.glob("*.py")} - {"__init__", "base"}
    assert modules == set(adapters.NAMES), "every module of finetune/adapters/ is registered in its __init__"
    assert adapters.DEFAULT == "lora" and LoraConfig().adapter.name == "lora"
    for name, method in adapters.METHODS.items():
        assert method.name == name and method.summary


@pytest.mark.parametrize("name", adapters.NAMES)
def test_each_method_wraps_with_its_peft_arguments_and_scale(recipe_dict, name):
    cfg = build_recipe({**recipe_dict, "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "method": name}})
    model = load_model(cfg, precision="fp32")
    peft_cfg = model.peft_config["default"]
    for key, value in adapters.get(name).peft_kwargs.items():
        assert getattr(peft_cfg, key) == value
    scale = adapters.get(name).scale(8.0, 4)
    found = lora_modules(model)
    assert len(found) == 14  # 7 linears x 2 decoder layers
    assert all(m.scaling["default"] == pytest.approx(scale, rel=1e-12) for _, m in found)
    assert (scale == 8 / math.sqrt(4)) if name == "rslora" else (scale == 8 / 4)


def test_pissa_base_plus_adapter_is_the_original_weight_at_init(recipe_dict, tiny_model_dir):
    cfg = build_recipe({**recipe_dict, "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "method": "pissa"}})
    model = load_model(cfg, precision="fp32")
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    for name, m in lora_modules(model):
        key = name.removeprefix("base_model.model.") + ".weight"
        w0 = original[key].float()
        residual = m.base_layer.weight
        delta = m.scaling["default"] * m.lora_B["default"].weight @ m.lora_A["default"].weight
        torch.testing.assert_close(residual + delta, w0, rtol=0, atol=1e-6)
        assert (residual - w0).abs().max() > 1e-2  # the base really is the residual, not W


@pytest.mark.parametrize("bits", [4, 8])
def test_pissa_refuses_a_quantized_base_naming_the_fix(recipe_dict, bits):
    with pytest.raises(ConfigError) as err:
        build_recipe({**recipe_dict, "quant": {"bits": bits}, "lora": {"method": "pissa"}})
    text = str(err.value)
    assert "lora.method=pissa replaces each base weight by its residual" in text
    assert f"not on quant.bits={bits}. Set quant.bits=null, or lora.method=lora" in text


def test_rslora_trains_and_its_adapter_loads_in_vanilla_peft(tiny_model_dir, runs_data, tmp_path):
    run = train_tiny_run(tmp_path / "run", tiny_model_dir, runs_data, lora={"method": "rslora"})
    config = json.loads((run.path / "adapter" / "adapter_config.json").read_text())
    assert config["use_rslora"] is True and config["r"] == 4 and config["lora_alpha"] == 8
    assert build_recipe(yaml.safe_load((run.path / "recipe.yaml").read_text())).lora.method == "rslora"
    rows = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 3 and losses[-1] < losses[0]
    base = vanilla_logits(tiny_model_dir, run.ids)  # rsLoRA starts as a no-op (B = 0), like LoRA
    out = tmp_path / "export"
    export_run(run.path, out, say=quiet)
    got = vanilla_logits(tiny_model_dir, run.ids, adapter=out)
    torch.testing.assert_close(got, run.logits, rtol=0, atol=1e-5)
    assert (got - base).abs().max() > 1e-2


def test_pissa_adapter_loads_in_vanilla_peft_and_merges_into_the_residual(tiny_model_dir, runs_data, tmp_path):
    run = train_tiny_run(tmp_path / "run", tiny_model_dir, runs_data, lora={"method": "pissa"})
    assert json.loads((run.path / "adapter" / "adapter_config.json").read_text())["init_lora_weights"] == "pissa"
    # vanilla peft recomputes the residual from the original base (an exact SVD): the run's logits
    got = vanilla_logits(tiny_model_dir, run.ids, adapter=run.path / "adapter")
    torch.testing.assert_close(got, run.logits, rtol=0, atol=1e-5)
    assert (got - vanilla_logits(tiny_model_dir, run.ids)).abs().max() > 1e-2
    # the merge adds the adapter to the residual W - U_r S_r V_r^T, not to W; its own check agrees
    result = export_run(run.path, tmp_path / "merged", merge=True, dtype="fp32", say=quiet)
    check = result.metadata["verification"]
    assert check["passed"] and check["max_abs_diff"] < 1e-4
    torch.testing.assert_close(vanilla_logits(tmp_path / "merged", run.ids), run.logits, rtol=0, atol=1e-4)


def test_dora_alias_reads_as_method_dora_and_old_runs_resume(recipe_dict):
    old_spelling = build_recipe({**recipe_dict, "lora": {**recipe_dict["lora"], "dora": True}})
    new_spelling = build_recipe({**recipe_dict, "lora": {**recipe_dict["lora"], "method": "dora"}})
    assert old_spelling.lora.adapter.name == new_spelling.lora.adapter.name == "dora"
    assert old_spelling.to_dict() == new_spelling.to_dict()
    assert "dora" not in new_spelling.to_dict()["lora"] and new_spelling.to_dict()["lora"]["method"] == "dora"
    # A checkpoint written before lora.method existed says lora.dora: true (or false).
    for dora, cfg in [(True, new_spelling), (False, build_recipe(recipe_dict))]:
        written = cfg.to_dict()
        written["lora"] = {k: v for k, v in written["lora"].items() if k != "method"} | {"dora": dora}
        assert recipe_changes(written, cfg.to_dict()) == ([], [])
    breaking, _ = recipe_changes(written, new_spelling.to_dict())  # dora: false -> method: dora is a change
    assert breaking == ["lora.method: 'lora' -> 'dora'"]
    with pytest.raises(ConfigError, match="lora.dora=true and lora.method=rslora name two methods"):
        build_recipe({**recipe_dict, "lora": {"dora": True, "method": "rslora"}})
