"""Resume: which checkpoint a run continues from, whether it may, and the checkpoints it writes.

    resume = Resume(cfg, out, train_data, say=print, is_main=True)
    saved = resume.restore(model, optimizer, scheduler, rank=0, metrics=writer)   # {} = fresh start
    resume.save(step, model, optimizer, scheduler, state.counters())

A resumed run is the same run: the checkpoint restores weights, optimizer, schedule and
every generator; refused (with every difference listed) when the recipe or the
tokenized data would make it another run. Files and their atomicity: runs/checkpoint.py.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Callable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from finetune.config.schema import RecipeConfig
from finetune.errors import CheckpointError, ResumeMismatch
from finetune.metrics import MetricsWriter, read_metrics
from finetune.parallel import ddp_hooks
from finetune.parallel.rank_state import RankState, read_objective_state
from finetune.runs.checkpoint import list_checkpoints, load_checkpoint, recipe_changes, save_checkpoint


def data_fingerprint(train: Sequence[dict]) -> str:
    """Hash of the tokenized train set: resuming on different data would not be the same run."""
    if hasattr(train, "fingerprint"):
        return train.fingerprint()
    h = hashlib.sha256()
    for ex in train:
        h.update(array("i", ex["input_ids"]).tobytes())
        h.update(array("i", ex["labels"]).tobytes())
    return h.hexdigest()[:16]


OOM_BACKOFF = "oom_backoff.json"  # the micro-batch a multi-process run restarts with after out of memory (trainer/faults.py)


def saved_state(cfg: RecipeConfig, out: Path) -> dict[str, Any]:
    """The trainer_state.json of the checkpoint a resume would continue from ({}: a fresh start), read
    before anything is built: what a run keeps for good (its window, what auto chose) shapes the build;
    with `oom_micro_batch` when a multi-process launch left restartable after running out of memory."""
    if cfg.resume is None:
        return {}
    found: dict[str, Any] = {}
    backoff = Path(out) / OOM_BACKOFF
    if backoff.is_file():
        found["oom_micro_batch"] = int(json.loads(backoff.read_text(encoding="utf-8"))["micro_batch"])
    paths = reversed(list_checkpoints(Path(out))) if cfg.resume == "auto" else [Path(str(cfg.resume))]
    for path in paths:
        try:
            return {**json.loads((path / "trainer_state.json").read_text(encoding="utf-8")), **found}
        except (OSError, ValueError):  # unreadable: Resume.restore says so and falls back the same way
            continue
    return found


class Resume:
    def __init__(self, cfg: RecipeConfig, out: Path, train: Sequence[dict], say: Callable[[str], None], is_main: bool):
        self.cfg, self.out, self.train, self.say, self.is_main = cfg, Path(out), train, say, is_main

    @cached_property
    def fingerprint(self) -> str:
        """Computed on first use (a checkpoint written or read), not at every start."""
        return data_fingerprint(self.train)

    # ------------------------------------------------------------------ reading

    def candidates(self) -> list[Path]:
        cfg = self.cfg
        if cfg.resume == "auto":
            found = list(reversed(list_checkpoints(self.out)))
            if not found:
                self.say(f"resume=auto: no checkpoint in {self.out / 'checkpoints'}; starting from step 0")
            return found
        path = Path(str(cfg.resume))
        if not path.is_dir():
            raise CheckpointError(
                f"resume: checkpoint directory '{cfg.resume}' not found",
                hint=f"use resume=auto or one of {self.out / 'checkpoints'}/step-N",
            )
        return [path]

    def check_compatible(self, path: Path, state: dict[str, Any]) -> None:
        """Refuse a resume that could not continue the same run, listing every difference."""
        if "recipe" not in state:
            return
        breaking, harmless = recipe_changes(state["recipe"], self.cfg.to_dict())
        if state.get("data_fingerprint") not in (None, self.fingerprint):
            breaking.append("the tokenized training data differs (file contents, tokenizer or formatting changed)")
        for change in harmless:
            self.say(f"resume: allowed change {change}")
        if breaking and not self.cfg.resume_ignore_changes:
            raise ResumeMismatch(
                f"resume: the recipe differs from the one that wrote {path} in ways that change the run:\n"
                + "\n".join(f"    {c}" for c in breaking),
                hint="undo these changes, start a new output_dir, or set resume_ignore_changes=true to continue anyway",
            )
        for change in breaking:
            self.say(f"resume: continuing despite {change} (resume_ignore_changes=true)")

    def restore(self, model, optimizer, scheduler, rank: int, metrics: MetricsWriter, objective=None) -> dict[str, Any]:
        """Load the checkpoint to continue from (resume=auto: the newest readable one); its
        trainer_state, or {} for a fresh start. `model` is the unwrapped model; objective: the run's
        Loss, given back its state (grpo's completions sampled ahead)."""
        if self.cfg.resume is None:
            return {}
        for path in self.candidates():
            try:
                # All files are read and checked before anything is assigned, so a
                # corrupt checkpoint leaves the model and optimizer untouched.
                state = load_checkpoint(
                    path,
                    model,
                    optimizer,
                    scheduler,
                    check=self.check_compatible,
                    rank=rank,
                    powersgd=ddp_hooks.attached(model),  # registered on this model by Parallel.prepare
                )
                ahead = read_objective_state(path, rank)
            except CheckpointError as exc:
                if self.cfg.resume != "auto" or isinstance(exc, ResumeMismatch):
                    raise  # an older checkpoint of a different run is no fallback
                self.say(f"resume: skipping {path.name}: {exc.message}; trying the previous checkpoint")
                continue
            break
        else:
            if self.cfg.resume == "auto" and list_checkpoints(self.out):
                raise CheckpointError(
                    f"resume=auto: no checkpoint in {self.out / 'checkpoints'} could be read (see above)",
                    hint="remove the broken checkpoints/step-N directories to start over, or set resume=null",
                )
            self._keep_metrics(metrics, up_to=None)  # from step 0: rows of an earlier attempt are not this run's
            return {}
        self.say(f"resumed from {path} at step {state['step']}")
        if objective is not None:
            self.say(objective.load_state_dict(ahead))
        self._keep_metrics(metrics, up_to=state["step"])  # rows logged after the checkpoint will be logged again
        return state

    def reopen_finished(self, step: int, total_steps: int, loss: float) -> float:
        """A finished run launched again: say so; the loss it ended with."""
        self.say(
            f"the run is already complete ({step} of {total_steps} steps): nothing to train; "
            "raise train.max_steps (or epochs) to extend it"
        )
        return self.last_logged_loss(loss)

    def last_logged_loss(self, default: float) -> float:
        """The loss of the last step metrics.jsonl logged (a finished run reopened), else `default`."""
        path = self.out / "metrics.jsonl"
        logged = [r["loss"] for r in read_metrics(path) if "loss" in r] if path.exists() else []
        return logged[-1] if logged and logged[-1] is not None else default

    def _keep_metrics(self, metrics: MetricsWriter, up_to: int | None) -> None:
        path = self.out / "metrics.jsonl"
        if not self.is_main or not path.exists():
            return
        metrics.close()
        if up_to is None:
            path.unlink()
            return
        kept = [r for r in read_metrics(path) if r.get("step", 0) <= up_to]
        path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")

    # ------------------------------------------------------------------ writing

    def save(
        self,
        step: int,
        model,
        optimizer,
        scheduler,
        counters: dict[str, Any],
        model_state: dict[str, torch.Tensor] | None = None,
        optimizer_state: dict[str, Any] | None = None,
        rank_states: list[RankState] | None = None,
        scheduler_state: dict[str, Any] | None = None,
    ) -> Path:
        """Write checkpoints/step-N (rank 0 only calls this; the states are gathered already, or snapshots for a
        write in the background). A note of an out-of-memory restart goes once a checkpoint holds the smaller
        micro-batch it asked for."""
        (self.out / OOM_BACKOFF).unlink(missing_ok=True)
        return save_checkpoint(
            self.out,
            step,
            model,
            optimizer,
            scheduler,
            {**counters, "recipe": self.cfg.to_dict(), "data_fingerprint": self.fingerprint},
            keep_last=self.cfg.checkpoint.keep_last,
            model_state=model_state,
            optimizer_state=optimizer_state,
            rank_states=rank_states,
            scheduler_state=scheduler_state,
        )
