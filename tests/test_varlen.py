"""model.attn_implementation=varlen (finetune/model/varlen.py): packed examples attend each to itself
with no (T x T) mask. On the CPU its per-segment sdpa path runs; the CUDA varlen flash kernel is
the `gpu` test at the end (same cut points, another kernel)."""

from __future__ import annotations

import json

import pytest
import torch

from finetune.config.schema import build_recipe, load_recipe
from finetune.errors import ModelError
from finetune.gpus import find_gpu
from finetune.metrics import read_metrics
from finetune.model import varlen
from finetune.plan import plan_recipe
from finetune.trainer import Trainer
from tests.test_long_context import LLAMA_31_8B


def test_segment_starts_cut_rows_packed_examples_and_padding():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    assert varlen.segment_starts(pos, None, 1, 6).tolist() == [0, 3, 5, 6]
    right = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert varlen.segment_starts(None, right, 2, 3).tolist() == [0, 2, 3, 6]
    left = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert varlen.segment_starts(None, left, 2, 4).tolist() == [0, 2, 4, 8]
    # Packed rows padded at the end (the collator gives padding positions 0, 1, ... of its own),
    # and one (1, T) position row broadcast over the batch, as a model makes it.
    packed = torch.tensor([[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 0, 1]])
    assert varlen.segment_starts(packed, None, 2, 6).tolist() == [0, 2, 5, 6, 10, 12]
    assert varlen.segment_starts(torch.arange(4)[None], None, 2, 4).tolist() == [0, 4, 8]
    assert varlen.segment_starts(None, None, 1, 5).dtype == torch.int32


def tiny(tmp_path, model_type: str = "llama", **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    cfg = AutoConfig.for_model(model_type, vocab_size=50, max_position_embeddings=64, **shape, **extra)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / model_type)
    load = lambda attn: AutoModelForCausalLM.from_pretrained(tmp_path / model_type, attn_implementation=attn).eval()  # noqa: E731
    return load("sdpa"), load(varlen.register())


@pytest.mark.parametrize("model_type,extra", [("llama", {}), ("mistral", {"sliding_window": 4})])
def test_logits_equal_sdpa_packed_padded_and_in_generation(tmp_path, model_type, extra):
    sdpa, ours = tiny(tmp_path, model_type, **extra)
    ids = torch.randint(3, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2]])
    right = torch.ones(2, 12, dtype=torch.long)
    right[1, 9:] = 0
    left = torch.ones(2, 12, dtype=torch.long)
    left[1, :4] = 0
    with torch.no_grad():
        logits = lambda m, **kw: m(input_ids=ids, use_cache=False, **kw).logits  # noqa: E731
        torch.testing.assert_close(logits(ours, position_ids=pos), logits(sdpa, position_ids=pos), rtol=0, atol=1e-5)
        torch.testing.assert_close(logits(ours), logits(sdpa), rtol=0, atol=1e-5)
        for mask in (right, left):  # real tokens; padding is never trained
            keep = mask.bool()
            got, want = logits(ours, attention_mask=mask)[keep], logits(sdpa, attention_mask=mask)[keep]
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        # it does keep packed examples apart: the packed row differs from the same ids unpacked
        assert (logits(ours, position_ids=pos) - logits(ours)).abs().max() > 1e-2
        gen = dict(input_ids=ids[:, :6], attention_mask=left[:, :6], max_new_tokens=5, do_sample=False)
        assert ours.generate(**gen).tolist() == sdpa.generate(**gen).tolist()


def test_gradients_equal_sdpa_for_packed_rows(tmp_path):
    sdpa, ours = tiny(tmp_path)
    ids = torch.randint(3, 50, (1, 12), generator=torch.Generator().manual_seed(2))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])
    grads = []
    for model in (sdpa, ours):
        model.train()
        model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)


def test_attention_varlen_cannot_compute_is_named():
    from transformers import AutoConfig

    assert varlen.unsupported(AutoConfig.for_model("llama")) is None
    assert "attn_logit_softcapping" in varlen.unsupported(AutoConfig.for_model("gemma2"))
    assert "sinks" in varlen.unsupported(AutoConfig.for_model("gpt_oss"))
    # Llama 4 attends in chunks of 8192 in 3 of every 4 layers; flash's mask function drops the chunk
    assert "attention_chunk_size" in varlen.unsupported(AutoConfig.for_model("llama4_text", attention_chunk_size=4))
    assert "attention_chunk_size" in varlen.unsupported(AutoConfig.for_model("llama4", text_config={"attention_chunk_size": 4}))


def test_softcapped_attention_is_refused_at_load(tmp_path):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from finetune.model.load import load_model

    Gemma2ForCausalLM(
        Gemma2Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
        )
    ).save_pretrained(tmp_path / "g2")
    cfg = build_recipe(
        {
            "model": {"path": str(tmp_path / "g2"), "attn_implementation": "varlen"},
            "data": {"path": "x.jsonl"},
            "output_dir": str(tmp_path / "out"),
            "precision": "fp32",
            "quant": {"bits": None},
        }
    )
    with pytest.raises(ModelError, match="attn_logit_softcapping") as err:
        load_model(cfg, device=torch.device("cpu"))
    assert "model.attn_implementation=auto" in err.value.hint


def test_packed_training_equals_sdpa_and_the_planner_counts_no_mask(recipe_dict, tmp_path):
    def run(attention):
        data = json.loads(json.dumps(recipe_dict))
        data.update(output_dir=str(tmp_path / attention), report={"plot": False}, precision="fp32")
        data["model"] = {**data["model"], "attn_implementation": attention}
        data["data"]["packing"] = True
        data["train"].update(max_steps=3, batch_size=2)
        data["memory"] = {"activation_checkpointing": "all"}  # the recomputation reuses the batch's cut points
        trainer = Trainer(build_recipe(data), progress=False)
        trainer.train()
        assert trainer.accelerator.unwrap_model(trainer.model).config._attn_implementation == attention
        return [r["loss"] for r in read_metrics(tmp_path / attention / "metrics.jsonl") if "loss" in r]

    losses = run("varlen")
    assert len(losses) == 3 and losses == pytest.approx(run("sdpa"), rel=1e-5)
    gpu = find_gpu("rtx4090", None)
    base = ["model.path=" + LLAMA_31_8B, "data.path=unused.jsonl", "data.packing=true"]
    mask = lambda *more: plan_recipe(load_recipe("qlora-longctx-1x24gb", base + list(more)), gpu).component("attention_mask")  # noqa: E731
    assert mask("model.attn_implementation=sdpa") == 131_072**2 and mask("model.attn_implementation=varlen") == 0
    assert mask() == 0  # auto on CUDA in bf16 cuts packed rows too


@pytest.mark.gpu
def test_cuda_varlen_kernel_matches_sdpa_in_bf16(tmp_path, monkeypatch):
    # GPU only: torch's varlen flash kernel (torch.nn.attention.varlen) has no CPU implementation.
    sdpa, ours = (m.to("cuda", torch.bfloat16) for m in tiny(tmp_path))
    paths = []  # which path ran: a silent fall back to the per-segment loop must fail this test
    for name in ("_flash_varlen", "_per_segment"):
        real = getattr(varlen, name)
        monkeypatch.setattr(varlen, name, lambda *a, _real=real, _name=name, **k: paths.append(_name) or _real(*a, **k))
    ids = torch.randint(3, 50, (2, 12), generator=torch.Generator().manual_seed(1)).cuda()
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2]]).cuda()
    grads = []
    for model in (sdpa, ours):
        model.train()
        model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss.backward()
        grads.append(torch.cat([p.grad.float().flatten() for p in model.parameters()]))
    assert paths and set(paths) == {"_flash_varlen"}, paths
    torch.testing.assert_close(grads[1], grads[0], rtol=2e-2, atol=2e-3)


def test_cut_points_are_computed_once_per_batch_and_again_when_the_positions_change(tmp_path, monkeypatch):
    # Each computation is two host syncs on CUDA: once per forward, not once per layer.
    sdpa, ours = tiny(tmp_path)
    calls = []
    real = varlen.segment_starts
    monkeypatch.setattr(varlen, "segment_starts", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = torch.randint(3, 50, (1, 12), generator=torch.Generator().manual_seed(3))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])
    with torch.no_grad():
        ours(input_ids=ids, position_ids=pos, use_cache=False)
        assert len(calls) == 1  # 2 layers, one computation
        ours(input_ids=ids, position_ids=pos.clone(), use_cache=False)
        assert len(calls) == 2  # another tensor
        pos[0, 3] = 0  # the same tensor changed in place: a new cut at 3
        got = ours(input_ids=ids, position_ids=pos, use_cache=False).logits
        assert len(calls) == 3
        torch.testing.assert_close(got, sdpa(input_ids=ids, position_ids=pos, use_cache=False).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "data,expected",
    [
        ({"packing": True, "max_seq_len": 2048}, "varlen"),
        ({"packing": True, "max_seq_len": 512}, "sdpa"),
        ({"max_seq_len": 2048}, "sdpa"),
    ],
)
def test_auto_cuts_long_packed_rows_per_example_on_a_cpu(recipe_dict, data, expected):
    # benchmarks/varlen_cpu.py: 1.6x sdpa's masked packed rows at 2048 tokens, 2.9x at 8192; no gain at 512.
    from finetune.model.load import choose_attention

    recipe = json.loads(json.dumps(recipe_dict))
    recipe["data"].update(data)
    attention, note = choose_attention(build_recipe(recipe), torch.device("cpu"), torch.float32)
    assert attention == expected
    assert (note is not None and "picks varlen on a CPU" in note) == (expected == "varlen")


def test_auto_says_when_it_cannot_look_up_the_model_class(recipe_dict, monkeypatch):
    # Custom code or an unreadable config: transformers' default attention, said in a note (not silently).
    from finetune.model import load

    def unreadable(cfg):
        raise OSError("config.json: no such file")

    monkeypatch.setattr(load, "causal_lm_class", unreadable)
    attention, note = load.choose_attention(build_recipe(recipe_dict), torch.device("cpu"), torch.float32)
    assert attention is None
    assert note == (
        "note: attn_implementation=auto could not look up the model's class (OSError: config.json: no such file); "
        "transformers' default"
    )


@pytest.mark.parametrize(
    "packed, seq, device, compute_bytes, ok, expected",
    [
        (True, 512, "cuda", 2, True, True),  # H100, Llama-3.1-8B 4-bit, rows of 2048: 1.36x sdpa's masked rows
        (True, 512, "cuda", 4, True, False),  # fp32: the flash kernel takes 16-bit only
        (True, 2048, "cuda", 2, False, False),  # softcapped or sink attention
        (False, 2048, "cuda", 2, True, False),  # padded rows: sdpa
        (True, 2048, "cpu", 4, True, True),
        (True, 512, "cpu", 4, True, False),
        (True, 2048, "mps", 2, True, False),
    ],
)
def test_auto_cuts_packed_rows_where_it_was_measured_faster(packed, seq, device, compute_bytes, ok, expected, monkeypatch):
    assert varlen.flash_kernel() is not None  # torch 2.13 has the kernel (with scale and window_size)
    assert varlen.auto_cuts_packed_rows(packed, seq, device, compute_bytes, ok) is expected
    monkeypatch.setattr(varlen, "flash_kernel", lambda: None)  # a torch without it: CUDA stays on sdpa
    assert varlen.auto_cuts_packed_rows(packed, seq, device, compute_bytes, ok) is (expected and device == "cpu")


def test_fp16_full_fine_tuning_picks_and_plans_attention_by_its_compute_precision():
    # fp32 weights under fp16 autocast: the loader and the planner both read the matmuls' precision.
    from finetune.model.load import choose_attention

    full_fp16 = ["model.path=" + LLAMA_31_8B, "data.path=unused.jsonl", "data.packing=true", "precision=fp16", "lora=null",
                 "quant.bits=null", "memory.embeddings=device"]  # fmt: skip
    cfg = load_recipe("qlora-1x24gb", full_fp16)
    attention, _ = choose_attention(cfg, torch.device("cuda"), torch.float32, compute_bytes=2)
    assert attention == "varlen"
    assert plan_recipe(cfg, find_gpu("rtx4090", None)).component("attention_mask") == 0


def test_the_planner_resolves_auto_as_the_loader_does(tmp_path):
    gpu = find_gpu("rtx4090", None)
    base = ["model.path=" + LLAMA_31_8B, "data.path=unused.jsonl", "data.packing=true"]
    mask = lambda *more: plan_recipe(load_recipe("qlora-1x24gb", base + list(more)), gpu).component("attention_mask")  # noqa: E731
    rows = load_recipe("qlora-1x24gb", base).train.batch_size
    assert mask() == 0 and mask("model.attn_implementation=varlen") == 0  # auto on CUDA in bf16: varlen
    assert mask("model.attn_implementation=sdpa") == rows * 2048**2
    assert mask("precision=fp32") == rows * 2048**2  # fp32: no flash kernel, auto stays sdpa
    from transformers import Gemma2Config

    # softcapped attention logits: varlen cannot, so auto stays sdpa (and its mask is planned)
    Gemma2Config(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, vocab_size=1024).save_pretrained(tmp_path)  # fmt: skip
    capped = plan_recipe(load_recipe("qlora-1x24gb", [*base[1:], f"model.path={tmp_path}"]), gpu)
    assert capped.component("attention_mask") == rows * 2048**2


def test_a_kernel_without_enable_gqa_gets_each_kv_head_repeated_for_its_query_heads():
    # torch 2.11's varlen_attn has no enable_gqa (seen on the H100): finetune repeats K/V heads, query head h
    # reading KV head h // g. A stand-in kernel of that signature (per-segment causal sdpa, no GQA of its own)
    # must give the per-segment path's numbers; tiling the heads (h % kv) instead would not.
    def kernel_2_11(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), return_aux=None):
        assert k.shape[1] == q.shape[1], "the kernel got fewer KV heads than query heads"
        return varlen._per_segment(q, k, v, cu_q.tolist(), scale, None, 0.0)

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(10, 4, 8, generator=g), torch.randn(10, 2, 8, generator=g), torch.randn(10, 2, 8, generator=g)
    bounds = [0, 6, 10]
    got = varlen._flash_varlen(kernel_2_11, q, k, v, torch.tensor(bounds), 6, 0.35, None)
    torch.testing.assert_close(got, varlen._per_segment(q, k, v, bounds, 0.35, None, 0.0), rtol=0, atol=1e-6)
