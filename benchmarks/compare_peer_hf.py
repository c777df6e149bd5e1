"""Peer (c) of benchmarks/compare.py: the script a user writes with transformers + peft; and
the HF Trainer pieces it shares with the TRL peer (TrainingArguments, the hooks that count
batches and pause, the base model, the LoRA config)."""

from __future__ import annotations

from typing import Any

from compare_job import LORA, LR, SEED, read_jsonl
from compare_measure import Lockstep, max_rss


def bnb_config(compute_dtype=None):
    """NF4, double quant; compute in fp32 (this CPU job) unless told."""
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype or torch.float32,
    )


def peft_lora_config():
    from peft import LoraConfig

    return LoraConfig(
        r=LORA["r"],
        lora_alpha=LORA["alpha"],
        lora_dropout=LORA["dropout"],
        target_modules="all-linear",
        bias="none",
        task_type="CAUSAL_LM",
    )


def hf_args(cls, spec: dict[str, Any], **extra):
    return cls(
        output_dir=spec["out"],
        per_device_train_batch_size=spec["micro"],
        gradient_accumulation_steps=spec["accum"],
        learning_rate=LR,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        max_steps=spec["steps"],
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=False,
        fp16=False,
        use_cpu=True,
        seed=SEED,
        disable_tqdm=True,
        gradient_checkpointing=spec["gc"],
        **extra,
    )


def hooked(cls, lock: Lockstep):
    from transformers import TrainerCallback

    class Pause(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            lock.mark_loaded()

        def on_step_end(self, args, state, control, **kw):
            lock.end_step()
            lock.pause()

    class Hooked(cls):
        def training_step(self, model, inputs, *args, **kwargs):
            lock.record(inputs)
            return super().training_step(model, inputs, *args, **kwargs)

    return Hooked, Pause()


def load_base(spec: dict[str, Any]):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        spec["model"], dtype=torch.float32, quantization_config=bnb_config() if spec["quant"] else None, device_map={"": "cpu"}
    )


def completion_only_dataset(spec: dict[str, Any], tok):
    """The training records as a user's script tokenizes them: prompt + completion + EOS, cut at
    max_seq_len, labels -100 on the prompt."""
    from datasets import Dataset

    msl = spec["max_seq_len"]

    def tokenize(r):
        prompt = tok(r["prompt"])["input_ids"]
        ids = (tok(r["prompt"] + r["completion"])["input_ids"] + [tok.eos_token_id])[:msl]
        return {
            "input_ids": ids,
            "attention_mask": [1] * len(ids),
            "labels": ([-100] * len(prompt) + ids[len(prompt) :])[: len(ids)],
        }

    return Dataset.from_list(read_jsonl(spec["train"])).map(tokenize, remove_columns=["prompt", "completion"])


def run_hf(spec: dict[str, Any], lock: Lockstep) -> dict[str, Any]:
    """(c) what a user writes with transformers + peft: tokenize prompt + completion + EOS,
    labels -100 on the prompt, DataCollatorForSeq2Seq, Trainer with its defaults."""
    from peft import get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainingArguments

    tok = AutoTokenizer.from_pretrained(spec["model"])
    ds = completion_only_dataset(spec, tok)
    model = load_base(spec)
    if spec["quant"]:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=spec["gc"])
    model = get_peft_model(model, peft_lora_config())
    Hooked, pause = hooked(Trainer, lock)
    extra = {"train_sampling_strategy": "group_by_length"} if spec.get("grouping") else {}
    trainer = Hooked(
        model=model,
        args=hf_args(TrainingArguments, spec, **extra),
        train_dataset=ds,
        data_collator=DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=-100),
        callbacks=[pause],
    )
    trainer.train()
    peak = max_rss()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"maxrss_train": peak, "losses": losses, "model": trainer.model, "tokenizer": tok}
