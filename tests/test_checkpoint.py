"""Checkpoint files: atomic directories, manifests that catch truncation, no NaN ever saved."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from finetune.checkpoint import atomic_dir, latest_checkpoint, verify_manifest, write_manifest
from finetune.errors import CheckpointError


def test_atomic_dir_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "ckpt"
    with pytest.raises(RuntimeError):
        with atomic_dir(target) as tmp:
            (tmp / "half.bin").write_bytes(b"x" * 10)
            raise RuntimeError("killed mid-save")
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []


def test_atomic_dir_replaces_only_when_complete(tmp_path):
    target = tmp_path / "adapter"
    with atomic_dir(target) as tmp:
        (tmp / "a.txt").write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_dir(target) as tmp:
            (tmp / "a.txt").write_text("new")
            raise KeyboardInterrupt
    assert (target / "a.txt").read_text() == "old"
    with atomic_dir(target) as tmp:
        (tmp / "a.txt").write_text("new")
    assert (target / "a.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


def make_checkpoint(root: Path, step: int, payload: bytes = b"weights") -> Path:
    d = root / "checkpoints" / f"step-{step}"
    d.mkdir(parents=True)
    (d / "w.safetensors").write_bytes(payload)
    write_manifest(d, {"step": step})
    return d


def test_manifest_catches_truncation_and_missing_files(tmp_path):
    d = make_checkpoint(tmp_path, 5)
    import hashlib

    assert verify_manifest(d)["files"] == {"w.safetensors": {"bytes": 7, "sha256": hashlib.sha256(b"weights").hexdigest()}}
    (d / "w.safetensors").write_bytes(b"weighs")
    (d / "w.safetensors").write_bytes(b"weightz")  # same size, other bytes
    with pytest.raises(CheckpointError) as err:
        verify_manifest(d)
    assert "'w.safetensors' is corrupt (sha256" in str(err.value)
    (d / "w.safetensors").write_bytes(b"wei")
    with pytest.raises(CheckpointError) as err:
        verify_manifest(d)
    assert "w.safetensors" in str(err.value) and "3 bytes, manifest says 7 (truncated)" in str(err.value)
    (d / "manifest.json").unlink()
    with pytest.raises(CheckpointError) as err:
        verify_manifest(d)
    assert "manifest.json is missing" in str(err.value)


def test_latest_checkpoint_skips_incomplete_ones_and_says_so(tmp_path):
    make_checkpoint(tmp_path, 10)
    newest = make_checkpoint(tmp_path, 20)
    (newest / "manifest.json").unlink()  # an interrupted save
    (tmp_path / "checkpoints" / "step-30").mkdir()  # a save killed before any file
    path, notes = latest_checkpoint(tmp_path)
    assert path == tmp_path / "checkpoints" / "step-10"
    assert len(notes) == 2 and all("manifest.json is missing" in n for n in notes)


def test_checkpoint_with_nan_weights_is_refused(tmp_path):
    from finetune.checkpoint import save_checkpoint

    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with pytest.raises(CheckpointError) as err:
        save_checkpoint(tmp_path, 1, model, opt, sched, {})
    assert "non-finite values in weight" in str(err.value)
    assert not (tmp_path / "checkpoints" / "step-1").exists()
