"""``deepwell.progress``: a bar on a TTY, periodic ``progress`` log lines otherwise."""

from __future__ import annotations

import io
import time

import pytest
from structlog.testing import capture_logs

from deepwell.progress import Progress, bar_line, describe, format_amount, resolve_mode


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_text() -> None:
    assert format_amount(292e6, "B") == "292 MB" and format_amount(1.5e9, "B") == "1.50 GB"
    assert format_amount(500e3, "B", like=98e6) == "0 MB" and format_amount(12, "tensors") == "12 tensors"
    assert describe("loading weights", 292e6, 540e6, "B", 1.23) == "loading weights  54%  292/540 MB  1.2 s"
    assert describe("KV calibration", 0, None, "", 12.34) == "KV calibration  12.3 s"
    assert describe("downloading", 45e6, None, "B", 3) == "downloading  45 MB  3.0 s"
    assert bar_line("w", 1, 4, "", 0) == "w  [######------------------]  25%  1/4  0.0 s"


def test_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEEPWELL_PROGRESS", raising=False)
    assert resolve_mode(FakeTTY()) == "bar" and resolve_mode(io.StringIO()) == "log"
    monkeypatch.setenv("DEEPWELL_PROGRESS", "off")
    assert resolve_mode(FakeTTY()) == "off"
    with pytest.raises(ValueError, match="not one of"):
        resolve_mode(io.StringIO(), "loud")


def test_bar_on_a_tty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEEPWELL_PROGRESS", raising=False)
    out, clock = FakeTTY(), Clock()
    with capture_logs() as logs, Progress("loading weights", total=400e6, unit="B", stream=out, clock=clock) as p:
        p.update(100e6)  # within 0.1 s of the start: not drawn yet
        assert out.getvalue() == ""
        clock.now += 0.5
        p.update(100e6)
        clock.now += 0.05
        p.update(100e6)  # within 0.1 s of the last redraw
        clock.now += 0.55
        p.update(100e6)
    frames = out.getvalue().split("\r")[1:]  # the last update's frame, then close() ends the line
    assert frames == ["loading weights  [############------------]  50%  200/400 MB  0.5 s\x1b[K",
                      "loading weights  [########################]  100%  400/400 MB  1.1 s\x1b[K",
                      "loading weights  [########################]  100%  400/400 MB  1.1 s\x1b[K\n"]
    assert logs == []  # no log lines on a TTY


def test_bar_without_total_and_failure() -> None:
    out, clock = FakeTTY(), Clock()
    with pytest.raises(RuntimeError), Progress("KV calibration", stream=out, clock=clock, mode="bar"):
        clock.now += 3
        raise RuntimeError("boom")
    assert out.getvalue() == "\rKV calibration  3.0 s  (failed)\x1b[K\n"


def test_log_lines_when_not_a_tty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEEPWELL_PROGRESS", raising=False)
    out, clock = io.StringIO(), Clock()
    with capture_logs() as logs:
        with Progress("quick", total=10, stream=out, clock=clock, every_s=5) as p:
            clock.now += 4
            p.update(10)
        assert logs == []  # shorter than every_s: nothing at all
        with Progress("loading weights", total=100, unit="B", stream=out, clock=clock, every_s=5, model="m") as p:
            for _ in range(10):
                clock.now += 1
                p.update(10)
    assert out.getvalue() == ""  # never drawn
    assert [e["event"] for e in logs] == ["progress"] * 3
    assert [(e["done"], e["percent"], e["elapsed_s"]) for e in logs] == [(50, 50, 5.0), (100, 100, 10.0),
                                                                         (100, 100, 10.0)]
    assert logs[-1]["finished"] is True and "finished" not in logs[0]
    assert all(e["task"] == "loading weights" and e["unit"] == "B" and e["model"] == "m" for e in logs)


def test_log_failure_and_emit() -> None:
    got: list[dict] = []
    clock = Clock()
    with pytest.raises(KeyError), Progress("x", stream=io.StringIO(), clock=clock, every_s=1, emit=got.append,
                                           mode="log") as p:
        clock.now += 2
        p.set(7, total=9)
        raise KeyError("k")
    assert [(r["done"], r["total"], r.get("finished"), r.get("ok")) for r in got] == [(7, 9, None, None),
                                                                                   (7, 9, True, False)]


def test_ticker_reports_work_that_reports_nothing() -> None:
    got: list[dict] = []
    with Progress("KV calibration", stream=io.StringIO(), mode="log", every_s=0.05, ticker=True, emit=got.append):
        time.sleep(0.4)
    assert len(got) >= 2 and got[-1]["finished"] is True and got[0]["elapsed_s"] >= 0
    out = FakeTTY()
    with Progress("KV calibration", stream=out, ticker=True):
        time.sleep(0.35)
    assert out.getvalue().count("\r") >= 2 and out.getvalue().endswith("\n")


def test_off_draws_and_logs_nothing() -> None:
    out = FakeTTY()
    with capture_logs() as logs, Progress("x", total=1, stream=out, mode="off", ticker=True) as p:
        p.update(1)
    assert out.getvalue() == "" and logs == []


def test_a_log_line_takes_the_bars_line() -> None:
    from deepwell.progress import clear_bars

    out, clock = FakeTTY(), Clock()
    with Progress("w", total=4, stream=out, clock=clock, mode="bar") as p:
        clock.now += 1
        p.update(1)
        event = {"event": "kv_calibrated"}
        assert clear_bars(None, "info", event) is event  # a structlog processor (deepwell.logs)
        assert out.getvalue().endswith("\r\x1b[K")
        clear_bars(None, "info", event)  # nothing drawn on the line now: nothing written
        assert out.getvalue().count("\r\x1b[K") == 1
        clock.now += 1
        p.update(1)  # drawn again, below the log line
    assert clear_bars(None, "info", {}) == {} and out.getvalue().endswith("\n")
