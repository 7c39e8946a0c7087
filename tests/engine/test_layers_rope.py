"""RoPE: inv_freq / attention scaling / cos-sin equal HF's ``_compute_*_parameters``
(within 1e-6 relative) for default, linear, YaRN and llama3, full and partial rotary, from
both ``rope_parameters`` and legacy ``rope_scaling`` configs."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3_5TextConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from deepwell.engine_service.layers.rope import RopeSpec, RotaryEmbedding, apply_rope, inv_freq_and_scale
from tests.engine.helpers_models import one_torch_thread

HEAD_DIM = 256
CASES = {
    "default": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6, "partial_rotary_factor": 0.25},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144,
             "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    "yarn_tiny": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                  "rope_theta": 1e4, "partial_rotary_factor": 0.5, "beta_fast": 16, "beta_slow": 2},
    "yarn_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096,
                    "rope_theta": 1e4, "mscale": 0.707, "mscale_all_dim": 1.0,
                    "partial_rotary_factor": 1.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
               "rope_theta": 5e5, "partial_rotary_factor": 1.0},
}

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)


def _max_pos(params: dict) -> int:
    orig = params.get("original_max_position_embeddings")
    return int(orig * params["factor"]) if orig else 262144


@pytest.mark.parametrize("case", list(CASES))
def test_inv_freq_and_cos_sin_match_hf(case: str) -> None:
    params = dict(CASES[case])
    cfg = Qwen3_5TextConfig(
        head_dim=HEAD_DIM, hidden_size=1024, num_attention_heads=4,
        max_position_embeddings=_max_pos(params), rope_parameters=dict(params),
    )
    if params["rope_type"] == "default":
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

        ref_inv, ref_scale = Qwen3_5TextRotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        ref_inv, ref_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu")
    ours_cfg = {"head_dim": HEAD_DIM, "max_position_embeddings": _max_pos(params),
                "rope_parameters": params}
    spec = RopeSpec.from_config(ours_cfg, HEAD_DIM)
    inv, scale = inv_freq_and_scale(spec)
    assert spec.rotary_dim == int(HEAD_DIM * params["partial_rotary_factor"])
    torch.testing.assert_close(inv, ref_inv.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale, rel=1e-6)
    pos = torch.tensor([0, 1, 7, 31, 32, 1000, 100000, 262143])
    cos, sin = RotaryEmbedding(spec).cos_sin(pos, torch.float32)
    freqs = pos.float()[:, None] * ref_inv.float()[None]
    emb = torch.cat([freqs, freqs], -1)
    torch.testing.assert_close(cos, emb.cos() * ref_scale, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, emb.sin() * ref_scale, rtol=1e-6, atol=1e-6)


def test_legacy_rope_scaling_fields() -> None:
    cfg = {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 4.0},
           "partial_rotary_factor": 0.5, "max_position_embeddings": 4096}
    spec = RopeSpec.from_config(cfg, 64)
    assert (spec.rope_type, spec.factor, spec.theta, spec.rotary_dim) == ("linear", 4.0, 5e5, 32)
    yarn = RopeSpec.from_config(
        {"rope_theta": 1e6, "max_position_embeddings": 131072,
         "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
        128,
    )
    assert (yarn.rope_type, yarn.original_max_position) == ("yarn", 32768)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "mrope_weird"])
def test_unsupported_rope_types_fail(rope_type: str) -> None:
    with pytest.raises(ValueError, match="unsupported rope_type"):
        RopeSpec.from_config({"rope_parameters": {"rope_type": rope_type, "factor": 2.0}}, 64)


def test_apply_rope_partial_matches_hf() -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

    spec = RopeSpec(head_dim=32, rotary_dim=8, theta=1e4)
    pos = torch.arange(10)
    cos, sin = RotaryEmbedding(spec).cos_sin(pos, torch.float32)
    q, k = torch.randn(10, 4, 32), torch.randn(10, 2, 32)
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    torch.testing.assert_close(apply_rope(q, cos, sin), ref_q[0].transpose(0, 1))
    torch.testing.assert_close(apply_rope(k, cos, sin), ref_k[0].transpose(0, 1))
    assert torch.equal(apply_rope(q, cos, sin)[..., 8:], q[..., 8:])
