"""Frozen-dataclass configs mapped onto CLI flags and ``DEEPWELL_*`` environment variables.

Each component declares a small frozen dataclass whose fields carry ``help`` metadata
(``field(default=..., metadata={"help": "..."})``) and validates itself in
``__post_init__`` by raising ``ConfigError`` naming the field and the bad value.

``add_arguments(parser, Config, env_prefix)`` adds one ``--field-name`` flag per field;
``from_args(Config, namespace, env_prefix)`` builds the config with precedence
flag > ``DEEPWELL_<PREFIX>_<FIELD>`` env var > dataclass default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the setting and the value."""


def check(condition: bool, name: str, value: Any, requirement: str) -> None:
    """Raise ConfigError(``name=value: requirement``) unless ``condition``."""
    if not condition:
        raise ConfigError(f"invalid {name}={value!r}: {requirement}")


def env_name(prefix: str, field_name: str) -> str:
    return f"DEEPWELL_{prefix}_{field_name}".upper() if prefix else f"DEEPWELL_{field_name}".upper()


def _base_type(tp: Any) -> tuple[Any, bool]:
    """Return (scalar type, optional?) for str/int/float/bool/Path and Optional thereof."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    if origin is tuple:
        return tp, False
    return tp, False


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (true/false/1/0), got {text!r}")


def _convert(name: str, tp: Any, raw: str) -> Any:
    base, optional = _base_type(tp)
    if optional and raw.strip().lower() in ("", "none"):
        return None
    try:
        if base is bool:
            return _parse_bool(raw)
        if typing.get_origin(base) is tuple:
            (item,) = {a for a in typing.get_args(base) if a is not Ellipsis}
            return tuple(_convert(name, item, p) for p in raw.split(",") if p.strip())
        return base(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid {name}={raw!r}: {exc}") from None


def add_arguments(parser: argparse.ArgumentParser, config_cls: type, env_prefix: str) -> None:
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        if not f.init or f.metadata.get("cli") is False:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None  # type: ignore[misc]
        )
        help_text = f.metadata.get("help", "")
        choices = f.metadata.get("choices")
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        help_text = f"{help_text} [env {env_name(env_prefix, f.name)}; default: {shown}]"
        base, _ = _base_type(hints[f.name])
        if base is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, default=None, metavar=f.metadata.get("metavar", f.name.upper()),
                                choices=choices, help=help_text)


def from_args(config_cls: type[T], namespace: argparse.Namespace | None, env_prefix: str,
              environ: typing.Mapping[str, str] | None = None, **overrides: Any) -> T:
    """Build ``config_cls`` from flags (strings from argparse), env vars and defaults."""
    env = os.environ if environ is None else environ
    hints = typing.get_type_hints(config_cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(config_cls):
        if not f.init:
            continue
        if f.name in overrides:
            values[f.name] = overrides[f.name]
            continue
        raw = getattr(namespace, f.name, None) if namespace is not None else None
        if raw is not None:
            values[f.name] = raw if isinstance(raw, bool) else _convert(f"--{f.name.replace('_', '-')}", hints[f.name], raw)
            continue
        key = env_name(env_prefix, f.name)
        if key in env:
            values[f.name] = _convert(key, hints[f.name], env[key])
    return config_cls(**values)
