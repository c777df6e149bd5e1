"""Issue 27 spike: does torch.distributed.pipelining carry a bitsandbytes NF4 base with peft LoRA?

    python -m torch.distributed.run --nproc_per_node 2 scripts/spikes/pipeline_4bit_lora.py gpipe   # or 1f1b

A tiny random-init Llama (4 layers) in 4-bit, LoRA r4 on every linear, cut into 2 stages by hand
(embeddings + layers 0-1 | layers 2-3 + norm + head), gloo, fp32, 2 micro-batches. The loss, every
LoRA gradient and the pre-clip gradient norm are compared with one process over the same batch.
Session 12 (torch 2.13 CPU, bnb 0.50.2, peft 0.21.2): loss equal to 5e-7, gradients to 7e-8, norms
equal, for GPipe and 1F1B alike. Not product code: the first slice of distributed.pipeline_parallel
starts from this.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

MODEL = "/tmp/finetune-spike/model"


def build() -> None:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(MODEL)


def load():
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=torch.float32)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(MODEL, quantization_config=q, dtype=torch.float32, attn_implementation="sdpa")
    torch.manual_seed(1)  # the same nonzero LoRA weights in every load
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))


class Stage(nn.Module):
    """Layers lo..hi of the decoder; the first stage embeds, the last normalises and projects."""

    def __init__(self, base, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        self.embed = base.model.embed_tokens if first else None
        self.layers = nn.ModuleList(base.model.layers[lo:hi])
        self.rotary = base.model.rotary_emb  # each stage computes its own rotary angles
        self.norm = base.model.norm if last else None
        self.head = base.lm_head if last else None

    def forward(self, x):
        h = self.embed(x) if self.first else x
        pos = torch.arange(h.shape[1]).unsqueeze(0).expand(h.shape[0], -1)
        angles = self.rotary(h, pos)
        for layer in self.layers:
            h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=angles)
            h = h[0] if isinstance(h, tuple) else h
        return self.head(self.norm(h)) if self.last else h


def main() -> None:
    schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[sys.argv[1] if len(sys.argv) > 1 else "gpipe"]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0 and not os.path.exists(MODEL + "/config.json"):
        build()
    dist.barrier()
    torch.manual_seed(2)
    ids = torch.randint(0, 128, (4, 16))
    labels = ids.clone()
    labels[:, :3] = -100
    targets = int((labels[:, 1:] != -100).sum())

    def loss_fn(logits, lab):  # summed over a micro-batch, divided by the window's targets: the window's token mean
        flat = logits[:, :-1].reshape(-1, logits.shape[-1])
        return nn.functional.cross_entropy(flat, lab[:, 1:].reshape(-1), ignore_index=-100, reduction="sum") / targets

    ref = load()
    ref_loss = loss_fn(ref(input_ids=ids).logits, labels)
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.requires_grad}

    model = load()
    base = model.base_model.model
    per = len(base.model.layers) // world
    part = Stage(base, rank * per, (rank + 1) * per, rank == 0, rank == world - 1)
    stage = PipelineStage(part, rank, world, torch.device("cpu"))
    steps = schedule(stage, n_microbatches=2, loss_fn=loss_fn, scale_grads=False)  # our loss_fn already scales
    losses: list[torch.Tensor] = []
    if rank == 0:
        steps.step(ids)
    else:
        steps.step(target=labels, losses=losses)
    names = {id(p): n for n, p in model.named_parameters()}
    trained = [p for p in part.parameters() if p.requires_grad]
    worst = max(float((p.grad - ref_grads[names[id(p)]]).abs().max()) for p in trained)
    square = torch.tensor(sum(float(p.grad.pow(2).sum()) for p in trained))
    dist.all_reduce(square)
    ref_norm = sum(float(g.pow(2).sum()) for g in ref_grads.values()) ** 0.5
    if rank == world - 1:
        print(f"loss: pipeline {float(sum(losses).detach()):.8f}, one process {float(ref_loss):.8f}")
    print(
        f"rank {rank}: {len(trained)} LoRA tensors, max |grad diff| {worst:.1e}; norm {square.item() ** 0.5:.8f} vs {ref_norm:.8f}"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
