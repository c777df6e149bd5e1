"""The start-up health check's comparison (finetune/parallel/health.py), on RankInfo lists built by hand.
Its real gather over two gloo processes: tests/e2e/test_health_gloo.py."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import torch

from finetune.errors import FinetuneError
from finetune.parallel import health

VERSIONS = {
    "torch": "2.13.0",
    "transformers": "5.24.0",
    "peft": "0.18.0",
    "bitsandbytes": "0.49.0",
    "accelerate": "1.12.0",
    "finetune": "0.1.0",
}


def ranks(n: int = 3) -> list[health.RankInfo]:
    hosts = ["host-a", "host-b", "host-c", "host-d"]
    return [
        health.RankInfo(rank=r, host=hosts[r], pid=100 + r, versions=dict(VERSIONS), recipe="abc123abc123", host_free=2**30)
        for r in range(n)
    ]


def test_equal_ranks_raise_nothing():
    assert health.mismatches(ranks()) == []


def test_a_version_mismatch_names_the_rank_its_host_and_both_values():
    infos = ranks()
    infos[1] = replace(infos[1], versions={**VERSIONS, "transformers": "5.23.0"})
    problems = health.mismatches(infos)
    assert problems == ["rank 1 (host-b): transformers 5.23.0, rank 0 (host-a) has 5.24.0"]
    err = health.mismatch_error(problems)
    assert isinstance(err, FinetuneError)
    assert "  - rank 1 (host-b): transformers 5.23.0, rank 0 (host-a) has 5.24.0" in str(err)
    assert err.hint == "install the same versions of torch, transformers, peft, bitsandbytes, accelerate, finetune on every node"


def test_a_missing_package_and_a_recipe_mismatch_are_both_listed_in_rank_order():
    infos = ranks()
    infos[2] = replace(infos[2], recipe="ffffffffffff")
    infos[1] = replace(infos[1], versions={k: v for k, v in VERSIONS.items() if k != "bitsandbytes"})
    problems = health.mismatches(infos)
    assert problems == [
        "rank 1 (host-b): bitsandbytes missing, rank 0 (host-a) has 0.49.0",
        "rank 2 (host-c): recipe hash ffffffffffff, rank 0 (host-a) has abc123abc123",
    ]
    hint = health.mismatch_error(problems).hint
    assert hint is not None and "same versions" in hint and "same recipe file" in hint


def test_only_a_recipe_mismatch_hints_only_the_recipe():
    infos = ranks(2)
    infos[1] = replace(infos[1], recipe="000000000000")
    assert health.mismatch_error(health.mismatches(infos)).hint == (
        "launch every node with the same recipe file and the same key=value overrides"
    )


def test_many_mismatches_are_cut_short():
    problems = [f"rank {r} (h): torch 1.0, rank 0 (h) has 2.0" for r in range(1, 31)]
    lines = str(health.mismatch_error(problems)).splitlines()
    assert lines[health.MISMATCHES_SHOWN + 1] == "  - ... and 10 more"
    assert len([x for x in lines if x.startswith("  - rank")]) == health.MISMATCHES_SHOWN


def test_recipe_hash_follows_the_recipe_not_its_key_order():
    a = SimpleNamespace(to_dict=lambda: {"seed": 0, "train": {"lr": 1e-3, "max_steps": 4}})
    b = SimpleNamespace(to_dict=lambda: {"train": {"max_steps": 4, "lr": 1e-3}, "seed": 0})
    c = SimpleNamespace(to_dict=lambda: {"train": {"max_steps": 4, "lr": 2e-3}, "seed": 0})
    assert health.recipe_hash(a) == health.recipe_hash(b)
    assert health.recipe_hash(a) != health.recipe_hash(c)
    assert len(health.recipe_hash(a)) == 12 and int(health.recipe_hash(a), 16) >= 0


def test_installed_versions_says_missing_for_a_package_not_installed(monkeypatch):
    monkeypatch.setattr(health, "PACKAGES", ("torch", "no-such-package-here", "finetune"))
    found = health.installed_versions()
    assert found["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert found["no-such-package-here"] == "missing"
    assert found["finetune"] == "0.1.0"


def test_host_ram_is_read_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:  100 kB\nMemAvailable:    8000000 kB\n")
    assert health.host_available_bytes(str(meminfo)) == 8_000_000 * 1024
    assert health.host_available_bytes(str(tmp_path / "absent")) is None


def test_one_process_returns_itself_with_no_collective():
    parallel = SimpleNamespace(world=1, rank=0, is_main=True, device=torch.device("cpu"))
    cfg = SimpleNamespace(to_dict=lambda: {"seed": 0})
    (info,) = health.check(parallel, cfg)  # no process group exists: a collective here would raise
    assert (info.rank, info.device_free, info.recipe) == (0, None, health.recipe_hash(cfg))
    assert info.versions["finetune"] == "0.1.0"


def test_rank_zero_logs_a_line_per_rank_or_a_summary():
    lines = health.memory_lines(ranks(2))
    assert lines == [
        "health: rank 0 (host-a) pid 100: device free n/a, host RAM available 1.0 GiB",
        "health: rank 1 (host-b) pid 101: device free n/a, host RAM available 1.0 GiB",
    ]
    many = [replace(r, rank=i, host=f"node{i // 4}", device_free=(i + 1) * 2**30) for i, r in enumerate(ranks(1) * 16)]
    (summary,) = health.memory_lines(many)
    assert summary == (
        "health: 16 ranks on 4 hosts agree on versions and recipe; device free: least 1.0 GiB on rank 0 (node0), "
        "median 8.5 GiB; host RAM available: least 1.0 GiB on rank 0 (node0), median 1.0 GiB"
    )
