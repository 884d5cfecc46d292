"""MXFP8: 1x32 blocks with E8M0 (power-of-two, FLOOR mode) scales, e4m3 codes, and the `mxfp8` recipe."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import snr_db
from jax import lax

import qjax

MX = qjax.QuantSpec("e4m3", "1x32", pow2_scale=True)
TN = (((1,), (1,)), ((), ()))


def _brute_force_mx(x):
    """numpy: per 32 of the last axis, scale = 2^(floor(log2 amax) - 8) (1 for zeros), codes = e4m3(clip(x / scale))."""
    x = np.asarray(x, np.float32)
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        exponent = np.frexp(amax)[1] - 1  # amax = m * 2^e, m in [0.5, 1): floor(log2 amax) = e - 1
        scale = np.where(amax == 0, 1.0, np.ldexp(np.float32(1), exponent - 8)).astype(np.float32)
        codes = np.clip(blocks / scale[..., None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return codes.reshape(x.shape), scale


def test_codes_and_scales_equal_brute_force():
    x = jax.random.normal(jax.random.key(0), (64, 256)) * jnp.logspace(-6, 6, 256)  # block amaxes over 12 decades
    x = x.at[3, :32].set(0.0).at[5, 40].set(448.0 * 2.0**-3).at[6, 70].set(-511.0)  # zeros, an exact power, saturation
    q = qjax.quantize(x, MX)
    codes, scale = _brute_force_mx(x)
    assert q.data.dtype == jnp.float8_e4m3fn and q.scale.shape == (64, 8)
    np.testing.assert_array_equal(np.asarray(q.scale), scale)
    np.testing.assert_array_equal(np.asarray(q.data).view(np.uint8), codes.view(np.uint8))
    # scales are powers of two, codes saturate at 448 (the FLOOR mode's block max lands in [256, 512))
    mantissa = np.frexp(np.asarray(q.scale))[0]
    assert np.all(mantissa == 0.5)
    assert float(q.data[6, 70].astype(jnp.float32)) == -448.0


def test_non_finite_blocks_stay_non_finite_and_zero_blocks_are_zero():
    x = jnp.ones((2, 96)).at[0, 1].set(jnp.nan).at[1, 40].set(jnp.inf).at[1, 64:].set(0.0)
    q = qjax.quantize(x, MX)
    scale = np.asarray(q.scale)
    assert np.isnan(scale[0, 0]) and np.isinf(scale[1, 1]) and scale[1, 2] == 1.0
    deq = np.asarray(qjax.dequantize(q))
    assert np.all(~np.isfinite(deq[0, :32])) and np.all(~np.isfinite(deq[1, 32:64]))
    assert np.all(deq[1, 64:] == 0) and np.all(np.isfinite(deq[0, 32:]))


def test_bad_specs_and_shapes_raise():
    with pytest.raises(ValueError, match="pow2_scale=True"):
        qjax.QuantSpec("e4m3", "1x32")
    with pytest.raises(ValueError, match="contracting % 32"):
        qjax.quantize(jnp.ones((4, 48)), MX)


def _operands(outlier_rows):
    """The outlier data of the README's recipe tests (tests/test_dot_general.py): outlier features and tokens."""
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (512, 512)).at[:, ::61].mul(20.0)
    if outlier_rows:
        x = x.at[::97].mul(30.0)
    return x, jax.random.normal(kw, (384, 512)) * 0.02, jax.random.normal(kg, (512, 384)).at[:, ::53].mul(5.0)


def _snrs(recipe, x, w, g):
    loss = lambda f: (lambda x, w: jnp.sum(f(x, w) * g))
    exact = lambda x, w: lax.dot_general(x, w, TN, precision=lax.Precision.HIGHEST)
    quantized = lambda x, w: qjax.dot_general(x, w, TN, recipe=recipe)
    ref, got = jax.grad(loss(exact), (0, 1))(x, w), jax.jit(jax.grad(loss(quantized), (0, 1)))(x, w)
    return snr_db(exact(x, w), jax.jit(quantized)(x, w)), snr_db(ref[0], got[0]), snr_db(ref[1], got[1])


@pytest.mark.parametrize("outlier_rows", [False, True])
def test_mxfp8_snr_on_outlier_data(outlier_rows):
    """Above the fp8 targets (18 / 17 dB), and within 6 dB of fp8_blockwise. Not above it (the issue's criterion):
    fp8_blockwise's amax / 448 scales put each block's largest value, here the outlier that dominates the signal,
    exactly on a code; power-of-two scales cannot, and FLOOR saturates block maxima above 448 * 2^k (the measured
    numbers: benchmarks/NOTES.md, "MXFP8 numerics on the CPU")."""
    operands = _operands(outlier_rows)
    mx, block = _snrs("mxfp8", *operands), _snrs("fp8_blockwise", *operands)
    assert min(mx) >= 25 and all(m >= b - 6 for m, b in zip(mx, block)), (mx, block)


def test_mx_gemm_is_the_exact_bf16_product_of_the_dequantized_operands():
    x, w, _ = _operands(False)
    xq, wq = qjax.quantize(x, MX), qjax.quantize(w, MX)
    exact = lax.dot_general(xq.dequantize(), wq.dequantize(), TN, precision=lax.Precision.HIGHEST)
    assert np.array_equal(np.asarray(xq.dequantize(jnp.bfloat16).astype(jnp.float32)), np.asarray(xq.dequantize()))
    y = qjax.dot_general(x, w, TN, recipe="mxfp8", preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(y), np.asarray(exact), rtol=1e-5, atol=1e-4)


def test_kernel_dispatch_falls_back_to_the_reference():
    x, w, _ = _operands(False)
    with qjax.dispatch.force("interpret"):
        y = jax.jit(lambda x, w: qjax.dot_general(x, w, TN, recipe="mxfp8"))(x, w)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(qjax.dot_general(x, w, TN, recipe="mxfp8")))
