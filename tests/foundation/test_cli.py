"""`deepwell --help` and every subcommand's --help work; subcommands map to real modules."""

from __future__ import annotations

import subprocess
import sys

import pytest

from deepwell import cli


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deepwell.cli", *args], capture_output=True, text=True, timeout=120)


def test_top_level_help_lists_every_available_command() -> None:
    result = _run("--help")
    assert result.returncode == 0, result.stderr
    for name, _ in cli.available_commands():
        assert name in result.stdout


def test_version() -> None:
    result = _run("--version")
    assert result.returncode == 0
    assert result.stdout.startswith("deepwell ")


@pytest.mark.parametrize("name", [name for name, _ in cli.available_commands()])
def test_subcommand_help(name: str) -> None:
    result = _run(name, "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: deepwell " + name in result.stdout
    assert "DEEPWELL_" in result.stdout, "every flag names its environment variable"


def test_no_command_prints_help_and_fails() -> None:
    result = _run()
    assert result.returncode == 2
    assert "usage: deepwell" in result.stdout


def test_unknown_command_is_an_error() -> None:
    result = _run("definitely-not-a-command")
    assert result.returncode == 2
    assert "invalid choice" in result.stderr
