"""GPT-2 (nanoGPT's shape): its forward against a plain jnp GPT-2, the data-flow recipes against float32 (loss,
per-parameter gradient SNR, 8-bit saved activations), and a training run from configs/gpt2_base.py."""

import dataclasses
import io
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import snr_db, write_tiny_corpus
from jax._src.ad_checkpoint import saved_residuals

from qjax import models
from qjax.generate import restore_workdir
from qjax.models import gpt2, vit
from qjax.train import config as config_lib, train
from qjax.train.config import ConfigError
from qjax.train.task import make_task

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # configs/gpt2_base.py imports `configs`

FAST_COMPILE = {"xla_backend_optimization_level": 0}
CONFIG = models.gpt2_config("tiny", vocab_size=128, dim=128, n_layers=2, n_heads=2, mlp_dim=512, max_seq_len=64,
                            attention="xla")
# Byte-level text with structure to learn (as tests/models/test_dataflow.py): a few words in a random order.
_WORDS = b"the king queen lord lady love night day sword crown speak hear heart".split()
TEXT = np.frombuffer(b" ".join(np.random.default_rng(0).choice(_WORDS, size=2000)), np.uint8) % 128
TOKENS = jnp.asarray(TEXT[:16 * 64].reshape(16, 64).astype(np.int32))
# The gradient SNR floors of tests/models/test_dataflow.py (the issue's: 18 dB int8, 13 dB fp8), every parameter.
FLOORS = {"int8_dataflow": 18.0, "fp8_dataflow": 13.0}


def _init(config, tokens):
    return jax.jit(lambda key: models.GPT2(config).init(key, tokens)["params"],
                   compiler_options=FAST_COMPILE)(jax.random.key(1))


def _layer_norm(x, p, eps):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps) * p["scale"] + p["bias"]


def _reference_logits(params, tokens, c):
    """nanoGPT's forward written out in float32 jnp: learned positions, pre-LN causal blocks, tied head."""
    t = tokens.shape[1]
    x = params["embed"]["embedding"][tokens] + params["pos_embed"][:t]
    dense = lambda h, p: h @ p["kernel"] + p["bias"]
    heads = lambda h: h.reshape(*h.shape[:2], c.n_heads, c.head_dim).transpose(0, 2, 1, 3)  # (B, H, T, hd)
    causal = jnp.tril(jnp.ones((t, t), bool))
    for i in range(c.n_layers):
        p = params[f"layers_{i}"]
        q, k, v = map(heads, jnp.split(dense(_layer_norm(x, p["attn_norm"], c.norm_eps), p["attn"]["qkv_proj"]),
                                       3, axis=-1))
        scores = jnp.where(causal, q @ k.transpose(0, 1, 3, 2) / math.sqrt(c.head_dim), -jnp.inf)
        out = (jax.nn.softmax(scores, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(x.shape)
        x = x + dense(out, p["attn"]["o_proj"])
        h = dense(_layer_norm(x, p["mlp_norm"], c.norm_eps), p["mlp"]["fc1"])
        x = x + dense(jax.nn.gelu(h, approximate=True), p["mlp"]["fc2"])
    return _layer_norm(x, params["norm"], c.norm_eps) @ params["embed"]["embedding"].T


def test_presets_shapes_and_params():
    config = models.gpt2_config("gpt2")
    abstract = jax.eval_shape(models.GPT2(config).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    assert models.num_params(abstract) == 124_475_904  # nanoGPT's GPT-2 small, 50304 tokens, wpe counted
    assert abstract["pos_embed"].shape == (1024, 768) and abstract["embed"]["embedding"].shape == (50304, 768)
    assert abstract["layers_11"]["mlp"]["fc1"]["kernel"].shape == (768, 3072)
    assert "lm_head" not in abstract  # tied to the embedding
    n_matmul = 12 * (768 * 3 * 768 + 768 * 768 + 2 * 768 * 3072) + 768 * 50304  # blocks + the tied head
    assert models.flops_per_token(config, 1024) == 6 * n_matmul + 12 * 12 * 768 * 1024
    with pytest.raises(ValueError, match="unknown GPT-2 size 'huge'; valid sizes: tiny, gpt2"):
        models.gpt2_config("huge")
    with pytest.raises(ValueError, match=r"unknown GPT2Config fields \['ffn_dim'\]"):
        models.gpt2_config("tiny", ffn_dim=128)
    with pytest.raises(ValueError, match="sequence length 65 exceeds max_seq_len 64"):
        models.GPT2(CONFIG).init(jax.random.key(0), jnp.zeros((1, 65), jnp.int32))
    with pytest.raises(TypeError, match="generate decodes Llama models .*got a GPT2Config"):
        models.generate(CONFIG, {}, jnp.zeros((1, 4), jnp.int32), 4)


def test_bf16_recipe_is_the_float_reference_and_causal():
    config = dataclasses.replace(CONFIG, compute_dtype="float32")
    tokens = TOKENS[:2, :32]
    params = _init(config, tokens)
    # nanoGPT's init: o_proj and fc2 at 0.02 / sqrt(2 n_layers), the rest 0.02.
    assert abs(float(params["layers_0"]["mlp"]["fc2"]["kernel"].std()) - 0.01) < 0.001
    assert abs(float(params["layers_0"]["attn"]["qkv_proj"]["kernel"].std()) - 0.02) < 0.001
    params = jax.tree.map(lambda p: p + 0.05 * jax.random.normal(jax.random.key(2), p.shape), params)  # biases too
    apply = jax.jit(lambda tokens: models.GPT2(config).apply({"params": params}, tokens),
                    compiler_options=FAST_COMPILE)
    logits = apply(tokens)
    assert logits.shape == (2, 32, 128) and logits.dtype == jnp.float32
    reference = jax.jit(lambda tokens: _reference_logits(params, tokens, config), compiler_options=FAST_COMPILE)
    np.testing.assert_allclose(logits, reference(tokens), rtol=1e-4, atol=1e-4)
    changed = apply(tokens.at[:, 20].set(7))
    np.testing.assert_array_equal(changed[:, :20], logits[:, :20])  # no position sees a later one
    assert not np.allclose(changed[:, 20:], logits[:, 20:])


def _value_and_grad(config, tokens):
    def loss(params, key):
        logits = models.GPT2(config).apply({"params": params}, tokens, rngs={"quant": key})
        return models.lm_loss(logits[:, :-1], tokens[:, 1:])

    return jax.jit(jax.value_and_grad(loss), compiler_options=FAST_COMPILE)


@pytest.mark.parametrize("recipe", list(FLOORS))
def test_dataflow_close_to_float32_with_per_parameter_gradient_snr(recipe):
    # A few float32 steps in, so the gradients are not those of a uniform prediction.
    params = _init(CONFIG, TOKENS)
    step32 = _value_and_grad(dataclasses.replace(CONFIG, compute_dtype="float32"), TOKENS)
    for i in range(3):
        _, grads = step32(params, jax.random.key(i))
        params = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
    ref_loss, ref_grads = step32(params, jax.random.key(5))
    quantized = dataclasses.replace(CONFIG, recipe=recipe)
    assert {r.name for r in models.layer_recipes(quantized).values()} == {recipe, "bf16"}  # bf16: the tied head
    loss, grads = _value_and_grad(quantized, TOKENS)(params, jax.random.key(5))
    assert abs(float(loss) / float(ref_loss) - 1) < 0.005, (float(loss), float(ref_loss))
    for (path, ref), got in zip(jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree.leaves(grads)):
        assert snr_db(ref, got) > FLOORS[recipe], jax.tree_util.keystr(path)


def _block_residuals(config, batch, seq):
    """[(aval, source)] the vjp of one GPT-2 block saves, traced on abstract inputs (nothing runs)."""
    block = vit.Block(config, causal=True, inits=gpt2.block_inits(config))
    x = jax.ShapeDtypeStruct((batch, seq, config.dim), jnp.bfloat16)
    params = jax.eval_shape(block.init, jax.random.key(0), x)
    loss = lambda p, x: block.apply(p, x, rngs={"quant": jax.random.key(0)}).astype(jnp.float32).sum()
    return saved_residuals(loss, params, x)


def _per_token_residuals(config, batch=2, seq=32):
    """[(aval, source)] of the residuals that grow with the batch (activations, not weights or seeds)."""
    once, twice = _block_residuals(config, batch, seq), _block_residuals(config, 2 * batch, seq)
    return [(a, s) for (a, s), (a2, _) in zip(once, twice) if a2.size == 2 * a.size]


@pytest.mark.parametrize("recipe", ["bf16", *FLOORS])
def test_dataflow_block_saves_8bit_activations_only(recipe):
    """Beside attention's own (q, k, v and XLA's scores), a block saves its LayerNorm and GELU inputs and its GEMM
    inputs in 8 bits (plus float32 group / row scales), no compute-dtype activation."""
    config = dataclasses.replace(CONFIG, recipe=recipe)
    saved = _per_token_residuals(config)
    outside_attention = [(a, s) for a, s in saved if "(attention)" not in s and "Attention.__call__" not in s]
    # Scales are (..., 1): one per row or group of 16 / 32 features.
    wide = [(a.str_short(), s) for a, s in outside_attention if a.dtype.itemsize > 1 and a.shape[-1] > 1]
    if recipe == "bf16":
        assert wide  # the norm outputs, GELU's input and the GEMM inputs, in bf16
        return
    assert not wide, wide
    eight_bit = [a.shape for a, _ in outside_attention if a.dtype.itemsize == 1]
    # 3 op inputs (two LayerNorms, GELU) in their saved groups + 4 GEMM inputs (qkv, o, fc1, fc2) as wgrad reads them
    assert len(eight_bit) == 7, eight_bit


def test_trains_from_the_config_file(tmp_path):
    config = config_lib.load_config(str(ROOT / "configs" / "gpt2_int8_dataflow.py"))
    config.data.path = str(write_tiny_corpus(tmp_path / "corpus"))
    config.model.update(dim=64, n_heads=2, mlp_dim=128, remat=True)
    config.batch_size, config.seq_len, config.steps = 8, 32, 30
    config.optimizer.warmup_steps = 3
    config.log_every, config.eval_every, config.eval_batches, config.checkpoint_every = 10, 0, 1, 0
    out = io.StringIO()
    result = train(config, str(tmp_path / "run"), stream=out)
    assert "lm: GPT2 tiny" in out.getvalue() and "qkv/o/fc1/fc2: int8_dataflow x 2 layers; lm_head: bf16" in \
        out.getvalue(), out.getvalue()
    first = float(out.getvalue().split("| loss ")[1].split()[0])
    assert result.train_metrics["loss"] < 0.7 * first, out.getvalue()  # from ~ln 256 toward the words' entropy
    with pytest.raises(ConfigError, match="trained a gpt2 model; generation runs Llama models only"):
        restore_workdir(str(tmp_path / "run"))
    task = make_task(config, vocab_size=256)
    assert isinstance(task.model, models.GPT2) and task.model_config.max_seq_len == 32
    assert task.flops_per_unit == models.flops_per_token(task.model_config, 32)
    config.model.arch = "gpt3"
    with pytest.raises(ConfigError, match=r"config.model.arch must be one of \('llama', 'gpt2'\), got 'gpt3'"):
        train(config, str(tmp_path / "bad"))
    config.model.arch, config.model.size = "gpt2", "125m"
    with pytest.raises(ConfigError, match="config.model.size '125m' is not a gpt2 preset; valid sizes: tiny, gpt2"):
        train(config, str(tmp_path / "bad"))
    config.model.size, config.init_from = "tiny", str(tmp_path / "hf")
    with pytest.raises(ConfigError, match="init_from loads Hugging Face Llama checkpoints; config.model.arch is "
                                          "'gpt2'"):
        train(config, str(tmp_path / "bad"))
