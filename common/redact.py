"""Keeping credentials out of everything vitray writes: configs, checkpoints, log lines.

Credentials reach vitray from the environment (``AWS_*``, ``RAY_AUTH_TOKEN``), instance roles,
Kubernetes Secrets or -- discouraged, but possible -- a config's ``storage_options``. The workers
need them as they are; what is *written* (``--dry-run``, the resolved config in a checkpoint's
``trainer_state.json``, log lines, error messages) goes through this module first:

- :func:`redact`: a JSON-like value (dicts, lists, strings) with every value stored under a
  secret-looking key (``key``, ``secret``, ``token``, ``password``, ``credential``, ...; at any
  depth, e.g. ``storage_options.client_kwargs.aws_secret_access_key``) replaced by ``***``, and
  every string passed through :func:`redact_text`;
- :func:`redact_args`: a command line, its `--set` (`--grid-set`) values under secret-looking keys
  masked too;
- :func:`redact_text`: free text with ``scheme://user:password@host`` passwords and the values of
  secret-looking environment variables (``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
  ``RAY_AUTH_TOKEN``, ...) masked;
- :func:`redacted_config`: a pydantic config as the dict to write (``redact(config.model_dump())``);
- :class:`RedactingFilter`: a :class:`logging.Filter` that redacts every record it passes.

No Ray here: anything that writes a config or a log line can use it.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

MASK = "***"

# A key names a secret when one of its words is one of these (words: split on non-letters and
# camelCase), so `aws_secret_access_key`, `AWS_SESSION_TOKEN`, `apiKey` and `password` are secrets,
# while `record_sample_keys` ("keys") or `head: token` (a value, not a key) are not.
SECRET_WORDS = frozenset(
    {"key", "secret", "token", "password", "passwd", "passphrase", "credential", "credentials", "apikey", "sas"}
)
# Sections whose values are credentials or options that carry them (fsspec's, a job's environment).
CREDENTIAL_SECTIONS = frozenset({"storage_options", "env", "env_vars"})
# Environment values shorter than this are not searched for in text: masking "true" or "1"
# everywhere would hide more than it protects.
MIN_SECRET_LENGTH = 8

# The options that set a config value, KEY=VALUE: `--set`, and `vitray demo`'s `--grid-set`.
_SETTING_OPTION = re.compile(r"--(?:[a-z]+-)*set")
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")
_URL_PASSWORD = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/@:\s]*):(?P<password>[^/@\s]+)@")


def is_secret_name(name: str) -> bool:
    """True for a key or variable name that holds a credential (see SECRET_WORDS)."""
    return any(word.lower() in SECRET_WORDS for word in _WORD.findall(str(name)))


def environment_secrets(environ: Mapping[str, str] | None = None) -> list[str]:
    """The values of secret-looking environment variables, longest first (so that a secret that
    contains another one is masked whole)."""
    environ = os.environ if environ is None else environ
    values = {v for k, v in environ.items() if is_secret_name(k) and len(v) >= MIN_SECRET_LENGTH}
    return sorted(values, key=len, reverse=True)


def redact_text(text: str, secrets: list[str] | None = None) -> str:
    """`text` with URL passwords and the environment's secret values replaced by ***."""
    text = _URL_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", text)
    for secret in environment_secrets() if secrets is None else secrets:
        text = text.replace(secret, MASK)
    return text


def redact(value: Any, secrets: list[str] | None = None) -> Any:
    """A copy of a JSON-like `value` with secrets masked (see the module docstring)."""
    secrets = environment_secrets() if secrets is None else secrets
    if isinstance(value, Mapping):
        return {
            key: MASK if is_secret_name(key) and item not in (None, "") else redact(item, secrets)
            for key, item in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [redact(item, secrets) for item in value]
    if isinstance(value, str):
        return redact_text(value, secrets)
    return value


def unmasked(value: Any) -> Any:
    """A copy of a recorded (redacted) JSON-like `value` without the entries :func:`redact` masked:
    options read back from a checkpoint's config, so that what masked a credential is never sent as
    one (the environment's, or a store's role, stand in for it)."""
    if isinstance(value, Mapping):
        return {key: unmasked(item) for key, item in value.items() if item != MASK}
    return value


def redact_at(path: Sequence[str], value: Any) -> Any:
    """`value` found at `path` (its keys from the top), for error messages that quote one value of a
    config: masked whole when a key on the way names a secret or a section that holds credentials
    (a malformed one may be a pasted key), else redacted inside."""
    hidden = any(is_secret_name(part) or str(part) in CREDENTIAL_SECTIONS for part in path)
    return MASK if hidden else redact(value)


def redact_args(args: Sequence[str], secrets: list[str] | None = None) -> list[str]:
    """A command line with its credentials masked: a `--set KEY=VALUE` (or `--grid-set`, any
    `--...-set` option) whose key names a secret
    (`data.storage_options.secret`) or whose value is a mapping holding one becomes `KEY=***`; every
    argument goes through :func:`redact_text` (URL passwords, the environment's secret values)."""
    import yaml

    secrets = environment_secrets() if secrets is None else secrets
    masked = []
    for index, arg in enumerate(args):
        prefix, setting = "", None
        option, equals, value = arg.partition("=")
        if equals and _SETTING_OPTION.fullmatch(option):
            prefix, setting = f"{option}=", value
        elif index > 0 and _SETTING_OPTION.fullmatch(args[index - 1]):
            setting = arg
        key, sep, value = (setting or "").partition("=")
        hidden = bool(sep and value) and any(is_secret_name(part) for part in key.split("."))
        if sep and not hidden:
            try:
                parsed = yaml.safe_load(value)
            except yaml.YAMLError:
                parsed = None
            hidden = isinstance(parsed, (dict, list)) and redact(parsed, []) != parsed
        masked.append(f"{prefix}{key}={MASK}" if hidden else redact_text(arg, secrets))
    return masked


def redacted_config(config: BaseModel) -> dict[str, Any]:
    """The config as the JSON-ready dict that may be written or printed: what `--dry-run` shows and
    what a checkpoint records."""
    return redact(config.model_dump(mode="json"))


class RedactingFilter(logging.Filter):
    """Masks secrets in every record's message (attach it to a handler or a logger)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact_text(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return True
