"""Stochastic rounding: unbiased, on the two neighbouring grid points, reproducible, non-finite values kept."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from qjax import formats, stochastic

KEY = jax.random.key(0)


def _round(x, dtype, key):
    """qjax.stochastic_round, or for int8 (refused there: NaN would become a code) the same rounding by seed, as
    the scale-based quantizer runs it."""
    if dtype == jnp.int8:
        return stochastic.stochastic_round_with_seed(jnp.asarray(x), dtype, stochastic.key_to_seed(key))
    return qjax.stochastic_round(x, dtype, key)


def _neighbours(x: float, dtype):
    """The representable values just below and above x in dtype (brute force over all codes)."""
    if dtype == jnp.int8:
        return np.floor(x), np.ceil(x)
    if dtype == jnp.bfloat16:
        codes = np.arange(2**16, dtype=np.uint16).view(jnp.bfloat16).astype(np.float32)
    else:
        codes = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)
    codes = codes[np.isfinite(codes)]
    return codes[codes <= x].max(), codes[codes >= x].min()


@pytest.mark.parametrize("dtype, x, draws, rel_tol", [
    (jnp.int8, 100.3, 10**5, 1e-4),
    (jnp.int8, -57.77, 10**5, 1e-4),
    (jnp.bfloat16, 1.0 + 2.0**-10, 10**5, 3e-5),
    (jnp.bfloat16, -3.0e-3, 10**5, 3e-5),
    (jnp.float8_e4m3fn, 1.0 + 2.0**-5, 10**6, 1e-4),
    (jnp.float8_e4m3fn, 0.0031, 10**6, 1e-4),  # in e4m3's subnormal range
    (jnp.float8_e5m2, -300.7, 10**6, 1e-4),
])
def test_unbiased_and_only_neighbours(dtype, x, draws, rel_tol):
    values = jnp.full((draws,), x, jnp.float32)
    rounded = np.asarray(_round(values, dtype, KEY).astype(jnp.float32), np.float64)
    x = float(np.float32(x))
    low, high = _neighbours(x, dtype)
    assert set(np.unique(rounded)) <= {low, high}
    # An unbiased rounding's sample mean has standard error (high - low) sqrt(p (1 - p) / draws). For int8 and
    # bf16 the relative bound is looser than 5 of those; fp8's grid is so coarse (2-3 mantissa bits) that no
    # unbiased rounding can meet 1e-4 with this many draws, so there the bound is 5 standard errors.
    p = (x - low) / (high - low)
    tolerance = max(rel_tol * abs(x), 5 * (high - low) * np.sqrt(p * (1 - p) / draws))
    assert abs(rounded.mean() - x) <= tolerance
    # Round-to-nearest misses the same bound, so the check is tight enough to see a bias.
    nearest = low if abs(x - low) <= abs(high - x) else high
    assert abs(nearest - x) > tolerance


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int8])
def test_reproducible_per_key_and_varies_across_keys(dtype):
    x = jax.random.normal(jax.random.key(1), (4096,)) * 10
    a = _round(x, dtype, jax.random.key(3))
    b = _round(x, dtype, jax.random.key(3))
    c = _round(x, dtype, jax.random.key(4))
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    assert np.mean(np.asarray(a.astype(jnp.float32)) != np.asarray(c.astype(jnp.float32))) > 0.1


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_representable_values_unchanged(dtype):
    codes = jnp.asarray(np.arange(-64, 64, dtype=np.float32) * 0.125).astype(dtype).astype(jnp.float32)
    out = qjax.stochastic_round(codes, dtype, KEY).astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(codes))


def test_non_finite_values_never_become_finite():
    x = jnp.array([np.nan, np.inf, -np.inf, 1e30, -1e30, 0.0], jnp.float32)
    e4m3 = np.asarray(qjax.stochastic_round(x, jnp.float8_e4m3fn, KEY).astype(jnp.float32))
    assert np.isnan(e4m3[:3]).all()  # e4m3 has no Inf: Inf becomes NaN, not 448
    np.testing.assert_array_equal(e4m3[3:], [448.0, -448.0, 0.0])  # finite values saturate
    e5m2 = np.asarray(qjax.stochastic_round(x, jnp.float8_e5m2, KEY).astype(jnp.float32))
    assert np.isnan(e5m2[0]) and e5m2[1] == np.inf and e5m2[2] == -np.inf
    bf16 = np.asarray(qjax.stochastic_round(x, jnp.bfloat16, KEY).astype(jnp.float32))
    assert np.isnan(bf16[0]) and bf16[1] == np.inf and bf16[2] == -np.inf


@pytest.mark.parametrize("dtype, max_value", [(jnp.bfloat16, float(jnp.finfo(jnp.bfloat16).max)),
                                              (jnp.float8_e4m3fn, 448.0), (jnp.float8_e5m2, 57344.0)])
def test_finite_values_near_float32_max_saturate(dtype, max_value):
    x = jnp.repeat(jnp.array([3.39e38, 3.4028235e38, -3.4028235e38], jnp.float32), 1000)
    out = np.asarray(qjax.stochastic_round(x, dtype, KEY).astype(jnp.float32))
    assert np.isfinite(out).all() and np.all(np.abs(out) <= max_value)


def test_public_int8_rounding_is_refused():
    with pytest.raises(ValueError, match=r"int8 would turn NaN and Inf into finite codes: use qjax.quantize"):
        qjax.stochastic_round(jnp.array([np.nan, 1.5]), jnp.int8, KEY)


def test_int8_saturates_at_127():
    out = _round(jnp.array([300.0, -300.0, 126.5]), jnp.int8, KEY)
    assert out.dtype == jnp.int8 and out[0] == 127 and out[1] == -127 and out[2] in (126, 127)


def test_uniform_is_the_top_23_bits():
    bits = jnp.asarray([0, 0x1FF, 0x200, 0xFFFFFFFF, 0x80000000, 0x12345678], jnp.uint32)
    want = (np.asarray(bits) >> 9).astype(np.float64) * 2.0**-23
    got = np.asarray(jax.jit(stochastic.uniform_from_bits)(bits))
    np.testing.assert_array_equal(got, want.astype(np.float32))
    assert got.max() < 1.0 and got.dtype == np.float32


def test_hash_bits_are_uniform():
    bits = np.asarray(stochastic.element_bits(jnp.uint32(12345), (1 << 16,)))
    counts = np.bincount(bits >> 28, minlength=16)  # top 4 bits
    chi2 = ((counts - counts.mean()) ** 2 / counts.mean()).sum()
    assert chi2 < 40  # 15 degrees of freedom: p ~ 5e-4
    low = np.bincount(bits & 15, minlength=16)
    assert ((low - low.mean()) ** 2 / low.mean()).sum() < 40
    assert len(np.unique(bits)) > 0.99 * bits.size


def test_bad_input():
    with pytest.raises(TypeError, match="PRNG key"):
        qjax.stochastic_round(jnp.ones(3), jnp.bfloat16, 0)
    with pytest.raises(TypeError, match="float"):
        qjax.stochastic_round(jnp.ones(3, jnp.int32), jnp.bfloat16, KEY)
    with pytest.raises(ValueError, match="unsupported quantization format"):
        qjax.stochastic_round(jnp.ones(3), jnp.float16, KEY)


def test_paired_bits_are_one_hash_per_two_elements():
    """Element i of each run of 128 takes the low (i % 128 < 64) or high half of hash word 64 * (i // 128) + i % 64,
    in its top 16 bits; a shape that is no multiple of 128 is the prefix of whole runs."""
    seed = jnp.uint32(99)
    bits = np.asarray(stochastic.paired_bits(seed, (3, 100))).reshape(-1)
    i = np.arange(300)
    words = np.asarray(stochastic.hash_uint32(seed, jnp.asarray((i // 128) * 64 + i % 64, jnp.uint32)))
    halves = np.where((i // 64) % 2 == 0, words & 0xFFFF, words >> 16)
    np.testing.assert_array_equal(bits, (halves << 16).astype(np.uint32))


def _correlation(a, b):
    return float(np.corrcoef(a.astype(np.float64), b.astype(np.float64))[0, 1])


def test_paired_uniforms_are_uniform_and_independent():
    """The 16-bit uniforms of paired bits: multiples of 2**-16 in [0, 1), uniform in their high and low bits, and
    uncorrelated between neighbours, the two elements of one hash word (c, c + 64), rows and seeds."""
    shape = (512, 256)
    u = np.asarray(jax.jit(lambda s: stochastic.uniform_from_bits(stochastic.paired_bits(s, shape)))(jnp.uint32(5)))
    k = u * 2.0**16
    np.testing.assert_array_equal(k, np.floor(k))
    assert u.min() >= 0 and u.max() < 1
    k = k.astype(np.int64).reshape(-1)
    for values in (k >> 12, k & 15):  # top and bottom 4 of the 16 bits: chi2 with 15 degrees of freedom
        counts = np.bincount(values, minlength=16)
        assert ((counts - counts.mean()) ** 2 / counts.mean()).sum() < 40  # p ~ 5e-4
    bound = 5 / np.sqrt(u.size / 2)  # 5 standard errors of a correlation of independent uniforms
    other_seed = np.asarray(stochastic.uniform_from_bits(stochastic.paired_bits(jnp.uint32(6), shape)))
    for a, b in ((u[:, :-1], u[:, 1:]), (u[:, :64], u[:, 64:128]), (u[:-1], u[1:]), (u, other_seed)):
        assert abs(_correlation(a.reshape(-1), b.reshape(-1))) < bound


@pytest.mark.parametrize("dtype, y", [(jnp.int8, 100.3), (jnp.int8, -57.77), (jnp.int8, 3 + 2.0**-20),
                                      (jnp.float8_e4m3fn, 1.0 + 2.0**-5), (jnp.float8_e4m3fn, 0.0031),
                                      (jnp.float8_e5m2, -300.7)])
def test_sixteen_random_bits_are_unbiased_to_2_pow_minus_16_of_a_step(dtype, y):
    """The expectation over all 2**16 values a paired-bits element can take is within 2**-16 of a grid step of y
    (exact, no sampling error), on y's two neighbouring grid points."""
    bits = jnp.arange(1 << 16, dtype=jnp.uint32) << 16
    y = float(np.float32(y))
    rounded = np.asarray(stochastic.round_to_grid(jnp.full(bits.shape, y), formats.get_format(dtype), bits),
                         np.float64)
    low, high = _neighbours(y, dtype)
    assert set(np.unique(rounded)) <= {low, high}
    assert abs(rounded.mean() - y) <= 2.0**-16 * (high - low)
