"""The one config loader: YAML file + `--set dotted.key=value` overrides -> a validated pydantic model.

Every error names the key, the bad value and what is allowed, and a typo'd key suggests the
closest valid one -- all before anything heavy (Ray, DeepSpeed) starts. A problem is blamed on
where its value came from: the `--set` override that gave it, else the YAML file.
"""

from __future__ import annotations

import copy
import difflib
import re
import types
import typing
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from vitray.common.redact import redact_at, redact_text, redacted_config

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A config that cannot be used; the message lists every problem found."""


class OptionValue(str):
    """A `key=value` override that one of a command's own options gave (`fewshot.l2_reg=-5` from
    `--l2 -5`): an error about it names the option as typed, not a `--set` nobody wrote."""

    given_as: str

    def __new__(cls, text: str, given_as: str) -> OptionValue:
        value = super().__new__(cls, text)
        value.given_as = given_as
        return value


# Said when a command needs sections that no file gave (the defaults alone do not make a config).
def no_config(schema: type[BaseModel]) -> str:
    """The refusal of a command run without the config it needs, pointing at an example of its kind."""
    example = getattr(schema, "EXAMPLE_CONFIG", "configs/demo.yaml")
    return f"no config given: pass -c FILE.yaml (see configs/, e.g. {example})"


def load_config(
    schema: type[M], path: str | Path | None = None, overrides: Sequence[str] = (), *, flag: str = "--set"
) -> M:
    """A YAML file (or nothing: the defaults) + `key=value` overrides, validated as `schema`.
    ``flag`` is the option the overrides came from, as errors name them (the demo's `--grid-set`)."""
    path = config_file(path) if path is not None else None
    raw = _read_yaml(path) if path is not None else {}
    return validate_config(schema, raw, overrides, source=str(path) if path else None, flag=flag)


def packaged_config(name: str) -> Path:
    """One of the recipes installed with vitray (`configs/` in a checkout): `paper/fewshot.yaml`."""
    return Path(str(resources.files("vitray.configs").joinpath(name)))


def _as_recipe(path: Path) -> str | None:
    """The recipe a relative `configs/...` path names (`paper/fewshot.yaml`; `configs` itself: ""), else None."""
    if path.is_absolute() or path.parts[:1] != ("configs",):
        return None
    return "/".join(path.parts[1:])


def config_file(path: str | Path) -> Path:
    """`path`; or, where it names one of vitray's own recipes as the docs write them
    (`configs/paper/pretrain_b16_i21k.yaml`) and no such file is here, that recipe as installed with
    vitray: outside a checkout (vitray installed from a wheel) the docs' commands work as written."""
    path = Path(path)
    recipe = None if path.exists() else _as_recipe(path)
    if recipe is None:
        return path
    packaged = packaged_config(recipe)
    return packaged if packaged.is_file() else path


def validate_config(
    schema: type[M],
    raw: Mapping[str, Any],
    overrides: Mapping[str, Any] | Sequence[str] = (),
    *,
    source: str | None,
    flag: str = "--set",
) -> M:
    """A config as a dict + dotted overrides (a mapping, or `key=value` strings as from `--set`).
    ``source`` names where ``raw`` came from (a file; None: no file at all)."""
    data = copy.deepcopy(dict(raw))
    origins: dict[str, str] = {}  # dotted key -> the override that set it, as the user wrote it
    if isinstance(overrides, Mapping):
        items = list(overrides.items())
        origins = {key: f"override {key}={redact_at(key.split('.'), value)!r}" for key, value in items}
    else:
        items = [_parse_override(text, flag) for text in overrides]
        origins = {
            key: redact_text(text.given_as)
            if isinstance(text, OptionValue)
            else f"{flag} {_shown_override(key, value, text)}"
            for (key, value), text in zip(items, overrides)
        }
    for key, value in items:
        _set_dotted(data, key, value, flag)
    blame = _Blame(source, origins)
    _refuse_moved_keys(schema, data, blame)
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_describe(err, schema, blame, data)) from None


# A dotted config key inside a validator's message ("train.batch_size=100 must be ...").
_DOTTED_KEY = re.compile(r"(?<![\w.])[a-z_]+(?:\.[a-z_]+)+(?![\w])")


def _shown_override(key: str, value: Any, text: str) -> str:
    """An override as the user wrote it, unless that shows a secret (a credential key, a value
    of a secret environment variable): then with its value masked."""
    masked = redact_at(key.split("."), value)
    return text.strip() if masked == value else f"{key}={masked}"


class _Blame:
    """Where a problem's value came from: the override that set its key (or a section above or
    below it), else the file. A rule across keys (a validator of a whole section) is blamed on
    every place that gave a key its message names."""

    def __init__(self, source: str | None, origins: Mapping[str, str]) -> None:
        self.source, self.origins = source, dict(origins)
        self.file = source or "no -c file"

    def of(self, key: str, message: str = "") -> list[str]:
        keys = [key] if key else _DOTTED_KEY.findall(message) or [""]
        return [self._origin(k) for k in keys]

    def _origin(self, key: str) -> str:
        for dotted, origin in self.origins.items():
            if key and (key == dotted or key.startswith(dotted + ".") or dotted.startswith(key + ".")):
                return origin
        return self.file

    def header(self, blamed: Sequence[Sequence[str]]) -> str:
        """ "invalid config (FILE, --set a=1):" naming every place a listed problem came from."""
        places = list(dict.fromkeys(place for places in blamed for place in places))
        if len(places) > 1 and self.file in places:  # the file first, then the overrides in order
            places.remove(self.file)
            places.insert(0, self.file)
        return f"invalid config ({', '.join(places)}):"


def _refuse_moved_keys(schema: type[BaseModel], data: Mapping[str, Any], blame: _Blame) -> None:
    """Keys the schema has moved (its `MOVED_KEYS`: old dotted key -> hint) fail with the hint."""
    found, blamed = [], []
    for dotted, hint in getattr(schema, "MOVED_KEYS", {}).items():
        node: Any = data
        for part in dotted.split("."):
            node = node.get(part, _MISSING) if isinstance(node, Mapping) else _MISSING
        if node is not _MISSING:
            found.append(f"  {dotted}: {hint}")
            blamed.append(blame.of(dotted))
    if found:
        raise ConfigError("\n".join([blame.header(blamed), *found]))


_MISSING = object()


def _recipes_beside(path: Path) -> str:
    """For a missing `configs/...` file: the recipes vitray has in that folder (a mistyped name)."""
    recipe = _as_recipe(path)
    if recipe is None:
        return ""
    folder = packaged_config(str(Path(recipe).parent))
    names = sorted(p.name for p in folder.glob("*.yaml")) if folder.is_dir() else []
    return f"; vitray's recipes in {path.parent}/: {', '.join(names)}" if names else ""


class _KeyGivenTwice(yaml.YAMLError):
    pass


class _UniqueKeysLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping: YAML's rule, which PyYAML
    does not enforce (the later value wins), so a second `optim:` section reset the first's values
    to their defaults without a word."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise _KeyGivenTwice(
                    f"{key!r} is given twice (lines {seen[key].start_mark.line + 1} and "
                    f"{key_node.start_mark.line + 1}): YAML keeps only the second, whole; merge them into one"
                )
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist{_recipes_beside(path)}")
    if not path.is_file():
        raise ConfigError(f"config file {path} is not a file: pass -c FILE.yaml")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeysLoader)  # (a safe loader)
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not text (not UTF-8): pass -c FILE.yaml") from None
    except _KeyGivenTwice as err:
        raise ConfigError(f"config file {path}: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(data).__name__}")
    return data


def _parse_override(override: str, flag: str = "--set") -> tuple[str, Any]:
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key:
        example = "finetune.steps=50" if flag == "--grid-set" else "train.steps=100"
        raise ConfigError(f"{flag} {override!r}: expected dotted.key=value, e.g. {flag} {example}")
    # YAML typing: 100 -> int, 1e-3 -> float, true -> bool, null -> None, [1, 2] -> list.
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    return key, value


def _set_dotted(raw: dict[str, Any], dotted: str, value: Any, flag: str = "--set") -> None:
    parts = dotted.split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            prefix = ".".join(parts[: i + 1])
            shown = redact_at(parts[: i + 1], child)
            raise ConfigError(f"{flag} {dotted}: {prefix} is a value ({shown!r}), not a section")
        node = child
    _merge(node, parts[-1], value)


def _merge(node: dict[str, Any], key: str, value: Any) -> None:
    """`node[key] = value`, except that a mapping given for a section merges into it key by key (a
    `--set 'train={steps: 5}'` that dropped the file's other train settings would change the run
    behind the user's back); an empty mapping empties it, and one of another `type` (an evaluator
    of another kind) replaces it. `null` for a mapping removes it: one of the file's evaluators
    (`--set evals.val=null`), or a section back to its defaults."""
    current = node.get(key)
    if value is None and isinstance(current, dict):
        del node[key]
        return
    merges = isinstance(value, dict) and value and isinstance(current, dict)
    if not merges or value.get("type", current.get("type")) != current.get("type"):
        node[key] = value
        return
    for name, item in value.items():
        _merge(current, name, item)


def _describe(err: ValidationError, schema: type[BaseModel], blame: _Blame, data: Mapping[str, Any]) -> str:
    problems = err.errors()
    if blame.source is None and all(p["type"] == "missing" and len(p["loc"]) == 1 for p in problems):
        # Nothing given at all: the missing sections are a missing -c, not a config to fix.
        missing = ", ".join(".".join(str(part) for part in p["loc"]) for p in problems)
        return f"{no_config(schema)}; it must set {missing}"  # one line
    lines, blamed = [], []
    for problem in problems:
        tagged = [str(p) for p in problem["loc"]]
        loc = _without_tags(tagged, data)
        key = ".".join(loc)
        if problem["type"] == "extra_forbidden":
            valid = _fields_at(schema, tagged[:-1])
            hint = difflib.get_close_matches(loc[-1], valid, n=1)
            suggestion = f"; did you mean {'.'.join(loc[:-1] + hint[:1])!r}?" if hint else ""
            lines.append(f"  {key}: unknown key{suggestion} (valid here: {', '.join(sorted(valid))})")
            blamed.append(blame.of(key))
            continue
        message = problem["msg"]
        if problem["type"] == "value_error":
            # A validator's own sentence, which names its keys and values: no "Value error, " and
            # no dump of the section it checked (the whole config for a rule across sections).
            message = message.removeprefix("Value error, ")
            if key and not isinstance(problem.get("input"), Mapping):  # one value's own check
                # The value given, unless the validator's sentence quotes it already.
                given = "" if "got " in message else f" (got {redact_at(loc, problem.get('input'))!r})"
                message = f"{key}: {message}{given}"
            lines.append(f"  {message}")
            blamed.append(blame.of(key, message))
            continue
        # Redacted: a bad value under a secret's key (or a whole section holding one) is not printed.
        shown = "" if problem["type"] == "missing" else f" (got {redact_at(loc, problem.get('input'))!r})"
        lines.append(f"  {key or '(top level)'}: {message}{shown}{_yaml_hint(key, problem)}")
        blamed.append(blame.of(key))
    if blame.source is None and any(p["type"] == "missing" and len(p["loc"]) == 1 for p in problems):
        lines.append(f"  ({no_config(schema)})")
    top_level = [p for p in problems if len(p["loc"]) == 1]
    if len(top_level) > 1 and all(p["type"] in ("extra_forbidden", "missing") for p in top_level):
        # Not one section of the file is this command's: most likely another command's config.
        lines.append(
            "  (none of its sections belong here: pretrain and finetune take a training config such as "
            "configs/demo.yaml, evaluate and fewshot a grid such as configs/grid_digits.yaml)"
        )
    return "\n".join([blame.header(blamed), *lines])


def _whole_number(text: str) -> int | None:
    """`1e3` -> 1000; None for what is no whole number written as a float."""
    try:
        number = float(text)
    except ValueError:
        return None
    return int(number) if number.is_integer() else None


def _yaml_hint(key: str, problem: Mapping[str, Any]) -> str:
    """How to write the value, where YAML read it as another type than the key takes (`--set
    run.name=123` is a number, `--set benchmarks=digits` a string)."""
    given = problem.get("input")
    if problem["type"] == "string_type" and isinstance(given, (bool, int, float)):
        # An int reads back as written; a float or a YAML boolean (on, yes) may not.
        written = given if isinstance(given, int) and not isinstance(given, bool) else "..."
        kind = "a boolean" if isinstance(given, bool) else "a number"
        return f"; YAML read {kind}: quote it to give a string, --set '{key}=\"{written}\"'"
    whole = _whole_number(given) if problem["type"] == "int_parsing" and isinstance(given, str) else None
    if whole is not None:
        # YAML 1.1 reads 1e3 as a string (its floats need a dot), and an int key takes no exponent.
        return f"; write the integer out: {key}={whole}"
    if problem["type"] == "list_type" and isinstance(given, str):
        return f"; a list is written in brackets: --set '{key}=[{given}]'"
    return ""


def _fields_at(schema: type[BaseModel], loc: list[str]) -> list[str]:
    """The valid keys of the section at `loc` (pydantic's location of an error), following nested
    models, the values of `dict[str, Model]` sections (`evals.NAME`) and, in a union told apart by
    its `type`, the member whose type is the next part (pydantic puts the tag in the location)."""
    node: Any = schema
    for part in loc:
        node = _unwrapped(node)
        if typing.get_origin(node) is dict:  # part: one of its keys
            node = typing.get_args(node)[1]
        elif typing.get_origin(node) in (typing.Union, types.UnionType):  # part: the member's `type`
            node = next((m for m in typing.get_args(node) if part in _type_tags(m)), None)
        elif isinstance(node, type) and issubclass(node, BaseModel) and part in node.model_fields:
            node = node.model_fields[part].annotation
        else:
            return []
    node = _unwrapped(node)
    return list(node.model_fields) if isinstance(node, type) and issubclass(node, BaseModel) else []


def _unwrapped(annotation: Any) -> Any:
    """`X` of `Annotated[X, ...]` and of `X | None`."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [m for m in typing.get_args(annotation) if m is not type(None)]
        if len(members) == 1:
            return _unwrapped(members[0])
    return annotation


def _type_tags(member: Any) -> tuple[Any, ...]:
    field = getattr(member, "model_fields", {}).get("type")
    return typing.get_args(field.annotation) if field is not None else ()


def _without_tags(loc: list[str], data: Any) -> list[str]:
    """`loc` as the user writes the key: without the `type` tags pydantic inserts for a union (the
    `val` in `evals.val.val.every`), found by walking the config's data along it."""
    kept, node = [], data
    for part in loc:
        if isinstance(node, Mapping) and part not in node and node.get("type") == part:
            continue
        kept.append(part)
        node = node.get(part) if isinstance(node, Mapping) else None
    return kept


def dump_config(config: BaseModel) -> str:
    """The resolved config as YAML (what --dry-run prints), credentials masked (`common/redact.py`)."""
    return yaml.safe_dump(redacted_config(config), sort_keys=False)


def flatten_config(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config dump as dotted keys (``{"train": {"steps": 10}}`` -> ``{"train.steps": 10}``); an
    empty section stays one key. What comparing two configs or logging one as flat params needs."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            flat.update(flatten_config(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat
