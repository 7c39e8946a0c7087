"""Send one fuzz body to a gateway and judge the answer (shared by the fuzz test and
``benchmarks/fuzz_http.py``).

An answer is fine when it is < 500, arrives (a stream: ends) within the per-request
deadline, and an error (4xx) has the API's own error shape with a string message. A
streaming 200 is read to its end; an error event inside it is fine (the fake engine never
fails, so none is expected, but a hostile body may still be refused mid-stream).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Outcome:
    status: int  # 0 = no answer (hang or connection failure)
    hang: bool = False
    problem: str = ""  # why the answer is wrong ("" = fine)


@dataclass
class Tally:
    tried: int = 0
    by_class: dict[str, int] = field(default_factory=lambda: {"2xx": 0, "4xx": 0, "5xx": 0})
    hangs: int = 0
    problems: list[str] = field(default_factory=list)

    def add(self, outcome: Outcome, endpoint: str, body: bytes) -> None:
        self.tried += 1
        if outcome.hang:
            self.hangs += 1
        elif outcome.status:
            key = f"{outcome.status // 100}xx"
            self.by_class[key] = self.by_class.get(key, 0) + 1
        if outcome.problem:
            self.problems.append(f"{endpoint} {outcome.status} {outcome.problem[:300]} <- {body[:300]!r}")

    def line(self) -> str:
        return (f"tried {self.tried} / 2xx {self.by_class.get('2xx', 0)} / 4xx {self.by_class.get('4xx', 0)} / "
                f"5xx {self.by_class.get('5xx', 0)} / hangs {self.hangs} / bad answers {len(self.problems)}")


def _shape_problem(endpoint: str, status: int, text: str) -> str:
    try:
        body = json.loads(text)
    except ValueError:
        return "error body is not JSON"
    if endpoint.startswith("/v1/messages"):
        ok = isinstance(body, dict) and body.get("type") == "error" and isinstance(
            (body.get("error") or {}).get("message"), str)
    else:
        ok = isinstance(body, dict) and isinstance((body.get("error") or {}).get("message"), str)
    return "" if ok else f"error body is not the API's shape: {text[:200]}"


def send(client: httpx.Client, endpoint: str, body: bytes, deadline_s: float = 20.0) -> Outcome:
    start = time.monotonic()
    try:
        with client.stream("POST", endpoint, content=body, headers={"content-type": "application/json"},
                           timeout=httpx.Timeout(deadline_s)) as r:
            chunks = []
            for chunk in r.iter_bytes():
                chunks.append(chunk)
                if time.monotonic() - start > deadline_s:
                    return Outcome(r.status_code, hang=True, problem=f"no end after {deadline_s:.0f} s")
            text = b"".join(chunks).decode("utf-8", "replace")
            status = r.status_code
            streamed = "text/event-stream" in r.headers.get("content-type", "")
    except httpx.TimeoutException:
        return Outcome(0, hang=True, problem=f"no answer within {deadline_s:.0f} s")
    except httpx.HTTPError as exc:
        return Outcome(0, problem=f"connection failed: {exc!r}")
    if status >= 500:
        return Outcome(status, problem=f"server error: {text[:300]}")
    if status >= 400:
        return Outcome(status, problem=_shape_problem(endpoint, status, text))
    if not streamed:
        try:
            json.loads(text)
        except ValueError:
            return Outcome(status, problem="200 body is not JSON")
    return Outcome(status)
