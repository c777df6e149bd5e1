"""The Trainer: the training loop, on accelerate.

    from finetune import load_recipe, Trainer
    with Trainer(load_recipe("demo-cpu")) as trainer:
        result = trainer.train()
    print(result.final_loss, result.adapter_dir)

One optimizer step = grad_accum micro-batches of batch_size examples on each
process. The loss of a step is the mean over every target token in the whole
window (all micro-batches, all processes), so the gradient does not depend on
how the window is cut into micro-batches: batch 8 x accum 1 and batch 2 x
accum 4 give the same update on variable-length data (the gradient-accumulation
bug that hit HF Trainer and others in 2024 averaged per micro-batch instead).

The rooms: state.py (what a run counts), build.py (parts from a recipe), order.py (which examples each step),
schedule.py (lr), callbacks.py (your code), profiling.py (MFU), faults.py (what a run survives); beside it:
parallel/runtime.py (single / DDP / FSDP / ZeRO), objectives/ (the losses), runs/resume.py (checkpoints).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from finetune.config.schema import RecipeConfig
from finetune.data import Collator, DataBundle, count_tokens, use_template
from finetune.declarations.layout import Layout
from finetune.errors import OutputDirError, Preempted
from finetune.hardware import detect_device, torch_dtype
from finetune.memory.apply import Applied
from finetune.metrics import MetricsWriter, Progress, Throughput, peak_memory_bytes
from finetune.model.load import load_tokenizer
from finetune.objectives.loss import Loss, as_loss, count_targets
from finetune.objectives.preference import attach_reference
from finetune.parallel import health
from finetune.parallel.launch import ELASTIC_WORLD
from finetune.parallel.runtime import Parallel, make_accelerator
from finetune.runs import choices
from finetune.runs.checkpoint import checkpoint_dir, output_dir_problem, prepare_output_dir, save_adapter
from finetune.runs.evaluate import held_out_loss
from finetune.runs.report import PLOT_NAME, open_sinks, plot_curves, require_extras
from finetune.runs.resume import Resume, saved_state
from finetune.trainer import build, faults, held_out
from finetune.trainer.callbacks import Callback, CallbackList
from finetune.trainer.held_out import HeldOutScores
from finetune.trainer.order import DataOrder, Window
from finetune.trainer.profiling import StepClock
from finetune.trainer.saving import Saving
from finetune.trainer.state import StepTotals, TrainResult, TrainState, stop_signals

LossFn = Callable[[Any, dict[str, torch.Tensor]], tuple[torch.Tensor, int]]
TRAINER_ARGS = ("progress", "callbacks", "optimizer", "scheduler", "loss_fn", "reward_fns")  # from_parts passes them on


class Trainer:
    """Fine-tunes cfg.model on cfg.data and writes the run to cfg.output_dir.

    Everything can be passed in instead of built from the recipe:
      model, tokenizer, data      your own (see also Trainer.from_parts, which needs no paths)
      optimizer                   an optimizer, or a function of the trainable parameters that builds one
      scheduler                   an LR scheduler, or a function of the optimizer that builds one
      loss_fn                     a finetune.Loss, or a function (model, batch) -> (summed loss, units: target tokens)
      callbacks                   finetune.Callback objects (on_train_begin, on_step_begin/_end, on_eval, on_save, on_train_end)
      reward_fns                  grpo: your rewards, (completion text, record) -> float, after the recipe's (finetune.reward)
    Use it as a context manager (or call close()) to free what outlives a run: a streamed weights file,
    the process group of a multi-process launch (at the latest when the interpreter exits).
    """

    def __init__(
        self,
        cfg: RecipeConfig,
        *,
        model=None,
        tokenizer=None,
        data: DataBundle | None = None,
        progress: bool = True,
        callbacks: Sequence[Callback] | None = None,
        optimizer: build.OptimizerArg = None,
        scheduler: build.SchedulerArg = None,
        loss_fn: Loss | LossFn | None = None,
        reward_fns: Sequence[Callable[[str, dict], float]] = (),
    ):
        self.cfg = cfg
        self.model = model
        self.tokenizer = tokenizer
        if data is not None:
            self.data = data
        self.progress_enabled = progress
        self.callbacks = CallbackList(build.recipe_callbacks(self) + list(callbacks or []))  # the recipe's first
        self.loss_fn: Loss = as_loss(loss_fn) if loss_fn is not None else build.default_loss(cfg, reward_fns)
        self._given_optimizer, self._given_scheduler = optimizer, scheduler
        self.out = Path(cfg.output_dir)
        self.state = TrainState()
        self.accelerator: Any = None  # set by setup(); None until then
        self.memory = Applied()  # the memory techniques' store and forward context (memory/apply.py)
        self.params: list[torch.nn.Parameter] = []
        self._trained = self._closed = False  # train() returned: every rank got through the run; close() ran

    # Built by setup() (declared here, typed; absent until then), or passed in:
    data: DataBundle
    parallel: Parallel
    precision: str
    order: DataOrder
    collate: Collator
    optimizer: Any  # accelerate's AcceleratedOptimizer around a torch optimizer
    scheduler: Any
    resume: Resume
    metrics: MetricsWriter

    @classmethod
    def from_parts(
        cls,
        model,
        tokenizer,
        train_data: Sequence[dict],
        *,
        eval_data: Sequence[dict] | None = None,
        output_dir: str | Path = "runs/from-parts",
        **settings: Any,
    ) -> Trainer:
        """A Trainer for a model, tokenizer and data you have in memory; no recipe file or paths
        (e.g. from_parts(model, tok, records, train={"max_steps": 50}, lora={"r": 8})).

        train_data / eval_data: records in data.format (alpaca unless data={"format": ...}),
        tokenized and masked as recipe data is, or examples already tokenized
        ({"input_ids", "labels"}). settings: recipe sections as dicts, or top-level keys
        (seed, precision, ...). LoRA is added per lora.* unless the model has adapters.
        The model's own name (config._name_or_path) stands for model.path in recipe.yaml.
        Keyword arguments of Trainer (callbacks, optimizer, ...) pass through.
        """
        trainer_args = {k: settings.pop(k) for k in TRAINER_ARGS if k in settings}
        cfg = build.recipe_for_parts(model, output_dir, settings)
        data = build.bundle_from_parts(cfg, tokenizer, train_data, eval_data)
        return cls(cfg, model=build.ready_given_model(cfg, model), tokenizer=tokenizer, data=data, **trainer_args)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers

    def say(self, text: str | None) -> None:
        if text and (self.accelerator is None or self.accelerator.is_main_process):
            print(text, flush=True)

    @property
    def unit(self) -> str:
        return self.order.unit if hasattr(self, "order") else "examples"

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        cfg = self.cfg
        saved = saved_state(cfg, self.out)  # what the run being resumed keeps for good: its window, auto's choices
        ran = saved.get("choices", {})
        self.precision, kept = choices.keep_precision(cfg, ran, detect_device())
        acc = self.accelerator = make_accelerator(self.precision, cfg)
        faults.close_at_exit(self)  # the process group, when a with-block or close() did not
        self.clock = StepClock(acc.device)
        self.say(kept)
        problem = output_dir_problem(cfg)  # refuse early; delete an old run (overwrite) only once loading worked
        if problem:
            raise OutputDirError(problem)
        require_extras(cfg)  # a missing TensorBoard/W&B package must not surface after the model has loaded

        torch.manual_seed(cfg.seed)
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(cfg)
        if cfg.data.template != "auto":  # also when data is passed in: the saved tokenizer carries the template
            use_template(self.tokenizer, cfg.data.template)
        if not hasattr(self, "data"):
            self.data = build.load_data(cfg, self.tokenizer, acc, self.say)
        build.describe_data(self.data, self.say)
        self._plan_steps(saved)

        run_cfg = choices.keep(cfg, ran, acc.num_processes)  # the recipe, auto's earlier choices kept
        parallel = self.parallel = Parallel.choose(run_cfg, acc)
        self.ranks = health.check(parallel, cfg, self.say)  # versions and recipe agree; a collective completes
        self.model, self.memory = build.load_model_and_store(run_cfg, self.precision, parallel, self.say, given=self.model)
        self.loss_fn.fit(self.model)
        self.loss_fn.use_tokenizer(self.tokenizer)
        self.loss_fn.use_rows(parallel.layout.replica, parallel.row_group())
        self.loss_fn.use_memory(
            *self.memory.loss_memory, parallel.device, parallel.sharded, head_partitioned=parallel.partitions_root
        )
        if self.memory.stream is not None:
            build.describe_store(self.memory.stream, acc.device, self.say)
        if parallel.is_main:
            prepare_output_dir(cfg)
        parallel.wait()
        self.model = parallel.shard(self.model, torch_dtype(self.precision))
        parallel.fit_objective(type(self), Trainer.compute_loss, self.loss_fn)
        self.say(parallel.describe())
        chunked = getattr(self.loss_fn, "chunk_rows", None) is not None
        self.state.choices = choices.resolved(cfg, self.precision, parallel.strategy, self.model, self.memory, chunked)
        self.say(choices.changes(ran, self.state.choices))

        self.params = [p for p in self.model.parameters() if p.requires_grad and not p.is_meta]  # meta: other stages'
        optimizer = build.build_optimizer(cfg, self.params, self._given_optimizer, parallel, self.memory)
        self.scheduler = build.build_lr_schedule(cfg, optimizer, self.state.total_steps, self._given_scheduler)
        self.model, self.optimizer = parallel.prepare(self.model, optimizer)
        if cfg.train.precompute_reference:  # one pass over the pairs with the adapter off, cached
            self.data = attach_reference(self, parallel.unwrap(self.model))
            self.order.train = self.data.train
        self.resume = Resume(cfg, self.out, self.data.train, self.say, parallel.is_main)
        self.saving = Saving(cfg)
        sinks = open_sinks(cfg, self.out) if parallel.is_main else []
        self.metrics = MetricsWriter(self.out / "metrics.jsonl", enabled=parallel.is_main, sinks=sinks)

    def _plan_steps(self, saved: dict[str, Any]) -> None:
        """The data order of this launch (the run's window, cut for this launch), and the run's length in steps."""
        cfg, acc, state = self.cfg, self.accelerator, self.state
        self.collate = Collator.for_tokenizer(self.tokenizer)
        layout = Layout.of(cfg, acc.process_index, acc.num_processes)  # a pipeline's stages share their replica's data
        if "window" not in saved and os.environ.get(ELASTIC_WORLD):  # an elastic job's first start, on however many nodes
            widest = Window.of_recipe(cfg, Layout.of(cfg, 0, int(os.environ[ELASTIC_WORLD])).replicas)
            saved = {**saved, **widest.counters()}
        window = Window.resumed(saved, cfg, layout.replicas)
        self.say(window.resume_note(saved, cfg))
        self.order = DataOrder(self.data.train, cfg, self.collate, layout.replica, window, acc.device)
        state.window, state.steps_per_epoch, state.cut = self.order.window, self.order.epoch_steps, window.counters()
        state.is_main = acc.is_main_process
        state.total_steps = self.order.total_steps()

    # ------------------------------------------------------------------ the step

    def compute_loss(self, model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """(summed loss over target tokens, number of target tokens) for one micro-batch.
        Override it, or pass loss_fn, to change the objective."""
        return self.loss_fn(model, batch)

    def step_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """The grad_accum micro-batches this process's replica trains on at optimizer step `step` (whole rows: a
        context-parallel rank takes its part of what the objective prepared from them, accumulate_gradients)."""
        return self.order.step_batches(step)

    def accumulate_gradients(self, step: int) -> StepTotals:
        """Backward over the step's window. Each micro-batch's summed loss is divided by the units
        (target tokens, or pairs) of the whole window on all processes, so the accumulated gradient
        is the gradient of the window's mean loss however the window is split."""
        parallel, model = self.parallel, self.model
        prepared = self.loss_fn.prepare(parallel.unwrap(model), step, self.step_batches, self.state.total_steps)  # grpo: sampled
        batches = [parallel.local_part(b) for b in prepared]  # a context-parallel rank's part of every row
        counted = batches if parallel.counts_window else []  # a pipeline's stages share a window: the last counts it
        targets = sum(count_targets(b) for b in counted)
        with self.clock.waiting():  # where the others wait for a rank slow to collate
            n_global = parallel.global_sum(sum(self.loss_fn.count(b) for b in counted))  # target tokens, or pairs
        # DDP averages gradients over processes: multiply back by their number (a pipeline sums them: 1).
        scale = parallel.gradient_scale / max(n_global, 1)
        totals = StepTotals(0.0, n_global, sum(count_tokens(b) for b in counted), targets)
        saving = self.memory.activations.saving
        totals.loss_sum, totals.sums = parallel.train_window(model, batches, self.loss_fn, scale, self._micro_step, saving)
        if parallel.window_waited is not None:  # a pipeline: its work ends with its window, its waits inside timed apart
            self.clock.window_ended(parallel.window_waited)
        return totals

    def _micro_step(self, batch: dict[str, Any], scale: float) -> float:
        """One micro-batch's forward and backward (its loss scaled to the window's mean); its summed loss."""
        with self.memory.activations.saving():
            loss_sum, _ = self.compute_loss(self.model, batch)
        self.clock.mark_backward(loss_sum)
        self.accelerator.backward(loss_sum * scale)
        return float(loss_sum.detach())

    def _optimizer_step(self, speed: Throughput) -> tuple[dict[str, Any], bool]:
        """One optimizer step: gradients, clipping, the update (never a non-finite one). (row, finite)."""
        cfg, state, acc = self.cfg, self.state, self.accelerator
        speed.start()
        self.clock.start()
        totals, retried = faults.window_gradients(self)  # retried after an out-of-memory
        self.parallel.sync_gradients(self.params)
        units = max(totals.units, 1)
        grad_norm = self.parallel.clip_grad_norm(self.params, cfg.train.max_grad_norm or float("inf"))
        lr = self.scheduler.get_last_lr()[0]
        loss_sum, tokens, trained, *sums = self.parallel.global_sums(
            totals.loss_sum, totals.tokens, totals.trained_tokens, *totals.sums.values()
        )
        loss = loss_sum / units
        extra = self.loss_fn.metric_means(dict(zip(totals.sums, sums)), units)
        # A non-finite loss or gradient must never reach the weights or the optimizer state.
        # (fp16: an inf gradient is the GradScaler's business; it skips that step itself and lowers the scale.)
        finite = math.isfinite(loss) and (math.isfinite(grad_norm) or self.precision == "fp16")
        step_tokens_global, trained_global = int(tokens), int(trained)
        if finite:
            self.optimizer.step()
            if not acc.optimizer_step_was_skipped:  # the schedule follows applied updates, not GradScaler skips
                self.scheduler.step()
            state.tokens += step_tokens_global
            state.trained_tokens += trained_global
        else:
            state.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        speed.stop(step_tokens_global, trained_global)
        state.step += 1
        state.loss = loss
        row = {
            "step": state.step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": step_tokens_global,
            "trained_tokens": trained_global,
            "tokens_per_s": speed.tokens_per_s,
            "elapsed_s": state.elapsed_s,
            **extra,
        }
        row["compute_s"], row["step_s"] = self.clock.stop()  # this rank's (trainer/watch.py gathers them)
        if retried:
            row.update(oom_retries=retried, micro_batch=self.order.split.micro_batch)
        return row, finite

    def _log_step(self, row: dict[str, Any], finite: bool, progress: Progress) -> None:
        """Spike and non-finite notes, metrics.jsonl, callbacks; stop on a non-finite step unless told to skip."""
        cfg, state, done = self.cfg, self.state, self.state.step
        recent = state.loss_ema
        spike = state.record_loss(row["loss"], finite, cfg.train.loss_spike_factor) and self.loss_fn.flags_spikes
        if spike:
            row["spike"] = True
            progress.write(
                f"step {done}: loss spike {row['loss']:.4f} (> {cfg.train.loss_spike_factor} x recent mean {recent:.4f})"
            )
        if not finite:
            row["skipped"] = True
        self.callbacks("on_step_end", state, row)
        progress.update(row["loss"], row["tokens_per_s"], row["lr"], row)  # with what callbacks added (MFU)
        # Every rank must stop together, or the others wait forever in the next collective.
        state.should_stop = self.parallel.global_sum(float(state.should_stop)) > 0
        if done % cfg.train.log_every_steps == 0 or self._last_step() or not finite or spike:
            self.metrics.write(row)
        if not finite:
            faults.after_nonfinite(self, row, progress)

    def _last_step(self) -> bool:
        return self.state.step == self.state.total_steps or self.state.should_stop

    def _after_step(self, progress: Progress) -> None:
        """Periodic eval and checkpoint; a stop signal checkpoints and raises Preempted."""
        cfg, done = self.cfg, self.state.step
        if cfg.eval.every_steps and (done % cfg.eval.every_steps == 0 or self._last_step()):
            self._eval_and_log(progress)
        saving, saved, last = self.saving, False, self._last_step()
        saving.poll(self)
        # The last step is checkpointed too: a finished run can be extended (more steps,
        # resume=auto) from where it ended instead of silently starting over.
        if saving.periodic and (saving.due(self, done) or last):
            self.save_checkpoint(done, background=not last)
            saved = True
        # A stop signal on any rank stops every rank, or one would wait forever in the next collective.
        if not last and self.parallel.global_sum(1.0 if self.state.stop_signal else 0.0) > 0:
            if saved:  # written in the background on rank 0: every rank leaves once it is complete (torchrun tears
                saving.wait(self)  # down the others at the first rank's exit)
                self.parallel.wait()
            else:
                self.save_checkpoint(done)
            raise Preempted(
                f"{self.state.stop_signal or 'stop signal'} received: saved {checkpoint_dir(self.out, done)} "
                f"and stopped after step {done} of {self.state.total_steps}",
                hint="run the same command with resume=auto to continue exactly where it stopped",
            )

    # ------------------------------------------------------------------ the run

    def train(self) -> TrainResult:
        try:
            result = self._train()
            self._trained = True
            return result
        finally:
            # TensorBoard/W&B are closed however the run ends (done, NaN stop, preempted).
            if hasattr(self, "metrics"):
                self.metrics.finish()

    def _train(self) -> TrainResult:
        if self.accelerator is None:
            self.setup()
        state = self.state
        if self.parallel.is_main:
            (self.out / "recipe.yaml").write_text(self.cfg.to_yaml() + choices.comment(state.choices), encoding="utf-8")
        model = self.parallel.unwrap(self.model)
        state.restore(self.resume.restore(model, self.optimizer, self.scheduler, self.parallel.rank, self.metrics, self.loss_fn))
        em_records = build.exact_match_prompts(self.cfg, self.parallel, self.say)
        before = held_out.score(self, em_records, "before training") if state.step == 0 else HeldOutScores()
        self.say(
            f"training {state.total_steps} steps ({state.steps_per_epoch} per epoch; {self.order.split.micro_batch} x "
            f"{self.order.split.accum} accum x {self.parallel.layout.copies} = {state.window} {self.unit}/step"
            f"{self.order.untrained_per_epoch}), precision {self.precision}"
        )
        self.model.train()
        speed = Throughput()
        progress = Progress(state.total_steps, initial=state.step, enabled=self.progress_enabled, is_main=self.parallel.is_main)
        state.restore({**state.counters(), "step": state.step, "elapsed_s": state.earlier_s})  # the clock starts now
        if state.step >= state.total_steps:
            state.loss = self.resume.reopen_finished(state.step, state.total_steps, state.loss)
        self.callbacks("on_train_begin", state, {"start_step": state.step, "total_steps": state.total_steps})
        try:
            with stop_signals(state), faults.Watchdog(self.cfg.distributed.timeout_s, self.ranks, self.parallel.world) as dog:
                while state.step < state.total_steps and not state.should_stop:
                    self.callbacks("on_step_begin", state, {"step": state.step + 1})
                    row, finite = self._optimizer_step(speed)
                    self._log_step(row, finite, progress)
                    with dog.paused():  # an eval or a save: bounded by their own collectives
                        self._after_step(progress)
            self.saving.wait(self)  # a checkpoint in flight written (or its failure raised) before the run ends
        except RuntimeError as err:
            faults.leave_if_peer_lost(err, self.ranks, self.parallel)  # exit 75: restartable
            raise
        finally:
            self.saving.wait(self, raise_errors=False)  # the run failed already: its error is the one to see
            progress.close()
            self.metrics.close()
            self.callbacks("on_train_exit", state, {"step": state.step})  # also after an error: release
        return self._finish(em_records, before)

    def _finish(self, em_records: list[dict] | None, before: HeldOutScores) -> TrainResult:
        """Final eval, the adapter, exact match after training, the plot and the summary."""
        cfg, state, parallel = self.cfg, self.state, self.parallel
        if state.eval_loss is None and self.data.eval and not cfg.eval.every_steps:
            self._eval_and_log(None)
            self.metrics.close()
        parallel.wait()
        adapter_dir = self._save_final_weights()
        after = held_out.score(self, em_records, "after training")
        plot = None
        if cfg.report.plot and parallel.is_main:
            plot = plot_curves(self.out / "metrics.jsonl", self.out / PLOT_NAME, title=f"{self.out.name}: {cfg.model.path}")
        result = state.result(
            peak_memory_bytes=peak_memory_bytes(self.accelerator.device),
            output_dir=self.out,
            adapter_dir=adapter_dir,
            metrics_path=self.out / "metrics.jsonl",
            exact_match_before=before.exact_match,
            exact_match_after=after.exact_match,
            reward_before=before.reward,
            reward_after=after.reward,
            preference_accuracy_before=before.preference_accuracy,
            preference_accuracy_after=after.preference_accuracy,
            extra={"plot": plot} if plot else {},
        )
        self.callbacks("on_train_end", state, result.end_metrics())
        self.say(result.summary(memory_kind="GPU memory" if self.accelerator.device.type == "cuda" else "RSS"))
        return result

    def _save_final_weights(self) -> Path:
        """The adapter (or, for full fine-tuning, the whole model), gathered whole under FSDP; rank 0 writes."""
        parallel = self.parallel
        unwrapped = parallel.unwrap(self.model)
        full_state = parallel.full_weights(unwrapped)
        adapter_dir = self.out / ("adapter" if self.cfg.lora is not None else "model")
        if parallel.is_main:
            save_adapter(unwrapped, adapter_dir, self.tokenizer, state_dict=full_state)
        self.callbacks("on_save", self.state, {"step": self.state.step, "path": str(adapter_dir), "kind": "adapter"})
        return adapter_dir

    def save_checkpoint(self, step: int, background: bool = False) -> None:
        """Checkpoint after `step` completed optimizer steps (all ranks call this); background: written off the
        training thread where the run allows it (trainer/saving.py)."""
        self.saving.save(self, step, background)

    # ------------------------------------------------------------------ eval

    def _eval_and_log(self, progress: Progress | None) -> None:
        eval_loss = self.evaluate_loss()
        if eval_loss is None:
            return
        self.state.eval_loss = eval_loss
        row = {"step": self.state.step, "eval_loss": eval_loss}
        self.metrics.write(row)
        if progress is not None:
            progress.write(f"step {self.state.step}: eval_loss {eval_loss:.4f}")
        self.callbacks("on_eval", self.state, row)

    def evaluate_loss(self) -> float | None:
        """Mean loss per target token over the eval set (all processes); None without one."""
        if not self.loss_fn.scores_held_out_loss:
            return None
        model = self.parallel.unwrap(self.model)
        return held_out_loss(model, self.data.eval, self.cfg, self.collate, self.parallel, self.compute_loss)

    # ------------------------------------------------------------------ preemption and cleanup

    def close(self) -> None:
        """Free what outlives a run: the streamed-weights file (base_weights=disk) and the process
        group of a multi-process launch. The model is unusable after. Once; again is a no-op."""
        if self._closed:
            return
        self._closed = True
        if self.memory.stream is not None:
            self.memory.stream.close()
        if hasattr(self, "parallel"):
            if self._trained:  # our references to the sharded model go first (see Parallel.close)
                self.model = self.optimizer = self.scheduler = None
                self.params = []
            self.parallel.close(all_finished=self._trained)
