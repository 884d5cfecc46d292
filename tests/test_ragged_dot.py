"""qjax.ragged_dot: lax.ragged_dot's contract, quantized GEMMs' SNR, ragged edge cases, transformations, bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import snr_db
from jax import lax

import qjax

M, K, N, G = 256, 128, 128, 4
SIZES = jnp.array([64, 0, 112, 80], jnp.int32)  # an empty group


def _operands(seed=0):
    """x with outlier features, per-expert weights of different magnitudes, an upstream gradient."""
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (M, K)).at[:, ::61].mul(20.0)
    w = jax.random.normal(kw, (G, K, N)) * 0.02 * jnp.array([1.0, 3.0, 0.3, 1.0])[:, None, None]
    g = jax.random.normal(kg, (M, N)).at[:, ::53].mul(5.0)
    return x, w, g


def _value_and_grads(fn, x, w, g, sizes):
    out, vjp = jax.vjp(lambda x, w: fn(x, w, sizes), x, w)
    return (out, *vjp(g.astype(out.dtype)))


@functools.cache
def _ragged(name):
    return lambda x, w, s: qjax.ragged_dot(x, w, s, recipe=name)


def _snrs(recipe, sizes=SIZES, key=None):
    x, w, g = _operands()
    exact = lambda x, w, s: lax.ragged_dot(x, w, s, precision=lax.Precision.HIGHEST)
    quantized = jax.jit(lambda x, w, s: qjax.ragged_dot(x, w, s, recipe=recipe, key=key))
    return [snr_db(r, q) for r, q in zip(_value_and_grads(exact, x, w, g, sizes),
                                          _value_and_grads(quantized, x, w, g, sizes))]


def test_bf16_recipe_is_lax_ragged_dot_exactly():
    """Without kernels (on a Hopper GPU bf16 runs JAX's grouped kernels: tests/kernels/test_grouped_matmul_mgpu.py)."""
    x, w, g = (a.astype(jnp.bfloat16) for a in _operands())
    with qjax.dispatch.force("reference"):
        ours = _value_and_grads(lambda x, w, s: qjax.ragged_dot(x, w, s, recipe="bf16"), x, w, g, SIZES)
    theirs = _value_and_grads(lax.ragged_dot, x, w, g, SIZES)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


@pytest.mark.parametrize("name, out_db, grad_db", [("int8_rowwise", 25, 20), ("fp8_rowwise", 18, 15),
                                                   ("fp8_tensorwise", 18, 15), ("fp8_blockwise", 18, 15),
                                                   ("mxfp8", 18, 15)])
def test_snr(name, out_db, grad_db):
    out, dx, dw = _snrs(name)
    assert out >= out_db and dx >= grad_db and dw >= grad_db, (out, dx, dw)


def test_stochastic_gradients_need_a_key_and_stay_accurate():
    recipe = qjax.with_stochastic_gradients(qjax.recipe("int8_rowwise"))
    x, w, _ = _operands()
    with pytest.raises(ValueError, match="stochastic rounding: pass key"):
        qjax.ragged_dot(x, w, SIZES, recipe=recipe)
    assert min(_snrs(recipe, key=jax.random.key(1))) >= 20


@pytest.mark.parametrize("name, sizes", [("int8_rowwise", [M, 0, 0, 0]), ("fp8_tensorwise", [0, 0, 0, M]),
                                         ("int8_rowwise", [10, 0, 30, 0]), ("fp8_rowwise", [0, 0, 0, 0])],
                         ids=["first-has-all", "last-has-all", "sum-below-M", "all-empty"])
def test_ragged_edge_cases_match_lax(name, sizes):
    sizes = jnp.asarray(sizes, jnp.int32)
    x, w, g = _operands()
    rows = int(sizes.sum())
    if rows < M:
        x, g = x.at[-1].set(jnp.nan), g.at[-1].set(jnp.inf)  # in a padding row: must not reach the real rows
    exact = _value_and_grads(lambda x, w, s: lax.ragged_dot(x, w, s, precision=lax.Precision.HIGHEST), x, w, g, sizes)
    ours = jax.jit(_value_and_grads, static_argnums=0)(_ragged(name), x, w, g, sizes)
    for ref, got in zip(exact, ours):
        ref, got = np.asarray(ref), np.asarray(got)
        if rows < M:  # padding rows are exactly 0, as lax's, and nothing else is NaN
            assert np.all(got[rows:] == 0) if got.shape[0] == M else True
        assert np.isfinite(ref).all() and np.isfinite(got).all()
        if np.linalg.norm(ref) > 0:
            assert snr_db(ref, got) > 15
        else:
            assert np.all(got == 0)
    # empty groups get a zero weight gradient
    dw = np.asarray(ours[2])
    assert all(np.all(dw[e] == 0) for e in range(G) if sizes[e] == 0)


@pytest.mark.parametrize("name", ["int8_rowwise", "fp8_blockwise", "bitnet_b158"])
def test_nan_weight_stays_in_its_group(name):
    """A NaN in one expert's weight stays visible in its rows, and the padding rows stay exactly 0: XLA's ragged dot
    (lax.ragged_dot's own, on the block-scaled and high-precision paths) spreads a NaN weight over every row, the
    padding included; an empty group's dw stays 0."""
    x, w, g = _operands()
    sizes = jnp.array([64, 0, 112, 40], jnp.int32)  # 40 padding rows
    w = w.at[0, 3, 5].set(jnp.nan)
    out, dx, dw = jax.jit(_value_and_grads, static_argnums=0)(_ragged(name), x, w, g, sizes)
    out, dx, dw = (np.asarray(a.astype(jnp.float32)) for a in (out, dx, dw))
    assert np.isnan(out[:64]).any() and np.isnan(dx[:64]).any(), "the NaN vanished from its own group"
    for a in (out, dx):
        assert np.all(a[216:] == 0), "padding rows must be exactly 0"
    assert np.all(dw[1] == 0)


def test_jit_vmap_scan_grad():
    x, w, g = _operands()
    f = lambda x, w, s: qjax.ragged_dot(x, w, s, recipe="int8_rowwise")
    direct = _value_and_grads(f, x, w, g, SIZES)
    sizes2 = jnp.stack([SIZES, jnp.array([0, M, 0, 0], jnp.int32)])
    batched = jax.jit(jax.vmap(lambda x, w, g, s: _value_and_grads(f, x, w, g, s)))(
        jnp.stack([x, x]), jnp.stack([w, w]), jnp.stack([g, g]), sizes2)
    for a, b in zip(direct, batched):
        np.testing.assert_allclose(np.asarray(b[0]), np.asarray(a), rtol=1e-5, atol=1e-5)
    lax_batched = jax.vmap(lambda x, w, g, s: _value_and_grads(lax.ragged_dot, x, w, g, s))(
        jnp.stack([x, x]), jnp.stack([w, w]), jnp.stack([g, g]), sizes2)
    assert all(snr_db(r[1], q[1]) > 20 for r, q in zip(lax_batched, batched))  # the second batch's own groups

    def body(carry, w_layer):
        return jnp.tanh(f(carry, w_layer, jnp.array([M, 0], jnp.int32))), None

    loss = lambda x, ws: jnp.sum(lax.scan(body, x[:, :N], ws)[0])
    ws = jnp.stack([w[:2, :N], w[2:, :N]])  # two layers of (G=2, N, N)
    grads = jax.jit(jax.grad(loss, (0, 1)))(x, ws)
    ref = jax.grad(lambda x, ws: jnp.sum(lax.scan(
        lambda c, wl: (jnp.tanh(lax.ragged_dot(c, wl, jnp.array([M, 0], jnp.int32))), None), x[:, :N], ws)[0]),
        (0, 1))(x, ws)
    assert all(snr_db(r, q) > 20 for r, q in zip(ref, grads))


def test_bad_group_sizes_raise():
    x, w, _ = _operands()
    cases = [(jnp.array([64, -1, 100, 80], jnp.int32), ">= 0"), (SIZES.astype(jnp.int64 if jax.config.x64_enabled
                                                                               else jnp.int16), "int32"),
             (jnp.array([64, 0, 112, 80, 0], jnp.int32), r"shape \(4,\)"), ([64, 0, 112, 80], "int32"),
             (jnp.array([200, 0, 112, 80], jnp.int32), "sum to at most")]
    for sizes, match in cases:
        with pytest.raises(ValueError, match=match):
            qjax.ragged_dot(x, w, sizes, recipe="int8_rowwise")
    with pytest.raises(ValueError, match="lhs \\(M, K\\) and rhs \\(G, K, N\\)"):
        qjax.ragged_dot(x, w[:, :100], SIZES, recipe="int8_rowwise")
