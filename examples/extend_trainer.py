"""python examples/extend_trainer.py [OUTPUT_DIR]

Extend the Trainer from Python without subclassing it: a callback that stops early and
keeps its own log, your own optimizer and learning-rate schedule, and a run on a model
and records you already hold in memory (Trainer.from_parts: no recipe paths).
Runs on the CPU with the bundled tiny model in about a minute.
"""

import sys
from pathlib import Path

import torch

from finetune import Callback, Trainer, load_recipe, load_tokenizer
from finetune.config.schema import resolve_path
from finetune.data import load_records

out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/example-extend")


class EarlyStop(Callback):
    """Ends the run (adapter saved as usual) once the loss stays under `target` for `patience` steps."""

    def __init__(self, target: float, patience: int = 3):
        self.target, self.patience, self.below = target, patience, 0
        self.lrs: list[float] = []

    def on_step_end(self, state, metrics):
        self.lrs.append(metrics["lr"])
        self.below = self.below + 1 if metrics["loss"] < self.target else 0
        if self.below >= self.patience:
            state.should_stop = True

    def on_train_end(self, state, metrics):
        if state.is_main:  # callbacks run on every process; print once
            print(f"stopped early at step {state.step} of {state.total_steps}" if state.should_stop else "ran to the end")


# 1. A shipped recipe, with your optimizer, schedule and callback.
cfg = load_recipe(
    "demo-cpu",
    [f"output_dir={out / 'recipe'}", "overwrite=true", "train.max_steps=200", "eval.exact_match_path=null", "report.plot=false"],
)
stop = EarlyStop(target=1.0)
with Trainer(
    cfg,
    callbacks=[stop],
    optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95)),
    scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5),
    progress=False,
) as trainer:
    result = trainer.train()
print(f"lr halves every 20 steps: {stop.lrs[0]:.1e} -> {stop.lrs[-1]:.1e}; final loss {result.final_loss:.3f}")

# 2. A model and records you already have: no model.path or data.path.
from transformers import AutoModelForCausalLM  # noqa: E402

model = AutoModelForCausalLM.from_pretrained(resolve_path(cfg.model.path), dtype=torch.float32)  # asset:... -> a folder
tokenizer = load_tokenizer(cfg)
records = load_records(resolve_path(cfg.data.path), cfg.data)[:256]
with Trainer.from_parts(
    model,
    tokenizer,
    records,
    output_dir=out / "parts",
    overwrite=True,
    progress=False,
    train={"max_steps": 20, "batch_size": 8, "lr": 3e-3},
    lora={"r": 8, "alpha": 16},
    report={"plot": False},
) as parts:
    print(f"from_parts: {parts.train().final_loss:.3f} after 20 steps; adapter in {parts.out / 'adapter'}")
