"""The run's tokenizer as GGUF metadata (tokenizer.ggml.*), what llama.cpp's converter writes for it.

    tokenizer.save_pretrained(tok_dir)
    check_vocab(tok_dir, "llama")           # 'gpt2' | 'llama', or ExportError before any work
    add_vocab(writer, tok_dir, vocab_size)  # model, pre, tokens, token types, merges or scores, special ids, chat template

Two tokenizer models: 'gpt2' for a byte-level BPE (Llama 3, Qwen; written here: tokens, types,
merges) and 'llama' for a SentencePiece-style BPE with byte fallback (Llama 2, Mistral, Gemma,
Phi-3; export/gguf_spm.py: tokens, scores, types, add_space_prefix). Special token ids, add_bos/add_eos
and the chat template (the run's chat_template.jinja) are read by gguf's own SpecialVocab, as
convert_hf_to_gguf.py reads them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from finetune.errors import ExportError
from finetune.export.gguf_file import import_gguf
from finetune.export.gguf_spm import add_spm, check_spm

# tokenizer.ggml.pre: the name llama.cpp (llama-vocab.cpp) gives each pre-tokenizer split it implements;
# the read-back check compares token ids, so a wrong name here fails the export rather than shipping.
_GPT2_SPLIT = "gpt-2"  # tokenizers' ByteLevel(use_regex=True): GPT-2's own regex
_SPLITS = {
    # Llama 3
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "llama-bpe",
    # Qwen2 / Qwen2.5
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
}
_FIX = "export with --merge and convert the merged model with llama.cpp's convert_hf_to_gguf.py"


def _tokenizer_json(tok_dir: Path) -> dict[str, Any]:
    path = tok_dir / "tokenizer.json"
    if not path.is_file():
        raise ExportError("the run's tokenizer has no tokenizer.json (a slow tokenizer); --gguf reads that file", hint=_FIX)
    return json.loads(path.read_text(encoding="utf-8"))


def pre_tokenizer_name(tok: dict[str, Any]) -> str:
    """tokenizer.ggml.pre for a byte-level BPE tokenizer.json, or ExportError naming what it splits with."""
    pre = tok.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return _GPT2_SPLIT
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    if len(steps) == 2 and steps[0].get("type") == "Split" and steps[1].get("type") == "ByteLevel":
        name = _SPLITS.get(steps[0].get("pattern", {}).get("Regex", ""))
        if name is not None:
            return name
    raise ExportError(
        f"the run's tokenizer splits text with a pre-tokenizer --gguf does not know ({json.dumps(pre)[:200]})", hint=_FIX
    )


def check_vocab(tok_dir: Path, arch: str) -> str:
    """The tokenizer.ggml.model this tokenizer is written as in a GGUF of arch (gguf's name: 'llama', 'gemma2'...):
    'gpt2' or 'llama', or ExportError before anything is written."""
    tok = _tokenizer_json(tok_dir)
    model = tok.get("model", {})
    decoder = (tok.get("decoder") or {}).get("type")
    if model.get("type") == "BPE" and model.get("byte_fallback"):
        check_spm(tok, arch)
        return "llama"
    if model.get("type") != "BPE" or decoder != "ByteLevel":
        kind = f"{model.get('type')}{' with byte fallback' if model.get('byte_fallback') else ''}, decoder {decoder}"
        if model.get("type") == "Unigram":  # llama.cpp's converter writes these as 'llama' too, tokenized only approximately
            kind += " (segmented by likelihood, which GGUF's score-ordered 'llama' merges do not reproduce)"
        raise ExportError(
            f"the run's tokenizer is {kind}; --gguf writes byte-level BPE (GPT-2 / Llama 3 / Qwen2 style) and "
            "SentencePiece-style BPE with byte fallback (Llama 2 / Mistral / Gemma / Phi-3 style)",
            hint=_FIX,
        )
    pre_tokenizer_name(tok)
    return "gpt2"


def add_vocab(writer, tok_dir: Path, vocab_size: int) -> dict[str, Any]:
    """Write the tokenizer in tok_dir (saved by save_pretrained) into the GGUF; a summary for the metadata."""
    gguf = import_gguf()
    tok = _tokenizer_json(tok_dir)
    if check_vocab(tok_dir, writer.arch) == "llama":
        return add_spm(writer, tok, tok_dir, vocab_size)
    by_id = {i: (text, gguf.TokenType.NORMAL) for text, i in tok["model"]["vocab"].items()}
    for added in tok.get("added_tokens", []):
        kind = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
        by_id[added["id"]] = (added["content"], kind)
    if max(by_id) >= vocab_size:
        raise ExportError(
            f"the tokenizer has token id {max(by_id)} but the model's vocab_size is {vocab_size}",
            hint="the run's tokenizer does not belong to its model: check model.tokenizer in recipe.yaml",
        )
    # The embedding rows no token uses get placeholders, as llama.cpp's converter writes them.
    tokens = [by_id.get(i, (f"[PAD{i}]", gguf.TokenType.UNUSED)) for i in range(vocab_size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(tok))
    writer.add_token_list([text for text, _ in tokens])
    writer.add_token_types([int(kind) for _, kind in tokens])
    special = gguf.SpecialVocab(tok_dir, load_merges=True, n_vocab=vocab_size)
    special.add_to_gguf(writer, quiet=True)
    return {
        "model": "gpt2",
        "pre": pre_tokenizer_name(tok),
        "tokens": vocab_size,
        "merges": len(special.merges),
        "special_ids": special.special_token_ids,
        "chat_template": special.chat_template is not None,
    }
