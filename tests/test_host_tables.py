"""memory.embeddings=cpu: the frozen vocabulary tables wait in host RAM (finetune/memory/host_tables.py).

On a CPU device nothing moves, but every lookup and every visit of the head goes through the
same code as on a GPU: the runs must be bitwise the runs with the tables in place, and the head's
visit must end before the decoder layers' backward begins (where a checkpointed step peaks).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from finetune.config.schema import build_recipe
from finetune.errors import ConfigError
from finetune.memory.host_tables import HostTables
from finetune.trainer import Trainer
from tests.conftest import build_tiny_llama


def recipe(recipe_dict, out, embeddings, **memory):
    data = json.loads(json.dumps(recipe_dict))
    data.update(output_dir=str(out), report={"plot": False}, quant={"bits": 4})
    data["train"].update(max_steps=3, grad_accum=2, batch_size=2)
    data["lora"]["dropout"] = 0.1  # dropout masks must be drawn alike too
    data["data"]["train_on"] = "all"  # ~100 targets a micro-batch: several chunks of 16
    data["memory"] = {"activation_checkpointing": "all", "embeddings": embeddings, **memory}
    return build_recipe(data)


def trained(cfg) -> tuple[list[float], dict[str, torch.Tensor], Trainer]:
    trainer = Trainer(cfg, progress=False)
    trainer.train()
    rows = [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    adapter = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}
    return [r["loss"] for r in rows if "loss" in r], adapter, trainer


@pytest.mark.parametrize("loss", ["chunked", "full"])
def test_tables_in_host_ram_train_bitwise_like_tables_in_place(recipe_dict, tmp_path, loss, capsys, monkeypatch):
    # chunked with chunks of 8 targets: the head is called once per chunk in forward and again per
    # chunk in backward; one visit (copy) per micro-batch serves them all. The visit is a real copy here (on a
    # CPU device .to() would hand back the store itself, equal by construction).
    monkeypatch.setattr(HostTables, "copy_on_host", True)
    knobs = {"loss": loss, "loss_chunk": 16}
    ref_losses, ref_adapter, _ = trained(recipe(recipe_dict, tmp_path / "device", "device", **knobs))
    losses, adapter, trainer = trained(recipe(recipe_dict, tmp_path / "cpu", "cpu", **knobs))
    tables = find_tables(trainer)
    assert tables.visits >= 6  # at least one per micro-batch (3 steps x 2)
    with torch.no_grad():
        trainer.model.get_base_model().get_output_embeddings()(torch.zeros(1, tables._store.shape[1]))
    assert tables.visit.data_ptr() != tables._store.data_ptr() and torch.equal(tables.visit, tables._store)
    assert losses == ref_losses and len(losses) == 3
    assert adapter.keys() == ref_adapter.keys()
    for name in adapter:
        assert torch.equal(adapter[name], ref_adapter[name]), name
    if loss == "chunked":
        assert trainer.loss_fn.chunked_batches == 6
    base = trainer.model.get_base_model()
    assert base.get_input_embeddings().weight.device.type == "cpu"
    out = capsys.readouterr().out
    assert "memory: 53.0 KiB of frozen vocabulary tables live in host RAM; the LM head visits cpu for the loss" in out, out


def test_the_head_visits_for_the_loss_and_leaves_before_the_decoder_backward(recipe_dict, tmp_path):
    cfg = recipe(recipe_dict, tmp_path / "r", "cpu", loss="chunked", loss_chunk=16)
    trainer = Trainer(cfg, progress=False)
    trainer.setup()
    base = trainer.model.get_base_model()
    head = base.get_output_embeddings()
    tables = find_tables(trainer)
    at_head, at_layers = [], []
    head.register_forward_hook(lambda m, i, o: at_head.append(tables.visit is not None))

    def layer_output_hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.requires_grad:
            hidden.register_hook(lambda g: at_layers.append((tables.visit is None, tables.pending)))

    for layer in base.model.layers:
        layer.register_forward_hook(layer_output_hook)
    tables.visit = None
    before = tables.visits
    batch = trainer.step_batches(0)[0]
    loss, n = trainer.compute_loss(trainer.model, batch)
    targets = n
    assert tables.visit is not None and tables.pending == -(-targets // 16)  # one pending input per chunk
    loss.backward()
    assert tables.visits - before == 1  # one copy for every chunk, forward and recomputation
    assert at_head and all(at_head)
    # Every decoder layer's output gradient (forward order: the first layer's hook is the last to fire)
    # arrives with the head gone and nothing pending.
    assert len(at_layers) >= len(base.model.layers) and all(gone and pending == 0 for gone, pending in at_layers)
    assert tables.visit is None


def find_tables(trainer) -> HostTables:
    head = trainer.model.get_base_model().get_output_embeddings()
    found = [c.cell_contents for c in head.forward.__closure__ or () if isinstance(c.cell_contents, HostTables)]
    assert len(found) == 1
    return found[0]


def test_a_loss_dropped_without_backward_does_not_keep_the_head(recipe_dict, tmp_path):
    # A user's loss_fn or an exception mid-step can drop a graph unused: its head inputs are freed
    # with it, and the visit must not stay on the device for the rest of the run.
    import gc

    trainer = Trainer(recipe(recipe_dict, tmp_path / "r", "cpu", loss="chunked", loss_chunk=16), progress=False)
    trainer.setup()
    tables = find_tables(trainer)
    batch = trainer.step_batches(0)[0]
    loss, _ = trainer.compute_loss(trainer.model, batch)
    assert tables.pending > 1 and tables.visit is not None
    del loss
    gc.collect()
    assert tables.pending == 0 and tables.visit is None
    loss, _ = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    assert tables.pending == 0 and tables.visit is None


def test_after_a_model_to_the_tables_are_their_host_stores_again(recipe_dict, tmp_path):
    # accelerate moves a 16-bit model with .to(device): the tables come back as copies. The next
    # forward points them at their stores again (a copy kept alongside would double the host RAM).
    trainer = Trainer(recipe(recipe_dict, tmp_path / "r", "cpu"), progress=False)
    trainer.setup()
    tables, base = find_tables(trainer), trainer.model.get_base_model()
    embed, head = base.get_input_embeddings(), base.get_output_embeddings()
    stores = (tables._embed_store.data_ptr(), tables._store.data_ptr())
    assert (embed.weight.data_ptr(), head.weight.data_ptr()) == stores
    embed.weight.data, head.weight.data = embed.weight.data.clone(), head.weight.data.clone()  # what .to() leaves
    trainer.compute_loss(trainer.model, trainer.step_batches(0)[0])
    assert (embed.weight.data_ptr(), head.weight.data_ptr()) == stores


def test_the_compute_device_is_the_first_parameter_not_in_host_ram():
    from finetune.model.load import compute_device

    model = torch.nn.Sequential(torch.nn.Embedding(4, 2), torch.nn.Linear(2, 2, device="meta"))
    assert compute_device(model) == torch.device("meta")  # model.device would say cpu
    assert compute_device(torch.nn.Linear(2, 2)) == torch.device("cpu")


def test_a_tied_table_is_looked_up_and_visits_alike(recipe_dict, tmp_path):
    tied = tmp_path / "tied_model"
    shutil.copytree(recipe_dict["model"]["path"], tied)
    from transformers import AutoTokenizer

    build_tiny_llama(tied, vocab_size=len(AutoTokenizer.from_pretrained(tied)), tied=True)
    data = {**recipe_dict, "model": {"path": str(tied)}}
    ref_losses, ref_adapter, _ = trained(recipe(data, tmp_path / "device", "device"))
    losses, adapter, trainer = trained(recipe(data, tmp_path / "cpu", "cpu"))
    base = trainer.model.get_base_model()
    assert base.get_output_embeddings().weight is base.get_input_embeddings().weight
    assert losses == ref_losses and all(torch.equal(adapter[k], ref_adapter[k]) for k in adapter)


def test_tables_that_train_or_are_sharded_are_refused(recipe_dict, tmp_path):
    data = json.loads(json.dumps(recipe_dict))
    data.update(output_dir=str(tmp_path / "r"), lora=None, memory={"embeddings": "cpu"})
    with pytest.raises(ConfigError) as err:
        build_recipe(data)
    assert "memory.embeddings=cpu keeps frozen tables in host RAM; with full fine-tuning (lora: null) they train" in str(
        err.value
    )
    data = json.loads(json.dumps(recipe_dict))
    data.update(output_dir=str(tmp_path / "r"), quant={"bits": 4}, distributed={"strategy": "fsdp"}, memory={"embeddings": "cpu"})
    with pytest.raises(ConfigError) as err:
        build_recipe(data)
    assert "distributed.strategy=fsdp shards the vocabulary tables itself" in str(err.value)
    data["distributed"], data["memory"]["loss"] = {"strategy": "ddp"}, "liger"
    with pytest.raises(ConfigError) as err:
        build_recipe(data)
    assert "memory.loss=liger hands the head's whole weight to its kernel" in str(err.value)
    data["memory"]["loss"] = "auto"
    data["distributed"] = {"strategy": "deepspeed"}
    with pytest.raises(ConfigError) as err:
        build_recipe(data)
    assert "memory.embeddings=cpu keeps the vocabulary tables in one process's host RAM" in str(err.value)

    model = torch.nn.Module()
    model.embed, model.head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)
    model.get_input_embeddings = lambda: model.embed
    model.get_output_embeddings = lambda: model.head
    model.embed.weight.requires_grad_(False)
    with pytest.raises(ConfigError) as err:
        HostTables.attach(model, torch.device("cpu"))  # the head trains
    assert "but the LM head train here" in str(err.value) and "memory.embeddings=device" in str(err.value)


def test_ddp_is_told_to_leave_the_parked_tables_alone(recipe_dict, tmp_path):
    trainer = Trainer(recipe(recipe_dict, tmp_path / "r", "cpu"), progress=False)
    trainer.setup()
    model = trainer.model
    ignored = set(model._ddp_params_and_buffers_to_ignore)
    named = dict(model.named_parameters())
    base = model.get_base_model()
    parked = {n for n, p in named.items() if p is base.get_input_embeddings().weight or p is base.get_output_embeddings().weight}
    assert parked and parked <= ignored and all(not named[n].requires_grad for n in ignored if n in named)


# --------------------------------------------------------------------------- the planner's terms and the targets

LLAMA_31_8B = str(Path(__file__).parent / "fixtures" / "configs" / "llama-3.1-8b")
GiB = 2**30


def test_the_planner_moves_both_tables_to_host_ram_and_the_head_visits_for_the_loss():
    from finetune.config.schema import load_recipe
    from finetune.gpus import find_gpu
    from finetune.plan import plan_recipe

    gpu = find_gpu("rtx4090", None)
    base = ["model.path=" + LLAMA_31_8B, "data.path=unused.jsonl", "memory.activation_offload=false"]
    device = plan_recipe(load_recipe("qlora-1x24gb", base + ["memory.embeddings=device"]), gpu)
    host = plan_recipe(load_recipe("qlora-1x24gb", base + ["memory.embeddings=cpu"]), gpu)
    table = 128_256 * 4096 * 2  # bf16, untied: the embedding table and the head are each this
    c = lambda e, key: e.component(key)  # noqa: E731
    assert c(device, "weights_unquantized") - c(host, "weights_unquantized") == 2 * table
    assert c(host, "head_visit") == table and c(device, "head_visit") == 0
    # The head is on the GPU at the end of forward (the loss phase), neither table during a layer's backward.
    cuda = {"allocator_slack", "cuda_context"}
    loss_only, backward_only = (
        {"logits_loss", "final_norm", "head_visit"},
        {"recompute_layer", "backward_working", "dequant_buffer"},
    )
    phase = lambda e, leave: sum(x.bytes for x in e.components if x.key not in cuda | leave)  # noqa: E731
    assert phase(device, backward_only) - phase(host, backward_only) == table
    assert phase(device, loss_only) - phase(host, loss_only) == 2 * table
    assert host.peak_allocated_bytes == max(phase(host, backward_only), phase(host, loss_only))
    assert host.host_ram_parts["vocab_tables"] == table + 2**30  # the head's pinned store: a power-of-two block
    # One visit and the looked-up rows (2 x 2048 x 4096 bf16) cross per micro-batch, with nothing to hide them.
    per_micro = (table + 2 * 2048 * 4096 * 2) / (gpu.pcie_gbps * 1e9)
    assert host.step_time_s - device.step_time_s == pytest.approx(8 * per_micro, rel=1e-9)


def test_qlora_1x24gb_plans_under_7_gib_with_both_offloads_and_the_long_context_recipe_over_100k_tokens():
    from finetune.config.schema import load_recipe
    from finetune.gpus import find_gpu
    from finetune.plan import longest_trainable_seq, plan_recipe

    gpu = find_gpu("rtx4090", None)
    model = ["model.path=" + LLAMA_31_8B, "data.path=unused.jsonl"]
    # Issue 12's target: 2 x 2048 under 7 GiB with the levers on (the recipe ships them off since an H100
    # measured them 1.47x slower: it has room to spare without them).
    levers = ["memory.activation_offload=true", "memory.embeddings=cpu"]
    short = plan_recipe(load_recipe("qlora-1x24gb", model + levers), gpu)
    assert (short.setup.batch_size, short.setup.seq_len) == (2, 2048)
    assert short.peak_bytes <= 7.0 * GiB
    shipped = plan_recipe(load_recipe("qlora-1x24gb", model), gpu)
    assert shipped.peak_bytes <= 0.5 * gpu.memory_bytes
    recipe = Path(__file__).parents[1] / "recipes" / "qlora-longctx-1x24gb.yaml"
    long_cfg = load_recipe(str(recipe), model)
    long = plan_recipe(long_cfg, gpu)
    assert long.setup.seq_len == 131_072 and long.setup.batch_size == 1
    assert long.peak_bytes <= 0.9 * gpu.memory_bytes
    assert f"{long.peak_bytes / GiB:.2f} GiB peak" in recipe.read_text()  # the header says what the planner says
    assert longest_trainable_seq(long_cfg, gpu).as_written >= 100_000


def test_with_streamed_base_weights_too_the_run_is_bitwise_the_same(recipe_dict, tmp_path):
    # qlora-longctx-1x24gb streams the 4-bit layers as well: the tables attach after the stream
    # (whose model.to(device) would otherwise bring them back).
    ref_losses, ref_adapter, _ = trained(recipe(recipe_dict, tmp_path / "device", "device"))
    losses, adapter, trainer = trained(recipe(recipe_dict, tmp_path / "both", "cpu", base_weights="cpu"))
    assert trainer.memory.stream is not None and trainer.memory.stream.loads > 0
    assert losses == ref_losses and all(torch.equal(adapter[k], ref_adapter[k]) for k in adapter)


def test_the_search_never_proposes_tables_in_host_ram_to_a_liger_recipe_and_fp32_terms_stay_positive():
    from finetune.config.schema import load_recipe
    from finetune.gpus import find_gpu
    from finetune.plan import RecipeFacts, estimate, plan_recipe, read_model_shape
    from finetune.plan.fitting import candidates
    from finetune.plan.recipe import setup_of

    base = ["model.path=" + LLAMA_31_8B, "data.path=unused.jsonl", "memory.embeddings=device", "memory.loss=liger"]
    cfg = load_recipe("qlora-1x24gb", base)
    shape, recipe = read_model_shape(LLAMA_31_8B), RecipeFacts.from_config(cfg, "bf16")
    tried = candidates(setup_of(cfg), 1, recipe)
    assert tried and not any(s.embeddings == "cpu" for s in tried)  # declarations/techniques refuses liger + cpu tables
    assert any(s.embeddings == "cpu" for s in candidates(setup_of(load_recipe("qlora-1x24gb", base[:3])), 1, recipe))
    # fp32 without checkpointing: only an MLP tile is rebuilt in backward, never a negative term.
    fp32 = load_recipe("qlora-1x24gb", base[:3] + ["memory.activation_checkpointing=none", "precision=fp32"])
    e = estimate(shape, RecipeFacts.from_config(fp32, "fp32"), setup_of(fp32), find_gpu("rtx4090", None))
    assert e.component("recompute_layer") == 0 and plan_recipe(fp32, None).component("recompute_layer") == 0
