"""Find what would break (or silently corrupt) a CUDA-graph capture of a step, by running it once
eagerly under torch's dispatch and function modes.

A captured step may not synchronize with the host, and every host-to-device copy in it is
recorded once: a copy from pageable memory is refused by CUDA ("Cannot copy between CPU and
CUDA tensors during CUDA graph capture ..."), one from pinned memory is replayed from the same
host buffer forever after. The capture's own error names only the first such op; ``audit``
reports all of them, each once, with the deepwell frames that reached it, so one run on a GPU
is enough to find them all. ``capture_graphs`` logs the audit when a capture fails.

What is flagged (``Hazard.kind``):

- ``sync``: a value read back to the host (``.item()``, ``.tolist()``, ``bool(t)``, a copy to
  the CPU) or an op whose output size depends on the data (``nonzero``, boolean masks, ...);
- ``h2d``: a host tensor copied to the step's device (pageable), or a device tensor created
  from Python data (``torch.tensor(..., device=...)``);
- ``h2d_pinned``: the same from pinned memory (allowed by CUDA, but the captured copy reads
  that buffer at every replay: it must live as long as the graph and hold the current values);
- ``mixed``: an op given tensors on the CPU and on the device at once (an implicit copy).

On a CPU runner only ``sync`` can be told apart (every tensor is on the host).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_SYNC_OPS = {
    "aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique", "aten._unique",
    "aten._unique2", "aten.unique_consecutive", "aten.unique_dim", "aten.argwhere",
    "aten.masked_scatter_", "aten._assert_async",
}
_CREATE_FUNCS = {"tensor", "as_tensor", "from_numpy"}
_FRAMES = 4  # deepwell frames kept per hazard
_PACKAGES = ("/engine_service/", "/kernels/")  # deepwell's own frames (in a checkout or installed)


@dataclass(frozen=True)
class Hazard:
    kind: str  # sync | h2d | h2d_pinned | mixed
    op: str
    where: tuple[str, ...]  # innermost deepwell frames, "path:line in function"

    def __str__(self) -> str:
        return f"{self.kind} {self.op} at {' <- '.join(self.where) or '?'}"


def _where() -> tuple[str, ...]:
    frames = []
    for fr in reversed(traceback.extract_stack()):
        f = fr.filename.replace("\\", "/")
        pkg = next((p for p in _PACKAGES if p in f), None)
        if pkg is None or f.endswith("/graph_audit.py"):
            continue
        frames.append(f"{pkg[1:]}{f.split(pkg, 1)[1]}:{fr.lineno} in {fr.name}")
        if len(frames) == _FRAMES:
            break
    return tuple(frames)


def _tensors(args: Any, kwargs: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                visit(y)

    visit(args)
    visit(list((kwargs or {}).values()))
    return out


class _Recorder:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.hazards: dict[tuple[str, str, tuple[str, ...]], Hazard] = {}

    def add(self, kind: str, op: str) -> None:
        h = Hazard(kind, op, _where())
        self.hazards.setdefault((h.kind, h.op, h.where), h)


class _Dispatch(TorchDispatchMode):
    def __init__(self, rec: _Recorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func.overloadpacket)
        out = func(*args, **(kwargs or {}))
        dev = self.rec.device
        ts = _tensors(args, kwargs)
        if name in _SYNC_OPS:
            self.rec.add("sync", name)
        elif name == "aten.index" and any(t.dtype == torch.bool for t in ts[1:]):
            self.rec.add("sync", name + " (boolean mask)")
        elif name in ("aten._to_copy", "aten.copy_", "aten.copy") and ts:
            src = ts[1] if name == "aten.copy_" and len(ts) > 1 else ts[0]
            dst = ts[0] if name == "aten.copy_" else out
            if isinstance(dst, torch.Tensor) and src.device != dst.device:
                if dst.device.type == "cpu" and dev.type != "cpu":
                    self.rec.add("sync", f"{name} to the host")
                elif src.device.type == "cpu":
                    self.rec.add("h2d_pinned" if src.is_pinned() else "h2d", name)
        elif dev.type != "cpu":
            devs = {t.device.type for t in ts if t.dim() > 0}
            if "cpu" in devs and len(devs) > 1:
                self.rec.add("mixed", name)
        return out


class _Functions(TorchFunctionMode):
    def __init__(self, rec: _Recorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__") and args \
                and isinstance(args[0], torch.Tensor) and args[0].device.type == self.rec.device.type:
            self.rec.add("sync", f"Tensor.{name}")
        elif name in _CREATE_FUNCS and self.rec.device.type != "cpu":
            target = kwargs.get("device")
            if target is not None and torch.device(target).type == self.rec.device.type:
                self.rec.add("h2d", f"torch.{name}(..., device={target})")
        return func(*args, **kwargs)


def audit(step: Callable[[], Any], device: torch.device | str) -> list[Hazard]:
    """Run ``step()`` once eagerly and return the capture hazards it hit on ``device`` (each once,
    in the order first met)."""
    rec = _Recorder(torch.device(device))
    with _Functions(rec), _Dispatch(rec):
        step()
    return list(rec.hazards.values())
