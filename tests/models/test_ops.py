"""qjax.models.ops: the custom-VJP norms, SwiGLU, GELU and RoPE compute what autodiff of the plain formulas
computes (forward bit for bit, gradients to float32 rounding) and save less: read with saved_residuals on a block."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals

from qjax import models
from qjax.models import llama, ops, vit

FAST_COMPILE = {"xla_backend_optimization_level": 0}
BF16_ULP = 2.0**-7  # relative spacing of bf16 (8 significant bits) at worst


# The formulations the ops replace (as they were in llama.py; vit.py used Flax's LayerNorm and nn.gelu).
def plain_rms_norm(x, scale, eps, dtype):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * scale.astype(jnp.float32)).astype(dtype)


def plain_layer_norm(x, scale, bias, eps, dtype):
    return nn.LayerNorm(eps, dtype=dtype).apply({"params": {"scale": scale, "bias": bias}}, x)


def plain_swiglu(gate, up):
    return jax.nn.silu(gate) * up


def plain_rope(x, positions, *, theta):
    half = x.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2 / x.shape[-1])
    angles = positions.astype(jnp.float32)[:, None] * inv_freq
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _plain(name, apply):
    """A `Prologue` whose op is the plain formula (the models call only `apply` outside the data-flow recipes)."""
    return ops.Prologue(name, apply=apply, forward=None, backward=None)


# (module, name, plain formula): what the models use in place of the ops once monkeypatched. The blocks' norms,
# SwiGLU and GELU are `Prologue`s (`layers.prologue_dense`); the final norms call the ops directly.
LLAMA_PLAIN = [(llama, "rms_norm", plain_rms_norm), (llama, "apply_rope", plain_rope),
               (llama, "_norm", lambda c: _plain("rms_norm", lambda x, s: plain_rms_norm(
                   x, s, c.norm_eps, jnp.dtype(c.compute_dtype)))),
               (ops, "SWIGLU", _plain("swiglu", lambda gate_up: plain_swiglu(*jnp.split(gate_up, 2, axis=-1))))]
VIT_PLAIN = [(vit, "LayerNorm", lambda eps, dtype, param_dtype, name: nn.LayerNorm(
    eps, dtype=dtype, param_dtype=param_dtype, name=name)),
             (vit, "_norm", lambda c: _plain("layer_norm", lambda x, s, b: plain_layer_norm(
                 x, s, b, c.norm_eps, jnp.dtype(c.compute_dtype)))),
             (ops, "GELU", _plain("gelu", nn.gelu))]


def _use_plain(monkeypatch, patches):
    for module, name, plain in patches:
        monkeypatch.setattr(module, name, plain)


def _value_and_vjp(fn, args, cotangent):
    """(fn(*args), the gradients of <fn(*args), cotangent> for every arg), jitted."""
    def run(args, cotangent):
        y, vjp = jax.vjp(fn, *args)
        return y, vjp(cotangent)
    return jax.jit(run, compiler_options=FAST_COMPILE)(args, cotangent)


def _normal(seed, shape, dtype, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).normal(0, scale, shape), dtype)


def _cases(dtype):
    """{name: (op, plain formula, args, cotangent)}; the activations and the cotangent in `dtype`."""
    x = _normal(0, (2, 8, 64), dtype, scale=3.0)
    scale = _normal(1, (64,), jnp.float32) + 1
    gate, up = _normal(2, (2, 8, 96), dtype, scale=2.0), _normal(3, (2, 8, 96), dtype)
    q = _normal(4, (2, 8, 4, 16), dtype)
    positions = jnp.arange(8) * 37
    return {
        "rms_norm": (lambda x, s: ops.rms_norm(x, s, 1e-5, dtype), lambda x, s: plain_rms_norm(x, s, 1e-5, dtype),
                     (x, scale), _normal(5, x.shape, dtype)),
        "layer_norm": (lambda x, s, b: ops.layer_norm(x, s, b, 1e-6, dtype),
                       lambda x, s, b: plain_layer_norm(x, s, b, 1e-6, dtype),
                       (x + 5, scale, _normal(8, (64,), jnp.float32)), _normal(5, x.shape, dtype)),
        "swiglu": (ops.swiglu, plain_swiglu, (gate, up), _normal(6, gate.shape, dtype)),
        "gelu": (ops.gelu, nn.gelu, (gate,), _normal(6, gate.shape, dtype)),
        "gelu_exact": (ops.gelu_exact, lambda x: nn.gelu(x, approximate=False), (gate,), _normal(6, gate.shape, dtype)),
        "rope": (lambda q: ops.apply_rope(q, positions, theta=500.0),
                 lambda q: plain_rope(q, positions, theta=500.0), (q,), _normal(7, q.shape, dtype)),
    }


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", ["rms_norm", "layer_norm", "swiglu", "gelu", "gelu_exact", "rope"])
def test_ops_match_autodiff_of_the_plain_formula(name, dtype):
    op, plain, args, dy = _cases(dtype)[name]
    y, grads = _value_and_vjp(op, args, dy)
    y_ref, grads_ref = _value_and_vjp(plain, args, dy)
    assert y.dtype == y_ref.dtype == dtype
    if name == "gelu_exact":  # XLA's unoptimized CPU code (FAST_COMPILE) rounds erfc by its graph: ulps apart
        np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref, np.float32), rtol=1e-6, atol=0)
    else:
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))  # bit for bit
    for i, (g, g_ref, arg) in enumerate(zip(grads, grads_ref, args)):
        assert g.dtype == g_ref.dtype == arg.dtype
        g, g_ref = np.asarray(g, np.float32), np.asarray(g_ref, np.float32)
        if arg.dtype == jnp.float32:
            np.testing.assert_allclose(g, g_ref, rtol=2e-6, atol=2e-6 * np.abs(g_ref).max())
        elif name in ("layer_norm", "swiglu", "gelu", "gelu_exact"):
            # bf16 autodiff rounds intermediate steps (the activations' own; Flax's LayerNorm rounds the two paths
            # of x's gradient, through the statistics and through x - mean, to bf16 before adding them). The op
            # computes in float32 and rounds once: within half a bf16 step of the float32 gradient and no farther
            # from it than autodiff.
            plain32 = _cases(jnp.float32)[name][1]
            _, g32 = _value_and_vjp(plain32, [a.astype(jnp.float32) for a in args], dy.astype(jnp.float32))
            g32 = np.asarray(g32[i])
            np.testing.assert_allclose(g, g32, rtol=BF16_ULP / 2 + 1e-5, atol=1e-6)
            assert np.linalg.norm(g - g32) <= np.linalg.norm(g_ref - g32)
        else:  # both round a float32 gradient to bf16 once: one bf16 step apart at most
            np.testing.assert_allclose(g, g_ref, rtol=BF16_ULP, atol=1e-6)


def _assert_matches_plain(loss_fn, params, patches, monkeypatch, compute_dtype):
    """loss_fn(params) -> (loss, model output): equal outputs and close gradients with the ops and with `patches`
    [(module, name, plain formula)] in their place (the models read the ops from their module's globals)."""
    run = lambda: jax.jit(jax.value_and_grad(loss_fn, has_aux=True), compiler_options=FAST_COMPILE)(params)
    (loss, out), grads = run()  # a fresh function each call: traced again after the patches
    _use_plain(monkeypatch, patches)
    (loss_ref, out_ref), grads_ref = run()
    np.testing.assert_array_equal(out, out_ref)
    assert loss == loss_ref
    assert all(np.any(g != 0) for g in jax.tree.leaves(grads))
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        g, g_ref = np.asarray(g), np.asarray(dict(jax.tree_util.tree_leaves_with_path(grads_ref))[path])
        if compute_dtype == "float32":  # rounding only
            np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-4 * np.abs(g_ref).max(), err_msg=str(path))
        else:  # the plain backward's extra bf16 roundings, carried through bf16 GEMMs: 0.4-1.6% measured
            assert np.linalg.norm(g - g_ref) < 3e-2 * np.linalg.norm(g_ref), path


def _random_params(model, *inputs):
    """Random parameters (not init's: ViT's zero head would make every other gradient zero)."""
    shapes = jax.eval_shape(model.init, jax.random.key(0), *inputs)["params"]
    rng = np.random.default_rng(1)
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(0, 0.1, s.shape), s.dtype) + (s.ndim == 1), shapes)


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_llama_matches_the_plain_formulation(compute_dtype, monkeypatch):
    model = models.Llama(models.llama_config("tiny", n_layers=1, compute_dtype=compute_dtype))
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, model.config.vocab_size)

    def loss(p):
        logits = model.apply({"params": p}, tokens)
        return models.lm_loss(logits[:, :-1], tokens[:, 1:]), logits

    _assert_matches_plain(loss, _random_params(model, tokens), LLAMA_PLAIN, monkeypatch, compute_dtype)


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_vit_matches_flax_layer_norm_and_gelu(compute_dtype, monkeypatch):
    model = models.ViT(models.vit_config("tiny", compute_dtype=compute_dtype))
    images = _normal(0, (4, 8, 8, 3), jnp.float32)
    labels = jnp.arange(4) % model.config.num_classes

    def loss(p):
        logits = model.apply({"params": p}, images)
        return models.classification_loss(logits, labels)[0], logits

    _assert_matches_plain(loss, _random_params(model, images), VIT_PLAIN, monkeypatch, compute_dtype)


def _block_activations(block, x, *args):
    """[(shape, dtype, source)] of the residuals of the vjp of block(x, *args) laid out like x's leading (batch, seq)
    axes: its activations (the weights' compute-dtype copies and attention's heads-first internals are left out)."""
    params = jax.eval_shape(block.init, jax.random.key(0), x, *args)
    loss = lambda p, x: block.apply(p, x, *args).astype(jnp.float32).sum()
    residuals = saved_residuals(loss, params, x)
    return [(a.shape, a.dtype, source) for a, source in residuals if a.shape[:2] == x.shape[:2]]


def _bytes_per_token(residuals, tokens):
    return sum(np.prod(shape) * jnp.dtype(dtype).itemsize for shape, dtype, _ in residuals) / tokens


def test_llama_block_saves_no_float32_copies_of_activations(monkeypatch):
    config = dataclasses.replace(models.llama_config("tiny", n_layers=1), attention="xla")
    b, t, d, f = 3, 16, config.dim, config.ffn_dim
    kv = config.n_kv_heads * config.head_dim
    x, positions = jax.ShapeDtypeStruct((b, t, d), jnp.bfloat16), jnp.arange(t)

    saved = _block_activations(llama.Block(config), x, positions)
    # The only float32 activations are the two norms' 1/rms per row; everything else is bf16.
    assert sorted((s, dt) for s, dt, _ in saved if dt != jnp.bfloat16) == [((b, t, 1), jnp.float32)] * 2
    assert all("ops.py" in src for s, dt, src in saved if dt == jnp.float32)
    # bf16: block input and attention-norm output, q (as attention's grouped view), k after RoPE, v, attention
    # output, residual-stream sum and MLP-norm output, gate and up, silu(gate) * up (the down GEMM's input).
    assert _bytes_per_token(saved, b * t) == 2 * (d + d + d + kv + kv + d + d + d + 2 * f + f) + 2 * 4

    _use_plain(monkeypatch, LLAMA_PLAIN)
    plain = _block_activations(llama.Block(config), x, positions)
    # Autodiff of the plain RMSNorm saves its input cast to float32 and the normalized float32 value, per norm.
    assert [(s, dt) for s, dt, _ in plain].count(((b, t, d), jnp.float32)) == 4
    assert _bytes_per_token(saved, b * t) < 0.55 * _bytes_per_token(plain, b * t)


def test_vit_block_saves_no_float32_copies_of_activations(monkeypatch):
    config = dataclasses.replace(models.vit_config("tiny"), attention="xla")
    b, s, d, f = 3, config.num_tokens, config.dim, config.mlp_dim
    x = jax.ShapeDtypeStruct((b, s, d), jnp.bfloat16)

    saved = _block_activations(vit.Block(config), x)
    # float32: only each norm's mean and 1/std per row.
    assert sorted((sh, dt) for sh, dt, _ in saved if dt != jnp.bfloat16) == [((b, s, 1), jnp.float32)] * 4
    # bf16: block input and attention-norm output, q, k, v, attention output, residual-stream sum and MLP-norm
    # output, fc1's output (GELU's input) and GELU's output (fc2's input).
    assert _bytes_per_token(saved, b * s) == 2 * (d + d + 3 * d + d + d + d + f + f) + 4 * 4

    _use_plain(monkeypatch, VIT_PLAIN)
    plain = _block_activations(vit.Block(config), x)
    # Flax's LayerNorm saves x^2, x - mean and the normalized value in float32, per norm.
    assert [(sh, dt) for sh, dt, _ in plain].count(((b, s, d), jnp.float32)) == 6
    assert _bytes_per_token(saved, b * s) < 0.6 * _bytes_per_token(plain, b * s)
