"""Export a finished run as one GGUF file (llama.cpp, Ollama, LM Studio), checked by reading it back.

    finetune export runs/demo-cpu --gguf --gguf-type q8_0 --out exports/demo-gguf
    ollama create demo -f exports/demo-gguf/Modelfile

The weights are what `--merge` computes (export/merge.py's MergedTensors: dequantize(quantize(W)) +
the scaled adapter, in fp32), each merged, converted and written by gguf's own GGUFWriter before
the next is read (export/gguf_file.py, export/gguf_vocab.py, export/gguf_spm.py): one tensor in memory,
nothing staged on disk. The check reads the file back with an independent reader, transformers'
GGUF loader: its logits on the verify prompts against the model as trained, its tokenizer's ids for
those prompts (rendered in the run's format with the file's own chat template) and for probe texts
against the run's. What llama.cpp reads of a SentencePiece-style tokenizer and transformers does
not (add_space_prefix, byte token types) is checked against the run's tokenizer on its own; so is
Llama 3.1's rope scaling (rope_freqs, export/gguf_rope.py), which the reader is given as ggml applies it.
A failed check leaves nothing at --out.
"""

from __future__ import annotations

import gc
import json
import math
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from finetune.errors import ExportError, MergeCheckFailed
from finetune.export.gguf_file import GGUF_TYPES, K_QUANT_HINT, arch_name, gguf_family, import_gguf, write_gguf
from finetune.export.gguf_rope import apply_file_rope, file_rope_factors, rope_check
from finetune.export.gguf_spm import llama_cpp_mismatches
from finetune.export.gguf_vocab import add_vocab, check_vocab
from finetune.export.merge import MergedTensors, read_adapter
from finetune.export.modelfile import modelfile
from finetune.export.run import (
    METADATA,
    TOLERANCE,
    VERIFY_PROMPTS,
    ExportResult,
    Reference,
    available_memory_bytes,
    check_destination,
    check_merge_fits,
    max_abs_diff,
    mergeable,
    prompt_logits,
    reference,
)
from finetune.hardware import torch_dtype
from finetune.model.load import default_device, model_source
from finetune.model.shards import read_header, weight_files
from finetune.runs.checkpoint import atomic_dir, write_json
from finetune.runs.evaluate import prompt_ids
from finetune.runs.open import Run, inference_precision, open_run, remote_code_notice, run_tokenizer

# Largest |GGUF - as-trained| logit difference, as a fraction of max(1, max |logit|), per file type;
# the export's TOLERANCE for the float types. q8_0: each weight rounded to 1/127 of its 32-weight
# block's largest, compounded over the layers: measured 1.4e-2 on a QLoRA run of the bundled tiny model (README).
# Plain text the read-back tokenizer must split as the run's does, besides the verify prompts: where
# pre-tokenizers differ (contractions, digit runs, whitespace runs, non-ASCII); eos is checked on its own.
TOKENIZER_PROBE = "Don't stop: HELLO'S 12345 and 1 + 22 = 23.\n\n  \tcafé, naïve 東京 "
GGUF_TOLERANCE = {"f32": TOLERANCE["fp32"], "f16": TOLERANCE["fp16"], "bf16": TOLERANCE["bf16"], "q8_0": 5e-2}


def _check_exportable(run: Run, gguf_type: str) -> tuple[Path, dict[str, Any]]:
    """(base folder, its config.json) once the family, the type and the tokenizer are ones GGUF export writes."""
    if gguf_type not in GGUF_TYPES:
        raise ExportError(
            f"--gguf-type '{gguf_type}' is not a type the gguf package writes",
            hint=f"use one of {', '.join(GGUF_TYPES)}; for k-quants write f16 and run: {K_QUANT_HINT.format(src='IN.gguf', dst='OUT.gguf')}",
        )
    base_dir, base_config, _ = mergeable(run, "fp32")
    family = gguf_family(base_config, f"model.path '{base_dir}'")
    with tempfile.TemporaryDirectory(prefix="finetune-gguf-tokenizer-") as tok_dir:
        run_tokenizer(run).save_pretrained(tok_dir)
        check_vocab(Path(tok_dir), arch_name(family))
    return base_dir, base_config


def readback_bytes(base_dir: Path, config: dict[str, Any], precision: str) -> int:
    """Host RAM transformers' GGUF loader holds to read the file back: it dequantizes every weight into one state
    dict in the check's precision before it builds the model (it cannot stream or offload a GGUF), so at least the
    parameters times that dtype's size (measured: 1.17x that on a 0.5B model, plus the file's pages; benchmarks/README.md)."""
    tied = bool(config.get("tie_word_embeddings"))
    entries = [(n, e) for f in weight_files(base_dir) for n, e in read_header(f).tensors.items()]
    params = sum(math.prod(e["shape"]) for n, e in entries if not (tied and n == "lm_head.weight"))
    return params * torch_dtype(precision).itemsize


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def verify_gguf(
    ref: Reference, out_dir: Path, name: str, gguf_type: str, data_format: str, config: dict[str, Any]
) -> dict[str, Any]:
    """Read the GGUF back with transformers: logits vs the model as trained, and its tokenizer's ids vs the run's;
    the file's rope scaling (rope_freqs) applied to the reader as llama.cpp applies it, and checked on its own."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = ref.device or default_device()
    model = AutoModelForCausalLM.from_pretrained(
        str(out_dir), gguf_file=name, dtype=torch_dtype(ref.precision), device_map={"": device}, use_kernels=False
    ).eval()  # use_kernels: the file's own numbers, no Hub kernel swapped in (transformers >= 5.25 would)
    rope_applied = apply_file_rope(model, file_rope_factors(out_dir / name))  # the reader ignores rope_freqs
    got = prompt_logits(model, ref.prompts, device)
    del model
    gc.collect()
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir), gguf_file=name)
    ids = [prompt_ids(p, data_format, tokenizer) for p in VERIFY_PROMPTS]
    eos = ref.tokenizer.eos_token or ""
    # Probes: plain text; eos; every added token, each followed by text (each must stay whole); a leading space
    # and text right after a special token (where SentencePiece prefix rules differ)
    added = " x".join(t.content for t in ref.tokenizer.added_tokens_decoder.values())
    probes = [TOKENIZER_PROBE, eos, f"{added} x", f" {TOKENIZER_PROBE}{eos}{TOKENIZER_PROBE}"]
    same_ids = ids == ref.prompts and all(tokenizer(t).input_ids == ref.tokenizer(t).input_ids for t in probes)
    llama_cpp = llama_cpp_mismatches(out_dir / name, ref.tokenizer)  # what transformers' loader does not read
    rope = {**rope_check(out_dir / name, config), "applied_to_reader": rope_applied}
    rel = max(GGUF_TOLERANCE[gguf_type], TOLERANCE[ref.precision])
    scale = max(1.0, max(float(x.abs().max()) for x in ref.logits))
    max_diff = max_abs_diff(got, ref.logits)
    same_template = tokenizer.chat_template == ref.tokenizer.chat_template
    effect = max_abs_diff(ref.base_logits, ref.logits) if ref.base_logits is not None else None
    return {
        "prompts": len(ref.prompts),
        "reader": "transformers (AutoModelForCausalLM / AutoTokenizer with gguf_file=)",
        "compared": f"GGUF ({gguf_type}, read back in {ref.precision}) vs the run's model as trained",
        "max_abs_diff": max_diff,
        "tolerance": rel * scale,
        "tolerance_rule": f"{rel:g} ({gguf_type}) x max(1, max |logit|)",
        "adapter_effect": effect,  # max |logit change| the adapter makes: a file without it differs this much
        "distinguishes_unmerged": effect is None or effect > rel * scale,
        "same_token_ids": same_ids,  # the verify prompts in the run's format, probe texts, the eos token
        "same_chat_template": same_template,
        "llama_cpp_mismatches": llama_cpp,  # a 'llama' tokenizer's add_space_prefix and byte token types
        "rope": rope,  # rope_freqs vs transformers' llama3 factors; the logits above were read with the file's factors
        "passed": max_diff <= rel * scale and same_ids and same_template and not llama_cpp and rope["passed"],
    }


def _say_check(check: dict[str, Any], out: Path, say: Callable[[str], None]) -> None:
    """Report the read-back check; MergeCheckFailed (nothing written) when it failed."""
    mismatches = check["llama_cpp_mismatches"]
    say(
        f"gguf check {'passed' if check['passed'] else 'FAILED'}: max |logit diff| {check['max_abs_diff']:.3g} vs tolerance "
        f"{check['tolerance']:.3g}; token ids {'equal' if check['same_token_ids'] else 'DIFFER'}; chat template "
        f"{'equal' if check['same_chat_template'] else 'DIFFERS'}{'; llama.cpp metadata DIFFERS: ' + '; '.join(mismatches) if mismatches else ''}"
        f"{'' if check['rope']['passed'] else '; rope scaling DIFFERS: ' + json.dumps(check['rope'])} "
        f"({check['prompts']} prompts)"
    )
    if not check["distinguishes_unmerged"]:
        say(
            "warning: the adapter changes the logits less than the tolerance, so this check cannot tell a merged file from the base"
        )
    if not check["passed"]:
        raise MergeCheckFailed(
            f"the GGUF read back by transformers differs from the run as trained (max |logit diff| "
            f"{check['max_abs_diff']:.4g}, tolerance {check['tolerance']:.4g}; token ids equal: {check['same_token_ids']}; "
            f"chat template equal: {check['same_chat_template']}{'; ' + '; '.join(mismatches) if mismatches else ''}; "
            f"rope scaling equal: {check['rope']['passed']}); "
            f"nothing was written to '{out}'",
            hint="try --gguf-type f32 to rule out rounding; if f32 fails too, report it with the run's config.json",
        )


def export_gguf(
    run_dir: str | Path,
    out: str | Path,
    gguf_type: str = "f16",
    overwrite: bool = False,
    say: Callable[[str], None] = print,
    device: torch.device | None = None,
    trust_remote_code: bool = False,
) -> ExportResult:
    """A verified GGUF of the finished run at run_dir, with an Ollama Modelfile beside it. See the module doc."""
    from finetune import __version__

    import_gguf()
    run = open_run(run_dir, trust_remote_code=trust_remote_code)
    if notice := remote_code_notice(run):
        say(notice)
    out = Path(out)
    check_destination(out, run, overwrite)
    base_dir, base_config = _check_exportable(run, gguf_type)
    loras = read_adapter(run.weights_dir) if run.is_adapter else {}
    device = device or default_device()
    check_merge_fits(run, base_dir, device)
    holds, free = readback_bytes(base_dir, base_config, inference_precision(run.cfg, device)), available_memory_bytes()
    if free is not None and holds > free:  # told before the work: the check comes last, after the merge
        say(
            f"warning: the read-back check will hold ~{_size(holds)} (transformers' GGUF loader dequantizes the whole "
            f"model at once), more than the {_size(free)} of RAM available now; the merge holds one tensor at a time"
        )
    say(f"gguf: computing reference logits of the run as trained ({len(VERIFY_PROMPTS)} prompts)")
    ref = reference(run, device)
    name = f"model-{gguf_type}.gguf"
    with atomic_dir(out) as tmp:
        tok_dir = tmp / ".tokenizer"  # inside the temporary export: deleted with it on any failure
        ref.tokenizer.save_pretrained(tok_dir)
        say(
            f"gguf: merging {base_dir} in fp32 into {out / name} ({gguf_type}; {len(loras)} LoRA weights, "
            f"{len(ref.quantized)} 4-bit weights), one tensor at a time"
        )
        # model_type: which checkpoint tensors transformers fuses into the 3-D experts training adapted (MoE)
        merged = MergedTensors(base_dir, loras, ref.quantized, ref.expert_lora, str(base_config.get("model_type", "")))
        vocab: dict[str, Any] = {}
        stats = write_gguf(
            merged,
            tmp / name,
            base_config,
            gguf_type,
            Path(model_source(run.cfg)).name,
            lambda w: vocab.update(add_vocab(w, tok_dir, int(base_config["vocab_size"]))),
        )
        shutil.rmtree(tok_dir)
        merge = {"tensors": len(merged.where), "merged": merged.merged, "requantized": len(ref.quantized)}
        say(f"gguf: reading the file back with transformers to check its logits and tokenizer (it holds ~{_size(holds)})")
        check = verify_gguf(ref, tmp, name, gguf_type, run.cfg.data.format, base_config)
        _say_check(check, out, say)
        (tmp / "Modelfile").write_text(modelfile(name, ref.tokenizer, run.cfg.data.format), encoding="utf-8")
        shutil.copyfile(run.path / "recipe.yaml", tmp / "recipe.yaml")
        meta: dict[str, Any] = {
            "format": 1,
            "finetune_version": __version__,
            "run_dir": str(run.path.resolve()),
            "base_model": model_source(run.cfg),
            "data_format": run.cfg.data.format,
            "kind": "gguf",
            "gguf": {"file": name, "type": gguf_type, **stats, "tokenizer": vocab},
            "merge": merge,
            "k_quants": K_QUANT_HINT.format(src=out / name, dst=out / "model-Q4_K_M.gguf"),
            "verification": check,
        }
        write_json(tmp / METADATA, meta)
    say(f"GGUF exported to {out / name}")
    say(f"  Ollama:     ollama create NAME -f {out / 'Modelfile'}")
    say(f"  k-quants:   {meta['k_quants']}")
    return ExportResult(out, meta)
