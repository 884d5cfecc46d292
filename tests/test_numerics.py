"""The numerics layer (qjax.numerics, the kernel-safe forms in qjax.stochastic): the formulas kernels and references
share. Each kernel-safe form is compared with the plain jnp operation it replaces, jitted as XLA compiles it (XLA
must not fold the tricks away); the kernels' own tests check them inside kernels.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qjax import formats, numerics, stochastic
from qjax.optim import adam_math


def _bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def test_amax_nan_convention():
    """NaN wherever the block holds one (either sign), else Inf where it holds +-Inf; denormals, +-0 exact."""
    x = jax.random.normal(jax.random.key(6), (12, 128)) * jnp.exp(5 * jax.random.normal(jax.random.key(7), (12, 1)))
    x = (x.at[1].set(0.0).at[2].set(-0.0).at[3, 4].set(jnp.nan).at[4, 5].set(-jnp.nan).at[5, 6].set(jnp.inf)
         .at[6, 7].set(-jnp.inf).at[7].set(1e-45).at[8, 3].set(jnp.inf).at[8, 9].set(jnp.nan))
    got = jax.jit(lambda x: numerics.amax(x, axis=-1))(x)
    want = np.where(np.isnan(np.asarray(x)).any(1), np.nan, np.abs(np.asarray(x)).max(1))
    np.testing.assert_array_equal(got, want)
    assert got.dtype == jnp.float32 and bool(jnp.isnan(got[8])) and float(got[5]) == np.inf
    assert bool(jnp.isnan(jax.jit(numerics.amax)(x)))  # all axes
    assert float(jax.jit(numerics.amax)(x[5:7])) == np.inf


@pytest.mark.parametrize("pow2", [False, True])
def test_scale_from_amax(pow2):
    amax = jnp.asarray([0.0, 1e-37, 1.0, 3.0, 448.0, 1e38, np.inf, np.nan], jnp.float32)
    scale = np.asarray(numerics.scale_from_amax(amax, formats.E4M3, pow2))
    assert scale[0] == 1 and scale[1] == np.finfo(np.float32).tiny  # zero blocks: 1; floored at the smallest normal
    assert np.isinf(scale[6]) and np.isnan(scale[7])  # non-finite amax stays visible
    finite = scale[2:6]
    if pow2:
        np.testing.assert_array_equal(np.frexp(finite)[0], 0.5)
        assert np.all(finite >= np.asarray(amax[2:6]) / 448) and np.all(finite < 2 * np.asarray(amax[2:6]) / 448)
    else:
        # XLA:CPU divides by the constant as a multiplication by its inverse: within one float32 rounding
        np.testing.assert_allclose(finite, np.asarray(amax[2:6]) / np.float32(448), rtol=2**-23)


def test_e4m3_blocks_equal_the_saturating_cast():
    """The optimizer states' e4m3 quantizer: scale = amax / 448 (1 for zero blocks), codes = the reference's
    saturating cast of x / scale (the clamp alone suffices: x / scale is never +-Inf)."""
    x = jax.random.normal(jax.random.key(0), (8, 128)) * 10.0 ** jax.random.uniform(jax.random.key(1), (8, 128),
                                                                                     minval=-8, maxval=8)
    x = x.at[1].set(0.0).at[2, 3].set(jnp.nan).at[3, 4].set(-jnp.inf).at[4].set(1e-40).at[5, 0].set(3e38)
    codes, scale = jax.jit(adam_math.quantize_e4m3_blocks)(x)
    want_scale = numerics.nonzero(numerics.amax(x, axis=-1) / jnp.float32(448))
    want = formats.saturating_cast(x / want_scale[:, None], formats.E4M3)
    np.testing.assert_array_equal(np.asarray(scale), np.asarray(want_scale))
    nan = np.isnan(np.asarray(want, np.float32))
    np.testing.assert_array_equal(np.isnan(np.asarray(codes, np.float32)), nan)
    np.testing.assert_array_equal(_bits(codes)[~nan], _bits(want)[~nan])
    assert float(scale[1]) == 1 and bool(np.all(nan[2])) and np.isinf(scale[3])  # NaN block: NaN codes; Inf: scale


def test_int8_cast_codes_round_half_to_even_without_conversions():
    """The kernel-side int8 cast (a magic-number add, the integer read from the mantissa bits) equals the reference's
    round half to even + clip + cast on ties, the clip boundary, NaN / +-Inf, -0 and every half-integer in range,
    jitted as XLA compiles it (XLA must not fold the trick away)."""
    halves = np.arange(-130.0, 130.5, 0.5)
    specials = [np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0, 127.49, 127.5, -127.5, 128.0, -1e30, 3e38, 1e-40,
                0.49999997, -0.50000006, 2.5000002]
    y = jnp.asarray(np.concatenate([halves, specials]), jnp.float32)
    fmt = formats.get_format("int8")
    got = jax.jit(lambda y: numerics.cast_codes(y, fmt, may_be_inf=False))(y)
    want = jax.jit(lambda y: formats.saturating_cast(jnp.where(jnp.isnan(y), 0.0, jnp.round(y)), fmt))(y)
    assert got.dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("may_be_inf", [True, False])
@pytest.mark.parametrize("target", ["int8", "e4m3", "e5m2"])
def test_stochastic_codes_at_the_range_ends(target, may_be_inf):
    """The kernel-side rounding + cast equals the reference's round_to_grid + saturating_cast where a random draw
    close to 1 carries a value at or near the format's max over it (int8: 127 + u rounds to 128.0 in f32 for
    u > 1 - 2**-18, p = 2**-18 per draw: random tests rarely reach it), on exact grid points, zeros, NaN and (when
    the caller allows them) +-Inf; every value with every draw of a small set, jitted as XLA compiles it."""
    fmt = formats.get_format(target)
    top = fmt.max_value
    values = [top, -top, top * 0.999, -top * 0.9999, top * 2, -3e38, 126.75, 126.5, 0.0, -0.0, 1.0, -2.5, 1e-30,
              np.nan]
    values += [np.inf, -np.inf] if may_be_inf else []
    draws = np.array([0, 1 << 9, 0x80000000, 0xFFFFFDFF, 0xFFFFFE00, 0xFFFFFFFF, 0x12345678], np.uint32)
    y = jnp.asarray(np.repeat(np.array(values, np.float32), len(draws)))
    bits = jnp.asarray(np.tile(draws, len(values)))
    got = jax.jit(lambda y, b: stochastic.stochastic_codes(y, fmt, b, may_be_inf=may_be_inf))(y, bits)
    if got.dtype == jnp.uint8:  # e5m2 bits (may_be_inf)
        got = jax.lax.bitcast_convert_type(got, fmt.dtype)
    want = jax.jit(lambda y, b: formats.saturating_cast(stochastic.round_to_grid(y, fmt, b), fmt))(y, bits)
    if fmt.is_integer:
        nan = np.isnan(np.asarray(y))
        assert np.all(np.asarray(got)[nan] == 0)  # NaN -> 0 (XLA's cast of NaN to int8 is backend-defined)
    else:  # NaN where the reference has NaN (NaN, and Inf -> e4m3); its sign and payload bits are backend choices
        nan = np.isnan(np.asarray(want, np.float32))
        np.testing.assert_array_equal(np.isnan(np.asarray(got, np.float32)), nan)
    np.testing.assert_array_equal(_bits(got)[~nan], _bits(want)[~nan])


def test_floor_without_conversions():
    """The kernel-side floor (nearest integer by a magic-number add, one less where it rounded up) equals jnp.floor
    on integers, half-integers, values a float32 ulp either side of them, negatives, the 2**22 bound and
    non-finite values, jitted as XLA compiles it (XLA folds the add and subtract away without the barrier).
    Compared with XLA's own floor, as the reference computes it: XLA:CPU flushes subnormals (floor(-1e-40) is 0
    there, -1 in numpy), and both sides follow the same backend's mode."""
    base = np.arange(-130.0, 130.5, 0.5, dtype=np.float32)
    near = np.concatenate([np.nextafter(base, np.float32(np.inf)), np.nextafter(base, np.float32(-np.inf))])
    specials = np.array([2.0**22, -(2.0**22), 2.0**22 - 0.5, -(2.0**22) + 0.5, 1e-40, -1e-40, 0.99999994,
                         np.inf, -np.inf], np.float32)
    v = jnp.asarray(np.concatenate([base, near, specials]))
    got = np.asarray(jax.jit(numerics.floor)(v))
    np.testing.assert_array_equal(got, np.asarray(jax.jit(jnp.floor)(v)))
    normal = np.abs(np.asarray(v)) >= np.finfo(np.float32).tiny
    np.testing.assert_array_equal(got[normal], np.floor(np.asarray(v))[normal])
    assert np.isnan(np.asarray(jax.jit(numerics.floor)(jnp.float32(np.nan))))
