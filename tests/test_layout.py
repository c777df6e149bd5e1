"""The data flow of docs/design.md, enforced: no module imports one that stands later."""

from __future__ import annotations

import ast
from pathlib import Path

import finetune

# The floors of docs/design.md, top to bottom: a folder (or a helper module) imports only those above it.
ORDER = [
    "errors",  # the helpers every floor may use
    "hardware",
    "gpus",
    "metrics",
    "adapters",  # adapter methods: peft arguments and rules
    "declarations",  # what config asks, with no model code: techniques, objectives, strategies, splits, their rules
    "config",  # the recipe, read and checked
    "data",  # records -> tokens and masks
    "model",  # the base model loaded, quantized, adapted
    "memory",  # where a step's bytes wait
    "plan",  # memory and speed before loading
    "parallel",  # how a run spreads over processes: one room per strategy
    "runs",  # a run's directory: checkpoints, resume, evaluate, open
    "export",  # a run turned into something else: adapter, merged model, GGUF
    "objectives",  # what a step minimises
    "trainer",  # the loop
    "cli",  # imports them all
]
PKG = Path(finetune.__file__).parent
HELPERS = {"errors", "hardware", "gpus", "metrics"}  # design: errors and at most three shared helpers


def unit_of(dotted: str) -> str:
    """The ORDER entry a module belongs to: finetune.memory.stream -> memory, finetune.errors -> errors."""
    return dotted.split(".")[1]


def imported_modules(path: Path) -> set[str]:
    """Every finetune module a file imports, dotted (`from finetune.declarations import techniques` -> finetune.declarations.techniques)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "finetune":
            base = PKG.parent / node.module.replace(".", "/")
            for alias in node.names:  # a submodule imported by name, or a name the module defines
                is_module = (base / f"{alias.name}.py").exists() or (base / alias.name).is_dir()
                found.add(f"{node.module}.{alias.name}" if is_module else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("finetune."))
    return found - {"finetune"}


def code_files() -> dict[str, Path]:
    files = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(PKG).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts and parts[0] not in ("assets", "__main__"):
            files["finetune." + ".".join(parts)] = path
    return files


def test_every_module_is_placed():
    top = {p.stem for p in PKG.glob("*.py")} - {"__init__", "__main__"}
    assert top == HELPERS, f"the top of finetune/ holds {sorted(top)}: errors and at most three shared helpers"
    folders = {p.parent.name for p in PKG.glob("*/__init__.py")} - {"assets"}  # assets: files, no code
    assert {unit_of(m) for m in code_files()} <= set(ORDER), "add the new folder to ORDER"
    assert folders | top == {u.split(".")[0] for u in ORDER}, "ORDER names a folder that is gone"


def test_imports_flow_one_way():
    for module, path in code_files().items():
        unit = unit_of(module)
        later = set(ORDER[ORDER.index(unit) + 1 :])
        for imported in imported_modules(path):
            assert unit_of(imported) not in later, (
                f"{module} imports {imported}, which stands below it (tests/test_layout.py ORDER)"
            )


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each circle of imports found by a depth-first walk (a module that imports, through others, itself)."""
    circles, state = [], dict[str, int]()  # 1: on the current path, 2: done

    def walk(module: str, path: list[str]) -> None:
        state[module] = 1
        for imported in sorted(graph.get(module, ())):
            if state.get(imported) == 1:
                circles.append(path[path.index(imported) :] + [imported])
            elif imported not in state:
                walk(imported, [*path, imported])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])
    return circles


def test_no_import_circle_inside_a_folder():
    """Folders stand in ORDER; inside one, its modules import one another in one direction (any order without a
    circle: an idea that needs another stands after it)."""
    graph = {
        m: {i for i in imported_modules(p) if i in code_files() and unit_of(i) == unit_of(m) and i != m}
        for m, p in code_files().items()
    }
    assert import_circles(graph) == []
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]  # the check sees one


STRATEGY_NAMES = {"single", "ddp", "fsdp", "deepspeed", "zero2", "zero3", "pipeline", "tensor", "context"}
# Each strategy's room (finetune/parallel/): the only modules that may compare its names.
ROOM_NAMES = {
    "parallel.ddp": {"ddp"},
    "parallel.fsdp": {"fsdp"},
    "parallel.zero": {"deepspeed", "zero2", "zero3"},
    "parallel.pipeline": {"pipeline"},
    "parallel.tensor": {"tensor"},
    "parallel.context": {"context"},
}
FLAGS = STRATEGY_NAMES | {"zero"}  # `parallel.pipeline is None`, `room.fsdp`: a branch on which strategy runs


def strategy_name_comparisons(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of each comparison with a strategy's name (== "fsdp", in ("fsdp", "zero3"), a match case,
    .startswith("zero")) and each flag read off the Parallel object or a room (parallel.pipeline, room.fsdp)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                values = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
                found += [(node.lineno, v.value) for v in values if isinstance(v, ast.Constant) and v.value in STRATEGY_NAMES]
        elif isinstance(node, ast.MatchValue) and isinstance(node.value, ast.Constant) and node.value.value in STRATEGY_NAMES:
            found.append((node.lineno, node.value.value))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "startswith":
            found += [(node.lineno, "zero") for a in node.args if isinstance(a, ast.Constant) and a.value == "zero"]
        elif isinstance(node, ast.Attribute) and node.attr in FLAGS:
            owner = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", None)
            if owner in ("parallel", "room"):
                found.append((node.lineno, node.attr))
    return found


def test_no_strategy_name_is_compared_outside_its_own_room():
    """Every other module asks a strategy's declaration (declarations/strategies.py, splits.py) or the Parallel object,
    which hands each question to the room that runs (parallel/room.py)."""
    offenders = [
        f"{path.relative_to(PKG)}:{line} ({name})"
        for module, path in code_files().items()
        for line, name in strategy_name_comparisons(ast.parse(path.read_text()))
        if name not in ROOM_NAMES.get(module.removeprefix("finetune."), set())
    ]
    assert not offenders, f"strategy names compared outside their room: {offenders}"
    probe = ast.parse(
        'if cfg.distributed.strategy == "fsdp" or s.sharding in ("ddp",) or x.startswith("zero") or p.strategy != "tensor"'
        " or self.parallel.pipeline is None or parallel.context or self.room.fsdp: pass\n"
        'match kind:\n    case "pipeline": pass'
    )
    assert len(strategy_name_comparisons(probe)) == 8  # the check sees each form it forbids
    assert strategy_name_comparisons(ast.parse('if room == "ddp": pass'))  # in parallel/ too, outside ddp.py


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
