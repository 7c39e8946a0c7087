"""What ``deepwell up`` shows on its terminal, and the children's log files behind it.

With ``--logs files`` (the default) each child writes its stdout and stderr — JSON log lines,
plus the few plain lines a process prints itself (a traceback before its logging starts) — to
``<log dir>/<name>.jsonl``, appended across restarts (each start is marked by a
``deepwell_up_start`` line naming the command). ``deepwell up`` tails those files
(``LogTail``) and its ``Console`` shows, on stderr:

- short status lines: a child starting, ready, exited (with the end of its log when it exited
  with an error status), restarting with backoff, the shutdown;
- the children's ``progress`` lines (``deepwell.progress``: model download, weight loading, KV
  calibration) as a bar redrawn in place on a TTY, else as a line each;
- their errors, and their warnings while they start, in one readable line each (the same
  event of the same child at most every ``REPEAT_S`` seconds, with a count of the others).

``--logs console`` leaves the children's output on the terminal (the old behaviour); the
status lines are the same. The banner (``deepwell.up.banner``) goes to stdout.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

from deepwell.progress import EVENT as PROGRESS_EVENT
from deepwell.progress import bar_line, describe

START_EVENT = "deepwell_up_start"
_HIDDEN = ("timestamp", "level", "event", "component", "logger", "exception")
_VALUE_MAX = 160
REPEAT_S = 10.0  # the same problem of the same child is shown at most this often


class LogTail:
    """The complete lines appended to ``path`` since the last call (a partial last line waits)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0
        self._partial = b""

    def lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return []
        self.offset += len(data)
        *complete, self._partial = (self._partial + data).split(b"\n")
        return [line.decode("utf-8", "replace") for line in complete if line.strip()]


def last_lines(path: Path, n: int, max_bytes: int = 64 << 10) -> list[str]:
    """The last ``n`` non-empty lines of ``path`` (of its last ``max_bytes``)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, 2) - max_bytes))
            data = fh.read()
    except OSError:
        return []
    return [line.decode("utf-8", "replace") for line in data.split(b"\n") if line.strip()][-n:]


def parse(line: str) -> dict[str, Any] | None:
    """A JSON log line as a dict (None for a plain line)."""
    if not line.startswith("{"):
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def humanize(line: str) -> str:
    """One log line for a person: ``LEVEL event  key=value ...`` (an exception on the lines
    after); a plain line as it is."""
    record = parse(line)
    if record is None:
        return line.rstrip()
    fields = " ".join(f"{k}={_short(v)}" for k, v in record.items() if k not in _HIDDEN)
    text = f"{str(record.get('level', '')).upper():7} {record.get('event', '')}" + (f"  {fields}" if fields else "")
    if record.get("exception"):
        text += "\n" + str(record["exception"]).rstrip()
    return text


def brief(record: dict[str, Any]) -> str:
    """A problem in one line: ``level event: detail`` (its ``detail`` / ``reason`` / ``error``
    field, else a few of its fields)."""
    head = f"{record.get('level', '')} {record.get('event', '')}".strip()
    for key in ("detail", "reason", "error", "message"):
        if isinstance(record.get(key), str) and record[key]:
            return f"{head}: {record[key]}"
    fields = [f"{k}={_short(v)}" for k, v in record.items() if k not in _HIDDEN][:4]
    return f"{head}  {' '.join(fields)}".rstrip()


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if isinstance(value, str) and (" " in text or not text):
        text = json.dumps(text)
    return text if len(text) <= _VALUE_MAX else text[:_VALUE_MAX - 3] + "..."


def start_record(name: str, argv: list[str]) -> str:
    """The line written to a child's log before each start."""
    return json.dumps({"timestamp": datetime.now(timezone.utc).isoformat().replace("+00:00", "Z"),
                       "level": "info", "event": START_EVENT, "component": "up", "child": name,
                       "argv": argv}) + "\n"


class Console:
    """deepwell up's stderr: status lines, relayed progress and problems (see the module doc)."""

    def __init__(self, stream: TextIO | None = None, tty: bool | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream if stream is not None else sys.stderr
        if tty is None:
            try:
                tty = self.stream.isatty()
            except (AttributeError, ValueError):
                tty = False
        self.tty = tty
        self.serving: dict[str, Any] = {}  # the engine's engine_serving line (model, device, context)
        self.clock = clock
        self._repeats: dict[tuple[str, str], tuple[float, int]] = {}  # (child, event): (shown at, skipped since)
        self._bar: str | None = None  # the child whose progress bar is drawn on the last line

    def status(self, text: str) -> None:
        self._end_bar()
        self._write(f"deepwell up: {text}\n")

    def block(self, title: str, lines: list[str]) -> None:
        """``title`` and ``lines`` (indented), e.g. the end of a child's log."""
        self._end_bar()
        body = "".join("    " + part + "\n" for line in lines for part in line.splitlines())
        self._write(f"deepwell up: {title}\n{body}")

    def relay(self, name: str, line: str, starting: bool) -> None:
        """Show what a person should see of one line of child ``name``'s log."""
        record = parse(line)
        if record is None:
            return
        event, level = record.get("event"), str(record.get("level", ""))
        if event == PROGRESS_EVENT and "task" in record:
            self._progress(name, record)
        elif event == "engine_serving":
            self.serving = record
        elif level in ("error", "critical") or (starting and level == "warning"):
            self._problem(name, record)

    def _problem(self, name: str, record: dict[str, Any]) -> None:
        """One line per problem, the same event of the same child at most every ``REPEAT_S``."""
        key, now = (name, str(record.get("event"))), self.clock()
        last, skipped = self._repeats.get(key, (float("-inf"), 0))
        if now - last < REPEAT_S:
            self._repeats[key] = (last, skipped + 1)
            return
        self._repeats[key] = (now, 0)
        more = f" ({skipped} more like it before)" if skipped else ""
        self.status(f"{name} {brief(record)}{more}")

    def _progress(self, name: str, rec: dict[str, Any]) -> None:
        args = (str(rec["task"]), float(rec.get("done") or 0), rec.get("total"), str(rec.get("unit", "")),
                float(rec.get("elapsed_s") or 0))
        finished = bool(rec.get("finished"))
        if not self.tty:
            self.status(f"{name}: {describe(*args)}" + (" (done)" if finished else ""))
            return
        if self._bar not in (None, name):
            self._end_bar()
        self._write(f"\r{name}: {bar_line(*args)}\x1b[K" + ("\n" if finished else ""))
        self._bar = None if finished else name

    def end_progress(self, name: str) -> None:
        """Child ``name`` stopped: its bar (if drawn) ends here."""
        if self._bar == name:
            self._end_bar()

    def _end_bar(self) -> None:
        if self._bar is not None:
            self._bar = None
            self._write("\n")

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            pass
