"""The base model as loaded for training: one room per thing a loaded model can be.

shards   safetensors files read and written one tensor at a time
moe      mixture-of-experts models' fused expert weights, stored 4-bit; which of them LoRA adapts
varlen   attention that cuts packed rows into their examples (no T x T mask)
load     tokenizer; base model in 4-bit NF4 (bitsandbytes), checkpointing, peft adapters
kernels  model.kernels: liger-kernel's fused norms, RoPE and MLP patched into the loaded model
"""
