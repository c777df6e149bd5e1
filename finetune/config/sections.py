"""The recipe's sections, as pydantic models: model, data, quant, lora, train, eval, checkpoint,
distributed, memory, report, profile. The only place defaults live; config/schema.py puts them
together in RecipeConfig and checks the rules between them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from finetune import adapters
from finetune.declarations import techniques, zero_config

# data.format: the formats of finetune/data/formats/, one module each (that package checks this
# list against its registry on import; config cannot import it: imports flow one way).
DataFormat = Literal["alpaca", "completion", "input_output", "messages", "preference", "prompt", "sharegpt", "text"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    path: str = Field(description="Hugging Face hub id or local directory of a causal LM")
    revision: str | None = None
    tokenizer: str | None = Field(None, description="tokenizer source; defaults to model.path")
    trust_remote_code: bool = False
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2", "flex_attention", "varlen"] = Field(
        "auto",
        description="auto: the fastest the model supports (flash_attention_2 on a GPU when flash-attn is installed, "
        "varlen for packed rows on CUDA in 16-bit and of 1024+ tokens on a CPU, else sdpa, else eager), with a note "
        "when it falls back or "
        "picks varlen; varlen: finetune's own (finetune/model/varlen.py), packed "
        "examples attend each to itself with no T x T mask (torch's varlen flash kernel on CUDA in 16-bit)",
    )
    vision_tower: Literal["compute", "4bit"] = Field(
        "compute",
        description="a vision-language model's vision tower and projector (frozen): compute keeps them in the compute "
        "dtype (exact image features; ~0.7 GB for Qwen2.5-VL-7B's 670M in bf16), 4bit stores them NF4 as quant.bits=4 "
        "does the language model (a quarter of the bytes; features carry quantization error)",
    )
    kernels: Literal["auto", "none", "liger", "finetune"] = Field(
        "auto",
        description="fused kernels in the decoder layers (finetune/model/kernels.py): liger-kernel's RMSNorm, RoPE, SwiGLU; "
        "auto: what GPU leases measured fastest (model/kernels.py's AUTO_ON_CUDA: none until one is faster above the noise); "
        "liger: liger-kernel on CUDA (pip install 'finetune[gpu]') for the families it knows; "
        "finetune: each LoRA'd 4-bit linear as one autograd function (model/fast_lora.py), on any device; on CUDA each "
        "gated MLP over them as one too (model/fast_mlp.py), with Triton's kernels where triton is installed",
    )


class MixSource(_Section):
    """One more dataset mixed into the training data (data.mix)."""

    path: str = Field(description="local file/folder or hub dataset name")
    weight: float = Field(1.0, gt=0, description="examples drawn per epoch = weight x its size (0.5: a seeded half)")
    format: DataFormat | None = None  # None: data.format
    columns: dict[str, str] | None = None  # None: data.columns
    split: str | None = None  # None: data.split
    subset: str | None = None  # hub dataset configuration name (load_dataset's second argument)


class DataConfig(_Section):
    path: str = Field(description="local JSON/JSONL/CSV/Parquet file or hub dataset name")
    format: DataFormat = "alpaca"
    split: str = "train"
    subset: str | None = Field(None, description="hub dataset configuration, e.g. 'main' for openai/gsm8k")
    weight: float = Field(1.0, gt=0, description="like data.mix[].weight, for data.path")
    mix: list[MixSource] = Field(default_factory=list, description="more datasets, each with its own weight")
    eval_path: str | None = None
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    max_seq_len: int = Field(2048, ge=8)
    max_pixels: int | None = Field(
        None,
        ge=784,
        description="vision-language models whose processor sizes images by area (Qwen2-VL, Qwen2.5-VL): each image "
        "is scaled down to at most this many pixels (one image token per 28x28 pixels); null: the processor's own",
    )
    columns: dict[str, str] = Field(
        default_factory=dict, description="map our column names to the dataset's, e.g. {output: answer}"
    )
    template: Literal["auto", "chatml", "llama3", "mistral", "alpaca"] = Field(
        "auto", description="chat template for chat data formats (messages, ...): auto = the tokenizer's own"
    )
    train_on: Literal["assistant", "last", "all"] = Field(
        "assistant", description="assistant: every reply; last: the last reply only; all: every token"
    )
    truncation: Literal["truncate", "drop"] = "truncate"
    skip_bad_rows: bool = Field(False, description="skip (and count) malformed rows instead of stopping")
    mask_check: Literal["error", "warn", "drop", "off"] = Field(
        "error", description="examples whose label mask looks wrong: error stops, warn trains them, drop leaves them out"
    )
    packing: bool = Field(False, description="concatenate examples into rows of max_seq_len (no cross-attention)")
    group_by_length: bool = Field(False, description="batch examples of similar length (less padding)")
    num_proc: int = Field(1, ge=1, description="processes that tokenize")
    cache: bool = Field(True, description="reuse tokenized data from an earlier run with the same inputs")
    cache_dir: str | None = None  # None: $FINETUNE_CACHE or ~/.cache/finetune
    shuffle: bool = True


class QuantConfig(_Section):
    bits: Literal[4, 8] | None = 4
    quant_type: Literal["nf4", "fp4"] = "nf4"
    double_quant: bool = True


# lora.method: the methods of finetune/adapters/, one module each.
AdapterName = Literal[adapters.NAMES]  # type: ignore[valid-type]


class LoraConfig(_Section):
    r: int = Field(16, ge=1)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.05, ge=0.0, lt=1.0)
    target: str | list[str] = "all-linear"
    dora: bool = Field(False, description="the older spelling of method=dora (still read; recipe.yaml writes method)")
    method: AdapterName = Field(
        adapters.DEFAULT, description=" | ".join(f"{m.name}: {m.summary}" for m in adapters.METHODS.values())
    )

    @model_validator(mode="before")
    @classmethod
    def _dora_alias(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("dora") is True:
            if data.get("method", "dora") != "dora":
                raise ValueError(
                    f"lora.dora=true and lora.method={data['method']} name two methods; remove lora.dora "
                    "(the older spelling of lora.method=dora)"
                )
            data = {**data, "method": "dora"}
        return data

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        data.pop("dora", None)  # written as method: dora
        data["method"] = self.adapter.name
        return data

    @property
    def adapter(self) -> adapters.AdapterMethod:
        """The method trained (finetune.adapters): lora.method, or dora when lora.dora=true."""
        return adapters.method_of(self)

    @property
    def method_key(self) -> str:
        """The method as this recipe spells it, for messages."""
        return "lora.dora=true" if self.dora else f"lora.method={self.method}"


class RewardSpec(_Section):
    """One built-in reward of train.objective=grpo (finetune/objectives/rewards.py), with its weight and options."""

    name: Literal["exact_match", "contains", "format", "numeric", "length", "json", "model"] = Field(
        description="exact_match | contains (the record's `column` in the completion) | format (`pattern` found) | "
        "numeric (the last number equals `column`'s, fractions normalised) | length (penalty past `target` "
        "characters) | json (the completion parses as JSON) | model (a reward model's score: `path`)"
    )
    weight: float = Field(1.0, description="its share of the total reward (negative: a penalty)")
    column: str | None = Field(None, description="exact_match, contains, numeric: the record's column with the answer")
    pattern: str | None = Field(None, description="format: a regular expression the completion must contain")
    target: int | None = Field(None, ge=1, description="length: characters before the penalty starts")
    path: str | None = Field(None, description="model: a sequence-classification reward model (local folder or hub id)")
    bits: Literal[4] | None = Field(None, description="model: 4 loads it in NF4 (double quant); null: compute dtype")
    max_length: int = Field(1024, ge=8, description="model: tokens of prompt + completion it reads (the prompt's start cut)")


class TrainConfig(_Section):
    max_steps: int | None = Field(None, ge=1, description="optimizer steps; overrides epochs")
    epochs: int = Field(1, ge=1)
    batch_size: int = Field(1, ge=1, description="micro-batch (examples per forward)")
    grad_accum: int = Field(1, ge=1)
    lr: float = Field(2e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    max_grad_norm: float | None = Field(1.0, gt=0)
    log_every_steps: int = Field(1, ge=1)
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop", description="non-finite loss/grad: stop (checkpoint of the last good state + error) or skip the update"
    )
    loss_spike_factor: float = Field(3.0, gt=1.0, description="log a warning when loss > factor x its recent mean")
    oom_backoff: bool = Field(
        True,
        description="out of memory inside a step (CUDA): the step is discarded and retried with half the micro-batch "
        "and twice grad_accum (the same examples per step, the same token-mean loss), down to batch_size 1; on "
        "several processes the job exits 75 and resumes with it; a resumed run keeps the smaller micro-batch "
        "(trainer/faults.py)",
    )
    objective: Literal["sft", "dpo", "orpo", "simpo", "grpo"] = Field(
        "sft",
        description="sft: next-token loss on the responses; dpo, orpo, simpo: preference tuning on "
        "data.format=preference pairs; grpo: online RL from train.rewards on data.format=prompt "
        "(finetune/declarations/objectives.py)",
    )
    beta: float | None = Field(
        None,
        ge=0,
        description="preference strength; null: dpo 0.1 (KL to the reference), orpo 0.1, simpo 2.0; grpo: the KL "
        "penalty to the base (the adapter off), null: 0 (no reference pass)",
    )
    simpo_gamma: float | None = Field(None, ge=0, description="simpo: target reward margin; null: beta / 2")
    loss_type: Literal["grpo", "dr_grpo", "dapo"] = Field(
        "grpo",
        description="grpo: each completion's token mean, averaged; dr_grpo: tokens summed over max_new_tokens "
        "(Dr. GRPO: no length bias); dapo: the mean over every completion token of the step, clip-higher",
    )
    num_generations: int = Field(4, ge=2, description="grpo: completions sampled per prompt (the group)")
    epsilon: float = Field(0.2, gt=0, lt=1, description="grpo: the ratio clip, 1 - epsilon .. 1 + epsilon_high")
    epsilon_high: float | None = Field(None, gt=0, description="grpo: the upper clip; null: epsilon (dapo: 0.28)")
    importance_sampling: Literal["token", "sequence"] = Field(
        "token",
        description="grpo: token: each token's ratio to the sampling policy, clipped; sequence (GSPO): one ratio a "
        "completion, the geometric mean of its tokens', clipped as one (GSPO's paper clips at 3e-4 / 4e-4)",
    )
    max_new_tokens: int = Field(32, ge=1, description="grpo: the longest completion sampled")
    steps_per_generation: int = Field(
        1,
        ge=1,
        description="grpo: one sampling serves this many optimizer steps (each trains on its own prompts' "
        "completions, sampled together by the policy of the first; its ratios against that policy, clipped)",
    )
    num_iterations: int = Field(
        1,
        ge=1,
        description="grpo: optimizer steps on each sampling's completions (TRL's num_iterations, mu): a cycle of "
        "steps_per_generation x num_iterations steps trains each step's prompts num_iterations times, in turn, "
        "against the policy that sampled them; train.epochs counts each prompt once (an epoch is that many times longer)",
    )
    overlong_buffer: int | None = Field(
        None,
        ge=1,
        description="grpo: DAPO's overlong shaping: a completion longer than max_new_tokens - this many tokens loses "
        "reward linearly, -1 at max_new_tokens (metrics: rewards/overlong); null: none",
    )
    dynamic_sampling: int = Field(
        0,
        ge=0,
        description="grpo: DAPO's dynamic sampling: a group whose rewards are all equal is sampled again from its "
        "prompt, up to this many times, until they differ (metrics: redraws, a prompt's mean); 0: never",
    )
    temperature: float = Field(1.0, gt=0, description="grpo: sampling temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="grpo: nucleus sampling")
    stop: list[str] = Field(
        default_factory=list,
        description="grpo: a completion also ends where one of these strings appears (it is trained up to there; "
        "the rewards read the text before it), as at an end token",
    )
    rewards: list[RewardSpec] = Field(
        default_factory=list,
        description="grpo: built-in rewards, weighted; your own Python rewards only through "
        "Trainer(reward_fns=...) or `finetune run --rewards FILE.py`, never named by a recipe",
    )

    @field_validator("rewards", mode="before")
    @classmethod
    def _built_in(cls, value: Any) -> Any:
        # A recipe names built-in rewards only: a file or a function is code, which only the user passes.
        known = ("exact_match", "contains", "format", "numeric", "length", "json", "model")
        for j, spec in enumerate(value if isinstance(value, list) else []):
            name = spec.get("name") if isinstance(spec, dict) else spec
            if name not in known:
                raise ValueError(
                    f"[{j}] names {name!r}, not a built-in reward ({' | '.join(known)}); your own Python rewards go "
                    "through `finetune run --rewards FILE.py` or Trainer(reward_fns=[...]), never a recipe"
                )
        return value

    precompute_reference: bool = Field(
        False,
        description="dpo: the reference log-probabilities computed in one pass before training and cached, "
        "instead of a forward with the adapter off at every step",
    )
    compile: bool = Field(
        False,
        description="torch.compile each decoder layer: compiled during the first step (tens of seconds), the same "
        "results within float rounding; whether it is faster depends on the model and the GPU (measure: --profile)",
    )


class EvalConfig(_Section):
    every_steps: int | None = Field(None, ge=1, description="eval loss every N steps (needs eval data)")
    batch_size: int | None = Field(None, ge=1)
    max_batches: int | None = Field(None, ge=1)
    exact_match_path: str | None = Field(
        None, description="file of prompts+answers (same format as data) scored by greedy generation before and after training"
    )
    exact_match_limit: int | None = Field(None, ge=1)
    max_new_tokens: int = Field(32, ge=1)


class CheckpointConfig(_Section):
    every_steps: int | None = Field(None, ge=1)
    every_minutes: float | None = Field(
        None, gt=0, description="also a checkpoint once this many minutes passed since the last: a hang loses at most that"
    )
    keep_last: int | None = Field(2, ge=1)


class DistributedConfig(_Section):
    strategy: Literal["auto", "ddp", "fsdp", "deepspeed"] = Field(
        "auto",
        description="ddp: a replica per process; fsdp: weights and optimizer state sharded; deepspeed: ZeRO (declarations/zero_config.py)",
    )
    cpu_offload: bool = Field(False, description="fsdp: sharded parameters, gradients and optimizer state live in CPU RAM")
    reshard_after_forward: bool = Field(True, description="fsdp: free gathered layers after forward (less memory, more traffic)")
    zero_stage: Literal[2, 3] = Field(2, description="deepspeed: 2 partitions optimizer state and gradients; 3 the weights too")
    offload_optimizer: zero_config.Offload = Field(
        "none", description="deepspeed: the optimizer state and its step on cpu or nvme"
    )
    offload_params: zero_config.Offload = Field(
        "none", description="deepspeed zero_stage 3: the weight partitions wait on cpu or nvme"
    )
    nvme_dir: str | None = Field(None, description="deepspeed: folder on an NVMe disk for the offloads set to nvme")
    pipeline_parallel: int = Field(
        1,
        ge=1,
        description="decoder layers split into this many stages, one per process (--nproc = stages x replicas): "
        "a model too large for one GPU without sharding it; 1: no pipeline (declarations/layout.py)",
    )
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = Field(
        "1f1b",
        description="pipeline_parallel: gpipe (all forwards, then all backwards: most activations in flight), 1f1b "
        "(the same idle time, at most one micro-batch per stage in flight), interleaved_1f1b (virtual_stages "
        "per rank: less idle time, more transfers); micro-batches = train.grad_accum",
    )
    virtual_stages: int = Field(1, ge=1, description="interleaved_1f1b: stages per process (layers split into pp x this)")
    pipeline_layers: Literal["even", "auto"] | list[int] = Field(
        "even",
        description="pipeline_parallel: decoder layers per stage: even, auto (balanced so that no stage's planned peak "
        "is higher than it must be: the first holds the embeddings and the most micro-batches, the last the head and "
        "loss), or a count per stage",
    )
    tensor_parallel: int = Field(
        1,
        ge=1,
        description="each decoder layer split over this many processes, Megatron style (attention heads and the "
        "MLP; --nproc = this x replicas): the 4-bit layers of a model too large for one GPU; 1: none (parallel/tensor.py)",
    )
    sequence_parallel: bool = Field(
        False,
        description="tensor_parallel: the norms, the residual stream and the checkpointed layer inputs split along the "
        "sequence over the tensor-parallel ranks (Megatron's; the same traffic as the all-reduces it replaces): less "
        "activation memory per rank (parallel/sequence.py)",
    )
    vocab_parallel: bool = Field(
        False,
        description="tensor_parallel: the input embedding and the LM head split along the vocabulary over the "
        "tensor-parallel ranks, and the loss computed from each rank's columns (no whole-vocabulary logits): 1/tp of "
        "the tables per rank (parallel/vocab.py)",
    )
    context_parallel: int = Field(
        1,
        ge=1,
        description="each sequence split over this many processes along its length (--nproc = this x replicas): "
        "context longer than one GPU's memory holds; 1: none (parallel/context.py)",
    )
    context_parallel_mode: Literal["ring", "ulysses"] = Field(
        "ring",
        description="context_parallel: ring (K/V blocks passed around the ranks, overlapped with compute; any head "
        "count) or ulysses (an all-to-all trades the sequence split for a head split: heads divisible by the ranks)",
    )
    timeout_s: int = Field(
        600,
        ge=10,
        description="seconds any collective (and a training step, watched on the host) may wait for the other ranks "
        "before the job exits 75 (restartable: resume=auto continues from the last complete checkpoint); raise it "
        "when a checkpoint save or an eval takes longer",
    )
    straggler_ratio: float = Field(
        1.5,
        gt=1.0,
        description="warn, naming the rank and host, when one rank's compute time per step exceeds this x the median "
        "rank's for straggler_steps steps running",
    )
    straggler_steps: int = Field(5, ge=1, description="straggler_ratio: how many steps running before the warning")
    grad_compression: Literal["none", "bf16", "fp16", "powersgd"] = Field(
        "none",
        description="ddp: how gradients travel in the all-reduce (slow links between nodes): none (fp32), "
        "bf16 | fp16 (half the bytes), powersgd (low-rank factors with error feedback: a fraction of them)",
    )
    powersgd_rank: int = Field(1, ge=1, description="powersgd: rank of the factors (torch: start at 1, then 2, 4 if loss lags)")
    powersgd_warmup_steps: int | None = Field(
        None,
        ge=2,  # torch: DDP regroups its buckets after step 1, which PowerSGD's memory must not straddle
        description="powersgd: optimizer steps of plain all-reduce first; null: train.warmup_steps, at least 10",
    )


class MemoryConfig(_Section):
    """Trade speed for memory: recompute activations, move them or the frozen weights off the GPU."""

    activation_checkpointing: Literal["all", "none"] | Annotated[int, Field(ge=1)] = Field(
        "all", description="recompute decoder-layer activations in backward: all layers, none, or every k-th layer (k)"
    )
    activation_offload: bool | Literal["disk"] = Field(
        False,
        description="what autograd saves for backward waits in pinned CPU RAM (copied on a side stream): all the "
        "activations of layers that are not checkpointed, and the input of each checkpointed one (brought back one "
        "layer ahead of its recomputation); works with every activation_checkpointing setting. disk: the checkpointed "
        "inputs wait in files under offload_dir instead (an NVMe disk: long rows whose inputs outgrow host RAM)",
    )
    base_weights: Literal["device", "cpu", "disk"] = Field(
        "device",
        description="where the frozen decoder-layer weights live: cpu RAM or a file on disk (NVMe) are streamed "
        "to the GPU one layer at a time",
    )
    offload_dir: str | None = Field(
        None,
        description="base_weights=disk and activation_offload=disk: folder for their files (put it on an NVMe disk); "
        "null: the cache dir",
    )
    device_layers: int = Field(
        0,
        ge=0,
        description="base_weights=cpu|disk: how many decoder layers keep their frozen weights on the GPU (spread "
        "evenly between the streamed ones); 0: every layer streams. Fill the GPU with what fits, stream the rest",
    )
    optimizer_offload: bool = Field(
        False, description="optimizer state and the fp32 step run in CPU RAM (large LoRA ranks, full fine-tuning)"
    )
    loss: Literal["auto", "full", "chunked", "liger"] = Field(
        "auto",
        description="how the LM head and the loss meet: chunked computes them over loss_chunk target positions at a "
        "time, never holding the whole logits (long context); full holds the logits of every target; auto: chunked "
        "when a batch has more targets than one chunk (full under FSDP); liger: liger-kernel's fused kernel (CUDA)",
    )
    loss_chunk: int = Field(256, ge=16, description="target positions per chunk of memory.loss=chunked|auto")
    embeddings: Literal["device", "cpu"] = Field(
        "device",
        description="cpu: the frozen input embedding table stays in host RAM (lookups there, only the rows cross) and "
        "the LM head visits the GPU for the loss only, not while the decoder runs backward (the peak)",
    )
    tiled_mlp: Literal["auto", "off"] | Annotated[int, Field(ge=1)] = Field(
        "auto",
        description="each decoder layer's MLP over N tiles of the sequence, each recomputed in backward: its "
        "intermediate (3 x seq x intermediate_size) never exists whole; auto: tiles of 4096 positions when longer",
    )

    @field_validator("tiled_mlp", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare off/on as false/true: tiled_mlp: off means "off".
        return {False: "off", True: "auto"}.get(value, value) if isinstance(value, bool) else value

    @property
    def checkpoint_every(self) -> int:
        """Every how many decoder layers one is checkpointed; 0: none."""
        return techniques.checkpoint_every(self.activation_checkpointing)


class ReportConfig(_Section):
    """Where metrics go besides metrics.jsonl. The extras are optional installs, checked by `finetune validate`."""

    tensorboard: bool = Field(False, description="event files in output_dir/tensorboard (pip install 'finetune[tensorboard]')")
    wandb: bool = Field(False, description="Weights & Biases run (pip install 'finetune[wandb]')")
    wandb_project: str = Field("finetune", min_length=1, description="W&B project the run is logged to")
    wandb_mode: Literal["online", "offline"] = Field(
        "online", description="offline writes output_dir/wandb only (upload later with `wandb sync`)"
    )
    plot: bool = Field(True, description="output_dir/loss.png at the end of the run (pip install 'finetune[plot]')")
    alert_below: float | None = Field(
        0.5,
        gt=0,
        lt=1,
        description="warn (and log throughput_alert) when tokens/s, or MFU where known, falls below this x its "
        "running median for alert_steps steps running; null: no alert",
    )
    alert_steps: int = Field(5, ge=1, description="alert_below: how many steps running before the warning")


class ProfileConfig(_Section):
    steps: str | None = Field(None, description="steps to record, 5-7 or 5: trace in output_dir/profile/, op table in the log")
    memory_timeline: bool = Field(True, description="CUDA: also a memory snapshot of those steps, for pytorch.org/memory_viz")

    @field_validator("steps", mode="before")
    @classmethod
    def _range(cls, value: Any) -> Any:
        first, dash, last = str(value).replace(" ", "").partition("-")
        if value is not None and not (first.isdigit() and (last.isdigit() or not dash) and 0 < int(first) <= int(last or first)):
            raise ValueError("not a range of optimizer steps: write FIRST-LAST, 1 <= FIRST <= LAST (e.g. 5-7), or one step")
        return value if value is None else first + dash + last
