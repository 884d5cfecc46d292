"""Kernel-safe numerics: the formulas that every jnp reference and every Mosaic GPU kernel share, each written once.

Every function takes and returns jnp arrays of any shape and uses only operations that XLA and Mosaic GPU both lower
with the same IEEE results, so a kernel calls the very function its reference calls (docs/design.md, "Kernel/reference
contract"). What that excludes, and the replacement used here:

  floor, round      -> a magic-number add (`round_by_magic`): no conversion instructions, which run at a fraction of
                       the FP32 rate on Hopper
  isfinite, isnan   -> |v| < inf, v == v
  float max-reduce  -> an int32 max over bit patterns (`amax`): XLA:CPU's float max-reduction can drop a NaN
  f32 -> fp8 cast   -> clamp first (`clamp`): Mosaic GPU's cast saturates (+-Inf becomes +-max), XLA's does not

NaN convention, for every amax (GEMM operands and optimizer states alike): max |x| over a block is NaN if the block
holds a NaN, else +Inf if it holds +-Inf. A NaN or Inf amax gives a NaN or Inf scale, so everything computed from
the block (dequantized values, GEMM outputs, optimizer moments) is non-finite: bad input is never hidden.
"""

import math

import jax.numpy as jnp
from jax import lax

from qjax import formats

# Largest K for which an int32 sum of K products of int8 codes (|code| <= 127) cannot overflow.
INT32_SAFE_K = (2**31 - 1) // 127**2
_TINY = float(jnp.finfo(jnp.float32).tiny)

# 1.5 * 2**23 and its f32 bits. For |v| <= 2**22 the floats around 1.5 * 2**23 + v are 1 apart, so the f32 sum is v
# rounded half to even, held in the low mantissa bits; its bits minus MAGIC_BITS are that integer.
MAGIC = 1.5 * 2**23
MAGIC_BITS = 0x4B400000


def is_finite(v):
    """jnp.isfinite for f32 arrays (NaN compares false)."""
    return jnp.abs(v) < jnp.float32(jnp.inf)


def clamp(v, bound: float):
    """jnp.clip(v, -bound, bound), keeping NaN: max / min propagate NaN in XLA and lower to PTX max.NaN / min.NaN."""
    bound = jnp.float32(bound)
    return jnp.minimum(jnp.maximum(v, -bound), bound)


def nonzero(divisor):
    """0 -> 1, so an all-zero block divides 0 by 1 instead of 0 by 0; NaN and Inf stay."""
    return jnp.where(divisor == 0, jnp.float32(1), divisor)


def invertible_scale(scale):
    """A block scale >= 0 (or NaN) made one whose reciprocal is a normal float32, which block quantizers multiply
    by (one division per block instead of one per element, ~8 instructions each in a kernel): below 2**-126 -> 0,
    the block is stored as zeros (1 / scale would overflow); above 2**126 -> +Inf, the block overflows and decodes
    to non-finite values, never to wrong finite ones (1 / scale would be subnormal, which XLA:CPU flushes to zero,
    and every code would be 0's). NaN stays."""
    scale = jnp.where(scale < jnp.float32(2.0**-126), jnp.float32(0), scale)
    return jnp.where(scale > jnp.float32(2.0**126), jnp.float32(jnp.inf), scale)


def round_half_even_to_int32(v):
    """f32 |v| <= 2**22 -> int32, rounded half to even (jnp.round), with one FP32 add and one integer subtract."""
    return lax.bitcast_convert_type(v + jnp.float32(MAGIC), jnp.int32) - jnp.int32(MAGIC_BITS)


def round_by_magic(v):
    """(v + MAGIC, that sum minus MAGIC, whether it rounded v up) for f32 |v| <= 2**22: the sum holds v rounded to
    the nearest integer, and minus MAGIC that integer is an exact f32. The barrier keeps XLA (the CPU interpreter
    runs kernels through it) from folding (v + MAGIC) - MAGIC back to v; compiled, it pins the sum in registers."""
    shifted = lax.optimization_barrier(v + jnp.float32(MAGIC))
    nearest = shifted - jnp.float32(MAGIC)
    return shifted, nearest, nearest > v


def floor(v):
    """floor for f32 |v| <= 2**22 (NaN and +-Inf pass through; -0 gives +0): the nearest integer, one less where
    that rounded up."""
    _, nearest, rounded_up = round_by_magic(v)
    return jnp.where(rounded_up, nearest - jnp.float32(1), nearest)


def copysign(magnitude, sign_source):
    """copysign for a non-negative f32 magnitude: its bits with the sign bit of sign_source."""
    sign = lax.bitcast_convert_type(sign_source, jnp.uint32) & jnp.uint32(0x80000000)
    return lax.bitcast_convert_type(lax.bitcast_convert_type(magnitude, jnp.uint32) | sign, jnp.float32)


def amax(x, axis=None):
    """max |x| of f32 x over `axis` (None: all), NaN where a NaN is among them, else +Inf where an Inf is.

    An int32 max over the bit patterns of |x| (sign cleared with a mask): they order the non-negative floats, and
    every NaN pattern sorts above Inf's. NaN results are made the canonical NaN."""
    bits = lax.bitcast_convert_type(x, jnp.int32) & jnp.int32(0x7FFFFFFF)
    result = lax.bitcast_convert_type(jnp.max(bits, axis=axis), jnp.float32)
    return jnp.where(result == result, result, jnp.float32(jnp.nan))


def mean_abs(x, axes: tuple[str, ...] = ()):
    """mean |x| of f32 x over all elements: the ternary format's scale statistic (BitNet b1.58's absmean). A sum
    keeps NaN (NaN if any element is NaN) and Inf (+Inf if any is, the rest finite), as `amax` does. axes: mesh axes
    (inside `jax.shard_map`) x is split over in equal shards; the mean is then over the whole array."""
    mean = jnp.mean(jnp.abs(x))
    return lax.pmean(mean, axes) if axes else mean


def amax_across(block_amax, axes: tuple[str, ...]):
    """`amax` values reduced over mesh axes (inside `jax.shard_map`): an int32 pmax of their bit patterns, so NaN
    wins over Inf whatever a float all-reduce does with NaN."""
    bits = lax.pmax(lax.bitcast_convert_type(block_amax, jnp.int32), axes)
    return lax.bitcast_convert_type(bits, jnp.float32)


def scale_from_amax(block_amax, fmt: formats.Format, pow2_scale: bool = False):
    """amax -> float32 dequantization scale: max(amax / fmt.max, f32 tiny), 1 where amax == 0, optionally rounded
    *up* to a power of two (exponent bits: the mantissa carried into the exponent, then cleared). NaN / Inf amax
    give NaN / Inf scales.

    Rounded up, this is also the OCP MX (E8M0) scale in RCEIL mode, 2^ceil(log2(amax / fmt.max)): NVIDIA's (cuBLAS's
    MXFP8 quantization, torchao's RCEIL). Those multiply amax by an f32 1 / fmt.max instead of dividing; the rounded-up
    powers of two are the same for every f32 amax whose quotient is normal (tests/test_mxfp8.py checks a binade)."""
    scale = jnp.maximum(block_amax.astype(jnp.float32) / jnp.float32(fmt.max_value), jnp.float32(_TINY))
    if pow2_scale:
        bits = lax.bitcast_convert_type(scale, jnp.uint32)
        up = lax.bitcast_convert_type((bits + jnp.uint32(0x7FFFFF)) & jnp.uint32(0xFF800000), jnp.float32)
        scale = jnp.where(is_finite(scale), up, scale)
    return jnp.where(block_amax == 0, jnp.float32(1), scale)


def cast_codes(y, fmt: formats.Format, *, may_be_inf: bool):
    """`formats.saturating_cast` for a kernel: f32 y -> fmt's storage dtype, or uint8 holding e5m2 bits when
    may_be_inf (the caller bitcasts). NaN gives NaN (0 for int8). int8 rounds y half to even first (`jnp.round`,
    the reference's nearest rounding), so callers pass unrounded values. may_be_inf=False: y is finite or NaN.

    Why each branch: Mosaic GPU's f32 -> fp8 cast saturates (+-Inf -> +-max) where XLA's does not, so Inf is
    selected apart; e4m3fn has no Inf (XLA gives NaN with Inf's sign); the e5m2 code of an on-grid value, Inf or
    NaN is the high byte of its float16; LLVM's fptosi of NaN is undefined (XLA gives 0)."""
    if fmt.is_integer:
        # The selects also keep a caller's y = x * inv apart from the magic add: fused into one FMA, the product
        # would be rounded once, not to f32 first as the reference does.
        clipped = jnp.where(y == y, clamp(y, fmt.max_value), jnp.float32(0))
        return round_half_even_to_int32(clipped).astype(jnp.int8)
    if fmt.name == "bf16":
        return y.astype(jnp.bfloat16)  # y is on the bf16 grid (or +-Inf / NaN): exact
    clamped = clamp(y, fmt.max_value)  # +-Inf clamps too; restored below where the format has Inf
    if not may_be_inf:
        return clamped.astype(fmt.dtype)
    if fmt.name == "e4m3":
        sign = lax.bitcast_convert_type(y, jnp.uint32) & jnp.uint32(0x80000000)
        signed_nan = lax.bitcast_convert_type(sign | jnp.uint32(0x7FC00000), jnp.float32)
        return jnp.where(jnp.abs(y) == jnp.float32(jnp.inf), signed_nan, clamped).astype(fmt.dtype)
    # e5m2: NaN gets XLA's code (quiet NaN 0x7E with the sign), as float16 NaN payloads vary by backend.
    finite_or_inf = jnp.where(jnp.abs(y) == jnp.float32(jnp.inf), y, clamped)
    half_bits = lax.bitcast_convert_type(finite_or_inf.astype(jnp.float16), jnp.uint16)
    sign = lax.bitcast_convert_type(y, jnp.uint32) >> jnp.uint32(24) & jnp.uint32(0x80)
    nan_code = (sign | jnp.uint32(0x7E)).astype(jnp.uint16)
    return jnp.where(y == y, half_bits >> jnp.uint16(8), nan_code).astype(jnp.uint8)


def quantize_groups(x32, fmt: formats.Format, pow2_scale: bool, broadcast):
    """f32 (..., g) -> (codes (..., g) of fmt, scale f32 (...)): `quantize_with_seed` with one nearest-rounded scale
    per last-axis group (granularity "row" of a (..., groups, g) view), in `qjax.quantize`'s order: amax, scale,
    x * (1 / scale), round and cast. broadcast(values, shape) broadcasts the per-group values back along g (kernels
    pass one that sets their register layout)."""
    scale = scale_from_amax(amax(x32, axis=-1), fmt, pow2_scale)
    inverse = jnp.float32(1) / scale
    # x * 1/scale is finite, or NaN in a NaN group (and Inf * 0 in an Inf group): never +-Inf
    return cast_codes(x32 * broadcast(inverse, x32.shape), fmt, may_be_inf=False), scale


def broadcast_last(values, shape):
    """Per-row values (...) against rows (..., B): the jnp default of the formulas' `broadcast_rows` argument."""
    del shape  # jnp broadcasts; kernels' versions need it for their register layouts
    return values[..., None]


def _mean_last(values):
    return jnp.mean(values, axis=-1)


def rms_norm(x32, scale32, eps: float, mean_rows=_mean_last, broadcast_rows=broadcast_last):
    """RMSNorm of f32 rows x32 (..., D) -> (y, inv_rms): y = (x * inv_rms) * scale (f32, x32's shape), inv_rms =
    rsqrt(mean(x^2) + eps) (f32 (...,), one per row). scale32: the f32 norm scale, broadcastable against x32.
    mean_rows(v) -> v's per-row mean; broadcast_rows(values, shape) -> per-row values broadcast along the rows
    (kernels pass forms that set their register layouts). The formula of `qjax.models.ops.rms_norm` and of the
    fused kernel in `qjax.kernels.rmsnorm_mgpu`."""
    inv_rms = lax.rsqrt(mean_rows(x32 * x32) + eps)
    return (x32 * broadcast_rows(inv_rms, x32.shape)) * scale32, inv_rms


def rms_norm_backward(x32, inv_rms, scale32, dy32):
    """RMSNorm's backward on f32 arrays -> (dx, dy * n), both of x32's shape: dx = inv_rms * (dn - n * mean(dn * n))
    with n = x * inv_rms and dn = dy * scale (the second term: the rms's own dependence on x), and the terms whose
    sum over rows is the scale's gradient. x32 and scale32 as in `rms_norm`; inv_rms its per-row output, dy32 the
    f32 gradient of y."""
    inv = broadcast_last(inv_rms, x32.shape)
    n = x32 * inv  # the normalized x, recomputed instead of saved in float32
    dn = dy32 * scale32
    return inv * (dn - n * broadcast_last(_mean_last(dn * n), x32.shape)), dy32 * n


def swiglu(gate, up):
    """silu(gate) * up, (...) each, any one float dtype -> that dtype: `jax.nn.silu(gate) * up` as XLA:CPU evaluates
    it (bit for bit: tests/kernels/test_swiglu_mgpu.py), in float32 with every op rounded to the inputs' dtype and
    sigmoid = 1 / (1 + exp(-gate)), XLA's expansion of the logistic. A kernel computing in float32 then gives the
    same values: bit for bit under the CPU interpreter; compiled, to the ulps where Mosaic GPU's exp differs from
    XLA's, or where XLA:GPU keeps the steps in float32 (excess precision)."""
    dtype = gate.dtype

    def rounded(v):
        return v.astype(dtype).astype(jnp.float32)

    g, u = gate.astype(jnp.float32), up.astype(jnp.float32)
    sigmoid = rounded(jnp.float32(1) / rounded(jnp.float32(1) + rounded(jnp.exp(-g))))
    return (rounded(g * sigmoid) * u).astype(dtype)


def swiglu_backward(g, u, dh):
    """SwiGLU's backward in float32: g, u, dh f32 (...) (gate, up and d(silu(gate) * up)) -> (dgate, dup) f32."""
    sigmoid = jnp.float32(1) / (jnp.float32(1) + jnp.exp(-g))
    # silu'(g) = sigmoid + g * sigmoid * (1 - sigmoid)
    dgate = dh * u * sigmoid * (1 + g * (1 - sigmoid))
    dup = dh * g * sigmoid
    return dgate, dup


def zero_rows(x: jnp.ndarray, valid_rows) -> jnp.ndarray:
    """x (..., R, C) with its rows from valid_rows on set to 0 (x itself for None): a ragged_dot's padding rows
    after its groups, which the quantize kernels read as zeros (`valid_rows`); in XLA it fuses into its consumer."""
    if valid_rows is None:
        return x
    keep = jnp.arange(x.shape[-2]) < valid_rows
    return jnp.where(keep[:, None], x, jnp.zeros((), x.dtype))
