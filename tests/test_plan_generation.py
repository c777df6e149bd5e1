"""finetune plan for an online objective (grpo): the KV cache and buffers of sampling, and its time.

The completions of a step are sampled (objectives/sampling.py: HF generate, a KV cache, no autograd) before its
first forward, so the step's peak is the larger of sampling's and training's over what every moment holds."""

from __future__ import annotations

import types
from dataclasses import replace

import pytest
import torch
from test_plan import CONFIGS
from test_plan_measured import LiveBytes, build_model_dir, quant_state_tensors

from finetune.config.schema import build_recipe
from finetune.gpus import find_gpu
from finetune.plan import RecipeFacts, Setup, estimate, plan_recipe, read_model_shape, report, setup_of
from finetune.plan.speed import BANDWIDTH_EFFICIENCY, MATMUL_EFFICIENCY
from finetune.plan.terms import sampling_terms

NF4_LORA_BF16 = RecipeFacts(
    quant_bits=4, double_quant=True, lora_r=16, lora_target="all-linear", lora_dropout=0.0, dora=False, compute_bytes=2
)


def grpo_recipe(model: str, tmp_path, memory: dict | None = None, distributed: dict | None = None, **train):
    return build_recipe(
        {
            "model": {"path": str(CONFIGS / model)},
            "data": {"path": "prompts.jsonl", "format": "prompt", "max_seq_len": train.pop("seq", 1024)},
            "output_dir": str(tmp_path / "run"),
            "lora": {"r": 16, "alpha": 32, "dropout": 0.0},
            "memory": memory or {},
            "distributed": distributed or {},
            "train": {"objective": "grpo", "rewards": [{"name": "exact_match", "column": "answer"}], **train},
        }
    )


def test_kv_cache_of_llama_3_1_8b_is_k_and_v_of_every_layer_row_and_position():
    shape = read_model_shape(str(CONFIGS / "llama-3.1-8b"))  # 32 layers, 8 KV heads of 128, vocabulary 128,256
    setup = Setup(batch_size=2, grad_accum=1, seq_len=1024, sequences_per_example=8, sampled_tokens=512)
    gen = sampling_terms(shape, NF4_LORA_BF16, setup, adapter_bytes=4)
    # 2 (K, V) x 32 layers x 8 heads x 128 x rows x positions x 2 bytes; after the prefill, the 2 prompts' cache (at
    # most 1024 - 512 tokens, all but the last: their 8 completions share it)
    assert gen.prompt_cache == 2 * 32 * 8 * 128 * 2 * 511 * 2 == 133_955_584
    # the last step: 512 + 511 positions (the last token sampled is never fed back)
    assert gen.cache == 2 * 32 * 8 * 128 * 16 * 1023 * 2 == 2_145_386_496
    # a step: one layer's K (or V) at 1022 positions, the old copy torch.cat still holds, with the last step's fp32
    # logits and probabilities (16 x 128,256 x 8), more than the head's moment (bf16 logits, fp32 copy, both steps'
    # probabilities and the last's copy: 16 x 128,256 x 14)
    assert gen.decode == 16 * 1022 * 8 * 128 * 2 + 16 * 128_256 * 8 == 49_905_664 > 16 * 128_256 * 14
    # a prompt token at the up_proj of one layer: SiLU, result, peft's clone, lora_B's output and its scaled copy in
    # fp32 (14,336 x 12), the fp32 input peft casts (4,096 x 4), four hidden-sized bf16 tensors, RoPE's cos and sin;
    # and the left-padded prompts' bool mask; for the 2 prompts' 511 tokens (each prefilled once)
    assert gen.prefill == 2 * 511 * (14_336 * 12 + 4_096 * 4 + 4 * 4_096 * 2 + 2 * 128 * 2) + 2 * 511 * 511 == 227_095_554
    e = estimate(shape, NF4_LORA_BF16, setup, find_gpu("rtx4090"))
    # the last decode step is the peak (prefilled 16 times over, the prefill was: 1.82 GB of buffers beside 1 GiB)
    assert e.component("kv_cache") == 2_145_386_496 and e.component("sampling_buffers") == 49_905_664
    # training: grpo's head runs on the completions only (a boolean logits_to_keep), 512 positions a row at most
    assert e.component("logits_loss") == 16 * 512 * 128_256 * 12


def test_a_grpo_peak_is_the_sampling_when_the_kv_cache_outweighs_training(tmp_path):
    """Llama-2-7B (32 KV heads: 512 KiB of cache a token) with activations offloaded: sampling is the step's peak, and
    8 more completions of each prompt add their cache at its longest (max_seq_len - 1 positions) and buffers."""
    gpu = find_gpu("rtx4090")
    offload = {"activation_offload": True}
    cfgs = [grpo_recipe("llama-2-7b", tmp_path, offload, batch_size=2, num_generations=n, max_new_tokens=768) for n in (8, 16)]
    eight, sixteen = (plan_recipe(cfg, gpu) for cfg in cfgs)
    assert eight.peak_phase == sixteen.peak_phase == "sampling"
    kept = ("weights_quantized", "quant_constants", "weights_unquantized", "lora_weights", "optimizer_state")
    for e in (eight, sixteen):  # the gradients are None while sampling; nothing is saved for backward
        held = sum(e.component(k) for k in kept) + e.component("dequant_buffer")
        assert e.peak_allocated_bytes == held + e.component("kv_cache") + e.component("sampling_buffers")
        assert not any(c.in_peak for c in e.components if c.key in ("gradients", "activations", "logits_loss"))
    rows = 2 * 8  # the completions added
    more_cache = 2 * 32 * 32 * 128 * rows * 1023 * 2
    # torch.cat's old copy of one layer's K, and the last step's fp32 logits and probabilities
    more_buffers = rows * 1022 * 32 * 128 * 2 + rows * 32_000 * 8
    assert sixteen.peak_allocated_bytes - eight.peak_allocated_bytes == more_cache + more_buffers == 8_719_597_568
    trained_only = estimate(eight.shape, RecipeFacts.from_config(cfgs[0], "bf16"), replace(eight.setup, sampled_tokens=0), gpu)
    assert trained_only.peak_phase != "sampling"
    assert trained_only.peak_allocated_bytes < eight.peak_allocated_bytes - 1024**3  # what was planned before


def test_step_time_adds_every_micro_batchs_sampling(tmp_path):
    gpu = find_gpu("rtx4090")
    train = {"batch_size": 2, "grad_accum": 4, "num_generations": 8, "max_new_tokens": 768}
    cfg = grpo_recipe("llama-2-7b", tmp_path, **train)
    e = plan_recipe(cfg, gpu)
    trained_only = estimate(e.shape, RecipeFacts.from_config(cfg, "bf16"), replace(e.setup, sampled_tokens=0), gpu)
    assert e.step_time_s == pytest.approx(trained_only.step_time_s + e.step_time_parts["sampling"], rel=1e-12)
    # By hand, per micro-batch: 2 prompts of 256 tokens (1024 - 768) prefilled once, 255 tokens each (shared by their
    # 8 completions), then 768 forwards of one token a row (the prompts' last token, then 767 sampled ones).
    s, rows, prompt, steps = e.shape, 16, 256, 768
    rate, bandwidth = 165.2e12 * MATMUL_EFFICIENCY, 1008e9 * BANDWIDTH_EFFICIENCY
    lora = 2 * e.trainable_params
    prefill = (2 * 255 * (2 * s.linear_params + lora + 2 * prompt * 32 * 128 * 32) + 2 * 2 * s.head_params) / rate
    prefill += s.linear_params * 4.5 / bandwidth  # the 4-bit weights dequantized once
    spans = 767 * prompt + 767 * 768 // 2 + prompt  # the positions each fed token attends to (the last prompt token's 256)
    weights = s.linear_params * 4.5 + s.head_params * 2 + e.trainable_params * 4  # read by every forward
    kv = 3 * rows * (2 * 32 * 32 * 128 * 2) * spans  # torch.cat reads the cache and writes it anew, attention reads it
    flops = rows * (steps * (2 * (s.linear_params + s.head_params) + lora) + spans * 4 * 32 * 128 * 32)
    assert kv + steps * weights > flops / rate * bandwidth  # decoding waits on memory, not on the matmuls
    assert e.step_time_parts["sampling"] == pytest.approx(4 * (prefill + (steps * weights + kv) / bandwidth), rel=1e-9)
    assert e.step_time_parts["sampling"] > 4 * trained_only.step_time_s  # 767 passes over the weights per micro-batch
    text = report(e)
    assert "8 completions of each sampled, up to 768 new tokens (16 rows per forward)" in text
    # the KL's reference (beta > 0) and, when a sampling serves 2 steps, the sampling policy's log-probabilities
    two = setup_of(grpo_recipe("llama-2-7b", tmp_path, beta=0.1, steps_per_generation=2, **train))
    assert (two.reference_passes, setup_of(cfg).reference_passes) == (2, 0)
    assert "(16 rows per forward, + 2 forwards without gradients)" in report(replace(e, setup=two))
    assert f"sampling   {e.step_time_parts['sampling']:.2f} s/step of it: 4 x 16 completions of up to 768 tokens" in text


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """hidden 512, 4 layers, GQA 8/4 heads, intermediate 1376, vocabulary 8k (tests/test_plan_measured.py's)."""
    return build_model_dir(tmp_path_factory.mktemp("small"), hidden=512, layers=4, vocab=8000)


class _Tokenizer:
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


@pytest.mark.parametrize("prompt, new, peak_at", [(256, 2, "prefill"), (8, 32, "decode")])
def test_sampling_peak_matches_measured_cpu_allocations(small_model, tmp_path, prompt, new, peak_at):
    """objectives/sampling.complete on the model loaded through the real path (NF4, LoRA r=8, fp32 on the CPU): the
    bytes its generate allocates at their peak (LiveBytes) against sampling_terms. bitsandbytes dequantizes inside
    its own op on the CPU (no tensor the mode sees), so the dequantized weight is in neither."""
    from finetune.model.load import load_model
    from finetune.objectives.sampling import complete

    prompts, group = 2, 4
    cfg = build_recipe(
        {
            "model": {"path": str(small_model)},
            "data": {"path": "prompts.jsonl", "format": "prompt", "max_seq_len": prompt + new},
            "output_dir": str(tmp_path / "run"),
            "precision": "fp32",
            "quant": {"bits": 4},
            "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
            "train": {"objective": "grpo", "batch_size": prompts, "num_generations": group, "max_new_tokens": new}
            | {"rewards": [{"name": "exact_match", "column": "answer"}]},
        }
    )
    torch.manual_seed(0)
    model = load_model(cfg, precision="fp32", device=torch.device("cpu"))
    ids = torch.randint(1, 8000, (prompts, prompt))
    mask = torch.ones_like(ids)
    ids[0, : prompt // 4], mask[0, : prompt // 4] = 0, 0  # one prompt shorter: left-padded, as the collator does
    train = types.SimpleNamespace(max_new_tokens=new, temperature=1.0, top_p=1.0, stop=[])
    tracker = LiveBytes(existing=[*model.parameters(), *model.buffers(), *quant_state_tensors(model)])
    with tracker:
        # An end token outside the vocabulary: every row runs to max_new_tokens, as the plan assumes.
        complete(model, {"input_ids": ids, "attention_mask": mask}, group, _Tokenizer(), [8000], train, greedy=False)
    gen = sampling_terms(read_model_shape(str(small_model)), RecipeFacts.from_config(cfg, "fp32", on_gpu=False), setup_of(cfg), 4)
    assert ("prefill" if gen.prefills_at_peak else "decode") == peak_at
    assert gen.peak / tracker.peak - 1 == pytest.approx(0, abs=0.05), f"predicted {gen.peak:,} measured {tracker.peak:,}"


def test_under_fsdp_every_decoded_token_waits_for_the_gathered_weights(tmp_path):
    """FSDP samples from gathered weights (objectives/sampling.complete, synced): each forward gathers the other
    rank's shard of the 4-bit layers over the GPU link, which on PCIe cards is slower than reading them."""
    gpu = find_gpu("rtx4090")
    train = {"batch_size": 2, "grad_accum": 4, "num_generations": 8, "max_new_tokens": 512}
    fsdp = plan_recipe(grpo_recipe("llama-3.1-8b", tmp_path, distributed={"strategy": "fsdp"}, **train), gpu, gpus=2)
    ddp = plan_recipe(grpo_recipe("llama-3.1-8b", tmp_path, **train), gpu, gpus=2)
    shard = fsdp.component("weights_quantized") + fsdp.component("quant_constants")  # this GPU's half
    # micro-batches x forwards (the prompts' prefill, their last token, 511 sampled) x the other half over PCIe at 80%
    gathers = 4 * 513 * shard * (2 - 1) / (25e9 * 0.8)
    assert fsdp.step_time_parts["sampling"] == pytest.approx(gathers, rel=1e-12)
    assert gathers > ddp.step_time_parts["sampling"]  # DDP's forwards read their whole weights from memory


def test_qwen2_5_7b_grpo_with_long_completions_fits_a_4090_with_its_head_in_chunks(tmp_path):
    # Issue 49's case: G=8 completions of up to 2,048 tokens after 1,024-token prompts. The head over chunks of 256
    # completion tokens (objectives/grpo.completion_logps) holds one chunk's logits; the whole head's would be
    # 8 x 2,048 positions x 152,064 x 12 bytes = 27.8 GiB on their own.
    gpu = find_gpu("rtx4090")
    train = {"batch_size": 1, "grad_accum": 8, "num_generations": 8, "max_new_tokens": 2048, "seq": 3072}
    chunked, whole = (
        plan_recipe(grpo_recipe("qwen2.5-7b", tmp_path, {"loss": loss, "activation_checkpointing": "all"}, **dict(train)), gpu)
        for loss in ("auto", "full")
    )
    assert chunked.component("logits_loss") == 256 * 152_064 * 12
    assert whole.component("logits_loss") == 8 * 2048 * 152_064 * 12
    assert chunked.fits and not whole.fits
    assert chunked.peak_allocated_bytes < 22 * 1024**3 < gpu.memory_bytes


def test_num_iterations_spreads_a_samplings_time_over_its_steps_and_adds_the_old_policys_pass(tmp_path):
    gpu = find_gpu("rtx4090")
    train = {"batch_size": 2, "grad_accum": 4, "num_generations": 8, "max_new_tokens": 768}
    once, twice = (plan_recipe(grpo_recipe("llama-2-7b", tmp_path, **train, num_iterations=n), gpu) for n in (1, 2))
    assert twice.step_time_parts["sampling"] == pytest.approx(once.step_time_parts["sampling"] / 2, rel=1e-12)
    # the second iteration's ratios need the sampling policy's log-probabilities: one forward without gradients, once
    # a sampling: half a forward a step (beta > 0's reference pass, every step at mu 1, is a whole one)
    assert (once.setup.reference_passes, twice.setup.reference_passes) == (0, 1)
    kl = plan_recipe(grpo_recipe("llama-2-7b", tmp_path, **train, beta=0.1), gpu)
    extra = twice.step_time_parts["compute"] - once.step_time_parts["compute"]
    assert extra > 0 and extra == pytest.approx(0.5 * (kl.step_time_parts["compute"] - once.step_time_parts["compute"]))
