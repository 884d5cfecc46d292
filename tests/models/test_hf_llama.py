"""Hugging Face Llama checkpoints: qjax logits vs a numpy HF-layout forward, save/load round trip, shards, errors,
and (where torch and transformers import) parity with transformers' LlamaForCausalLM."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import save_hf_dir, snr_db

from qjax import models
from qjax.models import hf_checkpoint, hf_llama

HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96, "hidden_size": 64,
             "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 500.0, "tie_word_embeddings": False,
             "hidden_act": "silu"}


def random_hf_tensors(hf: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 tensors in the HF Llama layout ((out, in) weights), norms near 1."""
    rng = np.random.default_rng(seed)
    d, f, v = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    kv = hf["num_key_value_heads"] * d // hf["num_attention_heads"]
    w = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    norm = lambda: (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    t = {"model.embed_tokens.weight": w(v, d), "model.norm.weight": norm()}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update({p + "self_attn.q_proj.weight": w(d, d), p + "self_attn.k_proj.weight": w(kv, d),
                  p + "self_attn.v_proj.weight": w(kv, d), p + "self_attn.o_proj.weight": w(d, d),
                  p + "mlp.gate_proj.weight": w(f, d), p + "mlp.up_proj.weight": w(f, d),
                  p + "mlp.down_proj.weight": w(d, f), p + "input_layernorm.weight": norm(),
                  p + "post_attention_layernorm.weight": norm()})
    if not hf["tie_word_embeddings"]:
        t["lm_head.weight"] = w(v, d)
    return t


def write_hf_dir(path, hf: dict = HF_CONFIG, tensors=None) -> dict[str, np.ndarray]:
    """A Hugging Face model directory (config.json + model.safetensors) with random weights; returns the tensors."""
    return save_hf_dir(path, hf, random_hf_tensors(hf) if tensors is None else tensors)


def hf_reference_logits(hf: dict, t: dict, tokens: np.ndarray) -> np.ndarray:
    """transformers' LlamaForCausalLM forward written in numpy, float64: (B, T) int -> (B, T, vocab)."""
    d, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    n_kv, hd, eps = hf["num_key_value_heads"], d // n_heads, hf["rms_norm_eps"]
    t = {k: v.astype(np.float64) for k, v in t.items()}
    rms = lambda x, w: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w
    seq = tokens.shape[1]
    inv_freq = 1.0 / hf["rope_theta"] ** (np.arange(0, hd, 2) / hd)
    emb = np.concatenate([np.outer(np.arange(seq), inv_freq)] * 2, axis=-1)  # (T, hd), HF's cat((freqs, freqs))
    cos, sin = np.cos(emb)[None, None], np.sin(emb)[None, None]
    rotate_half = lambda x: np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], axis=-1)
    rope = lambda x: x * cos + rotate_half(x) * sin
    causal = np.tril(np.ones((seq, seq), bool))
    x = t["model.embed_tokens.weight"][tokens]
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, t[p + "input_layernorm.weight"])
        heads = lambda w, n: (h @ t[p + w].T).reshape(*h.shape[:2], n, hd).transpose(0, 2, 1, 3)  # (B, n, T, hd)
        q, k, v = (heads("self_attn.q_proj.weight", n_heads), heads("self_attn.k_proj.weight", n_kv),
                   heads("self_attn.v_proj.weight", n_kv))
        q, k = rope(q), rope(k)
        k, v = np.repeat(k, n_heads // n_kv, axis=1), np.repeat(v, n_heads // n_kv, axis=1)
        s = np.where(causal, q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd), -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a = a / a.sum(-1, keepdims=True)
        o = (a @ v).transpose(0, 2, 1, 3).reshape(*x.shape)
        x = x + o @ t[p + "self_attn.o_proj.weight"].T
        h = rms(x, t[p + "post_attention_layernorm.weight"])
        g, u = h @ t[p + "mlp.gate_proj.weight"].T, h @ t[p + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ t[p + "mlp.down_proj.weight"].T
    x = rms(x, t["model.norm.weight"])
    head = t["model.embed_tokens.weight"] if hf["tie_word_embeddings"] else t["lm_head.weight"]
    return x @ head.T


TOKENS = np.random.default_rng(1).integers(0, HF_CONFIG["vocab_size"], (2, 24))


def _qjax_logits(config, params, tokens=TOKENS):
    # "highest": on a GPU, float32 GEMMs would otherwise run in TF32 (10-bit mantissas), far from 60 dB.
    with jax.default_matmul_precision("highest"):
        return np.asarray(jax.jit(models.Llama(config).apply)({"params": params}, jnp.asarray(tokens)))


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_hf_reference(tmp_path, tied):
    hf = dict(HF_CONFIG, tie_word_embeddings=tied)
    tensors = write_hf_dir(tmp_path, hf)
    config, params = models.load_hf_llama(str(tmp_path), compute_dtype="float32")
    assert (config.dim, config.n_kv_heads, config.ffn_dim, config.tie_embeddings) == (64, 2, 96, tied)
    assert ("lm_head" in params) == (not tied)
    ref = hf_reference_logits(hf, tensors, TOKENS)
    assert snr_db(ref, _qjax_logits(config, params)) >= 60


def test_rope_parameters_of_transformers_5():
    hf = {k: v for k, v in HF_CONFIG.items() if k != "rope_theta"}
    config = hf_llama.config_from_hf(dict(hf, rope_parameters={"rope_type": "default", "rope_theta": 123.0}))
    assert config.rope_theta == 123.0 and hf_llama.config_from_hf(hf).rope_theta == 10000.0


def test_save_load_round_trip_bit_exact(tmp_path):
    write_hf_dir(tmp_path / "in")
    config, params = models.load_hf_llama(str(tmp_path / "in"))
    models.save_hf_llama(config, params, str(tmp_path / "out"))
    config2, params2 = models.load_hf_llama(str(tmp_path / "out"))
    assert config2 == config
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b, strict=True), params, params2)
    with open(tmp_path / "out" / "config.json") as f:
        assert json.load(f)["torch_dtype"] == "float32"


def test_qjax_init_saves_and_loads(tmp_path):
    """A qjax-initialised model written as HF and read back gives the same logits (the tree layouts agree)."""
    config = models.llama_config("tiny", vocab_size=96, compute_dtype="float32")
    params = models.Llama(config).init(jax.random.key(0), jnp.asarray(TOKENS))["params"]
    models.save_hf_llama(config, params, str(tmp_path), max_shard_bytes=40_000)
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    loaded_config, loaded = models.load_hf_llama(str(tmp_path), compute_dtype="float32")
    assert jax.tree.structure(loaded) == jax.tree.structure(params)
    np.testing.assert_array_equal(_qjax_logits(loaded_config, loaded), _qjax_logits(config, params))


def test_bfloat16_checkpoint_loads_exactly(tmp_path):
    write_hf_dir(tmp_path / "f32")
    config, params = models.load_hf_llama(str(tmp_path / "f32"))
    models.save_hf_llama(config, params, str(tmp_path / "bf16"), dtype="bfloat16")
    _, params_bf16 = models.load_hf_llama(str(tmp_path / "bf16"))
    expected = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(np.float32), params)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b, strict=True), params_bf16, expected)


def _break(tmp_path, hf=HF_CONFIG, drop=None, reshape=None):
    tensors = random_hf_tensors(HF_CONFIG)
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][:-1]
    write_hf_dir(tmp_path, hf, tensors)
    return str(tmp_path)


@pytest.mark.parametrize("kind, kwargs, message", [
    ("missing", {"drop": "model.layers.1.mlp.up_proj.weight"}, "missing tensor model.layers.1.mlp.up_proj.weight"),
    ("shape", {"reshape": "model.layers.0.self_attn.k_proj.weight"}, "model.layers.0.self_attn.k_proj.weight has"),
    ("arch", {"hf": dict(HF_CONFIG, architectures=["MistralForCausalLM"])}, "architectures"),
    ("type", {"hf": dict(HF_CONFIG, model_type="gpt2")}, "model_type 'gpt2'"),
    ("field", {"hf": {k: v for k, v in HF_CONFIG.items() if k != "intermediate_size"}}, "'intermediate_size'"),
    ("rope", {"hf": dict(HF_CONFIG, rope_scaling={"rope_type": "llama3"})}, "rope_scaling"),
    ("rope5", {"hf": dict(HF_CONFIG, rope_parameters={"rope_type": "yarn"})}, "rope_parameters"),
])
def test_bad_checkpoints_raise(tmp_path, kind, kwargs, message):
    with pytest.raises(ValueError, match=message):
        models.load_hf_llama(_break(tmp_path, **kwargs))


def test_sharded_index_missing_tensor_and_empty_dir(tmp_path):
    config = models.llama_config("tiny", vocab_size=96, n_layers=1)
    params = models.Llama(config).init(jax.random.key(0), jnp.asarray(TOKENS))["params"]
    models.save_hf_llama(config, params, str(tmp_path / "ckpt"), max_shard_bytes=40_000)
    index_path = tmp_path / "ckpt" / hf_checkpoint.INDEX_FILE
    index = json.loads(index_path.read_text())
    del index["weight_map"]["model.norm.weight"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="missing tensor model.norm.weight"):
        models.load_hf_llama(str(tmp_path / "ckpt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        models.load_hf_llama(str(tmp_path / "empty"))


def test_matches_transformers(tmp_path):
    """Logits and greedy continuation equal transformers' LlamaForCausalLM on the same checkpoint (float32).

    Skipped where torch or transformers does not import (CI); the GPU image has both (device step `hf`)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    write_hf_dir(tmp_path / "hf")
    ours_config, ours = models.load_hf_llama(str(tmp_path / "hf"), compute_dtype="float32")
    models.save_hf_llama(ours_config, ours, str(tmp_path / "saved"))
    for path in ("hf", "saved"):  # the file we were given and the one save_hf_llama wrote
        model = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / path), torch_dtype=torch.float32)
        with torch.no_grad():
            ref = model(torch.as_tensor(TOKENS)).logits.numpy()
        assert snr_db(ref, _qjax_logits(ours_config, ours)) >= 60, path
        with torch.no_grad():
            hf_greedy = model.generate(torch.as_tensor(TOKENS[:, :8]), max_new_tokens=8, do_sample=False,
                                       min_new_tokens=8, pad_token_id=0).numpy()
        with jax.default_matmul_precision("highest"):
            ours_greedy = models.generate(ours_config, ours, TOKENS[:, :8], max_new_tokens=8)
        np.testing.assert_array_equal(np.asarray(ours_greedy), hf_greedy[:, 8:])
