"""python benchmarks/step_profile.py [--recipe demo-cpu] [--steps 3] [--out FILE.json] [recipe overrides ...]

Where a training step's time goes, by part (issue 48: what a fast QLoRA path must shrink): 4-bit dequantization,
the base layers' matmuls, LoRA, attention, norms/rope/activations/elementwise, the loss (head and cross-entropy), the
optimizer, other ops, and the rest of the step's wall time (Python and launch overhead). The recipe's own steps run
through finetune's Trainer under torch.profiler, after one warm-up step; each op's self time goes to the part of the
module it ran in (forward hooks open a labelled range around the LoRA adapters, the 4-bit base layers, attention, the
decoder's other modules and the head), and each backward op to the part of the forward op that made its autograd node
(the profiler's sequence numbers): so LoRA's backward is LoRA's, whatever order autograd runs it in. Ops named
dequantize are dequantization wherever they run; cross-entropy's are the loss's.

On a CPU the times are the ops' self CPU time; on a GPU their kernels' time (self device time), and the overhead is
the wall time the GPU was not busy with any op's kernels (Python, launches, synchronizations). The same script runs on
both; the table is printed and, with --out, saved as JSON (benchmarks/README.md quotes the CPU's).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from torch.autograd.profiler import record_function

PREFIX = "ft:"  # our labelled ranges among the profiler's events
PARTS = (
    "4-bit dequantization",
    "base matmuls",
    "LoRA",
    "attention",
    "norms, rope, activations, elementwise",
    "loss (head + cross-entropy)",
    "optimizer",
    "other ops",
)
OVERHEAD = "Python and launch overhead"
SCOPE_PARTS = {
    "base": "base matmuls",
    "lora": "LoRA",
    "attention": "attention",
    "layer": PARTS[4],
    "head": PARTS[5],
    "optimizer": "optimizer",
}
# finetune's own ranges inside one autograd node (model/fast_lora.py's fused LoRA over a 4-bit linear): forward and
# backward, they name the part of what runs inside them.
LIBRARY_SCOPES = {"finetune.fast_lora.base": "base", "finetune.fast_lora.adapter": "lora"}
LOSS_OPS = re.compile(r"cross_entropy|log_softmax|nll_loss")


def scope_of(module_name: str, module: torch.nn.Module) -> str | None:
    """The label of a module's range (the innermost labelled module an op runs in names its part), or None."""
    kind = type(module).__name__
    last = module_name.rsplit(".", 1)[-1]
    if hasattr(module, "lora_A"):  # peft's LoRA wrapper (of any base kind): its own ops (casts, the sum) are LoRA's
        return "lora"
    if re.fullmatch(r"lora_(A|B|dropout|embedding_A|embedding_B|magnitude_vector)", last.split(".")[0]) or (
        module_name.split(".")[-2:-1] and module_name.split(".")[-2] in ("lora_A", "lora_B", "lora_dropout")
    ):
        return "lora"
    if kind in ("Linear4bit", "Linear8bitLt") or last == "base_layer":
        return "base"
    if last in ("self_attn", "attention"):
        return "attention"
    if last == "lm_head":
        return "head"
    if re.search(r"(^|\.)(layers\.\d+|embed_tokens|norm|rotary_emb)$", module_name):  # a decoder layer's other modules
        return "layer"
    return None


class Labelled:
    """Forward and backward ranges around the labelled modules of a model; remove() takes them off."""

    def __init__(self, model: torch.nn.Module):
        self.handles: list[Any] = []
        for name, module in model.named_modules():
            label = scope_of(name, module)
            if label is not None:
                self.handles += _ranged(module, label)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _ranged(module: torch.nn.Module, label: str) -> list[Any]:
    open_ranges: list[Any] = []

    def enter(*_: Any) -> None:
        r = record_function(PREFIX + label)
        r.__enter__()
        open_ranges.append(r)

    def leave(*_: Any) -> None:
        if open_ranges:
            open_ranges.pop().__exit__(None, None, None)

    return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]


def parts_of(events: Iterable[Any], device: bool) -> tuple[dict[str, float], dict[str, list[str]]]:
    """(seconds by part, op names by part) of profiler events: each op's self time (device: its kernels') goes to the part
    its labelled range names, or for a backward op, the part of the forward op with its autograd sequence number."""
    events = list(events)
    by_seq: dict[int, str] = {}
    for e in events:  # forward ops first (they made the sequence numbers): the outermost op of each number
        if e.sequence_nr >= 0 and e.fwd_thread == 0 and not e.name.startswith("autograd::") and e.sequence_nr not in by_seq:
            if not _in_backward(e):
                by_seq[e.sequence_nr] = _forward_part(e)
    seconds: dict[str, float] = defaultdict(float)
    names: dict[str, list[str]] = defaultdict(list)
    for e in events:
        if e.name.startswith(PREFIX) or e.name in LIBRARY_SCOPES:
            continue  # a range's own time is Python between ops: the overhead
        spent = (e.self_device_time_total if device else e.self_cpu_time_total) / 1e6
        part = _part(e, by_seq)
        seconds[part] += spent
        names[part].append(e.name)
    return dict(seconds), dict(names)


def _in_backward(e: Any) -> bool:
    while e is not None:
        if e.name.startswith("autograd::engine::evaluate_function"):
            return True
        e = e.cpu_parent
    return False


def _forward_part(e: Any) -> str:
    if "dequantize" in e.name:
        return PARTS[0]
    if LOSS_OPS.search(e.name):
        return PARTS[5]
    return SCOPE_PARTS.get(_nearest_scope(e) or "", "other ops")


def _part(e: Any, by_seq: dict[int, str]) -> str:
    if "dequantize" in e.name:
        return PARTS[0]
    node = e
    while node is not None:  # a backward op: the part of the forward op whose autograd node it runs
        if node.name in LIBRARY_SCOPES:  # unless a range of ours inside that node names it
            return SCOPE_PARTS[LIBRARY_SCOPES[node.name]]
        if node.name.startswith("autograd::engine::evaluate_function") and node.sequence_nr in by_seq:
            return by_seq[node.sequence_nr]
        node = node.cpu_parent
    return _forward_part(e)


def _nearest_scope(e: Any) -> str | None:
    node = e.cpu_parent
    while node is not None:
        if node.name.startswith(PREFIX):
            return node.name[len(PREFIX) :]
        if node.name in LIBRARY_SCOPES:
            return LIBRARY_SCOPES[node.name]
        node = node.cpu_parent
    return None


def table(seconds: dict[str, float], wall: float) -> list[tuple[str, float, float]]:
    """(part, seconds, share of the wall time) of every part, the overhead last: the wall time no op accounts for."""
    rows = [(p, seconds.get(p, 0.0)) for p in PARTS]
    rows.append((OVERHEAD, max(0.0, wall - sum(s for _, s in rows))))
    return [(p, s, s / wall if wall else 0.0) for p, s in rows]


def profile_steps(trainer: Any, steps: int) -> tuple[dict[str, float], float]:
    """The trainer's steps 1..steps (step 0 warms up) under torch.profiler: (seconds by part, wall seconds)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = trainer.accelerator.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    labelled = Labelled(trainer.model)
    _one_step(trainer, 0)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for step in range(1, steps + 1):
            _one_step(trainer, step)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    labelled.remove()
    seconds, _ = parts_of(prof.events(), device=cuda)
    return seconds, wall


def _one_step(trainer: Any, step: int) -> None:
    trainer.accumulate_gradients(step)
    with record_function(PREFIX + "optimizer"):
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)


def main() -> None:
    from finetune.config.schema import load_recipe
    from finetune.trainer import Trainer

    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="demo-cpu")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_recipe(args.recipe, ["output_dir=/tmp/step_profile", "overwrite=true", *args.overrides])
    trainer = Trainer(cfg, progress=False)
    trainer.setup()
    seconds, wall = profile_steps(trainer, args.steps)
    device = trainer.accelerator.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"{args.recipe} {' '.join(args.overrides)}: {args.steps} steps, {wall:.2f} s ({wall / args.steps:.3f} s a step), {name}"
    )
    rows = table(seconds, wall)
    for part, s, share in rows:
        print(f"  {part:<40} {s / args.steps:9.4f} s/step  {share:6.1%}")
    if args.out:
        record = {
            "recipe": args.recipe,
            "overrides": args.overrides,
            "device": name,
            "precision": trainer.precision,
            "steps": args.steps,
            "wall_s": wall,
            "parts_s": {p: s for p, s, _ in rows},
            "shares": {p: share for p, _, share in rows},
        }
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
