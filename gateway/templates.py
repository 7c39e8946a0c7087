"""The model's own Jinja chat template, rendered with Hugging Face semantics.

Contract (matches ``transformers``' ``apply_chat_template(..., tokenize=False)``):
- Sandboxed: ``jinja2.sandbox.ImmutableSandboxedEnvironment`` with ``trim_blocks`` and
  ``lstrip_blocks`` and the loop-controls extension (``break``/``continue``).
- Globals: ``raise_exception(msg)`` (becomes :class:`TemplateError` with the template's
  message), ``strftime_now(fmt)``, a constructor-only ``dict`` and a ``namespace`` that
  refuses underscore attributes. Filter ``tojson`` as HF defines it: ``json.dumps`` with
  ``ensure_ascii=False`` and optional ``indent``, ``separators``, ``sort_keys`` (default
  False) — no HTML escaping.
- Variables: ``messages`` (keys whose value is None are dropped; reasoning is exposed as
  ``reasoning_content`` and ``thinking`` when a message carries it under any of
  ``reasoning_content``/``thinking``/``reasoning``), ``tools`` (None when absent),
  ``documents`` (None), ``add_generation_prompt``, the special-token strings given to the
  constructor (``bos_token``, ``eos_token``, ...), then the caller's extra kwargs
  (``enable_thinking``, ``preserve_thinking``, ``chat_template_kwargs``), which override
  special tokens of the same name.
- Every failure while compiling or rendering raises :class:`TemplateError` whose message
  is the template's own; nothing else escapes ``render``.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # the marker HF uses for continue_final_message


class TemplateError(Exception):
    """A chat template that fails to compile or render; ``str()`` is the reason."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` inside templates: construction only, no attribute access to the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore-prefixed attribute names."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} may not start with an underscore")


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _plain(value: Any) -> Any:
    """Rebuild template inputs out of plain JSON types (no objects with methods reach the sandbox)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """HF's message normalization: drop None-valued keys, alias reasoning fields."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TemplateError(f"message {i} is not an object")
        m = {k: _plain(v) for k, v in message.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may reference."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", **special_tokens: str) -> None:
        if not isinstance(source, str) or not source.strip():
            raise TemplateError("the model has no chat template")
        self.source = source
        self.special_tokens: dict[str, str] = {"bos_token": bos_token, "eos_token": eos_token, **special_tokens}
        try:
            self._compiled = _environment().from_string(source)
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateError(f"chat template does not compile: {exc}") from exc

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render like HF. ``continue_final_message``: the prompt ends inside the last
        message (its text content), so the model continues it (assistant prefill)."""
        if not continue_final_message:
            return self._render(messages, tools, add_generation_prompt, kwargs)
        if add_generation_prompt:
            raise TemplateError("continue_final_message and add_generation_prompt cannot both be set")
        if not messages or not isinstance(messages[-1].get("content"), str):
            raise TemplateError("continue_final_message needs a last message with text content")
        final = messages[-1]["content"]
        tagged = [*messages[:-1], {**messages[-1], "content": final + _CONTINUE_TAG}]
        text = self._render(tagged, tools, False, kwargs)
        where = text.rfind(_CONTINUE_TAG.strip())
        if where < 0 or final.strip() not in text:
            raise TemplateError("continue_final_message: the chat template does not render the final message's content")
        if text[where : where + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            return text[:where]
        return text[:where].rstrip()  # the template trimmed the content

    def _render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool, kwargs: dict[str, Any]
    ) -> str:
        chat = normalize_messages(messages)
        variables = {**self.special_tokens, **{k: _plain(v) for k, v in kwargs.items()}}
        try:
            return self._compiled.render(
                messages=chat,
                tools=_plain(tools) if tools is not None else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateError(str(exc) or type(exc).__name__) from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError, OverflowError, RecursionError) as exc:
            raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
