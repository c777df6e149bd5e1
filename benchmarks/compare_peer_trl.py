"""Peer (b) of benchmarks/compare.py: TRL's SFTTrainer. trl (the [bench] extra) is imported
only when this peer runs, so the other peers work without it."""

from __future__ import annotations

from typing import Any

from compare_job import read_jsonl
from compare_measure import Lockstep, max_rss
from compare_peer_hf import hf_args, hooked, load_base, peft_lora_config


def run_trl(spec: dict[str, Any], lock: Lockstep) -> dict[str, Any]:
    """(b) TRL SFTTrainer + peft_config, prompt/completion data (completion-only loss is
    TRL's default for that format), packing as in spec (TRL's default strategy: bfd,
    which turns on padding-free batches), TRL's defaults otherwise."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(spec["model"])
    records = read_jsonl(spec["train"])
    Hooked, pause = hooked(SFTTrainer, lock)
    args = hf_args(SFTConfig, spec, max_length=spec["max_seq_len"], packing=spec.get("packing", False))
    trainer = Hooked(
        model=load_base(spec),
        args=args,
        train_dataset=Dataset.from_list(records),
        processing_class=tok,
        peft_config=peft_lora_config(),
        callbacks=[pause],
    )
    if spec["quant"]:
        # TRL casts QLoRA adapters to bf16 (the QLoRA paper's setting). Every tool here trains
        # in fp32 (this CPU has no native bf16: its bf16 matmuls are emulated, ~100x slower),
        # so the adapters go back to fp32 before the optimizer is built.
        for p in trainer.model.parameters():
            if p.requires_grad:
                p.data = p.data.to(torch.float32)
    trainer.train()
    peak = max_rss()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"maxrss_train": peak, "losses": losses, "model": trainer.model, "tokenizer": tok}
