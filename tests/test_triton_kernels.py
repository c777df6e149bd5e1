"""model/triton_kernels.py on this CPU under Triton's interpreter (TRITON_INTERPRET=1; triton from the test extra):
the NF4 matmul (dequantization in the GEMM's tile, double quant or not, forward and the input's gradient) equals
bitsandbytes' dequantize_4bit then a matmul; the SwiGLU tail equals torch's silu and its backward; the fused MLP
block and LoRA'd linears running on them equal peft over bitsandbytes. A dropped double-quant offset fails.
What only a GPU exercises (the compiled kernels, their speed): tests/test_gpu.py and benchmarks/gpu.py."""

from __future__ import annotations

import importlib

import pytest
import torch

from finetune.model import fast_lora


@pytest.fixture
def kernels(monkeypatch):
    module = pytest.importorskip("finetune.model.triton_kernels", reason="triton (the test extra)")
    if not module.INTERPRETING:  # (conftest sets TRITON_INTERPRET=1 before triton's import where there is no CUDA)
        pytest.skip("triton compiles here (a CUDA machine): the interpreter's tests run on a CPU machine")
    monkeypatch.setenv("FINETUNE_TRITON", "interpret")  # the fused nodes' CPU tensors through the interpreter too
    return module


def _quantized(shape, dtype, nested):
    import bitsandbytes.functional as bnbf

    torch.manual_seed(0)
    packed, state = bnbf.quantize_4bit(
        torch.randn(*shape, dtype=dtype), blocksize=64, quant_type="nf4", compress_statistics=nested
    )
    return packed, state, bnbf.dequantize_4bit(packed, state).to(dtype)


def _tolerance(dtype):  # sums in another order: fp32's last bits, bf16's one rounding of the output
    return {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-5}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nested", [True, False], ids=["double quant", "fp32 absmax"])
@pytest.mark.parametrize("shape", [(344, 128), (40, 200)], ids=["344x128", "40x200 (blocks across rows)"])
def test_the_nf4_matmul_is_dequantize_then_matmul(kernels, dtype, nested, shape):
    packed, state, w = _quantized(shape, dtype, nested)
    x, g = torch.randn(2, 5, shape[1], dtype=dtype), torch.randn(2, 5, shape[0], dtype=dtype)
    # the reference summed in fp32 and rounded once (a 16-bit MMA's way; torch's CPU bf16 matmul rounds partial sums)
    forward, backward = ((x.float() @ w.float().t()).to(dtype), (g.float() @ w.float()).to(dtype))
    torch.testing.assert_close(kernels.nf4_matmul(x, packed, state, transposed=True), forward, **_tolerance(dtype))
    torch.testing.assert_close(kernels.nf4_matmul(g, packed, state, transposed=False), backward, **_tolerance(dtype))
    with pytest.raises(ValueError, match="last dimension is 200"):
        kernels.nf4_matmul(torch.randn(3, 200), packed, state, transposed=shape[1] != 200)


def test_a_weight_stored_as_the_compute_dtype_is_read_as_its_bytes(kernels):
    # FSDP loads the 4-bit weights with bnb_4bit_quant_storage = the compute dtype (model/load.py): the same bytes in
    # bf16 elements, which the kernel must read as bytes (read as bf16 numbers, it crashed the interpreter).
    import bitsandbytes.functional as bnbf

    torch.manual_seed(0)
    w32 = torch.randn(344, 128)
    packed, state = bnbf.quantize_4bit(
        w32, blocksize=64, quant_type="nf4", compress_statistics=True, quant_storage=torch.bfloat16
    )
    assert packed.dtype == torch.bfloat16
    w = bnbf.dequantize_4bit(packed, state)
    x = torch.randn(10, 128)
    torch.testing.assert_close(kernels.nf4_matmul(x, packed, state), x @ w.t(), **_tolerance(torch.float32))


def test_a_dropped_double_quant_offset_fails(kernels):
    packed, state, w = _quantized((344, 128), torch.float32, nested=True)
    x = torch.randn(10, 128)
    state.offset = torch.zeros_like(state.offset)  # (a kernel that ignored it computes this)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(kernels.nf4_matmul(x, packed, state), x @ w.t(), **_tolerance(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_swiglu_tail_is_torchs(kernels, dtype):
    e, g, dh = (torch.randn(3, 7, 50, dtype=dtype) * 3 for _ in range(3))
    torch.testing.assert_close(kernels.swiglu(e, g), torch.nn.functional.silu(e) * g, **_tolerance(dtype))
    de, dg = kernels.swiglu_backward(dh, e, g)
    torch.testing.assert_close(de, torch.ops.aten.silu_backward(dh * g, e), **_tolerance(dtype))
    torch.testing.assert_close(dg, dh * torch.nn.functional.silu(e), **_tolerance(dtype))


def test_the_fused_nodes_on_the_kernels_compute_what_peft_computes(kernels, recipe_dict, tmp_path, monkeypatch):
    from conftest import build_char_tokenizer, build_tiny_llama
    from test_fast_mlp import _compare, _first_mlp, _pass

    from finetune.model import fast_mlp

    build_tiny_llama(tmp_path / "m", vocab_size=len(build_char_tokenizer(tmp_path / "m")), hidden=128, layers=2)
    mlp = _first_mlp(recipe_dict, tmp_path / "m", tmp_path)
    x = torch.randn(2, 5, mlp.gate_proj.base_layer.in_features)
    monkeypatch.setenv("FINETUNE_TRITON", "0")
    eager = _pass(mlp, x, seed=3)
    monkeypatch.setenv("FINETUNE_TRITON", "interpret")
    calls = {"nf4_matmul": 0, "swiglu": 0, "swiglu_backward": 0}
    for name in calls:
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _r=real, _n=name, **k: calls.__setitem__(_n, calls[_n] + 1) or _r(*a, **k))
    fast_lora.install(mlp)
    fast_mlp.install(mlp)
    fused = _pass(mlp, x, seed=3)
    assert calls == {"nf4_matmul": 6, "swiglu": 2, "swiglu_backward": 1}  # 3 forward, 3 input gradients; h twice
    _compare(fused, eager, rtol=1e-5, atol=1e-5)


def test_the_setup_line_says_what_the_fused_nodes_run_on(monkeypatch):
    monkeypatch.delenv("FINETUNE_TRITON", raising=False)
    assert "Triton's kernels run on CUDA" in fast_lora.triton_note("cpu")
    assert fast_lora.triton_note("cuda").startswith("Triton's NF4 matmul")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert "triton is not installed (pip install triton" in fast_lora.triton_note("cuda")
    monkeypatch.setenv("FINETUNE_TRITON", "0")
    assert "FINETUNE_TRITON=0" in fast_lora.triton_note("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("nested", [True, False], ids=["double quant", "fp32 absmax"])
def test_the_compiled_kernels_on_cuda_compute_what_the_eager_path_computes(monkeypatch, nested):
    # What the interpreter cannot show: the compiled kernels (tl.dot on 16-bit tiles, the GPU's own rounding) on a
    # Llama-8B-sized MLP projection in bf16, and the SwiGLU tail.
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kernels = importlib.import_module("finetune.model.triton_kernels")
    assert not kernels.INTERPRETING, "TRITON_INTERPRET=1 on a CUDA machine"
    packed, state, w = _quantized((14336, 4096), torch.bfloat16, nested)
    packed, w = packed.cuda(), w.cuda()
    state.to("cuda")
    x, g = (
        torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16),
        torch.randn(512, 14336, device="cuda", dtype=torch.bfloat16),
    )
    forward, backward = ((x.float() @ w.float().t()).bfloat16(), (g.float() @ w.float()).bfloat16())
    torch.testing.assert_close(kernels.nf4_matmul(x, packed, state, transposed=True), forward, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(kernels.nf4_matmul(g, packed, state, transposed=False), backward, rtol=1.6e-2, atol=1e-2)
    e, u = (torch.randn(512, 14336, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    torch.testing.assert_close(kernels.swiglu(e, u), torch.nn.functional.silu(e) * u)


def test_the_interpreter_asked_for_after_triton_was_imported_without_it_is_refused(kernels, monkeypatch):
    from finetune.errors import ModelError

    monkeypatch.setattr(kernels, "INTERPRETING", False)  # (what a process without TRITON_INTERPRET=1 at import has)
    with pytest.raises(ModelError, match="imported without its interpreter") as err:
        fast_lora.triton_for(torch.zeros(1))
    assert "TRITON_INTERPRET=1" in str(err.value.hint)
