"""Never tokenize twice: tokenized data cached on disk, keyed by everything that shapes it.

The key hashes the data files' bytes (or a hub dataset's fingerprint), the
tokenizer (its full serialized state, special tokens and chat template), and every
setting that changes tokens, labels or rows (format, columns, weights, template,
train_on, max_seq_len, truncation, packing, eval split, seed). Change any of them
and the key changes; nothing is ever invalidated by hand. Layout:

    <cache_dir>/data/<key>/train.safetensors   flat int32 ids/labels + int64 offsets (see dataset.py)
                           eval.safetensors    (when there is eval data)
                           meta.json           stats and mask-check findings (and each example's image files,
                                               with their size and mtime: a changed image is a miss); written last

A directory is written under a temporary name and renamed into place, so a crash
mid-write leaves nothing that looks like a cache entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import uuid
from pathlib import Path
from typing import Any

from finetune.config.schema import RecipeConfig
from finetune.data.dataset import DataStats, TokenizedData
from finetune.data.images import processor_of
from finetune.data.pairs import PreferencePairs

CACHE_VERSION = 1  # bump when tokenization or the stored layout changes
_FILES = ("train", "eval")


def cache_root(cfg: RecipeConfig) -> Path:
    base = cfg.data.cache_dir or os.environ.get("FINETUNE_CACHE") or Path.home() / ".cache" / "finetune"
    return Path(base).expanduser() / "data"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state = json.loads(backend.to_str())
        # Padding/truncation are call-time state the tokenizer keeps from its last call, not what it maps.
        state.pop("padding", None)
        state.pop("truncation", None)
        h.update(json.dumps(state, sort_keys=True).encode())
    else:  # slow tokenizers: the vocabulary is what they map
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    for attr in ("split_special_tokens", "add_bos_token", "add_eos_token", "add_prefix_space", "legacy"):
        h.update(f"{attr}={getattr(tokenizer, attr, None)};".encode())
    processor = processor_of(tokenizer)
    if processor is not None:  # its resolution settings decide how many tokens each image becomes
        h.update(processor.image_processor.to_json_string().encode())
        h.update(str(processor.chat_template).encode())
    return h.hexdigest()


def _image_files(data: dict[str, Stored | None]) -> dict[str, list[int]]:
    """Each image file the data reads: [size, mtime_ns]. Images are not hashed into the key (a data file names
    them; reading thousands to look the key up would cost what the cache saves): a changed one is a miss."""
    paths = {p for part in data.values() if isinstance(part, TokenizedData) and part.images for ex in part.images for p in ex}
    return {p: _stat(p) for p in sorted(paths)}


def _stat(path: str) -> list[int]:
    try:
        st = os.stat(path)
        return [st.st_size, st.st_mtime_ns]
    except OSError:
        return [-1, -1]


def code_fingerprint() -> str:
    """Our data code and the libraries that shape tokens: a change to either is a different cache."""
    from importlib.metadata import PackageNotFoundError, version

    h = hashlib.sha256(str(CACHE_VERSION).encode())
    for path in sorted(Path(__file__).parent.rglob("*.py")):  # formats/ included
        h.update(path.read_bytes())
    for lib in ("transformers", "tokenizers", "jinja2"):
        try:
            h.update(f"{lib}={version(lib)};".encode())
        except PackageNotFoundError:
            h.update(f"{lib}=none;".encode())
    return h.hexdigest()


def cache_key(cfg: RecipeConfig, tokenizer: Any, content_ids: list[str]) -> str:
    d = cfg.data
    material = {
        "code": code_fingerprint(),
        "content": content_ids,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "data": d.model_dump(
            exclude={"path", "eval_path", "cache", "cache_dir", "num_proc", "mask_check", "shuffle", "group_by_length"}
        ),
        "drop_flagged": d.mask_check == "drop",  # the only mask-check policy that changes which examples are kept
        "seed": cfg.seed,  # picks the eval split and weighted subsets
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:24]


Stored = TokenizedData | PreferencePairs


def read_cache(path: Path) -> tuple[dict[str, Stored | None], dict[str, DataStats | None], list[dict]] | None:
    """(data, stats, findings) of a complete cache entry, or None (absent or unreadable: rebuild)."""
    try:
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
        if meta.get("version") != CACHE_VERSION:
            return None
        from safetensors.numpy import load_file

        data: dict[str, Stored | None] = {}
        stats: dict[str, DataStats | None] = {}
        for name in _FILES:
            if meta["stats"].get(name) is None:
                data[name] = stats[name] = None
                continue
            arrays = load_file(str(path / f"{name}.safetensors"))
            images = meta.get("images", {}).get(name)
            tokenized, counted = TokenizedData(**arrays, images=images), DataStats(**meta["stats"][name])
            pairs = name in meta.get("pairs", ())  # preference pairs: their sides interleaved
            if not _consistent(tokenized, counted, 2 if pairs else 1):
                return None
            data[name], stats[name] = (PreferencePairs(tokenized) if pairs else tokenized), counted
        if any(_stat(p) != kept for p, kept in meta.get("image_files", {}).items()):
            return None  # an image changed since: its token count may have too
        return data, stats, meta["findings"]
    except Exception:  # noqa: BLE001 - any unreadable entry (truncated file, bad header, old layout) is rebuilt
        return None


def _consistent(data: TokenizedData, stats: DataStats, per_example: int = 1) -> bool:
    """Arrays that agree with each other and with the stats written beside them (a torn or edited entry does not)."""
    offsets = data.offsets
    ok = len(data.input_ids) == len(data.labels) == int(offsets[-1]) == stats.tokens and int(offsets[0]) == 0
    ok = ok and bool((offsets[1:] >= offsets[:-1]).all())
    if data.starts is not None:
        ok = ok and len(data.starts) == stats.examples and len(data) == stats.rows
    else:
        ok = ok and len(data) == stats.examples * per_example
    return ok


def write_cache(path: Path, data: dict[str, Stored | None], stats: dict[str, DataStats | None], findings: list[dict]) -> None:
    """Write an entry atomically; a concurrent writer of the same key (another rank) is harmless."""
    from safetensors.numpy import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    # Unique per writer, even across hosts sharing the cache directory (pids repeat between containers).
    tmp = path.parent / f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        for name in _FILES:
            part = data.get(name)
            if part is not None:
                save_file((part.sides if isinstance(part, PreferencePairs) else part).arrays(), str(tmp / f"{name}.safetensors"))
        meta = {
            "version": CACHE_VERSION,
            "pairs": [name for name, part in data.items() if isinstance(part, PreferencePairs)],
            "stats": {k: (v.to_dict() if v is not None else None) for k, v in stats.items()},
            "findings": findings,
            "images": {k: v.images for k, v in data.items() if isinstance(v, TokenizedData) and v.images},
            "image_files": _image_files(data),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
        if path.exists() and read_cache(path) is None:
            shutil.rmtree(path, ignore_errors=True)  # a torn or stale entry: ours replaces it
        try:
            os.rename(tmp, path)
        except OSError:  # another process got there first: its entry is as good as ours
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
