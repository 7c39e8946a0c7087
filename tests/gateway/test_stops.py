"""StopMatcher: minimal hold-back and chunking-independent matching."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepwell.gateway.stops import StopMatcher


def run(stops: list[str], chunks: list[str]) -> tuple[list[str], str | None]:
    m = StopMatcher(stops)
    emitted, matched = [], None
    for c in chunks:
        e, hit = m.push(c)
        emitted.append(e)
        if hit is not None:
            matched = hit
            break
    if matched is None:
        emitted.append(m.flush())
    return emitted, matched


def test_holds_back_only_a_possible_prefix() -> None:
    m = StopMatcher(["STOP", "\n\nUser:"])
    assert m.push("Hello S") == ("Hello ", None)
    assert m.push("T") == ("", None)
    assert m.push("x") == ("STx", None)
    assert m.push("ab\n") == ("ab", None)
    assert m.push("\nUs") == ("", None)
    assert m.push("er: more") == ("", "\n\nUser:")
    assert m.done and m.push("anything") == ("", None)


def test_match_inside_one_chunk_and_flush() -> None:
    assert run(["</s>"], ["abc</s>def"]) == (["abc"], "</s>")
    assert run(["xyz"], ["abcxy"]) == (["abc", "xy"], None)
    assert run([], ["abc"]) == (["abc", ""], None)


def test_first_completed_stop_wins() -> None:
    # "bc" completes before "abcd" would; at equal ends the earlier start wins
    assert run(["abcd", "bc"], ["abcd"]) == (["a"], "bc")
    assert run(["b", "ab"], ["ab"]) == ([""], "ab")


def test_rejects_empty_stop() -> None:
    with pytest.raises(ValueError):
        StopMatcher([""])


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc\n:", max_size=40),
    stops=st.lists(st.text(alphabet="abc\n:", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=10),
)
def test_chunking_independent(text: str, stops: list[str], cuts: list[int]) -> None:
    whole, hit = run(stops, [text])
    bounds = [0, *sorted(set(c for c in cuts if c <= len(text))), len(text)]
    parts, hit2 = run(stops, [text[a:b] for a, b in zip(bounds, bounds[1:])])
    assert "".join(parts) == "".join(whole) and hit2 == hit
    if hit is None:
        assert "".join(whole) == text
    else:
        out = "".join(whole)
        assert text.startswith(out + hit)
        # no earlier completion of any stop exists
        end = len(out) + len(hit)
        assert not any(s in text[: end - 1] for s in stops)
