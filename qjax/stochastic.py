"""Stochastic rounding with a counter-based hash, reproducible bit for bit by GPU kernels.

GPU Pallas kernels have no random-number generator, so the random bits come from a pure function of
(seed, element index): `hash_uint32`. The jnp reference here and every kernel call it identically, so stochastic
rounding done by a kernel equals the reference exactly.

  index   = row-major position of the element in the array being rounded (uint32, wraps above 2**32 elements)
  bits    = hash_uint32(seed, index)                      uint32, uniform
  uniform = (bits >> 9) * 2**-23                          in [0, 1), exactly representable in float32

Rounding to a grid with spacing `ulp` at |y|: floor(|y| / ulp + uniform) * ulp, sign restored. This is unbiased to
within 2**-23 of a grid step: E[result] = y exactly where |y| / ulp has at most 23 fraction bits (every y of a
coarser format), else within 2**-23 * ulp.

Paired bits (`paired_bits`, the quantizers' gradients: `qjax.quantize`, `qjax.kernels.quantize_mgpu`): one hash
per two elements, each taking 16 of its bits, which halves the hashing, most of a stochastic quantize kernel's
extra time. In every aligned run of 128 elements (row-major), elements c and c + 64 share the word
hash_uint32(seed, 64 * run + c): c takes its low half, c + 64 its high half, each placed in the top 16 bits with the
low 16 zero, so `uniform_from_bits` gives k * 2**-16, k uniform in [0, 2**16). Unbiased to within 2**-16 of a grid
step (exact where |y| / ulp has at most 16 fraction bits): plenty for 8-bit grids. The two halves of a word are
independent bits of a well-mixed hash. The runs of 128 match the kernels' 128-wide tiles, whose register layout
gives elements c and c + 64 of a row to one thread (`pair_bits` joins the halves without moving data); word
indices wrap above 2**33 elements. Paired bits are for 8-bit formats: bfloat16's rounding reads the low 16 bits
(`truncate_to_bf16_grid`), which they leave zero. bfloat16 (`stochastic_round`, the optimizer's parameters in
`qjax.optim.sr_params` and its fused kernel) pairs adjacent elements instead (`bf16_bits`): elements 2j and 2j + 1
take the low and the high half of hash_uint32(seed, j), in their low 16 bits; a kernel whose threads hold
consecutive elements hashes each word once and splits it in registers (`split_bf16_words`). Other formats'
`stochastic_round` keeps one hash per element (`element_bits`: 23 random bits).

`round_to_grid` is the reference (plain jnp, which XLA fuses best); `stochastic_codes` is the same rounding and cast
with kernel-safe ops (`qjax.numerics`), bit-identical, for kernels.
"""

import jax
import jax.numpy as jnp
from jax import lax

from qjax import formats, numerics


def hash_uint32(seed: jnp.ndarray, index: jnp.ndarray) -> jnp.ndarray:
    """Mixes a uint32 seed and uint32 element indices into uniform uint32 bits.

    lowbias32(index ^ lowbias32(seed')) with lowbias32 the integer hash of C. Wellons: each seed's stream is one
    fixed well-mixed sequence re-indexed by an xor with a hashed seed, so streams of nearby seeds do not overlap in
    order. Only xor, shifts and 32-bit multiplies: cheap on GPU and identical in any backend.
    """

    def lowbias32(v):
        v = v ^ (v >> 16)
        v = v * jnp.uint32(0x7FEB352D)
        v = v ^ (v >> 15)
        v = v * jnp.uint32(0x846CA68B)
        return v ^ (v >> 16)

    seed = jnp.asarray(seed, jnp.uint32)
    index = jnp.asarray(index, jnp.uint32)
    return lowbias32(index ^ lowbias32(seed * jnp.uint32(0x9E3779B9) + jnp.uint32(1)))


def uniform_from_bits(bits: jnp.ndarray) -> jnp.ndarray:
    """uint32 random bits -> float32 uniform (bits >> 9) * 2**-23 in [0, 1) (exact in float32).

    Built as the float 1.(top 23 bits) in [1, 2) minus 1, which needs no int -> float conversion: kernels compute
    it per element, and conversions run at a fraction of the FP32 rate on Hopper."""
    one_point_bits = (bits >> 9) | jnp.uint32(0x3F800000)
    return lax.bitcast_convert_type(one_point_bits, jnp.float32) - jnp.float32(1)


def element_bits(seed: jnp.ndarray, shape: tuple[int, ...]) -> jnp.ndarray:
    """hash_uint32(seed, row-major index) for every element of an array of `shape`."""
    size = 1
    for d in shape:
        size *= d
    return hash_uint32(seed, lax.iota(jnp.uint32, size).reshape(shape))


def bf16_bits(seed: jnp.ndarray, index: jnp.ndarray) -> jnp.ndarray:
    """uint32 random bits for bfloat16 stochastic rounding of the elements at uint32 row-major `index`, one hash per
    two: element i takes half i & 1 of hash_uint32(seed, i >> 1), moved to its low 16 bits (the ones
    `truncate_to_bf16_grid` reads); its high 16 bits are not random."""
    index = jnp.asarray(index, jnp.uint32)
    words = hash_uint32(seed, index >> jnp.uint32(1))
    return jnp.where((index & jnp.uint32(1)) == 0, words, words >> jnp.uint32(16))


def split_bf16_words(words: jnp.ndarray) -> jnp.ndarray:
    """hash words (..., n) of word indices j -> `bf16_bits` (..., 2 n) of elements 2j and 2j + 1: (word, word >> 16)."""
    return jnp.stack([words, words >> jnp.uint32(16)], axis=-1).reshape(*words.shape[:-1], -1)


PAIR_RUN = 128  # elements per run of paired bits: element c and c + PAIR_RUN // 2 share one hash


def pair_bits(words: jnp.ndarray) -> jnp.ndarray:
    """uint32 hash words (..., 64) -> bits (..., 128) of the run they cover: word c's low half (shifted to the top)
    for element c, its high half for element c + 64; the low 16 bits of each are zero (`paired_bits`)."""
    return jnp.concatenate([words << jnp.uint32(16), words & jnp.uint32(0xFFFF0000)], axis=-1)


def paired_bits(seed: jnp.ndarray, shape: tuple[int, ...]) -> jnp.ndarray:
    """Random bits for every element of an array of `shape` (row-major), one hash per two elements (module
    docstring): uint32 with 16 random bits on top, for `round_to_grid` / `stochastic_codes` to 8-bit formats (not
    bfloat16, which reads the low 16 bits)."""
    size = 1
    for d in shape:
        size *= d
    runs = -(-size // PAIR_RUN)
    words = hash_uint32(seed, lax.iota(jnp.uint32, runs * (PAIR_RUN // 2)).reshape(runs, PAIR_RUN // 2))
    return pair_bits(words).reshape(-1)[:size].reshape(shape)


def truncate_to_bf16_grid(y: jnp.ndarray, bits: jnp.ndarray) -> jnp.ndarray:
    """f32 y with 16 random bits added below bfloat16's kept mantissa, then truncated: stochastic rounding to bf16
    (finite y; the carry rounds up with probability equal to the dropped fraction)."""
    y_bits = lax.bitcast_convert_type(y, jnp.uint32)
    return lax.bitcast_convert_type((y_bits + (bits & jnp.uint32(0xFFFF))) & jnp.uint32(0xFFFF0000), jnp.float32)


def grid_step(magnitude: jnp.ndarray, fmt: formats.Format) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(ulp, 1 / ulp) of `fmt`'s grid at f32 magnitude >= 0, both exact powers of two built from exponent bits with
    integer ops alone (shared with the kernels): ulp = 2**(max(e, e_min) - m) has the exponent field
    max(e, e_min) - m + 127, and 1 / ulp the field 254 minus that (e = -127 for zero and f32 subnormals)."""
    exponent_field = lax.bitcast_convert_type(magnitude, jnp.int32) & jnp.int32(0x7F800000)
    ulp_field = (jnp.maximum(exponent_field, jnp.int32((fmt.min_exponent + 127) << 23))
                 - jnp.int32(fmt.mantissa_bits << 23))
    return (lax.bitcast_convert_type(ulp_field, jnp.float32),
            lax.bitcast_convert_type(jnp.int32(254 << 23) - ulp_field, jnp.float32))


def round_to_grid(y: jnp.ndarray, fmt: formats.Format, bits: jnp.ndarray) -> jnp.ndarray:
    """Stochastically rounds float32 `y` to `fmt`'s grid, returned as float32 (not yet clamped or cast).

    int8: floor(y + u). Floats with mantissa_bits m and minimum normal exponent e_min: the grid spacing at |y| is
    2**(max(e, e_min) - m), e = floor(log2|y|); built from exponent bits, valid while e_min - m >= -126 (fp8, f16),
    as is its inverse, so |y| / ulp is an exact multiplication (a division is an instruction sequence on a GPU).
    bfloat16 uses the equivalent bit form: add 16 random bits below the kept mantissa, then truncate.
    NaN and +-Inf pass through unchanged.
    """
    y = y.astype(jnp.float32)
    # Finite values beyond the format's range saturate; without this the random carry could reach Inf / NaN.
    y = jnp.where(jnp.isfinite(y), jnp.clip(y, -fmt.max_value, fmt.max_value), y)
    if fmt.is_integer:
        return jnp.floor(y + uniform_from_bits(bits))
    if fmt.name == "bf16":
        return jnp.where(jnp.isfinite(y), truncate_to_bf16_grid(y, bits), y)
    if fmt.min_exponent - fmt.mantissa_bits < -126:
        raise ValueError(f"stochastic rounding to {fmt.name} is not supported")
    magnitude = jnp.abs(y)
    ulp, inverse_ulp = grid_step(magnitude, fmt)
    rounded = jnp.floor(magnitude * inverse_ulp + uniform_from_bits(bits)) * ulp
    return jnp.where(jnp.isfinite(y), jnp.copysign(rounded, y), y)


def stochastic_round_with_seed(x: jnp.ndarray, dtype, seed: jnp.ndarray) -> jnp.ndarray:
    """`stochastic_round` with an explicit uint32 seed instead of a PRNG key (the form kernels use)."""
    fmt = formats.get_format(dtype)
    if fmt.name == "bf16":
        bits = bf16_bits(seed, lax.iota(jnp.uint32, x.size).reshape(x.shape))
    else:
        bits = element_bits(seed, x.shape)
    y = round_to_grid(x.astype(jnp.float32), fmt, bits)
    if fmt.name == "bf16":
        return y.astype(jnp.bfloat16)  # exact: y is on the bf16 grid
    return formats.saturating_cast(y, fmt)


def _round_float_to_grid(y, fmt: formats.Format, bits, *, may_be_inf: bool):
    """`round_to_grid` with kernel-safe ops (same operations in the same order) for a float format: f32 y, uint32
    bits -> f32. may_be_inf: as in `stochastic_codes`."""
    y = jnp.where(numerics.is_finite(y), numerics.clamp(y, fmt.max_value), y) if may_be_inf else numerics.clamp(
        y, fmt.max_value)
    if fmt.name == "bf16":
        return jnp.where(numerics.is_finite(y), truncate_to_bf16_grid(y, bits), y)
    magnitude = jnp.abs(y)
    ulp, inverse_ulp = grid_step(magnitude, fmt)
    # magnitude / ulp <= 2**(mantissa_bits + 1): in numerics.floor's range
    rounded = numerics.floor(magnitude * inverse_ulp + uniform_from_bits(bits)) * ulp
    signed = numerics.copysign(rounded, y)  # NaN y: NaN with y's sign, as the reference's select of y gives
    return jnp.where(numerics.is_finite(y), signed, y) if may_be_inf else signed


def _stochastic_int8(y, bits, may_be_inf: bool):
    """floor(clip(y, -127, 127) + u) as int8 codes, NaN -> 0: `round_to_grid` + `formats.saturating_cast` for int8.
    One magic-number add gives both the floor and the code: v + MAGIC holds round(v) in its mantissa bits, so the
    code is those bits minus one where that rounded up.

    v is in [-127, 128]: 127 + u rounds to 128 for u > 1 - 2**-18, so an integer min of 127 is the cast's clip. +Inf
    then gives 127 as in the reference (which floors +Inf and clips it); -Inf (may_be_inf) is selected apart: the
    reference floors it to -Inf (code -127), where -127 + u may round to -126."""
    v = numerics.clamp(y, 127.0) + uniform_from_bits(bits)
    shifted, _, rounded_up = numerics.round_by_magic(v)
    code = lax.bitcast_convert_type(shifted, jnp.int32) - jnp.int32(numerics.MAGIC_BITS)
    code = jnp.minimum(jnp.where(rounded_up, code - jnp.int32(1), code), jnp.int32(127))
    if may_be_inf:
        code = jnp.where(y == jnp.float32(-jnp.inf), jnp.int32(-127), code)
    return jnp.where(y == y, code, jnp.int32(0)).astype(jnp.int8)


def stochastic_codes(y, fmt: formats.Format, bits, *, may_be_inf: bool):
    """Stochastic rounding of f32 y straight to fmt's codes (`numerics.cast_codes` forms), with kernel-safe ops:
    the kernel form of `round_to_grid` followed by `formats.saturating_cast`. may_be_inf=False: y is finite or NaN
    (never +-Inf), which makes the reference's isfinite selects the identity."""
    if fmt.is_integer:
        return _stochastic_int8(y, bits, may_be_inf)
    return numerics.cast_codes(_round_float_to_grid(y, fmt, bits, may_be_inf=may_be_inf), fmt,
                               may_be_inf=may_be_inf)


def key_to_seed(key: jax.Array) -> jnp.ndarray:
    """A PRNG key (typed, or raw uint32[2]) -> one uint32 seed."""
    if not isinstance(key, jax.Array) or not (
        jnp.issubdtype(key.dtype, jax.dtypes.prng_key) or (key.dtype == jnp.uint32 and key.shape == (2,))):
        raise TypeError(f"expected a PRNG key from jax.random.key(seed), got {type(key).__name__} "
                        f"{getattr(key, 'dtype', '')}{getattr(key, 'shape', '')}")
    return jax.random.bits(key, (), jnp.uint32)


def stochastic_round(x: jnp.ndarray, dtype, key: jax.Array) -> jnp.ndarray:
    """Rounds `x` to `dtype` stochastically: up or down with probability given by the distance, so E[out] = x.

    Args:
      x: float array (float32 for full unbiasedness; any float dtype is upcast first).
      dtype: jnp.bfloat16, jnp.float8_e4m3fn or jnp.float8_e5m2.
      key: a `jax.random.key`. The same key and shape always give the same result.

    Returns:
      An array of `x.shape` and `dtype`. Finite values beyond the format's range saturate to its max; NaN stays NaN.

    Raises:
      ValueError for jnp.int8: int8 has no NaN, so NaN or Inf would become finite codes. Quantize with a scale
      instead, which keeps them visible: `qjax.quantize(x, qjax.QuantSpec("int8", "row", stochastic=True), key)`.
    """
    if not jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating):
        raise TypeError(f"stochastic_round needs a float array, got {jnp.asarray(x).dtype}")
    if jnp.dtype(dtype) == jnp.int8:
        raise ValueError("stochastic_round to int8 would turn NaN and Inf into finite codes: use qjax.quantize(x, "
                         "qjax.QuantSpec('int8', 'row', stochastic=True), key), whose scale keeps them")
    return stochastic_round_with_seed(jnp.asarray(x), dtype, key_to_seed(key))
