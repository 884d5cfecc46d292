"""qjax.models.Llama keeps its explicit quantized layers; the same model written plainly (nn.Dense, no qjax layers)
and converted with `qjax.quantize_model` computes the same loss and gradients, bit for bit.

`PlainLlama` is a Llama as a user would write it in Flax: nn.Embed, nn.Dense projections, RMSNorm, RoPE, SwiGLU and
grouped-query attention, with qjax.models' param names (so one params tree feeds both, and `qjax.train`'s sharding
rules apply). Its q/k/v and gate/up projections are fused (one nn.Dense each), as the explicit Llama's are: a fused
layer's output gradient is quantized with one row scale over all its columns, separate layers with one each, so only
the same fusion can be bit-identical. The elementwise pieces are qjax.models.ops' (what is tested is the GEMMs'
conversion). `tests/train/test_train_convert.py` trains it through `config.model.convert`.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import qjax
from qjax import models
from qjax.models.ops import apply_rope, rms_norm, swiglu


class RMSNorm(nn.Module):
    eps: float
    dtype: str

    @nn.compact
    def __call__(self, x):
        return rms_norm(x, self.param("scale", nn.initializers.ones, (x.shape[-1],)), self.eps, self.dtype)


def _dense(config, features, name, residual=False):
    # qjax's Llama init (std 0.02, projections into the residual stream scaled down): with the same param paths
    # (Flax derives each param's key from its path), the same params from the same key
    std = 0.02 / math.sqrt(2 * config.n_layers) if residual else 0.02
    return nn.Dense(features, use_bias=False, dtype=config.compute_dtype, param_dtype=config.param_dtype,
                    kernel_init=nn.initializers.normal(std), name=name)


class Attention(nn.Module):
    config: models.LlamaConfig

    @nn.compact
    def __call__(self, x, positions):
        c = self.config
        b, t, _ = x.shape
        kv = c.n_kv_heads * c.head_dim
        q, k, v = jnp.split(_dense(c, c.dim + 2 * kv, "qkv_proj")(x), [c.dim, c.dim + kv], axis=-1)
        q = apply_rope(q.reshape(b, t, c.n_heads, c.head_dim), positions, theta=c.rope_theta)
        k = apply_rope(k.reshape(b, t, c.n_kv_heads, c.head_dim), positions, theta=c.rope_theta)
        out = jax.nn.dot_product_attention(q, k, v.reshape(b, t, c.n_kv_heads, c.head_dim), is_causal=True)
        return _dense(c, c.dim, "o_proj", residual=True)(out.reshape(b, t, c.dim))


class MLP(nn.Module):
    config: models.LlamaConfig

    @nn.compact
    def __call__(self, x):
        gate, up = jnp.split(_dense(self.config, 2 * self.config.ffn_dim, "gate_up_proj")(x), 2, axis=-1)
        return _dense(self.config, self.config.dim, "down_proj", residual=True)(swiglu(gate, up))


class Block(nn.Module):
    config: models.LlamaConfig

    @nn.compact
    def __call__(self, x, positions):
        c = self.config
        x = x + Attention(c, name="attn")(RMSNorm(c.norm_eps, c.compute_dtype, name="attn_norm")(x), positions)
        return x + MLP(c, name="mlp")(RMSNorm(c.norm_eps, c.compute_dtype, name="mlp_norm")(x))


class PlainLlama(nn.Module):
    """tokens int (B, T) -> logits float32 (B, T, vocab), or the final norm's output with return_hidden=True (the
    calling convention `qjax.train` uses). Reads only the shape, eps, theta and dtypes of `config`."""

    config: models.LlamaConfig

    @nn.compact
    def __call__(self, tokens, return_hidden: bool = False):
        c = self.config
        x = nn.Embed(c.vocab_size, c.dim, param_dtype=c.param_dtype, embedding_init=nn.initializers.normal(0.02),
                     name="embed")(tokens).astype(c.compute_dtype)
        positions = jnp.arange(tokens.shape[1])
        for i in range(c.n_layers):
            x = Block(c, name=f"layers_{i}")(x, positions)
        x = RMSNorm(c.norm_eps, c.compute_dtype, name="norm")(x)
        if return_hidden:
            return x
        return _dense(c, c.vocab_size, "lm_head")(x).astype(jnp.float32)


def _loss_and_grads(model, params, tokens):
    def loss_fn(params):
        return models.lm_loss(model.apply({"params": params}, tokens)[:, :-1], tokens[:, 1:])
    return jax.jit(jax.value_and_grad(loss_fn))(params)


def test_plain_llama_converted_is_bit_identical_to_the_explicit_llama():
    config = models.llama_config("tiny", n_layers=1, recipe="int8_rowwise")  # keeps lm_head in bf16
    explicit = models.Llama(config)
    converted = qjax.quantize_model(PlainLlama(config), "int8_rowwise", skip=("lm_head", "embed"))
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, config.vocab_size)
    params = jax.jit(explicit.init)(jax.random.key(1), tokens)["params"]
    # one params tree feeds both; the plain model even initializes to it
    plain_params = jax.jit(converted.init)(jax.random.key(1), tokens)["params"]
    assert jax.tree.structure(plain_params) == jax.tree.structure(params)
    for p, q in zip(jax.tree.leaves(plain_params), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(p), np.asarray(q))

    loss, grads = _loss_and_grads(explicit, params, tokens)
    converted_loss, converted_grads = _loss_and_grads(converted, params, tokens)
    np.testing.assert_array_equal(np.asarray(converted_loss), np.asarray(loss))
    for (path, g), c in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(converted_grads),
                            strict=True):
        np.testing.assert_array_equal(np.asarray(c), np.asarray(g), err_msg=jax.tree_util.keystr(path))

    # The conversion did quantize (the identity above is not that of two bf16 models): the report reads int8 dots
    # in the traced step for every projection but the skipped LM head.
    rows = qjax.report(converted, {"params": params}, tokens)
    assert {row.path for row in rows if row.quantized} == {
        "layers_0/attn/qkv_proj", "layers_0/attn/o_proj", "layers_0/mlp/gate_up_proj", "layers_0/mlp/down_proj"}
    assert [row.reason for row in rows if row.path == "lm_head"] == ["skip 'lm_head'"]
