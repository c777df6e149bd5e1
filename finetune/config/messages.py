"""How a recipe's text and mistakes are read and explained: dotted command-line overrides,
and one clear line per schema problem (did you mean, where a key moved, what was expected).

    tree = parse_overrides(["train.lr=1e-4", "lora.target=[q_proj,v_proj]"])
    problems = schema_problems(RecipeConfig, validation_error)

config/schema.py owns the schema; this module knows only pydantic, so it stands before schema.py.
"""

from __future__ import annotations

import difflib
import re
import types
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from finetune.errors import ConfigError

_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def parse_overrides(overrides: list[str] | None) -> dict[str, Any]:
    """['train.lr=1e-3', 'lora.target=[q_proj,v_proj]'] -> nested dict. Values are YAML scalars/lists."""
    tree: dict[str, Any] = {}
    problems = []
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            problems.append(f"override '{item}': expected key=value, e.g. train.lr=1e-4")
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() != "" else ""
        except yaml.YAMLError:
            value = raw
        if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads '1e-3' as a string; users mean a number
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                problems.append(f"override '{item}': '{part}' was already set to a value, not a section")
                break
            node = child
        else:
            node[parts[-1]] = value
    if problems:
        raise ConfigError(problems, source="command-line overrides")
    return tree


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def model_at(root: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model class that owns the keys at `loc` under `root` (for did-you-mean)."""
    model: type[BaseModel] = root
    for part in loc:
        if isinstance(part, int):  # an item of a list section (data.mix.0): the list's model owns its keys
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        ann = field.annotation
        candidates = getattr(ann, "__args__", (ann,))
        sub = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if sub is None:
            return None
        model = sub
    return model


# Names users bring from peft / HF Trainer / axolotl, mapped to ours.
_SYNONYMS = {
    "rank": "r",
    "lora_r": "r",
    "lora_alpha": "alpha",
    "lora_dropout": "dropout",
    "target_modules": "target",
    "use_dora": "dora",
    "use_rslora": "method",  # lora.method=rslora
    "init_lora_weights": "method",  # lora.method=pissa
    "learning_rate": "lr",
    "num_train_epochs": "epochs",
    "num_epochs": "epochs",
    "micro_batch_size": "batch_size",
    "per_device_train_batch_size": "batch_size",
    "gradient_accumulation_steps": "grad_accum",
    "lr_scheduler_type": "scheduler",
    "lr_scheduler": "scheduler",
    "max_length": "max_seq_len",
    "sequence_len": "max_seq_len",
    "max_seq_length": "max_seq_len",
    "load_in_4bit": "bits",
    "bnb_4bit_quant_type": "quant_type",
    "bnb_4bit_use_double_quant": "double_quant",
    "base_model": "path",
    "model_name_or_path": "path",
    "dataset": "path",
    "datasets": "mix",
    "sample_packing": "packing",
    "chat_template": "template",
    "train_on_inputs": "train_on",
    "dataset_num_proc": "num_proc",
    "dataset_prepared_path": "cache_dir",
}


# Keys that moved to another section: (old section, old key) -> where it lives now.
_MOVED = {
    ("train", "gradient_checkpointing"): "memory.activation_checkpointing (all | none | k for every k-th layer)",
}


def _suggest(key: str, known: list[str]) -> str | None:
    alias = _SYNONYMS.get(key)
    if alias in known:
        return alias
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return close[0] if close else None


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def field_path(root: type[BaseModel], loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """The part of an error location that names recipe keys (drops pydantic's union-branch tags)."""
    model: type[BaseModel] | None = root
    for i, part in enumerate(loc):
        if model is None or str(part) not in model.model_fields:
            return loc[:i] if i else loc
        model = model_at(root, loc[: i + 1])
    return loc


def _expected(ann: Any) -> str:
    """A field's type as a recipe writes its values where they are few (bool | Literal["disk"]: true, false or disk),
    else as Python names it."""
    args = get_args(ann) if get_origin(ann) in (Union, types.UnionType) else ()
    if args and all(a is bool or a is type(None) or get_origin(a) is Literal for a in args):
        words = [w for a in args for w in (("true", "false") if a is bool else ("null",) if a is type(None) else get_args(a))]
        return ", ".join(map(str, words[:-1])) + f" or {words[-1]}"
    return str(ann).replace("typing.", "").replace(" | None", " or null")


def schema_problems(root: type[BaseModel], err: ValidationError) -> list[str]:
    """One line per problem of a schema check against `root`: unknown keys with their did-you-mean
    (or where they moved), a wrong type once per key (not once per union branch), missing keys."""
    problems = []
    union_seen: set[tuple[Any, ...]] = set()
    for e in err.errors():
        loc = tuple(e["loc"])
        field = field_path(root, loc)
        if e["type"] != "extra_forbidden" and field != loc and field:
            # A value that matches none of a union's types: one problem, not one per branch.
            if field in union_seen:
                continue
            union_seen.add(field)
            owner = model_at(root, field[:-1])
            ann = owner.model_fields[str(field[-1])].annotation if owner else None
            expected = _expected(ann) if ann else "another type"
            dotted = ".".join(str(p) for p in field)
            problems.append(f"{dotted}: expected {expected} (got {_describe(e.get('input'))}){_help(root, field)}")
            continue
        dotted = ".".join(str(p) for p in loc)
        etype = e["type"]
        if etype == "extra_forbidden":
            owner = model_at(root, loc[:-1])
            known = list(owner.model_fields) if owner else []
            close = _suggest(str(loc[-1]), known)
            prefix = ".".join(str(p) for p in loc[:-1])
            last_two = tuple(str(p) for p in loc[-2:])
            moved = _MOVED.get((last_two[0], last_two[1])) if len(last_two) == 2 else None
            if moved:
                hint = f"it moved to {moved}"
            elif close:
                hint = f"did you mean '{prefix + '.' if prefix else ''}{close}'?"
            else:
                hint = f"known keys{' under ' + prefix if prefix else ''}: {', '.join(known)}"
            problems.append(f"{dotted}: unknown key; {hint}")
        elif etype == "missing":
            problems.append(f"{dotted}: required key is missing; add it to the recipe or pass {dotted}=...")
        elif etype == "value_error" and not loc:
            problems.extend(str(e["msg"]).removeprefix("Value error, ").split("\n"))
        else:
            msg = str(e["msg"]).removeprefix("Value error, ")
            problems.append(f"{dotted}: {msg} (got {_describe(e.get('input'))}){_help(root, loc)}")
    return problems


HELP_CHARS = 110  # the key's help shown after a wrong value: its description's first clause, at most this long


def _help(root: type[BaseModel], loc: tuple[Any, ...]) -> str:
    """' [key: what it is]' from the schema's description of the field at `loc`, or ''."""
    owner = model_at(root, loc[:-1])
    field = owner.model_fields.get(str(loc[-1])) if owner else None
    gist = ((field.description or "") if field else "").strip()
    if len(gist) > HELP_CHARS:
        gist = gist.split("; ")[0]  # the first clause
    if len(gist) > HELP_CHARS:
        cut = gist[: HELP_CHARS - 3]
        cut = cut[: cut.rfind("(")] if cut.count("(") > cut.count(")") else cut[: cut.rfind(" ")]  # no half parenthesis
        gist = cut.rstrip(" ,:") + "..."
    return f" [{loc[-1]}: {gist}]" if gist else ""
