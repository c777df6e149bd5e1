"""The start-up health check (finetune/parallel/health.py) over two gloo processes under torchrun: the real
all_gather_object, then a rank that reports another transformers, which stops both ranks naming it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import yaml
from conftest import free_port

pytestmark = pytest.mark.slow

DRIVER = """
import json, sys
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from finetune.config.schema import load_recipe
from finetune.errors import FinetuneError
from finetune.parallel import health

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank = dist.get_rank()
parallel = SimpleNamespace(world=dist.get_world_size(), rank=rank, is_main=rank == 0, device=torch.device("cpu"))
cfg = load_recipe(sys.argv[1])
said = []  # each rank's own file: two processes' prints interleave on the shared pipe
ranks = health.check(parallel, cfg, say=said.append)
report = {"gathered": [[r.rank, r.pid, r.recipe, r.versions["transformers"]] for r in ranks], "said": said}
if rank == 1:  # another environment on this rank only: the next check must stop every rank
    real = health.installed_versions()
    health.installed_versions = lambda: {**real, "transformers": "0.0.1-other"}
try:
    health.check(parallel, cfg)
except FinetuneError as exc:
    report["stopped"] = str(exc)
Path(f"rank{rank}.json").write_text(json.dumps(report))
sys.exit(2 if "stopped" in report else 0)
"""


def test_two_processes_gather_and_a_version_mismatch_stops_both(recipe_dict, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(recipe_dict))
    (tmp_path / "driver.py").write_text(DRIVER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*cmd, "driver.py", str(recipe)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0, (proc.stdout + proc.stderr)[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    # The first check passed: both ranks hold both reports, in rank order, with one recipe hash and two pids.
    gathered = reports[0]["gathered"]
    assert reports[1]["gathered"] == gathered and [r for r, *_ in gathered] == [0, 1]
    assert gathered[0][1] != gathered[1][1] and gathered[0][2] == gathered[1][2]
    host = socket.gethostname()
    said = reports[0]["said"]
    assert [line.split(" pid ")[0] for line in said] == [f"health: rank {r} ({host})" for r in (0, 1)]
    assert reports[1]["said"] == []  # only rank 0 logs
    named = f"rank 1 ({host}): transformers 0.0.1-other, rank 0 ({host}) has {gathered[0][3]}"
    for report in reports:  # the second check stopped every rank with the same message
        assert report["stopped"].startswith(f"the processes of this run differ from rank 0:\n  - {named}\n  hint: ")
