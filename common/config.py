"""The one config loader: YAML file + `--set dotted.key=value` overrides -> a validated pydantic model.

Every error names the key, the bad value and what is allowed, and a typo'd key suggests the
closest valid one -- all before anything heavy (Ray, DeepSpeed) starts.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from vitray.common.redact import redact_at, redacted_config

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A config that cannot be used; the message lists every problem found."""


def load_config(schema: type[M], path: str | Path | None = None, overrides: Sequence[str] = ()) -> M:
    """A YAML file (or nothing: the defaults) + `key=value` overrides, validated as `schema`."""
    raw = _read_yaml(Path(path)) if path is not None else {}
    return validate_config(schema, raw, overrides, source=str(path) if path else "the config")


def validate_config(
    schema: type[M], raw: Mapping[str, Any], overrides: Mapping[str, Any] | Sequence[str] = (), *, source: str
) -> M:
    """A config as a dict + dotted overrides (a mapping, or `key=value` strings as from `--set`)."""
    data = copy.deepcopy(dict(raw))
    items = overrides.items() if isinstance(overrides, Mapping) else map(_parse_override, overrides)
    for key, value in items:
        _set_dotted(data, key, value)
    _refuse_moved_keys(schema, data, source)
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_describe(err, schema, source=source)) from None


def _refuse_moved_keys(schema: type[BaseModel], data: Mapping[str, Any], source: str) -> None:
    """Keys the schema has moved (its `MOVED_KEYS`: old dotted key -> hint) fail with the hint."""
    found = []
    for dotted, hint in getattr(schema, "MOVED_KEYS", {}).items():
        node: Any = data
        for part in dotted.split("."):
            node = node.get(part, _MISSING) if isinstance(node, Mapping) else _MISSING
        if node is not _MISSING:
            found.append(f"  {dotted}: {hint}")
    if found:
        raise ConfigError("\n".join([f"invalid config ({source}):", *found]))


_MISSING = object()


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(data).__name__}")
    return data


def _parse_override(override: str) -> tuple[str, Any]:
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {override!r}: expected dotted.key=value, e.g. --set train.steps=100")
    # YAML typing: 100 -> int, 1e-3 -> float, true -> bool, null -> None, [1, 2] -> list.
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    return key, value


def _set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            prefix = ".".join(parts[: i + 1])
            shown = redact_at(parts[: i + 1], child)
            raise ConfigError(f"--set {dotted}: {prefix} is a value ({shown!r}), not a section")
        node = child
    node[parts[-1]] = value


def _describe(err: ValidationError, schema: type[BaseModel], source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for problem in err.errors():
        loc = [str(p) for p in problem["loc"]]
        key = ".".join(loc) or "(top level)"
        if problem["type"] == "extra_forbidden":
            valid = _fields_at(schema, loc[:-1])
            hint = difflib.get_close_matches(loc[-1], valid, n=1)
            suggestion = f"; did you mean {'.'.join(loc[:-1] + hint[:1])!r}?" if hint else ""
            lines.append(f"  {key}: unknown key{suggestion} (valid here: {', '.join(sorted(valid))})")
            continue
        # Redacted: a bad value under a secret's key (or a whole section holding one) is not printed.
        shown = "" if problem["type"] == "missing" else f" (got {redact_at(loc, problem.get('input'))!r})"
        lines.append(f"  {key}: {problem['msg']}{shown}")
    return "\n".join(lines)


def _fields_at(schema: type[BaseModel], loc: list[str]) -> list[str]:
    """The valid keys of the section at `loc`, following nested pydantic models."""
    model: Any = schema
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return []
        model = field.annotation
    return list(getattr(model, "model_fields", {}))


def dump_config(config: BaseModel) -> str:
    """The resolved config as YAML (what --dry-run prints), credentials masked (`common/redact.py`)."""
    return yaml.safe_dump(redacted_config(config), sort_keys=False)
