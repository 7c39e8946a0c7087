"""Progress of long work (model download, weight loading, KV calibration): a bar on a TTY,
periodic structured log lines otherwise. No dependency beyond structlog.

    with Progress("loading weights", total=nbytes, unit="B") as p:
        for chunk in ...:
            p.update(len(chunk))

    with Progress("KV calibration", ticker=True):   # no count: elapsed time, redrawn by a thread
        calibrate()

Modes (``mode=None`` picks ``bar`` when ``stream``, stderr by default, is a TTY, else ``log``;
``$DEEPWELL_PROGRESS=bar|log|off`` overrides):

- ``bar``: one line redrawn in place at most every ``BAR_EVERY_S``::

      loading weights  [#############-----------]  54%  292/540 MB  1.2 s

  without a total the count (if any) and the elapsed time; ``close()`` ends the line.
- ``log``: a ``progress`` event (``task``, ``done``, ``total``, ``unit``, ``percent``,
  ``elapsed_s`` and the caller's ``fields``) at most every ``every_s`` seconds
  (``$DEEPWELL_PROGRESS_EVERY_S``, default 5): work shorter than that logs nothing; once a
  line was logged, ``close()`` logs a last one with ``finished=true`` (``ok=false`` when the
  block raised). ``emit`` replaces the structlog call (``deepwell up`` prints its own lines).
- ``off``: nothing.

Thread-safe: ``update`` / ``set`` may come from any thread; ``ticker=True`` redraws (or logs)
from a daemon thread while the caller blocks in work that reports nothing. A log line written
while a bar is drawn first clears the bar's line (``clear_bars``, a processor of
``deepwell.logs``); the bar is redrawn below it at its next update or tick.
"""

from __future__ import annotations

import contextvars
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

MODES = ("bar", "log", "off")
BAR_EVERY_S = 0.1
DEFAULT_EVERY_S = 5.0
BAR_WIDTH = 24
EVENT = "progress"  # the log event name (``deepwell up`` relays these from its children's logs)
_BARS: list[Progress] = []  # bars open now (mode bar, not closed)


def clear_bars(*_args: Any) -> Any:
    """Clear the line of every bar drawn now (before something else is written to the terminal);
    usable as a structlog processor (returns its event dict)."""
    for bar in list(_BARS):
        bar._clear_line()
    return _args[-1] if _args else None


def resolve_mode(stream: TextIO, mode: str | None = None) -> str:
    """``mode``, else ``$DEEPWELL_PROGRESS``, else bar on a TTY and log otherwise."""
    if mode is None:
        env = os.environ.get("DEEPWELL_PROGRESS", "")
        mode = env if env in MODES else ("bar" if _isatty(stream) else "log")
    if mode not in MODES:
        raise ValueError(f"progress mode {mode!r} is not one of {', '.join(MODES)}")
    return mode


def default_every_s() -> float:
    try:
        value = float(os.environ.get("DEEPWELL_PROGRESS_EVERY_S", DEFAULT_EVERY_S))
    except ValueError:
        return DEFAULT_EVERY_S
    return value if value > 0 else DEFAULT_EVERY_S


_BYTE_SCALES = ((1e9, "GB", 2), (1e6, "MB", 0), (1e3, "kB", 0), (1.0, "B", 0))


def format_amount(n: float, unit: str, like: float | None = None) -> str:
    """``n`` in ``unit``: bytes as kB / MB / GB (decimal; the scale of ``like`` when given, so
    ``done/total`` share it), anything else as a count."""
    if unit != "B":
        return f"{n:,.0f}" + (f" {unit}" if unit else "")
    ref = n if like is None else like
    size, name, digits = next(s for s in _BYTE_SCALES if ref >= s[0] or s[0] == 1.0)
    return f"{n / size:.{digits}f} {name}"


def describe(task: str, done: float, total: float | None, unit: str, elapsed_s: float) -> str:
    """The state in one line of text (the bar's, without the bar; ``deepwell up`` prints it)."""
    parts = [task]
    if total:
        amount = format_amount(done, unit, like=total).rsplit(" ", 1)[0] if unit == "B" else f"{done:,.0f}"
        parts += [f"{min(100, int(100 * done / total))}%", f"{amount}/{format_amount(total, unit)}"]
    elif done:
        parts.append(format_amount(done, unit))
    parts.append(f"{elapsed_s:.1f} s")
    return "  ".join(parts)


def bar_line(task: str, done: float, total: float | None, unit: str, elapsed_s: float) -> str:
    """``describe`` with a ``[####----]`` bar after the task when the total is known."""
    text = describe(task, done, total, unit, elapsed_s)
    if not total:
        return text
    filled = min(BAR_WIDTH, int(BAR_WIDTH * done / total))
    return f"{task}  [{'#' * filled}{'-' * (BAR_WIDTH - filled)}]{text[len(task):]}"


class Progress:
    def __init__(self, task: str, total: float | None = None, *, unit: str = "", stream: TextIO | None = None,
                 mode: str | None = None, every_s: float | None = None, ticker: bool = False,
                 emit: Callable[[dict[str, Any]], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, **fields: Any) -> None:
        self.task, self.total, self.unit, self.fields = task, total or None, unit, fields
        self.stream = stream if stream is not None else sys.stderr
        self.mode = resolve_mode(self.stream, mode)
        self.every_s = every_s if every_s is not None else default_every_s()
        self.clock = clock
        self.done: float = 0
        self.started = clock()
        self.logged = 0  # log lines written
        self._emit = emit
        self._last = self.started  # last redraw (bar) or log line (log)
        self._drawn = False
        self._on_line = False  # a frame is the terminal's last line now
        self._closed = False
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.mode == "bar":
            _BARS.append(self)
        if ticker and self.mode != "off":  # in a copy of this context: the log lines keep its bound values
            self._thread = threading.Thread(target=contextvars.copy_context().run, args=(self._tick,),
                                            name=f"progress-{task}", daemon=True)
            self._thread.start()

    # -- reporting -------------------------------------------------------------------------
    def update(self, n: float = 1) -> None:
        """``n`` more done."""
        with self._lock:
            self.done += n
            self._report(force=False)

    def set(self, done: float, total: float | None = None) -> None:
        """``done`` so far (and a new ``total``, if given)."""
        with self._lock:
            self.done = done
            if total is not None:
                self.total = total or None
            self._report(force=False)

    def close(self, ok: bool = True) -> None:
        """End the bar's line, or log the last line (when any was logged). Idempotent."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self in _BARS:
                _BARS.remove(self)
            if self.mode == "bar" and (self._drawn or self.clock() - self.started >= BAR_EVERY_S):
                self._draw(final=True, ok=ok)
            elif self.mode == "log" and self.logged:
                self._log(finished=True, ok=ok)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close(ok=exc_type is None)

    # -- internals -------------------------------------------------------------------------
    def _tick(self) -> None:
        interval = BAR_EVERY_S if self.mode == "bar" else min(1.0, self.every_s / 2)
        while not self._stop.wait(interval):
            with self._lock:
                self._report(force=False)

    def _report(self, force: bool) -> None:
        if self._closed or self.mode == "off":
            return
        now = self.clock()
        if self.mode == "bar":
            if force or now - self._last >= BAR_EVERY_S:
                self._last = now
                self._draw()
        elif force or now - self._last >= self.every_s:
            self._last = now
            self._log()

    def _draw(self, final: bool = False, ok: bool = True) -> None:
        text = bar_line(self.task, self.done, self.total, self.unit, self.clock() - self.started)
        if final and not ok:
            text += "  (failed)"
        try:
            self.stream.write("\r" + text + "\x1b[K" + ("\n" if final else ""))
            self.stream.flush()
        except (OSError, ValueError):  # a closed stream: progress is best-effort
            return
        self._drawn = True
        self._on_line = not final

    def _clear_line(self) -> None:
        if not self._lock.acquire(timeout=0.1):  # never hold up a log line for long
            return
        try:
            if self._on_line:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
                self._on_line = False
        except (OSError, ValueError):
            pass
        finally:
            self._lock.release()

    def _log(self, finished: bool = False, ok: bool = True) -> None:
        elapsed = self.clock() - self.started
        record: dict[str, Any] = {"task": self.task, "done": round(self.done, 3), "total": self.total,
                                  "unit": self.unit, "elapsed_s": round(elapsed, 1), **self.fields}
        if self.total:
            record["percent"] = min(100, int(100 * self.done / self.total))
        if finished:
            record["finished"] = True
            if not ok:
                record["ok"] = False
        self.logged += 1
        if self._emit is not None:
            self._emit(record)
            return
        from deepwell.logs import get_logger

        get_logger("deepwell.progress").info(EVENT, **record)


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
