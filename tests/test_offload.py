"""memory.*: streamed base weights, activation offload and the host optimizer change nothing but where bytes wait."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import weakref
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import pytest
import torch
from conftest import build_char_tokenizer, build_tiny_llama
from safetensors.torch import load_file

from finetune.config.schema import build_recipe
from finetune.errors import ConfigError
from finetune.memory import apply
from finetune.memory.activation_disk import ParkingFiles
from finetune.memory.activation_offload import ActivationOffload, offloaded_checkpoint
from finetune.memory.optimizer_offload import HostAdamW
from finetune.memory.stream import in_backward, streamable_weights
from finetune.metrics import read_metrics
from finetune.model.load import decoder_layers
from finetune.trainer import Trainer

LAYERS = 4
EXACT = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def four_layer_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny4")
    tok = build_char_tokenizer(d)
    build_tiny_llama(d, vocab_size=len(tok), layers=LAYERS)
    return d


def recipe(recipe_dict, model_dir, out, quant, **memory):
    data = json.loads(json.dumps(recipe_dict))
    data["model"]["path"] = str(model_dir)
    data["output_dir"] = str(out)
    data["quant"] = {"bits": quant}
    data["lora"]["dropout"] = 0.1  # the recomputation must replay dropout exactly
    data["train"].update(max_steps=3, batch_size=2, grad_accum=2)
    data["memory"] = {"activation_checkpointing": "all", **memory}
    return build_recipe(data)


def run(cfg):
    trainer = Trainer(cfg, progress=False)
    result = trainer.train()
    losses = [r["loss"] for r in read_metrics(result.metrics_path) if "loss" in r]
    adapter = load_file(str(result.output_dir / "adapter" / "adapter_model.safetensors"))
    return trainer, losses, adapter


@pytest.mark.parametrize("quant", [None, 4], ids=["lora", "qlora"])
def test_streamed_base_weights_train_exactly_like_resident_ones(recipe_dict, four_layer_model, tmp_path, quant):
    _, ref_losses, ref_adapter = run(recipe(recipe_dict, four_layer_model, tmp_path / "device", quant))
    for mode in ("cpu", "disk"):
        extra = {"offload_dir": str(tmp_path / "nvme")} if mode == "disk" else {}
        trainer, losses, adapter = run(recipe(recipe_dict, four_layer_model, tmp_path / mode, quant, base_weights=mode, **extra))
        # The same kernels on the same bytes: on the CPU equal, not merely close (CUDA may
        # pick other GEMM algorithms for other memory addresses: close there).
        assert adapter.keys() == ref_adapter.keys() and len(adapter) == LAYERS * 7 * 2
        if EXACT:
            assert losses == ref_losses, mode
            for name in adapter:
                assert torch.equal(adapter[name], ref_adapter[name]), (mode, name)
        else:
            assert losses == pytest.approx(ref_losses, rel=1e-4)
        stream = trainer.memory.stream
        # Every streamed weight is a frozen linear weight of a decoder layer: 7 per Llama layer.
        assert [len(layer) for layer in stream.streamed] == [7] * LAYERS
        # Between steps no layer is resident: every streamed parameter holds no bytes.
        assert not stream.resident
        assert all(s.param.numel() == 0 for layer in stream.streamed for s in layer)
        # 3 steps x 2 micro-batches x (forward + recomputation) x 4 layers, plus the exact-match-free
        # run has no eval: each layer copied exactly twice per micro-batch.
        assert stream.loads == 3 * 2 * 2 * LAYERS
        assert 2 <= stream.max_resident <= 3
        if mode == "disk":
            # 4-bit weights went to the file while from_pretrained quantized them; 16-bit ones after.
            assert stream.captured_while_loading == (LAYERS * 7 if quant == 4 else 0)
            store = stream.store
            assert store.parent == tmp_path / "nvme" and store.is_file()
            assert store.stat().st_size >= stream.streamed_bytes  # page-aligned tensors, no header
            trainer.close()
            assert not store.exists()


def test_the_layers_kept_on_the_device_are_spread_and_some_must_stream():
    from finetune.memory.stream import stream_kept

    assert stream_kept(4, 2) == {1, 3} and stream_kept(80, 1) == {40} and stream_kept(5, 4) == {0, 1, 3, 4}
    assert stream_kept(80, 0) == set()
    with pytest.raises(ConfigError, match="memory.device_layers=4: the model has 4 decoder layers"):
        stream_kept(4, 4)


def test_layers_kept_on_the_device_train_like_streamed_ones_and_only_the_rest_streams(recipe_dict, four_layer_model, tmp_path):
    # memory.device_layers: 2 of the 4 layers keep their weights where they are (spread: layers 1 and 3), 2 stream.
    _, ref_losses, ref_adapter = run(recipe(recipe_dict, four_layer_model, tmp_path / "device", 4))
    # disk: every 4-bit weight goes to the file while loading; the kept layers' come back out of it (the tensor-
    # parallel e2e test streams from cpu with a kept layer)
    nvme = str(tmp_path / "nvme")
    cfg = recipe(recipe_dict, four_layer_model, tmp_path / "disk", 4, base_weights="disk", device_layers=2, offload_dir=nvme)
    trainer, losses, adapter = run(cfg)
    assert losses == ref_losses and all(torch.equal(adapter[n], ref_adapter[n]) for n in ref_adapter)
    stream = trainer.memory.stream
    streamed = {id(layer) for layer in stream.layers}
    every = decoder_layers(trainer.model, "test", "test")
    assert [i for i, layer in enumerate(every) if id(layer) in streamed] == [0, 2]
    for i in (1, 3):  # the kept layers' 4-bit weights hold their bytes, on the device
        assert all(w.numel() > 0 for w in streamable_weights(every[i])), i
    assert stream.loads == 3 * 2 * 2 * 2  # steps x micro-batches x (forward + recomputation) x streamed layers
    assert stream.captured_while_loading == 4 * 7  # every layer's, the kept ones' given back
    trainer.close()


def test_disk_with_dora_trains_like_resident_weights(recipe_dict, four_layer_model, tmp_path):
    # DoRA reads every 4-bit base weight when it wraps the model, so disk mode does not
    # capture them while loading (they would be empty by then); it stores them after.
    def dora(out, **memory):
        cfg = recipe(recipe_dict, four_layer_model, tmp_path / out, 4, **memory)
        return cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"dora": True})})

    _, ref_losses, ref_adapter = run(dora("device"))
    trainer, losses, adapter = run(dora("disk", base_weights="disk", offload_dir=str(tmp_path / "nvme")))
    assert trainer.memory.stream.captured_while_loading == 0 and trainer.memory.stream.streamed_bytes > 0
    assert adapter.keys() == ref_adapter.keys() and len(adapter) > 0
    if EXACT:  # the CPU: the same kernels on the same bytes
        assert losses == ref_losses
        assert all(torch.equal(adapter[k], ref_adapter[k]) for k in ref_adapter)
    else:  # CUDA may pick other GEMM algorithms for other addresses: close, DoRA's magnitudes included
        assert losses == pytest.approx(ref_losses, rel=1e-4)
        assert all(torch.allclose(adapter[k], ref_adapter[k], rtol=1e-3, atol=1e-5) for k in ref_adapter)
    trainer.close()


def test_a_failed_load_deletes_the_disk_file(recipe_dict, four_layer_model, tmp_path):
    # The 4-bit weights are written while the model loads; a LoRA target that matches nothing
    # fails only after that. The file (tens of GB for a 70B) must not stay behind.
    from finetune.errors import FinetuneError

    cfg = recipe(recipe_dict, four_layer_model, tmp_path / "o", 4, base_weights="disk", offload_dir=str(tmp_path / "nvme"))
    cfg = cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"target": ["no_such_proj"]})})
    with pytest.raises(FinetuneError):
        Trainer(cfg, progress=False).setup()
    assert list((tmp_path / "nvme").iterdir()) == []


def test_captured_weights_outside_the_decoder_layers_get_their_bytes_back(four_layer_model, tmp_path):
    # capture() takes every 4-bit weight a model registers; a model with 4-bit projections
    # outside its decoder layers (Gemma 3n) must keep those resident, not empty.
    from transformers import AutoModelForCausalLM

    from finetune.memory.stream import DiskStore, WeightStream

    model = AutoModelForCausalLM.from_pretrained(four_layer_model, dtype=torch.float32)
    for p in model.parameters():
        p.requires_grad_(False)
    outside = model.lm_head.weight
    expected = outside.detach().clone()
    store = DiskStore(tmp_path)
    store.add(outside)  # as capture() would have
    assert outside.numel() == 0
    stream = WeightStream.attach(model, "disk", torch.device("cpu"), store=store)
    assert torch.equal(outside, expected)
    assert all(s.param is not outside for layer in stream.streamed for s in layer)
    stream.close()
    assert list(tmp_path.iterdir()) == []


def test_streaming_holds_at_most_three_layers_during_backward(recipe_dict, four_layer_model, tmp_path):
    cfg = recipe(recipe_dict, four_layer_model, tmp_path / "s", 4, base_weights="cpu")
    trainer = Trainer(cfg, progress=False)
    trainer.setup()
    stream = trainer.memory.stream
    seen = []
    for layer in stream.streamed:  # the last streamed weight of each layer (down_proj) about to run
        module = next(m for m in trainer.model.modules() if getattr(m, "weight", None) is layer[-1].param)
        module.register_forward_pre_hook(lambda m, a: seen.append(sorted(stream.resident)))
    trainer.model.train()  # from_pretrained leaves the layers in eval mode, where nothing is checkpointed
    trainer.accumulate_gradients(0)
    # Forward of micro-batch 1: layer i computing, i+1 prefetched; then the recomputation
    # runs 3, 2, 1, 0 keeping the layer whose backward follows.
    assert seen[:LAYERS] == [[0, 1], [1, 2], [2, 3], [3]]
    assert seen[LAYERS : 2 * LAYERS] == [[2, 3], [1, 2], [0, 1], [0]]
    assert not stream.resident


def test_activation_offload_moves_saved_tensors_and_keeps_gradients(recipe_dict, tmp_path):
    def grads(offload: bool):
        data = {**recipe_dict, "output_dir": str(tmp_path / f"o{offload}")}
        data["memory"] = {"activation_checkpointing": "none", "activation_offload": offload}
        trainer = Trainer(build_recipe(data), progress=False)
        trainer.setup()
        if offload:
            # On a CPU device the default is a no-op; copying anyway puts every saved tensor through the
            # GPU run's host buffers and copies (pinning and the side stream: tests/test_gpu.py only).
            trainer.memory.activations = ActivationOffload(trainer.accelerator.device, min_bytes=0, force_copy=True)
        trainer.model.train()
        trainer.accumulate_gradients(0)
        return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}, trainer

    plain, _ = grads(False)
    moved, trainer = grads(True)
    assert trainer.memory.activations.moved_tensors > 0 and trainer.memory.activations.moved_bytes > 0
    for name in plain:
        torch.testing.assert_close(moved[name], plain[name], **({"rtol": 0, "atol": 0} if EXACT else {}))


def test_activation_offload_moves_only_what_non_checkpointed_layers_save(recipe_dict, tmp_path):
    # A checkpointed layer keeps only its input, which takes its own path (checkpoint_bytes, below):
    # what the saved-tensor hooks move shrinks with every checkpointed layer.
    def moved(checkpointing):
        data = {**recipe_dict, "output_dir": str(tmp_path / f"o{checkpointing}")}
        data["memory"] = {"activation_checkpointing": checkpointing, "activation_offload": True}
        trainer = Trainer(build_recipe(data), progress=False)
        trainer.setup()
        trainer.memory.activations = ActivationOffload(trainer.accelerator.device, min_bytes=0, force_copy=True)
        trainer.model.train()
        trainer.accumulate_gradients(0)
        return trainer.memory.activations.moved_bytes

    none, every_2nd = moved("none"), moved(2)
    assert 0.45 * none < every_2nd < 0.65 * none  # half the layers (plus the head's share) keep theirs


def test_a_cpu_round_trip_copies_out_and_back():
    # force_copy on a CPU device runs the GPU path's host buffers and copies; only the pinning, the side
    # stream and its events need CUDA (tests/test_gpu.py). What comes back is what was saved, in storage
    # of its own: the device tensor may change (a GPU frees and reuses it) once it has been copied.
    saved = torch.arange(6.0).reshape(2, 3)
    offload = ActivationOffload(torch.device("cpu"), min_bytes=0, force_copy=True)
    packed = offload._pack(saved)
    saved.add_(100)
    back = offload._unpack(packed)
    assert torch.equal(back, torch.arange(6.0).reshape(2, 3)) and back.data_ptr() != saved.data_ptr()
    counting = ActivationOffload(torch.device("cpu"), min_bytes=0)  # the default on a CPU: counts, moves nothing
    assert counting._pack(saved) is saved and (counting.moved_tensors, counting.moved_bytes) == (1, 24)


def test_activation_offload_leaves_weights_and_small_tensors_alone():
    offload = ActivationOffload(torch.device("cpu"), min_bytes=1024, force_copy=True)
    weight = torch.nn.Parameter(torch.randn(64, 64))
    leaf = torch.randn(8, 64, requires_grad=True)
    with offload.saving():
        x = leaf * 2
        y = (x @ weight.t()).sum()  # saves x (2 KiB) and weight (a parameter)
        z = (leaf @ weight.t()).sum()  # saves leaf, which autograd holds anyway (its AccumulateGrad): no copy
    (y + z).backward()
    assert offload.moved_tensors == 1 and offload.moved_bytes == 8 * 64 * 4
    torch.testing.assert_close(leaf.grad, 3 * weight.detach().sum(0).expand(8, 64))


@pytest.mark.parametrize("where", ["host", "disk"])
def test_offloaded_checkpoints_free_each_input_and_bring_it_back_one_layer_ahead(where, tmp_path):
    # disk (activation_offload=disk): each input written to a file of its own by a thread, read back one layer
    # ahead of its recomputation (its copy to the device made when the recomputation asks), its file then removed.
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 16) for _ in range(4)]
    x = torch.randn(8, 16, requires_grad=True)

    def train(offload: ActivationOffload | None):
        calls: list[tuple[int, list[int]]] = []  # (layer, checkpoints back on the device) at each run of a layer

        def layer_fn(i):
            def run(t):
                calls.append((i, sorted(offload.waiting) if offload else []))
                return torch.tanh(layers[i](t))

            return run

        with offload.saving() if offload else nullcontext():
            inputs, h = [], x * 2  # not x: autograd holds a leaf that trains anyway (nothing to park)
            for i in range(4):
                inputs.append(weakref.ref(h))
                h = offloaded_checkpoint(layer_fn(i), h)
        alive = [r() is not None for r in inputs]
        x.grad = None
        for layer in layers:
            layer.zero_grad()
        h.pow(2).sum().backward()
        return alive, calls, [x.grad.clone()] + [p.grad.clone() for layer in layers for p in layer.parameters()]

    kept_alive, _, kept_grads = train(None)
    files = ParkingFiles(tmp_path) if where == "disk" else None
    offload = ActivationOffload(torch.device("cpu"), min_bytes=0, force_copy=True, files=files)
    alive, calls, grads = train(offload)
    if files is not None:  # every input went through its own file, and no file is left
        assert files.written_bytes == 4 * 8 * 16 * 4 and list(files.folder.iterdir()) == []
        files.discard()
        assert list(tmp_path.iterdir()) == []
    assert kept_alive == [True] * 4  # a plain checkpoint holds each layer's input until backward
    assert alive == [False] * 4  # parked in host RAM: the device copies are gone
    assert (offload.checkpoint_tensors, offload.checkpoint_bytes) == (4, 4 * 8 * 16 * 4)
    assert offload.moved_tensors == 0  # the inputs took the checkpoint path, not the saved-tensor hooks'
    # forward 0-3, then the recomputations 3-0: while layer i recomputes, layer i-1's input is on its way
    assert calls == [(0, []), (1, []), (2, []), (3, []), (3, [2]), (2, [1]), (1, [0]), (0, [])]
    assert (offload.prefetched, offload.fetched_late) == (3, 1) and not offload.waiting
    assert all(torch.equal(a, b) for a, b in zip(grads, kept_grads, strict=True))


def _chain(offload: ActivationOffload, layers, x):
    """A 4-layer stack of offloaded checkpoints (under offload.saving() by the caller)."""
    h = x * 2  # not x: autograd holds a leaf that trains anyway
    for layer in layers:
        h = offloaded_checkpoint(lambda t, layer=layer: torch.tanh(layer(t)), h)
    return h


@pytest.mark.parametrize("where", ["host", "disk"])
def test_micro_batches_under_one_saving_each_bring_back_only_their_own_inputs(where, tmp_path):
    # A pipeline holds one saving() over its whole schedule, so the checkpoint chain runs on from one micro-batch into
    # the next: the second's first checkpoint must not prefetch the first's last one, whose backward came before
    # (consumed: its file is gone, its copy would wait on the device unclaimed).
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 16) for _ in range(4)]
    xs = [torch.randn(8, 16, requires_grad=True) for _ in range(2)]
    files = ParkingFiles(tmp_path) if where == "disk" else None
    offload = ActivationOffload(torch.device("cpu"), min_bytes=0, force_copy=True, files=files)
    with offload.saving():
        outs = [_chain(offload, layers, x) for x in xs]
    for out in outs:  # 1F1B's order: the first micro-batch's backward first
        out.pow(2).sum().backward()
    assert not offload.waiting and (offload.prefetched, offload.fetched_late) == (2 * 3, 2)  # 4 parked each, 1 late
    grads = [x.grad.clone() for x in xs]
    for x in xs:
        x.grad = None
        _chain(offload, layers, x).pow(2).sum().backward()  # each alone: the same gradients
    assert all(torch.equal(g, x.grad) for g, x in zip(grads, xs, strict=True))
    if files is not None:
        assert list(files.folder.iterdir()) == []
        files.discard()


def test_a_forward_whose_backward_never_comes_leaves_no_file(tmp_path):
    # An out-of-memory retry drops a forward's graph: its parked inputs' files go with it.
    import gc

    files = ParkingFiles(tmp_path)
    offload = ActivationOffload(torch.device("cpu"), min_bytes=0, force_copy=True, files=files)
    with offload.saving():
        out = _chain(offload, [torch.nn.Linear(16, 16) for _ in range(4)], torch.randn(8, 16, requires_grad=True))
    assert files.written_bytes == 4 * 8 * 16 * 4
    del out
    gc.collect()
    files._pool.submit(lambda: None).result()  # the thread's queue: the writes, then the removals
    assert list(files.folder.iterdir()) == []
    files.discard()


def test_a_parked_file_that_cannot_be_written_or_read_says_where_and_what_to_do(tmp_path):
    import shutil

    from finetune.errors import TrainingError

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(TrainingError, match="cannot make a folder for the checkpointed inputs in .*a-file") as made:
        ParkingFiles(blocker)
    assert "memory.offload_dir" in str(made.value)
    files = ParkingFiles(tmp_path / "parking")
    files.wait_for_room()
    kept = files.put(torch.arange(8.0), None)
    assert torch.equal(kept.take(), torch.arange(8.0)) and not kept.path.exists()
    shutil.rmtree(files.folder)  # the disk gone from under the run: the next write fails, and says so when read
    files.wait_for_room()
    lost = files.put(torch.arange(1024.0), None)
    with pytest.raises(TrainingError) as said:
        lost.take()
    text = str(said.value)
    assert "memory.activation_offload=disk: writing a checkpointed layer's input (4,096 bytes)" in text
    assert str(lost.path) in text and "set memory.activation_offload=true (host RAM)" in text
    files.discard()
    with pytest.raises(RuntimeError, match="parking folder was discarded"):  # nothing waits forever after
        files.wait_for_room()


@pytest.mark.parametrize(
    "quant, memory",
    [(None, {}), (4, {}), (4, {"base_weights": "cpu"}), (4, {"activation_offload": "disk"})],
    ids=["lora", "qlora", "qlora-streamed", "qlora-on-disk"],
)
def test_offloaded_checkpoints_train_exactly_like_kept_ones(recipe_dict, four_layer_model, tmp_path, quant, memory, monkeypatch):
    _, ref_losses, ref_adapter = run(recipe(recipe_dict, four_layer_model, tmp_path / "kept", quant, **memory))
    # On a CPU device the default only counts; copying anyway takes the GPU run's round trip and prefetch
    # order, made at once and unpinned (the side stream and its events: tests/test_gpu.py only).
    monkeypatch.setattr(apply, "ActivationOffload", partial(ActivationOffload, min_bytes=0, force_copy=True))
    on_disk = {"offload_dir": str(tmp_path / "parking")} if memory.get("activation_offload") == "disk" else {}
    parked_run = recipe(
        recipe_dict, four_layer_model, tmp_path / "parked", quant, **{"activation_offload": True, **memory, **on_disk}
    )
    trainer, losses, adapter = run(parked_run)
    assert adapter.keys() == ref_adapter.keys() and len(adapter) == LAYERS * 7 * 2
    if EXACT:
        assert losses == ref_losses
        assert all(torch.equal(adapter[name], ref_adapter[name]) for name in adapter)
    else:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
    offload = trainer.memory.activations
    micro_batches = [b for step in range(3) for b in trainer.step_batches(step)]
    assert len(micro_batches) == 3 * 2
    # Each layer's input: (batch x seq) tokens x hidden 64 x fp32, every layer of every micro-batch but
    # the first layer (its input is the embeddings' output, a leaf autograd holds: nothing to free).
    tokens = sum(b["input_ids"].numel() for b in micro_batches)
    parked = LAYERS - 1
    assert (offload.checkpoint_tensors, offload.checkpoint_bytes) == (6 * parked, tokens * 64 * 4 * parked)
    # Each backward asks for its last layer's input (copied back then) and prefetches the others.
    assert (offload.prefetched, offload.fetched_late) == (6 * (parked - 1), 6) and not offload.waiting
    if on_disk:  # each of them through a file of its own, in the folder the recipe names; none left after
        assert offload.files.written_bytes == offload.checkpoint_bytes
        assert offload.files.folder.parent == tmp_path / "parking" and list(offload.files.folder.iterdir()) == []


def test_offloaded_checkpoints_leave_no_layer_input_on_the_device(recipe_dict, four_layer_model, tmp_path):
    def forward_then_backward(activation_offload: bool):
        cfg = recipe(
            recipe_dict, four_layer_model, tmp_path / f"o{activation_offload}", None, activation_offload=activation_offload
        )
        trainer = Trainer(cfg, progress=False)
        trainer.setup()
        trainer.model.train()
        offload = ActivationOffload(trainer.accelerator.device, min_bytes=0, force_copy=True)
        inputs, seen = [], []
        for i, layer in enumerate(decoder_layers(trainer.model)):
            layer.register_forward_pre_hook(lambda m, args: inputs.append(weakref.ref(args[0])))
            # The norm's hooks fire in the recomputation too (the layer's own do not: its forward is what is checkpointed).
            layer.input_layernorm.register_forward_pre_hook(
                lambda m, args, i=i: seen.append((i, sorted(offload.waiting))) if in_backward() else None
            )
        with offload.saving() if activation_offload else nullcontext():
            loss, _ = trainer.compute_loss(trainer.model, trainer.step_batches(0)[0])
        alive = [r() is not None for r in inputs]
        loss.backward()
        return alive, seen

    assert forward_then_backward(False) == ([True] * LAYERS, [(3, []), (2, []), (1, []), (0, [])])
    # Between forward and backward every layer's input is in host RAM only (but the first: the embeddings'
    # output, which autograd holds as a leaf that trains); backward brings the next one back while a
    # layer recomputes.
    alive, seen = forward_then_backward(True)
    assert alive == [True] + [False] * (LAYERS - 1)
    assert seen == [(3, [2]), (2, [1]), (1, []), (0, [])]


def test_host_adamw_steps_like_adamw_and_its_state_loads_into_plain_adamw():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    plain = torch.optim.AdamW(a, lr=1e-2, weight_decay=0.1)
    host = HostAdamW(b, lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(host, lambda s: 1.0 / (s + 1))
    sched_plain = torch.optim.lr_scheduler.LambdaLR(plain, lambda s: 1.0 / (s + 1))
    for _step in range(4):
        g = [torch.randn_like(p) for p in a]
        for p, q, gi in zip(a, b, g):
            p.grad, q.grad = gi.clone(), gi.clone()
        plain.step(), host.step(), sched.step(), sched_plain.step()
        for p, q in zip(a, b):
            torch.testing.assert_close(q, p, rtol=0, atol=0)
    # A checkpoint written with offload resumes without it (and back).
    again = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in a], lr=1.0)
    again.load_state_dict(host.state_dict())
    assert again.param_groups[0]["lr"] == plain.param_groups[0]["lr"]
    for i in range(2):
        torch.testing.assert_close(again.state[again.param_groups[0]["params"][i]]["exp_avg_sq"], plain.state[a[i]]["exp_avg_sq"])
    host2 = HostAdamW([torch.nn.Parameter(p.detach().clone()) for p in a], lr=1.0)
    host2.load_state_dict(plain.state_dict())
    assert host2.param_groups[0]["lr"] == plain.param_groups[0]["lr"]


def test_optimizer_offload_trains_like_the_plain_optimizer(recipe_dict, tmp_path):
    def losses(offload):
        data = {**recipe_dict, "output_dir": str(tmp_path / f"opt{offload}")}
        data["memory"] = {"activation_checkpointing": "none", "optimizer_offload": offload}
        trainer = Trainer(build_recipe(data), progress=False)
        result = trainer.train()
        built = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # inside accelerate's wrapper
        assert isinstance(built, HostAdamW) == offload, type(built)  # the technique acted (memory/apply.py's step)
        return [r["loss"] for r in read_metrics(result.metrics_path) if "loss" in r]

    assert losses(True) == (losses(False) if EXACT else pytest.approx(losses(False), rel=1e-5))


@pytest.mark.parametrize(
    "memory, extra, expected",
    [
        ({"base_weights": "cpu", "activation_checkpointing": "none"}, {}, "needs memory.activation_checkpointing=all"),
        ({"base_weights": "disk", "activation_checkpointing": 2}, {}, "needs memory.activation_checkpointing=all"),
        ({"base_weights": "cpu"}, {"quant": {"bits": 8}}, "Use quant.bits=4"),
        ({"base_weights": "cpu"}, {"distributed": {"strategy": "fsdp"}}, "Use distributed.cpu_offload=true for FSDP"),
        ({"offload_dir": "/nvme"}, {}, "memory.offload_dir is only used by memory.base_weights=disk and"),
        ({"activation_offload": "disk", "activation_checkpointing": "none"}, {}, "with activation_checkpointing=none no"),
        ({"activation_checkpointing": 0}, {}, "activation_checkpointing"),
    ],
)
def test_memory_rules_name_the_keys_and_the_fix(recipe_dict, memory, extra, expected):
    data = {**json.loads(json.dumps(recipe_dict)), **extra, "memory": memory}
    with pytest.raises(ConfigError) as err:
        build_recipe(data)
    assert expected in str(err.value)


@pytest.mark.slow
def test_disk_trains_a_model_whose_weights_dwarf_its_anonymous_memory(tmp_path):
    # base_weights=disk: the frozen layer weights live in a memory-mapped file (page cache,
    # reclaimable), not in the process's heap. A ~1.7 GB-of-weights model trains with a
    # fraction of that in anonymous RSS. Run by the benchmark's child process, which
    # samples RssAnon every 2 ms (no timing is asserted).
    out = tmp_path / "disk.json"
    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "offload.py"
    cmd = [
        sys.executable,
        str(bench),
        "--hidden",
        "2048",
        "--layers",
        "10",
        "--steps",
        "2",
        "--batch",
        "1",
        "--modes",
        "disk",
        "--out",
        str(out),
    ]
    # On the CPU device: a CUDA run's heap holds the CUDA runtime, and its weights go to the GPU.
    env = {**os.environ, "TMPDIR": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    weights = result["layer_weight_bytes_fp32"]
    disk = result["results"][0]
    assert weights > 1.5 * 2**30
    assert disk["streamed_bytes"] >= weights  # every layer linear went to the file (+ norms)
    trained_on = disk["rss_anon_train_peak"] - disk["rss_anon_baseline"]
    assert trained_on < weights / 3, f"{trained_on / 2**20:.0f} MiB of heap while training {weights / 2**20:.0f} MiB of weights"


def test_a_streaming_run_keeping_layers_loads_on_the_gpu_only_when_its_weights_fit_there(recipe_dict, monkeypatch):
    # trainer/build.load_device on a (stand-in) CUDA device: memory.device_layers loads where the kept layers stay when
    # the weights fit the free memory with 5% to spare (the streamed ones then move out), else in host RAM; what the
    # planner assumes too (plan/memory.streaming_loads_on_gpu). No GPU here: the device and its free memory are faked.
    from types import SimpleNamespace

    from finetune.plan.memory import LOAD_ON_GPU_MARGIN
    from finetune.plan.recipe import loaded_weight_bytes
    from finetune.trainer.build import load_device

    cfg = build_recipe({**recipe_dict, "memory": {"base_weights": "cpu", "device_layers": 1}})
    need = loaded_weight_bytes(cfg, "fp32")
    cuda, said = torch.device("cuda", 0), []
    parallel = SimpleNamespace(
        device=cuda, load_device=lambda streaming: torch.device("cpu") if streaming else cuda, every_rank=lambda *v: [v]
    )
    edge = need / (1 - LOAD_ON_GPU_MARGIN)  # 5% of the free memory kept free
    for free, where in ((int(edge) + 1, cuda), (int(edge) - 1, torch.device("cpu"))):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (free, 2 * free))
        assert load_device(cfg, "fp32", parallel, True, said.append) == where
    assert len(said) == 1 and "the model loads in host RAM first" in said[0]
    every = build_recipe({**recipe_dict, "memory": {"base_weights": "cpu"}})  # every layer streams: host RAM
    assert load_device(every, "fp32", parallel, True, said.append) == torch.device("cpu")


def test_keeping_every_layer_on_the_device_is_refused_before_a_weight_loads(recipe_dict):
    from finetune.runs.preflight import preflight

    cfg = build_recipe({**recipe_dict, "memory": {"base_weights": "cpu", "device_layers": 99}})
    report = preflight(cfg, memory_check=False)
    assert any("memory.device_layers=99: the model has 2 decoder layers, so none would stream" in p for p in report.problems)
    fine = build_recipe({**recipe_dict, "memory": {"base_weights": "cpu", "device_layers": 1}})
    assert not [p for p in preflight(fine, memory_check=False).problems if "device_layers" in p]
