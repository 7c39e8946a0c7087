"""Page-locking the daemon's arena for the host tier's device copies (``cudaHostRegister``),
such that a failure stays where it happened and no mapping goes away while registered.

A range must be unregistered before its mapping goes away: the driver keeps the registration
(and the physical pages it locked) past the ``munmap``, and a later allocation placed at that
address is then copied to the device from the *old* pages -- silently wrong bytes -- or the
copy fails. ``Pin`` holds the buffer's owner until it unregisters, at ``release`` or when the
``Pin`` itself is collected, so no path can drop the mapping first.

The CUDA runtime keeps a failed call's error as the calling thread's *last error*, and torch
checks that slot after every kernel launch: an unchecked ``cudaHostRegister`` that failed
(the range is registered already, e.g. a mapping dropped without unregistering and the next
one placed at the same address; or the driver refuses to lock that much) makes some later,
unrelated op of the same thread raise ("resource already mapped") -- a decode step that
fails far from its cause. So here a failed register or unregister clears that slot at once,
is logged, and the copies go on pageable (correct, slower).

The runtime is reached through ``ctypes`` on the ``libcudart`` that torch loaded (torch's
``cudart()`` bindings return the code but cannot clear the slot). Where none is loaded
(a torch linked statically against the runtime) nothing is pinned.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Any

from deepwell.logs import get_logger

log = get_logger(__name__)


def _loaded_cudart() -> str | None:
    """The path of the ``libcudart`` mapped into this process, if any."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and "/libcudart.so" in fields[5]:
                    return fields[5].strip()
    except OSError:
        return None
    return None


_runtime: Any | None = None


def runtime() -> Any | None:
    """The CUDA runtime torch uses, through ``ctypes`` (``None`` while none is loaded: looked up
    again on the next call, as torch loads it when CUDA is first used)."""
    global _runtime
    if _runtime is not None:
        return _runtime
    path = _loaded_cudart()
    if path is None:
        return None
    lib = ctypes.CDLL(path)
    lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.cudaHostRegister.restype = ctypes.c_int
    lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
    lib.cudaHostUnregister.restype = ctypes.c_int
    lib.cudaGetLastError.argtypes = []
    lib.cudaGetLastError.restype = ctypes.c_int
    lib.cudaGetErrorString.argtypes = [ctypes.c_int]
    lib.cudaGetErrorString.restype = ctypes.c_char_p
    _runtime = lib
    return lib


def _failed(rt: Any, event: str, code: int, nbytes: int) -> None:
    rt.cudaGetLastError()  # clear this thread's slot, so no later launch reports it
    reason = rt.cudaGetErrorString(code)
    log.warning(event, cuda_error=code, reason=reason.decode(errors="replace") if reason else "?", nbytes=nbytes,
                effect="host-tier copies of this arena run pageable (slower, still correct)")


def pin(ptr: int, nbytes: int) -> bool:
    """Page-lock ``[ptr, ptr + nbytes)`` for the current device; False (logged, no error left
    behind) where the runtime is not reachable or refuses."""
    rt = runtime()
    if rt is None:
        log.warning("host_pin_unavailable", reason="no libcudart is loaded in this process", nbytes=nbytes,
                    effect="host-tier copies run pageable (slower, still correct)")
        return False
    code = rt.cudaHostRegister(ptr, nbytes, 0)
    if code != 0:
        _failed(rt, "host_pin_failed", code, nbytes)
        return False
    return True


def unpin(ptr: int) -> bool:
    """Undo ``pin``; False (logged, no error left behind) where the range was not registered."""
    rt = runtime()
    if rt is None:
        return False
    code = rt.cudaHostUnregister(ptr)
    if code != 0:
        _failed(rt, "host_unpin_failed", code, 0)
        return False
    return True


def _release(keep: object, ptr: int) -> None:
    unpin(ptr)
    del keep  # the mapping may go now


class Pin:
    """``[ptr, ptr + nbytes)`` of ``keep``'s buffer page-locked while this object lives: ``keep``
    (what owns the mapping, e.g. a tensor over the mmap) stays referenced until the range is
    unregistered, by ``release`` or when the ``Pin`` is collected. ``ok``: the lock took (else
    the copies run pageable and there is nothing to release)."""

    def __init__(self, keep: object, ptr: int, nbytes: int) -> None:
        self.ok = pin(ptr, nbytes)
        self._done = weakref.finalize(self, _release, keep, ptr) if self.ok else None

    def release(self) -> None:
        """Unregister now (idempotent)."""
        if self._done is not None:
            self._done()
