"""What a new user installs is what the tests need: the README's commands, .ci/run and the test extra agree.

.ci/run proves it at run time in a fresh virtual environment; this test says it on any machine, including
one where a package was installed by hand (which would hide a missing install step from a plain run).
"""

from __future__ import annotations

import ast
import re
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]


def readme_commands() -> tuple[str, str]:
    """(the install part of the demo command, the test command) of the README's "Two commands"."""
    section = (REPO / "README.md").read_text(encoding="utf-8").split("## Two commands", 1)[1].split("\n## ", 1)[0]
    demo, tests = re.findall(r"```bash\n(.+?)\n```", section, flags=re.S)
    install, run = demo.rsplit(" && ", 1)
    assert run == "finetune run recipes/demo-cpu.yaml", run
    return install, tests


def test_ci_installs_what_the_readme_installs_and_runs_its_test_command():
    install, tests = readme_commands()
    assert (install, tests) == ('pip install torch==2.13.0 && pip install -e ".[test]"', "python -m pytest -q")
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert f"{install} || exit 1" in ci and tests in ci
    assert 'python3 -m venv "$venv" || exit 1' in ci and 'rm -rf "$venv"' in ci  # a fresh environment each time


def installed_closure(extra: str) -> set[str]:
    """Every distribution `pip install finetune[extra]` brings, as its metadata says (markers evaluated here)."""
    seen: set[str] = set()
    todo = [("finetune", extra)]
    while todo:
        name, wanted = todo.pop()
        if canonicalize_name(name) in seen:
            continue
        seen.add(canonicalize_name(name))
        for line in metadata.requires(name) or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": wanted}):
                todo.append((req.name, ""))
    return seen


def imported_modules(folder: Path) -> dict[str, str]:
    """Top-level modules imported anywhere in folder's .py files (inside functions too) -> the first file that does."""
    found: dict[str, str] = {}
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], str(path.relative_to(REPO)))
    return found


def test_every_package_a_test_imports_comes_with_the_test_extra():
    local = {"finetune", "conftest", "tests"} | {p.stem for p in (REPO / "tests").rglob("*.py")}
    providers = metadata.packages_distributions()
    brought = installed_closure("test")
    missing = []
    for module, where in imported_modules(REPO / "tests").items():
        if module in sys.stdlib_module_names or module in local:
            continue
        dists = {canonicalize_name(d) for d in providers.get(module, [])}
        if not dists & brought:
            missing.append(f"{module} (imported by {where}; installed from: {sorted(dists) or 'nothing'})")
    assert not missing, "not installed by pip install -e '.[test]': " + "; ".join(missing)


def test_the_tests_run_offline_on_an_empty_hugging_face_cache():
    # conftest sets these whatever the shell exported: HF_HUB_OFFLINE=0 must not let a test reach the hub, and a
    # model the machine has cached (a user's Qwen/Qwen2.5-7B) must not change what a test sees.
    import tempfile

    from huggingface_hub import constants

    assert constants.HF_HUB_OFFLINE
    cache = Path(constants.HF_HUB_CACHE)
    assert cache.is_relative_to(tempfile.gettempdir()) and not list(cache.glob("models--*")), cache
