"""ReasoningSplitter: <think> split with hold-back; chunking-independent."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from deepwell.gateway.chat_types import ContentDelta, ReasoningDelta
from deepwell.gateway.reasoning import ReasoningSplitter, prompt_opens_reasoning


def split(text_chunks: list[str], start: bool) -> tuple[str, str, bool]:
    s = ReasoningSplitter(start)
    ev = []
    for c in text_chunks:
        ev += s.feed(c)
    ev += s.finish()
    r = "".join(e.text for e in ev if isinstance(e, ReasoningDelta))
    c = "".join(e.text for e in ev if isinstance(e, ContentDelta))
    assert r == s.reasoning_text
    return r, c, s.reasoning_closed


def test_prompt_opened_think() -> None:
    assert split(["Let me think.\n</think>\n\nAnswer: 4"], True) == ("Let me think.\n", "Answer: 4", True)
    assert split(["still thinking"], True) == ("still thinking", "", False)
    assert split(["<think>\nrepeated open\n</think>\n\nok"], True) == ("repeated open\n", "ok", True)


def test_model_opens_think_itself() -> None:
    assert split(["<think>\nhmm\n</think>\n\nHello"], False) == ("hmm\n", "Hello", True)
    assert split(["  <think>x</think>y"], False) == ("x", "y", True)
    assert split(["Hello <think>x</think>"], False) == ("", "Hello <think>x</think>", False)
    assert split(["  plain"], False) == ("", "  plain", False)


def test_tag_split_across_chunks() -> None:
    assert split(["abc</th", "ink>def"], True) == ("abc", "def", True)
    assert split(["<thi", "nk>r</", "think>c"], False) == ("r", "c", True)
    assert split(["abc</th"], True) == ("abc</th", "", False)


def test_prompt_opens_reasoning() -> None:
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(st.sampled_from(["<think>", "</think>", "<th", "ink>", "</", "a", " ", "\n", "<", ">", "x y"]), max_size=20),
    start=st.booleans(),
    cuts=st.lists(st.integers(0, 200), max_size=12),
)
def test_chunking_independent(parts: list[str], start: bool, cuts: list[int]) -> None:
    text = "".join(parts)
    bounds = [0, *sorted(set(c for c in cuts if c <= len(text))), len(text)]
    assert split([text[a:b] for a, b in zip(bounds, bounds[1:])], start) == split([text], start)
