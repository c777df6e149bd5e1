"""Multi-process training on CPU (gloo): FSDP2 with a 4-bit base, resume across world sizes, and an elastic
restart after a rank is killed (two "nodes" on one machine: tests/e2e/test_ddp.py).

Runs that are signalled, killed or restarted go through the real launcher (`finetune run --nproc N`); runs to
their end through torchrun directly or in this process (`finetune()` says why).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import CLOSED_AT_EXIT, Job, assert_same_steps, free_port, logged_steps
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


def write(tmp_path: Path, recipe_dict: dict, name: str, **changes) -> tuple[Path, Path]:
    data = json.loads(json.dumps(recipe_dict))
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            data.setdefault(section, {})[field] = value
        else:
            data[section] = value
    out = tmp_path / name
    data["output_dir"] = str(out)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, out


def finetune(*args: str, cwd: Path, port: int | None = None, timeout: int = 420, log: Path | None = None):
    """`finetune run ARGS` to a successful end on a free rendezvous port (or `port`, for launchers that must meet);
    with `log`, started through the launcher as a Job writing its output there (signals, exits, restarts).

    A run to its end goes the shortest way a user can run it, which trains the same numbers: `--nproc N` through
    torchrun directly (`torchrun -m finetune run`, as Slurm and Kubernetes start it; the launcher's own checks,
    signals and exit codes are the Job runs' and test_cli_e2e's), one process in this process (`finetune.cli.main`):
    each skips a Python process's imports (~5 CPU-s), which are most of a tiny run's cost."""
    flags = ("--nproc", "--nnodes", "--max-restarts")
    rest = [a for i, a in enumerate(args) if a not in flags and (i == 0 or args[i - 1] not in flags)]  # the run's own
    if log is not None or any(a in ("--nnodes", "--max-restarts") for a in args):
        cmd = [sys.executable, "-m", "finetune", "run", *args, "--no-progress", "--master-port", str(port or free_port())]
        if log is not None:
            return Job(cmd, log, cwd=cwd, env=ENV)
        proc = subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)
    elif "--nproc" in args and (nproc := args[args.index("--nproc") + 1]) != "1":
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            nproc,
            "--master_port",
            str(port or free_port()),
        ]
        proc = subprocess.run(
            [*cmd, "-m", "finetune", "run", *rest, "--no-progress"],
            cwd=cwd,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    else:
        proc = run_here(["run", *rest, "--no-progress"], cwd)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def run_here(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`finetune ARGV` in this process (its output captured), from `cwd`."""
    import contextlib
    import io

    from finetune.cli.commands import main

    out, err, before = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    finally:
        os.chdir(before)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def run_driver(tmp_path: Path, source: str, recipe: Path, nproc: int = 2, **env: str) -> subprocess.CompletedProcess:
    """A test's own Python driver (source: a script taking the recipe path) under torchrun, to a successful end;
    env: the variables it reads (e.g. the fault it injects). Fails too when a rank left its process group to
    the interpreter's teardown (CLOSED_AT_EXIT)."""
    driver = tmp_path / "driver.py"
    driver.write_text(CLOSED_AT_EXIT + source)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port())]
    proc = subprocess.run(
        [*cmd, str(driver), str(recipe)], cwd=tmp_path, env={**ENV, **env}, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def preempt_after(job: Job, out: Path, logged: int) -> str:
    """SIGTERM a launched job (what Slurm/Kubernetes send) once `logged` steps are in its metrics.jsonl
    (training is under way, its handlers set); it must checkpoint and exit 75. Its output."""
    job.wait_until(lambda: len(logged_steps(out)) >= logged, f"{logged} steps in {out / 'metrics.jsonl'}")
    job.proc.send_signal(signal.SIGTERM)
    assert job.finish(300) == 75, job.tail()
    return job.output()


def stopped_under_sigterm(recipe: Path, out: Path, cwd: Path, nproc: int = 2) -> int:
    """Launch `recipe` on nproc processes for 400 steps (it cannot end before the signal lands), SIGTERM it
    after 2 logged steps; the step of the checkpoint it left."""
    job = finetune(str(recipe), "--nproc", str(nproc), "train.max_steps=400", cwd=cwd, log=cwd / f"{out.name}.log")
    assert "checkpoint" in preempt_after(job, out, 2)
    return max(int(m.parent.name.split("-")[1]) for m in (out / "checkpoints").glob("step-*/manifest.json"))


def assert_adapters_close(a: dict, b: dict, atol: float = 1e-5) -> None:
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        assert a[k].shape == b[k].shape, k
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=atol)


def test_fsdp_qlora_two_processes_match_one(recipe_dict, tmp_path):
    # 4-bit base (stored in fp32 so FSDP can shard it), LoRA sharded per decoder layer; the loss in chunks of 16
    # targets (FSDP's root, the head with it, stays gathered after the forward for them; one process: whole logits).
    # Clipping off: the gradient norms before clipping must agree too (a wrong scale hides behind clipping).
    common = {
        "quant": {"bits": 4},
        "train__max_steps": 4,
        "train__grad_accum": 2,
        "checkpoint": {"every_steps": 2},
        "train__max_grad_norm": None,
    }
    one_recipe, one = write(tmp_path, recipe_dict, "one", train__batch_size=4, **common)
    chunked = {"loss": "chunked", "loss_chunk": 16}
    two_recipe, two = write(
        tmp_path, recipe_dict, "two", train__batch_size=2, distributed={"strategy": "fsdp"}, memory=chunked, **common
    )
    finetune(str(one_recipe), cwd=tmp_path)
    proc = finetune(str(two_recipe), "--nproc", "2", cwd=tmp_path)
    assert "parallel: fsdp over 2 processes" in proc.stdout
    assert "post-processes its logits" not in proc.stdout + proc.stderr  # the chunked head's check passed: it ran
    l1, l2 = losses(one), losses(two)
    assert len(l1) == len(l2) == 4 and all(0 < x < 20 for x in l2)
    assert_same_steps(one, two, rel=1e-5)
    assert l2[-1] < l2[0]
    # The saved adapter is whole (every rank's shard gathered) and equals the single-process one.
    assert_adapters_close(adapter(one), adapter(two))
    # ...and so is the periodic checkpoint's, which vanilla peft reads on one process.
    ck = load_file(str(two / "checkpoints" / "step-2" / "adapter" / "adapter_model.safetensors"))
    assert {k: v.shape for k, v in ck.items()} == {k: v.shape for k, v in adapter(one).items()}


@pytest.mark.parametrize("strategy", ["fsdp"])  # DDP: tests/e2e/test_cluster_faults.py (2 -> 1 and 1 -> 2, example by example)
def test_save_on_two_resume_on_one(recipe_dict, tmp_path, strategy):
    # Uninterrupted on 2 processes; then stopped at step 3 (max_steps) and resumed to step 6 on 1 (2 -> 2 resumes:
    # tests/e2e/test_compression_ddp.py, test_cluster_faults.py). Same global batch (2 x 2 processes = 4 x 1), so
    # the losses must continue the same.
    common = {"quant": {"bits": 4}, "train__grad_accum": 1, "checkpoint": {"every_steps": 3}, "train__scheduler": "constant"}
    full_recipe, full = write(
        tmp_path, recipe_dict, "full", train__batch_size=2, train__max_steps=6, distributed={"strategy": strategy}, **common
    )
    finetune(str(full_recipe), "--nproc", "2", cwd=tmp_path)
    reference = losses(full)
    for nproc, batch in ((1, 4),):
        recipe, out = write(
            tmp_path,
            recipe_dict,
            f"part{nproc}",
            train__batch_size=2,
            train__max_steps=3,
            distributed={"strategy": strategy},
            **common,
        )
        finetune(str(recipe), "--nproc", "2", cwd=tmp_path)
        # Continue the same run: six steps now, on nproc processes with the same global batch.
        finetune(
            str(recipe),
            "--nproc",
            str(nproc),
            "train.max_steps=6",
            f"train.batch_size={batch}",
            "resume=auto",
            "resume_ignore_changes=true",
            cwd=tmp_path,
        )
        got = losses(out)
        assert len(got) == 6
        assert got == pytest.approx(reference, rel=1e-4), (nproc, got, reference)
        assert_adapters_close(adapter(full), adapter(out), atol=1e-5)


def _worker_pids(recipe: Path) -> dict[int, int]:
    """{LOCAL_RANK: pid} of the training workers of `recipe` (found through /proc: no test hooks in the code)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        rank = next((e.split(b"=", 1)[1] for e in env if e.startswith(b"LOCAL_RANK=")), None)
        if rank is not None and str(recipe).encode() in cmdline and b"torch.distributed.run" not in cmdline:
            found[int(rank)] = int(entry.name)
    return found


def test_killed_rank_restarts_and_finishes_bitwise_like_an_uninterrupted_run(recipe_dict, tmp_path):
    # With dropout, an exact resume needs every rank's generator state, not only rank 0's: examples of lengths that
    # differ between the ranks' batches advance their generators by different amounts. 24 steps (~40 ms each, two
    # shuffled epochs of 48 examples): the kill after step 5 lands long before the run could end.
    from conftest import write_jsonl

    rows = [{"instruction": "Repeat " + "ab" * (i % 7 + 1), "input": "", "output": "ab" * (i % 7 + 1)} for i in range(48)]
    common = {
        "lora": {"r": 4, "alpha": 8, "dropout": 0.2},
        "train__batch_size": 2,
        "train__max_steps": 24,
        "train__scheduler": "constant",
        "train__lr": 5e-2,
        "checkpoint": {"every_steps": 2},
        "data__path": str(write_jsonl(tmp_path / "varied.jsonl", rows)),
        "data__shuffle": True,
    }
    ref_recipe, ref = write(tmp_path, recipe_dict, "ref", **common)
    finetune(str(ref_recipe), "--nproc", "2", cwd=tmp_path)
    recipe, out = write(tmp_path, recipe_dict, "elastic", **common)
    # One restart allowed: the restarted round must connect the first time (launch.launch_env).
    job = finetune(str(recipe), "--nproc", "2", "--max-restarts", "1", cwd=tmp_path, log=tmp_path / "elastic.log")
    # Rank 1's pid looked up once training runs (reading /proc is slow), then killed as soon as step 5
    # is logged with a complete checkpoint to come back to.
    pid = job.wait_until(lambda: logged_steps(out) and _worker_pids(recipe).get(1), "rank 1 training")
    job.wait_until(lambda: len(logged_steps(out)) >= 5 and any(out.glob("checkpoints/step-*/manifest.json")), "step 5")
    os.kill(pid, signal.SIGKILL)  # rank 1 dies mid-run; torchrun restarts both ranks
    assert job.finish(420) == 0, job.tail()
    # The restarted ranks continued an unfinished run: the kill landed before the last step.
    resumed = re.search(r"resumed from \S+ at step (\d+)", job.output())
    assert resumed and 4 <= int(resumed.group(1)) < 24, job.tail()

    # Every step's loss (the last row logged for it), and the adapter bitwise (CPU fp32: the same masks, the same sums).
    def by_step(run: Path) -> dict[int, float]:
        rows = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        return {r["step"]: r["loss"] for r in rows if "loss" in r}

    got, want = by_step(out), by_step(ref)
    assert sorted(got) == sorted(want) == list(range(1, 25))
    assert [got[s] for s in sorted(got)] == pytest.approx([want[s] for s in sorted(want)], rel=1e-6)
    a, b = adapter(ref), adapter(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
