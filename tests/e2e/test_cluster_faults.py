"""Faults at cluster scale, on CPU with gloo (trainer/faults.py, trainer/order.py's Window, trainer/watch.py):
a rank frozen mid-run ends the job with exit 75 within distributed.timeout_s and the resumed run is the
uninterrupted one; a run resumed on another number of processes trains the same examples at every step;
a slowed rank is named. Waits follow the run's own progress (metrics rows, checkpoints), never fixed sleeps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import free_port, logged_steps
from test_distributed import ENV, _worker_pids, adapter, assert_adapters_close, finetune, losses, run_driver, write

pytestmark = pytest.mark.slow

TIMEOUT_S = 20  # distributed.timeout_s: short, with room for a loaded machine's slow moments

# Trains a recipe (argv[1], with the key=value overrides in $OVERRIDES) and writes, per rank, every example each
# optimizer step trains (its tokens, padding left out) to $IDS.rankR; with $SLOW_RANK, that rank sleeps
# $SLOW_S before collating each step (a straggler the others must wait for); with $SLOW_STAGE, that rank's
# pipeline stage sleeps $SLOW_S in each forward (inside the schedule, where the other stage waits on its sends); with
# $SLOW_MLP, that rank's decoder MLPs sleep $SLOW_S each (inside forward, where a tensor-parallel partner waits in the
# all-reduce after them and a context-parallel one in the ring's next transfer).
DRIVER = """
import json, os, sys, time
import finetune.parallel.stages as stages
from finetune.config.schema import load_recipe
from finetune.trainer import Trainer

from transformers.models.llama import modeling_llama

def slowed(forward, variable):
    def run(self, *args, **kwargs):
        if os.environ.get(variable) == os.environ["RANK"]:
            time.sleep(float(os.environ["SLOW_S"]))
        return forward(self, *args, **kwargs)
    return run

stages.Stage.forward = slowed(stages.Stage.forward, "SLOW_STAGE")
modeling_llama.LlamaMLP.forward = slowed(modeling_llama.LlamaMLP.forward, "SLOW_MLP")

class Recording(Trainer):
    def step_batches(self, step):
        if str(self.parallel.rank) == os.environ.get("SLOW_RANK"):
            time.sleep(float(os.environ["SLOW_S"]))
        batches = super().step_batches(step)
        if os.environ.get("IDS"):
            with open(f"{os.environ['IDS']}.rank{self.parallel.rank}", "a") as f:
                for b in batches:
                    for ids, mask in zip(b["input_ids"].tolist(), b["attention_mask"].tolist()):
                        f.write(json.dumps([step, [t for t, m in zip(ids, mask) if m]]) + "\\n")
        return batches

with Recording(load_recipe(sys.argv[1], os.environ.get("OVERRIDES", "").split()), progress=False) as trainer:
    trainer.train()
"""


def trained_per_step(ids: Path) -> dict[int, Counter]:
    """{step: multiset of the examples trained at it, every rank together}."""
    found: dict[int, Counter] = {}
    for path in ids.parent.glob(f"{ids.name}.rank*"):
        for step, tokens in map(json.loads, path.read_text().splitlines()):
            found.setdefault(step, Counter())[tuple(tokens)] += 1
    return found


@pytest.mark.parametrize(
    "nproc, split",
    # pp2 x tp2: the frozen rank is stage 0's second tensor-parallel share; its peers wait in a point-to-point
    # receive (the other stage) or an all-reduce (its tensor-parallel partner): the host watchdog ends them all.
    [(2, {}), (4, {"pipeline_parallel": 2, "tensor_parallel": 2, "pipeline_schedule": "1f1b", "pipeline_layers": "even"})],
    ids=["ddp", "pp2xtp2"],
)
def test_a_frozen_rank_ends_the_job_with_75_and_resume_finishes_the_same_run(recipe_dict, tmp_path, nproc, split):
    # 60 steps of ~40 ms (DDP): the freeze after step 5 lands long before the run could end.
    common = {
        "train__batch_size": 2,
        "train__grad_accum": 1 if nproc == 2 else 2,  # the pipeline's 2 micro-batches: 4 rows a step either way
        "train__max_steps": 60,
        "train__scheduler": "constant",
        "checkpoint": {"every_steps": 5},
        "distributed": {"timeout_s": TIMEOUT_S, **split},
    }
    ref_recipe, ref = write(tmp_path, recipe_dict, "ref", **common)
    finetune(str(ref_recipe), "--nproc", str(nproc), cwd=tmp_path)
    recipe, out = write(tmp_path, recipe_dict, "frozen", **common)
    job = finetune(str(recipe), "--nproc", str(nproc), cwd=tmp_path, log=tmp_path / "frozen.log")
    pid = job.wait_until(lambda: logged_steps(out) and _worker_pids(recipe).get(1), "rank 1 training")
    job.wait_until(lambda: len(logged_steps(out)) >= 5 and any(out.glob("checkpoints/step-*/manifest.json")), "step 5")
    os.kill(pid, signal.SIGSTOP)  # rank 1 hangs: alive, silent, deaf to SIGTERM
    frozen_at = time.monotonic()
    try:
        code = job.finish(TIMEOUT_S + 120)
    finally:
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGKILL)
    took = time.monotonic() - frozen_at
    assert code == 75, job.tail()
    assert took < TIMEOUT_S + 30, f"the job took {took:.0f} s to end after the freeze"
    assert "exiting 75 (restartable)" in job.output() and "left restartable" in job.output(), job.tail()
    stopped_at = max(logged_steps(out))
    assert stopped_at < 60
    # The same command with resume=auto finishes it: the uninterrupted run's losses and adapter, bitwise (a
    # pipeline's resume gathers and re-splits the shares: within rounding).
    proc = finetune(str(recipe), "--nproc", str(nproc), "resume=auto", cwd=tmp_path)
    assert "resumed from" in proc.stdout
    a, b = adapter(ref), adapter(out)
    if not split:
        assert losses(out) == losses(ref)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    else:
        assert losses(out) == pytest.approx(losses(ref), rel=1e-5)
        assert_adapters_close(a, b)


# 64 examples, 4 per step (2 x 1 accum x 2 processes, or 2 x 2 accum x 1): 16 steps an epoch.
EPOCH = {"train__max_steps": None, "train__epochs": 1, "train__scheduler": "constant", "train__batch_size": 2}


@pytest.fixture(scope="module")
def epoch_reference(tiny_model_dir, tmp_path_factory):
    """(recipe, {step: examples trained}, run folder): one epoch on 2 processes, uninterrupted, shared by the module."""
    from conftest import ALPACA_ROWS, tiny_recipe, write_jsonl

    root = tmp_path_factory.mktemp("epoch_reference")
    recipe = tiny_recipe(tiny_model_dir, write_jsonl(root / "train.jsonl", ALPACA_ROWS))
    ref_recipe, ref = write(root, recipe, "ref", train__grad_accum=1, **EPOCH)
    run_driver(root, DRIVER, ref_recipe, nproc=2, IDS=str(root / "ref-ids"))
    reference = trained_per_step(root / "ref-ids")
    assert sorted(reference) == list(range(16)) and all(sum(c.values()) == 4 for c in reference.values())
    return recipe, reference, ref


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_a_run_resumed_on_another_number_of_processes_trains_the_same_examples(epoch_reference, tmp_path, before, after):
    recipe_dict, reference, ref = epoch_reference
    recipe, out = write(tmp_path, recipe_dict, "moved", train__grad_accum=2 // before, checkpoint={"every_steps": 100}, **EPOCH)
    ids = str(tmp_path / "moved-ids")
    run_driver(tmp_path, DRIVER, recipe, before, IDS=ids, OVERRIDES="train.max_steps=7")  # stops (checkpoint) at 7
    proc = run_driver(tmp_path, DRIVER, recipe, after, IDS=ids, OVERRIDES="resume=auto")
    got = trained_per_step(tmp_path / "moved-ids")
    assert got == reference  # every step the same examples: none trained twice, none skipped
    # The run's 4 examples per step, cut for the new number of processes, said in one line.
    accum = 2 // after
    output = proc.stdout + proc.stderr
    replicas = f"{after} replica" + ("s" if after > 1 else "")
    assert f"resume: the run's 4 examples per step as 2 x {accum} accum x {replicas} (it had {before})" in output
    # The same run: the uninterrupted run's losses and adapter (float rounding: the window's sums are cut otherwise).
    assert losses(out) == pytest.approx(losses(ref), rel=1e-5)
    assert_adapters_close(adapter(ref), adapter(out))


# Where rank 1 is slow (1 s a step, against ~0.05 s of work: far past 1.5 x however a loaded machine stretches the
# rest): DDP's rank before collating (rank 0 waits in the step's first collective); a pipeline's last stage in its
# two forwards a step (rank 0 waits inside the schedule, for the activations' gradients: timed apart from its work).
SLOWED = {
    "ddp": ({}, {"SLOW_RANK": "1", "SLOW_S": "1.0"}),
    "pipeline": ({"pipeline_parallel": 2}, {"SLOW_STAGE": "1", "SLOW_S": "0.5"}),
    # rank 0 waits inside forward and backward, in collectives timed apart from its work (parallel/waits.py; FSDP's
    # through fsdp.time_gathers):
    # 2 layers x 2 micro-batches of sleeps a step (no checkpointing: no recompute)
    "tensor": ({"tensor_parallel": 2}, {"SLOW_MLP": "1", "SLOW_S": "0.3"}),
    "context": ({"context_parallel": 2}, {"SLOW_MLP": "1", "SLOW_S": "0.3"}),
    "fsdp": ({"strategy": "fsdp"}, {"SLOW_MLP": "1", "SLOW_S": "0.3"}),  # rank 0 waits for the next layer's all-gather
}


@pytest.mark.parametrize("layout", SLOWED)
def test_a_slowed_rank_is_named_as_a_straggler(recipe_dict, tmp_path, layout):
    split, slow = SLOWED[layout]
    recipe, out = write(
        tmp_path,
        recipe_dict,
        "slow",
        train__batch_size=2,
        train__grad_accum=2 if split else 1,  # 1f1b: a micro-batch per stage
        train__max_steps=6,
        distributed={"straggler_ratio": 1.5, "straggler_steps": 3, **split},
    )
    proc = run_driver(tmp_path, DRIVER, recipe, nproc=2, **slow)
    import socket

    warning = f"warning: step 3: rank 1 ({socket.gethostname()}) is a straggler:"
    assert warning in proc.stdout, proc.stdout[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r.get("straggler_rank") for r in steps] == [None, None, 1, 1, 1, 1]
    assert all(r["compute_s_max_rank"] == 1 and r["compute_s_max"] > 1.0 for r in steps)
    assert all(r["wait_s_max_rank"] == 0 and r["wait_s_max"] > 0.5 for r in steps)  # rank 0 waits for it


# The test's own allocation failure (or with $FAIL=bug, an error of another kind), in the workers `finetune run --nproc` starts (sitecustomize runs in every
# Python process on PYTHONPATH; LOCAL_RANK marks torchrun's workers): rank 1's forward in step $OOM_AT_STEP + 1
# fails while its micro-batch holds more than 2 examples: in compute_loss (one model a process) or in a pipeline
# stage's forward (which torch's pipelining engine re-raises wrapped in a RuntimeError).
INJECT = """
import os
if os.environ.get("LOCAL_RANK") is not None and os.environ.get("OOM_AT_STEP"):
    import torch
    import finetune.parallel.stages as stages
    import finetune.trainer.loop as loop

    at = {"step": -1}

    def fail(rows):
        if int(os.environ["RANK"]) == 1 and at["step"] == int(os.environ["OOM_AT_STEP"]) and rows > 2:
            if os.environ.get("FAIL") == "bug":
                raise ValueError("a bug of the test's own")
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (the test's own failure)")

    real_window, real_loss, real_stage = loop.Trainer.accumulate_gradients, loop.Trainer.compute_loss, stages.Stage.forward

    def accumulate_gradients(self, step):
        at["step"] = step
        return real_window(self, step)

    def compute_loss(self, model, batch):
        fail(batch["input_ids"].shape[0])
        return real_loss(self, model, batch)

    def forward(self, x, *args, **kwargs):
        fail(x.shape[0])
        return real_stage(self, x, *args, **kwargs)

    loop.Trainer.accumulate_gradients, loop.Trainer.compute_loss = accumulate_gradients, compute_loss
    stages.Stage.forward = forward
"""


def launch_failing(tmp_path: Path, recipe: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """`finetune run RECIPE --nproc 2 ARGS` with INJECT in its workers."""
    inject = tmp_path / "inject"
    inject.mkdir(exist_ok=True)
    (inject / "sitecustomize.py").write_text(INJECT)
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(inject), ENV.get("PYTHONPATH", "")]), **env}
    cmd = [sys.executable, "-m", "finetune", "run", str(recipe), "--nproc", "2", *args, "--no-progress"]
    return subprocess.run(
        [*cmd, "--master-port", str(free_port())], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420
    )


# (the recipe's keys besides micro-batches of 4, what the restart says): 8 examples a step in both. The reference is
# one process at 2 x 4 accum, which DDP and a pipeline equal (test_ddp.py, test_pipeline.py).
OOM_LAYOUTS = {
    "ddp": ({}, "grad_accum 2, micro-batch 2 (the recipe says 4 x 1)"),
    # 2 stages of 1 replica: the schedule runs 4 micro-batches after the restart, not the recipe's 2
    "pipeline": (
        {"distributed__pipeline_parallel": 2, "train__grad_accum": 2},
        "grad_accum 4, micro-batch 2 (the recipe says 4 x 2)",
    ),
}


@pytest.mark.parametrize("layout", OOM_LAYOUTS)
def test_out_of_memory_on_one_of_two_ranks_restarts_with_half_the_micro_batch(recipe_dict, tmp_path, layout):
    common = {
        "train__max_steps": 8,
        "train__scheduler": "constant",
        "train__max_grad_norm": None,
        "checkpoint": {"every_steps": 2},
    }
    split, resumed = OOM_LAYOUTS[layout]
    recipe, out = write(tmp_path, recipe_dict, "oom", train__batch_size=4, **common, **split)
    ref_recipe, ref = write(tmp_path, recipe_dict, "ref", train__batch_size=2, train__grad_accum=4, **common)
    finetune(str(ref_recipe), cwd=tmp_path)
    proc = launch_failing(tmp_path, recipe, "--max-restarts", "1", OOM_AT_STEP="4")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "rank 1: out of memory in step 5 at micro-batch 4; the restart uses micro-batch 2" in output
    assert "resumed from" in output and resumed in output, output[-4000:]
    # The same examples per step throughout: the losses of micro-batches of 2 from the start.
    assert losses(out) == pytest.approx(losses(ref), rel=1e-5)


def test_an_error_of_one_rank_is_not_taken_for_a_restartable_exit(recipe_dict, tmp_path):
    # Rank 1 fails on a bug: rank 0 sees its connection close and leaves restartable, but the job is not:
    # a restart would fail again (a Slurm requeue on 75 would loop).
    recipe, _ = write(tmp_path, recipe_dict, "bug", train__batch_size=4, train__max_steps=8)
    proc = launch_failing(tmp_path, recipe, OOM_AT_STEP="2", FAIL="bug")
    output = proc.stdout + proc.stderr
    assert "ValueError: a bug of the test's own" in output
    assert proc.returncode == 1, output[-3000:]


def test_an_elastic_job_that_loses_a_node_finishes_on_the_other_with_its_examples_per_step(recipe_dict, tmp_path):
    # Two launchers on this machine are the two "nodes" of `finetune run --nnodes 1:2` (one process each); node 1 is
    # killed whole (launcher, torchrun, worker) after a checkpoint. Node 0's worker sees its peer gone and leaves
    # restartable; its torchrun restarts it in a rendezvous of the one node left, which resumes on 1 replica with
    # twice the micro-batches: the 4 examples per step of the 2 nodes, so the losses of one process at 2 x 2.
    from conftest import Job

    common = {"train__batch_size": 2, "train__max_steps": 60, "train__scheduler": "constant", "checkpoint": {"every_steps": 4}}
    ref_recipe, ref = write(tmp_path, recipe_dict, "ref", train__grad_accum=2, **common)
    finetune(str(ref_recipe), cwd=tmp_path)
    recipe, out = write(tmp_path, recipe_dict, "elastic", **common, distributed={"timeout_s": TIMEOUT_S})
    # --elastic-wait 3: a rendezvous waits 3 s (not 30) for a second node once one has joined, at the start and after the loss.
    cmd = [sys.executable, "-m", "finetune", "run", str(recipe), "--nproc", "1", "--nnodes", "1:2", "--elastic-wait", "3"]
    cmd += ["--no-progress", "--master-port", str(port := free_port())]
    first = Job(cmd, tmp_path / "node0.log", cwd=tmp_path, env=ENV)
    first.wait_until(lambda: _listening(port), "node 0 hosting the rendezvous", 120)  # the node that must survive
    second = Job(cmd, tmp_path / "node1.log", cwd=tmp_path, env=ENV)
    first.wait_until(lambda: len(logged_steps(out)) >= 5 and any(out.glob("checkpoints/step-*/manifest.json")), "step 5", 180)
    for pid in _descendants(second.proc.pid):  # torchrun starts its workers in sessions of their own
        os.kill(pid, signal.SIGKILL)
    second.kill()
    assert first.finish(300) == 0, first.tail()
    said = first.output()
    assert "launching 1 process x 1 to 2 node(s)" in said and "parallel: ddp over 2 processes" in said, first.tail()
    assert "resume: the run's 4 examples per step as 2 x 2 accum x 1 replica (it had 2)" in said, first.tail()
    assert losses(out) == pytest.approx(losses(ref), rel=1e-5)


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _descendants(root: int) -> list[int]:
    """The processes started by `root`, its children's children included (through /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found
