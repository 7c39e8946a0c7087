"""Host-tier copy speed on a GPU: an entry of the Qwen3.5-27B shape moved between the device
pools and the KV-cache daemon's arena, beside the raw pinned-copy bandwidth of the same run.

    python benchmarks/host_copy.py [--tokens 100000 400000] [--kv nvfp4 bf16] [--daemon]

The 27B shape: 16 attention layers x 4 KV heads x head_dim 256 (KV pages of 64 tokens, float
or quantized pools exactly as the engine allocates them), and one state image of 48 Gated
DeltaNet layers (conv [10240, 3] bf16 + recurrent [48, 128, 128] fp32). Pages and slots are
filled with random bytes, the page ids are a random permutation (a real pool's block table).

Prints, per KV format and context length:
- ``raw``: one contiguous copy of the same byte count between the device and the arena
  (a file in /dev/shm, mmap'd and page-locked with ``cudaHostRegister``, as the engine does),
  device-to-host and host-to-device: the link's bandwidth in this run;
- ``export`` / ``import``: ``KVStore.export_entry`` / ``import_entry`` (``kv.pool``: gather
  into a staging buffer, then copy), in GB/s and as a fraction of ``raw``;
- with ``--daemon``: a real ``python -m deepwell.kvcache_daemon`` and the engine's ``HostTier``:
  ``spill`` (Reserve -> copy -> Commit) and ``restore`` (Lookup + pin -> copy -> Release),
  wall seconds per entry, bit-exactness checked.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))

from deepwell.engine_service.kv.float_pool import KVLayout as FloatLayout  # noqa: E402
from deepwell.engine_service.kv.float_pool import KVPool  # noqa: E402
from deepwell.engine_service.kv.pool import Region  # noqa: E402
from deepwell.engine_service.kv.quant_pool import QuantKVPool, quant_layout  # noqa: E402
from deepwell.engine_service.kv.state import StateLayout, StatePool  # noqa: E402

PAGE = 64
LAYERS, KV_HEADS, HEAD_DIM = 16, 4, 256
STATE = StateLayout(num_layers=48, conv_dim=10240, conv_width=3, num_v_heads=48, head_k_dim=128, head_v_dim=128,
                    conv_dtype=torch.bfloat16)


class Pools:
    """The engine's pools of one format, with the runner's entry byte movers (``EntryBytes``)."""

    def __init__(self, kv: str, pages: int, dev: torch.device) -> None:
        if kv == "bf16":
            self.kv = KVPool(FloatLayout(LAYERS, KV_HEADS, HEAD_DIM, PAGE, torch.bfloat16), pages, dev)
        else:
            self.kv = QuantKVPool(quant_layout(kv, KV_HEADS, HEAD_DIM, PAGE, "on"), LAYERS, pages, dev)
        self.state = StatePool(STATE, 2, dev)
        self.device = dev
        from deepwell.engine_service.kv.pool import row_nbytes

        self.page_nbytes = row_nbytes(self.kv.page_tensors())
        self.slot_nbytes = self.state.slot_nbytes

    def fill(self) -> None:
        g = torch.Generator(device=self.device).manual_seed(0)
        for t in (*self.kv.page_tensors(), *self.state.slot_tensors()):
            raw = t.view(-1).view(torch.uint8) if t.dtype != torch.uint8 else t.view(-1)
            raw.copy_(torch.randint(0, 256, raw.shape, generator=g, device=self.device, dtype=torch.uint8))

    # EntryBytes (cache.host)
    def entry_nbytes(self, num_pages: int, with_state: bool) -> int:
        return num_pages * self.page_nbytes + (self.slot_nbytes if with_state else 0)

    def export_kv(self, pages: list[int], slot: int, out: Region) -> None:
        from deepwell.engine_service.kv.pool import export_rows

        export_rows(self.kv.page_tensors(), pages, out)
        if slot >= 0:
            export_rows(self.state.slot_tensors(), [slot], out, start=len(pages) * self.page_nbytes)

    def import_kv(self, pages: list[int], slot: int, position: int, src: Region, entry_pages: int) -> None:
        from deepwell.engine_service.kv.pool import import_rows

        import_rows(self.kv.page_tensors(), pages, src)
        if slot >= 0:
            import_rows(self.state.slot_tensors(), [slot], src, start=entry_pages * self.page_nbytes)


def arena_dir(nbytes: int) -> str:
    """/dev/shm when it holds the arena, else /tmp (a file-backed mapping, page-locked all the same)."""
    for d in ("/dev/shm", "/tmp"):
        st = os.statvfs(d)
        if st.f_bavail * st.f_frsize > 2 * nbytes + (1 << 30):
            return d
    raise SystemExit(f"no room for a {nbytes / 1e9:.1f} GB arena in /dev/shm or /tmp")


def arena(nbytes: int, dev: torch.device) -> tuple[torch.Tensor, mmap.mmap, str]:
    fd, path = tempfile.mkstemp(dir=arena_dir(nbytes), prefix="dw-hostcopy-")
    os.ftruncate(fd, nbytes)
    m = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)
    t = torch.frombuffer(m, dtype=torch.uint8, count=nbytes)
    t[:: 1 << 12].zero_()  # fault the pages in
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(err) != 0:
        print(f"cudaHostRegister failed: {err}", flush=True)
    return t, m, path


def timed(fn, dev: torch.device, reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(dev)
        best = min(best, time.perf_counter() - t0)
    return best


def run_copies(kv: str, tokens: int, dev: torch.device) -> dict:
    pages = -(-tokens // PAGE)
    pools = Pools(kv, pages + 8, dev)
    pools.fill()
    nbytes = pools.entry_nbytes(pages, True)
    host, m, path = arena(nbytes, dev)
    try:
        table = torch.randperm(pages + 8)[:pages].tolist()
        region = Region([host[:nbytes]])
        dev_buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        d2h = timed(lambda: host[:nbytes].copy_(dev_buf, non_blocking=True), dev)
        h2d = timed(lambda: dev_buf.copy_(host[:nbytes], non_blocking=True), dev)
        exp = timed(lambda: pools.export_kv(table, 0, region), dev)
        before = [t.clone() for t in pools.kv.page_tensors()[:2]]
        other = torch.randperm(pages + 8)[:pages].tolist()
        imp = timed(lambda: pools.import_kv(other, 1, tokens, region, pages), dev)
        exact = all(torch.equal(b[table].view(torch.uint8), t[other].view(torch.uint8))
                    for b, t in zip(before, pools.kv.page_tensors()[:2], strict=True))
        exact = exact and all(torch.equal(t[0].view(torch.uint8), t[1].view(torch.uint8))  # bytes: NaNs
                              for t in pools.state.slot_tensors())
        gb = nbytes / 1e9
        return {"kv": kv, "tokens": tokens, "GB": round(gb, 3), "raw_d2h_GBps": round(gb / d2h, 1),
                "raw_h2d_GBps": round(gb / h2d, 1), "export_s": round(exp, 4), "export_GBps": round(gb / exp, 1),
                "export_vs_raw": round(d2h / exp, 3), "import_s": round(imp, 4), "import_GBps": round(gb / imp, 1),
                "import_vs_raw": round(h2d / imp, 3), "bit_exact": exact}
    finally:
        torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
        del host
        m.close()
        os.unlink(path)


def run_daemon(kv: str, tokens: int, dev: torch.device) -> dict:
    """The engine's HostTier against a real daemon: spill one entry, drop nothing, restore it."""
    import numpy as np

    import asyncio
    import subprocess

    from deepwell import grpcx
    from deepwell.kvclient.client import KVClient
    from deepwell.engine_service.cache.host import HostTier

    pages = -(-tokens // PAGE)
    pools = Pools(kv, 2 * pages + 8, dev)
    pools.fill()
    nbytes = pools.entry_nbytes(pages, True)
    gran = 64 << 20
    size = -(-(nbytes + gran) // gran) * gran
    work = tempfile.mkdtemp(dir=arena_dir(size), prefix="dw-daemon-")
    address = f"unix://{work}/kv.sock"
    d = subprocess.Popen([sys.executable, "-m", "deepwell.kvcache_daemon", "--address", address, "--arena-path",
                          f"{work}/arena", "--arena-bytes", str(size), "--granule-bytes", str(gran),
                          "--log-level", "warning"], cwd=REPO)
    assert asyncio.run(grpcx.wait_healthy(address, "deepwell.kvcache.v1.KVCache", 120)), "daemon did not start"
    client = KVClient(address, "bench", rpc_timeout_s=60.0)
    host = None
    try:
        assert client.start(30)
        host = HostTier(client, pools, fingerprint=b"bench", page_size=PAGE, hybrid=True)
        table = list(range(pages))
        spills = []
        t0 = time.perf_counter()
        host._worker.submit(lambda: None).result()  # the arena's page-locking, started at attach
        lock_s = round(time.perf_counter() - t0, 3)
        for i in range(2):
            ids = (np.arange(tokens, dtype=np.uint32) + 7 * i) % 50000
            t0 = time.perf_counter()
            ok = host.spill(tokens=ids, pages=table, slot=0, tenant="", metadata_digest=b"", session=f"s{i}",
                            checkpoint=True)
            spills.append(round(time.perf_counter() - t0, 3))
        prompt = np.concatenate([ids, np.array([7], dtype=np.uint32)])
        t0 = time.perf_counter()
        lease = host.lookup(prompt, tenant="", metadata_digest=b"", session="s1")
        got = lease is not None and host.restore(lease, list(range(pages, 2 * pages)), 1)
        restore = time.perf_counter() - t0
        t = pools.kv.page_tensors()[0]
        exact = bool(got) and torch.equal(t[:pages].view(torch.uint8), t[pages:2 * pages].view(torch.uint8))
        return {"kv": kv, "tokens": tokens, "GB": round(nbytes / 1e9, 3), "spill_ok": ok,
                "arena_lock_wait_s": lock_s, "spill_s (first, second)": spills, "restore_ok": bool(got), "restore_s": round(restore, 3),
                "restore_GBps": round(nbytes / 1e9 / restore, 1), "bit_exact": exact}
    finally:
        if host is not None:
            host.close()
        client.close()
        d.terminate()
        d.wait(30)
        import shutil

        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[100_000, 400_000])
    ap.add_argument("--kv", nargs="+", default=["nvfp4", "bf16"])
    ap.add_argument("--daemon", action="store_true", help="also spill / restore through a real daemon")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(dev)}; torch {torch.__version__}", flush=True)
    for kv in args.kv:
        for n in args.tokens:
            print(run_copies(kv, n, dev), flush=True)
            if args.daemon:
                print(run_daemon(kv, n, dev), flush=True)
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
