"""``pinning``: a refused page-lock leaves no CUDA error behind for a later, unrelated op."""

from __future__ import annotations

import gc
import mmap
import weakref
from typing import Any

import pytest
import torch

from deepwell.engine_service.cache import pinning


class FakeRuntime:
    """The four ``libcudart`` entry points ``pinning`` uses, with a per-thread last error."""

    def __init__(self, register: int = 0, unregister: int = 0) -> None:
        self.codes = {"register": register, "unregister": unregister}
        self.last_error = 0
        self.calls: list[str] = []

    def _ret(self, name: str) -> int:
        self.calls.append(name)
        code = self.codes[name]
        if code:
            self.last_error = code
        return code

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802
        return self._ret("register")

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        return self._ret("unregister")

    def cudaGetLastError(self) -> int:  # noqa: N802
        code, self.last_error = self.last_error, 0
        return code

    def cudaGetErrorString(self, code: int) -> bytes:  # noqa: N802
        return f"error {code}".encode()


def _use(monkeypatch: pytest.MonkeyPatch, rt: Any) -> None:
    monkeypatch.setattr(pinning, "runtime", lambda: rt)


def test_a_pin_and_its_unpin(monkeypatch: pytest.MonkeyPatch) -> None:
    rt = FakeRuntime()
    _use(monkeypatch, rt)
    assert pinning.pin(4096, 1 << 20)
    assert pinning.unpin(4096)
    assert rt.calls == ["register", "unregister"] and rt.last_error == 0


@pytest.mark.parametrize("which", ["register", "unregister"])
def test_a_refusal_is_false_and_clears_the_last_error(monkeypatch: pytest.MonkeyPatch, which: str) -> None:
    rt = FakeRuntime(**{which: 208})  # cudaErrorAlreadyMapped
    _use(monkeypatch, rt)
    assert (pinning.pin(4096, 1 << 20) if which == "register" else pinning.unpin(4096)) is False
    assert rt.last_error == 0  # what a later kernel launch's check would otherwise report


def test_without_a_runtime_nothing_is_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    _use(monkeypatch, None)
    assert not pinning.pin(4096, 1 << 20)
    assert not pinning.unpin(4096)


class Owner:
    """Stands for what owns a mapping (a tensor over the mmap)."""


def _pin(monkeypatch: pytest.MonkeyPatch, **codes: int) -> tuple[FakeRuntime, pinning.Pin, weakref.ref[Owner]]:
    """A ``Pin`` over an ``Owner`` nothing else references, and a weak reference to that owner."""
    rt = FakeRuntime(**codes)
    _use(monkeypatch, rt)
    owner = Owner()
    p = pinning.Pin(owner, 4096, 1 << 20)
    return rt, p, weakref.ref(owner)


def test_a_pin_keeps_the_mapping_until_it_unregisters(monkeypatch: pytest.MonkeyPatch) -> None:
    rt, p, alive = _pin(monkeypatch)
    gc.collect()
    assert p.ok and alive() is not None  # registered: the mapping must stay
    p.release()
    p.release()
    gc.collect()
    assert alive() is None and rt.calls == ["register", "unregister"]


def test_a_collected_pin_unregisters_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tier dropped without ``close`` must not leave its arena registered past its mapping."""
    rt, p, alive = _pin(monkeypatch)
    del p
    gc.collect()
    assert alive() is None and rt.calls == ["register", "unregister"]


def test_a_refused_pin_holds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    rt, p, alive = _pin(monkeypatch, register=712)
    gc.collect()
    assert not p.ok and alive() is None
    p.release()
    assert rt.calls == ["register"] and rt.last_error == 0


@pytest.mark.gpu
def test_on_cuda_a_second_pin_fails_and_the_next_op_runs() -> None:
    """The arena case: the same range registered twice (a mapping freed while registered and the
    next one placed at its address). Through torch's ``cudart()`` the refusal stayed the
    thread's last error and a later, unrelated op raised "resource already mapped"."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.zeros(1, device="cuda")  # the runtime is loaded and the context made
    assert pinning.runtime() is not None
    buf = mmap.mmap(-1, 4 << 20)
    ptr = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    assert pinning.pin(ptr, len(buf))
    try:
        assert not pinning.pin(ptr, len(buf))
        x = torch.arange(1 << 16, device="cuda", dtype=torch.float32)
        assert float((x * 2).sum()) == float(x.sum()) * 2
    finally:
        assert pinning.unpin(ptr)
    assert not pinning.unpin(ptr)
    assert float(torch.ones(8, device="cuda").sum()) == 8.0


@pytest.mark.gpu
def test_on_cuda_a_dropped_pin_frees_the_range_for_the_next() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    buf = mmap.mmap(-1, 4 << 20)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    p = pinning.Pin(t, t.data_ptr(), len(buf))
    assert p.ok
    del p
    gc.collect()
    again = pinning.Pin(t, t.data_ptr(), len(buf))  # refused were the range still registered
    assert again.ok
    again.release()


def test_a_runtime_not_loaded_yet_is_looked_up_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """``runtime()`` asked before torch has loaded ``libcudart`` must not stay ``None``."""
    from types import SimpleNamespace

    loaded: list[str | None] = [None]
    monkeypatch.setattr(pinning, "_runtime", None)
    monkeypatch.setattr(pinning, "_loaded_cudart", lambda: loaded[0])
    fns = ("cudaHostRegister", "cudaHostUnregister", "cudaGetLastError", "cudaGetErrorString")
    monkeypatch.setattr(pinning.ctypes, "CDLL", lambda path: SimpleNamespace(
        path=path, **{f: SimpleNamespace() for f in fns}))
    assert pinning.runtime() is None
    loaded[0] = "/opt/cuda/lib/libcudart.so.12"
    rt = pinning.runtime()
    assert rt is not None and rt.path == loaded[0]
    assert pinning.runtime() is rt  # a hit is kept
