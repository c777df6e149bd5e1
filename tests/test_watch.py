"""StragglerWatch and ThroughputAlert (finetune/trainer/watch.py) on a stand-in trainer: every_rank returns
the tuples a test gives, the rows are built as the loop builds them."""

from __future__ import annotations

from types import SimpleNamespace

from finetune.parallel.health import RankInfo
from finetune.trainer.watch import StragglerWatch, ThroughputAlert

STRAGGLER = "warning: step {step}: rank 1{host} is a straggler: 0.90 s of compute per step vs the others' median 0.30 s for 3 steps running (distributed.straggler_ratio 1.5); every step waits for it"


class FakeParallel:
    def __init__(self, world: int, gathered: list[list[tuple[float, float]]]):
        self.world, self.is_main = world, True
        self.gathered = list(gathered)  # what every_rank returns, call after call
        self.asked: list[tuple[float, ...]] = []

    def every_rank(self, *values: float) -> list[tuple[float, ...]]:
        self.asked.append(values)
        return [tuple(v) for v in self.gathered.pop(0)]


def trainer(world: int = 3, gathered=(), hosts: bool = True, alert_below: float | None = 0.5):
    cfg = SimpleNamespace(
        distributed=SimpleNamespace(straggler_ratio=1.5, straggler_steps=3),
        report=SimpleNamespace(alert_below=alert_below, alert_steps=3),
    )
    t = SimpleNamespace(parallel=FakeParallel(world, list(gathered)), cfg=cfg)
    if hosts:
        t.ranks = [RankInfo(rank=r, host=f"host-{'abc'[r]}", pid=r) for r in range(world)]
    return t


def run_steps(watch, rows: list[dict]) -> list[dict]:
    watch.on_train_begin(None, {"start_step": 0, "total_steps": len(rows)})
    for row in rows:
        watch.on_step_end(None, row)
    return rows


def test_the_row_gets_every_ranks_spread_in_place_of_its_own_times():
    t = trainer(gathered=[[(0.30, 1.00), (0.90, 1.00), (0.32, 0.30)]])
    (row,) = run_steps(StragglerWatch(t), [{"step": 1, "compute_s": 0.30, "step_s": 1.00}])
    assert t.parallel.asked == [(0.30, 1.00)]  # this rank's own numbers go into the collective
    assert row == {
        "step": 1,
        "compute_s_min": 0.30,
        "compute_s_median": 0.32,
        "compute_s_max": 0.90,
        "compute_s_max_rank": 1,
        "wait_s_min": 0.0,  # rank 2's compute read a hair past its step: floored, not negative
        "wait_s_median": 0.10,
        "wait_s_max": 0.70,
        "wait_s_max_rank": 0,
    }


def slow_rank_1(steps: int) -> list[list[tuple[float, float]]]:
    return [[(0.30, 1.0), (0.90, 1.0), (0.30, 1.0)]] * steps


def even() -> list[tuple[float, float]]:
    return [(0.30, 0.9), (0.35, 0.9), (0.30, 0.9)]


def timed_rows(n: int) -> list[dict]:
    return [{"step": s, "compute_s": 0.3, "step_s": 1.0} for s in range(1, n + 1)]


def test_a_straggler_is_named_with_its_host_after_exactly_k_steps_running(capsys):
    rows = run_steps(StragglerWatch(trainer(gathered=slow_rank_1(4))), timed_rows(4))
    assert [r.get("straggler_rank") for r in rows] == [None, None, 1, 1]
    assert capsys.readouterr().out.splitlines() == [STRAGGLER.format(step=3, host=" (host-b)")]


def test_a_broken_streak_starts_over_and_warns_again_when_it_forms_again(capsys):
    gathered = slow_rank_1(2) + [even()] + slow_rank_1(3) + [even()] + slow_rank_1(3)
    rows = run_steps(StragglerWatch(trainer(gathered=gathered, hosts=False)), timed_rows(len(gathered)))
    assert [r.get("straggler_rank") for r in rows] == [None, None, None, None, None, 1, None, None, None, 1]
    assert capsys.readouterr().out.splitlines() == [STRAGGLER.format(step=6, host=""), STRAGGLER.format(step=10, host="")]


def test_one_process_keeps_its_step_time_and_asks_no_collective(capsys):
    t = trainer(world=1)
    (row,) = run_steps(StragglerWatch(t), [{"step": 1, "compute_s": 0.3, "step_s": 1.0}])
    assert row == {"step": 1, "step_s": 1.0}
    assert t.parallel.asked == [] and capsys.readouterr().out == ""


def averaged_rows(steps: list[tuple[int, float, float | None]]) -> list[dict]:
    """Rows as the loop writes them from each step's (tokens, seconds, mfu): tokens_per_s and mfu average over the
    launch so far (metrics.Throughput, profiling.ModelFlops), they are not the step's own."""
    rows, tokens, seconds, work = [], 0, 0.0, 0.0
    for step, (n, secs, mfu) in enumerate(steps, 1):
        tokens, seconds, work = tokens + n, seconds + secs, work + (mfu or 0.0) * secs
        row = {"step": step, "tokens": n, "tokens_per_s": tokens / seconds}
        if mfu is not None:
            row["mfu"] = work / seconds
        rows.append(row)
    return rows


def test_tokens_per_s_alert_after_k_steps_below_half_the_running_median(capsys):
    # warm-up at 100 tok/s, six steps at 1000, then four at 400: the launch's average stays above 500 throughout
    steps = [(100, 1.0, None)] + [(1000, 1.0, None)] * 6 + [(400, 1.0, None)] * 4
    rows = run_steps(ThroughputAlert(trainer()), averaged_rows(steps))
    assert min(r["tokens_per_s"] for r in rows[1:]) > 500  # what an alert on the average would never see
    assert [r.get("throughput_alert", False) for r in rows] == [False] * 9 + [True, True]
    assert capsys.readouterr().out.splitlines() == [
        "warning: step 10: tokens/s 400 per step vs its running median 1,000, below report.alert_below 0.5 x the "
        "median for 3 steps running"
    ]


def test_mfu_is_watched_where_known_and_warns_once_per_episode(capsys):
    good, low = (1000, 1.0, 0.40), (1000, 1.0, 0.10)
    steps = [good] * 10 + [low] * 4 + [good] + [low] * 3
    rows = run_steps(ThroughputAlert(trainer()), averaged_rows(steps))
    assert [i + 1 for i, r in enumerate(rows) if r.get("throughput_alert")] == [13, 14, 18]
    warning = "warning: step {}: MFU 10.0% per step vs its running median 40.0%, below report.alert_below 0.5 x the median for 3 steps running"
    assert capsys.readouterr().out.splitlines() == [warning.format(13), warning.format(18)]


def test_no_alert_when_alert_below_is_null(capsys):
    steps = [(1000, 1.0, None)] * 5 + [(100, 1.0, None)] * 5
    rows = run_steps(ThroughputAlert(trainer(alert_below=None)), averaged_rows(steps))
    assert not any("throughput_alert" in r for r in rows)
    assert capsys.readouterr().out == ""


def test_collectives_are_taken_out_of_the_compute_only_inside_a_steps_work():
    # parallel/waits.py: spans kept between a step clock's start and stop, added up at each micro-batch's end of
    # backward; a collective after the last one (FSDP's final reduce-scatters) or before the step is not the work's.
    import time

    import pytest
    import torch

    from finetune.parallel import waits
    from finetune.trainer.profiling import StepClock

    cpu = torch.device("cpu")
    clock = StepClock(cpu)
    with waits.collective(cpu):
        time.sleep(0.05)  # before any step: not kept
    clock.start()
    for _ in range(2):  # two micro-batches, each waiting 0.05 s in a collective, then its backward's end
        with waits.collective(cpu):
            time.sleep(0.05)
        clock._done()
    with waits.collective(cpu):
        time.sleep(0.05)  # after the work ended
    compute, step = clock.stop()
    assert step >= 0.15 and compute < 0.02 and clock.waited == pytest.approx(0.10, abs=0.02)
    assert not waits._spans
    with waits.collective(cpu):
        time.sleep(0.01)  # after the step: not kept
    assert not waits._spans
