"""FP8 block-scaled dequantization: exact maths, partial edge blocks, stream pairing, errors,
and parity with transformers loading the same tiny FP8 checkpoint on CPU."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deepwell.engine_service.loading.fp8 import (
    FP8Error,
    block_size,
    dequantize_stream,
    dequantize_weight,
    is_fp8_checkpoint,
)

FP8_MAX = 448.0


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference quantizer (per block amax / 448), written plainly with loops over blocks."""
    rows, cols = w.shape
    bo, bi = block
    nr, nc = math.ceil(rows / bo), math.ceil(cols / bi)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale = torch.empty(nr, nc, dtype=torch.float32)
    for i in range(nr):
        for j in range(nc):
            tile = w[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi].float()
            s = max(tile.abs().max().item(), 1e-12) / FP8_MAX
            scale[i, j] = s
            q[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi] = (tile / s).to(torch.float8_e4m3fn)
    return q, scale


def reference_dequant(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Element-by-block loop: w[r, c] = q[r, c] * scale[r // bo, c // bi]."""
    out = torch.empty(q.shape, dtype=torch.float32)
    bo, bi = block
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            sl = (slice(i * bo, (i + 1) * bo), slice(j * bi, (j + 1) * bi))
            out[sl] = q[sl].float() * scale[i, j]
    return out


def fp8_config(block: list[int] | None = (128, 128)) -> dict:
    qc: dict = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if block is not None:
        qc["weight_block_size"] = list(block)
    return {"model_type": "llama", "quantization_config": qc}


@pytest.mark.parametrize(
    ("shape", "block"),
    [((256, 384), (128, 128)), ((200, 300), (128, 128)), ((130, 70), (64, 32)), ((7, 5), (4, 4))],
)
def test_dequantize_matches_blockwise_reference_exactly(shape, block):
    g = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(shape, generator=g) * 0.05
    q, scale = quantize_blocks(w, block)
    got = dequantize_weight("m", q, scale, block, torch.float32)
    torch.testing.assert_close(got, reference_dequant(q, scale, block), rtol=0, atol=0)
    # and it is the original weight up to e4m3 rounding (3 mantissa bits: rel. error <= 1/16)
    assert ((got - w).abs() <= w.abs() / 16 + 1e-6).all()


def test_leading_dims_per_tensor_scale_and_dtype():
    g = torch.Generator().manual_seed(1)
    experts = torch.randn(3, 40, 24, generator=g)
    qs = [quantize_blocks(experts[e], (16, 16)) for e in range(3)]
    q = torch.stack([a for a, _ in qs])
    s = torch.stack([b for _, b in qs])
    got = dequantize_weight("experts", q, s, (16, 16), torch.float32)
    for e in range(3):
        torch.testing.assert_close(got[e], reference_dequant(qs[e][0], qs[e][1], (16, 16)), rtol=0, atol=0)
    scalar = torch.tensor(0.25)
    per_tensor = dequantize_weight("t", q[0], scalar, None, torch.float32)
    torch.testing.assert_close(per_tensor, q[0].float() * 0.25, rtol=0, atol=0)
    assert dequantize_weight("t", q[0], s[0], (16, 16)).dtype == torch.float32
    assert dequantize_weight("t", q[0], s[0], (16, 16), torch.bfloat16).dtype == torch.bfloat16


def test_stream_pairs_in_any_order_and_passes_others_through():
    g = torch.Generator().manual_seed(2)
    qa, sa = quantize_blocks(torch.randn(10, 12, generator=g), (4, 8))
    qb, sb = quantize_blocks(torch.randn(9, 3, generator=g), (4, 8))
    norm = torch.randn(12, generator=g)
    stream = [
        ("a.weight_scale_inv", sa),  # scale before weight
        ("norm.weight", norm),
        ("b.weight", qb),  # weight before scale, with another tensor in between
        ("a.input_scale", torch.tensor(1.0)),
        ("a.weight", qa),
        ("b.weight_scale_inv", sb),
    ]
    out = list(dequantize_stream(iter(stream), fp8_config([4, 8]), dtype=torch.float32))
    assert [n for n, _ in out] == ["norm.weight", "a.weight", "b.weight"]
    got = dict(out)
    assert got["norm.weight"] is norm
    torch.testing.assert_close(got["a.weight"], reference_dequant(qa, sa, (4, 8)), rtol=0, atol=0)
    torch.testing.assert_close(got["b.weight"], reference_dequant(qb, sb, (4, 8)), rtol=0, atol=0)


def test_errors_name_the_tensor_and_expected_shape():
    q, s = quantize_blocks(torch.randn(10, 12), (4, 8))
    with pytest.raises(FP8Error, match=r"layer\.weight_scale_inv: shape \(3, 1\).*expected \(3, 2\)"):
        dequantize_weight("layer", q, s[:, :1], (4, 8))
    with pytest.raises(FP8Error, match=r"no \.weight_scale_inv, e\.g\. x\.weight"):
        list(dequantize_stream(iter([("x.weight", q)]), fp8_config([4, 8])))
    with pytest.raises(FP8Error, match=r"scales have no FP8 weight, e\.g\. y\.weight_scale_inv"):
        list(dequantize_stream(iter([("y.weight_scale_inv", s)]), fp8_config([4, 8])))
    with pytest.raises(FP8Error, match="no weight_block_size"):
        list(dequantize_stream(iter([("x.weight", q), ("x.weight_scale_inv", s)]), fp8_config(None)))
    with pytest.raises(FP8Error, match="weight_block_size must be"):
        block_size(fp8_config([0, 8]))
    with pytest.raises(FP8Error, match="no FP8 quantization_config"):
        block_size({"model_type": "llama"})
    assert is_fp8_checkpoint({"text_config": fp8_config()}) and not is_fp8_checkpoint({})


def _tiny_llama_fp8_checkpoint(path: Path, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """A tiny Llama checkpoint whose linear weights are FP8 with block scales; returns fp32 refs."""
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 96,
        "hidden_size": 48,
        "intermediate_size": 80,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 12,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(block),
        },
    }
    g = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(96, 48, generator=g).to(torch.bfloat16),
        "model.norm.weight": (1 + 0.1 * torch.randn(48, generator=g)).to(torch.bfloat16),
        "lm_head.weight": torch.randn(96, 48, generator=g).to(torch.bfloat16),
    }
    expected: dict[str, torch.Tensor] = {}
    shapes = {
        "self_attn.q_proj": (48, 48),
        "self_attn.k_proj": (24, 48),
        "self_attn.v_proj": (24, 48),
        "self_attn.o_proj": (48, 48),
        "mlp.gate_proj": (80, 48),
        "mlp.up_proj": (80, 48),
        "mlp.down_proj": (48, 80),
    }
    for layer in range(2):
        for part in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{layer}.{part}.weight"] = (1 + 0.1 * torch.randn(48, generator=g)).to(
                torch.bfloat16
            )
        for mod, shape in shapes.items():
            q, s = quantize_blocks(torch.randn(shape, generator=g) * 0.1, block)
            name = f"model.layers.{layer}.{mod}"
            tensors[f"{name}.weight"] = q
            tensors[f"{name}.weight_scale_inv"] = s
            expected[f"{name}.weight"] = reference_dequant(q, s, block)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    return expected


def _stream(path: Path):
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            yield name, f.get_tensor(name)


def test_tiny_checkpoint_matches_transformers(tmp_path, monkeypatch):
    # transformers' CPU dequantizer requires whole blocks, so this parity check uses a block
    # dividing every dim; partial edge blocks are covered against the loop reference above.
    block = (8, 16)
    expected = _tiny_llama_fp8_checkpoint(tmp_path, block)
    config = json.loads((tmp_path / "config.json").read_text())
    ours = dict(dequantize_stream(_stream(tmp_path), config, dtype=torch.float32))
    assert not any(n.endswith("_scale_inv") for n in ours)
    for name, ref in expected.items():
        torch.testing.assert_close(ours[name], ref, rtol=0, atol=0)

    import transformers.quantizers.quantizer_finegrained_fp8 as hf_fp8
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    # transformers refuses FP8 checkpoints without `accelerate` installed (not a deepwell
    # dependency), although its CPU path (dequantize on load) never calls into it.
    monkeypatch.setattr(hf_fp8, "is_accelerate_available", lambda: True)
    # Dequantize on load explicitly: transformers picks that path by itself only when no CUDA/XPU
    # device is visible; with one (compute capability >= 8.9) it keeps FP8Linear modules, whose
    # state_dict holds the raw e4m3 weights and scales.
    hf_config = FineGrainedFP8Config(activation_scheme="dynamic", weight_block_size=list(block), dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32, quantization_config=hf_config)
    theirs = model.state_dict()
    for name, value in ours.items():
        # Both dequantize in fp32 (dtype=float32): bit-identical; bf16 tensors pass through.
        torch.testing.assert_close(theirs[name], value.float(), rtol=0, atol=0, msg=name)
