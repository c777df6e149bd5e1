"""The memory model against measured allocations of real training steps on the CPU.

A Llama-shaped model is built from a config, loaded through the real path
(model.load.load_model: bitsandbytes NF4 + double quant, peft LoRA) and trained one
step by the real Trainer loss. Measured:
  weights      storage bytes of every parameter, buffer and quantization constant
  LoRA state   LoRA weights + their gradients + AdamW state after one optimizer step
  activations  bytes alive at the end of the model's forward that were allocated during it
               (a TorchDispatchMode sees every op's output storage, and a weakref says when it dies)
and each must be within 15% of `finetune.plan.estimate` for the same setup.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from finetune.config.schema import build_recipe
from finetune.model.load import enable_gradient_checkpointing, load_model
from finetune.plan import RecipeFacts, Setup, estimate, read_model_shape
from finetune.trainer import loss_sum_and_count

TOLERANCE = 0.15


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storages created by ops under this mode and still alive; and their peak."""

    def __init__(self, existing=()):
        super().__init__()
        self.live: dict[int, int] = {}
        self.peak = 0
        # Views of weights that existed before (a transposed parameter) are no new memory.
        self.existing = {t.untyped_storage().data_ptr() for t in existing}

    @property
    def now(self) -> int:
        return sum(self.live.values())

    def _track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in self.live or key in self.existing or st.nbytes() == 0:
            return
        self.live[key] = st.nbytes()
        weakref.finalize(st, self.live.pop, key, None)
        self.peak = max(self.peak, self.now)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self._track(t)
        return out


def build_model_dir(path, hidden, layers, vocab, heads=8, kv_heads=4, inter=None):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter or int(hidden * 2.6875),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        st = t.untyped_storage()
        if st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        total += st.nbytes()
    return total


def quant_state_tensors(model):
    for p in model.parameters():
        qs = getattr(p, "quant_state", None)
        if qs is None:
            continue
        yield qs.absmax
        if qs.nested:
            yield qs.state2.absmax
            yield qs.state2.code
            yield qs.offset
        else:
            yield qs.code


def trained_model(cfg):
    """The model as the trainer trains it: loaded, with memory.activation_checkpointing applied (memory/apply.py's
    first step; the other memory techniques these measurements turn on are applied by the test itself)."""
    torch.manual_seed(0)
    model = load_model(cfg, precision="fp32", device=torch.device("cpu"))
    if cfg.memory.checkpoint_every:
        enable_gradient_checkpointing(model, cfg.memory.checkpoint_every)
    return model


def measure(model_dir, tmp_path, *, checkpointing: bool, dropout: float, batch: int, seq: int, quant: int | None = 4):
    cfg = build_recipe(
        {
            "model": {"path": str(model_dir)},
            "data": {"path": "unused.jsonl", "max_seq_len": seq},
            "output_dir": str(tmp_path / "run"),
            "precision": "fp32",
            "quant": {"bits": quant},
            "lora": {"r": 8, "alpha": 16, "dropout": dropout},
            "train": {"batch_size": batch},
            "memory": {"activation_checkpointing": "all" if checkpointing else "none"},
        }
    )
    model = trained_model(cfg)
    model.train()
    lora = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    weights = storage_bytes(frozen) + storage_bytes(list(model.buffers())) + storage_bytes(quant_state_tensors(model))
    optimizer = torch.optim.AdamW(lora, lr=1e-3)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq))
    labels = ids.clone()  # every position a target: the planner's worst case

    tracker = LiveBytes(existing=[*model.parameters(), *model.buffers(), *quant_state_tensors(model)])
    with tracker:
        before = tracker.now
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
        logits_bytes = storage_bytes([out.logits])
        activations = tracker.now - before - logits_bytes
        loss, _ = loss_sum_and_count(out.logits, labels)
        del out
        loss.backward()
    optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values()]
    lora_state = storage_bytes(lora) + storage_bytes([p.grad for p in lora]) + storage_bytes(state)
    return cfg, {"weights": weights, "lora_state": lora_state, "activations": activations, "peak": tracker.peak}


def predict(cfg, batch, seq, checkpointing):
    shape = read_model_shape(cfg.model.path)
    recipe = RecipeFacts.from_config(cfg, "fp32", on_gpu=False)
    e = estimate(shape, recipe, Setup(batch_size=batch, grad_accum=1, seq_len=seq, checkpoint_every=int(checkpointing)), None)
    c = e.component
    return e, {
        "weights": c("weights_quantized") + c("quant_constants") + c("weights_unquantized"),
        "lora_state": c("lora_weights") + c("gradients") + c("optimizer_state"),
        # the final norm's fp32 input is saved by the forward too
        "activations": c("activations") + c("final_norm") + c("attention_mask"),
    }


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """A 'small' Llama: hidden 512, 4 layers, GQA 8/4 heads, 8k vocabulary (~23M parameters)."""
    return build_model_dir(tmp_path_factory.mktemp("small"), hidden=512, layers=4, vocab=8000)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A 'tiny' Llama: hidden 128, 2 layers, MHA 4 heads, 1k vocabulary."""
    return build_model_dir(tmp_path_factory.mktemp("tiny"), hidden=128, layers=2, vocab=1000, heads=4, kv_heads=4)


CASES = [
    # model, checkpointing, dropout, batch, seq
    ("small", False, 0.05, 2, 128),
    ("small", True, 0.05, 2, 128),
    ("small", False, 0.0, 1, 256),
    ("tiny", False, 0.05, 2, 64),
    ("tiny", True, 0.0, 4, 64),
]


@pytest.mark.parametrize("which, checkpointing, dropout, batch, seq", CASES)
def test_prediction_matches_measured_cpu_allocations(
    which, checkpointing, dropout, batch, seq, small_model, tiny_model, tmp_path
):
    model_dir = small_model if which == "small" else tiny_model
    cfg, measured = measure(model_dir, tmp_path, checkpointing=checkpointing, dropout=dropout, batch=batch, seq=seq)
    _, predicted = predict(cfg, batch, seq, checkpointing)
    for key in ("weights", "lora_state", "activations"):
        err = predicted[key] / measured[key] - 1
        assert abs(err) <= TOLERANCE, f"{key}: predicted {predicted[key]:,} measured {measured[key]:,} ({err:+.1%})"


if __name__ == "__main__":  # print the table of docs/plan.md: python tests/test_plan_measured.py
    import tempfile
    from pathlib import Path

    tmp = Path(tempfile.mkdtemp())
    dirs = {
        "small": build_model_dir(tmp / "small", hidden=512, layers=4, vocab=8000),
        "tiny": build_model_dir(tmp / "tiny", hidden=128, layers=2, vocab=1000, heads=4, kv_heads=4),
    }
    print("| model | checkpointing | LoRA dropout | batch x seq | what | measured | predicted | error |")
    print("|---|---|---|---|---|---|---|---|")
    for which, ck, dr, b, s in CASES:
        cfg, m = measure(dirs[which], tmp, checkpointing=ck, dropout=dr, batch=b, seq=s)
        _, p = predict(cfg, b, s, ck)
        for key in ("weights", "lora_state", "activations"):
            print(
                f"| {which} | {'on' if ck else 'off'} | {dr} | {b} x {s} | {key} | {m[key]:,} B | {p[key]:,} B | {100 * (p[key] / m[key] - 1):+.1f}% |"
            )


def measure_step_peak(model_dir, tmp_path, *, seq: int, tiles: int, chunk: int) -> tuple[int, int]:
    """(measured, predicted) bytes allocated at the peak of one step with the long-context levers:
    every layer checkpointed, the MLP in `tiles` tiles, the head and loss over chunks of `chunk`
    targets. Both count only what the step allocates (not the weights, LoRA weights, AdamW state)."""
    from finetune.memory.tiled_mlp import tile_mlps
    from finetune.trainer import CausalLMLoss

    memory = {"activation_checkpointing": "all", "tiled_mlp": tiles, "loss": "chunked", "loss_chunk": chunk}
    cfg = build_recipe(
        {
            "model": {"path": str(model_dir)},
            "data": {"path": "unused.jsonl", "max_seq_len": seq},
            "output_dir": str(tmp_path / "run"),
            "precision": "fp32",
            "quant": {"bits": 4},
            "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
            "train": {"batch_size": 1},
            "memory": memory,
        }
    )
    model = trained_model(cfg)
    assert tile_mlps(model, tiles) == model.config.num_hidden_layers
    model.train()
    loss_fn = CausalLMLoss(chunk_rows=chunk)
    loss_fn.checked = True  # the probe against the model's own logits is not part of a step
    ids = torch.randint(0, model.config.vocab_size, (1, seq))
    tracker = LiveBytes(existing=[*model.parameters(), *model.buffers(), *quant_state_tensors(model)])
    with tracker:
        loss, _ = loss_fn(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
        loss.backward()
    assert loss_fn.chunked_batches == 1

    shape = read_model_shape(cfg.model.path)
    recipe = RecipeFacts.from_config(cfg, "fp32", on_gpu=False)
    setup = Setup(batch_size=1, grad_accum=1, seq_len=seq, loss="chunked", loss_chunk=chunk, tiled_mlp=tiles)
    e = estimate(shape, recipe, setup, None)
    held = ("weights_quantized", "quant_constants", "weights_unquantized", "lora_weights", "optimizer_state")
    return tracker.peak, e.peak_allocated_bytes - sum(e.component(k) for k in held)


@pytest.mark.parametrize("seq, tiles, chunk", [(1024, 4, 128), (1024, 1, 128), (512, 8, 64)])
def test_long_context_step_peak_matches_measured_cpu_allocations(seq, tiles, chunk, small_model, tmp_path):
    # The planner's long-context terms together (one chunk of logits, one MLP tile in the layer
    # recomputed and in its backward gradients, the checkpointed inputs) against a real step.
    measured, predicted = measure_step_peak(small_model, tmp_path, seq=seq, tiles=tiles, chunk=chunk)
    err = predicted / measured - 1
    assert abs(err) <= TOLERANCE, f"step peak: predicted {predicted:,} measured {measured:,} ({err:+.1%})"
