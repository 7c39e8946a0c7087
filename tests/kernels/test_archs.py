"""Every Triton kernel the KV backend launches builds for an A100 (sm_80), offline: Triton's
``fp8e4nv`` type exists only from sm_89, so a kernel naming it outside ``kernels.e4m3_unpack``'s
guard would fail to compile there (``benchmarks/triton_archs.py``: the launches captured from
CPU calls, built with Triton's bundled ``ptxas``; about 25 s)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels.offline import has_ptxas

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not has_ptxas(), reason="this Triton has no NVIDIA backend (ptxas)")
def test_every_backend_kernel_builds_for_sm80(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "triton_archs.py"), "--arch", "80", "--quick"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("sm_80 ")]
    assert len(lines) >= 20 and all(": ok (" in ln for ln in lines)
    for kernel in ("kv_append_fwd_kernel", "paged_attention_fwd_kernel FMT=1", "paged_attention_fwd_kernel FMT=3",
                   "paged_attention_fwd_kernel FMT=4", "dequant_kernel FMT=1", "page_bias_kernel", "merge_kernel"):
        assert any(kernel in ln for ln in lines), kernel
