"""The runs of benchmarks/gpu.py, one per worker process: finetune (three settings), TRL's
SFTTrainer (four), a plain HF Trainer + peft script, unsloth, and a shipped recipe under a memory
cap. Each returns what it measured; the parent (gpu.py) turns that into rates and ratios.
trl and unsloth are imported only by the runs that use them."""

from __future__ import annotations

import time
from typing import Any

from compare_job import LORA, read_jsonl
from compare_measure import batch_segments
from compare_peer_hf import bnb_config, completion_only_dataset, peft_lora_config
from compare_worker import encode_eval, eval_loss

LR = 2e-4
WARMUP_STEPS = 3  # optimizer steps not timed: allocator warm-up, autotuning, first-call compilation


class StepClock:
    """What every optimizer step held (from the batches the tool trained on) and how long it took
    (CUDA synchronized at each step's end); peak memory after loading and during training."""

    def __init__(self, device: str):
        import torch

        self.cuda = device.startswith("cuda")
        self.torch = torch
        self.steps: list[dict[str, float]] = []
        self.held: list[dict[str, Any]] = []
        self.t0: float | None = None
        self.peak_loading = 0
        self.losses: list[float] = []  # each optimizer step's training loss, as the tool logged it

    def train_begins(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
            self.peak_loading = self.torch.cuda.max_memory_allocated()
            self.torch.cuda.reset_peak_memory_stats()
        self.t0 = time.perf_counter()

    def batch(self, batch: dict[str, Any]) -> None:
        # Kept, read at the step's end: reading a batch already on the GPU would synchronize every micro-batch.
        self.held.append({k: batch[k] for k in ("input_ids", "labels", "attention_mask", "position_ids") if k in batch})

    def step_ends(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
        now = time.perf_counter()
        segs = [seg for b in self.held for seg in batch_segments(b)]
        s = [n for n, _ in segs]
        self.steps.append(
            {
                "seconds": now - (self.t0 or now),
                "examples": len(segs),
                "tokens": sum(s),
                "trained": sum(t for _, t in segs),
                "sum_s2": sum(n * n for n in s),
            }
        )
        self.held = []
        self.t0 = time.perf_counter()  # the accounting above is not the tool's time

    def loss(self, value: float | None) -> None:
        if value is not None:
            self.losses.append(float(value))

    def result(self) -> dict[str, Any]:
        cuda = self.torch.cuda
        return {
            "steps": self.steps,
            "losses": self.losses,
            "peak_train": cuda.max_memory_allocated() if self.cuda else None,
            "peak_loading": self.peak_loading if self.cuda else None,
        }


def dtype_of(spec: dict[str, Any]):
    import torch

    return torch.bfloat16 if spec["precision"] == "bf16" else torch.float32


def hf_job_args(cls, spec: dict[str, Any], **extra):
    """The job's TrainingArguments (or SFTConfig) for the HF-based tools; extra wins."""
    packed = spec["tool"].endswith("packing")
    args = dict(
        output_dir=spec["out"],
        per_device_train_batch_size=1 if packed else spec["micro"],
        gradient_accumulation_steps=spec["packed_accum"] if packed else spec["accum"],
        learning_rate=LR,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        num_train_epochs=1,
        optim="adamw_torch",  # torch.optim.AdamW, as finetune
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=spec["precision"] == "bf16",
        use_cpu=not spec["device"].startswith("cuda"),
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    args.update(extra)
    return cls(**args)


def clocked(cls, clock: StepClock):
    """A Trainer subclass that shows the clock every batch, and the callback that ticks it."""
    from transformers import TrainerCallback

    class Tick(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            clock.train_begins()

        def on_step_end(self, args, state, control, **kw):
            clock.step_ends()

        def on_log(self, args, state, control, logs=None, **kw):
            clock.loss((logs or {}).get("loss"))  # logging_steps=1: one per optimizer step

    class Clocked(cls):
        def training_step(self, model, inputs, *args, **kwargs):
            clock.batch(inputs)
            return super().training_step(model, inputs, *args, **kwargs)

    return Clocked, Tick()


def load_4bit(spec: dict[str, Any]):
    from transformers import AutoModelForCausalLM

    device_map = {"": 0} if spec["device"].startswith("cuda") else {"": "cpu"}
    return AutoModelForCausalLM.from_pretrained(
        spec["model"], dtype=dtype_of(spec), quantization_config=bnb_config(dtype_of(spec)), device_map=device_map
    )


# ----------------------------------------------------------------------------- finetune

FINETUNE_SETTINGS = {
    # qlora-1x24gb as shipped: packed rows cut per example (auto: varlen on CUDA in 16-bit), every tensor
    # on the GPU; model.kernels=auto (liger's kernels when installed until session 29; none since)
    "finetune": [],
    # packed rows under sdpa's block-causal mask (what auto picked on CUDA until session 12)
    "finetune_sdpa": ["model.attn_implementation=sdpa"],
    # + the recipe's memory settings until session 12: checkpointed inputs and vocabulary tables in host RAM
    "finetune_offload": ["memory.activation_offload=true", "memory.embeddings=cpu"],
    # each offload alone (what the next GPU session should measure: which of the two costs the time)
    "finetune_act_offload": ["memory.activation_offload=true"],
    "finetune_host_tables": ["memory.embeddings=cpu"],
    # the two choices auto made on CUDA that session 12 left undecided: liger's kernels on and off, and compile on
    "finetune_liger": ["model.kernels=liger"],
    "finetune_no_kernels": ["model.kernels=none"],
    "finetune_compile": ["train.compile=true"],
    # issue 48's fast path: fused LoRA'd 4-bit linears and MLP blocks on Triton's kernels; the same nodes on
    # bitsandbytes' matmul and torch's ops (FINETUNE_ENV below), to tell the nodes' share from the kernels'
    "finetune_kernels": ["model.kernels=finetune"],
    "finetune_kernels_eager": ["model.kernels=finetune"],
}
# Environment a finetune tool's worker process runs with (read by finetune itself, not a recipe setting).
FINETUNE_ENV = {"finetune_kernels_eager": {"FINETUNE_TRITON": "0"}}


def finetune_overrides(spec: dict[str, Any]) -> list[str]:
    return [
        f"model.path={spec['model']}",
        f"data.path={spec['train']}",
        "data.format=completion",
        f"data.max_seq_len={spec['max_seq_len']}",
        "data.packing=true",
        "data.cache=false",
        "data.eval_fraction=0",
        f"output_dir={spec['out']}/run",
        "overwrite=true",
        "seed=0",
        f"precision={spec['precision']}",
        f"lora.r={LORA['r']}",
        f"lora.alpha={LORA['alpha']}",
        f"lora.dropout={LORA['dropout']}",
        "train.batch_size=1",
        f"train.grad_accum={spec['packed_accum']}",
        f"train.lr={LR}",
        "train.scheduler=constant",
        "train.warmup_steps=0",
        "train.max_grad_norm=1.0",
        "train.log_every_steps=1",
        "eval.every_steps=null",
        "checkpoint.every_steps=null",
        "report.plot=false",
    ]


def run_finetune(spec: dict[str, Any], clock: StepClock) -> dict[str, Any]:
    from finetune.config.schema import load_recipe
    from finetune.trainer import Callback, Trainer

    overrides = finetune_overrides(spec) + FINETUNE_SETTINGS[spec["tool"]] + spec.get("finetune_set", [])
    cfg = load_recipe("qlora-1x24gb", overrides)

    class Tick(Callback):
        def on_train_begin(self, state, metrics):
            clock.train_begins()

        def on_step_end(self, state, metrics):
            clock.step_ends()
            clock.loss(metrics.get("loss"))

    class Clocked(Trainer):
        def step_batches(self, step):
            batches = super().step_batches(step)
            for b in batches:
                clock.batch(b)
            return batches

    trainer = Clocked(cfg, callbacks=[Tick()], progress=False)
    trainer.train()
    settings = FINETUNE_SETTINGS[spec["tool"]] + spec.get("finetune_set", [])
    return {"model": trainer.accelerator.unwrap_model(trainer.model), "tokenizer": trainer.tokenizer, "settings": settings}


# ----------------------------------------------------------------------------- TRL, HF, unsloth

TRL_SETTINGS = {
    "trl": {},  # its defaults (gradient checkpointing on, no packing)
    "trl_liger": {"use_liger_kernel": True},
    "trl_liger_packing": {"use_liger_kernel": True, "packing": True},  # bfd packing: padding-free batches
    # TRL cannot truncate without packing here: max_length=None (gpu.py trims every record to fit instead)
    "trl_padding_free": {"padding_free": True, "max_length": None},
}


def run_trl(spec: dict[str, Any], clock: StepClock, model=None, tokenizer=None) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tok = tokenizer or AutoTokenizer.from_pretrained(spec["model"])
    Clocked, tick = clocked(SFTTrainer, clock)
    settings = TRL_SETTINGS.get(spec["tool"], {})
    if model is not None:  # unsloth's model: its own gradient checkpointing is on already
        settings = {"gradient_checkpointing": False}
    trainer = Clocked(
        model=model or load_4bit(spec),
        args=hf_job_args(SFTConfig, spec, **{"max_length": spec["max_seq_len"], **settings}),
        train_dataset=Dataset.from_list(read_jsonl(spec["train"])),
        processing_class=tok,
        peft_config=None if model is not None else peft_lora_config(),
        callbacks=[tick],
    )
    trainer.train()
    return {"model": trainer.model, "tokenizer": tok, "settings": settings}


def run_hf(spec: dict[str, Any], clock: StepClock) -> dict[str, Any]:
    """What a user writes: tokenize prompt + completion + EOS, labels -100 on the prompt,
    DataCollatorForSeq2Seq, prepare_model_for_kbit_training, Trainer defaults."""
    from peft import get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainingArguments

    tok = AutoTokenizer.from_pretrained(spec["model"])
    ds = completion_only_dataset(spec, tok)
    model = get_peft_model(prepare_model_for_kbit_training(load_4bit(spec), use_gradient_checkpointing=True), peft_lora_config())
    Clocked, tick = clocked(Trainer, clock)
    trainer = Clocked(
        model=model,
        args=hf_job_args(TrainingArguments, spec, gradient_checkpointing=True),
        train_dataset=ds,
        data_collator=DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=-100),
        callbacks=[tick],
    )
    trainer.train()
    return {"model": trainer.model, "tokenizer": tok, "settings": {"gradient_checkpointing": True}}


def run_unsloth(spec: dict[str, Any], clock: StepClock) -> dict[str, Any]:
    """unsloth's FastLanguageModel (4-bit, its gradient checkpointing) trained by TRL's SFTTrainer,
    as its notebooks do. Not installable on a CPU: gpu.py records why it did not run."""
    from unsloth import FastLanguageModel  # before transformers/trl are used: it patches them

    model, tok = FastLanguageModel.from_pretrained(
        model_name=spec["model"], max_seq_length=spec["max_seq_len"], dtype=dtype_of(spec), load_in_4bit=True
    )
    model = FastLanguageModel.get_peft_model(
        model,
        r=LORA["r"],
        lora_alpha=LORA["alpha"],
        lora_dropout=LORA["dropout"],
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        use_gradient_checkpointing="unsloth",
        random_state=0,
    )
    return run_trl(spec, clock, model=model, tokenizer=tok)


TOOLS = {
    **{name: run_finetune for name in FINETUNE_SETTINGS},
    **{name: run_trl for name in TRL_SETTINGS},
    "hf": run_hf,
    "unsloth": run_unsloth,
}


def run_tool(spec: dict[str, Any]) -> dict[str, Any]:
    """One tool's run: train one epoch, then the held-out loss (the same function for every tool)."""
    import torch

    clock = StepClock(spec["device"])
    got = TOOLS[spec["tool"]](spec, clock)
    held = encode_eval(read_jsonl(spec["eval"]), got["tokenizer"], spec["max_seq_len"])
    with torch.autocast(spec["device"].split(":")[0], dtype=dtype_of(spec), enabled=spec["precision"] == "bf16"):
        loss = eval_loss(got["model"], held, device=spec["device"])
    return {**clock.result(), "eval_loss": loss, "settings": got["settings"]}


# ----------------------------------------------------------------------------- a shipped recipe's peak vs its plan


def run_recipe(spec: dict[str, Any]) -> dict[str, Any]:
    """A shipped recipe, a few steps on the job's model and data, under a cap of the card it is
    written for (torch.cuda.set_per_process_memory_fraction): its peak next to `finetune plan`."""
    import torch

    from finetune.config.schema import load_recipe
    from finetune.gpus import find_gpu
    from finetune.plan import plan_recipe
    from finetune.trainer import Trainer

    cfg = load_recipe(spec["recipe"], spec["overrides"])
    cap = spec["cap_gib"] * 2**30
    if spec["device"].startswith("cuda"):
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / torch.cuda.get_device_properties(0).total_memory))
    plan = plan_recipe(cfg, find_gpu(spec["plan_gpu"]))
    result = Trainer(cfg, progress=False).train()
    cuda = spec["device"].startswith("cuda")
    return {
        "planned_allocated": plan.peak_allocated_bytes,  # what max_memory_allocated measures
        "planned": plan.peak_bytes,  # + allocator slack + CUDA context: what nvidia-smi would show
        "measured": result.peak_memory_bytes,
        "measured_is": "torch.cuda.max_memory_allocated" if cuda else "peak RSS (a CPU: not what the plan counts)",
        "measured_reserved": torch.cuda.max_memory_reserved() if cuda else None,
        "cap": cap,
        "steps": result.steps,
    }
