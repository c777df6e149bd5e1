"""Memory planner: per-GPU memory and step time of a recipe, before any weight is read.

    from finetune.plan import plan_recipe, fit, report
    plan = plan_recipe(cfg, find_gpu("rtx4090"), gpus=1)
    print(report(plan))                  # breakdown, peak, verdict, host RAM/disk, step time
    best = fit(cfg, find_gpu("rtx4090"), max_gpus=2)   # fastest setup that fits

Parameter counts come from the model's own config.json: the model is built on
the meta device (no memory, no weights) and every parameter is counted by the
kind of module that holds it. What each tensor costs follows from how this
toolkit trains (model/load.py, trainer/), written out in `estimate` (memory.py) with the
reason for every term. The model was checked against measured CPU allocations
(tests/test_plan_measured.py) and against published GPU peaks of other
frameworks (docs/plan.md; tests/test_plan_published.py).

Modules, in the order a plan is made (each imports only those above it):
    images     a vision-language model's tower (VisionShape): tokens per image, pixel values, the tower's forward
    shape      ModelShape: config.json's model on the meta device, parameters counted by module kind
    inputs     what is planned: RecipeFacts (the recipe's parts the model reads), Setup (the knobs), Implementation
    speed      step time: compute, dequantization, GPU-link and host-link transfers, an online objective's sampling
    host       host RAM and disk of a setup
    memory     estimate: every per-GPU tensor with its reason, host RAM, disk; the memory constants
    context    context parallelism: a rank's part of every sequence, the ring's or Ulysses' buffers and traffic
    stages     pipeline and tensor-parallel ranks, each planned as its part; plan_setup: any setup
    recipe     a RecipeConfig on a GPU: plan_recipe, setup_of; loaded_weight_bytes (inference loads)
    fitting    the search over KNOBS for the fastest setup that fits: fit
    render     report: the human-readable plan
    rewrite    the fitted recipe: changes_of, rewrite_recipe
    check      preflight_memory: the check `finetune run` makes before loading weights
"""

from finetune.plan.check import REFUSE_FACTOR, physical_ram, preflight_memory
from finetune.plan.fitting import (
    FIT_HEADROOM,
    KNOBS,
    Knob,
    LongestSeq,
    candidates,
    fit,
    longest_fitting_seq,
    longest_trainable_seq,
    runnable,
    search,
)
from finetune.plan.inputs import DEFAULT_IMPL, Implementation, RecipeFacts, Setup, describe_setup, lora_targets
from finetune.plan.memory import (
    ALLOCATOR_SLACK,
    CUDA_CONTEXT_BYTES,
    DEFAULT_SHARD_BYTES,
    HOST_BASELINE_BYTES,
    NF4_BLOCK,
    NF4_BLOCK2,
    OFFLOAD_LAYERS_IN_FLIGHT,
    STREAMED_LAYERS_RESIDENT,
    Component,
    Estimate,
    backward_working_bytes_per_token,
    estimate,
    gib,
    layer_saved_bytes_per_token,
    loss_peak_bytes,
    quantized_bytes,
    trainable_params,
)
from finetune.plan.recipe import WEIGHT_COMPONENTS, loaded_weight_bytes, model_shape_of, plan_precision, plan_recipe, setup_of
from finetune.plan.render import report
from finetune.plan.rewrite import FittedRecipe, changes_of, recipe_value, rewrite_recipe, write_fitted_recipe
from finetune.plan.shape import LinearGroup, ModelShape, read_model_shape
from finetune.plan.speed import (
    BANDWIDTH_EFFICIENCY,
    HOST_ADAMW_BYTES_PER_PARAM,
    HOST_ADAMW_GBPS,
    LINK_EFFICIENCY,
    MATMUL_EFFICIENCY,
    NVME_READ_GBPS,
    forward_seconds,
    step_time,
)

__all__ = [
    "ALLOCATOR_SLACK",
    "BANDWIDTH_EFFICIENCY",
    "CUDA_CONTEXT_BYTES",
    "DEFAULT_IMPL",
    "DEFAULT_SHARD_BYTES",
    "FIT_HEADROOM",
    "HOST_ADAMW_BYTES_PER_PARAM",
    "HOST_ADAMW_GBPS",
    "HOST_BASELINE_BYTES",
    "KNOBS",
    "LINK_EFFICIENCY",
    "MATMUL_EFFICIENCY",
    "NF4_BLOCK",
    "NF4_BLOCK2",
    "NVME_READ_GBPS",
    "OFFLOAD_LAYERS_IN_FLIGHT",
    "REFUSE_FACTOR",
    "STREAMED_LAYERS_RESIDENT",
    "WEIGHT_COMPONENTS",
    "Component",
    "Estimate",
    "Implementation",
    "Knob",
    "LinearGroup",
    "ModelShape",
    "RecipeFacts",
    "Setup",
    "backward_working_bytes_per_token",
    "candidates",
    "changes_of",
    "describe_setup",
    "estimate",
    "fit",
    "forward_seconds",
    "gib",
    "layer_saved_bytes_per_token",
    "longest_fitting_seq",
    "longest_trainable_seq",
    "LongestSeq",
    "lora_targets",
    "loaded_weight_bytes",
    "loss_peak_bytes",
    "model_shape_of",
    "plan_precision",
    "plan_recipe",
    "physical_ram",
    "preflight_memory",
    "quantized_bytes",
    "read_model_shape",
    "recipe_value",
    "report",
    "rewrite_recipe",
    "write_fitted_recipe",
    "FittedRecipe",
    "runnable",
    "search",
    "setup_of",
    "step_time",
    "trainable_params",
]
