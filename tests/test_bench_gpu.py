"""benchmarks/gpu.py (issue 20's measurements) run end to end on this CPU with a 2-layer model of
the Llama-3.1-8B family: every tool trains the same examples, the held-out loss and the rates come
back, ratios are taken, and a shipped recipe runs next to its plan. The numbers it exists for
(tokens/s, CUDA peaks, MFU) need a GPU; here the test checks the harness, not them."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_bench():
    return load_benchmark("gpu.py")


def test_step_flops_by_hand(gpu_bench):
    # d 8, MLP 16, 1 layer, vocab 10, 2 heads of 4, 1 KV head: base linears 576 weights, LoRA r16 2048
    cfg = {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "vocab_size": 10, "num_attention_heads": 2,
           "num_key_value_heads": 1, "head_dim": 4}  # fmt: skip
    step = {"tokens": 10, "trained": 4, "sum_s2": 50}
    assert gpu_bench.flops_per_step(cfg, step) == (4 * 576 + 6 * 2048) * 10 + 4 * 8 * 10 * 4 + 12 * 1 * 2 * 4 * 50


def test_every_tool_trains_the_same_examples_and_a_recipe_runs_beside_its_plan(tmp_path):
    out = tmp_path / "results.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--suite", "all", "--tiny", "--device", "cpu",
           "--examples", "24", "--median-words", "30", "--tools", "finetune_kernels", "trl", "hf", "--baseline", "trl", "--repeats", "1",
           "--recipes", "qlora-1x24gb", "--workdir", str(tmp_path / "work"), "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = json.loads(out.read_text())
    peers = results["peers"]["llama-3.1-8b"]
    assert set(peers) == {"finetune_kernels", "trl", "hf"}
    for tool, row in peers.items():
        assert "error" not in row, (tool, row)
        assert row["examples"] == 24, tool  # one epoch of the same 24 examples, whatever the layout
        assert row["trained_tok_s"] > 0 and row["tok_s"] > row["trained_tok_s"]
        assert math.isfinite(row["eval_loss"]) and 7.0 < row["eval_loss"] < 9.5  # ~ln(4096) = 8.3 at random init
        assert row["mfu"] is None and row["peak_train_gib"] is None  # a CPU: no CUDA peak, no bf16 peak
        assert len(row["train_losses"]) == row["steps"] and all(7.0 < x < 9.5 for x in row["train_losses"])  # one a step
        assert len(row["runs"]) == 1 and row["spread"] is None and row["errors"] == []  # one run: no spread
        assert tool == "trl" or row["apart_from_baseline"] is None
    assert peers["trl"]["speed_vs_baseline"] == 1.0
    assert peers["finetune_kernels"]["settings"] == ["model.kernels=finetune"]
    recipe = results["recipes"]["llama-3.1-8b/qlora-1x24gb"]
    assert recipe["steps"] == 3 and recipe["planned"] > recipe["planned_allocated"] > 0 and recipe["measured"] > 0
    assert recipe["measured_is"].startswith("peak RSS") and "measured_vs_plan" not in recipe  # no CUDA peak to compare
    assert results["versions"]["torch"] and results["lengths"]["max"] <= 2048 and results["lengths"]["trimmed"] == 0


def test_replies_are_shortened_to_fit_so_no_tool_truncates(gpu_bench):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ROOT / "finetune" / "assets" / "tiny-llama")
    long = {"prompt": "Repeat the words: a b\nAnswer:", "completion": " " + " ".join(["ab"] * 300)}
    short = dict(long, completion=" ab ab")
    assert gpu_bench.fit_length(long, tok, 64) and not gpu_bench.fit_length(short, tok, 64)
    fitted = len(tok(long["prompt"] + long["completion"])["input_ids"]) + 1
    assert 0.8 * 64 < fitted <= 64 and set(long["completion"].split()) == {"ab"}  # whole words, cut in 10% steps
    assert short["completion"] == " ab ab"


def test_tools_run_interleaved_each_round_starting_one_further(gpu_bench):
    assert gpu_bench.schedule(["a", "b", "c"], 3) == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"),
                                                      (2, "c"), (2, "a"), (2, "b")]  # fmt: skip


def test_a_row_is_the_median_of_its_runs_and_says_whether_it_stands_apart(gpu_bench):
    def run(rate, peak):
        return {"trained_tok_s": rate, "tok_s": 2 * rate, "mfu": None, "eval_loss": 1.0, "wall_s": 10.0,
                "peak_train_gib": peak, "peak_loading_gib": None, "steps": 5}  # fmt: skip

    rows = {
        "base": gpu_bench.aggregate([run(100, 10), run(130, 11), run(110, 10)]),
        "faster": gpu_bench.aggregate([run(150, 9), run(140, 9), {"error": "exit 1: OOM"}]),
        "within the noise": gpu_bench.aggregate([run(125, 10), run(128, 10), run(120, 10)]),  # above low, below high
        "failed": gpu_bench.aggregate([{"error": "exit 1: OOM"}]),
    }
    gpu_bench.versus(rows, "base")
    base, faster, noisy = rows["base"], rows["faster"], rows["within the noise"]
    assert base["trained_tok_s"] == 110 and base["tok_s"] == 220 and base["peak_train_gib"] == 11
    assert base["spread"] == pytest.approx(30 / 110) and [r["trained_tok_s"] for r in base["runs"]] == [100, 130, 110]
    assert faster["trained_tok_s"] == 145 and faster["errors"] == ["exit 1: OOM"] and len(faster["runs"]) == 2
    assert faster["speed_vs_baseline"] == pytest.approx(145 / 110) and faster["apart_from_baseline"]
    assert faster["peak_vs_baseline"] == pytest.approx(9 / 11)
    assert noisy["speed_vs_baseline"] == pytest.approx(125 / 110) and not noisy["apart_from_baseline"]
    assert rows["failed"]["error"] == "exit 1: OOM" and "speed_vs_baseline" not in rows["failed"]
    assert rows["failed"]["runs"] == [] and rows["failed"]["errors"] == ["exit 1: OOM"]
    single = {"base": rows["base"], "once": gpu_bench.aggregate([run(200, 9)])}
    gpu_bench.versus(single, "base")
    assert single["once"]["spread"] is None and single["once"]["apart_from_baseline"] is None  # no range of its own
