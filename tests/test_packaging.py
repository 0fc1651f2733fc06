"""What `pip install vitray` (a wheel, not the editable install the tests and `make` use) holds,
read from pyproject.toml the way setuptools reads it: every folder of Python modules or recipes
under the package folders is a declared package, and every recipe is package data. The editable
install maps whole folders, so a sub-package left out of the list imports here and fails only from
a wheel (the evaluators and methods did: `vitray pretrain` stopped at its first import there)."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def folders_with(suffixes: tuple[str, ...]) -> dict[str, Path]:
    """Package name -> folder, for every folder under pyproject's package folders that holds a file
    with one of `suffixes`."""
    found = {}
    for name, folder in SETUPTOOLS["package-dir"].items():
        root = REPO / folder
        for path in root.rglob("*"):
            if path.is_file() and path.suffix in suffixes and "__pycache__" not in path.parts:
                relative = path.parent.relative_to(root).parts
                found[".".join((name, *relative))] = path.parent
    return found


def test_every_folder_of_modules_or_recipes_is_a_declared_package():
    declared = set(SETUPTOOLS["packages"])
    wanted = folders_with((".py", ".yaml"))
    assert sorted(set(wanted) - declared) == [], "add these to [tool.setuptools] packages in pyproject.toml"
    assert sorted(declared - set(wanted)) == [], "these declared packages hold no module or recipe"


def test_every_recipe_is_package_data():
    data = SETUPTOOLS["package-data"]
    for package, folder in folders_with((".yaml",)).items():
        for recipe in folder.glob("*.yaml"):
            globs = data.get(package, [])
            assert any(fnmatch.fnmatch(recipe.name, g) for g in globs), f"{recipe}: no package-data glob of {package}"
