"""DESIGN.md's package graph, enforced by reading the source (`ast`, nothing is imported).

- Each top-level package imports only the vitray packages its row of `MAY_IMPORT` names: `models`
  and `common` import nothing else of vitray, `storage` at most `common`, `data` only `storage`;
  `ray` is imported only under `cluster/`.
  Every import counts, at any depth (module level, inside functions, under `if TYPE_CHECKING`),
  `import x`, `from x import y`, relative imports resolved, and `importlib.import_module("...")`.
  A registry's dotted name (`"vitray.trainers.engines.xla.backend:XlaBackend"`, imported when used) counts
  too: such a by-name edge between packages is allowed only where `BY_NAME` lists it, with why.
- No import cycle between the modules of one package through module-level imports (those run when
  the module is imported), nor through any import at all: an import inside a function defers a
  circle, it does not remove it. A registry that imports its plug-ins while they import it may be
  exempt, by name, in `CYCLE_EXEMPT`; a by-name import does not count.
- Engines (trainers/engines/<name>/) are one folder each behind one seam: no engine's name is
  compared outside its folder, the rest of vitray imports only the seam and the registry, and
  `runfolder` imports nothing of `data`.
- The checker itself is shown to fail on a small synthetic tree (forbidden import, `ray` in
  `models`, a cycle): each report names the file, the line, the import and the rule.

tests/ and benchmarks/ are outside the rule.
"""

from __future__ import annotations

import ast
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# package -> the other vitray packages it may import (None: any). One row per top-level folder.
MAY_IMPORT: dict[str, frozenset[str] | None] = {
    "common": frozenset(),  # small Ray-free helpers shared by all (vitray.common)
    # local and object-storage paths through fsspec: open, read, atomic write, retries, the shard
    # cache, the reachability probe -- below everything that touches a path
    "storage": frozenset({"common"}),
    "models": frozenset(),
    "data": frozenset({"storage"}),
    "configs": frozenset({"common"}),  # recipes (YAML); a config loader living here may use common
    # run folders on storage: checkpoints found and checked, the resume decision, lease, attempts,
    # listing, export -- what the driver and any reader of a checkpoint use, below the worker's loop.
    # Not data: a run folder is files on storage, whatever dataset the run read.
    "runfolder": frozenset({"common", "storage", "models"}),
    # the training loop; it schedules evaluation's evaluators (their config sections are part of a
    # run's config), and evaluation never imports trainers
    "trainers": frozenset({"common", "runfolder", "data", "storage", "models", "evaluation"}),
    "evaluation": frozenset({"common", "runfolder", "data", "storage", "models"}),
    "cluster": frozenset({"common", "configs", "trainers", "evaluation", "runfolder", "data", "storage", "models"}),
    "cli": None,  # the command line (vitray.cli) sits on top of everything
}

# (package, vitray package it reaches by dotted name only) -> why. Such an edge is invisible to
# the import statements, so each one is written down here; an unlisted one fails like an import.
BY_NAME: dict[tuple[str, str], str] = {}  # none today: the engine registries name their own package's modules

# third-party top-level module -> the only packages that may import it.
HOMES: dict[str, frozenset[str]] = {
    "ray": frozenset({"cluster"}),
    "deepspeed": frozenset({"trainers"}),  # distribution code stays away from the model definition
    "torch_xla": frozenset({"trainers"}),
}

# module -> why its import cycle is accepted (a registry and its plug-ins). None today: the source
# registry (data/sources/__init__.py) imports its adapters inside `source_kinds`, and the adapters
# import only the types of data/sources/base.py (see the data rooms below); the one that wraps
# another source is handed the registry's `open_source`.
CYCLE_EXEMPT: dict[str, str] = {}

# The rooms of data/ (a package has no row of its own in MAY_IMPORT; these are rules within it).
# The read side never reaches the write side or the source adapters: a training worker reads shards
# without importing what prepares them.
DATA_READ_SIDE = ("plan", "slots", "reader", "loader", "batch", "shared_memory", "eval_loader", "transforms")
DATA_WRITE_SIDE = ("prepare", "shards", "image_check", "sources")

# Known cycles, each with the issue that removes it: the test of the package is xfail(strict=True),
# so it fails the day the cycle is gone, until its entry is removed. None today: issue #12 step 1
# made the CLI its own sub-package (cli/app.py is imported by the command modules, never the reverse).
KNOWN_CYCLES: dict[str, str] = {}


@dataclass(frozen=True)
class Import:
    file: str  # relative to the root, e.g. "models/vit.py"
    line: int
    text: str  # the statement as written (normalized by ast.unparse)
    target: str  # the module imported, absolute: "vitray.data", "ray.train"
    names: tuple[str, ...]  # for `from target import a, b`: ("a", "b"); () for `import target`
    module_level: bool  # runs when the module is imported (not in a function, not TYPE_CHECKING)
    by_name: bool = False  # a "vitray.pkg.module:attribute" string, imported when used


# "vitray.package.module:attribute": how registries name what they import when it is used.
DOTTED_NAME = re.compile(r"^(vitray(?:\.[A-Za-z_]\w*)+):[A-Za-z_]\w*$")


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["vitray", *parts])


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _dynamic_target(call: ast.Call) -> str | None:
    """The module of `importlib.import_module("a.b")` / `__import__("a.b")`; for an f-string, the
    literal part before its first placeholder ("vitray.evaluation." -> "vitray.evaluation")."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in ("import_module", "__import__") or not call.args:
        return None
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return str(arg.values[0].value).rstrip(".") or None
    return None


def collect_imports(root: Path, path: Path) -> list[Import]:
    """Every import in the file at `path` (a module of the vitray package folder it lies in)."""
    source = path.read_text()
    tree = ast.parse(source, filename=str(path))
    module = module_name(root, path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    file = path.relative_to(root).as_posix()
    found: list[Import] = []

    def visit(node: ast.AST, module_level: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(file, node.lineno, ast.unparse(node), alias.name, (), module_level))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            names = tuple(alias.name for alias in node.names)
            found.append(Import(file, node.lineno, ast.unparse(node), target, names, module_level))
        elif isinstance(node, ast.Call) and (target := _dynamic_target(node)):
            found.append(Import(file, node.lineno, ast.unparse(node), target, (), module_level))
        elif (
            isinstance(node, ast.Constant) and isinstance(node.value, str) and (named := DOTTED_NAME.match(node.value))
        ):
            found.append(Import(file, node.lineno, f"{ast.unparse(node)} (by name)", named[1], (), False, by_name=True))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            module_level = False
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            visit(node.test, module_level)
            for child in node.body:
                visit(child, False)
            for child in node.orelse:
                visit(child, module_level)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, module_level)

    visit(tree, True)
    return found


def package_files(root: Path, package: str) -> list[Path]:
    return sorted((root / package).rglob("*.py"))


def vitray_packages(imp: Import) -> list[str]:
    """The top-level vitray packages an import reaches (`from vitray import models, data`: both)."""
    parts = imp.target.split(".")
    if parts[0] != "vitray":
        return []
    if len(parts) > 1:
        return [parts[1]]
    return list(imp.names) or ["<vitray itself>"]


def rule_text(package: str) -> str:
    allowed = MAY_IMPORT.get(package)
    if allowed is None:
        return f"{package} -> any"
    return f"{package} -> " + (", ".join(sorted(allowed)) if allowed else "nothing of vitray")


def layer_violations(root: Path, packages: list[str], by_name: dict[tuple[str, str], str] | None = None) -> list[str]:
    """One line per import that breaks `MAY_IMPORT` or `HOMES` (by-name edges: unless `BY_NAME` lists
    them), naming file, line, import and rule."""
    by_name = BY_NAME if by_name is None else by_name
    problems = []
    for package in packages:
        allowed = MAY_IMPORT[package]
        for path in package_files(root, package):
            for imp in collect_imports(root, path):
                where = f"{imp.file}:{imp.line}: `{imp.text}`"
                for other in vitray_packages(imp):
                    if other not in MAY_IMPORT:
                        problems.append(f"{where} -- vitray.{other} has no row in the rule table MAY_IMPORT")
                    elif imp.by_name and (package, other) in by_name:
                        continue
                    elif other != package and allowed is not None and other not in allowed:
                        problems.append(f"{where} -- imports vitray.{other}; rule: {rule_text(package)}")
                top = imp.target.split(".")[0]
                if top in HOMES and package not in HOMES[top]:
                    homes = ", ".join(sorted(HOMES[top]))
                    problems.append(f"{where} -- imports {top}; rule: only {homes} imports {top}")
    return problems


def module_exists(root: Path, module: str) -> bool:
    parts = module.split(".")[1:]
    if not parts:
        return False
    return root.joinpath(*parts).with_suffix(".py").is_file() or (root.joinpath(*parts) / "__init__.py").is_file()


def is_extension(root: Path, module: str) -> bool:
    """A compiled module of the tree (its C source is there, no .py)."""
    parts = module.split(".")[1:]
    return bool(parts) and root.joinpath(*parts).with_suffix(".c").is_file()


def import_edges(root: Path, package: str, *, any_depth: bool = False) -> dict[str, dict[str, Import]]:
    """module -> {module of the same package it imports at module level: the first such import}.
    `any_depth`: every import statement counts (in a function, under TYPE_CHECKING too), by-name
    ones not (a registry naming its plug-ins, imported when used)."""
    prefix = f"vitray.{package}"
    edges: dict[str, dict[str, Import]] = {}
    for path in package_files(root, package):
        importer = module_name(root, path)
        edges.setdefault(importer, {})
        for imp in collect_imports(root, path):
            if imp.by_name or not (imp.module_level or any_depth):
                continue
            # `from pkg import sub` reaches the module pkg.sub; `from pkg import name`, pkg itself; a
            # compiled extension (data/_jpeg_region.c) imports nothing of vitray
            submodules = [
                f"{imp.target}.{name}" for name in imp.names if not is_extension(root, f"{imp.target}.{name}")
            ]
            if imp.names and not submodules:
                continue
            targets = [sub if module_exists(root, sub) else imp.target for sub in submodules] or [imp.target]
            for target in targets:
                while target != prefix and not module_exists(root, target) and "." in target:
                    target = target.rpartition(".")[0]  # `import vitray.data.plan.X` reaches plan
                in_package = target == prefix or target.startswith(prefix + ".")
                if in_package and target != importer and module_exists(root, target):
                    edges[importer].setdefault(target, imp)
    return edges


def cycles(root: Path, package: str, exempt: dict[str, str] | None = None, *, any_depth: bool = False) -> list[str]:
    """One line per import cycle among the package's modules (a strongly connected component of the
    module-level imports; `any_depth`: of all its import statements), listing the imports between
    its members, each with file and line."""
    exempt = CYCLE_EXEMPT if exempt is None else exempt
    edges = {
        module: {target: imp for target, imp in targets.items() if target not in exempt}
        for module, targets in import_edges(root, package, any_depth=any_depth).items()
        if module not in exempt
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def connect(module: str) -> None:  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(edges.get(module, {})):
            if target not in index:
                connect(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for module in sorted(edges):
        if module not in index:
            connect(module)

    problems = []
    for component in sorted(components):
        members = set(component)
        chain = "; ".join(
            f"{imp.file}:{imp.line}: `{imp.text}`"
            for module in component
            for target, imp in sorted(edges[module].items())
            if target in members
        )
        names = ", ".join(module.removeprefix(f"vitray.{package}.") for module in component)
        rule = f"rule: no {'' if any_depth else 'module-level '}import cycle within a package"
        problems.append(f"import cycle among vitray.{package}.{{{names}}}: {chain}; {rule}")
    return problems


# -- the vitray tree ----------------------------------------------------------------------------


def present_packages() -> list[str]:
    return [package for package in MAY_IMPORT if (REPO / package / "__init__.py").is_file()]


def test_rule_table_covers_every_package_of_the_distribution() -> None:
    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    folders = {name.removeprefix("vitray."): folder for name, folder in package_dir.items()}
    assert all(name == folder for name, folder in folders.items()), folders
    assert set(folders) <= set(MAY_IMPORT), f"add a MAY_IMPORT row for {sorted(set(folders) - set(MAY_IMPORT))}"
    assert set(folders) == {path.parent.name for path in REPO.glob("*/__init__.py")}
    assert {"models", "storage", "data", "runfolder", "trainers", "evaluation", "cluster"} <= set(present_packages())


def test_packages_import_only_downwards_and_ray_only_in_cluster() -> None:
    assert layer_violations(REPO, present_packages()) == []


@pytest.mark.parametrize(
    "package",
    [
        pytest.param(package, marks=pytest.mark.xfail(strict=True, raises=AssertionError, reason=KNOWN_CYCLES[package]))
        if package in KNOWN_CYCLES
        else package
        for package in present_packages()
    ],
)
def test_no_import_cycle_within_a_package(package: str) -> None:
    assert cycles(REPO, package) == []


@pytest.mark.parametrize("package", present_packages())
def test_no_import_circle_within_a_package_at_any_depth(package: str) -> None:
    """An import inside a function (or under TYPE_CHECKING) hides a circle from the module-level
    check, it does not remove it: backend <-> the engines, config <-> evals and objectives <->
    masked_patch were such circles (issue 39). By-name imports do not count (a registry naming its
    plug-ins, imported when used)."""
    assert cycles(REPO, package, any_depth=True) == []


def test_runfolder_imports_nothing_from_data() -> None:
    """A run folder is files on storage, whatever dataset the run read (issue 39)."""
    assert "data" not in (MAY_IMPORT["runfolder"] or ())
    assert not [
        f"{imp.file}:{imp.line}: `{imp.text}`"
        for path in package_files(REPO, "runfolder")
        for imp in collect_imports(REPO, path)
        if "data" in vitray_packages(imp)
    ]


# -- engines: one folder each, behind one seam ---------------------------------------------------

ENGINES_DIR = Path("trainers") / "engines"
# What of trainers/engines/ the rest of vitray may import: the seam (the backend protocol, the
# Engine description) and the registry (engines by name). An engine's own modules are its own.
ENGINE_SEAM = ("vitray.trainers.engines.seam", "vitray.trainers.engines.registry")


def engine_folders(root: Path) -> dict[str, Path]:
    """Engine name -> its folder (a folder of trainers/engines/ with an engine.py)."""
    return {path.parent.name: path.parent for path in sorted((root / ENGINES_DIR).glob("*/engine.py"))}


def engine_name_comparisons(root: Path, packages: list[str]) -> list[str]:
    """One line per comparison with an engine's name (`backend == "xla"`, `name in ("deepspeed",)`)
    outside that engine's folder: what an engine can do is its Engine's to say."""
    names = set(engine_folders(root))
    found = []
    for package in packages:
        for path in package_files(root, package):
            rel = path.relative_to(root)
            own = rel.parts[2] if rel.parts[:2] == ENGINES_DIR.parts and len(rel.parts) > 3 else None
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if not isinstance(node, ast.Compare):
                    continue
                for operand in (node.left, *node.comparators):
                    items = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
                    hit = {i.value for i in items if isinstance(i, ast.Constant) and i.value in names} - {own}
                    if hit:
                        found.append(
                            f"{rel.as_posix()}:{node.lineno}: `{ast.unparse(node)}` compares engine name(s) {sorted(hit)}"
                        )
    return found


def test_no_engine_name_is_compared_outside_its_engine_folder() -> None:
    assert set(engine_folders(REPO)) >= {"deepspeed", "xla"}
    assert engine_name_comparisons(REPO, present_packages()) == []


def test_engine_name_checker_finds_comparisons(tmp_path: Path) -> None:
    root = write_tree(
        tmp_path,
        {
            "trainers/engines/deepspeed/engine.py": "",
            "trainers/engines/xla/engine.py": "",
            "trainers/engines/xla/backend.py": 'ok = name == "xla"\nbad = name != "deepspeed"\n',
            "trainers/loop.py": 'a = cfg.train.backend == "xla"\nb = kind in ("cpu", "deepspeed")\nc = "xla"\n',
        },
    )
    assert engine_name_comparisons(root, ["trainers"]) == [
        "trainers/engines/xla/backend.py:2: `name != 'deepspeed'` compares engine name(s) ['deepspeed']",
        "trainers/loop.py:1: `cfg.train.backend == 'xla'` compares engine name(s) ['xla']",
        "trainers/loop.py:2: `kind in ('cpu', 'deepspeed')` compares engine name(s) ['deepspeed']",
    ]


def test_each_engine_is_one_folder_and_one_registry_line() -> None:
    """A new engine is a folder of trainers/engines/ (its engine.py describing it) and one line of
    the registry; nothing outside trainers/engines/ imports more of the engines than the seam and
    the registry, and no engine imports another."""
    folders = engine_folders(REPO)
    registered = {
        imp.target.rpartition(".")[2]
        for imp in collect_imports(REPO, REPO / ENGINES_DIR / "registry.py")
        if imp.target.startswith("vitray.trainers.engines.") and imp.names == ("engine",)
    }
    assert registered == set(folders)
    problems = []
    for package in present_packages():
        for path in package_files(REPO, package):
            rel = path.relative_to(REPO)
            inside = rel.parts[:2] == ENGINES_DIR.parts
            own = rel.parts[2] if inside and len(rel.parts) > 3 else None
            for imp in collect_imports(REPO, path):
                reached = [imp.target, *(f"{imp.target}.{name}" for name in imp.names)]
                into = {t.split(".")[3] for t in reached if t.startswith("vitray.trainers.engines.")} & set(folders)
                if not inside and not imp.by_name and into and not imp.target.startswith(ENGINE_SEAM):
                    problems.append(f"{rel}:{imp.line}: `{imp.text}` reaches into an engine's folder")
                if own is not None and into - {own}:
                    problems.append(f"{rel}:{imp.line}: `{imp.text}` imports another engine")
    assert problems == []


def test_source_adapters_import_only_the_shared_types_and_the_registry_imports_them_when_used() -> None:
    sources = REPO / "data" / "sources"
    adapters = sorted(path for path in sources.glob("*.py") if path.stem not in ("__init__", "base"))
    assert {path.stem for path in adapters} >= {"imagefolder", "cifar", "parquet", "hf", "tfds", "vtab", "builtin"}
    for path in adapters:
        for imp in collect_imports(REPO, path):
            if imp.module_level and imp.target.startswith("vitray.data.sources"):
                assert imp.target != "vitray.data.sources", f"{imp.file}:{imp.line}: `{imp.text}` imports the registry"
    registry = collect_imports(REPO, sources / "__init__.py")
    eager = {imp.target for imp in registry if imp.module_level and imp.target.startswith("vitray.")}
    assert eager == {"vitray.data.sources.base"}, eager
    assert {imp.target.rpartition(".")[2] for imp in registry if not imp.module_level} == {
        path.stem for path in adapters if path.stem != "tfrecord"
    }


def test_the_data_read_side_never_imports_the_write_side() -> None:
    write_side = tuple(f"vitray.data.{name}" for name in DATA_WRITE_SIDE)
    for name in DATA_READ_SIDE:
        for imp in collect_imports(REPO, REPO / "data" / f"{name}.py"):
            reached = [imp.target, *(f"{imp.target}.{n}" for n in imp.names)]
            assert not [t for t in reached if t in write_side or t.startswith(tuple(w + "." for w in write_side))], (
                f"{imp.file}:{imp.line}: `{imp.text}` -- the read side imports the write side"
            )


def test_the_scan_sees_the_imports_it_must() -> None:
    """Guards the scan itself against finding nothing: known imports of the tree are collected."""
    imports = collect_imports(REPO, REPO / "data" / "layout.py")
    assert any(imp.target == "vitray" and imp.names == ("storage",) and imp.module_level for imp in imports)
    assert {"data", "runfolder"} <= {
        package
        for package in present_packages()
        for path in package_files(REPO, package)
        for imp in collect_imports(REPO, path)
        if "storage" in vitray_packages(imp)
    }
    ray_users = {
        imp.file
        for path in package_files(REPO, "cluster")
        for imp in collect_imports(REPO, path)
        if imp.target.split(".")[0] == "ray"
    }
    assert ray_users, "no `ray` import found under cluster/"


# -- the checker fails where it must ------------------------------------------------------------


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


# A tiny vitray tree with one of each fault. Line numbers matter: the reports below name them.
SYNTHETIC = {
    "models/__init__.py": "from .vit import ViT\n",
    "models/vit.py": """\
import torch

from vitray.trainers.loop import TrainingLoop
""",
    "models/io.py": """\
def load():
    import ray.train
    from vitray import data, models
""",
    "models/registry.py": 'PLUGINS = {"loop": "vitray.trainers.loop:TrainingLoop"}\n',
    "models/sub/__init__.py": "",
    "models/sub/deep.py": """\
from ...trainers import config
from .. import vit
""",
    "data/__init__.py": "",
    "data/a.py": "from . import b\n",
    "data/b.py": """\
import os
from typing import TYPE_CHECKING
from vitray.data.c import X
if TYPE_CHECKING:
    from .d import Y
""",
    "data/c.py": """\
def f():
    from vitray.data import a
from .a import Z
""",
    "data/d.py": "from .b import B\n",
    "data/e.py": """\
def f():
    from . import e_helper
""",
    "data/e_helper.py": "from .e import E\n",
    "trainers/__init__.py": "",
    "trainers/loop.py": """\
from vitray.data import a
from vitray.models import vit
from vitray.cluster.runtime import connect
from vitray.nowhere import thing
""",
    "data/plugins.py": 'SINKS = {"tb": "vitray.trainers.trackers:TensorBoard", "x": "vitray.data:x y"}\n',
    "cluster/__init__.py": "",
    "cluster/run.py": """\
import importlib
import ray
from vitray.trainers import loop
importlib.import_module("deepspeed.ops")
""",
}


def test_checker_reports_each_forbidden_import_with_file_line_import_and_rule(tmp_path: Path) -> None:
    root = write_tree(tmp_path, SYNTHETIC)
    problems = layer_violations(root, ["models", "data", "trainers", "cluster"])
    assert problems == [
        "models/io.py:2: `import ray.train` -- imports ray; rule: only cluster imports ray",
        "models/io.py:3: `from vitray import data, models` -- imports vitray.data; rule: models -> nothing of vitray",
        "models/registry.py:1: `'vitray.trainers.loop:TrainingLoop' (by name)` -- imports vitray.trainers; rule: models -> nothing of vitray",
        "models/sub/deep.py:1: `from ...trainers import config` -- imports vitray.trainers; rule: models -> nothing of vitray",
        "models/vit.py:3: `from vitray.trainers.loop import TrainingLoop` -- imports vitray.trainers; rule: models -> nothing of vitray",
        "data/plugins.py:1: `'vitray.trainers.trackers:TensorBoard' (by name)` -- imports vitray.trainers; rule: data -> storage",
        "trainers/loop.py:3: `from vitray.cluster.runtime import connect` -- imports vitray.cluster; rule: trainers -> common, data, evaluation, models, runfolder, storage",
        "trainers/loop.py:4: `from vitray.nowhere import thing` -- vitray.nowhere has no row in the rule table MAY_IMPORT",
        "cluster/run.py:4: `importlib.import_module('deepspeed.ops')` -- imports deepspeed; rule: only trainers imports deepspeed",
    ]


def test_checker_reports_a_module_level_cycle_as_its_chain_of_imports(tmp_path: Path) -> None:
    root = write_tree(tmp_path, SYNTHETIC)
    # a -> b -> c -> a at module level. Not cycles: d -> b (b imports d only under TYPE_CHECKING),
    # e <-> e_helper (e imports e_helper inside a function), c -> a inside f (a duplicate edge).
    assert cycles(root, "data", exempt={}) == [
        "import cycle among vitray.data.{a, b, c}: "
        "data/a.py:1: `from . import b`; data/b.py:3: `from vitray.data.c import X`; data/c.py:3: `from .a import Z`; "
        "rule: no module-level import cycle within a package"
    ]
    assert cycles(root, "models", exempt={}) == []  # sub.deep -> vit is one way
    # At any depth, the imports under TYPE_CHECKING and inside functions close two more circles.
    assert cycles(root, "data", exempt={}, any_depth=True) == [
        "import cycle among vitray.data.{a, b, c, d}: data/a.py:1: `from . import b`; data/b.py:3: "
        "`from vitray.data.c import X`; data/b.py:5: `from .d import Y`; data/c.py:2: `from vitray.data import a`; "
        "data/d.py:1: `from .b import B`; rule: no import cycle within a package",
        "import cycle among vitray.data.{e, e_helper}: data/e.py:2: `from . import e_helper`; "
        "data/e_helper.py:1: `from .e import E`; rule: no import cycle within a package",
    ]


def test_checker_cycle_exemption_is_by_module_name(tmp_path: Path) -> None:
    root = write_tree(tmp_path, SYNTHETIC)
    assert cycles(root, "data", exempt={"vitray.data.b": "a registry"}) == []
    assert len(cycles(root, "data", exempt={"vitray.data.d": "a registry"})) == 1


def test_checker_allows_a_by_name_edge_only_where_by_name_lists_it(tmp_path: Path) -> None:
    root = write_tree(tmp_path, SYNTHETIC)
    # data/plugins.py names a module of trainers: allowed by a BY_NAME row (data, trainers), refused
    # without it. ("vitray.data:x y" is no dotted name: not an import.)
    listed = {("data", "trainers"): "why"}
    assert not [p for p in layer_violations(root, ["data"], by_name=listed) if "plugins.py" in p]
    assert [p for p in layer_violations(root, ["data"], by_name={}) if "plugins.py" in p] == [
        "data/plugins.py:1: `'vitray.trainers.trackers:TensorBoard' (by name)` -- imports vitray.trainers; "
        "rule: data -> storage"
    ]


def test_by_name_edges_between_packages_are_the_listed_ones() -> None:
    """Every by-name edge between two packages of the tree is one BY_NAME explains, and one BY_NAME
    lists that the tree no longer has is noticed."""
    edges = {
        (package, other)
        for package in present_packages()
        for path in package_files(REPO, package)
        for imp in collect_imports(REPO, path)
        if imp.by_name
        for other in vitray_packages(imp)
        if other != package
    }
    assert edges == set(BY_NAME)


# -- transfer evaluation has one home -----------------------------------------------------------

# What evaluates -> the one module of the packages that uses it (issue #25: the top-1 loop was
# written twice, the few-shot probe started from three places). The training loop, the CLI and
# the grid's Ray tasks reach these modules, never the pieces they are made of.
EVALUATES: dict[str, str] = {
    "top1_hits": "evaluation/top1.py",  # the top-1 count (vitray.data's per-batch hits)
    "sample_few_shot": "evaluation/fewshot_probe.py",  # a few-shot set drawn ...
    "score_few_shot_set": "evaluation/fewshot_probe.py",  # ... and solved
    "FinetuneRecipe": "cluster/finetune.py",  # the typed recipe, made a TrainingConfig once
}


def test_what_evaluates_is_used_by_one_module() -> None:
    users: dict[str, set[str]] = {name: set() for name in EVALUATES}
    for package in present_packages():
        for path in package_files(REPO, package):
            if path.name == "__init__.py":  # a package's public names, re-exported
                continue
            for imp in collect_imports(REPO, path):
                for name in set(imp.names) & set(EVALUATES):
                    users[name].add(imp.file)
    assert users == {name: {home} for name, home in EVALUATES.items()}


def test_no_two_rooms_share_a_module_name_for_transfer_evaluation() -> None:
    """Three `transfer.py` (cli/, cluster/, evaluation/) were one concern in three rooms; the CLI's
    command group keeps the name, the rooms below say what they hold."""
    assert sorted(path.parent.name for path in REPO.glob("*/transfer.py")) == ["cli"]
    rooms = [room for room in ("cluster", "evaluation", "runfolder") if (REPO / room).is_dir()]
    names = [path.stem for room in rooms for path in (REPO / room).glob("*.py") if path.stem != "__init__"]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


# The rooms one concern crosses (a checkpoint: written on a worker, read by the driver; inspection:
# computed, drawn, run on a checkpoint); within any one package every module counts.
CONCERN_ROOMS = ("trainers", "runfolder", "evaluation", "cluster")


def alike_module_names(root: Path) -> list[str]:
    """Modules whose names are one word with another ending (`checkpoint`, `checkpoints`,
    `checkpointer`): in one folder, or across `CONCERN_ROOMS`."""

    def word(stem: str) -> str:
        return re.sub(r"(ions?|ers?|ing|s)$", "", stem)

    modules = [path for package in MAY_IMPORT for path in package_files(root, package) if path.stem != "__init__"]
    found = []
    for a, b in ((a, b) for i, a in enumerate(modules) for b in modules[i + 1 :]):
        rooms = {path.relative_to(root).parts[0] for path in (a, b)}
        crossing = a.parent == b.parent or rooms <= set(CONCERN_ROOMS)
        if crossing and a.stem != b.stem and word(a.stem) == word(b.stem):
            found.append(" ~ ".join(sorted(str(path.relative_to(root)) for path in (a, b))))
    return sorted(found)


def test_module_names_tell_apart_what_they_hold(tmp_path: Path) -> None:
    """`trainers/checkpoint.py`, `trainers/checkpointer.py` and `runfolder/checkpoints.py`, and
    `evaluation/inspect.py` beside `inspection.py`, said nothing of which held what (issue 39): a
    module is not named as another with only its ending changed."""
    assert alike_module_names(REPO) == []
    old = write_tree(
        tmp_path,
        {f"{name}.py": "" for name in ("trainers/checkpoint", "trainers/checkpointer", "runfolder/checkpoints")}
        | {"evaluation/inspect.py": "", "evaluation/inspection.py": "", "data/loader.py": "", "models/loading.py": ""},
    )
    assert alike_module_names(old) == [
        "evaluation/inspect.py ~ evaluation/inspection.py",
        "runfolder/checkpoints.py ~ trainers/checkpoint.py",
        "runfolder/checkpoints.py ~ trainers/checkpointer.py",
        "trainers/checkpoint.py ~ trainers/checkpointer.py",
    ]


def test_every_by_name_import_names_a_module_that_exists() -> None:
    named = [
        imp
        for package in present_packages()
        for path in package_files(REPO, package)
        for imp in collect_imports(REPO, path)
        if imp.by_name
    ]
    assert named, "no by-name import found (the engine registries name their backends)"
    assert [f"{imp.file}:{imp.line}: {imp.text}" for imp in named if not module_exists(REPO, imp.target)] == []


def test_the_driver_does_not_import_torchvision_or_deepspeed() -> None:
    """A `vitray pretrain` driver loads the config and starts Ray; torchvision (through
    torch._dynamo ~1.4 s of CPU) and DeepSpeed (~3 s) belong to the workers. Every run and every
    test's run starts a driver, so what it imports for nothing is paid again and again."""
    imports = "vitray.cli.main, vitray.cluster.pretrain, vitray.cluster.finetune, vitray.cluster.evaluate"
    assert _loaded_after(imports, ("torchvision", "deepspeed", "mlflow")) == []


def test_the_training_workers_modules_do_not_import_torchvision() -> None:
    """Every Ray Train worker of every run imports the training loop. torchvision's import takes its
    models and ops along (~0.3 CPU-s a process after torch._dynamo, which torch.optim imports
    anyway; ~1.5 s before it); only device decoding uses it, and imports it where it does
    (`vitray.data.transforms`). The val evaluator's transform, which every worker runs on its share
    of the split, is PIL's alone."""
    transform = "vitray.data.transforms.eval_transform(16)(PIL.Image.new('RGB', (40, 30)))"
    assert (
        _loaded_after("PIL.Image, vitray.cluster.train_worker, vitray.trainers.loop", ("torchvision",), transform) == []
    )


def test_the_drivers_model_check_does_not_import_torch_dynamo() -> None:
    """The driver builds the model on the meta device to check it (`vitray pretrain`, `--dry-run`,
    `vitray evaluate`). Initialising meta tensors ran torch's Python reference kernels, which import
    torch._dynamo and sympy: ~0.7 CPU-s for values a meta tensor does not hold."""
    check = "preflight.check_model(models.ModelConfig(name='R50+B/16', img_size=224, representation_size=768), 1000)"
    assert (
        _loaded_after(
            "vitray.models as models, vitray.trainers.driver_checks.preflight as preflight",
            ("torch._dynamo",),
            then=check,
        )
        == []
    )


def _loaded_after(imports: str, watched: tuple[str, ...], then: str = "pass") -> list[str]:
    """Which of the `watched` modules a fresh Python process has loaded after `import <imports>`
    (and the statement `then`)."""
    import subprocess
    import sys

    script = f"import sys, {imports}; {then}; print('loaded', *sorted(m for m in {watched!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[0] == "loaded", out.stdout
    return out.stdout.split()[1:]
