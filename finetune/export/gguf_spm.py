"""A SentencePiece-style tokenizer as GGUF's "llama" tokenizer model (Llama 2, Mistral, Gemma, Phi-3).

    check_spm(tok, "llama")                      # ExportError before any work, naming what GGUF cannot carry
    summary = add_spm(writer, tok, tok_dir, n)   # tokens, scores, token types, add_space_prefix, special ids

In tokenizers' JSON these are a BPE with byte fallback (<0x00>..<0xFF> tokens) whose spaces become "▁".
A GGUF keeps no merges for them: llama.cpp (llama-vocab.cpp's SPM tokenizer) merges any two adjacent
pieces whose join is a token, best score first, and transformers' GGUF loader rebuilds the merges the
same way (generate_merges). So each token's score here is minus (1 + the rank of the first merge that
makes it), and the export is refused when the run's merges are not all the pairs those scores imply, in
that order (a tokenizer.json converted from sentencepiece has exactly those). llama.cpp's own converter
reads tokenizer.json with LlamaHfVocab, which scores every token -1000 and so leaves its merge order to
ties. Token types as llama.cpp's converters type them: byte tokens BYTE, the unknown token UNKNOWN,
special added tokens CONTROL, other added tokens USER_DEFINED, unused embedding rows UNUSED.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from finetune.errors import ExportError
from finetune.export.gguf_file import import_gguf

SPACE = "\u2581"  # "▁": how SentencePiece spells a space inside a token
_BYTE = re.compile(r"<0x[0-9A-F]{2}>")
_FIX = "export with --merge and convert the merged model with llama.cpp's convert_hf_to_gguf.py"

# Where the tokenizer puts a "▁" in front of text: the forms SentencePiece BPE takes in tokenizers' JSON.
PREFIX_FIRST = "a '▁' before the start of the text only (Metaspace, prepend_scheme 'first')"
PREFIX_EVERY = "a '▁' before every run of text, after special tokens too (Prepend '▁' + Replace ' ', sentencepiece's legacy)"
PREFIX_NONE = "no '▁' before the text (Replace ' ' only)"
# A LlamaTokenizer with legacy=true (Mistral's tokenizer_config) loads so; no GGUF reader rebuilds it
PREFIX_ALWAYS = "a '▁' before every run of text, after special tokens too, but not before a leading space (Metaspace, prepend_scheme 'always')"
# How transformers' GGUF loader (integrations/gguf, select_tokenizer_builder) rebuilds a "llama" tokenizer
# per architecture: LlamaTokenizer's Metaspace for every arch but these
READER_PREFIX = {"phi3": PREFIX_EVERY, "gemma2": PREFIX_NONE, "gemma3": PREFIX_NONE}
# Archs whose reader (gemma_tokenizer) orders merges by token position, not by score, and respells space-only tokens
READER_BY_POSITION = {"gemma2", "gemma3"}


def _steps(step: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    if not step:
        return []
    return [s for inner in step[key] for s in _steps(inner, key)] if step.get("type") == "Sequence" else [step]


def prefix_rule(tok: dict[str, Any]) -> str:
    """Which PREFIX_* the tokenizer.json's normalizer and pre-tokenizer make, or ExportError naming them."""
    norms = _steps(tok.get("normalizer"), "normalizers")
    pres = _steps(tok.get("pre_tokenizer"), "pretokenizers")
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
    if not norms and len(pres) == 1:
        meta = pres[0]
        if meta.get("type") == "Metaspace" and meta.get("replacement") == SPACE and meta.get("split") is False:
            scheme = meta.get("prepend_scheme", "always" if meta.get("add_prefix_space", True) else "never")  # tokenizers < 0.15
            rule = {"first": PREFIX_FIRST, "always": PREFIX_ALWAYS}.get(scheme)
            if rule:
                return rule
    # Gemma's own Split on " " comes after the normalizer has replaced every space: it splits nothing
    if all(p.get("type") == "Split" and p.get("pattern") == {"String": " "} for p in pres):
        if norms == [{"type": "Prepend", "prepend": SPACE}, replace]:
            return PREFIX_EVERY
        if norms == [replace]:
            return PREFIX_NONE
    found = json.dumps({"normalizer": tok.get("normalizer"), "pre_tokenizer": tok.get("pre_tokenizer")})
    raise ExportError(
        f"the run's SentencePiece-style tokenizer turns spaces into '▁' in a way --gguf does not know ({found[:300]}); "
        f"it writes {PREFIX_FIRST}, {PREFIX_EVERY}, or {PREFIX_NONE}",
        hint=_FIX,
    )


def _merges(tok: dict[str, Any]) -> list[tuple[str, str]]:
    pairs = []
    for merge in tok["model"].get("merges", []):
        left, right = merge if isinstance(merge, list) else merge.split(" ", 1)  # tokenizers < 0.20 wrote "a b"
        pairs.append((left, right))
    return pairs


def first_ranks(merges: list[tuple[str, str]]) -> dict[str, int]:
    """{token: rank of the first merge that makes it}: what each token's score stands for."""
    ranks: dict[str, int] = {}
    for rank, (left, right) in enumerate(merges):
        ranks.setdefault(left + right, rank)
    return ranks


def _check_model(model: dict[str, Any]) -> None:
    """ExportError for a BPE option neither llama.cpp's SPM tokenizer nor transformers' reader has."""
    options = {
        "dropout": model.get("dropout"),
        "continuing_subword_prefix": model.get("continuing_subword_prefix"),
        "end_of_word_suffix": model.get("end_of_word_suffix"),
        "ignore_merges": model.get("ignore_merges") or None,
    }
    if set_options := {k: v for k, v in options.items() if v is not None}:
        raise ExportError(
            f"the run's SentencePiece-style BPE sets {set_options}, which GGUF's 'llama' tokenizer has no way to say", hint=_FIX
        )
    # llama.cpp spells a character no token has as its UTF-8 bytes: <0xXX>, else the byte's own one-character
    # token (Gemma's tab), and fails on a byte it finds neither for
    vocab = model["vocab"]
    missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in vocab and not (b < 0x80 and chr(b) in vocab)]
    if missing:
        raise ExportError(
            f"the run's byte-fallback tokenizer lacks {len(missing)} of the 256 byte tokens (first: {missing[0]})", hint=_FIX
        )


def _check_merges(tok: dict[str, Any], arch: str) -> None:
    """ExportError unless the scores written (minus each token's first merge rank) give back the run's merges."""
    merges = _merges(tok)
    ranks = first_ranks(merges)
    for rank in range(1, len(merges)):
        made, before = ranks["".join(merges[rank])], ranks["".join(merges[rank - 1])]
        if made < before:
            raise ExportError(
                f"the run's merge #{rank} {merges[rank]} makes a token an earlier merge (#{made}) made, after merges making "
                "other tokens: GGUF keeps one score per token, so the merges that make one token must follow each other",
                hint=_FIX,
            )
    added = {a["content"] for a in tok.get("added_tokens", [])}
    pieces = set(tok["model"]["vocab"]) | added
    have = set(merges)
    for token in tok["model"]["vocab"]:
        if token in added:
            continue  # matched whole before any merge, by the run's tokenizer and by both readers
        for i in range(1, len(token)):
            if token[:i] in pieces and token[i:] in pieces and (token[:i], token[i:]) not in have:
                raise ExportError(
                    f"the run's vocabulary has {token!r}, {token[:i]!r} and {token[i:]!r} but no merge of the two: llama.cpp and "
                    "transformers' GGUF loader merge any two adjacent pieces whose join is a token, so they would tokenize "
                    "differently from the run (a SentencePiece-converted tokenizer.json has every such merge)",
                    hint=_FIX,
                )
    if arch in READER_BY_POSITION:
        _check_position_order(tok, ranks, pieces, arch)


def _check_position_order(tok: dict[str, Any], ranks: dict[str, int], pieces: set[str], arch: str) -> None:
    """Gemma's reader orders merges by token id and respells space-only tokens: refuse what that changes."""
    vocab = tok["model"]["vocab"]
    ids = [vocab[t] for t in sorted(ranks, key=ranks.__getitem__)]
    if any(b < a for a, b in zip(ids, ids[1:])):
        raise ExportError(
            f"transformers' GGUF loader, which checks the file, orders every {arch} GGUF's merges by token id, and the run's "
            "merges make tokens in another order, so --gguf cannot check this tokenizer",
            hint=_FIX,
        )
    if spaces := [t for t in pieces if " " in t and not t.strip()]:
        raise ExportError(
            f"the run's tokenizer has the space-only token {spaces[0]!r}, which transformers' GGUF loader reads back from "
            f"every {arch} GGUF as {SPACE * len(spaces[0])!r}, so --gguf cannot check this tokenizer",
            hint=_FIX,
        )


def check_spm(tok: dict[str, Any], arch: str) -> None:
    """ExportError, before any work, for a byte-fallback BPE whose GGUF the read-back check could not pass."""
    _check_model(tok["model"])
    rule, reader = prefix_rule(tok), READER_PREFIX.get(arch, PREFIX_FIRST)
    if rule != reader:
        raise ExportError(
            f"the run's tokenizer puts {rule}, but transformers' GGUF loader, which checks the file, reads every {arch} "
            f"GGUF's SentencePiece tokenizer back with {reader}, so --gguf cannot check this model",
            hint=_FIX,
        )
    _check_merges(tok, arch)


def spm_tokens(tok: dict[str, Any], vocab_size: int, unk_id: int | None) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) for every embedding row, as add_spm writes them."""
    gguf = import_gguf()
    types = gguf.TokenType
    model = tok["model"]
    by_id = {i: (text, types.NORMAL) for text, i in model["vocab"].items()}
    for added in tok.get("added_tokens", []):
        by_id[added["id"]] = (added["content"], types.CONTROL if added.get("special") else types.USER_DEFINED)
    for i, (text, _) in by_id.items():
        if _BYTE.fullmatch(text):
            by_id[i] = (text, types.BYTE)  # llama.cpp reads these as the byte, in any text it prints
        elif i == unk_id:
            by_id[i] = (text, types.UNKNOWN)
    if max(by_id) >= vocab_size:
        raise ExportError(
            f"the tokenizer has token id {max(by_id)} but the model's vocab_size is {vocab_size}",
            hint="the run's tokenizer does not belong to its model: check model.tokenizer in recipe.yaml",
        )
    ranks = first_ranks(_merges(tok))
    tokens, scores, kinds = [], [], []
    for i in range(vocab_size):
        text, kind = by_id.get(i, (f"[PAD{i}]", types.UNUSED))  # rows no token uses, as llama.cpp's converter pads them
        tokens.append(text)
        kinds.append(int(kind))
        # Tokens no merge makes are never compared by score (check_spm refused any other case)
        scores.append(-float(ranks[text] + 1) if text in ranks and kind == types.NORMAL else 0.0)
    return tokens, scores, kinds


def add_spm(writer, tok: dict[str, Any], tok_dir: Path, vocab_size: int) -> dict[str, Any]:
    """Write the tokenizer (check_spm passed for writer.arch) as GGUF's 'llama' model; a summary for the metadata."""
    gguf = import_gguf()
    special = gguf.SpecialVocab(tok_dir, load_merges=False, n_vocab=vocab_size)
    tokens, scores, kinds = spm_tokens(tok, vocab_size, special.special_token_ids.get("unk"))
    prefix = prefix_rule(tok) != PREFIX_NONE
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(kinds)
    writer.add_add_space_prefix(prefix)
    # Both readers add a BOS to a 'llama' tokenizer that does not say otherwise; say it when the run adds none
    special.add_special_token.setdefault("bos", False)
    special.add_to_gguf(writer, quiet=True)
    return {
        "model": "llama",
        "tokens": vocab_size,
        "merges_as_scores": len(_merges(tok)),
        "byte_tokens": sum(k == int(gguf.TokenType.BYTE) for k in kinds),
        "add_space_prefix": prefix,
        "add_bos": special.add_special_token["bos"],
        "special_ids": special.special_token_ids,
        "chat_template": special.chat_template is not None,
    }


def space_prefix(tokenizer) -> bool:
    """Whether the run's (fast) tokenizer puts '▁' before text, seen by running its normalizer and pre-tokenizer."""
    backend = tokenizer.backend_tokenizer
    text = backend.normalizer.normalize_str("a") if backend.normalizer else "a"
    if backend.pre_tokenizer:
        text = "".join(piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text))
    return text.startswith(SPACE)


def llama_cpp_mismatches(path: Path, tokenizer) -> list[str] | None:
    """What llama.cpp reads from a 'llama' tokenizer and transformers' loader does not, against the run's tokenizer:
    the differences (empty when none), or None for another tokenizer model."""
    gguf = import_gguf()
    fields = gguf.GGUFReader(str(path)).fields

    def value(key: str) -> Any:
        field = fields.get(key)
        return None if field is None else field.contents()

    if value("tokenizer.ggml.model") != "llama":
        return None
    found = []
    flag = value("tokenizer.ggml.add_space_prefix")
    flag = True if flag is None else bool(flag)  # llama.cpp's default for a 'llama' tokenizer
    if flag != space_prefix(tokenizer):
        found.append(f"add_space_prefix is {flag} but the run's tokenizer puts {'no ' if flag else ''}'▁' before text")
    kinds = value("tokenizer.ggml.token_type")
    untyped = [t for t, k in zip(value("tokenizer.ggml.tokens"), kinds) if _BYTE.fullmatch(t) and k != int(gguf.TokenType.BYTE)]
    if untyped:  # llama.cpp finds byte tokens by text but prints as a byte only a token typed BYTE
        found.append(
            f"{len(untyped)} byte tokens are not typed BYTE (first: {untyped[0]}), so llama.cpp would print them as text"
        )
    return found
