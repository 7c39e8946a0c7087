"""GGUF loading: config mapping, tensor names, dequantization, Q/K unpermutation.

The real SmolLM2-135M-Instruct Q4_1 GGUF is compared tensor by tensor with transformers
loading the same file in ``test_smollm2.py`` (which loads transformers' model once for all its
comparisons); tiny GGUFs written here with ``gguf.GGUFWriter`` cover what that file does not
(qwen2/qwen3, biases, Q8_0/F16 round trips, errors).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from deepwell.engine_service.loading.gguf import GGUFError, hf_tensor_name, open_gguf, unpermute_qk


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (HF rotate-half -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_rotate_half(x: torch.Tensor, pos: int, base: float = 10000.0) -> torch.Tensor:
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.cat([pos * inv, pos * inv])
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * ang.cos() + torch.cat([-x2, x1], dim=-1) * ang.sin()


def rope_interleaved(x: torch.Tensor, pos: int, base: float = 10000.0) -> torch.Tensor:
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    c, s = (pos * inv).cos(), (pos * inv).sin()
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)


# --- unit tests --------------------------------------------------------------------------


@pytest.mark.parametrize(("n_head", "head_dim", "cols"), [(9, 64, 576), (3, 64, 576), (2, 8, 5), (4, 6, 1)])
def test_unpermute_inverts_llama_cpp_permute(n_head, head_dim, cols):
    rng = np.random.default_rng(n_head * head_dim)
    w = rng.standard_normal((n_head * head_dim, cols)).astype(np.float32)
    permuted = torch.from_numpy(llama_cpp_permute(w, n_head))
    assert torch.equal(unpermute_qk(permuted, n_head), torch.from_numpy(w))
    bias = w[:, 0].copy()
    assert torch.equal(unpermute_qk(torch.from_numpy(llama_cpp_permute(bias, n_head)), n_head), torch.from_numpy(bias))


def test_unpermuted_weights_give_hf_rope_scores():
    """llama.cpp's interleaved RoPE on its permuted rows == HF rotate-half RoPE on ours."""
    g = torch.Generator().manual_seed(0)
    n_head, hd, hidden = 2, 8, 12
    wq, wk = torch.randn(n_head * hd, hidden, generator=g), torch.randn(n_head * hd, hidden, generator=g)
    x1, x2 = torch.randn(hidden, generator=g), torch.randn(hidden, generator=g)
    pq = torch.from_numpy(llama_cpp_permute(wq.numpy(), n_head))
    pk = torch.from_numpy(llama_cpp_permute(wk.numpy(), n_head))
    uq, uk = unpermute_qk(pq, n_head), unpermute_qk(pk, n_head)

    def heads(v: torch.Tensor) -> torch.Tensor:
        return v.double().view(n_head, hd)

    # q at position 5 attends to k at position 2, per head
    hf = (rope_rotate_half(heads(uq @ x1), 5) * rope_rotate_half(heads(uk @ x2), 2)).sum(-1)
    cpp = (rope_interleaved(heads(pq @ x1), 5) * rope_interleaved(heads(pk @ x2), 2)).sum(-1)
    torch.testing.assert_close(hf, cpp, rtol=1e-12, atol=1e-12)


def test_tensor_names():
    assert hf_tensor_name("token_embd.weight", 2) == "model.embed_tokens.weight"
    assert hf_tensor_name("output_norm.weight", 2) == "model.norm.weight"
    assert hf_tensor_name("output.weight", 2) == "lm_head.weight"
    assert hf_tensor_name("blk.1.attn_q.bias", 2) == "model.layers.1.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.0.attn_k_norm.weight", 2) == "model.layers.0.self_attn.k_norm.weight"
    assert hf_tensor_name("blk.1.ffn_down.weight", 2) == "model.layers.1.mlp.down_proj.weight"
    for bad in ("blk.2.attn_q.weight", "blk.0.ffn_gate_exps.weight", "rope_freqs.weight", "token_embd"):
        with pytest.raises(GGUFError, match="no Hugging Face counterpart"):
            hf_tensor_name(bad, 2)


# --- tiny GGUFs written here -------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 32, 4, 2, 8, 64, 300


def _tokenizer(w: gguf.GGUFWriter, pre: str) -> None:
    byte_chars = [chr(c) for c in range(33, 127)]  # a few printable bytes in GPT-2 spelling
    tokens = ["<|bos|>", "<|eos|>", "<think>", *byte_chars, "Ġ", "Ġa", "ab"]
    tokens += [f"<unused{i}>" for i in range(VOCAB - len(tokens))]
    types = [3, 3, 4] + [1] * (len(byte_chars) + 3) + [5] * (VOCAB - len(byte_chars) - 6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ a", "a b"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)
    w.add_chat_template("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")


def write_tiny_gguf(
    path: Path, arch: str, *, bias: bool, qk_norm: bool, tied: bool, pre: str = "qwen2"
) -> dict[str, np.ndarray]:
    """Write a 2-layer model; returns the HF-layout fp32 tensors each GGUF tensor must load as.

    q/k rows are stored permuted the way llama.cpp's converter does for ``llama`` only.
    """
    rng = np.random.default_rng(7)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    if qk_norm:
        w.add_key_length(HEAD_DIM)
        w.add_value_length(HEAD_DIM)
    w.add_sampling_temp(0.7)
    w.add_sampling_top_p(0.8)
    _tokenizer(w, pre)
    expected: dict[str, np.ndarray] = {}

    def put(gguf_name: str, hf_name: str, value: np.ndarray, kind: str = "f32", n_head: int = 0) -> None:
        stored = llama_cpp_permute(value, n_head) if (arch == "llama" and n_head) else value
        if kind == "q8_0":
            assert not n_head, "q8_0 rows are quantized in stored order; keep them unpermuted here"
            raw = gguf.quants.quantize(stored, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gguf_name, raw, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            back = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0)
            assert np.abs(back - value).max() <= np.abs(value).max() / 100  # 8-bit blocks
            expected[hf_name] = back
            return
        if kind == "f16":
            w.add_tensor(gguf_name, stored.astype(np.float16))
            expected[hf_name] = value.astype(np.float16).astype(np.float32)
            return
        w.add_tensor(gguf_name, stored.astype(np.float32))
        expected[hf_name] = value.astype(np.float32)

    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    put("token_embd.weight", "model.embed_tokens.weight", f(VOCAB, HIDDEN), "q8_0")
    put("output_norm.weight", "model.norm.weight", f(HIDDEN))
    if not tied:
        put("output.weight", "lm_head.weight", f(VOCAB, HIDDEN), "f16")
    for i in range(2):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        put(p + "attn_norm.weight", h + "input_layernorm.weight", f(HIDDEN))
        put(p + "ffn_norm.weight", h + "post_attention_layernorm.weight", f(HIDDEN))
        put(p + "attn_q.weight", h + "self_attn.q_proj.weight", f(HEADS * HEAD_DIM, HIDDEN), n_head=HEADS)
        put(p + "attn_k.weight", h + "self_attn.k_proj.weight", f(KV_HEADS * HEAD_DIM, HIDDEN), "f16", KV_HEADS)
        put(p + "attn_v.weight", h + "self_attn.v_proj.weight", f(KV_HEADS * HEAD_DIM, HIDDEN))
        put(p + "attn_output.weight", h + "self_attn.o_proj.weight", f(HIDDEN, HEADS * HEAD_DIM), "q8_0")
        if bias:
            put(p + "attn_q.bias", h + "self_attn.q_proj.bias", f(HEADS * HEAD_DIM), n_head=HEADS)
            put(p + "attn_k.bias", h + "self_attn.k_proj.bias", f(KV_HEADS * HEAD_DIM), n_head=KV_HEADS)
            put(p + "attn_v.bias", h + "self_attn.v_proj.bias", f(KV_HEADS * HEAD_DIM))
        if qk_norm:
            put(p + "attn_q_norm.weight", h + "self_attn.q_norm.weight", f(HEAD_DIM))
            put(p + "attn_k_norm.weight", h + "self_attn.k_norm.weight", f(HEAD_DIM))
        put(p + "ffn_gate.weight", h + "mlp.gate_proj.weight", f(FFN, HIDDEN))
        put(p + "ffn_up.weight", h + "mlp.up_proj.weight", f(FFN, HIDDEN), "f16")
        put(p + "ffn_down.weight", h + "mlp.down_proj.weight", f(HIDDEN, FFN), "q8_0")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.mark.parametrize(
    ("arch", "bias", "qk_norm", "tied"),
    [
        ("llama", False, False, True),
        ("llama", True, False, False),
        ("qwen2", True, False, False),
        ("qwen3", False, True, True),
    ],
)
def test_tiny_gguf_round_trip(tmp_path, arch, bias, qk_norm, tied):
    path = tmp_path / f"tiny-{arch}.gguf"
    expected = write_tiny_gguf(path, arch, bias=bias, qk_norm=qk_norm, tied=tied)
    src = open_gguf(path)
    cfg = src.config
    assert cfg["model_type"] == arch and cfg["architectures"][0].lower().startswith(arch)
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (
        HIDDEN, HEADS, KV_HEADS, HEAD_DIM,
    )  # fmt: skip
    assert (cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]) == (2, FFN, VOCAB)
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6} and cfg["rms_norm_eps"] == 1e-6
    assert cfg["tie_word_embeddings"] is tied and cfg["attention_bias"] is bias
    assert src.generation_config == {
        "bos_token_id": 0, "eos_token_id": 1, "temperature": 0.7, "top_p": 0.8, "do_sample": True,
    }  # fmt: skip
    got = dict(src.iter_tensors())
    assert set(got) == set(expected)
    for name, want in expected.items():
        assert got[name].dtype == torch.float32 and got[name].is_contiguous()
        assert torch.equal(got[name], torch.from_numpy(want)), name
    # config.json and tokenizer files are present and parse
    assert json.loads(src.files["config.json"]())["model_type"] == arch
    assert src.chat_template is not None and "messages" in src.chat_template


def test_tiny_gguf_tokenizer_special_tokens_and_bos(tmp_path):
    from tokenizers import Tokenizer

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "qwen2", bias=True, qk_norm=False, tied=True)
    src = open_gguf(path)
    tok = Tokenizer.from_str(src.files["tokenizer.json"]().decode())
    enc = tok.encode("ab a<think><|eos|>")
    # add_bos_token=True -> BOS first; "ab" merges; " a" merges; <think>, <|eos|> whole
    assert enc.tokens == ["<|bos|>", "ab", "Ġa", "<think>", "<|eos|>"]
    assert tok.decode(enc.ids, skip_special_tokens=True) == "ab a<think>"
    cfg = json.loads(src.files["tokenizer_config.json"]())
    assert (cfg["bos_token"], cfg["eos_token"], cfg["add_bos_token"]) == ("<|bos|>", "<|eos|>", True)
    assert cfg["added_tokens_decoder"]["2"]["special"] is False and cfg["added_tokens_decoder"]["0"]["special"]
    assert cfg["chat_template"] == src.chat_template


def test_errors_are_clear(tmp_path):
    with pytest.raises(GGUFError, match="cannot read GGUF"):
        bad = tmp_path / "bad.gguf"
        bad.write_bytes(b"not a gguf file at all")
        open_gguf(bad)
    good = tmp_path / "good.gguf"
    write_tiny_gguf(good, "llama", bias=False, qk_norm=False, tied=True)
    (tmp_path / "cut.gguf").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(GGUFError, match="cannot read GGUF"):
        open_gguf(tmp_path / "cut.gguf")
    write_tiny_gguf(tmp_path / "pre.gguf", "llama", bias=False, qk_norm=False, tied=True, pre="made-up")
    with pytest.raises(GGUFError, match=r"pre.gguf: GGUF pre-tokenizer 'made-up' is not supported; known: .*smollm"):
        open_gguf(tmp_path / "pre.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match=r"architecture 'mamba' is not supported; supported: llama, qwen2, qwen3"):
        open_gguf(tmp_path / "mamba.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "nohidden.gguf"), "llama")
    w.add_block_count(1)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match=r"GGUF metadata 'llama.embedding_length' is missing"):
        open_gguf(tmp_path / "nohidden.gguf")
