"""Flags and DEEPWELL_* env vars map onto frozen config dataclasses with clear errors."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from deepwell import configs


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    port: int = dataclasses.field(default=8000, metadata={"help": "TCP port"})
    host: str = dataclasses.field(default="127.0.0.1", metadata={"help": "bind address"})
    ratio: float = dataclasses.field(default=0.5, metadata={"help": "a fraction"})
    verbose: bool = dataclasses.field(default=False, metadata={"help": "more logs"})
    engines: tuple[str, ...] = dataclasses.field(default=("a:1",), metadata={"help": "addresses"})
    limit: int | None = dataclasses.field(default=None, metadata={"help": "optional cap"})

    def __post_init__(self) -> None:
        configs.check(0 < self.port < 65536, "port", self.port, "must be in 1..65535")
        configs.check(0.0 <= self.ratio <= 1.0, "ratio", self.ratio, "must be in [0, 1]")


def _parse(argv: list[str], env: dict[str, str] | None = None) -> DemoConfig:
    parser = argparse.ArgumentParser()
    configs.add_arguments(parser, DemoConfig, "DEMO")
    return configs.from_args(DemoConfig, parser.parse_args(argv), "DEMO", environ=env or {})


def test_defaults() -> None:
    assert _parse([]) == DemoConfig()


def test_flags_override_env_override_defaults() -> None:
    env = {"DEEPWELL_DEMO_PORT": "9000", "DEEPWELL_DEMO_HOST": "0.0.0.0"}
    cfg = _parse(["--port", "9100"], env)
    assert cfg.port == 9100 and cfg.host == "0.0.0.0"


def test_types_are_converted() -> None:
    cfg = _parse(["--ratio", "0.25", "--verbose", "--engines", "x:1,y:2", "--limit", "7"])
    assert cfg == DemoConfig(ratio=0.25, verbose=True, engines=("x:1", "y:2"), limit=7)
    assert _parse([], {"DEEPWELL_DEMO_VERBOSE": "true", "DEEPWELL_DEMO_LIMIT": "none"}).verbose is True
    assert _parse(["--no-verbose"], {"DEEPWELL_DEMO_VERBOSE": "1"}).verbose is False


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        _parse([]).port = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["--port", "0"], {}, "invalid port=0: must be in 1..65535"),
        (["--port", "eighty"], {}, "--port"),
        ([], {"DEEPWELL_DEMO_RATIO": "2"}, "invalid ratio=2.0"),
        ([], {"DEEPWELL_DEMO_VERBOSE": "maybe"}, "DEEPWELL_DEMO_VERBOSE"),
    ],
)
def test_errors_name_the_setting_and_value(argv: list[str], env: dict[str, str], needle: str) -> None:
    with pytest.raises(configs.ConfigError) as info:
        _parse(argv, env)
    assert needle in str(info.value)


def test_help_names_env_vars() -> None:
    parser = argparse.ArgumentParser()
    configs.add_arguments(parser, DemoConfig, "DEMO")
    text = parser.format_help()
    for f in dataclasses.fields(DemoConfig):
        assert configs.env_name("DEMO", f.name) in text
