"""benchmarks/pipeline_bubble.py (issue 27's CPU measurement of the pipeline bubble) runs every
schedule on 2 processes and reports each rank's bubble beside the ideal one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_every_schedule_reports_a_measured_bubble_beside_the_ideal(tmp_path):
    out = tmp_path / "bubble.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(ROOT / "benchmarks" / "pipeline_bubble.py"), "--steps", "1", "--width", "32", "--rows", "4", "--depth", "2",
           "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    schedules = result["schedules"]
    assert set(schedules) == {"gpipe", "1f1b", "interleaved_1f1b"}
    # (p - 1) / (m + p - 1) at p = 2, m = 8; interleaving over V = 2 virtual stages: (p - 1) / (V m + p - 1)
    assert schedules["gpipe"]["ideal_bubble"] == pytest.approx(1 / 9) == schedules["1f1b"]["ideal_bubble"]
    assert schedules["interleaved_1f1b"]["ideal_bubble"] == pytest.approx(1 / 17)
    for name, row in schedules.items():
        assert len(row["per_rank"]) == 2, name
        for rank in row["per_rank"]:
            assert 0.0 <= rank["bubble"] < 1.0 and rank["step_s"] > 0, (name, rank)
