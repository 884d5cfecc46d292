"""The stochastic-rounding cast kernel (benchmarks/stochastic_cast_mgpu.py, outside the library) against
`qjax.stochastic.stochastic_round_with_seed`: `pytest benchmarks/test_stochastic_cast_mgpu.py` (not in the default
test run; its kernel-safe helpers are tested in tests/test_numerics.py).

Off a Hopper GPU the kernel runs under the Mosaic GPU interpreter and must equal the jitted reference bit for bit.
On a GPU (marked tests) it is compared with XLA:GPU's reference: equal bits, except that NaN results need only be
NaN on both sides (NaN sign/payload bits are backend choices).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stochastic_cast_mgpu
from qjax import formats, stochastic
from qjax.dispatch import on_hopper_gpu

SEED = np.uint32(0xC0FFEE)
TARGETS = [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int8]
interpreter_only = pytest.mark.skipif(on_hopper_gpu(), reason="CPU interpreter tests (GPU: the gpu tests)")


def _input(shape, dtype, target, seed=0):
    """Values over many decades around the target's range, plus NaN, +-Inf, -0, values beyond the target's max
    (saturate), f32 subnormals and exact grid points / midpoints of the target."""
    key_n, key_e = jax.random.split(jax.random.key(seed))
    top = formats.get_format(target).max_value
    x = np.array(jax.random.normal(key_n, shape) * 10.0 ** jax.random.uniform(key_e, shape, minval=-6, maxval=3))
    flat = x.reshape(-1)
    specials = [np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0, top, -top, min(top * 1.01, 3.4e38), -min(top * 3, 3.4e38), 1e-40, -3e-39,
                2.5, -3.5, 0.75, 17.0, 19.0, 126.5, -127.4, 1.0 + 2**-8, 3e38, -3.4e38]
    flat[:len(specials)] = specials
    flat[-3:] = [np.nan, np.inf, 1.5]  # in the last, padded tile
    return jnp.asarray(x, jnp.float32).astype(dtype)  # float16: values beyond its range become +-Inf


def _bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16}[a.dtype.itemsize])


def _assert_same(got, want, compiled):
    assert got.shape == want.shape and got.dtype == want.dtype
    got_bits, want_bits = _bits(got), _bits(want)
    if compiled and jnp.issubdtype(want.dtype, jnp.floating):
        nan, nan_ref = np.isnan(np.asarray(got, np.float32)), np.isnan(np.asarray(want, np.float32))
        np.testing.assert_array_equal(nan, nan_ref)
        got_bits, want_bits = got_bits[~nan_ref], want_bits[~nan_ref]
    differ = int(np.sum(got_bits != want_bits))
    assert differ == 0, f"{differ} of {got_bits.size} values differ ({want.dtype})"


def _check(x, target):
    compiled = on_hopper_gpu()
    # Jitted: run eagerly, interpreted kernels can deadlock with the next eager op.
    got = jax.jit(lambda x: stochastic_cast_mgpu.stochastic_cast(x, target, SEED,
                                                                 interpret=None if compiled else True))(x)
    want = jax.jit(lambda x: stochastic.stochastic_round_with_seed(x, target, SEED))(x)
    _assert_same(got, want, compiled)
    return got


@interpreter_only
@pytest.mark.parametrize("target", TARGETS)
def test_matches_reference(target):
    # 35,000 elements: five 64 x 128 tiles, the last one padded (flat indices across tiles and the slice).
    x = _input((5, 7000), jnp.float32, target)
    got = np.asarray(_check(x, target), np.float32).reshape(-1)
    fmt = formats.get_format(target)
    if fmt.is_integer:
        assert got[0] == 0 and got[2] == 127 and got[3] == -127  # NaN -> 0, +-Inf saturate like the reference
    else:
        assert np.isnan(got[0]) and np.abs(got[8]) <= fmt.max_value  # NaN stays NaN; finite values saturate
        assert np.isnan(got[2]) if target == jnp.float8_e4m3fn else got[2] == np.inf  # e4m3fn has no Inf
    assert np.all(got[np.isfinite(got)] <= fmt.max_value)


@interpreter_only
def test_input_dtypes_and_shapes():
    x = _input((3, 50), jnp.float16, jnp.float8_e5m2, seed=2)  # float16 input, one padded tile
    _check(x, jnp.float8_e5m2)
    empty = stochastic_cast_mgpu.stochastic_cast(jnp.zeros((0, 4)), jnp.int8, SEED, interpret=True)
    assert empty.shape == (0, 4) and empty.dtype == jnp.int8


def test_errors():
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        stochastic_cast_mgpu.stochastic_cast(jnp.zeros(8, jnp.int32), jnp.int8, SEED, interpret=True)
    with pytest.raises(TypeError, match="uint32 scalar"):
        stochastic_cast_mgpu.stochastic_cast(jnp.zeros(8), jnp.int8, jnp.zeros(2, jnp.uint32), interpret=True)
    with pytest.raises(ValueError, match="unsupported quantization format"):
        stochastic_cast_mgpu.stochastic_cast(jnp.zeros(8), jnp.float16, SEED, interpret=True)


def test_lowers_for_hopper():
    """The Mosaic GPU lowering succeeds for sm_90 on any host (int8's floor path and e5m2's float16 path)."""
    for target, dtype in ((jnp.int8, jnp.float32), (jnp.float8_e5m2, jnp.bfloat16)):
        f = lambda x: stochastic_cast_mgpu.stochastic_cast(x, target, SEED)
        lowered = jax.jit(f).trace(jnp.zeros((300, 100), dtype)).lower(lowering_platforms=("cuda",))
        assert "mosaic_gpu" in lowered.as_text()


# ---------------------------------------------------------------- GPU (H100/H200): compiled kernel vs XLA:GPU


@pytest.mark.skipif(not on_hopper_gpu(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shape,dtype", [((4096, 4096), jnp.float32), ((1000, 3001), jnp.bfloat16)])
def test_gpu_matches_reference(target, shape, dtype):
    assert on_hopper_gpu(), jax.devices()
    _check(_input(shape, dtype, target, seed=3), target)
