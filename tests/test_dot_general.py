"""qjax.dot_general: numerics per recipe, any dimension numbers, JAX transformations, dtypes and bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import INT8_DATAFLOW_SR, snr_db
from jax import lax
from jax._src.ad_checkpoint import saved_residuals

import qjax

TN = (((1,), (1,)), ((), ()))  # x (M, K) . w (N, K) -> (M, N)
M, K, N = 512, 512, 384


def _operands(outlier_rows=False, seed=0):
    """x with outlier features (and optionally outlier tokens), w, and an upstream gradient g."""
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (M, K)).at[:, ::61].mul(20.0)
    if outlier_rows:
        x = x.at[::97].mul(30.0)
    w = jax.random.normal(kw, (N, K)) * 0.02
    g = jax.random.normal(kg, (M, N)).at[:, ::53].mul(5.0)
    return x, w, g


def _snrs(recipe, x, w, g, dims=TN, key=None):
    """SNR (dB) of output, dgrad and wgrad against a float32 HIGHEST-precision reference."""

    def loss(f):
        return lambda x, w: jnp.sum(f(x, w) * g)

    exact = lambda x, w: lax.dot_general(x, w, dims, precision=lax.Precision.HIGHEST)
    quantized = lambda x, w: qjax.dot_general(x, w, dims, recipe=recipe, key=key)
    ref_grads = jax.grad(loss(exact), (0, 1))(x, w)
    grads = jax.jit(jax.grad(loss(quantized), (0, 1)))(x, w)
    return (snr_db(exact(x, w), jax.jit(quantized)(x, w)), snr_db(ref_grads[0], grads[0]),
            snr_db(ref_grads[1], grads[1]))


def test_bf16_recipe_is_lax_dot_general_exactly():
    x, w, g = (a.astype(jnp.bfloat16) for a in _operands())
    ours = lambda x, w: jnp.sum(qjax.dot_general(x, w, TN, recipe="bf16").astype(jnp.float32) * g)
    theirs = lambda x, w: jnp.sum(lax.dot_general(x, w, TN).astype(jnp.float32) * g)
    np.testing.assert_array_equal(np.asarray(qjax.dot_general(x, w, TN, recipe="bf16")),
                                  np.asarray(lax.dot_general(x, w, TN)))
    for a, b in zip(jax.grad(ours, (0, 1))(x, w), jax.grad(theirs, (0, 1))(x, w)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


INT8 = qjax.recipe("int8_rowwise")
INT8_VARIANTS = {
    "fwd": dataclasses.replace(INT8, name="int8_fwd", dgrad=None, wgrad=None),
    "fwd+dgrad": dataclasses.replace(INT8, name="int8_fwd_dgrad", wgrad=None),
    "all": INT8,
}


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("variant", list(INT8_VARIANTS))
def test_int8_rowwise_snr_above_20db(variant, stochastic):
    recipe = INT8_VARIANTS[variant]
    if stochastic:
        recipe = qjax.with_stochastic_gradients(recipe)
    key = jax.random.key(7) if stochastic else None
    out, dgrad, wgrad = _snrs(recipe, *_operands(), key=key)
    assert min(out, dgrad, wgrad) > 20, (out, dgrad, wgrad)


@pytest.mark.parametrize("name", ["fp8_tensorwise", "fp8_rowwise", "fp8_blockwise"])
def test_fp8_snr(name):
    out, dgrad, wgrad = _snrs(name, *_operands())
    assert out >= 18 and dgrad >= 17 and wgrad >= 17, (out, dgrad, wgrad)


def _blockwise(dtype: str) -> qjax.Recipe:
    """DeepSeek-V3's blocks in `dtype` (fp8_blockwise is the named recipe; int8 blocks are a custom one)."""
    if dtype == "fp8":
        return qjax.recipe("fp8_blockwise")
    gemm = lambda lhs, rhs: qjax.GemmSpec(qjax.QuantSpec("int8", lhs), qjax.QuantSpec("int8", rhs))  # noqa: E731
    return qjax.Recipe("int8_blockwise", fwd=gemm("1x128", "128x128"), dgrad=gemm("1x128", "128x128"),
                       wgrad=gemm("1x128", "1x128"))


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_block_recipes_at_least_as_good_as_rowwise_with_outlier_rows(dtype):
    operands = _operands(outlier_rows=True)
    row = _snrs(f"{dtype}_rowwise", *operands)
    block = _snrs(_blockwise(dtype), *operands)
    assert all(b >= r - 0.5 for b, r in zip(block, row)), (block, row)
    # wgrad quantizes x along the tokens, where the outlier rows are: blocks isolate them. fp8 gains less than int8
    # (its error is relative), only for values a row-wide scale pushes into its subnormal range.
    assert block[2] > row[2] + (3 if dtype == "int8" else 1)


@pytest.mark.parametrize("lhs_shape, rhs_shape, dims", [
    ((4, 64, 256), (96, 256), (((2,), (1,)), ((), ()))),          # (B, T, D) . (F, D)
    ((4, 64, 256), (256, 96), (((2,), (0,)), ((), ()))),          # Flax Dense kernel (D, F)
    ((3, 64, 256), (3, 256, 40), (((2,), (1,)), ((0,), (0,)))),   # batched matmul
    ((64, 4, 64), (4, 64, 96), (((1, 2), (0, 1)), ((), ()))),     # two contracting dims (heads, head_dim)
    ((64, 3, 256), (3, 40, 256), (((2,), (2,)), ((1,), (0,)))),   # batch dim not leading
])
@pytest.mark.parametrize("name", ["int8_rowwise", "fp8_tensorwise"])
def test_any_dimension_numbers(lhs_shape, rhs_shape, dims, name):
    kx, kw = jax.random.split(jax.random.key(1))
    x, w = jax.random.normal(kx, lhs_shape), jax.random.normal(kw, rhs_shape)
    y_ref = lax.dot_general(x, w, dims, precision=lax.Precision.HIGHEST)
    g = jax.random.normal(jax.random.key(2), y_ref.shape)
    y = qjax.dot_general(x, w, dims, recipe=name)
    assert y.shape == y_ref.shape and snr_db(y_ref, y) > 18
    ref = jax.grad(lambda x, w: jnp.sum(lax.dot_general(x, w, dims, precision="highest") * g), (0, 1))(x, w)
    got = jax.grad(lambda x, w: jnp.sum(qjax.dot_general(x, w, dims, recipe=name) * g), (0, 1))(x, w)
    for r, q in zip(ref, got):
        assert q.shape == r.shape and snr_db(r, q) > 17


def test_block_recipe_on_leading_dims():
    x = jax.random.normal(jax.random.key(1), (2, 128, 256))
    w = jax.random.normal(jax.random.key(2), (256, 128))
    dims = (((2,), (0,)), ((), ()))
    y = qjax.dot_general(x, w, dims, recipe="fp8_blockwise")
    assert snr_db(lax.dot_general(x, w, dims, precision="highest"), y) > 18


def _loss(recipe, key=None):
    # A fixed upstream gradient: with sum(y**2) it would depend on y's float rounding, which differs between eager
    # and jit by an ulp and can flip a quantized gradient code.
    g = _operands()[2]
    return lambda x, w: jnp.sum(qjax.dot_general(x, w, TN, recipe=recipe, key=key) * g)


@pytest.mark.parametrize("name", ["int8_rowwise", "fp8_tensorwise", "fp8_blockwise"])
def test_jit_vmap_scan_remat_agree_with_eager(name):
    x, w, _ = _operands()
    eager_grads = jax.grad(_loss(name), (0, 1))(x, w)
    for transformed in (jax.jit(jax.grad(_loss(name), (0, 1))), jax.grad(jax.checkpoint(_loss(name)), (0, 1))):
        for a, b in zip(eager_grads, transformed(x, w)):
            assert snr_db(a, b) > 70  # float32 summation order differs under jit (XLA rewrites the scaled dot)
    # vmap: each example is quantized on its own, as a Python loop would. (Scales shared across the batch would
    # show as ~25-35 dB; on a GPU the batched and per-example GEMMs may differ by fp8 fast-accumulation rounding.)
    xs = x.reshape(4, M // 4, K)
    per_example = jnp.stack([qjax.dot_general(xi, w, TN, recipe=name) for xi in xs])
    assert snr_db(per_example, jax.vmap(lambda xi: qjax.dot_general(xi, w, TN, recipe=name))(xs)) > 50
    # scan over a stack of layers (the way models scan over blocks), differentiated.
    ws = jnp.stack([w[:256, :256], w[128:384, 256:]])  # two (256, 256) layers
    g = jax.random.normal(jax.random.key(5), (M, 256))

    def stack_loss(x, ws):
        body = lambda h, wi: (qjax.dot_general(h, wi, TN, recipe=name), None)
        return jnp.sum(lax.scan(body, x[:, :256], ws)[0] * g)

    def loop_loss(x, ws):
        h = x[:, :256]
        for wi in ws:
            h = qjax.dot_general(h, wi, TN, recipe=name)
        return jnp.sum(h * g)

    # Layer 2 quantizes layer 1's output, whose float rounding differs between scan and the loop by an ulp, which
    # can flip a code; a wrong residual or layout would be ~0-20 dB.
    for a, b in zip(jax.grad(stack_loss, (0, 1))(x, ws), jax.grad(loop_loss, (0, 1))(x, ws)):
        assert snr_db(a, b) > 40


def test_dtypes_follow_inputs_and_preferred_element_type():
    x, w, _ = _operands()
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    assert qjax.dot_general(xb, wb, TN, recipe="int8_rowwise").dtype == jnp.bfloat16
    assert qjax.dot_general(xb, wb, TN, preferred_element_type=jnp.float32, recipe="int8_rowwise").dtype == jnp.float32
    assert qjax.dot_general(xb, w, TN, recipe="fp8_rowwise").dtype == jnp.float32
    dx, dw = jax.grad(lambda x, w: jnp.sum(qjax.dot_general(x, w, TN, recipe="int8_rowwise")), (0, 1))(xb, w)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32


@pytest.mark.parametrize("name", ["int8_rowwise", "fp8_tensorwise"])
def test_only_quantized_operands_are_saved_for_backward(name):
    x, w, _ = (a.astype(jnp.bfloat16) for a in _operands())
    residuals = saved_residuals(lambda x, w: jnp.sum(qjax.dot_general(x, w, TN, recipe=name).astype(jnp.float32)),
                                x, w)
    big = [aval for aval, _ in residuals if aval.size >= N * K]
    assert len(big) == 2 and all(aval.dtype.itemsize == 1 for aval in big), residuals


def test_stochastic_recipe_needs_key_and_is_reproducible():
    recipe = qjax.with_stochastic_gradients(INT8)
    x, w, _ = _operands()
    with pytest.raises(ValueError, match="stochastic rounding: pass key"):
        qjax.dot_general(x, w, TN, recipe=recipe)
    grad = lambda key: jax.grad(_loss(recipe, key), 1)(x, w)
    np.testing.assert_array_equal(np.asarray(grad(jax.random.key(1))), np.asarray(grad(jax.random.key(1))))
    assert not np.array_equal(np.asarray(grad(jax.random.key(1))), np.asarray(grad(jax.random.key(2))))


# Every named recipe, and one that rounds its gradients stochastically (Jetfire's int8 data flow).
EDGE_RECIPES = {**qjax.RECIPES, "int8_dataflow_sr": INT8_DATAFLOW_SR}


@pytest.mark.parametrize("name", list(EDGE_RECIPES))
def test_all_zero_inputs_give_zeros(name):
    zeros = jnp.zeros((256, 256), jnp.bfloat16)
    key = jax.random.key(0)  # for the stochastic recipe
    y, grads = jax.value_and_grad(lambda x, w: jnp.sum(
        qjax.dot_general(x, w, TN, recipe=EDGE_RECIPES[name], key=key).astype(jnp.float32)), (0, 1))(zeros, zeros)
    assert y == 0 and all(np.all(np.asarray(gr) == 0) for gr in grads)


@pytest.mark.parametrize("name", list(EDGE_RECIPES))
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_inputs_stay_visible(name, bad):
    x, w, _ = _operands()
    x = x.at[3, 5].set(bad)
    key = jax.random.key(0)  # for the stochastic recipe
    recipe = EDGE_RECIPES[name]
    y = qjax.dot_general(x, w, TN, recipe=recipe, key=key)
    assert not np.isfinite(np.asarray(y[3])).all()
    dw = jax.grad(lambda w: jnp.sum(qjax.dot_general(x, w, TN, recipe=recipe, key=key)))(w)
    assert not np.isfinite(np.asarray(dw)).all()


def test_bad_input():
    x, w, _ = _operands()
    with pytest.raises(ValueError, match="contracting dimension sizes differ"):
        qjax.dot_general(x, w[:, :100], TN, recipe="int8_rowwise")
    with pytest.raises(ValueError, match="dimension_numbers must be"):
        qjax.dot_general(x, w, ((1,), (1,)), recipe="int8_rowwise")
    with pytest.raises(ValueError, match="distinct dims"):
        qjax.dot_general(x, w, (((2,), (1,)), ((), ())), recipe="int8_rowwise")
    with pytest.raises(TypeError, match="quantizes float inputs; lhs has dtype int32"):
        qjax.dot_general(x.astype(jnp.int32), w, TN, recipe="int8_rowwise")
    with pytest.raises(ValueError, match="unknown recipe"):
        qjax.dot_general(x, w, TN, recipe="int3")
    with pytest.raises(ValueError, match="contracting % 128 == 0"):
        qjax.dot_general(x[:, :100], w[:, :100], TN, recipe="fp8_blockwise")
    with pytest.raises(TypeError, match="PRNG key"):
        qjax.dot_general(x, w, TN, recipe=qjax.with_stochastic_gradients(INT8), key=3)
    with pytest.raises(TypeError, match="PRNG key"):
        qjax.dot_general(x, w, TN, recipe=INT8, key=3)  # checked even where the recipe draws no random bits


@pytest.mark.parametrize("lhs_shape, rhs_shape, dims", [
    ((6, 24, 32), (40, 32), (((2,), (1,)), ((), ()))),
    ((3, 16, 32), (3, 32, 8), (((2,), (1,)), ((0,), (0,)))),
    ((16, 3, 32), (8, 32, 3), (((2,), (1,)), ((1,), (2,)))),             # rhs batch dim last
    ((16, 4, 8), (8, 12, 4), (((1, 2), (2, 0)), ((), ()))),              # two contracting dims, swapped order
    ((2, 16, 3, 8), (3, 8, 5, 2), (((3,), (1,)), ((2, 0), (0, 3)))),     # two batch dims in swapped order
])
def test_exact_on_losslessly_quantizable_inputs(lhs_shape, rhs_shape, dims):
    """Random +-127 entries quantize exactly under int8 row scaling in every layout (every row's amax is 127), so
    values and both gradients must equal lax.dot_general's: a wrong transpose or residual layout shows."""

    def integers(key, shape):
        return jnp.where(jax.random.bernoulli(key, 0.5, shape), 127.0, -127.0)

    x, w = integers(jax.random.key(1), lhs_shape), integers(jax.random.key(2), rhs_shape)
    y_ref = lax.dot_general(x, w, dims, precision="highest")
    g = integers(jax.random.key(3), y_ref.shape)
    loss = lambda f: (lambda x, w: jnp.sum(f(x, w) * g))
    ref = jax.grad(loss(lambda x, w: lax.dot_general(x, w, dims, precision="highest")), (0, 1))(x, w)
    got = jax.jit(jax.grad(loss(lambda x, w: qjax.dot_general(x, w, dims, recipe="int8_rowwise")), (0, 1)))(x, w)
    np.testing.assert_allclose(qjax.dot_general(x, w, dims, recipe="int8_rowwise"), y_ref, rtol=1e-6)
    for r, q in zip(ref, got):
        np.testing.assert_allclose(q, r, rtol=1e-6)


def test_float16_inputs_do_not_overflow():
    x = jax.random.normal(jax.random.key(1), (64, 1024)).astype(jnp.float16)
    w = jax.random.normal(jax.random.key(2), (64, 1024)).astype(jnp.float16)
    y_ref = lax.dot_general(x.astype(jnp.float32), w.astype(jnp.float32), TN, precision="highest")
    for name in ("int8_rowwise", "fp8_tensorwise", "fp8_rowwise"):
        y = qjax.dot_general(x, w, TN, recipe=name)
        assert y.dtype == jnp.float16 and np.isfinite(np.asarray(y)).all() and snr_db(y_ref, y) > 18, name


def test_int8_wgrad_over_many_tokens_does_not_wrap():
    tokens = 140_000  # 127**2 * tokens > 2**31: one int32 accumulation would wrap
    x, w = jnp.ones((tokens, 1)), jnp.ones((1, 1))
    dw = jax.grad(lambda w: jnp.sum(qjax.dot_general(x, w, TN, recipe="int8_rowwise")))(w)
    np.testing.assert_allclose(dw, [[tokens]], rtol=1e-6)


def test_forward_only_needs_only_the_forward_layouts():
    x, w = jnp.ones((100, 256)), jnp.ones((128, 256))  # 100 tokens: fine forward, not tileable for wgrad
    np.testing.assert_allclose(qjax.dot_general(x, w, TN, recipe="fp8_blockwise"), jnp.full((100, 128), 256.0))
    with pytest.raises(ValueError,
                       match="wgrad rhs x as \\(K, M\\), M = tokens.*contracting % 128 == 0.*contracting=100"):
        jax.grad(lambda x: jnp.sum(qjax.dot_general(x, w, TN, recipe="fp8_blockwise")))(x)


def test_empty_operands():
    x, w = jnp.ones((0, 256)), jnp.ones((8, 256))
    assert qjax.dot_general(x, w, TN, recipe="int8_rowwise").shape == (0, 8)
    dw = jax.grad(lambda w: jnp.sum(qjax.dot_general(x, w, TN, recipe="int8_rowwise")))(w)
    assert np.all(np.asarray(dw) == 0)


@pytest.mark.parametrize("where", ["w", "g"])
def test_non_finite_weights_and_gradients_stay_visible(where):
    x, w, g = _operands()
    if where == "w":
        w = w.at[2, 9].set(np.nan)
    else:
        g = g.at[4, 1].set(np.inf)
    dx, dw = jax.grad(lambda x, w: jnp.sum(qjax.dot_general(x, w, TN, recipe="int8_rowwise") * g), (0, 1))(x, w)
    assert not np.isfinite(np.asarray(dx)).all()  # dx = g . w reads both
    if where == "g":
        assert not np.isfinite(np.asarray(dw)).all()  # dw = g^T . x does not read w
