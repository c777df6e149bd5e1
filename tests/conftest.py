"""Shared fixtures: a tiny Llama-shaped model and a character-level tokenizer, built
locally (no network, no hub).

The tokenizer maps every character to one token, so golden label masks can be
worked out by hand: a prompt of n characters is exactly n tokens (plus BOS).
"""

from __future__ import annotations

import json
import os
import string
import tempfile
from pathlib import Path

import pytest

# Set, not setdefault: a developer's exported HF_HUB_OFFLINE=0 must not let a test reach the network.
os.environ.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
os.environ["TOKENIZERS_PARALLELISM"] = "false"
# Each xdist worker computes on one thread (the workers share the cores; set before torch is imported).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# Triton reads TRITON_INTERPRET when it is first imported (its own library functions are wrapped then): on a machine
# without CUDA the suite runs model/triton_kernels.py under the interpreter (tests/test_triton_kernels.py), set here
# before anything imports triton; a CUDA machine compiles them.
if not __import__("torch").cuda.is_available():  # (torch imported after the thread count above)
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The tokenized-data cache of the whole test session goes to a temp dir, never ~/.cache.
os.environ["FINETUNE_CACHE"] = tempfile.mkdtemp(prefix="finetune-test-cache-")
# An empty Hugging Face home: no test reads a model or dataset the machine has cached (a user's machine
# may hold Qwen/Qwen2.5-7B), nor writes there; the code transformers copies out of custom-code model folders too.
_hf_home = tempfile.mkdtemp(prefix="finetune-test-hf-home-")
os.environ["HF_HOME"] = _hf_home
for _name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE", "HF_DATASETS_CACHE", "HF_MODULES_CACHE"):
    os.environ[_name] = os.path.join(_hf_home, _name.lower())

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
PAD_ID, BOS_ID, EOS_ID, UNK_ID, IM_START_ID, IM_END_ID = range(6)
CHARS = list(string.printable)  # digits, letters, punctuation, whitespace incl. \n

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def char_token_id(ch: str) -> int:
    return len(SPECIALS) + CHARS.index(ch)


def build_char_tokenizer(out_dir: Path, chat_template: str | None = CHATML_TEMPLATE):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # "." would miss "\n"
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", BOS_ID)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(out_dir)
    return fast


def build_tiny_llama(out_dir: Path, vocab_size: int, seed: int = 0, hidden: int = 64, layers: int = 2, tied: bool = False):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=tied,
        # A wider init than the default 0.02 lets a frozen random head express
        # confident predictions, so LoRA alone can visibly lower the loss.
        initializer_range=0.1,
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out_dir)
    return model


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("char_tokenizer")
    build_char_tokenizer(d)
    return d


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random tiny Llama (hidden 64, 2 layers) with the char tokenizer saved beside it."""
    d = tmp_path_factory.mktemp("tiny_llama")
    tok = build_char_tokenizer(d)
    build_tiny_llama(d, vocab_size=len(tok))
    return d


@pytest.fixture
def checkpoint_reads(monkeypatch) -> dict[str, tuple[int, ...]]:
    """{checkpoint key: shape read} of every tensor transformers' loader materializes from safetensors while
    the test runs (slices are lazy until indexed: a key never indexed is never read)."""
    import transformers.modeling_utils as loading

    read: dict[str, tuple[int, ...]] = {}
    opened = loading.safe_open

    class Counted:
        def __init__(self, key, inner):
            self.key, self.inner = key, inner

        def __getitem__(self, index):
            got = self.inner[index]
            read[self.key] = tuple(got.shape)
            return got

        def __getattr__(self, name):
            return getattr(self.inner, name)

    class File:
        def __init__(self, *args, **kwargs):
            self.inner = opened(*args, **kwargs)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, key):
            return Counted(key, self.inner.get_slice(key))

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

    monkeypatch.setattr(loading, "safe_open", File)
    return read


def step_rows(out: Path) -> list[tuple[float, float]]:
    """(loss, pre-clip grad norm) of every logged training step of the run in `out`."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["loss"], r["grad_norm"]) for r in rows if "loss" in r]


def assert_same_steps(reference: Path, other: Path, rel: float = 1e-5) -> None:
    """Same losses and same gradient norms, step by step.

    Losses alone cannot see a gradient scaled by a constant (clipping and AdamW both
    undo it); the norm before clipping can, when the runs train with clipping off.
    """
    a, b = step_rows(reference), step_rows(other)
    assert len(a) == len(b) > 0, (len(a), len(b))
    import pytest

    assert [loss for loss, _ in b] == pytest.approx([loss for loss, _ in a], rel=rel), "losses differ"
    assert [norm for _, norm in b] == pytest.approx([norm for _, norm in a], rel=rel), "gradient norms differ"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


ALPACA_ROWS = [
    {"instruction": "Add the numbers.", "input": f"{a} + {b}", "output": str(a + b)} for a in range(1, 9) for b in range(1, 9)
]


@pytest.fixture
def alpaca_file(tmp_path) -> Path:
    return write_jsonl(tmp_path / "train.jsonl", ALPACA_ROWS)


def tiny_recipe(model_dir: Path, data_file: Path) -> dict:
    """A small valid recipe (as a dict) on a tiny model and an alpaca file, output_dir left to the caller."""
    return {
        "description": "test recipe",
        "model": {"path": str(model_dir)},
        "data": {"path": str(data_file), "format": "alpaca", "max_seq_len": 256},
        "seed": 0,
        "precision": "fp32",
        "quant": {"bits": None},
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "train": {"max_steps": 4, "batch_size": 4, "lr": 1e-3},
        "memory": {"activation_checkpointing": "none"},
        # No loss.png: matplotlib's import and a drawing cost ~0.5 s a run (tests/test_report.py and the default-
        # output tests in test_trainer.py and e2e/test_cli_e2e.py draw it).
        "report": {"plot": False},
    }


@pytest.fixture
def recipe_dict(tiny_model_dir, alpaca_file, tmp_path) -> dict:
    """A small valid recipe (as a dict) on the tiny model; tests tweak it."""
    return {**tiny_recipe(tiny_model_dir, alpaca_file), "output_dir": str(tmp_path / "run")}


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): one worker per core, at most 4 (a multi-process test starts 2-5 processes
    of its own); PYTEST_XDIST_AUTO_NUM_WORKERS overrides, `-n 0` runs everything in this process."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """A module whose tests share a module-scoped fixture (a reference run) runs on one xdist worker, so the
    fixture is built once (`--dist loadgroup`); tests marked `gpu` need CUDA and are skipped, visibly, without it."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        if any(d and d[-1].scope == "module" for d in defs) and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# --------------------------------------------------------------------------- finished runs (export, generate, eval)


class TinyRun:
    """A finished run on the tiny model, with the trained model's logits on `ids` kept for comparisons."""

    def __init__(self, path: Path, ids, logits):
        self.path, self.ids, self.logits = path, ids, logits


def train_tiny_run(out: Path, model_dir: Path, data_file: Path, **sections) -> TinyRun:
    """A 3-step run (lr 1e-2, so the adapter visibly moves the logits) with recipe sections patched."""
    import torch

    from finetune.config.schema import build_recipe
    from finetune.trainer import Trainer

    recipe = {
        "model": {"path": str(model_dir)},
        "data": {"path": str(data_file), "format": "alpaca", "max_seq_len": 256},
        "output_dir": str(out),
        "seed": 0,
        "precision": "fp32",
        "quant": {"bits": None},
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "train": {"max_steps": 3, "batch_size": 4, "lr": 1e-2},
        "memory": {"activation_checkpointing": "none"},
        "report": {"plot": False},
    }
    for key, value in sections.items():
        recipe[key] = {**recipe.get(key, {}), **value} if isinstance(value, dict) else value
    trainer = Trainer(build_recipe(recipe), progress=False)
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    ids = torch.tensor([trainer.data.train[0]["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return TinyRun(out, ids, logits)


@pytest.fixture(scope="session")
def runs_data(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("runs_data") / "train.jsonl", ALPACA_ROWS)


@pytest.fixture(scope="session")
def lora_run(tmp_path_factory, tiny_model_dir, runs_data) -> TinyRun:
    """LoRA on the unquantized fp32 base."""
    return train_tiny_run(tmp_path_factory.mktemp("lora_run") / "run", tiny_model_dir, runs_data)


@pytest.fixture(scope="session")
def qlora_run(tmp_path_factory, tiny_model_dir, runs_data) -> TinyRun:
    """QLoRA: LoRA trained against the 4-bit NF4 (double-quant) base."""
    return train_tiny_run(tmp_path_factory.mktemp("qlora_run") / "run", tiny_model_dir, runs_data, quant={"bits": 4})


def copy_run_with_base(run: Path, dest: Path, model_dir: Path, **model) -> Path:
    """A copy of a finished run at dest/run whose recipe.yaml points at a copy of its base model at dest/model
    (with `model` keys set): a run whose base can be damaged or given custom code without touching the original."""
    import shutil

    import yaml

    shutil.copytree(run, dest / "run")
    shutil.copytree(model_dir, dest / "model")
    recipe = yaml.safe_load((dest / "run" / "recipe.yaml").read_text())
    recipe["model"].update(path=str(dest / "model"), **model)
    (dest / "run" / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return dest / "run"


def add_custom_code(model_dir: Path, marker: Path) -> None:
    """Make model_dir a custom architecture (config.json's auto_map names a class in its own custom_llama.py)
    whose code, when transformers runs it, creates `marker`. The weights stay the tiny Llama's."""
    (model_dir / "custom_llama.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class CustomConfig(LlamaConfig):\n    model_type = 'custom_llama'\n"
        "class CustomForCausalLM(LlamaForCausalLM):\n    config_class = CustomConfig\n"
    )
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(
        {
            "model_type": "custom_llama",
            "auto_map": {"AutoConfig": "custom_llama.CustomConfig", "AutoModelForCausalLM": "custom_llama.CustomForCausalLM"},
        }
    )
    (model_dir / "config.json").write_text(json.dumps(cfg))


def training_kernel_only(model):
    """Turn off bitsandbytes' AVX512-BF16 eval kernel on a vanilla-loaded model (its logits differ by ~1e-2).

    On CPUs with avx512_bf16, bitsandbytes repacks 4-bit weights for a bf16 kernel the
    first time a Linear4bit runs in eval mode without grad; training never uses it, so
    an exact comparison with the trained model needs the training kernel on both sides.
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


def assert_packed_logits_match_each_example(trainer, label: str) -> None:
    """A packed run's rows (the first two holding several examples) give each example the logits it
    gets alone (atol 1e-5): packing never lets one example see another."""
    import torch

    from finetune.data import Collator

    model = trainer.model.eval()
    rows = [r for r in trainer.data.train if r["position_ids"].count(0) > 1][:2]
    assert rows, "packing put every example in a row of its own"
    batch = Collator(pad_token_id=0)(rows)
    seen = 0
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        for r, row in enumerate(rows):
            starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["input_ids"])]
            for a, b in zip(starts, starts[1:]):
                alone = model(input_ids=torch.tensor([row["input_ids"][a:b]]), use_cache=False).logits[0]
                torch.testing.assert_close(packed[r, a:b], alone, rtol=0, atol=1e-5, msg=f"{label} row {r} [{a}:{b})")
                seen += 1
    assert seen >= 3, label
    model.train()


def load_benchmark(filename: str):
    """A script of benchmarks/ loaded by path as a module (benchmarks/ is no package: its scripts
    import their neighbours, which they put on sys.path themselves)."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[1] / "benchmarks" / filename
    name = "bench_" + path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- launched runs: free ports, waiting on progress


def free_port() -> int:
    """A TCP port no process holds now, below the kernel's ephemeral range: a rendezvous port no other test, file or
    test run shares.

    torchrun needs only this one: its workers' stores and gloo's connections take ephemeral ports of their own, so a
    port the kernel picked (ephemeral) could be handed to another test's gloo connection before torchrun binds it
    (seen: EADDRINUSE under xdist). Below the range only another free_port could take it: random, then checked.
    """
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default range starts there
    for _ in range(100):
        port = random.SystemRandom().randrange(max(1024, low - 12000), low)  # not the global generator a test seeds
        with socket.socket() as sock:
            try:
                sock.bind(("", port))  # every interface: torchrun's store listens on all of them
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in [{low - 12000}, {low}) after 100 tries")


def logged_steps(out: Path) -> list[int]:
    """The steps whose training row is complete in out/metrics.jsonl so far (a line still being written is not)."""
    path = out / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    rows = [json.loads(line) for line in text.split("\n")[:-1]]
    return [r["step"] for r in rows if "loss" in r]


class Job:
    """A command running in a session of its own, its output (stdout and stderr) going to `log`.

    A test that signals a run waits for the run's own progress (wait_until), never for a fixed time; a wait
    that fails kills the whole tree (launcher, torchrun, workers) and shows the run's output.
    """

    def __init__(self, cmd: list[str], log: Path, **popen):
        import subprocess

        self.log = log
        with log.open("w") as sink:
            self.proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True, **popen)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_until(self, ready, what: str, timeout: float = 600):
        """ready()'s value once it is true; fail if the run ends first or `timeout` seconds pass."""
        import time

        deadline = time.monotonic() + timeout
        while not (found := ready()):
            if self.proc.poll() is not None:
                pytest.fail(f"waited for {what}, but the run ended (exit {self.proc.returncode}) {self.tail()}")
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"waited {timeout} s for {what} {self.tail()}")
            time.sleep(0.02)  # a step of the tiny test runs takes ~40 ms: a slower poll lets the run get ahead
        return found

    def finish(self, timeout: float = 600) -> int:
        """The exit code, once the run ends; fail (killing it) if it runs past `timeout` seconds."""
        import subprocess

        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"still running after {timeout} s {self.tail()}")

    def kill(self) -> None:
        import contextlib
        import signal

        with contextlib.suppress(ProcessLookupError):  # the group may be gone already
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def tail(self) -> str:
        return f"({self.log}):\n{self.output()[-4000:]}"


CLOCK_KEYS = ("elapsed_s", "tokens_per_s", "tflops", "mfu", "step_s")  # clock readings in a step's row: never compared


def straight_and_resumed(cfg, a: Path, b: Path, stop_at: int = 3) -> tuple[list[dict], list[dict]]:
    """Train cfg(a) straight, and cfg(b) stopped by SIGUSR1 as step `stop_at` begins, then resumed with
    resume=auto; each run's logged step rows, clock readings left out."""
    import os
    import signal

    from finetune.errors import Preempted
    from finetune.metrics import read_metrics
    from finetune.trainer import Trainer

    class StopAt(Trainer):
        def step_batches(self, step):
            if step == stop_at:
                os.kill(os.getpid(), signal.SIGUSR1)
            return super().step_batches(step)

    with Trainer(cfg(a), progress=False) as straight:
        straight.train()
    with StopAt(cfg(b), progress=False) as first, pytest.raises(Preempted):
        first.train()
    with Trainer(cfg(b, resume="auto"), progress=False) as resumed:
        resumed.train()
    return tuple(  # type: ignore[return-value]
        [{k: v for k, v in r.items() if k not in CLOCK_KEYS} for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
        for out in (a, b)
    )


# The first lines of a torchrun driver that calls Trainer(...).train() with no with-block: their atexit hook runs
# last, and fails the launch (exit 3) when the Trainer left its process group to the interpreter's teardown,
# where a rank can abort after a good run (SIGABRT, "terminate called without an active exception").
CLOSED_AT_EXIT = """
import atexit, os
import torch.distributed as dist
atexit.register(lambda: dist.is_initialized() and os._exit(3))
"""

# WRONG_SCALE=1 doubles every gradient while the loss value stays the same: the kind of
# bug (a wrong world-size or token-count factor in backward) the comparison must catch.
WRONG_SCALE_DRIVER = """
import os, sys
from finetune.config.schema import load_recipe
from finetune.trainer import Trainer

class WrongScale(Trainer):
    def compute_loss(self, model, batch):
        loss, n = super().compute_loss(model, batch)
        return 2 * loss - loss.detach(), n

cls = WrongScale if os.environ.get("WRONG_SCALE") else Trainer
cls(load_recipe(sys.argv[1]), progress=False).train()
"""
