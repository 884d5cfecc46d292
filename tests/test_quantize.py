"""qjax.quantize / dequantize reference semantics at every granularity and format."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from qjax.quantize import QuantSpec

GRANULARITIES = ["tensor", "row", "1x128", "128x128"]
BLOCK = {"tensor": None, "row": (1, 256), "1x128": (1, 128), "128x128": (128, 128)}


def _data(shape=(2, 256, 256), seed=0):
    x = jax.random.normal(jax.random.key(seed), shape, jnp.float32)
    return x.at[..., 3, :].mul(50.0).at[..., 17].mul(20.0)  # an outlier row and column


def _numpy_amax(x, granularity):
    """Block absmax broadcast back to x's shape, computed independently with numpy."""
    x = np.abs(np.asarray(x, np.float64))
    if granularity == "tensor":
        return np.full_like(x, x.max())
    block_r, block_k = BLOCK[granularity]
    *lead, rows, k = x.shape
    blocks = x.reshape(*lead, rows // block_r, block_r, k // block_k, block_k).max(axis=(-3, -1), keepdims=True)
    return np.broadcast_to(blocks, (*lead, rows // block_r, block_r, k // block_k, block_k)).reshape(x.shape)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_int8_codes_match_independent_numpy(granularity):
    x = _data()
    q = qjax.quantize(x, QuantSpec("int8", granularity))
    scale = np.float32(_numpy_amax(x, granularity) / 127.0)
    expected = np.clip(np.round(np.asarray(x) * (np.float32(1) / scale)), -127, 127)
    np.testing.assert_array_equal(np.asarray(q.data, np.int32), expected.astype(np.int32))
    dequantized = np.asarray(qjax.dequantize(q))
    assert np.all(np.abs(dequantized - np.asarray(x)) <= 0.5001 * scale)  # nearest rounding: half a step


@pytest.mark.parametrize("dtype, max_value, mantissa_bits", [("e4m3", 448.0, 3), ("e5m2", 57344.0, 2)])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_fp8_relative_error(dtype, max_value, mantissa_bits, granularity):
    x = _data()
    q = qjax.quantize(x, QuantSpec(dtype, granularity))
    assert q.data.dtype == qjax.formats.get_format(dtype).dtype
    amax = _numpy_amax(x, granularity)
    np.testing.assert_allclose(np.asarray(jnp.max(jnp.abs(q.data.astype(jnp.float32)))), max_value)
    error = np.abs(np.asarray(qjax.dequantize(q)) - np.asarray(x))
    # Half an ulp relative for normal values, plus the subnormal spacing at the block's scale.
    subnormal_step = amax / max_value * 2.0 ** (-6 if dtype == "e4m3" else -14 - 2)
    assert np.all(error <= np.abs(np.asarray(x)) * 2.0 ** -(mantissa_bits + 1) + subnormal_step)


@pytest.mark.parametrize("granularity, scale_shape", [
    ("tensor", ()), ("row", (2, 256, 1)), ("1x128", (2, 256, 2)), ("128x128", (2, 2, 2))])
def test_scale_shapes(granularity, scale_shape):
    q = qjax.quantize(_data(), QuantSpec("int8", granularity))
    assert q.scale.shape == scale_shape and q.scale.dtype == jnp.float32


def test_pow2_scales_are_powers_of_two_and_cover_amax():
    x = _data()
    q = qjax.quantize(x, QuantSpec("e4m3", "row", pow2_scale=True))
    scale = np.asarray(q.scale)
    mantissa, _ = np.frexp(scale)
    assert np.all(mantissa == 0.5)
    amax = np.abs(np.asarray(x)).max(axis=-1, keepdims=True)
    assert np.all(scale >= amax / 448.0) and np.all(scale < 2 * amax / 448.0)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_all_zero_gives_scale_one_and_zeros(granularity):
    q = qjax.quantize(jnp.zeros((256, 256), jnp.bfloat16), QuantSpec("e4m3", granularity))
    assert np.all(np.asarray(q.scale) == 1.0)
    assert np.all(np.asarray(qjax.dequantize(q)) == 0.0)


@pytest.mark.parametrize("dtype", ["int8", "e4m3", "e5m2"])
@pytest.mark.parametrize("granularity", ["row", "1x128"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_stays_visible_in_its_block_only(dtype, granularity, bad):
    x = _data((256, 256)).at[5, 200].set(bad)
    out = np.asarray(qjax.dequantize(qjax.quantize(x, QuantSpec(dtype, granularity))))
    assert not np.isfinite(out[5, 200])
    assert np.isfinite(np.delete(out, 5, axis=0)).all()  # other rows untouched
    if granularity == "1x128":
        assert np.isfinite(out[5, :128]).all()


def test_tiny_values_do_not_overflow_the_inverse_scale():
    x = jnp.linspace(-1e-37, 1e-37, 4 * 128, dtype=jnp.float32).reshape(4, 128)  # amax / 127 is a subnormal
    q = qjax.quantize(x, QuantSpec("int8", "row"))
    # The scale is floored at float32's smallest normal, so 1 / scale stays finite; codes then resolve x in steps
    # of that floor (documented), never NaN or Inf.
    assert np.all(np.asarray(q.scale) == np.finfo(np.float32).tiny)
    out = np.asarray(qjax.dequantize(q))
    assert np.isfinite(out).all() and np.all(np.abs(out - np.asarray(x)) <= 0.5001 * np.finfo(np.float32).tiny)


@pytest.mark.parametrize("dtype", ["int8", "e4m3"])
def test_stochastic_quantize_is_unbiased(dtype):
    x = jnp.tile(jax.random.uniform(jax.random.key(1), (1, 256), minval=-1, maxval=1), (4096, 1))
    x = x.at[:, 0].set(1.0)  # same amax in every row, so every row has the same scale
    q = qjax.quantize(x, QuantSpec(dtype, "row", stochastic=True), key=jax.random.key(2))
    mean = np.asarray(qjax.dequantize(q)).mean(axis=0)
    nearest = np.asarray(qjax.dequantize(qjax.quantize(x[:1], QuantSpec(dtype, "row"))))[0]
    sr_error = np.abs(mean - np.asarray(x[0])).mean()
    assert sr_error < 0.2 * np.abs(nearest - np.asarray(x[0])).mean()


def test_qtensor_is_a_pytree():
    q = qjax.quantize(_data(), QuantSpec("int8", "1x128"))
    doubled = jax.jit(lambda q: dataclasses.replace(q, scale=q.scale * 2))(q)
    assert doubled.granularity == "1x128"
    np.testing.assert_allclose(np.asarray(qjax.dequantize(doubled)), 2 * np.asarray(qjax.dequantize(q)))


def test_bad_input():
    with pytest.raises(ValueError, match="contracting % 128"):
        qjax.quantize(jnp.ones((128, 100)), QuantSpec("int8", "1x128"))
    with pytest.raises(ValueError, match="rows % 128"):
        qjax.quantize(jnp.ones((100, 128)), QuantSpec("e4m3", "128x128"))
    with pytest.raises(ValueError, match="granularity"):
        QuantSpec("int8", "column")
    with pytest.raises(ValueError, match="unsupported quantization format"):
        QuantSpec("int4")
    with pytest.raises(ValueError, match="8-bit"):
        QuantSpec("bf16")
    with pytest.raises(TypeError, match="float"):
        qjax.quantize(jnp.ones((4, 4), jnp.int32), QuantSpec("int8"))
    with pytest.raises(ValueError, match="key"):
        qjax.quantize(jnp.ones((4, 4)), QuantSpec("int8", stochastic=True))
