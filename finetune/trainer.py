"""The training loop, on accelerate.

    from finetune import load_recipe, Trainer
    result = Trainer(load_recipe("demo-cpu")).train()
    print(result.final_loss, result.adapter_dir)

One optimizer step = grad_accum micro-batches of batch_size examples on each
process. The loss of a step is the mean over every target token in the whole
window (all micro-batches, all processes), so the gradient does not depend on
how the window is cut into micro-batches: batch 8 x accum 1 and batch 2 x
accum 4 give the same update on variable-length data (the gradient-accumulation
bug that hit HF Trainer and others in 2024 averaged per micro-batch instead).
"""

from __future__ import annotations

import hashlib
import json
import math
import signal
import threading
from array import array
import time
from contextlib import nullcontext
from functools import cached_property
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from finetune.checkpoint import (
    list_checkpoints,
    load_checkpoint,
    output_dir_problem,
    prepare_output_dir,
    recipe_changes,
    rng_states,
    save_adapter,
    save_checkpoint,
)
from finetune.config import RecipeConfig, resolve_offload_dir, resolve_path
from finetune.data import (
    IGNORE_INDEX,
    Collator,
    DataBundle,
    build_datasets,
    count_tokens,
    length_grouped,
    load_records,
    use_template,
)
from finetune.errors import CheckpointError, ConfigError, DataError, OutputDirError, Preempted, ResumeMismatch, TrainingError
from finetune.evaluate import ExactMatch, exact_match, loss_sum_and_count, shifted_targets
from finetune.hardware import release_free_heap, resolve_precision, torch_dtype
from finetune.metrics import MetricsWriter, Progress, Throughput, human_bytes, human_duration, peak_memory_bytes, read_metrics
from finetune.distributed import (
    check_strategy,
    full_optimizer_state,
    full_trainable_state,
    place_sharded,
    resolve_strategy,
    shard_model,
)
from finetune.model import count_parameters, load_model, load_tokenizer, takes_boolean_logits_to_keep
from finetune.offload import ActivationOffload, HostAdamW
from finetune.stream import DiskStore, WeightStream
from finetune.report import PLOT_NAME, open_sinks, plot_curves, require_extras


@dataclass
class TrainResult:
    final_loss: float
    steps: int
    tokens: int
    trained_tokens: int
    elapsed_s: float
    peak_memory_bytes: int
    output_dir: Path
    adapter_dir: Path
    metrics_path: Path
    exact_match_before: ExactMatch | None = None
    exact_match_after: ExactMatch | None = None
    eval_loss: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def lr_factor(step: int, warmup_steps: int, total_steps: int, kind: str) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based): linear warmup, then decay to 0."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if kind == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    progress = min(max(progress, 0.0), 1.0)
    if kind == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def count_targets(batch: dict[str, torch.Tensor]) -> int:
    return int((shifted_targets(batch["labels"]) != IGNORE_INDEX).sum())


class Trainer:
    """Fine-tunes cfg.model on cfg.data and writes the run to cfg.output_dir.

    model / tokenizer / data can be passed in (tests, notebooks); otherwise they
    are built from the recipe. Subclass and override `compute_loss` to change the objective.
    """

    def __init__(
        self,
        cfg: RecipeConfig,
        *,
        model=None,
        tokenizer=None,
        data: DataBundle | None = None,
        progress: bool = True,
    ):
        self.cfg = cfg
        self.model = model
        self.tokenizer = tokenizer
        self.data = data
        self.progress_enabled = progress
        self.accelerator = None
        self._head_on_targets_only = True  # see compute_loss; setup() checks the model can take it
        self.strategy = "single"  # set by setup(): single | ddp | fsdp
        self.stream: WeightStream | None = None  # memory.base_weights=cpu|disk
        self.activation_offload: ActivationOffload | None = None  # memory.activation_offload

    # ------------------------------------------------------------------ helpers

    def say(self, text: str) -> None:
        if self.accelerator is None or self.accelerator.is_main_process:
            print(text, flush=True)

    def compute_loss(self, model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """(summed loss over target tokens, number of target tokens) for one micro-batch."""
        # Packed rows carry position_ids and no attention_mask: the model then keeps each
        # packed example's attention to itself (see finetune.data.dataset.Collator), but
        # only without a KV cache (use_cache=False), which transformers would otherwise
        # take as a sign of generation and ignore the packing.
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
        labels = batch["labels"]
        if self._head_on_targets_only:
            # The LM head runs only where a target is predicted (a boolean logits_to_keep
            # gives flat (n_targets, vocab) logits): masked prompt positions cost no head
            # matmul and no logits memory, which for a 150k vocabulary is most of the
            # activation peak. Models without this argument take the full path below.
            keep = torch.zeros_like(labels, dtype=torch.bool)
            keep[:, :-1] = shifted_targets(labels) != IGNORE_INDEX
            try:
                out = model(**inputs, use_cache=False, logits_to_keep=keep)
            except (TypeError, IndexError):
                # TypeError: no such argument. IndexError: a model (or a transformers release
                # before the boolean form, e.g. 5.17) that slices hidden_states[:, keep, :].
                # A real indexing bug raises again on the full path below.
                out = None
            if out is not None and out.logits.dim() == 2:
                n = int(keep.sum())
                if n == 0:
                    return out.logits.sum() * 0.0, 0
                return F.cross_entropy(out.logits.float(), labels[:, 1:][keep[:, :-1]], reduction="sum"), n
            self._head_on_targets_only = False  # this model ignores or rejects it: full logits from now on
            if out is not None:
                return loss_sum_and_count(out.logits, labels)
        out = model(**inputs, use_cache=False)
        return loss_sum_and_count(out.logits, labels)

    def _global_sum(self, value: float) -> float:
        acc = self.accelerator
        if acc.num_processes == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=acc.device)
        return float(acc.reduce(t, reduction="sum").item())

    # ------------------------------------------------------------------ setup

    def _load_and_stream(self, streaming: bool) -> None:
        """Load the model (unless one was given) and, for memory.base_weights=cpu|disk, move its
        frozen layer weights to their store. A failure deletes a weights file already written."""
        cfg, acc = self.cfg, self.accelerator
        disk_store = None
        try:
            if self.model is None:
                torch.manual_seed(cfg.seed)  # LoRA init is drawn from the global RNG: the same on every rank
                fsdp = self.strategy == "fsdp"
                # FSDP loads into CPU RAM and moves only this rank's shard to the GPU, and streaming
                # keeps the decoder layers there: a whole 4-bit 70B model (~37 GB) would not fit
                # one 24 GB card even for a moment.
                load_on = torch.device("cpu") if fsdp or streaming else acc.device
                if cfg.memory.base_weights == "disk" and not (cfg.lora and cfg.lora.dora):
                    # 4-bit weights go to the file as bitsandbytes quantizes them: the whole
                    # quantized model (~37 GB for 70B) is never in RAM, not even while loading.
                    # (DoRA reads every base weight when it wraps the model: no capture then.)
                    disk_store = DiskStore(resolve_offload_dir(cfg))
                    with disk_store.capture():
                        self.model = load_model(cfg, precision=self.precision, device=load_on, shardable=fsdp)
                else:
                    self.model = load_model(cfg, precision=self.precision, device=load_on, shardable=fsdp)
            self._head_on_targets_only = takes_boolean_logits_to_keep(self.model)
            trainable, total = count_parameters(self.model)
            quant = f"{cfg.quant.bits}-bit {cfg.quant.quant_type if cfg.quant.bits == 4 else 'int8'}" if cfg.quant.bits else "unquantized"
            self.say(
                f"model: {total:,} parameters ({quant} base), {trainable:,} trainable ({100 * trainable / max(total, 1):.2f}%)"
            )
            if streaming:
                self.stream = WeightStream.attach(
                    self.model, cfg.memory.base_weights, acc.device, resolve_offload_dir(cfg), store=disk_store
                )
        except BaseException:
            if disk_store is not None:
                disk_store.discard()  # tens of GB written for a model that will not train
            raise
        if streaming:
            where = f"a file in {self.stream.store.parent}" if self.stream.store else "CPU RAM"
            self.say(
                f"memory: {human_bytes(self.stream.streamed_bytes)} of frozen decoder-layer weights live in {where} "
                f"and stream to {acc.device} one layer at a time"
            )

    def setup(self) -> None:
        from accelerate import Accelerator

        cfg = self.cfg
        self.precision = resolve_precision(cfg.precision)
        mixed = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}[self.precision]
        from accelerate.state import AcceleratorState

        # accelerate keeps one mixed-precision setting per process and refuses a second
        # Trainer with another; the setting is ours to choose per run (the process group,
        # in PartialState, is kept).
        AcceleratorState._reset_state()
        self.accelerator = Accelerator(mixed_precision=mixed, cpu=not torch.cuda.is_available())
        acc = self.accelerator
        self.out = Path(cfg.output_dir)
        problem = output_dir_problem(cfg)  # refuse early; delete an old run (overwrite) only once loading worked
        if problem:
            raise OutputDirError(problem)
        require_extras(cfg)  # a missing TensorBoard/W&B package must not surface after the model has loaded

        torch.manual_seed(cfg.seed)
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(cfg)
        if cfg.data.template != "auto":  # also when data is passed in: the saved tokenizer carries the template
            use_template(self.tokenizer, cfg.data.template)
        if self.data is None:
            t0 = time.perf_counter()
            # Rank 0 tokenizes (and fills the cache) while the others wait, then they read its cache.
            with acc.main_process_first():
                self.data = build_datasets(cfg, self.tokenizer)
            how = "read from the tokenized cache" if self.data.from_cache else "tokenized"
            self.say(f"data: {how} in {time.perf_counter() - t0:.1f}s")
        self.say(f"data: {self.data.train_stats.summary()}")
        for line in self.data.train_stats.warnings:
            self.say(f"warning: {line}")
        if self.data.eval_stats is not None:
            self.say(f"eval data: {self.data.eval_stats.summary()}")

        world = acc.num_processes
        self.window = cfg.train.batch_size * cfg.train.grad_accum * world
        self.steps_per_epoch = len(self.data.train) // self.window
        if self.steps_per_epoch == 0:
            raise DataError(
                f"data.path: the train set has {len(self.data.train)} {self.unit}, fewer than one optimizer step needs "
                f"(train.batch_size {cfg.train.batch_size} x train.grad_accum {cfg.train.grad_accum} x {world} processes = {self.window})",
                hint="lower train.batch_size or train.grad_accum, or add data",
            )
        self.total_steps = cfg.train.max_steps or cfg.train.epochs * self.steps_per_epoch

        self.strategy = resolve_strategy(cfg, acc.num_processes, acc.device)
        check_strategy(cfg, self.strategy)
        streaming = cfg.memory.base_weights != "device"
        if streaming and self.strategy != "single":
            raise ConfigError([
                f"memory.base_weights={cfg.memory.base_weights} streams the weights of one process; this launch has "
                f"{acc.num_processes}. Run on one GPU, or use distributed.strategy=fsdp with distributed.cpu_offload=true."
            ])
        self._load_and_stream(streaming)
        if acc.is_main_process:
            prepare_output_dir(cfg)
        acc.wait_for_everyone()
        if self.strategy == "fsdp":
            # Sharded before the optimizer exists: its state is then sharded too.
            shard_model(self.model, cfg, torch_dtype(self.precision))
            place_sharded(self.model, acc.device, keep_params_on_cpu=cfg.distributed.cpu_offload)
            release_free_heap()  # the whole model each process loaded, now that it keeps only its shards
        if self.strategy != "single":
            self.say(f"parallel: {self.strategy} over {acc.num_processes} processes")
        params = [p for p in self.model.parameters() if p.requires_grad]
        adamw = HostAdamW if cfg.memory.optimizer_offload else torch.optim.AdamW
        optimizer = adamw(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
        if cfg.memory.activation_offload:
            self.activation_offload = ActivationOffload(acc.device)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda s: lr_factor(s, cfg.train.warmup_steps, self.total_steps, cfg.train.scheduler),
        )
        if self.strategy == "fsdp":
            self.optimizer = acc.prepare(optimizer)  # the model is FSDP already; prepare() would wrap it in DDP
        else:
            self.model, self.optimizer = acc.prepare(self.model, optimizer)
        self.params = params
        self.collate = Collator(pad_token_id=self.tokenizer.pad_token_id)
        sinks = open_sinks(cfg, self.out) if acc.is_main_process else []
        self.metrics = MetricsWriter(self.out / "metrics.jsonl", enabled=acc.is_main_process, sinks=sinks)

    # ------------------------------------------------------------------ data order

    @property
    def unit(self) -> str:
        """What one item of the train set is: an example, or a packed row of several."""
        return "packed rows" if getattr(self.data.train, "packed", False) else "examples"

    def epoch_order(self, epoch: int) -> list[int]:
        """Example order of an epoch: a pure function of (seed, epoch), so resume needs no replay.

        Kept for the current epoch: step_batches asks for it every step, and a
        permutation of a large dataset is not free.
        """
        cached = getattr(self, "_order_cache", None)
        if cached is not None and cached[0] == epoch:
            return cached[1]
        n = len(self.data.train)
        if not self.cfg.data.shuffle:
            order = list(range(n))
        else:
            g = torch.Generator().manual_seed(self.cfg.seed * 100_003 + epoch)
            order = torch.randperm(n, generator=g).tolist()
        if self.cfg.data.group_by_length:
            # Groups of 64 micro-batches: wide enough to find similar lengths, narrow enough to stay random.
            train = self.data.train
            lengths = train.lengths() if hasattr(train, "lengths") else [len(ex["input_ids"]) for ex in train]
            order = length_grouped(order, lengths, 64 * self.cfg.train.batch_size)
        self._order_cache = (epoch, order)
        return order

    def step_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """The grad_accum micro-batches this process trains on at optimizer step `step`."""
        epoch, index = divmod(step, self.steps_per_epoch)
        order = self.epoch_order(epoch)
        acc = self.accelerator
        bs = self.cfg.train.batch_size
        start = index * self.window
        batches = []
        for micro in range(self.cfg.train.grad_accum):
            base = start + micro * bs * acc.num_processes + acc.process_index * bs
            ids = order[base : base + bs]
            batch = self.collate([self.data.train[i] for i in ids])
            batches.append({k: v.to(acc.device) for k, v in batch.items()})
        return batches

    def accumulate_gradients(self, step: int) -> tuple[float, float, int]:
        """Backward over the step's window; returns (summed loss here, global target tokens, tokens here).

        Each micro-batch's summed loss is divided by the target-token count of the
        whole window on all processes, so the accumulated gradient is the gradient
        of the window's token-mean loss however the window is split.
        """
        acc, model = self.accelerator, self.model
        batches = self.step_batches(step)
        n_global = self._global_sum(sum(count_targets(b) for b in batches))
        # DDP averages gradients over processes: multiply back by their number.
        scale = acc.num_processes / max(n_global, 1)
        loss_total = 0.0
        for i, batch in enumerate(batches):
            # Only the last micro-batch of the window all-reduces (DDP) or reduce-scatters (FSDP) gradients.
            last = i == len(batches) - 1
            if self.strategy == "fsdp":
                model.set_requires_gradient_sync(last)
                ctx = nullcontext()
            else:
                ctx = acc.no_sync(model) if not last else nullcontext()
            with ctx:
                with self.activation_offload.saving() if self.activation_offload else nullcontext():
                    loss_sum, _ = self.compute_loss(model, batch)
                acc.backward(loss_sum * scale)
            loss_total += float(loss_sum.detach())
        tokens = sum(count_tokens(b) for b in batches)
        return loss_total, n_global, tokens

    # ------------------------------------------------------------------ eval

    @torch.no_grad()
    def evaluate_loss(self) -> float | None:
        if not self.data.eval:
            return None
        acc = self.accelerator
        bs = self.cfg.eval.batch_size or self.cfg.train.batch_size
        batches = [self.data.eval[i : i + bs] for i in range(0, len(self.data.eval), bs)]
        if self.cfg.eval.max_batches:
            batches = batches[: self.cfg.eval.max_batches]
        # The unwrapped model: a DDP forward joins collectives (buffer broadcast), and a
        # process with fewer eval batches than the others would leave them waiting.
        model = acc.unwrap_model(self.model)
        model.eval()
        total = count = 0.0
        mine = batches[acc.process_index :: acc.num_processes]
        # FSDP gathers weights inside every forward: all ranks must run as many forwards.
        # Ranks with fewer batches repeat one and discard its loss.
        rounds = math.ceil(len(batches) / acc.num_processes) if self.strategy == "fsdp" else len(mine)
        for r in range(rounds):
            rows = mine[r] if r < len(mine) else batches[0]
            batch = {k: v.to(acc.device) for k, v in self.collate(rows).items()}
            loss, n = self.compute_loss(model, batch)
            if r < len(mine):
                total += float(loss)
                count += n
        model.train()
        total, count = self._global_sum(total), self._global_sum(count)
        return total / count if count else None

    def exact_match_records(self) -> list[dict] | None:
        path = self.cfg.eval.exact_match_path
        if not path:
            return None
        records = load_records(resolve_path(path), self.cfg.data, key="eval.exact_match_path")
        return records[: self.cfg.eval.exact_match_limit] if self.cfg.eval.exact_match_limit else records

    def run_exact_match(self, records: list[dict], when: str) -> ExactMatch:
        model = self.accelerator.unwrap_model(self.model)
        result = exact_match(
            model, self.tokenizer, records, self.cfg.data.format, max_new_tokens=self.cfg.eval.max_new_tokens
        )
        self.say(f"eval ({when}): {result.summary()}")
        for s in result.samples:
            self.say(f"    expected {s['expected']!r:<30} got {s['got']!r}")
        return result

    # ------------------------------------------------------------------ resume

    @cached_property
    def fingerprint(self) -> str:
        """Hash of the tokenized train set: resuming on different data would not be the same run.

        Computed on first use (a checkpoint written or read), not at every start.
        """
        if hasattr(self.data.train, "fingerprint"):
            return self.data.train.fingerprint()
        h = hashlib.sha256()
        for ex in self.data.train:
            h.update(array("i", ex["input_ids"]).tobytes())
            h.update(array("i", ex["labels"]).tobytes())
        return h.hexdigest()[:16]

    def resume_candidates(self) -> list[Path]:
        cfg = self.cfg
        if cfg.resume == "auto":
            found = list(reversed(list_checkpoints(self.out)))
            if not found:
                self.say(f"resume=auto: no checkpoint in {self.out / 'checkpoints'}; starting from step 0")
            return found
        path = Path(cfg.resume)
        if not path.is_dir():
            raise CheckpointError(
                f"resume: checkpoint directory '{cfg.resume}' not found",
                hint=f"use resume=auto or one of {self.out / 'checkpoints'}/step-N",
            )
        return [path]

    def check_resume_compatible(self, path: Path, state: dict[str, Any]) -> None:
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

    def maybe_resume(self) -> dict[str, Any]:
        """Load the checkpoint to continue from (resume=auto: the newest readable one)."""
        if self.cfg.resume is None:
            return {}
        model = self.accelerator.unwrap_model(self.model)
        for path in self.resume_candidates():
            try:
                # All files are read and checked before anything is assigned, so a
                # corrupt checkpoint leaves the model and optimizer untouched.
                state = load_checkpoint(
                    path, model, self.optimizer, self.scheduler, check=self.check_resume_compatible,
                    rank=self.accelerator.process_index,
                )
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
            # Starting from step 0: rows of an earlier attempt would be read as this run's.
            mpath = self.out / "metrics.jsonl"
            if self.accelerator.is_main_process and mpath.exists():
                self.metrics.close()
                mpath.unlink()
            return {}
        self.say(f"resumed from {path} at step {state['step']}")
        # Rows logged after the checkpoint will be logged again: drop them.
        mpath = self.out / "metrics.jsonl"
        if self.accelerator.is_main_process and mpath.exists():
            kept = [r for r in read_metrics(mpath) if r.get("step", 0) <= state["step"]]
            self.metrics.close()
            mpath.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        return state

    def save_checkpoint(self, step: int, tokens: int, trained_tokens: int, elapsed_s: float) -> None:
        """Checkpoint after `step` completed optimizer steps (all ranks call this)."""
        acc = self.accelerator
        acc.wait_for_everyone()
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        model_state = optimizer_state = None
        if self.strategy == "fsdp":  # gathering is a collective: every rank takes part, rank 0 writes
            model_state = full_trainable_state(self.model)
            optimizer_state = full_optimizer_state(optimizer)
        rank_rng = None
        if acc.num_processes > 1:  # each rank's dropout streams (CPU and GPU), so each continues its own on resume
            import torch.distributed as dist

            rank_rng = [None] * acc.num_processes
            dist.all_gather_object(rank_rng, rng_states())
        if acc.is_main_process:
            save_checkpoint(
                self.out,
                step,
                acc.unwrap_model(self.model),
                optimizer,
                self.scheduler,
                {
                    "tokens": tokens,
                    "trained_tokens": trained_tokens,
                    "elapsed_s": elapsed_s,
                    "total_steps": self.total_steps,
                    "skipped_steps": self.skipped_steps,
                    "recipe": self.cfg.to_dict(),
                    "data_fingerprint": self.fingerprint,
                },
                keep_last=self.cfg.checkpoint.keep_last,
                model_state=model_state,
                optimizer_state=optimizer_state,
                rank_rng_states=rank_rng,
            )
        acc.wait_for_everyone()

    # ------------------------------------------------------------------ preemption

    STOP_SIGNALS = ("SIGTERM", "SIGUSR1")  # what Slurm (--signal) and Kubernetes send before killing

    def _install_signal_handlers(self) -> dict[int, Any]:
        """Turn SIGTERM/SIGUSR1 into a request to checkpoint and stop at the next step boundary."""
        self._stop_signal: str | None = None
        previous: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            return previous  # signal handlers can only be set from the main thread

        def request_stop(signum, frame):
            self._stop_signal = signal.Signals(signum).name

        for name in self.STOP_SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                previous[sig] = signal.signal(sig, request_stop)
        return previous

    def _stop_requested(self) -> bool:
        # Every rank must agree, or one would wait forever in the next collective.
        return self._global_sum(1.0 if self._stop_signal else 0.0) > 0

    # ------------------------------------------------------------------ the loop

    def close(self) -> None:
        """Free what outlives a run: the streamed-weights file (base_weights=disk) and the process
        group of a multi-process launch. The model is unusable after."""
        if self.stream is not None:
            self.stream.close()
        if self.accelerator is not None and self.accelerator.num_processes > 1:
            # A process group left to interpreter exit can abort a finished worker (seen once in
            # 10+ FSDP runs: SIGABRT, "terminate called without an active exception"); torch
            # asks for destroy_process_group before exit.
            self.accelerator.state.destroy_process_group()

    def train(self) -> TrainResult:
        try:
            return self._train()
        finally:
            # TensorBoard/W&B are closed however the run ends (done, NaN stop, preempted).
            if getattr(self, "metrics", None) is not None:
                self.metrics.finish()

    def _train(self) -> TrainResult:
        if self.accelerator is None:
            self.setup()
        cfg, acc = self.cfg, self.accelerator
        if acc.is_main_process:
            (self.out / "recipe.yaml").write_text(cfg.to_yaml(), encoding="utf-8")

        state = self.maybe_resume()
        start_step = int(state.get("step", 0))
        em_records = self.exact_match_records()
        em_before = None
        if em_records and start_step == 0:
            em_before = self.run_exact_match(em_records, "before training")

        self.say(
            f"training {self.total_steps} steps ({self.steps_per_epoch} per epoch; "
            f"{cfg.train.batch_size} x {cfg.train.grad_accum} accum x {acc.num_processes} proc = {self.window} {self.unit}/step), "
            f"precision {self.precision}"
        )
        self.model.train()
        speed = Throughput()
        progress = Progress(self.total_steps, initial=start_step, enabled=self.progress_enabled, is_main=acc.is_main_process)
        t_start = time.perf_counter() - float(state.get("elapsed_s", 0.0))
        tokens_total = int(state.get("tokens", 0))
        trained_total = int(state.get("trained_tokens", 0))
        loss_value = float("nan")
        if start_step >= self.total_steps:
            self.say(
                f"the run is already complete ({start_step} of {self.total_steps} steps): nothing to train; "
                "raise train.max_steps (or epochs) to extend it"
            )
            logged = [r["loss"] for r in read_metrics(self.out / "metrics.jsonl") if "loss" in r] if (self.out / "metrics.jsonl").exists() else []
            loss_value = logged[-1] if logged and logged[-1] is not None else loss_value
        eval_loss = None
        model = self.model
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.loss_ema: float | None = None
        previous_handlers = self._install_signal_handlers()
        try:
            for step in range(start_step, self.total_steps):
                speed.start()
                loss_total, n_global, step_tokens = self.accumulate_gradients(step)
                max_norm = cfg.train.max_grad_norm or float("inf")
                grad_norm = float(acc.clip_grad_norm_(self.params, max_norm))
                lr = self.scheduler.get_last_lr()[0]
                loss_value = self._global_sum(loss_total) / max(n_global, 1)
                done = step + 1
                # A non-finite loss or gradient must never reach the weights or the
                # optimizer state. (fp16: an inf gradient is the GradScaler's business;
                # it skips that step itself and lowers the scale.)
                finite = math.isfinite(loss_value) and (math.isfinite(grad_norm) or self.precision == "fp16")
                step_tokens_global = int(self._global_sum(step_tokens))
                if finite:
                    self.optimizer.step()
                    # The schedule follows applied updates: not a step the GradScaler skipped.
                    if not acc.optimizer_step_was_skipped:
                        self.scheduler.step()
                    tokens_total += step_tokens_global
                    trained_total += int(n_global)
                else:
                    self.skipped_steps += 1
                self.optimizer.zero_grad(set_to_none=True)
                speed.stop(step_tokens_global, int(n_global))
                progress.update(loss_value, speed.tokens_per_s, lr)
                row = {
                    "step": done,
                    "loss": loss_value,
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "tokens": step_tokens_global,
                    "trained_tokens": int(n_global),
                    "tokens_per_s": speed.tokens_per_s,
                    "elapsed_s": time.perf_counter() - t_start,
                }
                spike = finite and self.loss_ema is not None and loss_value > cfg.train.loss_spike_factor * self.loss_ema
                if spike:
                    row["spike"] = True
                    progress.write(f"step {done}: loss spike {loss_value:.4f} (> {cfg.train.loss_spike_factor} x recent mean {self.loss_ema:.4f})")
                if finite:
                    self.loss_ema = loss_value if self.loss_ema is None else 0.9 * self.loss_ema + 0.1 * loss_value
                else:
                    row["skipped"] = True
                if done % cfg.train.log_every_steps == 0 or done == self.total_steps or not finite or spike:
                    self.metrics.write(row)
                if not finite:
                    where = f"step {done}: loss {loss_value}, grad_norm {grad_norm}"
                    if cfg.train.on_nonfinite == "stop":
                        # The weights are still those of the last good step: keep them.
                        self.save_checkpoint(step, tokens_total, trained_total, time.perf_counter() - t_start)
                        raise TrainingError(
                            f"non-finite {where}; the update was not applied. Checkpoint of the last good state: "
                            f"{self.out / 'checkpoints' / f'step-{step}'}",
                            hint="lower train.lr, keep train.max_grad_norm set, check this step's data, "
                            "or set train.on_nonfinite=skip; resume=auto continues from the checkpoint",
                        )
                    progress.write(f"{where}: non-finite, update skipped ({self.skipped_steps} so far)")
                if cfg.eval.every_steps and (done % cfg.eval.every_steps == 0 or done == self.total_steps):
                    eval_loss = self.evaluate_loss()
                    if eval_loss is not None:
                        self.metrics.write({"step": done, "eval_loss": eval_loss})
                        progress.write(f"step {done}: eval_loss {eval_loss:.4f}")
                saved = False
                # The last step is checkpointed too: a finished run can be extended (more steps,
                # resume=auto) from where it ended instead of silently starting over.
                if cfg.checkpoint.every_steps and (done % cfg.checkpoint.every_steps == 0 or done == self.total_steps):
                    self.save_checkpoint(done, tokens_total, trained_total, time.perf_counter() - t_start)
                    saved = True
                if done < self.total_steps and self._stop_requested():
                    if not saved:
                        self.save_checkpoint(done, tokens_total, trained_total, time.perf_counter() - t_start)
                    raise Preempted(
                        f"{self._stop_signal or 'stop signal'} received: saved {self.out / 'checkpoints' / f'step-{done}'} "
                        f"and stopped after step {done} of {self.total_steps}",
                        hint="run the same command with resume=auto to continue exactly where it stopped",
                    )
        finally:
            progress.close()
            self.metrics.close()
            for sig, handler in previous_handlers.items():
                signal.signal(sig, handler)

        if eval_loss is None and self.data.eval and not cfg.eval.every_steps:
            eval_loss = self.evaluate_loss()
            if eval_loss is not None:
                self.metrics.write({"step": self.total_steps, "eval_loss": eval_loss})
                self.metrics.close()
        acc.wait_for_everyone()
        adapter_dir = self.out / "adapter"
        unwrapped = acc.unwrap_model(model)
        # Under FSDP every rank holds a shard: gather the whole adapter (all ranks), rank 0 writes it.
        full_state = full_trainable_state(unwrapped) if self.strategy == "fsdp" else None
        if acc.is_main_process:
            if cfg.lora is not None:
                save_adapter(unwrapped, adapter_dir, self.tokenizer, state_dict=full_state)
            else:
                save_adapter(unwrapped, self.out / "model", self.tokenizer)
                adapter_dir = self.out / "model"
        em_after = self.run_exact_match(em_records, "after training") if em_records else None
        plot = None
        if cfg.report.plot and acc.is_main_process:
            plot = plot_curves(self.out / "metrics.jsonl", self.out / PLOT_NAME, title=f"{self.out.name}: {cfg.model.path}")
        elapsed = time.perf_counter() - t_start
        result = TrainResult(
            final_loss=loss_value,
            steps=self.total_steps,
            tokens=tokens_total,
            trained_tokens=trained_total,
            elapsed_s=elapsed,
            peak_memory_bytes=peak_memory_bytes(acc.device),
            output_dir=self.out,
            adapter_dir=adapter_dir,
            metrics_path=self.out / "metrics.jsonl",
            exact_match_before=em_before,
            exact_match_after=em_after,
            eval_loss=eval_loss,
            extra={"plot": plot} if plot else {},
        )
        self.say(self.summary(result))
        return result

    def summary(self, r: TrainResult) -> str:
        mem_kind = "GPU memory" if self.accelerator.device.type == "cuda" else "RSS"
        lines = [
            "done.",
            f"  steps        {r.steps}",
            f"  final loss   {r.final_loss:.4f}" + (f"   eval loss {r.eval_loss:.4f}" if r.eval_loss is not None else ""),
            f"  tokens       {r.tokens:,} ({r.trained_tokens:,} trained)",
            f"  time         {human_duration(r.elapsed_s)}",
            f"  peak {mem_kind:<8}{human_bytes(r.peak_memory_bytes)}",
        ]
        if r.exact_match_before is not None or r.exact_match_after is not None:
            before = f"{100 * r.exact_match_before.accuracy:.1f}%" if r.exact_match_before else "-"
            after = f"{100 * r.exact_match_after.accuracy:.1f}%" if r.exact_match_after else "-"
            lines.append(f"  exact match  {before} -> {after}")
        lines.append(f"  adapter      {r.adapter_dir}")
        lines.append(f"  metrics      {r.metrics_path}")
        if r.extra.get("plot"):
            lines.append(f"  loss curve   {r.extra['plot']}")
        return "\n".join(lines)

