"""The README and docs/ against the code they describe.

- docs/configuration.md is what `vitray.cli.config_reference` renders from the config models now
  (regenerate it with `make docs` when a config model changes).
- The README's model table is what `vitray.cli.model_table` computes.
- Every relative link of the README and of docs/*.md resolves: the file exists, and so does the
  heading an `#anchor` names.
- Every `vitray` command line in their ```bash blocks parses with the CLI as written: the command
  exists and its options are real (tests/test_deploy.py also runs those of docs/deploy.md with
  --dry-run).
"""

from __future__ import annotations

import difflib
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
REGENERATE = "make docs (or: python -m vitray.cli.config_reference > docs/configuration.md)"

_FENCED = re.compile(r"^```.*?^```", flags=re.S | re.M)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose(markdown: str) -> str:
    """The Markdown without its fenced code blocks."""
    return _FENCED.sub("", markdown)


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors of the headings: lower case, punctuation dropped, spaces to '-', repeats
    numbered (-1, -2, ...)."""
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", prose(markdown), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in found:
            n += 1
            candidate = f"{slug}-{n}"
        found.add(candidate)
    return found


def relative_links(page: Path) -> list[str]:
    return [t for t in _LINK.findall(prose(page.read_text())) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def bash_lines(page: Path) -> list[str]:
    """The command lines of the page's ```bash blocks, continuations joined, comments dropped."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                lines.append(line.strip())
    return lines


def vitray_args(line: str) -> list[str] | None:
    """The arguments of `vitray ARGS` or of `... -- vitray ARGS` (ray job submit); None otherwise."""
    words = shlex.split(line, comments=True)
    if words and words[-1] == "&":
        words = words[:-1]
    if words[:1] == ["vitray"]:
        return words[1:]
    if "--" in words and words[words.index("--") + 1 : words.index("--") + 2] == ["vitray"]:
        return words[words.index("--") + 2 :]
    return None


def command_lines() -> list[tuple[str, list[str]]]:
    return [
        (f"{page.relative_to(REPO)}: {line}", args)
        for page in PAGES
        for line in bash_lines(page)
        if (args := vitray_args(line)) is not None
    ]


def parse_with_the_cli(args: list[str]) -> None:
    """The CLI's parse of `args`, up to running the command: an unknown command or option, a missing
    argument or a badly typed value raises the CLI's UsageError."""
    import typer

    from vitray.cli.main import app

    command, name, rest, parent = typer.main.get_command(app), "vitray", list(args), None
    while hasattr(command, "get_command"):  # a group (`vitray`, `vitray data`): pick its command
        parent = command.context_class(command, info_name=name, parent=parent)
        assert rest, f"{name} needs a command"
        name, command, rest = command.resolve_command(parent, rest)
    command.make_context(name, rest, parent=parent)


# -- generated parts -----------------------------------------------------------------------------
def test_the_configuration_reference_is_what_the_config_models_generate():
    from vitray.cli.config_reference import render

    path = DOCS / "configuration.md"
    expected = render()
    written = path.read_text() if path.exists() else ""
    if written != expected:
        diff = difflib.unified_diff(
            written.splitlines(), expected.splitlines(), "docs/configuration.md", "generated now", lineterm="", n=1
        )
        shown = "\n".join(list(diff)[:40])
        pytest.fail(f"docs/configuration.md is out of date with the config models: run {REGENERATE}\n{shown}")


def test_the_configuration_reference_covers_every_key():
    from vitray.evaluation.config import GridConfig
    from vitray.trainers.config import TrainingConfig

    text = (DOCS / "configuration.md").read_text()

    def keys(model, prefix=""):
        for name, field in model.model_fields.items():
            yield f"{prefix}{name}"
            annotation = field.annotation
            nested = [a for a in getattr(annotation, "__args__", (annotation,)) if hasattr(a, "model_fields")]
            for sub in nested:
                yield from keys(sub, f"{prefix}{name}.")

    missing = [k for model in (TrainingConfig, GridConfig) for k in keys(model) if f"| `{k}` |" not in text]
    assert not missing, f"not in docs/configuration.md: {missing}"


def test_the_readme_model_table_is_computed_from_the_code():
    from vitray.cli.model_table import render

    table = render()
    assert table in README.read_text(), (
        "the README's model table differs from `python -m vitray.cli.model_table`; paste its output:\n" + table
    )


# -- links and commands --------------------------------------------------------------------------
def test_the_readme_is_one_page_that_links_every_docs_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: reference material belongs in docs/"
    linked = {Path(t.split("#")[0]) for t in relative_links(README)}
    unlinked = [p.name for p in DOCS.glob("*.md") if p.relative_to(REPO) not in linked]
    assert not unlinked, f"README.md links no docs/{unlinked}"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_relative_link_resolves(page):
    broken = []
    for target in relative_links(page):
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists():
            broken.append(f"{target}: no file {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {path.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: broken links:\n" + "\n".join(broken)


def test_the_readme_and_docs_show_command_lines():
    where = {w.split(":")[0] for w, _ in command_lines()}
    assert {"README.md", "docs/data.md", "docs/evaluation.md", "docs/deploy.md"} <= where


@pytest.mark.parametrize("where, args", command_lines(), ids=[w for w, _ in command_lines()])
def test_every_vitray_command_line_parses_as_written(where, args):
    parse_with_the_cli(args)
    if args[0] == "submit":
        parse_with_the_cli(args[args.index("--") + 1 :])


def test_the_anchor_rule_numbers_repeated_headings():
    assert anchors("# A b\n## `x.y` (z)\n## A b\n```bash\n# not a heading\n```\n") == {"a-b", "xy-z", "a-b-1"}


def test_vitray_help_lists_every_command_once_in_the_order_of_the_work():
    from typer.testing import CliRunner

    from vitray.cli.main import HELP_PANELS, app

    shown = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"}).output
    registered = {c.name or c.callback.__name__ for c in app.registered_commands} | {
        g.name for g in app.registered_groups
    }
    listed = [name for names in HELP_PANELS.values() for name in names]
    assert sorted(listed) == sorted(registered)  # every command in a panel, once
    # the panels and, within each, the commands, top to bottom as HELP_PANELS has them
    places = [shown.index(title) for title in HELP_PANELS]
    assert places == sorted(places), shown
    for title, names in HELP_PANELS.items():
        panel = shown[shown.index(title) :].split("╰")[0]
        assert re.findall(r"^│ (\S+)", panel, flags=re.M) == names, panel  # (a wrapped line starts blank)
