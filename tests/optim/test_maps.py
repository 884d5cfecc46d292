"""Quantization maps equal their defining formulas; nearest-code encoding equals brute force; block formats."""

from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qjax.optim import adam_math, blockwise, codebooks


def _dynamic_map_exact(signed, max_exponent_bits, total_bits):
    """The bitsandbytes dynamic-map formula in exact rational arithmetic, each value rounded once to float32."""
    non_sign = total_bits - 1
    values = [Fraction(0), Fraction(1)]
    for i in range(max_exponent_bits):
        n = 2 ** (i + non_sign - max_exponent_bits + (0 if signed else 1))
        bounds = [Fraction(1, 10) + Fraction(9, 10) * Fraction(j, n) for j in range(n + 1)]
        decade = Fraction(10) ** (i - max_exponent_bits + 1)
        for a, b in zip(bounds[:-1], bounds[1:]):
            values.append((a + b) / 2 * decade)
            if signed:
                values.append(-(a + b) / 2 * decade)
    return np.sort(np.array([np.float32(float(v)) for v in values], np.float32))


@pytest.mark.parametrize("signed,exp_bits,bits", [(True, 7, 8), (False, 7, 8), (True, 3, 4)])
def test_dynamic_map_equals_formula(signed, exp_bits, bits):
    got = codebooks.dynamic_map(signed, exp_bits, bits)
    assert got.dtype == np.float32 and got.shape == (2**bits,)
    np.testing.assert_array_equal(got, _dynamic_map_exact(signed, exp_bits, bits))
    assert np.all(np.diff(got) > 0), "map values must be distinct and sorted"


def test_named_maps():
    np.testing.assert_array_equal(codebooks.DYNAMIC_SIGNED_8BIT, codebooks.dynamic_map(True, 7, 8))
    np.testing.assert_array_equal(codebooks.DYNAMIC_UNSIGNED_8BIT, codebooks.dynamic_map(False, 7, 8))
    m4 = np.array([-0.8875, -0.6625, -0.4375, -0.2125, -0.0775, -0.0325, -0.0055, 0,
                   0.0055, 0.0325, 0.0775, 0.2125, 0.4375, 0.6625, 0.8875, 1.0], np.float32)
    np.testing.assert_array_equal(codebooks.DYNAMIC_SIGNED_4BIT, m4)
    np.testing.assert_array_equal(codebooks.LINEAR_UNSIGNED_4BIT, np.arange(1, 17, dtype=np.float32) / 16)
    assert codebooks.DYNAMIC_UNSIGNED_8BIT.min() == 0 and codebooks.DYNAMIC_SIGNED_8BIT.min() < -0.99
    # smallest non-zero magnitudes: 0.55e-6 (signed level 0 has one midpoint), 0.325e-6 (unsigned has two)
    assert np.float32(0.55e-6) in codebooks.DYNAMIC_SIGNED_8BIT and codebooks.DYNAMIC_UNSIGNED_8BIT[1] == np.float32(0.325e-6)
    with pytest.raises(ValueError, match="frozen|read-only"):
        codebooks.DYNAMIC_SIGNED_8BIT[0] = 0


def _brute_force_chunked(x, qmap, chunk=1 << 16):
    """encode_brute_force in chunks (its memory is x.size * 2**bits)."""
    brute = jax.jit(lambda v: codebooks.encode_brute_force(v, qmap))
    pad = -x.size % chunk
    padded = np.concatenate([x, np.zeros(pad, np.float32)]).reshape(-1, chunk)
    return np.concatenate([np.asarray(brute(jnp.asarray(c))) for c in padded])[:x.size]


def _near(values, ulps):
    """Each float32 value and its neighbours up to `ulps` floats away on either side."""
    out, up, down = [values], values, values
    for _ in range(ulps):
        up, down = np.nextafter(up, np.float32(np.inf)), np.nextafter(down, np.float32(-np.inf))
        out += [up, down]
    return np.concatenate(out)


def _integer_positions(qmap):
    """Magnitudes whose encoder position G - shift is an integer on some level (`codebooks._Encoder`), for both
    shifts: where the candidate pair changes and the floor may round either way."""
    enc = codebooks._encoder(qmap)
    points = []
    for scale, offset in zip(enc.level_scale, enc.level_offset):
        for shift in (enc.nearest_shift, enc.first_tie_shift):
            points.append((np.arange(-1, qmap.size + 1) + shift - offset) / scale)
    points = np.concatenate(points)
    return points[(points > 0) & (points < 2)].astype(np.float32)


def _probes(qmap):
    """Where an encoder can go wrong: around every decision boundary, decade, map value, and beyond +-1."""
    mids = ((qmap[:-1].astype(np.float64) + qmap[1:]) / 2).astype(np.float32)
    decades = (10.0 ** np.arange(-9, 1)).astype(np.float32)
    # beyond 1: distances x - q round together from x ~ 2**7 on; probe every binade's edges and a few steps inside
    powers = (2.0 ** np.arange(0, 128)).astype(np.float32)
    inside = (powers[:-1, None] * (1 + np.arange(1, 33, dtype=np.float32) / 32)).ravel()
    special = np.array([0, 1e-30, 1e-38, 1e-40, 1e-45, 1.0, 1.5, 2, 3e38, np.finfo(np.float32).max], np.float32)
    signed = np.concatenate([_near(qmap, 3), _near(mids, 4), _near(decades, 3), _near(powers, 3), _near(inside, 2),
                             _near(_integer_positions(qmap), 3), special]).astype(np.float32)
    rng = np.random.default_rng(0)
    log_uniform = np.exp(rng.uniform(np.log(1e-9), np.log(2), 1_000_000)).astype(np.float32)
    huge = np.exp(rng.uniform(0, np.log(3e38), 20_000)).astype(np.float32)  # log-uniform over [1, 3e38]
    randoms = np.concatenate([log_uniform, huge]) * rng.choice(np.array([-1, 1], np.float32), 1_020_000)
    return np.concatenate([signed, -signed, randoms]).astype(np.float32)


@pytest.mark.parametrize("name", sorted(codebooks.MAPS))
def test_encode_equals_brute_force(name):
    qmap = codebooks.get_map(name)
    x = _probes(qmap)
    got = np.asarray(jax.jit(lambda v: codebooks.encode_nearest(v, qmap))(jnp.asarray(x)))
    want = _brute_force_chunked(x, qmap)
    wrong = np.flatnonzero(got != want)
    assert wrong.size == 0, f"{wrong.size} codes differ, e.g. x={x[wrong[:5]]}: got {got[wrong[:5]]}, want " \
                            f"{want[wrong[:5]]}"
    # the probes do reach the beyond-1 tie region: brute force returns codes other than the last one there
    assert np.any((x > 1) & (want != qmap.size - 1)) and np.any((x > 1) & (want == qmap.size - 1))
    np.testing.assert_array_equal(codebooks.decode(codebooks.encode_nearest(jnp.asarray(qmap), qmap), qmap), qmap)


@pytest.mark.parametrize("name", sorted(codebooks.MAPS))
def test_encode_non_finite(name):
    """NaN and +-Inf encode as code 0, as the brute-force argmin does (NaN distances, or all distances Inf)."""
    qmap = codebooks.get_map(name)
    x = jnp.array([jnp.nan, -jnp.nan, jnp.inf, -jnp.inf, 0.5], jnp.float32).reshape(5, 1)
    got = codebooks.encode_nearest(x, qmap)
    assert got.shape == (5, 1) and got.dtype == jnp.uint8
    np.testing.assert_array_equal(got[:4, 0], 0)
    np.testing.assert_array_equal(got, codebooks.encode_brute_force(x, qmap))
    assert int(got[4, 0]) != 0  # a finite value is not swept to 0 by the NaN handling


def test_encode_rejects_bad_map():
    with pytest.raises(ValueError, match="power of two"):
        codebooks.encode_nearest(jnp.zeros(3), np.arange(3, dtype=np.float32))
    with pytest.raises(ValueError, match="arithmetic encoder"):  # a sorted power-of-two map of another shape
        codebooks.encode_nearest(jnp.zeros(3), np.sort(np.random.default_rng(0).uniform(-1, 1, 16)).astype(np.float32))
    with pytest.raises(ValueError, match="unknown quantization map"):
        codebooks.get_map("dynamic_9bit")


@pytest.mark.parametrize("make", [lambda: codebooks.linear_map(16, include_zero=True), lambda: codebooks.linear_map(256),
                                  lambda: codebooks.dynamic_map(False, 3, 4)])
def test_encode_other_supported_maps(make):
    qmap = make()
    x = _probes(qmap)[::8]
    got = np.asarray(jax.jit(lambda v: codebooks.encode_nearest(v, qmap))(jnp.asarray(x)))
    np.testing.assert_array_equal(got, _brute_force_chunked(x, qmap))


@pytest.mark.parametrize("name", sorted(codebooks.MAPS))
def test_encode_unit_equals_brute_force(name):
    """On its domain |x| <= 1 (+ a few ulps: values times their block's 1 / absmax, divided on a GPU) and NaN,
    including the map values, the decision boundaries and decades +- a few ulps, zeros of both signs and 1e6
    log-uniform values."""
    qmap = codebooks.MAPS[name]
    x = _probes(qmap)
    top = np.float32(1)
    for _ in range(3):
        top = np.nextafter(top, np.float32(2))
    x = np.concatenate([x[np.abs(x) <= top], np.array([0.0, -0.0, 1.0, -1.0, top, -top, np.nan], np.float32)])
    got = np.asarray(jax.jit(lambda v: codebooks.encode_unit(v, qmap))(jnp.asarray(x)))
    want = _brute_force_chunked(x, qmap)  # NaN: code 0
    wrong = np.flatnonzero(got != want)
    assert got.dtype == np.uint8 and wrong.size == 0, f"{wrong.size} codes differ, e.g. x={x[wrong[:5]]}"


def test_codec_table_layout():
    qmap = codebooks.DYNAMIC_SIGNED_8BIT
    table = codebooks.codec_table(qmap)
    assert table.dtype == np.float32 and table.shape == (512,)
    np.testing.assert_array_equal(table[256:], qmap)  # values after the thresholds
    assert np.all((qmap[:-1] < table[:255]) & (table[:255] <= qmap[1:]))  # T_c between codes c and c + 1


def test_pack_4bit_roundtrip():
    codes = jax.random.randint(jax.random.key(2), (5, 128), 0, 16).astype(jnp.uint8)
    packed = codebooks.pack_4bit(codes)
    assert packed.shape == (5, 64) and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(codebooks.unpack_4bit(packed), codes)
    assert int(packed[0, 0]) == int(codes[0, 0]) * 16 + int(codes[0, 1])


@pytest.mark.parametrize("fmt,block,max_rel_err", [
    ("dynamic_signed_8bit", 256, 0.03), ("dynamic_unsigned_8bit", 256, 0.02), ("dynamic_signed_4bit", 128, 0.13),
    ("linear_unsigned_4bit", 128, 0.0625), ("e4m3", 256, 0.07), ("e4m3_dre", 128, 0.07)])
def test_blockwise_roundtrip(fmt, block, max_rel_err):
    x = jax.random.normal(jax.random.key(3), (32, 128))
    if "unsigned" in fmt:
        x = x * x
    q = blockwise.quantize(x, fmt, block)
    y = blockwise.dequantize(q)
    assert y.shape == x.shape and y.dtype == jnp.float32
    absmax = jnp.max(jnp.abs(x.reshape(-1, block)), axis=1, keepdims=True)
    err = jnp.abs(y - x).reshape(-1, block) / absmax  # error relative to the block's absmax
    assert float(err.max()) <= max_rel_err, float(err.max())
    if fmt in ("dynamic_unsigned_8bit", "linear_unsigned_4bit", "e4m3"):  # maps holding +-1.0: absmax is kept
        np.testing.assert_allclose(jnp.max(jnp.abs(y.reshape(-1, block)), 1), absmax[:, 0], rtol=2e-7)


def test_codebook_codes_are_nearest():
    x = jax.random.normal(jax.random.key(4), (4, 256))
    q = blockwise.quantize(x, "dynamic_signed_8bit", 256)
    normed = x / jnp.max(jnp.abs(x), axis=1, keepdims=True)
    np.testing.assert_array_equal(q.codes, codebooks.encode_brute_force(normed, codebooks.DYNAMIC_SIGNED_8BIT))


@pytest.mark.parametrize("fmt", blockwise.STATE_FORMATS)
def test_zero_and_nan_blocks(fmt):
    block = 128
    x = jax.random.uniform(jax.random.key(5), (4, block), minval=0.1, maxval=1.0)
    x = x.at[1].set(0.0).at[2, 7].set(jnp.nan).at[3, 3].set(jnp.inf)
    y = blockwise.dequantize(blockwise.quantize(x, fmt, block))
    np.testing.assert_array_equal(y[1], 0.0)  # all-zero block: exact zeros, no NaN
    assert bool(jnp.all(jnp.isnan(y[2])))  # NaN spreads to its block, never becomes finite
    assert not bool(jnp.any(jnp.isfinite(y[3, 3:4])))  # Inf never becomes finite either
    assert bool(jnp.all(jnp.isfinite(y[0])))


def test_dre_parameters_follow_coat():
    x = jnp.concatenate([jnp.geomspace(1e-6, 1e-2, 127), jnp.zeros(1)]).astype(jnp.float32)[None]
    q = blockwise.quantize_fp8_expanded(x, 128)
    big, small = 1e-2, 1e-6
    k = np.floor(np.log2(448.0**2 / 2) / np.log2(big / small) * 16) / 16
    assert q.expand.dtype == jnp.uint8 and int(q.expand[0]) == 16 * k  # k is stored exactly as 16 k
    assert q.centre.dtype == jnp.bfloat16  # sqrt(big * small) rounded to a power of two: 2**-13.29 -> 2**-13
    assert float(q.centre[0]) == 2.0**-13
    assert float(blockwise.dequantize(q)[0, -1]) == 0.0


def test_dre_parameters_from_bits_track_coat():
    """k and the centre come from the bit patterns by integer arithmetic (`adam_math.expansion_params`): on blocks of
    every range (max / min from 1 to ~1e30), 16 k is COAT's floor(16 log2(448**2 / 2) / log2(max / min)) or one more
    (the fixed-point log2 is up to ~2**-11 low), nearly always equal; the centre is a power of two whose log2 is
    within 0.6 of log2 sqrt(max min)."""
    rng = np.random.default_rng(0)
    n = 4096
    x = 10.0 ** (rng.uniform(-30, 0, (n, 1)) + rng.uniform(0, 3, (n, 1)) ** rng.uniform(0.3, 2.5, (n, 1))
                 * rng.uniform(0, 1, (n, 128)))
    x = (x * rng.choice([-1, 1], x.shape)).astype(np.float32)
    steps, centre, _ = (np.asarray(a) for a in jax.jit(adam_math.expansion_params)(jnp.asarray(x)))
    a = np.abs(x).astype(np.float64)
    big, small = a.max(axis=1), a.min(axis=1)
    with np.errstate(divide="ignore"):
        coat = np.clip(np.floor(16 * np.log2(448.0**2 / 2) / np.log2(big / small)), 1, 255)
    assert np.isin(steps - coat, [0, 1]).all() and np.mean(steps == coat) > 0.99
    assert (np.frexp(centre)[0] == 0.5).all() and (np.abs(np.log2(centre / np.sqrt(big * small))) <= 0.6).all()


def _mean_rel_err(fmt, x):
    y = blockwise.dequantize(blockwise.quantize(x, fmt, x.shape[-1]))
    return float(jnp.mean(jnp.abs(y - x) / x))


def test_dre_beats_plain_e4m3():
    # Narrow range: k > 1 spreads the group over more e4m3 exponents, so relative error shrinks about k times.
    narrow = jnp.geomspace(1e-3, 1e-2, 256, dtype=jnp.float32)[None]
    assert _mean_rel_err("e4m3_dre", narrow) < _mean_rel_err("e4m3", narrow) / 3
    # Range wider than e4m3's: plain absmax scaling flushes the small values to 0, expansion (k < 1) keeps them.
    wide = jnp.geomspace(1e-10, 1e-2, 256, dtype=jnp.float32)[None]
    assert _mean_rel_err("e4m3_dre", wide) < 0.1 < _mean_rel_err("e4m3", wide)


def test_bad_formats_raise():
    with pytest.raises(ValueError, match="unknown state format"):
        blockwise.quantize(jnp.zeros(256), "int3", 256)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        blockwise.quantize(jnp.zeros(256), "e4m3", 0)
    with pytest.raises(ValueError, match="whole number of blocks"):
        blockwise.quantize(jnp.zeros(300), "e4m3", 256)
    with pytest.raises(ValueError, match="even"):
        blockwise.check_format("dynamic_signed_4bit", 127)
