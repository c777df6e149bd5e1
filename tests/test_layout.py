"""The data flow of docs/design.md, enforced: no module imports one that stands later."""

from __future__ import annotations

import ast
from pathlib import Path

import finetune

# Import order (a module may import only those before it), as docs/design.md draws it:
# checkpoint and resume are libraries the trainer calls, so they stand before it.
ORDER = [
    "errors",
    "adapters",
    "memory_modes",
    "objectives",
    "grad_compression",
    "zero",
    "config_messages",
    "recipe_files",
    "older_runs",
    "config",
    "gpus",
    "hardware",
    "shards",
    "metrics",
    "report",
    "moe",
    "varlen",
    "model",
    "kernels",
    "tiled_mlp",
    "plan",
    "distributed",
    "comm_hooks",
    "offload",
    "stream",
    "host_tables",
    "data",
    "evaluate",
    "checkpoint",
    "resume",
    "preflight",
    "trainer",
    "runs",
    "merge",
    "export",
    "launch",
    "cli",
]
# Inside a package that states an order, the same rule between its modules (finetune/plan/).
PACKAGE_ORDER = {
    "plan": [
        "shape",
        "inputs",
        "speed",
        "terms",
        "activations",
        "memory",
        "recipe",
        "fitting",
        "render",
        "rewrite",
        "preflight",
        "command",
    ],
    "trainer": [
        "state",
        "callbacks",
        "schedule",
        "linear_ce",
        "loss",
        "order",
        "parallel",
        "evaluation",
        "preference",
        "profiling",
        "build",
        "loop",
    ],
}
PKG = Path(finetune.__file__).parent


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "finetune":
            found.update(alias.name for alias in node.names)  # from finetune import trainer
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("finetune."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("finetune."):
                    found.add(alias.name.split(".")[1])
    return found


def module_files(name: str) -> list[Path]:
    """The file of a module, or every file of a package and its subpackages (finetune/data/, data/formats/)."""
    if (PKG / name).is_dir():
        return sorted((PKG / name).rglob("*.py"))
    return [PKG / f"{name}.py"] if (PKG / f"{name}.py").exists() else []


def test_every_module_is_placed():
    modules = {p.stem for p in PKG.glob("*.py")} - {"__init__", "__main__"}
    modules |= {p.parent.name for p in PKG.glob("*/__init__.py")} - {"assets"}  # assets: files, no code
    assert modules <= set(ORDER), f"add {modules - set(ORDER)} to ORDER"


def test_imports_flow_one_way():
    for name in ORDER:
        later = set(ORDER[ORDER.index(name) + 1 :])
        for path in module_files(name):
            bad = imported_modules(path) & later
            assert not bad, f"finetune.{name} ({path.name}) imports {bad}, which stand after it"
            # A module importing itself is only legal inside a package (finetune.data.x imports finetune.data.y).
            assert name not in imported_modules(path) or path.relative_to(PKG).parts[0] == name, f"{path} imports itself"


def test_package_modules_flow_one_way():
    for package, order in PACKAGE_ORDER.items():
        files = {p.stem: p for p in (PKG / package).glob("*.py")}
        assert set(files) - {"__init__"} == set(order), (
            f"finetune/{package}/: PACKAGE_ORDER lists {order}, files are {sorted(files)}"
        )
        for name in order:
            later = set(order[order.index(name) + 1 :])
            found = set()
            for node in ast.walk(ast.parse(files[name].read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(f"finetune.{package}."):
                    found.add(node.module.split(".")[2])
            assert not found & later, f"finetune.{package}.{name} imports {found & later}, which stand after it"


def test_every_package_ships():
    """pyproject lists packages by name: a new subpackage left out is missing from the wheel."""
    import tomllib

    listed = set(tomllib.loads((PKG.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(("finetune",) + p.parent.relative_to(PKG).parts) for p in PKG.glob("**/__init__.py") if p.parent != PKG}
    assert found <= listed, f"add {found - listed} to [tool.setuptools] packages in pyproject.toml"


def test_public_api():
    for name in ("load_recipe", "Trainer", "load_model", "load_tokenizer", "build_datasets", "TrainResult"):
        assert name in finetune.__all__
        assert getattr(finetune, name) is not None


def test_the_repository_carries_its_own_design_and_points_nowhere_outside():
    root = PKG.parent
    for name in ("docs/design.md", "CONTRIBUTING.md", "LICENSE"):
        assert (root / name).is_file(), f"{name} is missing"
    assert "Apache License" in (root / "LICENSE").read_text() and "Apache-2.0" in (root / "pyproject.toml").read_text()
    outside = "../" + "shared"  # spelled apart so this file does not match itself
    offenders = [
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file()
        and p.suffix in {".py", ".md", ".toml", ".yaml", ".yml", ".sbatch", ".cfg", ".txt"}
        and ".git" not in p.parts
        and outside in p.read_text(errors="ignore")
    ]
    assert not offenders, f"files refer to {outside}: {offenders}"


def test_no_file_over_500_lines_and_no_function_over_80():
    # One idea per file (docs/design.md); ruff format can push a file over without anyone noticing.
    long_files, long_functions = [], []
    for path in PKG.rglob("*.py"):
        text = path.read_text()
        if len(text.splitlines()) > 500:
            long_files.append(f"{path.relative_to(PKG)}: {len(text.splitlines())}")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80:
                long_functions.append(f"{path.relative_to(PKG)}:{node.lineno} {node.name}")
    assert not long_files and not long_functions, (long_files, long_functions)
