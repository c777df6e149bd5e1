"""The memory model against published peak GPU memory of QLoRA runs (7B-8B, 1-2 GPUs).

Each row is a run a public source measured, with the configuration it states;
what the source leaves open is written in `assumed`. The prediction is
`finetune.plan.estimate` with the same constants for every row; a row only
says how the source's framework holds its tensors (`Implementation`: adapter
dtype, upcast of unquantized weights, loss kernel) and which number it reports
(peak allocated, peak reserved, or "the most that fits" a card of that size).

Print the table of docs/plan.md:  python tests/test_plan_published.py
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from finetune.gpus import GiB
from finetune.plan import Implementation, RecipeFacts, Setup, estimate, read_model_shape

CONFIGS = Path(__file__).parent / "fixtures" / "configs"
TOLERANCE = 0.20

ANSWERAI = "https://github.com/AnswerDotAI/fsdp_qlora/blob/main/benchmarks_03_2024.md"
TORCHTUNE = "https://github.com/pytorch/torchtune#memory-and-training-speed"
UNSLOTH = "https://github.com/unslothai/unsloth#-performance-benchmarking"

# fsdp_qlora train.py defaults: pure bf16 (LoRA weights and AdamW state bf16), transformers' loss.
ANSWERAI_IMPL = Implementation("fsdp_qlora", adapter_bytes=2, loss="full_fp32")
ANSWERAI_LORA = dict(lora_r=64, lora_target=("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"), lora_dropout=0.1)
# torchtune: bf16 model and adapters, compiled chunked cross-entropy.
TORCHTUNE_IMPL = Implementation("torchtune", adapter_bytes=2, loss="chunked")
# Hugging Face + peft: prepare_model_for_kbit_training upcasts embeddings/head/norms to fp32; fp32 adapters.
HF_IMPL = Implementation("transformers+peft", adapter_bytes=4, unquantized_bytes=4, loss="full_fp32")


@dataclass(frozen=True)
class Row:
    source: str
    url: str
    config: str  # what the source states
    assumed: str  # what it leaves open and we assumed
    model: str  # fixture under tests/fixtures/configs
    setup: Setup
    impl: Implementation
    lora: dict
    metric: str  # "reserved" | "allocated" | "fits"
    published_gib: float
    outside: str = ""  # why a row falls outside the bound; such rows are shown, not asserted

    def predict_gib(self) -> float:
        shape = read_model_shape(str(CONFIGS / self.model))
        recipe = RecipeFacts(quant_bits=4, double_quant=True, dora=False, compute_bytes=2, **self.lora)
        e = estimate(shape, recipe, self.setup, gpu=_gpu(), impl=self.impl)
        value = {"reserved": e.peak_reserved_bytes, "allocated": e.peak_allocated_bytes, "fits": e.peak_bytes}[self.metric]
        return value / GiB


def _gpu():
    from finetune.gpus import find_gpu

    return find_gpu("h100")  # only memory terms are compared; any catalogue GPU gives the same bytes


def _unsloth(vram: int, context: int) -> Row:
    return Row(
        "unsloth README, Hugging Face + FA2 column",
        UNSLOTH,
        f"Llama 3.1 8B Instruct, QLoRA all linear (q,k,v,o,gate,up,down) r=32, batch 1, sequences padded to {context:,}: "
        f"the longest context that fits {vram} GB",
        "standard HF QLoRA: prepare_model_for_kbit_training (fp32 embeddings/head/norms, gradient checkpointing), "
        "LoRA dropout 0, AdamW; published value = the card's memory",
        "llama-3.1-8b",
        Setup(batch_size=1, grad_accum=1, seq_len=context, checkpoint_every=1),
        HF_IMPL,
        dict(lora_r=32, lora_target="all-linear", lora_dropout=0.0),
        "fits",
        float(vram),
    )


ROWS = [
    Row(
        "Answer.AI fsdp_qlora benchmarks (2x4090, 'DDP')",
        ANSWERAI,
        "Llama-2 7B QLoRA, train.py defaults (r=64, alpha 16, dropout 0.1, q/k/v/gate/up/down, bf16, AdamW), "
        "context 2048, batch 8, gradient checkpointing, full weights on each GPU; peak reserved",
        "dummy data fills every position (labels on all but the prompt)",
        "llama-2-7b",
        Setup(batch_size=8, grad_accum=1, seq_len=2048, checkpoint_every=1),
        ANSWERAI_IMPL,
        ANSWERAI_LORA,
        "reserved",
        20.94,
    ),
    Row(
        "Answer.AI fsdp_qlora benchmarks (2x3090, FSDP)",
        ANSWERAI,
        "as above, FSDP full shard over 2 GPUs, context 512, batch 1; peak reserved",
        "as above",
        "llama-2-7b",
        Setup(batch_size=1, grad_accum=1, gpus=2, sharding="fsdp", seq_len=512, checkpoint_every=1),
        ANSWERAI_IMPL,
        ANSWERAI_LORA,
        "reserved",
        4.98,
        outside="the source reports 3.72 GiB already reserved right after wrapping, before training: each rank "
        "quantizes the whole model before FSDP shards it, and the allocator keeps that memory. The model predicts "
        "training memory (3.5 GiB), which at this short context is less than that load-time reservation",
    ),
    Row(
        "Answer.AI fsdp_qlora benchmarks (2x3090, FSDP)",
        ANSWERAI,
        "as above, context 2048, batch 1",
        "as above",
        "llama-2-7b",
        Setup(batch_size=1, grad_accum=1, gpus=2, sharding="fsdp", seq_len=2048, checkpoint_every=1),
        ANSWERAI_IMPL,
        ANSWERAI_LORA,
        "reserved",
        5.21,
    ),
    Row(
        "Answer.AI fsdp_qlora benchmarks (2x3090, FSDP)",
        ANSWERAI,
        "as above, context 2048, batch 4",
        "as above",
        "llama-2-7b",
        Setup(batch_size=4, grad_accum=1, gpus=2, sharding="fsdp", seq_len=2048, checkpoint_every=1),
        ANSWERAI_IMPL,
        ANSWERAI_LORA,
        "reserved",
        11.22,
    ),
    Row(
        "Answer.AI fsdp_qlora benchmarks (2x3090, FSDP)",
        ANSWERAI,
        "as above, context 2048, batch 10",
        "as above",
        "llama-2-7b",
        Setup(batch_size=10, grad_accum=1, gpus=2, sharding="fsdp", seq_len=2048, checkpoint_every=1),
        ANSWERAI_IMPL,
        ANSWERAI_LORA,
        "reserved",
        20.97,
    ),
    Row(
        "torchtune README, memory and training speed",
        TORCHTUNE,
        "Llama 3.1 8B QLoRA on 1x4090, batch 2, no accumulation, packed to 2048, torch.compile; config "
        "llama3_1/8B_qlora_single_device: r=8, alpha 16, dropout 0, q/k/v/o + MLP, activation checkpointing, "
        "fused AdamW, bf16, CEWithChunkedOutputLoss",
        "the figure is torch.cuda.max_memory_reserved (the metric torchtune's README named for its earlier table)",
        "llama-3.1-8b",
        Setup(batch_size=2, grad_accum=1, seq_len=2048, checkpoint_every=1),
        TORCHTUNE_IMPL,
        dict(lora_r=8, lora_target="all-linear", lora_dropout=0.0),
        "reserved",
        7.4,
    ),
    _unsloth(12, 932),
    _unsloth(16, 2551),
    _unsloth(24, 5789),
    _unsloth(40, 12264),
    _unsloth(48, 15502),
    _unsloth(80, 28454),
]


CHECKED = [r for r in ROWS if not r.outside]


@pytest.mark.parametrize(
    "row", CHECKED, ids=[f"{r.model}-{r.setup.batch_size}x{r.setup.seq_len}-{r.published_gib}" for r in CHECKED]
)
def test_prediction_within_20_percent_of_published(row):
    predicted = row.predict_gib()
    err = predicted / row.published_gib - 1
    assert abs(err) <= TOLERANCE, f"{row.source}: predicted {predicted:.2f} GiB, published {row.published_gib} ({err:+.1%})"


def test_rows_outside_the_bound_are_really_outside():
    # A row marked `outside` that comes back inside the bound should lose its excuse.
    for r in ROWS:
        if r.outside:
            assert abs(r.predict_gib() / r.published_gib - 1) > TOLERANCE, r


def test_checked_rows_cover_three_sources_and_six_configurations():
    assert len({r.url for r in CHECKED}) >= 3
    assert len({(r.model, r.setup, r.impl.name) for r in CHECKED}) >= 6


def markdown_table() -> str:
    lines = [
        "| # | source | configuration (as stated) | assumed | metric | published | predicted | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(ROWS, 1):
        p = r.predict_gib()
        lines.append(
            f"| {i} | [{r.source}]({r.url}) | {r.config} | {r.assumed} | {r.metric} | {r.published_gib:g} GiB | "
            f"{p:.2f} GiB | {100 * (p / r.published_gib - 1):+.1f}%{' (outside: see below)' if r.outside else ''} |"
        )
    for i, r in enumerate(ROWS, 1):
        if r.outside:
            lines.append(f"\nRow {i} is outside the bound and not asserted: {r.outside}.")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
