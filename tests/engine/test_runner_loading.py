"""Loading: HF directory layouts (single, sharded, VLM with vision + MTP tensors, fused or
per-expert MoE), side files, and the errors for bad checkpoints."""

from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deepwell.engine_service.loading import open_model
from deepwell.engine_service.models import build_model
from deepwell.engine_service.runner import TorchModelRunner, build_runner
from tests.engine.helpers_models import one_torch_thread, prompt, run_chunks, save_tiny

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():  # noqa: SIM118
                out[k] = h.get_tensor(k)
    return out


def _logits(path: Path, n: int = 20) -> torch.Tensor:
    r = build_runner(open_model(path), page_size=8)
    r.allocate(8, 1)
    r.reset_state(0)
    return run_chunks(r, prompt(n), [n], [5, 2, 7], slot=0)[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_load")
    for name in ("llama", "qwen3_5", "qwen3_5_moe", "qwen3_next"):
        save_tiny(name, root / name)
    return {p.name: p for p in root.iterdir()}


def _copy(src: Path, dst: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_vlm_layout_skips_vision_and_loads_mtp(tiny: dict[str, Path], tmp_path: Path) -> None:
    src = tiny["qwen3_5"]
    text_cfg = json.loads((src / "config.json").read_text())
    text_cfg["mtp_num_hidden_layers"] = 1
    config = {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": text_cfg,
        "vision_config": {"depth": 1, "hidden_size": 16},
        "tie_word_embeddings": False,
    }
    tensors = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
               for k, v in _tensors(src).items()}
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(48, 16)
    tensors["model.visual.merger.linear_fc1.weight"] = torch.randn(16, 16)
    model, _, _ = build_model(config)
    assert model.mtp is not None
    mtp = {f"mtp.{k}": torch.randn(v.shape) for k, v in model.mtp.state_dict().items()}
    assert "mtp.fc.weight" in mtp and "mtp.layers.0.self_attn.q_proj.weight" in mtp
    dst = _copy(src, tmp_path / "vlm", {**tensors, **mtp}, config)

    assert torch.equal(_logits(dst), _logits(src))
    r = build_runner(open_model(dst))
    assert r.model.mtp is not None
    assert torch.equal(r.model.mtp.fc.weight, mtp["mtp.fc.weight"])
    assert r.architecture == "qwen3_5"


def test_vlm_top_level_tie_word_embeddings_wins() -> None:
    from deepwell.engine_service.models.registry import text_config

    cfg = {"model_type": "qwen3_5", "tie_word_embeddings": True,
           "text_config": {"model_type": "qwen3_5_text", "tie_word_embeddings": False}}
    assert text_config(cfg)["tie_word_embeddings"] is True
    assert text_config({"text_config": {"tie_word_embeddings": False}})["tie_word_embeddings"] is False


def test_mismatched_or_partial_mtp_never_fails_the_load(tiny: dict[str, Path], tmp_path: Path) -> None:
    src = tiny["qwen3_5"]
    cfg = json.loads((src / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1
    tensors = _tensors(src)
    tensors["mtp.fc.weight"] = torch.randn(3, 3)  # wrong shape
    tensors["mtp.something_new.weight"] = torch.randn(4)
    dst = _copy(src, tmp_path / "mtp_bad", tensors, cfg)
    r = build_runner(open_model(dst))
    assert r.model.mtp is None  # dropped, logged
    assert torch.equal(_logits(dst), _logits(src))
    # mtp tensors in a checkpoint whose config has no MTP layers are skipped
    cfg.pop("mtp_num_hidden_layers")
    dst2 = _copy(src, tmp_path / "mtp_unconfigured", tensors, cfg)
    assert build_runner(open_model(dst2)).model.mtp is None


def test_sharded_checkpoint_with_index(tiny: dict[str, Path], tmp_path: Path) -> None:
    src = tiny["llama"]
    tensors = _tensors(src)
    dst = tmp_path / "sharded"
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: tensors[k].contiguous() for k in part}, str(dst / fname))
        weight_map.update({k: fname for k in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert torch.equal(_logits(dst), _logits(src))
    (dst / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="missing"):
        open_model(dst)


def test_fused_experts_equal_per_expert(tiny: dict[str, Path], tmp_path: Path) -> None:
    src = tiny["qwen3_5_moe"]
    tensors = _tensors(src)
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in tensors
    fused: dict[str, torch.Tensor] = {}
    for layer in range(4):
        base = f"model.layers.{layer}.mlp.experts"
        gu, dn = [], []
        for e in range(8):
            g = tensors.pop(f"{base}.{e}.gate_proj.weight")
            u = tensors.pop(f"{base}.{e}.up_proj.weight")
            gu.append(torch.cat([g, u], 0))
            dn.append(tensors.pop(f"{base}.{e}.down_proj.weight"))
        fused[f"{base}.gate_up_proj"] = torch.stack(gu)
        fused[f"{base}.down_proj"] = torch.stack(dn)
    dst = _copy(src, tmp_path / "fused", {**tensors, **fused})
    assert torch.equal(_logits(dst), _logits(src))


def test_missing_tensor_is_named_with_its_shape(tiny: dict[str, Path], tmp_path: Path) -> None:
    src = tiny["qwen3_next"]
    tensors = _tensors(src)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    dst = _copy(src, tmp_path / "missing", tensors)
    with pytest.raises(ValueError) as err:
        build_runner(open_model(dst))
    msg = str(err.value)
    assert "model.layers.1.self_attn.k_proj.weight (expected shape (32, 64))" in msg
    assert "model.layers.0.mlp.experts.3.up_proj.weight (expected shape (32, 64))" in msg


def test_misshaped_tensor_is_named(tiny: dict[str, Path], tmp_path: Path) -> None:
    src = tiny["llama"]
    tensors = _tensors(src)
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(100, 64)
    dst = _copy(src, tmp_path / "misshaped", tensors)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj.weight.*\(100, 64\).*\(128, 64\)"):
        build_runner(open_model(dst))


def test_unexpected_tensors_are_skipped(tiny: dict[str, Path], tmp_path: Path) -> None:
    src = tiny["llama"]
    tensors = _tensors(src)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    tensors["model.some_future_thing.weight"] = torch.ones(3)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()  # tied model
    dst = _copy(src, tmp_path / "extra", tensors)
    assert torch.equal(_logits(dst), _logits(src))


def test_unknown_architecture_lists_supported(tiny: dict[str, Path], tmp_path: Path) -> None:
    src = tiny["llama"]
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    cfg["architectures"] = ["GPT2LMHeadModel"]
    dst = _copy(src, tmp_path / "gpt2", _tensors(src), cfg)
    with pytest.raises(ValueError, match="unsupported architecture.*llama, qwen2, qwen3, qwen3_5"):
        build_runner(open_model(dst))


def test_open_model_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        open_model(tmp_path / "nope")
    with pytest.raises(ValueError, match="neither config.json nor a .gguf"):
        open_model(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="expected a HF directory or a .gguf"):
        open_model(tmp_path / "weights.bin")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        open_model(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        open_model(tmp_path)


def test_side_files_and_chat_template(tiny: dict[str, Path], tmp_path: Path) -> None:
    dst = tmp_path / "side"
    shutil.copytree(tiny["llama"], dst)
    (dst / "tokenizer.json").write_text('{"version": "1.0"}')
    (dst / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "tool_use", "template": "T"},
                                      {"name": "default", "template": "D"}]})
    )
    src = open_model(dst)
    assert src.format == "hf" and src.model_id == "side"
    assert src.chat_template == "D"
    assert src.files["tokenizer.json"]() == b'{"version": "1.0"}'
    assert src.generation_config.get("bos_token_id") == 1
    assert "generation_config.json" in src.files and "config.json" in src.files
    (dst / "chat_template.jinja").write_text("{{ messages }}")
    assert open_model(dst).chat_template == "{{ messages }}"


def test_fp8_checkpoints_go_through_the_fp8_dequantizer(
    tiny: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tiny["llama"]
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    dst = _copy(src, tmp_path / "fp8", _tensors(src), cfg)
    seen: list[str] = []

    def dequantize_stream(stream, config):  # type: ignore[no-untyped-def]
        assert config["quantization_config"]["quant_method"] == "fp8"
        for name, t in stream:
            seen.append(name)
            yield name, t

    fake = types.ModuleType("deepwell.engine_service.loading.fp8")
    fake.dequantize_stream = dequantize_stream  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deepwell.engine_service.loading.fp8", fake)
    assert torch.equal(_logits(dst), _logits(src))
    assert "model.embed_tokens.weight" in seen
    cfg["quantization_config"] = {"quant_method": "awq"}
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="'awq' is not supported"):
        open_model(dst)


def test_runner_reports_model_facts(tiny: dict[str, Path]) -> None:
    r = build_runner(open_model(tiny["qwen3_next"]))
    assert isinstance(r, TorchModelRunner)
    assert (r.vocab_size, r.max_context, r.architecture) == (256, 512, "qwen3_next")
    assert r.device == torch.device("cpu")


_REAL_HYBRID = {
    "vocab_size": 248320, "head_dim": 256, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "linear_num_key_heads": 16,
}
REAL_SIZE = {
    # Qwen3.5-27B dims (DESIGN.md; 8 of its 64 layers), VLM layout: model.language_model.*
    # + model.visual.*
    "qwen3_5_27b": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", True, {
        **_REAL_HYBRID, "model_type": "qwen3_5_text", "hidden_size": 5120,
        "intermediate_size": 17408, "num_hidden_layers": 8, "num_attention_heads": 24,
        "num_key_value_heads": 4, "linear_num_value_heads": 48,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    }),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", True, {
        **_REAL_HYBRID, "model_type": "qwen3_5_moe_text", "hidden_size": 2048,
        "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 2,
        "linear_num_value_heads": 32, "num_experts": 256, "num_experts_per_tok": 8,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    }),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", False, {
        **_REAL_HYBRID, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5120,
        "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 2,
        "linear_num_value_heads": 32, "num_experts": 512, "num_experts_per_tok": 10,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "rope_theta": 1e7, "partial_rotary_factor": 0.25,
    }),
}


@pytest.mark.parametrize("name", list(REAL_SIZE))
def test_real_size_configs_match_hf_parameter_names_and_shapes(name: str) -> None:
    """Built on the meta device (no memory): every tensor of HF's model of a real-size
    config lands on one of our parameters with the same shape, and vice versa."""
    import transformers

    from deepwell.engine_service.models.loader import normalize_name
    from deepwell.engine_service.models.registry import resolve
    from deepwell.engine_service.models.weights import WeightTargets

    cfg_cls, model_cls, vlm, text = REAL_SIZE[name]
    kwargs = {"text_config": dict(text), "vision_config": {"depth": 1}} if vlm else dict(text)
    with torch.device("meta"):
        hf = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kwargs))
    config = {"model_type": name.split("_27b")[0], "text_config": dict(text)} if vlm else dict(text)
    if not vlm:
        config["model_type"] = name
    model, family, tc = build_model(config, device="meta")
    targets = WeightTargets()
    targets.add_module(model.model, "model.")
    targets.add_module(model.lm_head, "lm_head.")
    adapt = family.adapter_for(tc)
    covered: set[str] = set()
    for key, tensor in hf.state_dict().items():
        mapped = normalize_name(key)
        if mapped is None:
            assert "visual" in key
            continue
        for pname, t in adapt(mapped, tensor):
            target = targets.targets.get(pname)
            assert target is not None, key
            assert target.shape == tuple(t.shape), (key, target.shape, tuple(t.shape))
            covered.update(target.covers)
    assert resolve(config)[0].name == name.split("_27b")[0]
    assert set(targets.required) <= covered


def test_loading_streams_one_tensor_at_a_time(tiny: dict[str, Path]) -> None:
    """When the stream reads tensor i + 1, nothing holds tensor i any more (no 2x peak;
    tensors have no reference cycles, so refcounting frees them at once)."""
    import weakref

    from deepwell.engine_service.models import load_weights

    src = open_model(tiny["qwen3_next"])  # exercises the de-interleaving adapter too
    model, family, tc = build_model(src.config)
    alive: list[str] = []

    def stream():  # type: ignore[no-untyped-def]
        prev: weakref.ref | None = None
        prev_name = ""
        for name, t in src.iter_tensors():
            if prev is not None and prev() is not None:
                alive.append(prev_name)
            prev, prev_name = weakref.ref(t), name
            yield name, t
            del t

    load_weights(model, family, tc, stream())
    assert alive == []


def test_gguf_paths_dispatch_to_the_gguf_loader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[Path] = []
    fake = types.ModuleType("deepwell.engine_service.loading.gguf")
    fake.open_gguf = lambda p: opened.append(Path(p)) or "source"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deepwell.engine_service.loading.gguf", fake)
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert open_model(f) == "source"
    assert open_model(tmp_path) == "source"  # a directory holding exactly one .gguf
    assert opened == [f, f]
    (tmp_path / "n.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="several .gguf files"):
        open_model(tmp_path)


def test_random_weights_need_no_weight_files(tmp_path) -> None:
    """``--random-weights``: a directory with config.json only builds and runs (finite logits)."""
    import json

    import torch

    from deepwell.engine_service.loading import open_model
    from deepwell.engine_service.runner import build_runner
    from deepwell.engine_service.runner_api import ForwardBatch, SeqSlice
    from tests.engine.helpers_models import TINY

    _, _, _, kwargs = TINY["qwen3_5"]
    (tmp_path / "config.json").write_text(json.dumps({**kwargs, "model_type": "qwen3_5_text",
                                                      "architectures": ["Qwen3_5ForCausalLM"]}))
    with pytest.raises(ValueError, match="no \\*.safetensors weights"):
        open_model(tmp_path)
    r = build_runner(open_model(tmp_path, weights=False), random=True)
    r.allocate(4, 1)
    r.reset_state(0)
    out = r.forward(ForwardBatch(torch.arange(3, 20), [SeqSlice(0, [0, 1, 2, 3], 0, 17)]))
    assert out.shape == (1, r.vocab_size) and bool(torch.isfinite(out).all())
