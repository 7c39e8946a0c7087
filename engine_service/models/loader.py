"""Build a model from a config and stream checkpoint tensors into it.

``build_model`` allocates every parameter once, uninitialised, directly on the target
device in the target dtype (no CPU staging copy, no 2x peak). ``load_weights`` consumes a
``(hf_name, tensor)`` stream: names are normalised (VLM ``model.language_model.`` and
``language_model.`` prefixes), vision tower / projector tensors and rotary buffers are
skipped, the family adapter reshapes fused layouts, and each tensor is copied into its
parameter and dropped.

Failure rules: a mis-shaped tensor fails at once naming it and the expected shape; after
the stream, missing language-model tensors fail listing them with their shapes. ``mtp.*``
tensors load into ``model.mtp`` when their layout matches and never fail the load: an
incomplete or mismatched MTP set drops the MTP module (logged). Unknown tensors are
logged and skipped.

Progress (``deepwell.progress``): parameter bytes written of the model's total (a bar on a
TTY, ``progress`` log lines otherwise); ``weights_loaded`` logs the tensors read, the bytes and
the seconds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from deepwell.kernels import fp8_gemm
from deepwell.logs import get_logger
from deepwell.progress import Progress
from deepwell.engine_service.loading.fp8 import SCALE_SUFFIX, WEIGHT_SUFFIX, FP8Weight, dequantize_weight
from deepwell.engine_service.layers.backend import ReferenceBackend
from deepwell.engine_service.models.decoder import CausalLM
from deepwell.engine_service.models.registry import Family, resolve
from deepwell.engine_service.models.weights import WeightTargets, missing_error

log = get_logger(__name__)

_SKIP_PREFIXES = (
    "model.visual.",
    "visual.",
    "vision_tower.",
    "model.vision_tower.",
    "multi_modal_projector.",
    "model.multi_modal_projector.",
    "vision_model.",
    "model.vision_model.",
)
_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.mtp.", "mtp."),
)


def normalize_name(name: str) -> str | None:
    """The decoder's parameter name for a checkpoint tensor, or None to skip it."""
    if name.startswith(_SKIP_PREFIXES) or name.endswith("rotary_emb.inv_freq"):
        return None
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


@contextlib.contextmanager
def model_defaults(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Build parameters directly on ``device`` in ``dtype`` (torch's defaults, restored after)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


def build_model(
    config: dict[str, Any],
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    backend: ReferenceBackend | None = None,
) -> tuple[CausalLM, Family, dict[str, Any]]:
    family, tc = resolve(config)
    args = family.build_args(tc)
    with model_defaults(torch.device(device), dtype):
        model = CausalLM(args, backend or ReferenceBackend())
    model.eval()
    return model, family, tc


def random_weights(model: CausalLM, seed: int = 0) -> None:
    """Fill every parameter with random values on its device instead of loading a checkpoint:
    matrices N(0, 0.02), vectors (norm weights, biases, gates) ones. For speed and memory
    measurements of full-size shapes only: the outputs mean nothing."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.fill_(1.0)
    log.warning("random_weights", architecture=model.args.architecture,
                detail="weights are random: for speed measurements only")


@dataclass
class _LoadState:
    skipped: int = 0
    unexpected: list[str] = field(default_factory=list)
    mtp_error: str | None = None


def _offer(
    model: CausalLM,
    main: WeightTargets,
    mtp: WeightTargets,
    state: _LoadState,
    pieces: Iterable[tuple[str, torch.Tensor]],
) -> int:
    """Copy one checkpoint tensor's pieces into their parameters (locals die on return);
    returns the parameter elements written."""
    written = 0
    for pname, t in pieces:
        if pname.startswith("mtp."):
            if model.mtp is None:
                state.skipped += 1
                continue
            try:
                if mtp.offer(pname, t):
                    written += t.numel()
                else:
                    state.mtp_error = state.mtp_error or f"unexpected MTP tensor {pname}"
            except ValueError as exc:
                state.mtp_error = state.mtp_error or str(exc)
        elif main.offer(pname, t):
            written += t.numel()
        elif not (pname == "lm_head.weight" and model.args.tie_embeddings):
            state.unexpected.append(pname)
    return written


class _FP8Targets:
    """Native FP8 loading: the FP8 layers prepared before the load (``fp8_linear.prepare_linears``:
    their ``<m>.weight`` names; ``moe.prepare_experts``: the fused experts' and each expert's) and
    their block. A checkpoint's FP8 pair loads into such a layer
    unchanged when the family's adapter passes the tensor through as it is; otherwise (no FP8
    layer there, or a fused layout to rearrange) it is dequantized and loads as a 16-bit tensor
    would. A 16-bit tensor for an FP8 layer is quantized as it loads."""

    def __init__(self, names: set[str], block: tuple[int, int] | None, adapt: Callable[..., Any]) -> None:
        self.names, self.block, self.adapt = names, block, adapt
        self.native = self.quantized = self.dequantized = 0

    def _passes_through(self, name: str, shape: tuple[int, ...]) -> bool:
        probe = torch.empty(shape, device="meta")
        pieces = list(self.adapt(name, probe))
        return len(pieces) == 1 and pieces[0][0] == name and pieces[0][1] is probe

    def pieces(self, name: str, item: FP8Weight, device: torch.device) -> list[tuple[str, torch.Tensor]]:
        module = name[: -len(WEIGHT_SUFFIX)]
        if name in self.names and self.block is not None and self._passes_through(name, tuple(item.codes.shape)):
            n, k = item.codes.shape
            grid = (-(-n // self.block[0]), -(-k // self.block[1]))
            scale = item.scale_inv.float()
            if scale.numel() == 1:  # per-tensor scaling: the same scale in every block
                scale = scale.reshape(()).expand(grid)
            self.native += 1
            return [(name, item.codes.to(torch.float8_e4m3fn)), (module + SCALE_SUFFIX, scale)]
        w = dequantize_weight(module, item.codes, item.scale_inv, self.block)
        self.dequantized += 1
        return self.quantize(list(self.adapt(name, w)), device)

    def quantize(self, pieces: list[tuple[str, torch.Tensor]], device: torch.device) -> list[tuple[str, torch.Tensor]]:
        out: list[tuple[str, torch.Tensor]] = []
        for pname, t in pieces:
            if pname in self.names and self.block is not None and t.dtype not in (torch.float8_e4m3fn,
                                                                                    torch.float8_e5m2):
                if t.dim() == 3:  # fused experts [E, rows, cols] (layers.moe.FP8Experts): per expert
                    pairs = [fp8_gemm.quantize(t[e].to(device), self.block) for e in range(t.shape[0])]
                    out += [(pname, torch.stack([c for c, _ in pairs])),
                            (pname + "_scale_inv", torch.stack([sc for _, sc in pairs]))]
                else:
                    codes, scales = fp8_gemm.quantize(t.to(device), self.block)
                    out += [(pname, codes), (pname[: -len(WEIGHT_SUFFIX)] + SCALE_SUFFIX, scales)]
                self.quantized += 1
            else:
                out.append((pname, t))
        return out


def load_weights(
    model: CausalLM,
    family: Family,
    text_cfg: dict[str, Any],
    tensors: Iterable[tuple[str, torch.Tensor | FP8Weight]],
    fp8_layers: set[str] | None = None,
    fp8_block: tuple[int, int] | None = None,
) -> None:
    """Stream ``tensors`` into ``model``. The stream may carry ``FP8Weight`` pairs
    (``ModelSource.iter_fp8``) of an FP8 checkpoint whose ``weight_block_size`` is ``fp8_block``;
    with ``fp8_layers`` (the names ``prepare_linears`` returned, prepared with that block) they
    load natively where they fit (``_FP8Targets``), elsewhere dequantized."""
    main = WeightTargets()
    main.add_module(model.model, "model.")
    if not model.args.tie_embeddings:
        main.add_module(model.lm_head, "lm_head.")
    mtp = WeightTargets()
    if model.mtp is not None:
        mtp.add_module(model.mtp, "mtp.")
    state = _LoadState()
    adapt = family.adapter_for(text_cfg)
    fp8 = _FP8Targets(fp8_layers or set(), fp8_block, adapt)
    device = next(model.parameters()).device
    params = list(model.parameters())  # tied weights once
    elem = params[0].element_size() if params else 4
    total = sum(p.numel() for p in params) * elem
    count = 0
    with Progress("loading weights", total=total, unit="B") as bar:
        for raw, tensor in tensors:
            name = normalize_name(raw)
            count += 1
            if name is None:
                state.skipped += 1
            elif isinstance(tensor, FP8Weight):
                bar.update(_offer(model, main, mtp, state, fp8.pieces(name, tensor, device)) * elem)
            elif fp8.names:
                bar.update(_offer(model, main, mtp, state, fp8.quantize(list(adapt(name, tensor)), device)) * elem)
            else:
                bar.update(_offer(model, main, mtp, state, adapt(name, tensor)) * elem)
            # drop our reference before the stream reads the next tensor (peak: one tensor)
            del tensor
    missing = main.missing()
    if missing:
        raise missing_error(missing)
    if model.mtp is not None:
        gone = mtp.missing()
        if gone or state.mtp_error:
            reason = state.mtp_error or f"{len(gone)} MTP tensors missing (e.g. {gone[0][0]})"
            log.warning("mtp_weights_dropped", reason=reason)
            model.mtp = None
    if state.unexpected:
        log.warning(
            "unexpected_tensors_skipped", count=len(state.unexpected), first=state.unexpected[:5]
        )
    log.info(
        "weights_loaded",
        architecture=model.args.architecture,
        tensors=count,
        bytes=total,
        seconds=round(bar.clock() - bar.started, 2),
        skipped=state.skipped,
        mtp=model.mtp is not None,
        **({"fp8_native": fp8.native, "fp8_quantized": fp8.quantized, "fp8_dequantized": fp8.dequantized}
           if fp8.names else {}),
    )
