"""GGUF export of SentencePiece-style tokenizers (Llama 2, Mistral, Gemma, Phi-3): GGUF's 'llama' tokenizer model,
read back by transformers with the run's own ids; what neither tokenizer writer handles is refused before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_llama, copy_run_with_base, train_tiny_run

from finetune.cli.commands import main
from finetune.errors import ExportError
from finetune.export import gguf_export
from finetune.export.gguf_export import export_gguf
from finetune.export.gguf_vocab import check_vocab

pytest.importorskip("gguf", reason="the GGUF export needs the gguf package: pip install -e '.[test]' (or '.[gguf]')")

SPACE = "\u2581"
SPECIALS = ["<unk>", "<s>", "</s>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]
CHAT = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
CORPUS = [
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.",
    "### Instruction:\nAdd the numbers.\n\n### Input:\n1 + 2\n\n### Response:\n3",
    "Write one sentence about the sea. List three prime numbers, then add them up. def fibonacci(n):",
    "The quick brown fox jumps over the lazy dog; the dog sleeps in the sun.",
]
# Spaces (leading, doubled), newlines, characters the tiny vocabulary lacks (byte fallback: accents, emoji, CJK),
# and special tokens with text right after them, where the three ways of writing '▁' differ.
TEXTS = [
    "Add the numbers.\n\n1 + 2",
    " leading space",
    "  two leading spaces and  two inside",
    "line one\nline two\n\n  indented",
    "café, naïve, 東京 😀",
    "<s>user text</s><unk>",
    "<|im_start|>user\nhé, ça va?<|im_end|>\n<|im_start|>assistant\n",
]
# prefix: how the tokenizer writes '▁' ("first": Metaspace as transformers 5 loads Llama 2 / Mistral;
# "every": Prepend + Replace, sentencepiece's legacy, as Phi-3 ships; "none": Replace only, as Gemma)
NORMALIZERS = {
    "first": (None, {"type": "Metaspace", "replacement": SPACE, "prepend_scheme": "first", "split": False}),
    "every": (
        {
            "type": "Sequence",
            "normalizers": [
                {"type": "Prepend", "prepend": SPACE},
                {"type": "Replace", "pattern": {"String": " "}, "content": SPACE},
            ],
        },
        None,
    ),
    "none": ({"type": "Replace", "pattern": {"String": " "}, "content": SPACE}, None),
}


def quiet(_text: str) -> None:
    pass


def every_split_merges(vocab: dict[str, int]) -> list[list[str]]:
    """Every split of each token into two tokens, in token order: the merges a SentencePiece-converted
    tokenizer.json has (transformers' converter writes them so from the .model file)."""
    merges = []
    for token in sorted(vocab, key=vocab.__getitem__):
        merges += [[token[:i], token[i:]] for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
    return merges


def build_spm_tokenizer(out: Path, prefix: str):
    """A tiny SentencePiece-style tokenizer as a converted Llama 2 tokenizer.json is laid out: <unk> <s> </s>, the 256
    byte tokens, then pieces learned on CORPUS; byte fallback; a chat template with two added special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    learner = Tokenizer(models.BPE())
    # sentencepiece (split_digits, as Llama's) learns neither across words nor digits; no newline: byte fallback, as Llama's
    learner.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Metaspace(SPACE, prepend_scheme="always", split=True), pre_tokenizers.Digits(individual_digits=True)]
    )
    corpus = [text.replace("\n", " ") for text in CORPUS]
    learner.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    learned = sorted(learner.get_vocab(), key=learner.get_vocab().__getitem__)
    vocab = {t: i for i, t in enumerate(SPECIALS + BYTES + learned)}
    normalizer, pre_tokenizer = NORMALIZERS[prefix]
    spec = json.loads(learner.to_str())
    spec.update(normalizer=normalizer, pre_tokenizer=pre_tokenizer, post_processor=None, decoder=None)
    spec["model"].update(vocab=vocab, merges=every_split_merges(vocab), unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    spec["added_tokens"] = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
        for i, t in enumerate(SPECIALS)
    ]
    tok = Tokenizer.from_str(json.dumps(spec))
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix != "none" else []))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT
    fast.save_pretrained(out)
    return fast


# family: (its prefix, as its reader in transformers' GGUF loader rebuilds it; its own config keys, as tests/test_gguf.py)
FAMILIES = {
    "llama": ("first", {}),
    "gemma2": ("none", {"head_dim": 16, "sliding_window": 64, "tie_word_embeddings": True}),
    "phi3": ("every", {}),
}


def build_spm_model(family: str, out: Path) -> Path:
    """A tiny random-init model of the family with build_spm_tokenizer's tokenizer beside it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir()
    prefix, own = FAMILIES[family]
    tok = build_spm_tokenizer(out, prefix)
    if family == "llama":
        build_tiny_llama(out, vocab_size=len(tok))
        return out
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg = AutoConfig.for_model(
        family, vocab_size=len(tok), max_position_embeddings=512, initializer_range=0.1, **ids, **shape, **own
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def spm_runs(tmp_path_factory, runs_data):
    """family -> a 3-step LoRA run on a tiny model of it with a SentencePiece-style tokenizer (built once each)."""
    runs = {}

    def get(family: str):
        if family not in runs:
            d = tmp_path_factory.mktemp(f"spm_{family}")
            runs[family] = train_tiny_run(d / "run", build_spm_model(family, d / "model"), runs_data)
        return runs[family]

    return get


@pytest.fixture(scope="module")
def llama_f16(spm_runs, tmp_path_factory):
    out = tmp_path_factory.mktemp("spm_export") / "gguf"
    return export_gguf(spm_runs("llama").path, out, gguf_type="f16", say=quiet)


def read_back_logits(out: Path, name: str, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out), gguf_file=name, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_llama_sentencepiece_gguf_reads_back_with_the_runs_ids_scores_and_types(spm_runs, llama_f16, tmp_path):
    import gguf
    from transformers import AutoTokenizer

    from finetune.runs.open import open_run, run_tokenizer

    run, out, name = spm_runs("llama"), llama_f16.out, "model-f16.gguf"
    check = llama_f16.metadata["verification"]
    assert check["passed"] and check["same_token_ids"] and check["llama_cpp_mismatches"] == []
    got = read_back_logits(out, name, run.ids)
    assert float((got - run.logits).abs().max()) / float(run.logits.abs().max()) < 1e-3  # f16: one rounding per weight
    run_tok = run_tokenizer(open_run(run.path))
    back = AutoTokenizer.from_pretrained(str(out), gguf_file=name)
    for text in TEXTS:
        assert back(text).input_ids == run_tok(text).input_ids, text
    assert any(t.startswith("<0x") for t in run_tok.convert_ids_to_tokens(run_tok("東京 😀").input_ids))  # byte fallback
    chat = [{"role": "user", "content": " hi there\n"}, {"role": "assistant", "content": "naïve ✓"}]
    assert back.apply_chat_template(chat) == run_tok.apply_chat_template(chat)

    reader = gguf.GGUFReader(str(out / name))

    def field(key):
        return reader.fields[key].contents()

    assert field("tokenizer.ggml.model") == "llama" and field("tokenizer.ggml.pre") == "default"
    assert field("tokenizer.ggml.add_space_prefix") is True and field("tokenizer.ggml.add_bos_token") is True
    assert "tokenizer.ggml.merges" not in reader.fields  # a 'llama' tokenizer merges by score
    tokens, scores, types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.scores"), field("tokenizer.ggml.token_type")
    vocab = run_tok.get_vocab()
    assert tokens == sorted(vocab, key=vocab.__getitem__) and len(scores) == len(types) == len(vocab)
    by = dict(zip(tokens, zip(scores, types)))
    T = gguf.TokenType
    assert by["<unk>"] == (0.0, T.UNKNOWN) and by["<s>"] == (0.0, T.CONTROL) and by["<|im_end|>"] == (0.0, T.CONTROL)
    assert by["<0x00>"] == by["<0xE6>"] == (0.0, T.BYTE)
    # Each merged token scores minus (1 + the rank of the first merge that makes it): the run's merge order
    run_tok.save_pretrained(tmp_path)
    first: dict[str, int] = {}
    for rank, (left, right) in enumerate(json.loads((tmp_path / "tokenizer.json").read_text())["model"]["merges"]):
        first.setdefault(left + right, rank)
    assert len(first) > 150 and all(by[t] == (-(r + 1.0), T.NORMAL) for t, r in first.items())
    assert by["a"] == (0.0, T.NORMAL)  # no merge makes a single character


@pytest.mark.parametrize("family", ["gemma2", "phi3"])
def test_gemma_and_phi3_sentencepiece_tokenizers_read_back_equal_in_f32(spm_runs, tmp_path, family):
    """Their readers rebuild the tokenizer otherwise: Gemma's with no '▁' prefix and merges in token order, Phi-3's
    with sentencepiece's legacy prefix."""
    import gguf
    from transformers import AutoTokenizer

    from finetune.runs.open import open_run, run_tokenizer

    run = spm_runs(family)
    result = export_gguf(run.path, tmp_path / "gguf", gguf_type="f32", say=quiet)
    check = result.metadata["verification"]
    assert check["passed"] and check["max_abs_diff"] < 1e-4 and check["llama_cpp_mismatches"] == []
    assert float((read_back_logits(tmp_path / "gguf", "model-f32.gguf", run.ids) - run.logits).abs().max()) < 1e-4
    run_tok = run_tokenizer(open_run(run.path))
    back = AutoTokenizer.from_pretrained(str(tmp_path / "gguf"), gguf_file="model-f32.gguf")
    for text in TEXTS:
        assert back(text).input_ids == run_tok(text).input_ids, text
    reader = gguf.GGUFReader(str(tmp_path / "gguf" / "model-f32.gguf"))
    assert reader.fields["tokenizer.ggml.add_space_prefix"].contents() is (family == "phi3")
    assert result.metadata["gguf"]["tokenizer"]["add_space_prefix"] is (family == "phi3")


def damage_writer(monkeypatch, method: str, change) -> None:
    """Export with the tokenizer writer's call of GGUFWriter.<method> changed (change(value) is written instead)."""
    add = gguf_export.add_vocab

    def add_damaged(writer, tok_dir, vocab_size):
        original = getattr(writer, method)
        setattr(writer, method, lambda value: None if (v := change(value)) is None else original(v))
        return add(writer, tok_dir, vocab_size)

    monkeypatch.setattr(gguf_export, "add_vocab", add_damaged)


def retype(tokens: dict[int, str], which: set[str]):
    """A change of add_token_types' list: the tokens named in which typed NORMAL."""
    return lambda kinds: [1 if tokens.get(i) in which else k for i, k in enumerate(kinds)]  # 1: gguf.TokenType.NORMAL


# damage: (run family, the GGUFWriter call it changes, the change given the run's {id: token}, what the check says)
DAMAGES = {
    # minus the scores: the merges both readers rebuild from them run in reverse
    "reversed scores": ("llama", "add_token_scores", lambda _: lambda scores: [-s for s in scores], "token ids equal: False"),
    # <|im_start|> not CONTROL: transformers' loader splits it into characters
    "<|im_start|> typed NORMAL": ("llama", "add_token_types", lambda t: retype(t, {"<|im_start|>"}), "token ids equal: False"),
    # transformers' loader does not mind; llama.cpp would print '<0xC3>' where the run decodes 'é'
    "bytes typed NORMAL": ("llama", "add_token_types", lambda t: retype(t, set(BYTES)), "256 byte tokens are not typed BYTE"),
    # llama.cpp's default (true) puts a '▁' Gemma never has; transformers' loader does not read the flag
    "add_space_prefix dropped": ("gemma2", "add_add_space_prefix", lambda _: lambda flag: None, "add_space_prefix is True but"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_wrong_score_type_or_space_prefix_fails_the_check_and_leaves_nothing(spm_runs, tmp_path, monkeypatch, capsys, damage):
    from finetune.runs.open import open_run, run_tokenizer

    family, method, change, found = DAMAGES[damage]
    run = spm_runs(family)
    tokens = {i: t for t, i in run_tokenizer(open_run(run.path)).get_vocab().items()}
    damage_writer(monkeypatch, method, change(tokens))
    out = tmp_path / "gguf"
    assert main(["export", str(run.path), "--gguf", "--gguf-type", "f32", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert "gguf check FAILED" in captured.out and found in captured.err
    assert "nothing was written" in captured.err and not out.exists() and not list(tmp_path.glob(".tmp-*"))


@pytest.fixture(scope="module")
def spm_tokenizers(tmp_path_factory):
    """prefix -> a folder with build_spm_tokenizer's tokenizer of that prefix (no model)."""
    dirs = {}
    for prefix in NORMALIZERS:
        dirs[prefix] = tmp_path_factory.mktemp(f"spm_tok_{prefix}")
        build_spm_tokenizer(dirs[prefix], prefix)
    return dirs


def edited(src: Path, dest: Path, edit) -> Path:
    """A copy of the tokenizer folder src at dest with its tokenizer.json changed by edit(spec)."""
    dest.mkdir()
    for f in src.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    spec = json.loads((src / "tokenizer.json").read_text())
    edit(spec)
    (dest / "tokenizer.json").write_text(json.dumps(spec))
    return dest


def unigram(spec):
    spec["model"] = {"type": "Unigram", "unk_id": 0, "byte_fallback": True, "vocab": [[t, -1.0] for t in spec["model"]["vocab"]]}


def swap_merged_ids(spec):
    """Two merged tokens trade ids: their merges now make tokens out of id order."""
    vocab, (left, right) = spec["model"]["vocab"], spec["model"]["merges"][0]
    first, last = left + right, "".join(spec["model"]["merges"][-1])
    vocab[first], vocab[last] = vocab[last], vocab[first]


@pytest.mark.parametrize(
    ("prefix", "arch", "edit", "message"),
    [
        (
            "first",
            "llama",
            unigram,
            "the run's tokenizer is Unigram with byte fallback, decoder Sequence (segmented by likelihood, which GGUF's "
            "score-ordered 'llama' merges do not reproduce); --gguf writes byte-level BPE (GPT-2 / Llama 3 / Qwen2 style) "
            "and SentencePiece-style BPE with byte fallback",
        ),
        (
            "first",
            "phi3",
            None,
            "the run's tokenizer puts a '▁' before the start of the text only (Metaspace, prepend_scheme 'first'), but "
            "transformers' GGUF loader, which checks the file, reads every phi3 GGUF's SentencePiece tokenizer back with "
            "a '▁' before every run of text",
        ),
        (
            "every",
            "llama",
            None,
            "reads every llama GGUF's SentencePiece tokenizer back with a '▁' before the start of the text only",
        ),
        ("none", "qwen2", None, "the run's tokenizer puts no '▁' before the text (Replace ' ' only), but"),
        (  # a LlamaTokenizer with legacy: true (Mistral's tokenizer_config) loads so
            "first",
            "llama",
            lambda s: s["pre_tokenizer"].update(prepend_scheme="always"),
            "but not before a leading space (Metaspace, prepend_scheme 'always'), but transformers' GGUF loader",
        ),
        (
            "first",
            "llama",
            lambda s: s["pre_tokenizer"].update(split=True),
            "turns spaces into '▁' in a way --gguf does not know",
        ),
        ("first", "llama", lambda s: s["model"].update(dropout=0.1), "sets {'dropout': 0.1}"),
        ("first", "llama", lambda s: s["model"]["vocab"].pop("<0xC3>"), "lacks 1 of the 256 byte tokens (first: <0xC3>)"),
        ("first", "llama", lambda s: s["model"]["merges"].pop(0), "but no merge of the two"),
        (
            "first",
            "llama",
            lambda s: s["model"]["merges"].append(s["model"]["merges"][0]),
            "makes a token an earlier merge (#0) made",
        ),
        ("none", "gemma2", swap_merged_ids, "orders every gemma2 GGUF's merges by token id"),
        ("none", "gemma3", lambda s: s["added_tokens"].append({"id": 999, "content": "  "}), "the space-only token '  '"),
    ],
)
def test_a_tokenizer_neither_writer_handles_is_refused_naming_it(spm_tokenizers, tmp_path, prefix, arch, edit, message):
    tok_dir = edited(spm_tokenizers[prefix], tmp_path / "tok", edit) if edit else spm_tokenizers[prefix]
    with pytest.raises(ExportError, match="export with --merge and convert") as err:
        check_vocab(tok_dir, arch)
    assert message in str(err.value)


def test_each_prefix_is_accepted_for_the_arch_whose_reader_rebuilds_it(spm_tokenizers):
    for prefix, arches in {"first": ["llama", "qwen2", "qwen3"], "every": ["phi3"], "none": ["gemma2", "gemma3"]}.items():
        for arch in arches:
            assert check_vocab(spm_tokenizers[prefix], arch) == "llama", (prefix, arch)
    assert check_vocab(Path(__file__).parents[1] / "finetune" / "assets" / "tiny-llama", "llama") == "gpt2"


def test_a_missing_ascii_byte_token_is_accepted_where_its_character_is_a_token(spm_tokenizers, tmp_path):
    def tab_for_byte(spec):
        vocab = spec["model"]["vocab"]
        vocab["\t"] = vocab.pop("<0x09>")  # as transformers' GemmaConverter renames it

    # (a missing <0xC3>, which no one-character token stands for, is refused: see the refusals above)
    assert check_vocab(edited(spm_tokenizers["none"], tmp_path / "tab", tab_for_byte), "gemma2") == "llama"


def test_a_refused_tokenizer_stops_the_export_before_anything_is_written(spm_runs, tmp_path, capsys):
    """The run's own tokenizer (in its adapter folder) rewritten in sentencepiece's legacy form: a Llama GGUF's reader
    would put no '▁' after special tokens, so the export is refused before the merge."""
    import yaml

    run = spm_runs("llama")
    base = Path(yaml.safe_load((run.path / "recipe.yaml").read_text())["model"]["path"])
    copy = copy_run_with_base(run.path, tmp_path, base)
    spec_path = copy / "adapter" / "tokenizer.json"
    spec = json.loads(spec_path.read_text())
    spec["normalizer"], spec["pre_tokenizer"] = NORMALIZERS["every"]
    spec_path.write_text(json.dumps(spec))
    out = tmp_path / "gguf"
    assert main(["export", str(copy), "--gguf", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert "sentencepiece's legacy), but transformers' GGUF loader, which checks the file, reads every llama GGUF" in captured.err
    assert "gguf: merging" not in captured.out and not out.exists() and not list(tmp_path.glob(".tmp-*"))
