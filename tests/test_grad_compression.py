"""PowerSGD's state follows each parameter when DDP regroups its buckets and through a checkpoint.

In-process, on a one-process gloo group: a bucket here is what DDP hands a communication hook
(index, flat buffer, gradient views, parameters), so the hook's arithmetic is the real one.
The 2-process runs through the launcher: tests/e2e/test_compression_ddp.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from finetune.parallel.ddp_hooks import PowerSGD, powersgd_hook

# LoRA A's and B's (factored; torch groups the factors of equal shapes) and a bias (sent whole).
SHAPES = {"a": (4, 64), "b": (64, 4), "c": (8,), "d": (4, 64)}


class Bucket:
    """One DDP gradient bucket holding `order`'s gradients back to back."""

    def __init__(self, module, order: str, grads: dict[str, torch.Tensor]):
        self.params = [module[n] for n in order]
        self.flat = torch.cat([grads[n].reshape(-1) for n in order])
        sizes = [p.numel() for p in self.params]
        self.views = [v.view_as(p) for v, p in zip(self.flat.split(sizes), self.params)]
        self.order = order

    def index(self):
        return 0

    def is_last(self):
        return True

    def buffer(self):
        return self.flat

    def gradients(self):
        return self.views

    def parameters(self):
        return self.params


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def step_grads(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return {n: torch.randn(shape, generator=gen) for n, shape in SHAPES.items()}


def reduce(state, module, order: str, step: int, fn=powersgd_hook, grads=None) -> dict[str, torch.Tensor]:
    """Step `step`'s gradients through the hook, in a bucket in `order`; what it hands back per parameter."""
    bucket = Bucket(module, order, step_grads(step) if grads is None else grads)
    fn(state, bucket).wait()
    return {n: v.clone() for n, v in zip(order, bucket.views)}


def test_powersgd_state_follows_parameters_through_regrouping_and_a_checkpoint(group):
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

    module = torch.nn.ParameterDict({n: torch.nn.Parameter(torch.zeros(s)) for n, s in SHAPES.items()})
    ref = PowerSGD(module, rank=1, warmup_steps=2)
    expected = [reduce(ref, module, "abcd", s) for s in range(6)]
    assert expected[1]["a"].equal(step_grads(1)["a"])  # warm-up: plain all-reduce (one process: unchanged)
    assert not expected[2]["a"].equal(step_grads(2)["a"])  # then rank-1 factors (plus error feedback)

    hook = PowerSGD(module, rank=1, warmup_steps=2)
    got = [reduce(hook, module, "abcd", s) for s in range(4)]
    tensors, scalars = hook.state_dict()  # a checkpoint after step 4; a new launch reads it
    assert scalars["iter"] == 4 and {k.split(".")[0] for k in tensors} == {"error", "p", "q", "rng_keys"}
    resumed = PowerSGD(module, rank=1, warmup_steps=2)
    resumed.load_state_dict(tensors, scalars, own_rank=True)
    # The new launch's first bucket holds the parameters in another order, the next in a third.
    got += [reduce(resumed, module, "cdab", 4), reduce(resumed, module, "bdca", 5)]
    for s in range(6):
        for n in SHAPES:
            assert torch.equal(got[s][n], expected[s][n]), (s, n)

    # torch's own state, keyed by bucket index, adds one parameter's error feedback to another's.
    naive = PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    plain = [reduce(naive, module, "abcd" if s < 4 else "cdab", s, fn=powerSGD_hook) for s in range(5)]
    assert plain[3]["a"].equal(expected[3]["a"]) and not plain[4]["a"].equal(expected[4]["a"])


def test_state_from_another_rank_keeps_the_factors_not_the_error_feedback(group):
    module = torch.nn.ParameterDict({n: torch.nn.Parameter(torch.zeros(s)) for n, s in SHAPES.items()})
    hook = PowerSGD(module, rank=1, warmup_steps=2)
    for s in range(3):
        reduce(hook, module, "abcd", s)
    tensors, scalars = hook.state_dict()
    other = PowerSGD(module, rank=1, warmup_steps=2)
    other.load_state_dict(tensors, scalars, own_rank=False)  # a rank the saving run did not have
    kept, _ = other.state_dict()
    assert sorted(kept) == sorted(k for k in tensors if not k.startswith("error."))
    assert other.state.iter == 3 and other.state.rng.randint(10**9) == hook.state.rng.randint(10**9)


def test_a_non_finite_gradient_leaves_the_powersgd_state_as_it_was(group):
    # An fp16 GradScaler overflow: the trainer skips the step; PowerSGD's memory must not keep the inf.
    module = torch.nn.ParameterDict({n: torch.nn.Parameter(torch.zeros(s)) for n, s in SHAPES.items()})
    ref = PowerSGD(module, rank=1, warmup_steps=2)
    expected = [reduce(ref, module, "abcd", s) for s in range(5)]
    hook = PowerSGD(module, rank=1, warmup_steps=2)
    for s in range(3):
        reduce(hook, module, "abcd", s)
    bad = step_grads(3)
    bad["b"][0, 0] = float("inf")
    assert not torch.isfinite(reduce(hook, module, "abcd", 3, grads=bad)["b"]).all()
    for s in (3, 4):  # the same steps as a run that never saw it
        got = reduce(hook, module, "abcd", s)
        assert all(torch.equal(got[n], expected[s][n]) for n in SHAPES), s
