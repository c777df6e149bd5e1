"""Training: the Trainer and the rooms it is built from.

    from finetune import load_recipe, Trainer, Callback
    with Trainer(load_recipe("demo-cpu"), callbacks=[...]) as trainer:
        result = trainer.train()

state (TrainState, TrainResult) -> callbacks -> schedule -> order (the window, cut per launch) ->
profiling (MFU, the step clock) -> watch (stragglers, throughput) -> faults (out of memory, hangs, lost
peers) -> held_out (scores before and after) -> build -> loop (Trainer). The objectives are in finetune/objectives/, the Parallel object in finetune/parallel/,
resume beside the checkpoint files in finetune/runs/.
"""

from finetune.objectives.loss import CausalLMLoss, Loss, count_targets
from finetune.parallel.runtime import Parallel
from finetune.runs.evaluate import loss_sum_and_count
from finetune.trainer.callbacks import Callback, CallbackList
from finetune.trainer.loop import Trainer
from finetune.trainer.schedule import lr_factor
from finetune.trainer.state import TrainResult, TrainState

__all__ = [
    "Callback",
    "CallbackList",
    "CausalLMLoss",
    "Loss",
    "Parallel",
    "TrainResult",
    "TrainState",
    "Trainer",
    "count_targets",
    "loss_sum_and_count",
    "lr_factor",
]
