"""Checkpoint files: atomic directories, manifests that catch truncation, no NaN ever saved."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from finetune.errors import CheckpointError
from finetune.runs.checkpoint import atomic_dir, latest_checkpoint, verify_manifest, write_manifest


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
    from finetune.runs.checkpoint import save_checkpoint

    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with pytest.raises(CheckpointError) as err:
        save_checkpoint(tmp_path, 1, model, opt, sched, {})
    assert "non-finite values in weight" in str(err.value)
    assert not (tmp_path / "checkpoints" / "step-1").exists()


class TinyModel(torch.nn.Linear):
    """A model with the save_pretrained that checkpoints call (full fine-tuning layout)."""

    def save_pretrained(self, directory, safe_serialization=True, **_):
        from safetensors.torch import save_file

        Path(directory).mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(Path(directory) / "model.safetensors"))


def test_each_rank_restores_its_own_cpu_and_cuda_generators(tmp_path, monkeypatch):
    # A 2-GPU run: each rank's CUDA generator has its own state and must get it back
    # (not rank 0's on every rank). No GPU here: the CUDA generator calls are recorded.
    import peft  # noqa: F401 - imported (with bitsandbytes) before CUDA is faked below

    from finetune.parallel.rank_state import RankState
    from finetune.runs.checkpoint import load_checkpoint, save_checkpoint

    cuda_states = {0: torch.tensor([1, 2, 3], dtype=torch.uint8), 1: torch.tensor([7, 8, 9], dtype=torch.uint8)}
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *a, **k: cuda_states[0])  # this process is rank 0
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, *a, **k: restored.append(state.clone()))
    cpu = {r: torch.Generator().manual_seed(r + 10).get_state() for r in (0, 1)}
    per_rank = [RankState({"torch_cpu": cpu[r], "torch_cuda": cuda_states[r]}) for r in (0, 1)]

    model = TinyModel(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    path = save_checkpoint(tmp_path, 3, model, opt, sched, {}, rank_states=per_rank)
    for rank in (0, 1):
        load_checkpoint(path, model, opt, sched, rank=rank)
        assert torch.equal(restored[-1], cuda_states[rank]), rank
        assert torch.equal(torch.get_rng_state(), cpu[rank]), rank
    # A checkpoint of one process (no per-rank states): every rank takes the one saved.
    single = save_checkpoint(tmp_path, 4, model, opt, sched, {})
    load_checkpoint(single, model, opt, sched, rank=1)
    assert torch.equal(restored[-1], cuda_states[0])


def test_each_rank_gets_its_own_powersgd_state_back_from_safetensors_and_json(tmp_path):
    from finetune.parallel.ddp_hooks import PowerSGD
    from finetune.parallel.rank_state import RankState, rng_states
    from finetune.runs.checkpoint import load_checkpoint, save_checkpoint

    model = TinyModel(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

    def held(rank: int) -> PowerSGD:
        """What rank `rank` holds after 7 steps: its own error feedback, the shared factors."""
        hook = PowerSGD(model, rank=1, warmup_steps=2)
        hook.state.iter = 7
        hook.state.rng.randint(10**9)  # the generator moved on
        hook.pieces = {"error.weight": torch.full((16,), float(rank)), "p.weight": torch.ones(4), "q.weight": torch.ones(4)}
        return hook

    saved = [held(r).state_dict() for r in (0, 1)]
    path = save_checkpoint(tmp_path, 7, model, opt, sched, {}, rank_states=[RankState(rng_states(), s) for s in saved])
    names = sorted(p.name for p in (path / "grad_compression").iterdir())
    assert names == ["rank0.json", "rank0.safetensors", "rank1.json", "rank1.safetensors"]
    for rank in (0, 1):
        hook = PowerSGD(model, rank=1, warmup_steps=2)
        load_checkpoint(path, model, opt, sched, rank=rank, powersgd=hook)
        tensors, scalars = hook.state_dict()
        assert tensors.keys() == saved[rank][0].keys() and all(torch.equal(tensors[k], saved[rank][0][k]) for k in tensors)
        assert tensors["error.weight"][0] == rank and scalars == saved[rank][1] and scalars["iter"] == 7
    # A third process (resumed on 3): rank 0's counter, generator and factors; no one's error feedback.
    hook = PowerSGD(model, rank=1, warmup_steps=2)
    load_checkpoint(path, model, opt, sched, rank=2, powersgd=hook)
    tensors, scalars = hook.state_dict()
    assert "error.weight" not in tensors and torch.equal(tensors["p.weight"], torch.ones(4)) and scalars["iter"] == 7
    # A checkpoint of a run without PowerSGD leaves a new PowerSGD as it was (plain steps first).
    plain = save_checkpoint(tmp_path, 8, model, opt, sched, {})
    hook = PowerSGD(model, rank=1, warmup_steps=2)
    load_checkpoint(plain, model, opt, sched, powersgd=hook)
    assert not (plain / "grad_compression").exists() and hook.state.iter == 0 and hook.pieces == {}
