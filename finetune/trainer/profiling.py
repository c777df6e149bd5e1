"""Profiling and MFU: model FLOPs utilization on every step, torch.profiler over the steps of profile.steps.

    finetune run demo-cpu --profile 5-7        # = profile.steps=5-7

ModelFlops (every run) adds to each step's row (metrics.jsonl, the progress bar):
    tflops  the model's FLOPs per second, over this launch so far like tokens_per_s (eval and checkpoints
            left out): FLOPs per token from the planner's formula (finetune/plan/speed.py token_flops:
            matmuls with LoRA's, attention at the step's mean row length, the backward, DPO's reference
            forwards; recomputation is not model work) averaged over the tokens trained, x tokens_per_s
    mfu     tflops over the peak of the run's devices (processes x one device's peak): a GPU that
            finetune/gpus.py knows, in bf16/fp16: its spec-sheet dense rate; a CPU, an unknown GPU or
            fp32: measured once per process, the best rate of square matmuls in the run's precision

StepProfiler (profile.steps: "5-7") records those optimizer steps (warmed up over the step before) and
writes output_dir/profile/rankR-stepsA-B.pt.trace.json (Chrome/Perfetto JSON; TensorBoard's profiler
plugin reads the folder), and on CUDA rankR-stepsA-B.memory.pickle (a memory snapshot for
pytorch.org/memory_viz: written, never read here). The log gets the top ops by self time and, for a
multi-process run, rank 0's time in collectives against the rest. Neither changes a number of the run:
they only read clocks, and the matmuls that measure a peak draw from a generator of their own.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import torch

from finetune.errors import PlanError
from finetune.gpus import gpu_for_device
from finetune.hardware import torch_dtype
from finetune.parallel import waits
from finetune.plan import RecipeFacts, model_shape_of, setup_of, trainable_params
from finetune.plan.speed import token_flops
from finetune.trainer.callbacks import Callback
from finetune.trainer.state import TrainState

# Ops that are communication: c10d's ops and torch's collective annotation, gloo's and NCCL's kernels.
COMM_OPS = re.compile(r"nccl|gloo|c10d::|record_param_comms|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all", re.I)
TABLE_ROWS = 15
MEMORY_EVENTS = 100_000  # allocation events the CUDA memory history keeps (its ring buffer)
_MEASURED: dict[tuple[str, torch.dtype], float] = {}


def _say(trainer, text: str) -> None:
    """A line above the progress bar, on the main process."""
    if trainer.parallel.is_main:
        from tqdm.auto import tqdm

        tqdm.write(text)


def measured_matmul_tflops(device: torch.device, dtype: torch.dtype, seconds: float = 0.3) -> float:
    """The best rate (TFLOP/s) of square matmuls in `dtype` on `device` over ~`seconds`; once per process."""
    key = (str(device), dtype)
    if key not in _MEASURED:
        cuda = device.type == "cuda"
        n, batch = (8192, 5) if cuda else (1024, 1)  # large enough to keep every core (or SM) busy
        # A generator of its own: the run's random streams (dropout, data order) are not advanced.
        gen = torch.Generator(device=device).manual_seed(0)
        a, b = (torch.randn(n, n, generator=gen, device=device).to(dtype) for _ in range(2))

        def timed() -> float:
            t0 = time.perf_counter()
            for _ in range(batch):
                a @ b
            if cuda:
                torch.cuda.synchronize(device)
            return time.perf_counter() - t0

        timed()  # the first call pays for kernel selection and thread start-up
        best, runs, deadline = float("inf"), 0, time.perf_counter() + seconds
        while runs < 3 or time.perf_counter() < deadline:
            best, runs = min(best, timed()), runs + 1
        _MEASURED[key] = 2 * n**3 * batch / best / 1e12
    return _MEASURED[key]


def device_peak(device: torch.device, precision: str) -> tuple[float, str]:
    """(peak TFLOP/s of one device in the run's precision, where the number comes from)."""
    if device.type == "cuda" and precision != "fp32":
        props = torch.cuda.get_device_properties(device)
        spec = gpu_for_device(props.name, props.total_memory)
        if spec.name != props.name:  # a catalogue card (an unknown one keeps torch's name and a guessed speed)
            return spec.bf16_tflops, f"{spec.description.split(' (')[0]}, spec-sheet dense {precision}"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return measured_matmul_tflops(device, torch_dtype(precision)), f"{name}, {precision} matmul measured"


class ModelFlops(Callback):
    """tflops and mfu in every step's row (see the module's docstring); none when the model's shape cannot be read."""

    adds_metrics = True

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.flops = self.tokens = 0.0
        self.peak = 0.0
        self.shape: Any = None

    def on_train_begin(self, state: TrainState, metrics: dict[str, Any]) -> None:
        t = self.trainer
        self.flops = self.tokens = 0.0  # tokens_per_s counts this launch only: so do these
        try:
            self.shape = model_shape_of(t.cfg)
        except PlanError as exc:  # e.g. Trainer.from_parts on a model built in memory, with no config.json
            self.shape = None
            _say(t, f"mfu: not reported: the planner cannot read the model's shape ({exc})")
            return
        self.recipe = RecipeFacts.from_config(t.cfg, t.precision, on_gpu=t.accelerator.device.type == "cuda")
        self.setup = setup_of(t.cfg, gpus=t.parallel.world)
        self.trainable = trainable_params(self.shape, self.recipe)
        self.peak, how = device_peak(t.accelerator.device, t.precision)
        example = self.per_token(float(self.setup.seq_len))
        _say(
            t,
            f"mfu: model FLOPs per token from the planner's formula ({example:,.0f} in rows of {self.setup.seq_len} "
            f"tokens; each step at its mean row length) over {t.parallel.world} x {self.peak:.4g} TFLOP/s ({how})",
        )

    def per_token(self, row_length: float) -> float:
        """Model FLOPs per token in rows of `row_length` tokens (finetune/plan/speed.py token_flops)."""
        return token_flops(self.shape, self.recipe, self.setup, self.trainable, seq_len=row_length).model

    def on_step_end(self, state: TrainState, metrics: dict[str, Any]) -> None:
        if self.shape is None or not metrics["tokens"]:
            return
        rows = state.window * self.setup.sequences_per_example  # sequences in the step, all processes
        self.flops += metrics["tokens"] * self.per_token(metrics["tokens"] / rows)
        self.tokens += metrics["tokens"]
        metrics["tflops"] = self.flops / self.tokens * metrics["tokens_per_s"] / 1e12
        metrics["mfu"] = metrics["tflops"] / (self.peak * self.trainer.parallel.world)


class StageTimes(Callback):
    """A pipeline's measured time in each step's row (parallel/stage_time.py): stage_busy_s, each pipeline rank's
    forward, backward and loss time in the step's window (the first replica's, in order along the pipe), and
    bubble, the mean over them of the window's idle share (waiting on the other stages and on the sends).
    At the end, the mean bubble beside the schedule's ideal one."""

    adds_metrics = True

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.bubbles: list[float] = []

    def on_step_end(self, state: TrainState, metrics: dict[str, Any]) -> None:
        ranks = self.trainer.parallel.stage_times()  # a collective where there are stages: every rank gets here
        if ranks is None:
            return
        metrics["stage_busy_s"] = [round(busy, 6) for busy, _ in ranks]
        metrics["bubble"] = sum(1 - busy / whole for busy, whole in ranks if whole) / len(ranks)
        if state.step > 1:  # the first window of a run also infers the shapes the stages send
            self.bubbles.append(metrics["bubble"])

    def on_train_end(self, state: TrainState, metrics: dict[str, Any]) -> None:
        if self.bubbles:  # only a pipeline's stages measure any
            measured, ideal = sum(self.bubbles) / len(self.bubbles), self.trainer.parallel.ideal_idle
            _say(self.trainer, f"pipeline: idle {measured:.0%} of each window, measured ({ideal:.0%} ideal)")


class StepProfiler(Callback):
    """torch.profiler over optimizer steps FIRST..LAST of profile.steps (see the module's docstring)."""

    def __init__(self, trainer: Any, steps: str) -> None:
        first, _, last = steps.partition("-")
        self.trainer, self.first, self.last = trainer, int(first), int(last or first)
        self.end = self.last  # the last step recorded: LAST, or the run's last step before it
        self.prof: Any = None
        self.recording: int | None = None  # the first step recorded, once recording
        self.label: Any = None  # the open "train step N" range of the trace

    def on_train_begin(self, state: TrainState, metrics: dict[str, Any]) -> None:
        start, total = metrics["start_step"], metrics["total_steps"]
        self.end = min(self.last, total)
        if self.first > total:
            _say(self.trainer, f"profile: steps {self.first}-{self.last} lie past the run's {total} steps: nothing is recorded")
        elif self.end <= start:
            _say(self.trainer, f"profile: steps {self.first}-{self.last} ran before step {start}, where this launch resumed")

    def on_step_begin(self, state: TrainState, metrics: dict[str, Any]) -> None:
        step = metrics["step"]
        if (step == self.first - 1 and self.first <= self.end) or (self.prof is None and self.first <= step <= self.end):
            self._open()  # the step before FIRST warms the profiler up, so FIRST is not charged for its start
        if not self.first <= step <= self.end:
            return
        if self.recording is None:
            self.recording = step
            if self._memory_timeline():
                torch.cuda.memory._record_memory_history(max_entries=MEMORY_EVENTS)
            self.prof.start_trace()
        if self.label is not None:
            self.label.__exit__(None, None, None)
        self.label = torch.profiler.record_function(f"train step {step}")
        self.label.__enter__()

    def on_step_end(self, state: TrainState, metrics: dict[str, Any]) -> None:
        if self.recording is not None and metrics["step"] >= self.end:
            self._close(metrics["step"])

    def on_train_end(self, state: TrainState, metrics: dict[str, Any]) -> None:
        if self.prof is not None:  # the run ended inside the range (a callback or signal stopped it)
            self._close(state.step)

    def on_train_exit(self, state: TrainState, metrics: dict[str, Any]) -> None:
        """An error or a signal inside the range: stop tracing and memory recording, write nothing (a
        profiler left on would refuse the next run in this process, e.g. a notebook's)."""
        prof, recording, self.prof, self.recording = self.prof, self.recording, None, None
        if self.label is not None:
            self.label.__exit__(None, None, None)
            self.label = None
        if prof is None:
            return
        if recording is None:  # only warmed up (prepared): started and stopped at once, as _close does
            prof.start_trace()
        prof.stop_trace()
        if recording is not None and self._memory_timeline():
            torch.cuda.memory._record_memory_history(enabled=None)

    def _memory_timeline(self) -> bool:
        return self.trainer.cfg.profile.memory_timeline and self.trainer.accelerator.device.type == "cuda"

    def _open(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.trainer.accelerator.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
        self.prof.prepare_trace()

    def _close(self, last: int) -> None:
        prof, first = self.prof, self.recording
        self.prof, self.recording = None, None
        if self.label is not None:
            self.label.__exit__(None, None, None)
            self.label = None
        if first is None:  # warmed up, but the run ended before FIRST
            prof.start_trace()
            prof.stop_trace()
            return
        prof.stop_trace()
        t = self.trainer
        out = Path(t.cfg.output_dir) / "profile"
        out.mkdir(parents=True, exist_ok=True)
        name = f"rank{t.parallel.rank}-steps{first}-{last}"
        trace = out / f"{name}.pt.trace.json"
        prof.export_chrome_trace(str(trace))
        written = [trace]
        if self._memory_timeline():
            torch.cuda.memory._dump_snapshot(str(out / f"{name}.memory.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
            written.append(out / f"{name}.memory.pickle")
        _say(t, op_report(prof.key_averages(), t.accelerator.device.type == "cuda", t.parallel.world, first, last))
        _say(t, f"profile: wrote {', '.join(str(p) for p in written)} (open the trace at ui.perfetto.dev)")


def op_report(averages, cuda: bool, world: int, first: int, last: int) -> str:
    """The top ops by self time and, for a multi-process run, the time in collectives against the rest."""
    kind = "GPU" if cuda else "CPU"
    lines = [f"profile: steps {first}-{last}, top {TABLE_ROWS} ops by self {kind} time (this process)"]
    lines.append(averages.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=TABLE_ROWS))
    if world > 1:
        comm, compute = comm_and_compute_us(averages, cuda)
        share = comm / (comm + compute) if comm + compute else 0.0
        lines.append(
            f"profile: collectives {comm / 1e3:,.1f} ms ({share:.1%}), other ops {compute / 1e3:,.1f} ms ({1 - share:.1%}) "
            f"of {kind} time on this process over steps {first}-{last}"
            + ("" if cuda else " (gloo runs collectives on threads of its own: they overlap the rest)")
        )
    return "\n".join(lines)


def comm_and_compute_us(averages, cuda: bool) -> tuple[float, float]:
    """(time in collectives, self time of the other ops) in microseconds, from key_averages(). On a GPU the
    self time of kernels (NCCL's are collectives); on a CPU gloo's collectives are async events on threads
    of their own, with no self time: their duration counts. Our "train step N" ranges are not ops."""
    comm = compute = 0.0
    for evt in averages:
        if evt.key.startswith("train step "):
            continue
        spent = float(evt.self_device_time_total if cuda else evt.self_cpu_time_total)
        if COMM_OPS.search(evt.key):
            comm += spent or (0.0 if cuda else float(evt.cpu_time_total))
        else:
            compute += spent
    return comm, compute


class StepClock:
    """This rank's own work in a step, apart from its waits for the others (what a straggler is found by:
    trainer/watch.py). Waits it knows of: the collectives the loop times (waiting()), and a DDP reducer's
    wait for the other ranks' gradients at the end of backward, which starts after autograd has finished
    this rank's graph (a callback queued from the loss's hook runs before the reducer's), and a pipeline's
    sends, receives and bubble (its window outside the stages' own forward and backward: parallel/stage_time.py), and
    tensor and context parallelism's and FSDP's collectives inside forward and backward (parallel/waits.py)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.t0 = self.waited = self.collectives = 0.0
        self.local_done: float | None = None

    def start(self) -> None:
        waits.taken()  # the collectives before this step: not this step's
        waits.recording(True)
        self.t0, self.waited, self.local_done, self.collectives = time.perf_counter(), 0.0, None, 0.0

    def waiting(self) -> _Waiting:
        return _Waiting(self)

    def mark_backward(self, loss: torch.Tensor) -> None:
        """Note when backward of `loss` has run this rank's part (call before backward)."""
        if loss.requires_grad:
            loss.register_hook(self._queue)

    def _queue(self, grad: torch.Tensor) -> torch.Tensor:
        torch.autograd.Variable._execution_engine.queue_callback(self._done)
        return grad

    def window_ended(self, waited: float) -> None:
        """A window a room timed itself (a pipeline's): `waited` seconds of it were waits, and this rank's work ends
        here (the collectives after it wait for the slowest stage)."""
        self.waited += waited
        self.local_done = time.perf_counter()
        self.collectives += waits.taken()  # those inside the window (after it: not this rank's work anyway)

    def _done(self) -> None:
        if self.cuda:  # the compute stream only: the reducer's communication runs on its own
            torch.cuda.current_stream().synchronize()
        self.local_done = time.perf_counter()
        self.collectives += waits.taken()  # the collectives inside this micro-batch's forward and backward

    def stop(self) -> tuple[float, float]:
        """(compute_s, step_s) of the step since start()."""
        after = waits.taken()  # since local_done (FSDP's last reduce-scatters): outside the work it ends
        waits.recording(False)
        self.waited += self.collectives if self.local_done is not None else after
        end = time.perf_counter()
        return max(0.0, (self.local_done or end) - self.t0 - self.waited), end - self.t0


class _Waiting:
    def __init__(self, clock: StepClock):
        self.clock = clock

    def __enter__(self) -> None:
        self.t = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.clock.waited += time.perf_counter() - self.t
