"""Start the real engine process for a test and always stop it.

``engine_process(run_dir, args)`` runs ``python -m deepwell.engine_service --listen 127.0.0.1:0
--port-file ... --metrics-port 0 <args>`` with stderr in ``run_dir/stderr.log`` (a file, not
a pipe: logs can never block the engine), waits for its "engine listening on" line and
yields ``(grpc address, metrics url)``; on exit it sends SIGTERM and kills it after 30 s.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def engine_process(run_dir: Path, args: list[str]) -> Iterator[tuple[str, str]]:
    port_file = run_dir / "port"
    stderr = open(run_dir / "stderr.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "deepwell.engine_service", "--listen", "127.0.0.1:0", "--port-file", str(port_file),
         "--metrics-port", "0", *args],
        stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("engine listening on 127.0.0.1:"), (line, (run_dir / "stderr.log").read_text())
        port = int(port_file.read_text())
        assert line.split()[3] == f"127.0.0.1:{port}"
        yield f"127.0.0.1:{port}", line.split("metrics on ")[1].strip()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        stderr.close()
