"""The memory-mode table (finetune/declarations/techniques.py): config, the launch and the --fit search read
the same rules, so the search never proposes a setup that the recipe's rules or the launch refuse."""

from __future__ import annotations

from dataclasses import replace

import pytest

from finetune.config.schema import build_recipe, fsdp_problems, load_recipe
from finetune.declarations import techniques
from finetune.plan.fitting import candidates, mode_settings, runnable
from finetune.plan.inputs import RecipeFacts, Setup
from finetune.plan.recipe import setup_of
from finetune.plan.rewrite import setup_changes, with_values

PATHS = ["model.path=some/model", "data.path=train.jsonl"]


@pytest.mark.parametrize(
    "recipe, overrides, max_gpus",
    [
        ("qlora-1x24gb", [], 2),
        ("qlora-fsdp-2x24gb", [], 2),
        ("qlora-fsdp-2x24gb", [], 1),  # an FSDP recipe fitted to one GPU: strategy and cpu_offload become moot
        ("qlora-stream-70b-1x24gb", [], 2),
        ("qlora-stream-70b-1x24gb", ["memory.base_weights=disk", "memory.offload_dir=/nvme"], 1),
        ("qlora-offload-1x12gb", [], 2),
        ("qlora-1x24gb", ["quant.bits=8"], 2),  # int8: no FSDP, no streaming
        (
            "qlora-1x24gb",
            ["quant.bits=null", "lora=null", "memory.embeddings=device"],
            2,
        ),  # full fine-tuning: no FSDP, no streaming, tables train
    ],
)
def test_fit_search_proposes_only_setups_the_rules_accept(recipe, overrides, max_gpus):
    cfg = load_recipe(recipe, PATHS + overrides)
    base = setup_of(cfg, max_gpus)
    found = candidates(base, max_gpus, RecipeFacts.from_config(cfg, "bf16"))
    assert found
    for s in found:
        # the recipe --fit would write for this setup loads (every config rule) and reads back as the setup
        written = build_recipe(with_values(cfg.to_dict(), setup_changes(s, base, cfg)))
        assert setup_of(written, s.gpus) == s
        # and the launch on s.gpus processes accepts it (what Parallel.choose and check_strategy ask)
        strategy = "single" if s.gpus == 1 else written.distributed.strategy.replace("auto", "ddp")
        assert techniques.problems(techniques.launch_settings(written, fsdp=strategy == "fsdp", processes=s.gpus)) == []
    # the search tried every mode the table allows: streaming and offloads are among the candidates
    lora = cfg.lora is not None
    assert any(s.streams_weights for s in found) == (lora and cfg.quant.bits != 8)
    assert any(s.activation_offload for s in found) and any(s.optimizer_offload for s in found)
    assert any(s.sharding == "fsdp" for s in found) == (max_gpus > 1 and lora and cfg.quant.bits != 8)


# Each setup the search may try, and the recipe key whose rule refuses it (None: it runs). Written out,
# not derived from the table: a rule lost or loosened in finetune/declarations/techniques.py fails here.
INT8 = RecipeFacts(8, False, 16, "all-linear", 0.05, False, 2)
RUNNABLE = [
    (Setup(1, 1), None, None),
    (Setup(1, 1, activation_offload=True, checkpoint_every=1), None, None),
    (Setup(1, 1, activation_offload=True, checkpoint_every=2), None, None),
    (Setup(1, 1, base_weights="cpu"), None, None),
    (Setup(1, 1, gpus=2, sharding="fsdp", cpu_offload=True), None, None),
    (Setup(1, 1, gpus=2, sharding="ddp"), INT8, None),
    (Setup(1, 1, base_weights="cpu", checkpoint_every=0), None, "memory.activation_checkpointing=all"),
    (Setup(1, 1, base_weights="disk", checkpoint_every=2), None, "memory.activation_checkpointing=all"),
    (Setup(1, 1, gpus=2, base_weights="disk"), None, "this launch has 2 processes"),
    (Setup(1, 1, gpus=2, sharding="fsdp", optimizer_offload=True), None, "memory.optimizer_offload is for one process"),
    (Setup(1, 1, gpus=2, sharding="ddp", cpu_offload=True), None, "distributed.cpu_offload needs distributed.strategy=fsdp"),
    (Setup(1, 1, gpus=2, sharding="fsdp", embeddings="cpu"), None, "memory.embeddings=cpu keeps them whole"),
    (Setup(1, 1, gpus=2, sharding="fsdp", loss="liger"), None, "memory.loss=liger is not run under FSDP yet"),
    (Setup(1, 1, loss="liger", embeddings="cpu"), None, "memory.loss=liger hands the head's whole weight"),
    (Setup(1, 1, gpus=2, sharding="fsdp"), INT8, "cannot shard 8-bit"),
    (Setup(1, 1, base_weights="cpu"), INT8, "8-bit (LLM.int8) layers keep state"),
    (Setup(1, 1, gpus=1, sharding="fsdp"), None, ""),  # FSDP on one GPU: DDP's setup again (no rule, no message)
]


@pytest.mark.parametrize("setup, recipe, refused_by", RUNNABLE)
def test_runnable_refuses_exactly_what_the_rules_refuse(setup, recipe, refused_by):
    assert runnable(setup, recipe) == (refused_by is None)
    messages = techniques.problems(mode_settings(setup, recipe))
    if refused_by:
        assert any(refused_by in m for m in messages), messages
    else:
        assert messages == []


def test_launch_rules_need_the_process_count_and_fsdp_rules_name_what_chose_fsdp():
    cfg = load_recipe("qlora-stream-70b-1x24gb", PATHS)
    assert techniques.problems(techniques.recipe_settings(cfg)) == []  # the recipe alone does not say
    (msg,) = techniques.problems(techniques.launch_settings(cfg, fsdp=False, processes=2), (techniques.LAUNCH,))
    assert msg == (
        "memory.base_weights=cpu streams the weights of one process; this launch has 2 processes. Run on one GPU, "
        "or use distributed.strategy=fsdp with distributed.cpu_offload=true."
    )
    auto = fsdp_problems(cfg, "FSDP (chosen by distributed.strategy=auto)")
    assert auto == [
        "FSDP (chosen by distributed.strategy=auto) shards the weights itself; memory.base_weights=cpu streams them "
        "on one process. Use distributed.cpu_offload=true for FSDP, or run on one GPU."
    ]
    # every row names the recipe keys it reads, and its message names each of them
    for rule in techniques.RULES:
        text = rule.message(replace(techniques.Settings(), processes=2))
        assert all(key.split(".")[-1] in text for key in rule.keys), (rule.keys, text)


@pytest.mark.parametrize("checkpointing", ["all", "none", 2])
def test_activation_offload_runs_with_every_checkpointing_setting(checkpointing):
    # Checkpointed layers' inputs are offloaded too (activation_offload.offloaded_checkpoint): no setting is left with nothing to move.
    cfg = load_recipe(
        "qlora-1x24gb", PATHS + ["memory.activation_offload=true", f"memory.activation_checkpointing={checkpointing}"]
    )
    assert techniques.problems(techniques.recipe_settings(cfg)) == []
    setup = setup_of(cfg, 1)
    assert (setup.activation_offload, setup.checkpoint_every) == (True, techniques.checkpoint_every(checkpointing))
    assert runnable(setup)


def test_every_memory_key_belongs_to_one_technique_and_every_technique_to_the_recipe():
    # The registry is the one list: a MemoryConfig field no technique owns, a Modes field no technique
    # switches, or a technique key the schema lacks would each be a copy gone out of step.
    from dataclasses import fields

    from finetune.config.schema import MemoryConfig
    from finetune.runs.checkpoint import HARMLESS_CHANGES

    owned = [key for t in techniques.TECHNIQUES for key in t.keys]
    assert len(owned) == len(set(owned))
    assert sorted(owned) == sorted(f"memory.{name}" for name in MemoryConfig.model_fields)
    switches = {f.name for f in fields(techniques.Modes)}
    assert {t.field for t in techniques.TECHNIQUES} <= switches
    # Each Modes field is a key of one technique, named as the recipe names it (but checkpoint_every,
    # the planner's number for memory.activation_checkpointing).
    assert {"memory." + {"checkpoint_every": "activation_checkpointing"}.get(f, f) for f in switches} <= set(owned)
    assert set(techniques.RESUME_HARMLESS) <= set(HARMLESS_CHANGES)
    assert set(techniques.RESUME_HARMLESS) == {
        "memory.activation_offload", "memory.embeddings", "memory.loss", "memory.loss_chunk", "memory.tiled_mlp",
        "memory.offload_dir",  # where files wait, for whichever technique writes them
    }  # fmt: skip
    # A recipe's values reach the planner's Setup unchanged: no translator between them.
    cfg = load_recipe("qlora-offload-1x12gb", PATHS)
    assert techniques.modes(cfg.memory) == techniques.modes(setup_of(cfg)) | {"optimizer_offload": cfg.memory.optimizer_offload}
    assert techniques.modes(cfg.memory)["checkpoint_every"] == 0 and cfg.memory.activation_offload
