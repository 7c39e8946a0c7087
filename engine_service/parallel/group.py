"""The tensor-parallel process group of one engine: who this rank is and how ranks talk.

``TPGroup`` is a frozen record of the rank, the world size, the rank's device and two process
groups: ``compute`` (the model's all-reduce and all-gather of device tensors: NCCL on CUDA, gloo
on CPU) and ``control`` (gloo over CPU tensors: the runner calls rank 0 broadcasts, the status
every rank reports after a call, the bytes of spilled / restored cache entries). On CPU both are
the same gloo group. Rendezvous is a ``torch.distributed.TCPStore`` on loopback whose port rank
0 picks (port 0) and hands to the workers it starts; ranks never listen beyond loopback.

Messages are JSON objects sent as UTF-8 bytes in a uint8 tensor after an int64 length (no
pickle: a worker never runs code it is sent). One process holds at most one group (the default
``torch.distributed`` group); ``leave`` ends it.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

LOOPBACK = "127.0.0.1"
TIMEOUT_S = 600.0  # a collective waiting longer than this fails (a rank died or hangs)


@dataclass(frozen=True)
class TPGroup:
    rank: int
    world: int
    device: torch.device
    backend: str  # of ``compute``: nccl | gloo
    compute: Any  # torch.distributed ProcessGroup for activations
    control: Any  # gloo ProcessGroup for messages, statuses and entry bytes

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks in place (every rank gets the same bytes); returns ``t``."""
        dist.all_reduce(t, group=self.compute)
        return t

    def all_gather_last(self, t: torch.Tensor, size: int) -> torch.Tensor:
        """The ranks' ``t`` side by side along the last dimension, cut to ``size`` columns."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t, group=self.compute)
        return torch.cat(parts, dim=-1)[..., :size]

    def status(self, failed: bool) -> int:
        """How many ranks failed the call just made (every rank calls this after every call)."""
        flag = torch.tensor([1 if failed else 0], dtype=torch.int64)
        dist.all_reduce(flag, group=self.control)
        return int(flag.item())

    def broadcast_message(self, msg: dict[str, Any] | None = None) -> dict[str, Any]:
        """Rank 0 sends ``msg`` (a JSON object); every rank returns it."""
        if self.rank == 0:
            if msg is None:
                raise ValueError("rank 0 must give the message to broadcast")
            data = json.dumps(msg, separators=(",", ":")).encode()
            head = torch.tensor([len(data)], dtype=torch.int64)
        else:
            head = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(head, src=0, group=self.control)
        if self.rank == 0:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buf = torch.empty(int(head.item()), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.control)
        return msg if self.rank == 0 else json.loads(buf.numpy().tobytes())  # type: ignore[return-value]

    def send_bytes(self, t: torch.Tensor, dst: int) -> None:
        """Send a CPU uint8 tensor to rank ``dst`` (which ``recv_bytes`` the same size)."""
        dist.send(t, dst=dst, group=self.control)

    def recv_bytes(self, t: torch.Tensor, src: int) -> None:
        dist.recv(t, src=src, group=self.control)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: ``cuda:(i + rank)`` for rank 0's ``cuda:i``; the CPU for every rank on CPU."""
    if device.type == "cuda":
        return torch.device("cuda", (device.index or 0) + rank)
    return torch.device("cpu")


def master_store(world: int) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free loopback port (``.port``), before the workers start."""
    return dist.TCPStore(LOOPBACK, 0, world, True, timeout=datetime.timedelta(seconds=TIMEOUT_S),
                         wait_for_workers=False)


def client_store(port: int, world: int) -> dist.TCPStore:
    return dist.TCPStore(LOOPBACK, port, world, False, timeout=datetime.timedelta(seconds=TIMEOUT_S))


def join(store: dist.Store, rank: int, world: int, device: torch.device) -> TPGroup:
    """Join the group (blocks until every rank has); RuntimeError when this process already has one."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a tensor-parallel group (one engine per process)")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    world_group = dist.group.WORLD
    control = dist.new_group(backend="gloo") if backend != "gloo" else world_group
    return TPGroup(rank=rank, world=world, device=device, backend=backend, compute=world_group, control=control)


def leave() -> None:
    """End this process's group (no-op without one)."""
    if dist.is_initialized():
        dist.destroy_process_group()
