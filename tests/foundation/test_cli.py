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


def test_an_address_a_service_cannot_serve_on_is_a_usage_error(tmp_path) -> None:
    """A port in use or a socket in a missing folder: the gateway (HTTP and gRPC Chat) and the
    KV-cache daemon each exit 2 naming the address and the likely causes, without a traceback."""
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        cases = [
            (["deepwell.gateway", "--host", "127.0.0.1", "--port", str(port)],
             f"gateway: invalid host/port 127.0.0.1:{port}: cannot listen there"),
            (["deepwell.gateway", "--host", "127.0.0.1", "--port", "0", "--grpc-listen", f"127.0.0.1:{port}"],
             f"gateway: invalid listen address '127.0.0.1:{port}': cannot serve on it"),
            (["deepwell.kvcache_daemon", "--address", f"unix://{tmp_path}/missing/kv.sock",
              "--arena-path", str(tmp_path / "arena"), "--arena-bytes", str(4 << 20), "--granule-bytes", str(1 << 20)],
             f"invalid listen address 'unix://{tmp_path}/missing/kv.sock': cannot serve on it"),
        ]
        for argv, said in cases:
            r = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=60)
            assert r.returncode == 2 and said in r.stderr, (argv, r.returncode, r.stderr[-2000:])
            assert "Traceback" not in r.stderr, r.stderr[-2000:]
    finally:
        busy.close()
