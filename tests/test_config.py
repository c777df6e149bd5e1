"""Recipe schema: every problem listed at once, typos suggested, shipped recipes valid."""

from __future__ import annotations

import pytest
import yaml

from finetune.config.schema import build_recipe, load_recipe, parse_overrides, resolve_path, shipped_recipes
from finetune.errors import ConfigError

MINIMAL = {"model": {"path": "m"}, "data": {"path": "d.jsonl"}, "output_dir": "out"}


def problems_of(data: dict) -> list[str]:
    with pytest.raises(ConfigError) as err:
        build_recipe(data)
    return err.value.problems


def test_defaults_live_in_schema():
    cfg = build_recipe(MINIMAL)
    assert cfg.quant.bits == 4 and cfg.quant.quant_type == "nf4" and cfg.quant.double_quant
    assert cfg.lora.r == 16 and cfg.lora.alpha == 32 and cfg.lora.target == "all-linear"
    assert cfg.train.batch_size == 1 and cfg.train.grad_accum == 1 and cfg.train.max_steps is None
    assert cfg.precision == "auto" and cfg.resume is None and cfg.seed == 42


def test_all_problems_listed_with_did_you_mean():
    data = {
        "model": {"path": "m"},
        "data": {"path": "d", "formatt": "alpaca"},
        "output_dir": "o",
        "trian": {"lr": 1},
        "train": {"lr": "abc", "batch_size": 0, "gradient_checkpointing": True},
        "precision": "bf32",
    }
    problems = problems_of(data)
    assert len(problems) == 6, problems
    text = "\n".join(problems)
    assert "data.formatt: unknown key; did you mean 'data.format'?" in text
    assert "trian: unknown key; did you mean 'train'?" in text
    assert "train.gradient_checkpointing: unknown key; it moved to memory.activation_checkpointing" in text
    assert "train.lr:" in text and "'abc'" in text
    assert "train.batch_size:" in text and "(got 0)" in text
    assert "precision:" in text and "'bf32'" in text


def test_missing_required_keys_named():
    problems = problems_of({"data": {"path": "d"}})
    assert any(p.startswith("model: required key is missing") for p in problems)
    assert any(p.startswith("output_dir: required key is missing") for p in problems)


def test_unknown_key_without_close_match_lists_known_keys():
    (p,) = problems_of({**MINIMAL, "lora": {"zzz": 1}})
    assert p.startswith("lora.zzz: unknown key; known keys under lora: r, alpha, dropout, target, dora")


@pytest.mark.parametrize(
    "patch, fragment",
    [
        ({"quant": {"bits": 4}, "lora": None}, "quant.bits=4 needs an adapter"),
        ({"eval": {"every_steps": 10}}, "eval.every_steps is set but there is no eval data"),
        ({"train": {"max_steps": 5, "warmup_steps": 10}}, "train.warmup_steps=10 exceeds train.max_steps=5"),
        ({"resume": "auto", "overwrite": True}, "resume and overwrite=true contradict"),
        ({"quant": {"bits": 8}, "lora": {"dora": True}}, "lora.dora=true is not supported with quant.bits=8"),
    ],
)
def test_cross_field_rules(patch, fragment):
    problems = problems_of({**MINIMAL, **patch})
    assert any(fragment in p for p in problems), problems


def test_full_finetune_without_quant_is_allowed():
    cfg = build_recipe({**MINIMAL, "quant": {"bits": None}, "lora": None})
    assert cfg.lora is None and cfg.quant.bits is None


def test_overrides_parse_yaml_values():
    tree = parse_overrides(["train.lr=1e-3", "lora.target=[q_proj,v_proj]", "quant.bits=null", "model.path=a/b"])
    assert tree == {
        "train": {"lr": 1e-3},
        "lora": {"target": ["q_proj", "v_proj"]},
        "quant": {"bits": None},
        "model": {"path": "a/b"},
    }
    with pytest.raises(ConfigError) as err:
        parse_overrides(["train.lr"])
    assert "expected key=value" in err.value.problems[0]


def test_load_recipe_applies_overrides_and_reports_unknown_override(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(MINIMAL))
    cfg = load_recipe(path, ["train.lr=0.5", "lora.r=4"])
    assert cfg.train.lr == 0.5 and cfg.lora.r == 4 and cfg.model.path == "m"
    with pytest.raises(ConfigError) as err:
        load_recipe(path, ["train.lrr=0.5"])
    assert err.value.problems == ["train.lrr: unknown key; did you mean 'train.lr'?"]


def test_bad_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {path: m\n")
    with pytest.raises(ConfigError) as err:
        load_recipe(bad)
    assert "not valid YAML at line" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_recipe(tmp_path / "nope.yaml")
    assert "not found (cwd:" in str(err.value) and "finetune ls" in str(err.value)


def test_yaml_is_loaded_safely(tmp_path):
    evil = tmp_path / "evil.yaml"
    evil.write_text("model: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError) as err:
        load_recipe(evil)
    assert "not valid YAML" in str(err.value)


def test_asset_paths_resolve_into_package():
    from finetune.config.schema import ASSETS_DIR

    assert resolve_path("asset:tiny-llama") == str(ASSETS_DIR / "tiny-llama")
    assert resolve_path("/abs/x") == "/abs/x"


def test_every_shipped_recipe_validates_and_documents_every_key():
    recipes = shipped_recipes()
    assert {"demo-cpu", "qlora-1x24gb"} <= set(recipes)
    for name, path in recipes.items():
        text = path.read_text()
        assert text.startswith("# finetune run"), f"{name}: first line must be the command that runs it"
        cfg = load_recipe(path)
        assert cfg.description, name
        # Every key line carries a comment saying what it trades.
        for line in text.splitlines():
            stripped = line.strip()
            if (
                ":" in stripped
                and not stripped.startswith("#")
                and not stripped.endswith(":")
                and not stripped.startswith("description")
            ):
                assert "#" in stripped, f"{name}: key without a comment: {line!r}"


def test_union_type_error_is_one_problem():
    (p,) = problems_of({**MINIMAL, "lora": {"target": 5}})
    assert p == "lora.target: expected str | list[str] (got 5)"
    (p,) = problems_of({**MINIMAL, "memory": {"activation_offload": "dsk"}})  # a few values: said as a recipe writes them
    assert p.startswith("memory.activation_offload: expected true, false or disk (got 'dsk')")


def test_fsdp_rules_hold_for_the_key_and_for_autos_choice():
    from finetune.errors import ConfigError
    from finetune.parallel.ddp import DDP
    from finetune.parallel.fsdp import FSDP

    base = {"model": {"path": "x"}, "data": {"path": "y"}, "output_dir": "o", "quant": {"bits": 8}}
    with pytest.raises(ConfigError) as err:
        build_recipe({**base, "distributed": {"strategy": "fsdp"}})
    assert "distributed.strategy=fsdp cannot shard 8-bit (int8) weights" in str(err.value)
    with pytest.raises(ConfigError, match="offload needs distributed.strategy=fsdp"):
        build_recipe({**base, "quant": {"bits": 4}, "distributed": {"cpu_offload": True}})
    auto = build_recipe(base)  # strategy auto: valid until auto actually picks FSDP
    assert DDP.problems(auto, None) == []
    (p,) = FSDP.problems(auto, None)
    assert p.startswith("FSDP (chosen by distributed.strategy=auto) cannot shard 8-bit (int8) weights")


def test_grad_compression_needs_ddp_and_a_powersgd_knob_needs_powersgd():
    (p,) = problems_of({**MINIMAL, "distributed": {"strategy": "fsdp", "grad_compression": "bf16"}})
    assert p == (
        "distributed.grad_compression=bf16 compresses DDP's gradient all-reduce, but distributed.strategy=fsdp, "
        "which reduces gradients its own way (no DDP all-reduce to compress). Set distributed.strategy=ddp "
        "(a full replica per GPU) or distributed.grad_compression=none."
    )
    (p,) = problems_of({**MINIMAL, "distributed": {"grad_compression": "fp16", "powersgd_rank": 2, "powersgd_warmup_steps": 5}})
    assert p == (
        "distributed.powersgd_rank applies to distributed.grad_compression=powersgd (it is fp16). "
        "Set grad_compression=powersgd, or remove distributed.powersgd_rank and distributed.powersgd_warmup_steps."
    )
    (p,) = problems_of({**MINIMAL, "distributed": {"grad_compression": "powersgd", "powersgd_warmup_steps": 1}})
    assert p.startswith("distributed.powersgd_warmup_steps:") and "2" in p  # torch needs 2 plain steps at least


def test_grad_compression_at_launch_refused_under_autos_fsdp_and_said_useless_on_one_process(monkeypatch):
    from types import SimpleNamespace

    import torch

    from finetune.declarations import compression
    from finetune.declarations.layout import Layout
    from finetune.parallel import runtime as parallel
    from finetune.parallel.ddp import DDP
    from finetune.parallel.room import Room

    cfg = build_recipe({**MINIMAL, "distributed": {"grad_compression": "powersgd"}})
    assert compression.powersgd_warmup(cfg) == 10  # null: at least 10 plain steps...
    assert compression.powersgd_warmup(build_recipe({**cfg.to_dict(), "train": {"warmup_steps": 30}})) == 30
    # distributed.strategy=auto is valid until auto picks FSDP at launch (a replica does not fit).
    monkeypatch.setattr(parallel, "resolve_strategy", lambda *a: "fsdp")
    accelerator = SimpleNamespace(num_processes=2, process_index=0, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="distributed.strategy=auto chose fsdp here, which reduces gradients its own way"):
        parallel.Parallel.choose(cfg, accelerator)
    # One process: nothing to all-reduce. Said, not refused (a multi-GPU recipe tried on one).
    grid = Layout.of(cfg, 0, 2)
    assert parallel.Parallel(accelerator, Room(accelerator, cfg, grid)).describe() == (
        "distributed.grad_compression=powersgd has no effect: one process has no gradients to all-reduce"
    )
    assert parallel.Parallel(accelerator, DDP(accelerator, cfg, grid)).describe() == (
        "parallel: ddp over 2 processes, gradients all-reduced as rank-1 PowerSGD factors from step 11"
    )


def test_runs_from_before_grad_compression_resume_and_turning_it_on_changes_the_run():
    import json

    from finetune.runs.checkpoint import recipe_changes

    new = build_recipe(MINIMAL).to_dict()
    old = json.loads(json.dumps(new))
    for key in ("grad_compression", "powersgd_rank", "powersgd_warmup_steps"):
        del old["distributed"][key]
    assert recipe_changes(old, new) == ([], [])
    on = build_recipe({**MINIMAL, "distributed": {"grad_compression": "bf16"}}).to_dict()
    assert recipe_changes(new, on) == (["distributed.grad_compression: 'none' -> 'bf16'"], [])


def test_each_split_declares_its_recipe_keys_and_a_resume_may_change_them():
    # declarations/splits.py is where a split strategy's keys live: runs/checkpoint.py reads them, lists none.
    from finetune.config.sections import DistributedConfig
    from finetune.declarations.splits import SPLITS
    from finetune.runs.checkpoint import recipe_changes

    assert [s.name for s in SPLITS] == ["pipeline", "tensor", "context"]
    for split in SPLITS:
        assert split.key in split.keys and {k.split(".", 1)[1] for k in split.keys} <= set(DistributedConfig.model_fields)
    one = build_recipe(MINIMAL)
    assert not any(s.asked(one) for s in SPLITS)
    for moved, sizes in (
        ({"pipeline_parallel": 2, "pipeline_schedule": "gpipe", "tensor_parallel": 2}, [2, 2, 1]),
        ({"context_parallel": 2, "context_parallel_mode": "ulysses"}, [1, 1, 2]),
    ):
        split = build_recipe({**MINIMAL, "distributed": moved})
        assert [s.size(split) for s in SPLITS] == sizes
        breaking, harmless = recipe_changes(one.to_dict(), split.to_dict())
        assert breaking == [] and [h.split(":")[0] for h in harmless] == sorted(f"distributed.{k}" for k in moved)


def test_where_offloaded_files_wait_is_a_harmless_change_on_resume():
    # memory.offload_dir: a folder for base_weights=disk's file and activation_offload=disk's, nothing computed; moving
    # them (the disk filled up, as the error says) or back to host RAM resumes.
    from finetune.runs.checkpoint import recipe_changes

    disk = build_recipe({**MINIMAL, "memory": {"activation_offload": "disk", "offload_dir": "/nvme/a"}})
    moved = build_recipe({**MINIMAL, "memory": {"activation_offload": "disk", "offload_dir": "/nvme/b"}})
    host = build_recipe({**MINIMAL, "memory": {"activation_offload": True}})
    for other in (moved, host):
        breaking, harmless = recipe_changes(disk.to_dict(), other.to_dict())
        assert breaking == [] and harmless


def test_deepspeed_keys_and_what_zero_cannot_run_with():
    ds = {"strategy": "deepspeed"}
    cfg = build_recipe({**MINIMAL, "distributed": {**ds, "zero_stage": 3, "offload_params": "cpu", "offload_optimizer": "cpu"}})
    assert (cfg.distributed.zero_stage, cfg.distributed.offload_params) == (3, "cpu")
    assert problems_of({**MINIMAL, "distributed": {"zero_stage": 3}}) == [
        "distributed.zero_stage applies to distributed.strategy=deepspeed (it is auto). "
        "Set strategy=deepspeed, or remove distributed.zero_stage."
    ]
    (p,) = problems_of({**MINIMAL, "distributed": {**ds, "offload_params": "cpu"}})
    assert p.startswith("distributed.offload_params=cpu offloads the weight partitions of ZeRO-3; zero_stage=2")
    assert problems_of({**MINIMAL, "distributed": {**ds, "offload_optimizer": "nvme"}}) == [
        "distributed.offload_optimizer=nvme needs distributed.nvme_dir: a folder on an NVMe disk."
    ]
    (p,) = problems_of({**MINIMAL, "distributed": {**ds, "nvme_dir": "/nvme"}})
    assert p.startswith("distributed.nvme_dir is only used by offload_optimizer=nvme or offload_params=nvme")
    build_recipe({**MINIMAL, "distributed": {**ds, "zero_stage": 3, "offload_params": "nvme", "nvme_dir": "/nvme"}})
    # Streaming with ZeRO-3, FSDP's keys, our own optimizer offload, 8-bit under ZeRO-3: refused, saying what works.
    problems = problems_of(
        {
            **MINIMAL,
            "quant": {"bits": 8},
            "distributed": {**ds, "zero_stage": 3, "cpu_offload": True},
            "memory": {"base_weights": "cpu", "optimizer_offload": True},
        }
    )
    assert any(p.startswith("distributed.cpu_offload is FSDP's; distributed.strategy=deepspeed offloads with") for p in problems)
    assert any(
        "memory.base_weights=cpu streams them on one process. What works: zero_stage=3 with offload_params" in p for p in problems
    )
    assert any(
        p.startswith("memory.optimizer_offload is for one process; under distributed.strategy=deepspeed set") for p in problems
    )
    assert "ZeRO-3 cannot partition 8-bit (int8) weights; use quant.bits=4 or null, or distributed.zero_stage=2." in problems
    (p,) = problems_of({**MINIMAL, "distributed": {**ds, "grad_compression": "bf16"}})
    assert p.startswith(
        "distributed.grad_compression=bf16 compresses DDP's gradient all-reduce, but distributed.strategy=deepspeed"
    )


def test_deepspeed_missing_says_how_to_install_it(monkeypatch):
    import sys

    from finetune.declarations import zero_config

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed -> ImportError
    with pytest.raises(ConfigError) as err:
        zero_config.require()
    assert "pip install 'finetune[deepspeed]'" in err.value.problems[0]


def test_deepspeed_config_leaves_accumulation_to_the_trainer_and_runs_from_before_it_resume():
    import json

    from finetune.declarations import zero_config
    from finetune.runs.checkpoint import recipe_changes

    cfg = build_recipe(
        {
            **MINIMAL,
            "train": {"batch_size": 3, "max_grad_norm": 0.5},
            "distributed": {"strategy": "deepspeed", "zero_stage": 3, "offload_params": "nvme", "nvme_dir": "/nv"},
        }
    )
    c = zero_config.ds_config(cfg, "bf16", on_gpu=True)
    assert (c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"], c["gradient_clipping"]) == (3, 1, 0.5)
    assert c["zero_optimization"]["offload_param"] == {"device": "nvme", "pin_memory": True, "nvme_path": "/nv"}
    assert "offload_optimizer" not in c["zero_optimization"] and c["bf16"] == {"enabled": True}
    assert (
        c["zero_force_ds_cpu_optimizer"] and not zero_config.ds_config(cfg, "bf16", on_gpu=False)["zero_force_ds_cpu_optimizer"]
    )
    new = build_recipe(MINIMAL).to_dict()
    old = json.loads(json.dumps(new))
    for key in zero_config.DEFAULTS:
        del old["distributed"][key]
    assert recipe_changes(old, new) == ([], [])
    # How the processes share the work is not what they compute: a ZeRO run resumes under DDP or alone.
    moved = build_recipe({**MINIMAL, "distributed": {"strategy": "deepspeed", "zero_stage": 3}}).to_dict()
    assert recipe_changes(moved, new) == ([], ["distributed.strategy: 'deepspeed' -> 'auto'", "distributed.zero_stage: 3 -> 2"])


def test_auto_strategy_on_cuda_follows_the_plan_and_says_when_it_cannot_make_one(monkeypatch, capsys):
    from types import SimpleNamespace

    import torch

    from finetune import plan
    from finetune.errors import PlanError
    from finetune.parallel import distribute

    cfg = build_recipe({**MINIMAL, "distributed": {"strategy": "auto"}})
    rtx4090 = SimpleNamespace(name="NVIDIA GeForce RTX 4090", total_memory=24 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: rtx4090)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(plan, "plan_recipe", lambda cfg, gpu, gpus: SimpleNamespace(fits=gpu.memory_bytes > 30 * 2**30))
    assert distribute.resolve_strategy(cfg, 2, cuda) == "fsdp"  # a replica does not fit 24 GiB
    rtx4090.total_memory = 48 * 2**30
    assert distribute.resolve_strategy(cfg, 2, cuda) == "ddp"
    assert distribute.resolve_strategy(cfg, 1, cuda) == "single"
    assert capsys.readouterr().out == ""

    def unreadable(*args, **kwargs):
        raise PlanError("cannot read config.json of 'org/custom'")

    monkeypatch.setattr(plan, "plan_recipe", unreadable)
    assert distribute.resolve_strategy(cfg, 2, cuda) == "ddp"  # it still trains, and says why unplanned
    assert capsys.readouterr().out == (
        "note: distributed.strategy=auto runs DDP (a whole replica per GPU) without a memory plan: "
        "cannot read config.json of 'org/custom'. Set distributed.strategy=fsdp if a replica does not fit one GPU.\n"
    )


def test_a_wrong_value_says_what_the_key_is():
    # The schema's description (its first clause when long, never half a parenthesis): the help is where
    # the user reads the error.
    problems = problems_of(
        {
            **MINIMAL,
            "train": {"batch_size": 0},
            "memory": {"loss": "bogus"},
            "model": {**MINIMAL["model"], "attn_implementation": "x"},
        }
    )
    assert (
        "train.batch_size: Input should be greater than or equal to 1 (got 0) [batch_size: micro-batch (examples per forward)]"
        in problems
    )
    (loss,) = [p for p in problems if p.startswith("memory.loss")]
    assert loss.endswith(
        "(got 'bogus') [loss: how the LM head and the loss meet: chunked computes them over loss_chunk target positions at a time, never...]"
    )
    (attention,) = [p for p in problems if p.startswith("model.attn_implementation")]
    assert attention.endswith("(got 'x') [attn_implementation: auto: the fastest the model supports...]")
    (stage,) = problems_of({**MINIMAL, "distributed": {"zero_stage": 4}})
    assert stage.endswith("[zero_stage: deepspeed: 2 partitions optimizer state and gradients; 3 the weights too]")
