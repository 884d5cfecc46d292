"""qjax.models.ops: the custom-VJP RMSNorm, SwiGLU and RoPE compute what autodiff of the plain formulas computes
(forward bit for bit, gradients to float32 rounding) and save less: read with saved_residuals on a Llama block."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals

from qjax import models
from qjax.models import llama, ops

FAST_COMPILE = {"xla_backend_optimization_level": 0}
BF16_ULP = 2.0**-7  # relative spacing of bf16 (8 significant bits) at worst


# The formulations the ops replace, as they were in llama.py: autodiff differentiates these.
def plain_rms_norm(x, scale, eps, dtype):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * scale.astype(jnp.float32)).astype(dtype)


def plain_swiglu(gate, up):
    return jax.nn.silu(gate) * up


def plain_rope(x, positions, *, theta):
    half = x.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2 / x.shape[-1])
    angles = positions.astype(jnp.float32)[:, None] * inv_freq
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _value_and_vjp(fn, args, cotangent):
    """(fn(*args), the gradients of <fn(*args), cotangent> for every arg), jitted."""
    def run(args, cotangent):
        y, vjp = jax.vjp(fn, *args)
        return y, vjp(cotangent)
    return jax.jit(run, compiler_options=FAST_COMPILE)(args, cotangent)


def _normal(seed, shape, dtype, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).normal(0, scale, shape), dtype)


def _cases(dtype):
    """(custom op, plain formula, args with float32/bf16 data, float32 cotangent) for each op."""
    x = _normal(0, (2, 8, 64), dtype, scale=3.0)
    scale = _normal(1, (64,), jnp.float32) + 1
    gate, up = _normal(2, (2, 8, 96), dtype, scale=2.0), _normal(3, (2, 8, 96), dtype)
    q = _normal(4, (2, 8, 4, 16), dtype)
    positions = jnp.arange(8) * 37
    return {
        "rms_norm": (lambda x, s: ops.rms_norm(x, s, 1e-5, dtype), lambda x, s: plain_rms_norm(x, s, 1e-5, dtype),
                     (x, scale), _normal(5, x.shape, dtype)),
        "swiglu": (ops.swiglu, plain_swiglu, (gate, up), _normal(6, gate.shape, dtype)),
        "rope": (lambda q: ops.apply_rope(q, positions, theta=500.0),
                 lambda q: plain_rope(q, positions, theta=500.0), (q,), _normal(7, q.shape, dtype)),
    }


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", ["rms_norm", "swiglu", "rope"])
def test_ops_match_autodiff_of_the_plain_formula(name, dtype):
    op, plain, args, dy = _cases(dtype)[name]
    y, grads = _value_and_vjp(op, args, dy)
    y_ref, grads_ref = _value_and_vjp(plain, args, dy)
    assert y.dtype == y_ref.dtype == dtype
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))  # bit for bit
    for i, (g, g_ref, arg) in enumerate(zip(grads, grads_ref, args)):
        assert g.dtype == g_ref.dtype == arg.dtype
        g, g_ref = np.asarray(g, np.float32), np.asarray(g_ref, np.float32)
        if arg.dtype == jnp.float32:
            np.testing.assert_allclose(g, g_ref, rtol=2e-6, atol=2e-6 * np.abs(g_ref).max())
        elif name == "swiglu":
            # bf16 autodiff rounds each of silu's steps; the op computes in float32 and rounds once, so it is
            # within half a bf16 step of the float32 gradient and no farther from it than autodiff.
            _, g32 = _value_and_vjp(plain, [a.astype(jnp.float32) for a in args], dy.astype(jnp.float32))
            g32 = np.asarray(g32[i])
            np.testing.assert_allclose(g, g32, rtol=BF16_ULP / 2 + 1e-5, atol=1e-6)
            assert np.linalg.norm(g - g32) <= np.linalg.norm(g_ref - g32)
        else:  # both round a float32 gradient to bf16 once: one bf16 step apart at most
            np.testing.assert_allclose(g, g_ref, rtol=BF16_ULP, atol=1e-6)


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_llama_matches_the_plain_formulation(compute_dtype, monkeypatch):
    config = models.llama_config("tiny", n_layers=1, compute_dtype=compute_dtype)
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, config.vocab_size)
    params = jax.jit(models.Llama(config).init, compiler_options=FAST_COMPILE)(jax.random.key(1), tokens)["params"]

    def loss_and_grads():  # traced afresh: the model reads rms_norm, swiglu and apply_rope from llama's globals
        def loss(p):
            logits = models.Llama(config).apply({"params": p}, tokens)
            return models.lm_loss(logits[:, :-1], tokens[:, 1:]), logits
        return jax.jit(jax.value_and_grad(loss, has_aux=True), compiler_options=FAST_COMPILE)(params)

    (loss, logits), grads = loss_and_grads()
    monkeypatch.setattr(llama, "rms_norm", plain_rms_norm)
    monkeypatch.setattr(llama, "swiglu", plain_swiglu)
    monkeypatch.setattr(llama, "apply_rope", plain_rope)
    (loss_ref, logits_ref), grads_ref = loss_and_grads()
    np.testing.assert_array_equal(logits, logits_ref)
    assert loss == loss_ref
    # float32: rounding only; bf16: the plain SwiGLU backward's bf16 roundings, carried through the GEMMs.
    rtol = 1e-4 if compute_dtype == "float32" else 2e-2
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        g_ref = np.asarray(dict(jax.tree_util.tree_leaves_with_path(grads_ref))[path])
        np.testing.assert_allclose(g, g_ref, rtol=rtol, atol=rtol * np.abs(g_ref).max(), err_msg=str(path))


def _block_activations(config, batch, seq):
    """[(shape, dtype, source)] of the residuals of one block's vjp laid out (batch, seq, ...): its activations."""
    block = llama.Block(config)
    x = jax.ShapeDtypeStruct((batch, seq, config.dim), jnp.dtype(config.compute_dtype))
    positions = jnp.arange(seq)
    params = jax.eval_shape(block.init, jax.random.key(0), x, positions)
    loss = lambda p, x: block.apply(p, x, positions).astype(jnp.float32).sum()
    return [(a.shape, a.dtype, source) for a, source in saved_residuals(loss, params, x)
            if a.shape[:2] == (batch, seq)]


def test_block_saves_no_float32_copies_of_activations(monkeypatch):
    config = dataclasses.replace(models.llama_config("tiny", n_layers=1), attention="xla")
    b, t, d, f = 3, 16, config.dim, config.ffn_dim
    kv = config.n_kv_heads * config.head_dim
    per_token = lambda residuals: sum(np.prod(s) * jnp.dtype(dt).itemsize for s, dt, _ in residuals) / (b * t)

    saved = _block_activations(config, b, t)
    # The only float32 activations are the two norms' 1/rms per row; everything else is bf16.
    assert sorted((s, dt) for s, dt, _ in saved if dt != jnp.bfloat16) == [((b, t, 1), jnp.float32)] * 2
    assert all("ops.py" in src for s, dt, src in saved if dt == jnp.float32)
    # bf16: block input and attention-norm output, q (as attention's grouped view), k after RoPE, v, attention
    # output, residual-stream sum and MLP-norm output, gate and up, silu(gate) * up (the down GEMM's input).
    assert per_token(saved) == 2 * (d + d + d + kv + kv + d + d + d + 2 * f + f) + 2 * 4

    monkeypatch.setattr(llama, "rms_norm", plain_rms_norm)
    monkeypatch.setattr(llama, "swiglu", plain_swiglu)
    monkeypatch.setattr(llama, "apply_rope", plain_rope)
    plain = _block_activations(config, b, t)
    # Autodiff of the plain RMSNorm saves its input cast to float32 and the normalized float32 value, per norm.
    assert [(s, dt) for s, dt, _ in plain].count(((b, t, d), jnp.float32)) == 4
    assert per_token(saved) < 0.55 * per_token(plain)
