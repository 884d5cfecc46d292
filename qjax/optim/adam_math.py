"""The low-bit Adam formulas that the optimizer's jnp code and the fused step kernel (`qjax.kernels.adam_step_mgpu`)
share, each written once and kernel-safe (`qjax.numerics`' rules): clipping by the global norm, the Adam update, the
param update, and the e4m3 state codecs, plain and with COAT's dynamic range expansion. The code book states are
`qjax.optim.codebooks`'.
"""

import math

import jax.numpy as jnp
from jax import lax

from qjax import formats, numerics

FP8_STATE_FORMATS = ("e4m3", "e4m3_dre")  # the e4m3 state formats (no code table)


def quantize_e4m3_blocks(blocks, broadcast_rows=numerics.broadcast_last):
    """f32 blocks (..., B) -> (codes float8_e4m3fn (..., B), scale f32 (...)): scale = amax / 448 (1 for all-zero
    blocks and, by `numerics.invertible_scale`, below 2**-126), codes = e4m3(clamp(x * (1 / scale))), rounded to
    nearest even. The optimizer states' e4m3 format.

    x * (1 / scale) is finite or NaN (an Inf makes the scale Inf: Inf * 0 = NaN), so the clamp alone is the
    saturating cast, and it makes XLA's cast agree with Mosaic GPU's saturating one. broadcast_rows(scale, shape) ->
    scale broadcast along B (kernels pass one that sets their register layout)."""
    block_amax = numerics.amax(blocks, axis=-1)
    scale = numerics.nonzero(numerics.invertible_scale(block_amax / jnp.float32(formats.E4M3.max_value)))
    inverse = broadcast_rows(1 / scale, blocks.shape)
    codes = numerics.clamp(blocks * inverse, formats.E4M3.max_value).astype(formats.E4M3.dtype)
    return codes, scale


# COAT's dynamic range expansion (the optimizer states' "e4m3_dre" format): k is a multiple of 1 / EXPAND_STEPS.
EXPAND_STEPS = 16
_EXPAND_STEPS_MAX = 255  # 16 k is stored as a uint8
_LOG2_BITS = 12  # fractional bits of the fixed-point log2(max / min) that k comes from
# 16 log2(448**2 / 2) in that fixed point: 16 k = floor(this / log2(max / min)) fills e4m3's range.
_EXPAND_NUMERATOR = round(EXPAND_STEPS * math.log2(formats.E4M3.max_value ** 2 / 2) * 2**_LOG2_BITS)
_INF_BITS = 0x7F800000
_MANTISSA_BITS = 0x7FFFFF


def _power(magnitude, exponent):
    """magnitude ** exponent for f32 magnitude >= 0 (0 -> 0 for exponent > 0), as exp(exponent * log(magnitude)):
    Mosaic GPU lowers exp and log but not pow. Natural exp and log, not exp2 / log2: XLA computes those as exp(x ln 2)
    and log(x) / ln 2, Mosaic GPU with other functions, so only exp and log can be the same on both sides."""
    return jnp.exp(exponent * jnp.log(magnitude))


def _log2_ratio_fixed(big_bits, small_bits):
    """log2(big / small) * 2**_LOG2_BITS, truncated (within ~2**-11 of the real log2), as int32 >= 0, from the int32
    bit patterns of finite f32 big >= small > 0 (a subnormal counts as 2**-127 (1 + f)). Integer arithmetic only, so
    XLA and Mosaic GPU give the same bits: the exponent difference, then the mantissa ratio q in [1, 2) in 1.15
    fixed point and its log2 bit by bit (q squared: a bit is 1 where the square reaches 2, which is then halved)."""
    one = jnp.int32(1 << 15)
    mantissa = lambda b: ((b & jnp.int32(_MANTISSA_BITS)) | jnp.int32(0x800000)) >> 8  # 1.15 fixed point
    q = lax.div(mantissa(big_bits) << 15, mantissa(small_bits))  # 1.15, in (1/2, 2)
    borrow = q < one  # big's mantissa below small's: q doubled, the exponent difference one less
    q = jnp.where(borrow, q << 1, q).astype(jnp.uint32)  # q < 2**16: its square fits in uint32
    exponent = (big_bits >> 23) - (small_bits >> 23) - jnp.where(borrow, jnp.int32(1), jnp.int32(0))
    fixed = exponent
    for _ in range(_LOG2_BITS):
        q = (q * q) >> 15
        bit = q >> 16
        q = q >> bit
        fixed = (fixed << 1) | bit.astype(jnp.int32)
    return fixed


def expansion_params(blocks):
    """COAT's expansion parameters of f32 blocks (..., B) -> (steps int32, centre f32, amax f32), each (...).

    With max and min the block's largest and smallest non-zero |x| (int32 max and min over bit patterns, like
    `amax`): steps = 16 k = floor(16 log2(448**2 / 2) / log2(max / min)) clipped to [1, 255], log2(max / min) in
    fixed point (`_log2_ratio_fixed`: ~0.3% of blocks get one step more than with an exact log2); centre = COAT's
    sqrt(max min) rounded to a power of two (log2 within 0.6 of it; any centre works, decoding uses the stored one).
    Both come from the bit patterns by integer arithmetic alone, so a kernel and its jnp reference agree bit for bit
    (a log or sqrt may round differently in XLA and Mosaic GPU); a power of two is exact in bfloat16 and makes
    |x| / c exact. All-zero blocks: steps 16, centre 1. Blocks holding NaN: a NaN amax and centre; holding Inf (no
    NaN): an Inf amax and centre (steps 16 for both), so the scale of either is NaN (`quantize_e4m3_expanded_blocks`).
    """
    bits = lax.bitcast_convert_type(blocks, jnp.int32) & jnp.int32(0x7FFFFFFF)
    big = numerics.amax(blocks, axis=-1)
    big_bits = lax.bitcast_convert_type(big, jnp.int32)
    small_bits = jnp.min(jnp.where(bits == 0, jnp.int32(_INF_BITS), bits), axis=-1)
    usual = numerics.is_finite(big) & (big != 0)  # else small_bits is Inf's (all zero) or unused
    steps = lax.div(jnp.int32(_EXPAND_NUMERATOR), jnp.maximum(_log2_ratio_fixed(big_bits, small_bits), jnp.int32(1)))
    steps = jnp.where(usual, jnp.clip(steps, 1, _EXPAND_STEPS_MAX), jnp.int32(EXPAND_STEPS))
    # The mean of the bit patterns is Mitchell's log2 sqrt(max min) (exponent + mantissa, at most 0.09 low); + 1/2
    # and the mantissa cleared rounds it to the nearest exponent, kept in [2**-126, 2**126]: a normal float whose
    # reciprocal is normal too (x / centre may run as x * (1 / centre), and XLA:CPU flushes 2**-127 to zero).
    mean = (big_bits >> 1) + (small_bits >> 1) + jnp.int32(1 << 22)
    centre = lax.bitcast_convert_type(jnp.clip(mean & jnp.int32(_INF_BITS), 1 << 23, 253 << 23), jnp.float32)
    centre = jnp.where(usual, centre, jnp.where(big == 0, jnp.float32(1), big))
    return steps, centre, big


def quantize_e4m3_expanded_blocks(blocks, broadcast_rows=numerics.broadcast_last):
    """f32 blocks (..., B) -> (codes float8_e4m3fn (..., B), scale f32 (...), expand uint8 (...), centre bfloat16
    (...)): COAT's dynamic range expansion, then e4m3 with absmax scaling (the optimizer states' "e4m3_dre").

    x -> copysign((|x| / centre) ** k, x) with k = expand / 16 (`expansion_params`), scale = (max / centre) ** k /
    448 (1 for all-zero blocks, NaN for blocks holding NaN or Inf), codes = e4m3(clamp(expanded / scale)).
    broadcast_rows as in `quantize_e4m3_blocks`."""
    steps, centre, big = expansion_params(blocks)
    k = steps.astype(jnp.float32) / jnp.float32(EXPAND_STEPS)  # exact: a multiple of 1/16
    ratio = jnp.abs(blocks) / broadcast_rows(centre, blocks.shape)
    expanded = numerics.copysign(_power(ratio, broadcast_rows(k, blocks.shape)), blocks)
    scale = numerics.nonzero(_power(big / centre, k) / jnp.float32(formats.E4M3.max_value))
    codes = numerics.clamp(expanded / broadcast_rows(scale, blocks.shape), formats.E4M3.max_value)
    codes = codes.astype(formats.E4M3.dtype)
    return codes, scale, steps.astype(jnp.uint8), centre.astype(jnp.bfloat16)  # a power of two: exact


def dequantize_e4m3_expanded_blocks(codes, scale, expand, centre, broadcast_rows=numerics.broadcast_last):
    """Inverse of `quantize_e4m3_expanded_blocks`: codes (..., B), scale f32, expand uint8, centre bfloat16 (...)
    -> f32 (..., B) = copysign(|y| ** (1 / k) * centre, y), y = code * scale, 1 / k = 16 / expand. Zeros stay zero;
    a NaN scale gives NaN everywhere in its block."""
    y = codes.astype(jnp.float32) * broadcast_rows(scale, codes.shape)
    inverse_k = jnp.float32(EXPAND_STEPS) / expand.astype(jnp.float32)
    magnitude = _power(jnp.abs(y), broadcast_rows(inverse_k, codes.shape))
    return numerics.copysign(magnitude * broadcast_rows(centre.astype(jnp.float32), codes.shape), y)


def round_to(x, dtype):
    """float32 x rounded to the nearest value of float `dtype` (identity for float32), as float32. A
    `reduce_precision`, not a cast there and back: XLA may drop such a pair of casts (excess precision)."""
    if jnp.dtype(dtype) == jnp.float32:
        return x
    info = jnp.finfo(dtype)
    return lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def clip_factors(norm, max_norm: float, dtype):
    """`optax.clip_by_global_norm`'s scalars for one gradient of `dtype` -> (keep, divisor, multiplier) for
    `clip_gradient`: keep (bool) where norm < max_norm (compared as optax compares: the norm in its own dtype,
    `optax.tree.norm`'s, against a weakly typed Python float), divisor and multiplier float32 holding the norm and
    max_norm rounded to `dtype` (optax divides by norm.astype(g.dtype), multiplies by max_norm in g's dtype). A NaN
    norm compares False: NaN gradients, as optax gives."""
    keep = jnp.asarray(norm < max_norm)
    divisor = round_to(jnp.asarray(norm, jnp.float32), dtype)
    multiplier = jnp.asarray(max_norm, dtype).astype(jnp.float32)  # as jnp converts a weakly typed Python float
    return keep, divisor, multiplier


def scale_gradient(g, divisor, multiplier, dtype, rounded=round_to):
    """optax.clip_by_global_norm's (g / norm) * max_norm on the float32 values g of a gradient of `dtype`, each op's
    result rounded to `dtype` as optax's op in that dtype specifies (a bfloat16 quotient rounded to float32, then to
    bfloat16, is the correctly rounded one: double rounding is innocuous from 24 to 8 significant bits) -> float32.
    divisor, multiplier: `clip_factors`' (or 1 and 1, which leave g as it is); rounded(x, dtype): `round_to` (a
    kernel passes casts)."""
    return rounded(rounded(g / divisor, dtype) * multiplier, dtype)


def clip_gradient(g, keep, divisor, multiplier, dtype):
    """optax.clip_by_global_norm on the float32 values g of a gradient of `dtype` -> float32: g where `keep` (a
    scalar), else `scale_gradient`. Args from `clip_factors`. A select, as optax's: XLA keeps the division under it,
    where it may turn a bare x / broadcast(scalar) into x * (1 / scalar), other bits."""
    return lax.select(keep, g, scale_gradient(g, divisor, multiplier, dtype))


def adam_math(g, m_old, v_old, b1, b2, eps, bias_correction1, bias_correction2_sqrt):
    """One Adam step on float32 arrays -> (direction, m, v), from the un-quantized new m and v."""
    g = g.astype(jnp.float32)
    m = m_old + (1 - b1) * (g - m_old)
    v = v_old + (1 - b2) * (g * g - v_old)
    # Scalar reciprocals, then multiplies: a float32 division costs a kernel ~8 instructions per element.
    inverse1, inverse2 = 1 / bias_correction1, 1 / bias_correction2_sqrt
    direction = (m * inverse1) / (jnp.sqrt(v) * inverse2 + eps)
    return direction, m, v


def param_update(p, direction, step_size, weight_decay: float):
    """optax's add_decayed_weights, scale_by_learning_rate and apply_updates on float32 arrays, in their order.
    step_size: -learning_rate; weight_decay: a Python float (0 skips the decay, as optax does)."""
    u = direction + jnp.float32(weight_decay) * p if weight_decay else direction
    return p + step_size * u
