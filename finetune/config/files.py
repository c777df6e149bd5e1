"""Recipe files and bundled assets: where they are and how they are read (schema-free).

    data, source = read_recipe("demo-cpu", ["train.lr=1e-3"])   # a shipped name or a path
    resolve_path("asset:tiny-llama")                           # -> the bundled model's folder

YAML is read with yaml.safe_load; config.load_recipe validates what this returns.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from finetune.config.messages import _deep_merge, parse_overrides
from finetune.errors import ConfigError

# Paths that start with this prefix point into the package's bundled assets
# (finetune/assets/), so the demo recipe works from any working directory.
ASSET_PREFIX = "asset:"
ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets"


def resolve_path(value: str) -> str:
    """Turn 'asset:NAME' into the absolute path of a bundled asset; other values unchanged."""
    if value.startswith(ASSET_PREFIX):
        return str(ASSETS_DIR / value[len(ASSET_PREFIX) :])
    return os.path.expanduser(value)


def read_recipe_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError([f"recipe file '{path}' not found (cwd: {os.getcwd()}). Run `finetune ls` to see shipped recipes."])
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError([f"not valid YAML{where}: {getattr(exc, 'problem', exc)}"], str(path)) from None
    return data if data is not None else {}


def read_recipe(path: str | os.PathLike[str], overrides: list[str] | None = None) -> tuple[dict[str, Any], str]:
    """The raw recipe dict with overrides applied, and where it came from."""
    resolved = find_recipe(str(path))
    data = read_recipe_file(resolved)
    if isinstance(data, dict):
        data = _deep_merge(data, parse_overrides(overrides))
    return data, str(resolved)


# --------------------------------------------------------------------------- shipped recipes


def shipped_recipes() -> dict[str, Path]:
    """name -> path of each recipe that ships with the package (finetune.recipes)."""
    from importlib import resources

    root = resources.files("finetune.recipes")
    return {
        Path(str(entry)).stem: Path(str(entry))
        for entry in sorted(root.iterdir(), key=lambda e: str(e))
        if str(entry).endswith(".yaml")
    }


def find_recipe(name_or_path: str) -> Path:
    """A path as given when it exists, else a shipped recipe of that name."""
    p = Path(name_or_path)
    if p.exists():
        return p
    shipped = shipped_recipes()
    key = p.stem if p.suffix in (".yaml", ".yml") else name_or_path
    if key in shipped and len(p.parts) <= 2:
        return shipped[key]
    return p


def recipe_description(path: Path) -> str:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError:
        return "(invalid YAML)"
    return str(data.get("description", "")).strip().splitlines()[0] if data.get("description") else ""
