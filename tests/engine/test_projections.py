"""Projections of one input stacked into one GEMM after loading (``layers.projections``): what
stacks and what does not, the outputs as views of the stacked product, and a hybrid model whose
Gated DeltaNet layers fused their four projections giving the unfused model's logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from deepwell.engine_service.layers.fp8_linear import FP8Linear
from deepwell.engine_service.layers.projections import SplitLinear, concat_linears, fuse_group


def _lin(k: int, n: int, bias: bool = False, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias)


def test_linears_stack_and_split_back() -> None:
    layers = [_lin(32, 48, True, 1), _lin(32, 16, True, 2), _lin(32, 5, True, 3)]
    fused = concat_linears(layers)
    assert type(fused) is nn.Linear and fused.weight.shape == (69, 32) and not fused.weight.requires_grad
    split = SplitLinear(fused, [48, 16, 5])
    x = torch.randn(7, 32)
    for got, layer in zip(split(x), layers):
        assert torch.allclose(got, layer(x), rtol=1e-6, atol=1e-6)
    assert split(x)[1].stride() == (69, 1)  # a view of the one product
    # what does not stack: mixed biases, other widths, dtypes, subclasses, a single layer
    assert concat_linears([_lin(32, 8, True), _lin(32, 8)]) is None
    assert concat_linears([_lin(32, 8), _lin(16, 8)]) is None
    assert concat_linears([_lin(32, 8), _lin(32, 8).to(torch.bfloat16)]) is None

    class Padded(nn.Linear):
        pass

    assert concat_linears([Padded(32, 8), _lin(32, 8)]) is None
    assert concat_linears([_lin(32, 8)]) is None


def test_fp8_linears_stack_on_whole_scale_blocks() -> None:
    a, b, c = (FP8Linear.from_linear(_lin(256, n, seed=n)) for n in (256, 128, 96))
    fused = concat_linears([a, b, c])  # 256 and 128 rows are whole 128-row blocks; the last may be partial
    assert isinstance(fused, FP8Linear) and fused.weight.shape == (480, 256) and fused.weight_scale_inv.shape == (4, 2)
    x = torch.randn(3, 256)
    for got, layer in zip(SplitLinear(fused, [256, 128, 96])(x), (a, b, c)):
        assert torch.equal(got, layer(x)) or torch.allclose(got, layer(x), rtol=1e-6, atol=1e-6)
    assert concat_linears([c, a]) is None  # 96 rows then more: the blocks would straddle
    assert concat_linears([a, _lin(256, 8)]) is None  # FP8 beside 16-bit


def test_fuse_group_takes_the_first_plan_that_saves_a_launch() -> None:
    fp8 = FP8Linear.from_linear(_lin(256, 128))
    layers = [fp8, FP8Linear.from_linear(_lin(256, 128)), _lin(256, 4), _lin(256, 4)]
    groups = fuse_group(layers, ([[0, 1, 2, 3]], [[0, 1], [2, 3]]))
    assert groups is not None and [g.sizes for g in groups] == [(128, 128), (4, 4)]
    assert fuse_group([_lin(256, 4), _lin(128, 4)], ([[0, 1]],)) is None


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
def test_gdn_layers_fused_give_the_same_logits(name: str, tmp_path: Path) -> None:
    from deepwell.engine_service.layers.gdn import GatedDeltaNet
    from deepwell.engine_service.layers.projections import fuse_projections
    from deepwell.engine_service.loading import open_model
    from deepwell.engine_service.runner import build_runner
    from tests.engine.helpers_models import prompt, run_chunks, save_tiny

    save_tiny(name, tmp_path)

    def logits(fuse: bool) -> tuple[torch.Tensor, int]:
        r = build_runner(open_model(tmp_path), device="cpu", dtype=torch.float32, page_size=16)
        gdn = [m for m in r.model.modules() if isinstance(m, GatedDeltaNet)]
        if not fuse:  # build_runner fused them: rebuild the unfused forward from the stacked weights
            for m in gdn:
                (proj,) = m.fused_proj
                w = proj.layer.weight
                for part, rows in zip(("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
                                      torch.split(w, proj.sizes)):
                    layer = nn.Linear(w.shape[1], rows.shape[0], bias=False)
                    layer.weight = nn.Parameter(rows.clone(), requires_grad=False)
                    setattr(m, part, layer)
                m.fused_proj = None
        saved = fuse_projections(r.model) if fuse else 0
        assert all((m.fused_proj is not None) == fuse for m in gdn)
        r.allocate(num_pages=12, num_state_slots=2)
        out = []
        for chunks in ([20], [7, 7, 6], [1] * 5):
            r.reset_state(1)
            out += run_chunks(r, prompt(20)[: sum(chunks)], chunks, [7, 2, 9], slot=1)
        return torch.stack(out), saved

    fused, again = logits(True)
    plain, _ = logits(False)
    assert again == 0  # build_runner already fused them (idempotent)
    assert torch.allclose(fused, plain, rtol=1e-5, atol=1e-5), float((fused - plain).abs().max())
