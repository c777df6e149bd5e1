"""Pipeline parallelism's room, on torch.distributed.pipelining: each rank runs its stages' decoder layers,
micro-batches pass between ranks, the schedule (GPipe, 1F1B, interleaved 1F1B) orders them.

    pipeline = Pipeline(accelerator, cfg, layout, model_config, tensor)   # before loading: placement()
    model = pipeline.shard(model, dtype)                          # this rank's stages (of its tensor shares)
    loss_sum = pipeline.train_window(...)                         # forward + backward of the whole window
    pipeline.sync_gradients(params)                               # over the stage's replicas

A stage runs the model's own decoder forward (its masks, rotary angles, checkpointed layers) with the
decoder's layers swapped for the stage's (parallel/stages.py), the embeddings used only by the first stage
and the final norm only by the last; the last stage's output goes to the objective's head_loss (the chunked
loss kept). Each rank loads only its stages' modules (model/partial.py); a checkpoint gathers the stages'
adapter and optimizer state into the numbering one process uses, so any layout resumes any other.
Layout and rules: declarations/layout.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from finetune.declarations.layout import Layout, launch_problems
from finetune.declarations.splits import TENSOR
from finetune.errors import ConfigError, TrainingError
from finetune.model.load import head_owner
from finetune.parallel.context import KEY, runtime_problems, split_attention, split_batch
from finetune.parallel.grads import clip_to, squares, sum_over
from finetune.parallel.mesh import dim_group, dims_group
from finetune.parallel.room import SplitRoom, refuse_fp16
from finetune.parallel.stage_time import BusyClock
from finetune.parallel.stages import (
    Stage,
    _model_inputs,
    _padded_pairs,
    _padded_rows,
    _untrained,
    balanced_layers,
    pad_window,
    stage_placement,
)
from finetune.parallel.tensor import TensorParallel


class Pipeline(SplitRoom):
    """This rank's stages, and the schedules that run them (one per window shape)."""

    name = "pipeline"
    holds_whole_model = False  # each process holds its stages: no generating, no pair scoring

    def __init__(
        self, accelerator, cfg: Any, layout: Layout, model_config: Any, tensor: TensorParallel | None = None, mesh: Any = None
    ) -> None:
        if cfg.distributed.pipeline_layers == "auto":
            layout = replace(layout, splits=balanced_layers(cfg, layout.world, accelerator.device))
        super().__init__(accelerator, cfg, layout, mesh)
        self.device, self.model_config = accelerator.device, model_config  # the model's (text) config.json
        self.tensor = tensor  # tensor parallelism: each stage split over a group (parallel/tensor.py)
        self.objective: Any = None  # the Loss whose head_loss the last stage runs (the trainer sets it)
        self._schedules: dict[tuple[int, ...], Any] = {}  # one per micro-batch count, window shape and mode (train or not)
        self._head: Any = None  # what _loss computes on the last stage (set before each run of a schedule)
        self.micro_batches = cfg.train.grad_accum  # a step's (the last window's: a resume or backoff may cut it finer)
        self.clock = BusyClock(self.device)  # the last window's busy and whole seconds on this rank
        self.context_group = dim_group(mesh, "cp")  # cp x pp: the ranks whose pipelines run the other parts of the rows

    @classmethod
    def build(cls, accelerator, cfg: Any, layout: Layout, model_config: Any, mesh: Any) -> Pipeline:
        """A pipeline, of tensor-parallel shares where the recipe asks for them (each stage split)."""
        tensor = TensorParallel(accelerator, cfg, layout, model_config, mesh) if TENSOR.asked(cfg) else None
        return cls(accelerator, cfg, layout, model_config, tensor, mesh)

    @classmethod
    def problems(cls, cfg: Any, accelerator) -> list[str]:
        return runtime_problems(cfg, accelerator.device)  # cp x pp: what this GPU cannot run of the split attention

    def placement(self, device: torch.device) -> dict[str, Any]:
        """This rank's stages' modules on `device`, the rest on the meta device, never read."""
        tied = bool(getattr(self.model_config, "tie_word_embeddings", False))
        return stage_placement(self.layout, self.model_config.num_hidden_layers, tied, device)

    def shard(self, model: nn.Module, compute_dtype: torch.dtype) -> nn.Module:
        """This rank's stages (of its tensor-parallel shares)."""
        refuse_fp16(self.cfg, compute_dtype)
        if self.tensor is not None:
            model = self.tensor.shard(model, compute_dtype)
        if self.layout.cp > 1:  # each stage's attention over its part of the rows, the other parts' pipelines beside it
            model = split_attention(model)
        owner: Any = head_owner(model)
        if owner is not None:  # a model given in memory (Trainer.from_parts) is checked here
            text = owner.config.get_text_config()
            problems = launch_problems(self.cfg, self.layout.world, text.num_hidden_layers, text.model_type)
            if problems:
                raise ConfigError(problems)
        if owner is None or not hasattr(owner, "model") or not hasattr(owner.model, "layers"):
            raise TrainingError(
                "distributed.pipeline_parallel: found no decoder (model.model.layers) to split into stages",
                hint="set distributed.pipeline_parallel=1",
            )
        self.owner, self.decoder = owner, owner.model  # the *ForCausalLM (head, config) and its decoder
        self.model: Any = model  # the PeftModel: its adapter is switched off for a DPO reference pass
        n, layout = len(self.decoder.layers), self.layout
        self.stages = [
            Stage(self.decoder, *layout.layer_range(s, n), first=s == 0, last=s == layout.stage_count - 1)
            for s in layout.stages_of_rank
        ]
        # This rank's pipeline (its replica's stages of its tensor-parallel share; cp x pp: of its part of the rows),
        # and the ranks holding its stage's share: other rows, other parts of them (a collective: every rank asks).
        self.group, self.replica_group = dim_group(self.mesh, "pp"), dims_group(self.mesh, ("dp", "cp"))
        # Checkpoint gathers travel in host RAM: over NCCL an object gathered passes through GPU memory, and
        # rank 0 would receive every stage's adapter and optimizer state there at once.
        self.host_group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
        # The parameters whose gradients this rank computes: its layers', the embeddings' on the first stage,
        # the norm's and head's on the last (a model given whole to every rank holds the others unchanged).
        owned: list[nn.Module] = list(self.stages)
        if 0 in layout.stages_of_rank:
            owned.append(self.decoder.embed_tokens)
        if self.is_last:
            owned += [self.decoder.norm, owner.lm_head]
        self.owned = {id(p) for m in owned for p in m.parameters()}
        return model

    def local_part(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """cp x pp: this rank's part of every row (parallel/context.py), which its pipeline runs; else the batch."""
        layout = self.layout
        if layout.cp == 1:
            return batch
        mode = self.cfg.distributed.context_parallel_mode
        return split_batch(batch, tuple(layout.context_ranks()), layout.cp_rank, self.context_group, mode)

    def row_group(self) -> tuple[Any, int] | None:
        return (self.context_group, self.layout.context_ranks()[0]) if self.layout.cp > 1 else None

    @property
    def is_last(self) -> bool:
        return any(s.last for s in self.stages)

    @property
    def counts_window(self) -> bool:
        """Whether this rank's losses count: the last stage's (its first tensor-parallel rank's, when split:
        the group's ranks compute one loss; under cp x pp each part's, of its own targets); every stage holds its
        replica's window."""
        return self.is_last and (self.tensor is None or self.tensor.tp_rank == 0)

    def fit_objective(self, trainer_class: Any, base_compute_loss, objective) -> None:
        """Take the objective the last stage runs. A Trainer subclass's compute_loss cannot run: the model runs
        split over processes and the last stage computes the objective's head_loss."""
        if trainer_class.compute_loss is not base_compute_loss:
            raise ConfigError(
                [
                    f"distributed.pipeline_parallel: {trainer_class.__name__} overrides compute_loss, which a pipeline "
                    "cannot call (the model runs split over processes; the last stage computes the objective's "
                    "head_loss). Pass a finetune.Loss, or set distributed.pipeline_parallel=1."
                ]
            )
        self.objective = objective
        if getattr(objective, "ranks_pairs", False) and self.accelerator.is_main_process:
            print(
                "eval: preference accuracy is not scored in a pipeline (each process holds its stage); "
                f"`finetune eval {self.cfg.output_dir}` scores it"
            )

    @property
    def ideal_idle(self) -> float:  # type: ignore[override]  # a class-wide 0 in the other rooms
        """The schedule's idle share of a window, (P - 1) / V over m + (P - 1) / V."""
        layout, m = self.layout, self.micro_batches
        fill = (layout.pp - 1) / layout.virtual_stages
        return fill / (m + fill)

    @property
    def window_waited(self) -> float:  # type: ignore[override]  # a class-wide None in the other rooms
        """The last window's seconds outside this rank's forward, backward and loss: its sends, receives and bubble."""
        busy, whole = self.clock.last
        return max(0.0, whole - busy)

    def describe(self) -> str:
        d, layout = self.cfg.distributed, self.layout
        n = len(self.decoder.layers)
        counts = [hi - lo for lo, hi in (layout.layer_range(s, n) for s in range(layout.stage_count))]
        layers = str(counts[0]) if len(set(counts)) == 1 else " + ".join(map(str, counts))
        m, idle = self.micro_batches, self.ideal_idle
        return (
            f"parallel: pipeline: {layout.stage_count} stages of {layers} layers over {layout.pp} processes"
            + (f" x {layout.cp} context-parallel ranks ({d.context_parallel_mode}, each sequence split)" if layout.cp > 1 else "")
            + (f" x {layout.tp} tensor-parallel ranks (each layer split)" if layout.tp > 1 else "")
            + f" x {layout.replicas} "
            f"replica{'s' if layout.replicas > 1 else ''}, {d.pipeline_schedule}, {m} micro-batches per step (ideal idle time {idle:.0%}; "
            "raise train.grad_accum to shrink it)"
        )

    def held_out_sums(self, batches: list[dict[str, torch.Tensor]], rows: int) -> tuple[float, float]:
        """(summed loss, units) of this replica's share of the eval batches (each of at most `rows` rows), run
        forward through the stages grad_accum at a time; (0, 0) where they do not count (counts_window)."""
        mine, m, objective = batches[self.layout.replica :: self.layout.replicas], self.cfg.train.grad_accum, self.objective
        total = count = 0.0
        pairs = objective.ranks_pairs  # a batch of pairs is filled with pairs, its real ones counted
        for start in range(0, len(mine), m):
            given = mine[start : start + m]
            window = [self.local_part(_padded_pairs(b, rows) if pairs else _padded_rows(b, rows)) for b in given]
            counted = given if pairs else window[: len(given)]  # pairs: not the filler ones; rows: this part's targets
            window += [_untrained(window[0])] * (m - len(window))  # the schedule runs m micro-batches
            real = [objective.count(b) for b in given] + [0] * (m - len(given)) if pairs else None
            joined = self._joined(window)
            self._head = self._objective_head(objective, 1.0, self._extras(objective, joined, m, real), {})
            losses = self._run(joined, m, train=False)
            if self.counts_window:
                total += sum(float(loss) for loss in losses)
                count += sum(objective.count(b) for b in counted)
        return total, count

    def _joined(self, batches: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """The window's micro-batches as one batch (stages.pad_window); under cp x pp each micro-batch's context part
        handed to the stages, the window's padding added to the tokens after it (they attend only to themselves)."""
        joined = pad_window(batches, self.cfg.data.max_seq_len)
        length = joined["input_ids"].shape[1]
        given = [{KEY: replace(b[KEY], extra=b[KEY].extra + length - b["input_ids"].shape[1])} for b in batches if KEY in b]
        for stage in self.stages:
            stage.given = given
        return joined

    def _schedule_for(self, shape: tuple[int, ...]) -> Any:
        """The schedule for windows of this (micro-batches, rows, length, mode), built on first use (the engine then
        infers what it sends)."""
        if shape in self._schedules:
            return self._schedules[shape]
        from torch.distributed import pipelining as pp

        layout, d = self.layout, self.cfg.distributed
        stages: list[Any] = [
            pp.PipelineStage(stage, index, layout.stage_count, self.device, group=self.group)
            for stage, index in zip(self.stages, layout.stages_of_rank)
        ]
        for stage in stages:  # what the schedule calls per micro-batch: the rank's busy time (stage_time.py)
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, name, self.clock.timed(getattr(stage, name)))
        m, loss = shape[0], self.clock.timed(self._loss)
        schedule: Any
        if d.pipeline_schedule == "interleaved_1f1b":
            schedule = pp.ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss, scale_grads=False)
        else:
            kind = pp.ScheduleGPipe if d.pipeline_schedule == "gpipe" else pp.Schedule1F1B
            schedule = kind(stages[0], n_microbatches=m, loss_fn=loss, scale_grads=False)
        self._schedules[shape] = schedule
        return schedule

    def _loss(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """What the last stage computes from one micro-batch's final hidden states (the schedule's loss_fn):
        the objective's loss scaled for backward, or in a reference pass its rows' log-probabilities. The
        target is the labels with the micro-batch's index as a last column (_run): the engine also calls
        this once on the first micro-batch to infer gradient shapes, so calls are told apart by index."""
        return self._head(hidden, target[:, :-1], int(target[0, -1]))

    def _objective_head(self, objective, scale: float, extras: list[dict[str, Any]], sums: dict[int, dict[str, float]]):
        """Each micro-batch's loss with what it needs besides its hidden states (extras[index]); its metric
        sums kept by index in `sums` (a second call for one micro-batch replaces them)."""

        def head(hidden: torch.Tensor, labels: torch.Tensor, index: int) -> torch.Tensor:
            loss, _ = objective.head_loss(self.owner, hidden, labels, **extras[index])
            sums[index] = dict(objective.metric_sums())
            return loss * scale

        return head

    def _run(self, joined: dict[str, torch.Tensor], m: int, train: bool) -> list[torch.Tensor]:
        """The window through the stages in m micro-batches (train: forward and backward; else forward only,
        without gradients, on a schedule of its own: the engine re-infers shapes whenever one switches); what
        _loss returned for each micro-batch on the last stage, else []."""
        schedule = self._schedule_for((m, *joined["input_ids"].shape, train))
        rows = joined["labels"].shape[0]
        args = (joined["input_ids"],) if 0 in self.layout.stages_of_rank else ()
        kwargs: dict[str, Any] = dict(_model_inputs(joined))
        out: list[torch.Tensor] = []
        index = torch.arange(m, device=joined["labels"].device).repeat_interleave(rows // m)  # each row's micro-batch
        if self.stages[0].given:  # the stages look up each micro-batch's context part by it (read on the host: no sync)
            kwargs["micro"] = torch.arange(m).repeat_interleave(rows // m)
        if self.is_last:
            kwargs = {**kwargs, "target": torch.cat([joined["labels"], index[:, None]], dim=1), "losses": out}
        if train:
            schedule.step(*args, **kwargs)
        else:
            with torch.no_grad():
                schedule.eval(*args, **kwargs)
        return out

    def _extras(self, objective, joined: dict[str, torch.Tensor], m: int, real: list[int] | None) -> list[dict[str, Any]]:
        """Per micro-batch of the m, what the objective's head_loss takes besides hidden states: a DPO reference (its
        rows' log-probabilities, run through the stages first with the adapter off on every one) and the
        pairs that count (real: a short eval batch is filled)."""
        extras: list[dict[str, Any]] = [{} for _ in range(m)] if real is None else [{"real": n} for n in real]
        if objective.needs_reference:
            self._head = lambda hidden, labels, index: objective.reference_rows(self.owner, hidden, labels)
            with self.model.disable_adapter():
                rows = self._run(joined, m, train=False)
            found: list[Any] = rows or [None] * m  # the reference reaches the last stage only
            extras = [{**e, "reference": r} for e, r in zip(extras, found)]
        return extras

    def train_window(self, model, batches: list, objective, scale: float, micro_step, saving) -> tuple[float, dict[str, float]]:
        """Forward and backward of the window's micro-batches through the stages at once, each micro-batch's summed
        loss multiplied by `scale` (1 / the window's units); `saving` (the activations' context) held over the
        whole schedule. (The summed loss, the objective's metric sums) where they count (counts_window), else zeros."""
        window, m = self._joined(batches), len(batches)
        self.micro_batches = m  # grad_accum, or a resume's or out-of-memory backoff's cut of the window
        sums: dict[int, dict[str, float]] = {}
        with self.clock.window(), saving(), self.accelerator.autocast():  # autocast: no prepared model casts
            self._head = self._objective_head(objective, scale, self._extras(objective, window, m, None), sums)
            losses = self._run(window, m, train=True)
        totals = {k: sum(s.get(k, 0.0) for s in sums.values()) if self.counts_window else 0.0 for k in objective.metric_keys}
        if not self.counts_window:
            return 0.0, totals
        return sum(float(loss.detach()) for loss in losses) / scale, totals

    def sync_gradients(self, params: list[nn.Parameter]) -> None:
        """Each stage's gradients summed over its replicas (the same parameters, other examples) and under cp x pp its
        other parts of the rows; split over a tensor-parallel group, the group's partial ones first."""
        if self.tensor is not None:
            self.tensor.sum_gradients(params)  # the group only: its replica sum is this one
        if self.layout.replicas * self.layout.cp > 1:
            sum_over(params, self.replica_group)

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> float:
        """The norm of the whole gradient (every stage's part, summed in squares over the pipeline) and
        clipping to max_norm with it, by torch's rule."""
        total = self.tensor.squares(params) if self.tensor is not None else squares(params, self.device)
        dist.all_reduce(total, group=self.group)
        return clip_to(params, float(total.sqrt()), max_norm)

    def _whole(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A tensor on CPU, whole: a tensor-parallel share gathered over its group (a collective), else itself."""
        if self.tensor is not None:
            return self.tensor.whole(name, t)
        return t.detach().cpu()

    def stage_times(self, every_rank) -> list[tuple[float, ...]]:
        """Each stage's (busy, whole) seconds in the last window, of replica 0's pipeline (tensor-parallel rank 0's);
        every_rank: the collective that brings every rank's values."""
        every = every_rank(*self.clock.last)
        return [every[r] for r in self.layout.pipeline_ranks(0, 0, 0)]

    # ------------------------------------------------------------------ whole states for a checkpoint

    def full_states(self, model, optimizer) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any] | None]:
        unwrapped = self.unwrap(model)
        return self.whole_trainable_state(unwrapped), self.whole_optimizer_state(unwrapped, optimizer)

    def full_weights(self, model) -> dict[str, torch.Tensor] | None:
        return self.whole_trainable_state(model)

    def _gathered(self, mine: Any) -> list[Any] | None:
        """Every rank's object on rank 0 (a collective); only the first replica's first context- and tensor-parallel
        rank sends (the others hold the same stage, or its whole tensors gathered already)."""
        parts: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        sends = self.layout.replica == 0 and self.layout.cp_rank == 0 and self.layout.tp_rank == 0
        dist.gather_object(mine if sends else None, parts, dst=0, group=self.host_group)
        return parts

    def whole_trainable_state(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """{name: tensor on CPU} of every trained parameter, as one process names them, on rank 0 (else None)."""
        mine = {n: self._whole(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) in self.owned}
        parts = self._gathered(mine)
        return None if parts is None else {k: v for part in parts if part for k, v in part.items()}

    def whole_optimizer_state(self, model: nn.Module, optimizer: Any) -> dict[str, Any] | None:
        """The optimizer state as one process's optimizer numbers it (one parameter group), on rank 0."""
        sd = optimizer.state_dict()
        if len(sd["param_groups"]) != 1:
            raise TrainingError(
                f"distributed.pipeline_parallel checkpoints an optimizer with one parameter group; this one has "
                f"{len(sd['param_groups'])}",
                hint="pass an optimizer with one group (Trainer(optimizer=lambda ps: ...)), or set distributed.pipeline_parallel=1",
            )
        trainable = [p for p in model.parameters() if p.requires_grad]
        index = {id(p): i for i, p in enumerate(trainable)}  # one process's optimizer numbers them so
        params = optimizer.param_groups[0]["params"]
        names = {id(p): n for n, p in model.named_parameters()}  # a split tensor's moments are gathered as it is
        mine = {
            index[id(params[local])]: {
                k: (self._whole(names[id(params[local])], v) if torch.is_tensor(v) else v) for k, v in sorted(s.items())
            }
            for local, s in sd["state"].items()
            if id(params[local]) in self.owned
        }
        parts = self._gathered(mine)
        if parts is None:
            return None
        state = {index: s for part in parts if part for index, s in sorted(part.items())}
        group = {**sd["param_groups"][0], "params": list(range(len(trainable)))}
        return {"state": dict(sorted(state.items())), "param_groups": [group]}
