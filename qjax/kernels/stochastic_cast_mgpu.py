"""Stochastic-rounding cast f32 -> bf16 / e4m3 / e5m2 / int8: a Pallas Mosaic GPU kernel, bit-identical to
`qjax.stochastic.stochastic_round_with_seed`.

`stochastic_cast(x, dtype, seed)` flattens x (any shape), views it as (rows, 128), pads it to whole tiles of
64 x 128 elements, runs one program per tile and slices the padding off. Per tile:

  GMEM -> SMEM (TMA): x tile (64, 128) f32 / bf16 / f16
  registers:          bits = stochastic.hash_uint32(seed, flat index)   (the reference's own hash, same indices)
                      code = stochastic_codes(x, fmt, bits)             (round_to_grid + formats.saturating_cast
                                                                         with kernel-safe ops)
  SMEM -> GMEM (TMA): codes (64, 128)

The module also holds the kernel-safe math helpers `quantize_mgpu` and `scaled_matmul_mgpu` use. They exist because
Mosaic GPU has no lowering for floor / isfinite, and its f32 -> fp8 cast saturates (`cvt.satfinite`: +-Inf becomes
+-max) while XLA's does not; each helper computes the reference's exact result with ops Mosaic GPU lowers:
  round + int8   -> v + 1.5 * 2**23 rounds |v| <= 2**22 half to even and the integer is read from the mantissa
                    bits (MAGIC below), no conversion instructions
  floor(v)       -> the same add, minus 1.5 * 2**23 (behind an optimization barrier: XLA folds (v + c) - c back
                    to v), minus 1 where that rounded up; also no conversions (|v| <= 2**22 where it is used)
  SR -> int8     -> one such add gives floor and code at once: the code from the sum's bits, one less where it
                    rounded up (`_stochastic_int8`)
  isfinite(v)    -> |v| < inf (false for NaN)
  clip(v)        -> max / min, which propagate NaN (as the reference's clip does)
  Inf -> e4m3    -> NaN with Inf's sign before the cast (XLA casts Inf to e4m3fn NaN; satfinite would give 448)
  Inf -> e5m2    -> the e5m2 code is the high byte of the float16 value (exact for values on e5m2's grid, Inf and
                    NaN), written as uint8 and bitcast outside the kernel
  NaN -> int8    -> code 0 (XLA's cast; LLVM's fptosi of NaN is undefined)

Register layout: each warp holds whole rows (32 lanes x 4 consecutive columns), so SMEM loads and stores are
contiguous per warp. Under the CPU interpreter the kernel's XLA ops equal the reference bit for bit; compiled on a
GPU they are the same IEEE operations (the one multiply-add, |y| * (1 / ulp) + u, has an exact product, so fusing it
into an FMA changes nothing), except that NaN payload/sign bits may differ (both NaN).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from qjax import formats, stochastic

_COLUMNS = 128  # x is viewed as (rows, 128); TMA boxes allow at most 256 elements per dimension
_ROWS = 64  # rows per program: 32 KiB of f32 in + <= 16 KiB out of SMEM, so several programs share an SM
# Each warp sweeps whole rows: 32 lanes x 4 consecutive columns, so its SMEM accesses are one contiguous run
# (no bank conflicts in the untiled tile); the 4 warps take 4 consecutive rows.
LAYOUT = plgpu.Layout.TILED(plgpu.Tiling(((4, _COLUMNS), (4,))), warp_dims=(-3,), lane_dims=(-2,), vector_dim=-1)
_INPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_TARGETS = ("bf16", "e4m3", "e5m2", "int8")


# ------------------------------------- kernel-safe math (also used by quantize_mgpu and scaled_matmul_mgpu)


def is_finite(v):
    """jnp.isfinite for f32 arrays, with ops Mosaic GPU lowers (NaN compares false)."""
    return jnp.abs(v) < jnp.float32(jnp.inf)


# 1.5 * 2**23 and its f32 bits. For |v| <= 2**22 the floats around 1.5 * 2**23 + v are 1 apart, so the f32 sum is v
# rounded half to even, held in the low mantissa bits; its bits minus MAGIC_BITS are that integer. That avoids the
# conversion-unit instructions (cvt.rni + F2I), which run at a fraction of the FP32 rate on Hopper (stochastic
# rounding's floor avoids them the same way): the int8 quantize tile kernel was bound by them (H200: 141 -> 109 us
# for a 16384 x 4096 pair). The reverse direction (int32 -> f32 as an integer add and a float subtract) lost to one
# I2F in the block-scaled int8 GEMM, which is bound by its instruction count (benchmarks/NOTES.md).
MAGIC = 1.5 * 2**23
MAGIC_BITS = 0x4B400000


def round_half_even_to_int32(v):
    """f32 |v| <= 2**22 -> int32, rounded half to even (jnp.round), with one FP32 add and one integer subtract."""
    return lax.bitcast_convert_type(v + jnp.float32(MAGIC), jnp.int32) - jnp.int32(MAGIC_BITS)


def clamp(v, bound: float):
    """jnp.clip(v, -bound, bound) that keeps NaN (as XLA's clip does): XLA's max / min propagate NaN, and Mosaic GPU
    lowers them to PTX max.NaN / min.NaN, one instruction each (a compare and a select each before)."""
    bound = jnp.float32(bound)
    return jnp.minimum(jnp.maximum(v, -bound), bound)


def _round_by_magic(v):
    """(v + MAGIC, that sum minus MAGIC, whether it rounded v up) for f32 |v| <= 2**22: the sum holds v rounded to
    the nearest integer (`round_half_even_to_int32`), and minus MAGIC that integer is an exact f32. The barrier
    keeps XLA (the CPU interpreter runs kernels through it) from folding (v + MAGIC) - MAGIC back to v; compiled,
    it is an empty inline asm that pins the sum in registers."""
    shifted = lax.optimization_barrier(v + jnp.float32(MAGIC))
    nearest = shifted - jnp.float32(MAGIC)
    return shifted, nearest, nearest > v


def _floor(v):
    """floor for f32 |v| <= 2**22 (NaN and +-Inf pass through; -0 gives +0, callers pass no -0), with FP32 ops only:
    the nearest integer (`_round_by_magic`), one less where that rounded up."""
    _, nearest, rounded_up = _round_by_magic(v)
    return jnp.where(rounded_up, nearest - jnp.float32(1), nearest)


def _copysign(magnitude, sign_source):
    """copysign for a non-negative f32 magnitude: its bits with the sign bit of sign_source."""
    sign = lax.bitcast_convert_type(sign_source, jnp.uint32) & jnp.uint32(0x80000000)
    return lax.bitcast_convert_type(lax.bitcast_convert_type(magnitude, jnp.uint32) | sign, jnp.float32)


def _round_float_to_grid(y, fmt: formats.Format, bits, *, may_be_inf: bool):
    """`stochastic.round_to_grid` (same operations in the same order) for a kernel and a float format: f32 y, uint32
    bits -> f32 (int8: `_stochastic_int8`). may_be_inf: as in `stochastic_codes`."""
    y = jnp.where(is_finite(y), clamp(y, fmt.max_value), y) if may_be_inf else clamp(y, fmt.max_value)
    if fmt.name == "bf16":
        return jnp.where(is_finite(y), stochastic.truncate_to_bf16_grid(y, bits), y)
    magnitude = jnp.abs(y)
    ulp, inverse_ulp = stochastic.grid_step(magnitude, fmt)
    uniform = stochastic.uniform_from_bits(bits)
    rounded = _floor(magnitude * inverse_ulp + uniform) * ulp  # magnitude / ulp <= 2**(mantissa_bits + 1): in range
    signed = _copysign(rounded, y)  # NaN y: NaN with y's sign, as the reference's select of y gives
    return jnp.where(is_finite(y), signed, y) if may_be_inf else signed


def _stochastic_int8(y, bits, may_be_inf: bool):
    """floor(clip(y, -127, 127) + u) as int8 codes, NaN -> 0: the reference's round_to_grid + saturating_cast for
    int8. One magic-number add gives both the floor and the code: v + MAGIC holds round(v) in its mantissa bits
    (`_round_by_magic`), so the code is those bits minus one where that rounded up.

    v is in [-127, 128]: 127 + u rounds to 128 for u > 1 - 2**-18, so an integer min of 127 is the cast's clip. +Inf
    then gives 127 as in the reference (which floors +Inf and clips it); -Inf (may_be_inf) is selected apart: the
    reference floors it to -Inf (code -127), where -127 + u may round to -126."""
    v = clamp(y, 127.0) + stochastic.uniform_from_bits(bits)
    shifted, _, rounded_up = _round_by_magic(v)
    code = lax.bitcast_convert_type(shifted, jnp.int32) - jnp.int32(MAGIC_BITS)
    code = jnp.minimum(jnp.where(rounded_up, code - jnp.int32(1), code), jnp.int32(127))
    if may_be_inf:
        code = jnp.where(y == jnp.float32(-jnp.inf), jnp.int32(-127), code)
    return jnp.where(y == y, code, jnp.int32(0)).astype(jnp.int8)


def stochastic_codes(y, fmt: formats.Format, bits, *, may_be_inf: bool):
    """Stochastic rounding of f32 y straight to fmt's codes (`cast_codes` forms): the kernel form of the reference's
    `stochastic.round_to_grid` followed by `formats.saturating_cast`. may_be_inf=False: the caller's y is finite or
    NaN (never +-Inf), which makes the reference's isfinite selects the identity."""
    if fmt.is_integer:
        return _stochastic_int8(y, bits, may_be_inf)
    return cast_codes(_round_float_to_grid(y, fmt, bits, may_be_inf=may_be_inf), fmt, may_be_inf=may_be_inf)


def cast_codes(y, fmt: formats.Format, *, may_be_inf: bool):
    """`formats.saturating_cast` for a kernel: f32 y -> fmt's storage dtype, or uint8 holding e5m2 bits when
    may_be_inf (see module docstring; the caller bitcasts). NaN gives NaN (0 for int8). int8 rounds y half to even
    first (`jnp.round`, the nearest rounding of the reference), so callers pass unrounded values."""
    if fmt.is_integer:
        # round half to even (the identity on the integers stochastic rounding gives), clip to +-127, NaN -> 0.
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
        signed_nan = lax.bitcast_convert_type(sign | jnp.uint32(0x7FC00000), jnp.float32)  # e4m3fn has no Inf
        return jnp.where(jnp.abs(y) == jnp.float32(jnp.inf), signed_nan, clamped).astype(fmt.dtype)
    # e5m2: on-grid values and +-Inf are exact in float16, and e5m2 is float16's high byte. NaN gets XLA's code
    # (quiet NaN 0x7E with the sign), as float16 NaN payloads vary by backend.
    finite_or_inf = jnp.where(jnp.abs(y) == jnp.float32(jnp.inf), y, clamped)
    half_bits = lax.bitcast_convert_type(finite_or_inf.astype(jnp.float16), jnp.uint16)
    sign = lax.bitcast_convert_type(y, jnp.uint32) >> jnp.uint32(24) & jnp.uint32(0x80)
    nan_code = (sign | jnp.uint32(0x7E)).astype(jnp.uint16)
    return jnp.where(y == y, half_bits >> jnp.uint16(8), nan_code).astype(jnp.uint8)


# ------------------------------------------------------------------------------------------------------ kernel


def resolve_interpret(interpret):
    """None / False -> compiled Mosaic GPU; True -> the CPU interpreter's default params; params pass through."""
    if interpret is True:
        return plgpu.InterpretGPUParams()
    if interpret is False:
        return None
    return interpret


@functools.partial(jax.jit, static_argnames=("target", "interpret"))
def _cast_call(x2, seed, *, target, interpret):
    n_rows = x2.shape[0]
    fmt = formats.get_format(target)
    writes_bits = target == "e5m2"
    out_dtype = jnp.uint8 if writes_bits else fmt.dtype

    def body(seed_ref, x_ref, out_ref, x_smem, out_smem, barrier):
        rows = pl.ds(lax.axis_index("tile") * _ROWS, _ROWS)
        plgpu.copy_gmem_to_smem(x_ref.at[rows], x_smem, barrier.at[0])
        plgpu.barrier_wait(barrier.at[0])
        x = plgpu.load(x_smem, layout=LAYOUT).astype(jnp.float32)
        first_row = (lax.axis_index("tile") * _ROWS).astype(jnp.uint32)
        row = plgpu.broadcasted_iota(jnp.uint32, x.shape, 0, layout=LAYOUT) + first_row
        col = plgpu.broadcasted_iota(jnp.uint32, x.shape, 1, layout=LAYOUT)
        bits = stochastic.hash_uint32(seed_ref[0], row * jnp.uint32(_COLUMNS) + col)  # row-major flat index
        out_smem[...] = stochastic_codes(x, fmt, bits, may_be_inf=True)
        plgpu.commit_smem()  # make the register -> SMEM stores visible to the TMA engine
        plgpu.copy_smem_to_gmem(out_smem, out_ref.at[rows])
        plgpu.wait_smem_to_gmem(0)

    scratch = (plgpu.SMEM((_ROWS, _COLUMNS), x2.dtype), plgpu.SMEM((_ROWS, _COLUMNS), out_dtype),
               plgpu.Barrier(num_barriers=1))
    out = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((n_rows, _COLUMNS), out_dtype), scratch_types=scratch,
                       grid=(n_rows // _ROWS,), grid_names=("tile",), interpret=interpret)(seed, x2)
    # fp8 results leave as uint8 bits: XLA:CPU may rewrite NaN bits when it slices or reshapes fp8 arrays.
    return lax.bitcast_convert_type(out, jnp.uint8) if fmt.dtype.itemsize == 1 else out


def stochastic_cast(x: jax.Array, dtype, seed: jax.Array, *, interpret=False) -> jax.Array:
    """Stochastically rounds x to `dtype`: the kernel form of `stochastic.stochastic_round_with_seed`.

    Args:
      x: float32 / bfloat16 / float16 array of any shape (upcast to float32 first, as the reference does).
      dtype: jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2 or jnp.int8 (or the names "bf16", "e4m3", ...).
      seed: uint32 scalar (e.g. `stochastic.key_to_seed(key)`).
      interpret: False / None run the compiled kernel (needs a Hopper GPU); True or a `plgpu.InterpretGPUParams`
        run it under the Mosaic GPU interpreter (CPU, slow: tests).

    Returns:
      Array of x's shape and `dtype`, equal bit for bit to `stochastic_round_with_seed(x, dtype, seed)` (NaN
      payload and sign bits excepted when compiled).
    """
    fmt = formats.get_format(dtype)
    x = jnp.asarray(x)
    if jnp.dtype(x.dtype) not in _INPUT_DTYPES:
        raise TypeError(f"stochastic_cast needs a float32, bfloat16 or float16 array, got {x.dtype}")
    seed = jnp.asarray(seed)
    if seed.shape != () or seed.dtype != jnp.uint32:
        raise TypeError(f"seed must be a uint32 scalar (stochastic.key_to_seed(key)), got {seed.dtype}{seed.shape}")
    if x.size == 0:
        return jnp.zeros(x.shape, fmt.dtype)
    # Flat index i sits at row i // 128, column i % 128, so the kernel's row-major index is the reference's; zero
    # padding at the end only adds elements that are sliced off.
    tile_elements = _ROWS * _COLUMNS
    padded = -x.size % tile_elements
    flat = x.reshape(-1)
    if padded:
        flat = jnp.pad(flat, (0, padded))
    out = _cast_call(flat.reshape(-1, _COLUMNS), seed.reshape(1), target=fmt.name, interpret=resolve_interpret(interpret))
    out = out.reshape(-1)
    out = (out[:x.size] if padded else out).reshape(x.shape)
    return lax.bitcast_convert_type(out, fmt.dtype) if out.dtype != fmt.dtype else out
