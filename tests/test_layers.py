"""The package's structure, from its source: imports point down the layers docs/design.md draws, scheduler names
stay behind the scheduler boundary, no module grows past its size, and git can track every source file."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import mhf_dist

PACKAGE = Path(mhf_dist.__file__).parent
DESIGN = PACKAGE.parent / "docs" / "design.md"
MAX_LINES = 500
MAX_DOCSTRING = 15
MAX_PAGE_LINES = 400
MIN_KEYWORD_PARAMS = 7


def layers() -> dict[str, int]:
    """``{package or top-level module: layer}`` from design.md's picture, 0 at the bottom."""
    picture = re.search(r"```layers\n(.*?)```", DESIGN.read_text(), re.S)[1].split("\n")
    rows = [row.split() for row in picture if row.strip()]
    return {name: len(rows) - 1 - i for i, row in enumerate(rows) for name in row}


def unit(module: str) -> str:
    """The layer unit of a dotted module name: its subpackage, or the top-level module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports() -> list[tuple[str, int, str]]:
    """Every ``mhf_dist`` import in the package: (file, line, imported module)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found += [
                (str(path.relative_to(PACKAGE.parent)), node.lineno, n)
                for n in names
                if n.startswith("mhf_dist.")
            ]
    return found


def importer(path: str) -> str:
    parts = Path(path).with_suffix("").parts
    return parts[1] if len(parts) > 2 else parts[1].removesuffix(".py")


def test_every_package_is_in_the_layer_picture():
    units = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    units |= {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert units == set(layers()), "docs/design.md's layers and the package's packages differ"


def test_imports_point_down_the_layers():
    layer = layers()
    wrong = [
        f"{path}:{line} imports {name} ({importer(path)} may not import {unit(name)})"
        for path, line, name in imports()
        if importer(path) != unit(name) and layer[unit(name)] >= layer[importer(path)]
    ]
    assert not wrong, "\n".join(wrong)


def test_scheduler_names_live_behind_the_scheduler_boundary():
    names = re.compile(r"sbatch|srun|scontrol|squeue|SLURM_")
    scheduler = PACKAGE / "cluster" / "scheduler"
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{i}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*"))
        if path.is_file()
        and path.suffix in (".py", ".yaml", ".json")
        and not path.is_relative_to(scheduler)
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if names.search(line)
    ]
    assert not found, "\n".join(found)


def test_no_module_is_over_the_size_limit():
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in sorted(PACKAGE.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_module_docstrings_say_what_the_module_holds_in_a_few_lines():
    """The reasoning lives in docs/; a module's docstring says what it holds and where to look."""
    docstrings = {
        p: ast.get_docstring(ast.parse(p.read_text()), clean=False) or ""
        for p in PACKAGE.rglob("*.py")
    }
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p, text in sorted(docstrings.items())
        if (n := len(text.splitlines())) > MAX_DOCSTRING
    }
    assert not long, f"module docstrings over {MAX_DOCSTRING} lines: {long}"


# Signatures torch defines, which a subclass keeps as they are
TORCH_OVERRIDES = {"forward", "backward", "_load_from_state_dict"}


def test_long_signatures_take_their_parameters_by_keyword():
    """A function of seven or more parameters takes at most its first three by position: a call names the rest."""
    found = []
    for p in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if (
                not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                or node.name in TORCH_OVERRIDES
            ):
                continue
            positional = [
                a.arg
                for a in node.args.posonlyargs + node.args.args
                if a.arg not in ("self", "cls")
            ]
            if (
                len(positional) + len(node.args.kwonlyargs) >= MIN_KEYWORD_PARAMS
                and len(positional) > 3
            ):
                where = f"{p.relative_to(PACKAGE.parent)}:{node.lineno}"
                found.append(f"{where} {node.name} ({len(positional)} positional)")
    assert not found, "\n".join(found)


def test_docs_pages_stay_readable_in_one_sitting():
    long = {
        p.name: n
        for p in sorted((PACKAGE.parent / "docs").glob("*.md"))
        if (n := len(p.read_text().splitlines())) > MAX_PAGE_LINES
    }
    assert not long, f"docs pages over {MAX_PAGE_LINES} lines: {long}"


def test_the_code_layout_names_every_module():
    """docs/design.md's code layout lists every module of the package (a package's ``__init__`` is its folder) on
    its package's lines."""
    block = DESIGN.read_text().split("## Code layout\n\n```\n", 1)[1].split("```", 1)[0]
    named: dict[str, str] = {}  # folder -> its lines' text
    folder = ""
    for line in block.splitlines():
        head, text = line[:21].strip(), line[21:]
        if head:
            depth = (len(line) - len(line.lstrip())) // 2
            folder = (
                "/".join(folder.split("/")[:depth] + [head.rstrip("/")])
                if depth
                else head.rstrip("/")
            )
        named[folder] = named.get(folder, "") + " " + text
    missing = []
    for path in sorted(
        p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent == PACKAGE
    ):
        rel = path.relative_to(PACKAGE.parent)
        text = named.get(str(rel.parent), "")
        if not re.search(rf"(?<![\w/]){re.escape(path.name)}", text):
            missing.append(str(rel))
    assert not missing, f"modules missing from docs/design.md's code layout: {missing}"


def test_no_source_file_is_ignored_by_git():
    """A source file that a ``.gitignore`` pattern covers exists only on the machine that wrote it: a clean clone
    (CI, a cluster) would lack it. Every module, test, tool and doc must be one git can track."""
    root = PACKAGE.parent
    if not (root / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    sources = [
        str(p.relative_to(root))
        for folder in ("mhf_dist", "tests", "tools", "docs")
        for p in sorted((root / folder).rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    ]
    assert len(sources) > 100
    ignored = subprocess.run(
        ["git", "-C", str(root), "check-ignore", "--no-index", "--stdin"],
        input="\n".join(sources),
        capture_output=True,
        text=True,
    )
    assert ignored.returncode in (0, 1), ignored.stderr  # 1: nothing ignored
    assert not ignored.stdout.split(), (
        f"source files that .gitignore hides from git: {ignored.stdout.split()}"
    )
