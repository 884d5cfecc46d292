"""Block-quantized optimizer-state tensors: 8-bit / 4-bit code books with absmax, FP8 e4m3, FP8 with COAT expansion.

A float32 tensor of shape `shape` is flattened row-major and cut into blocks of `block_size` consecutive elements
(size % block_size == 0 is required; callers keep other tensors in float32). Per format:

  format                  stored (n = size // block_size)                        decode
  "dynamic_signed_8bit"   codes uint8 (n, B), absmax f32 (n,)                    qmap[code] * absmax
  "dynamic_unsigned_8bit" "
  "dynamic_signed_4bit"   codes uint8 (n, B/2): two codes per byte, first code   qmap[code] * absmax
  "linear_unsigned_4bit"  in the high nibble; absmax f32 (n,)
  "e4m3"                  codes float8_e4m3fn (n, B), scale f32 (n,)             code * scale, scale = absmax / 448
  "e4m3_dre"              codes e4m3 (n, B), scale f32, expand uint8 = 16 k,     sign(y) * |y|**(1/k) * c, y = code*scale
                          centre c bf16 (n,)

COAT's dynamic range expansion (Xi et al. 2024, "COAT", sec. 4) maps a group to sign(x) * (|x| / c)**k before the
e4m3 cast so that the group's max/min ratio R fills e4m3's range: with max and min the largest and smallest non-zero
magnitudes, c ~ sqrt(max * min) centres the group in log space and k = floor(16 * log2(448**2 / 2) / log2(R)) / 16
(a multiple of 1/16), clipped to [1/16, 255/16] (R near 1 would give an unbounded k). scale = (max / c)**k / 448.
k and c come from the bit patterns of max and min by integer arithmetic (log2(R) in fixed point, c rounded to a
power of two: `adam_math.expansion_params`), so the fused step kernel and XLA compute the same ones; powers are
computed as exp(k log(.)) with natural logarithms (`adam_math.quantize_e4m3_expanded_blocks`, the formula the kernel
shares: Mosaic GPU has no pow).
k is stored exactly as the uint8 16 k, and c, a power of two, exactly as bfloat16 (any centre works as long as
decoding uses the same one), so a group costs 4 + 1 + 2 bytes of metadata: 2.11 bytes/element for m and v together
(0.264x fp32 AdamW at group 128) instead of 2.19 with float32 k and c.

Zeros, all-zero blocks and NaN: an all-zero block stores absmax 0 (scale 1, k 1, c 1 for fp8) and decodes to exact
zeros; so does a block whose absmax (code books) or scale (e4m3) is below float32's smallest normal, 2**-126
(`numerics.invertible_scale`: codes are x times 1 / absmax, which would overflow there); a code-book block whose
absmax is above 2**126 (~8.5e37; its reciprocal would be subnormal) stores absmax +Inf and decodes to non-finite
values, like an overflow. A block holding NaN stores a NaN absmax/scale (`numerics.amax`), so every element of
that block decodes to NaN: NaN is never silently turned into a finite value (it spreads to its block instead).
+-Inf gives an Inf absmax/scale (a NaN scale for fp8 with expansion), and the block decodes to non-finite values.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from qjax.optim import adam_math, codebooks

CODEBOOK_FORMATS = {  # name -> bits
    "dynamic_signed_8bit": 8, "dynamic_unsigned_8bit": 8, "dynamic_signed_4bit": 4, "linear_unsigned_4bit": 4}
STATE_FORMATS = tuple(CODEBOOK_FORMATS) + adam_math.FP8_STATE_FORMATS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CodebookState:
    """A tensor stored as code-book indices + per-block absmax (8 or 4 bits per element).

    Attributes:
      codes: uint8 (n_blocks, block_size) for 8 bits, (n_blocks, block_size // 2) for 4 bits.
      absmax: float32 (n_blocks,): max |x| of each block (NaN if the block held NaN).
      shape: static, the original tensor shape.
      qmap: static, the map name (see `codebooks.MAPS`).
    """

    codes: jax.Array
    absmax: jax.Array
    shape: tuple = dataclasses.field(metadata=dict(static=True))
    qmap: str = dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8State:
    """A tensor stored as e4m3 codes + per-block scale (scale = absmax / 448; 1 for all-zero blocks).

    Attributes:
      codes: float8_e4m3fn (n_blocks, block_size).
      scale: float32 (n_blocks,).
      shape: static, the original tensor shape.
    """

    codes: jax.Array
    scale: jax.Array
    shape: tuple = dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8ExpandedState:
    """e4m3 codes (n, B) of COAT-expanded values + per-group scale f32 (n,), 16 k as uint8 (n,), centre bf16 (n,)."""

    codes: jax.Array
    scale: jax.Array
    expand: jax.Array
    centre: jax.Array
    shape: tuple = dataclasses.field(metadata=dict(static=True))


QuantizedTensor = CodebookState | Fp8State | Fp8ExpandedState


def check_format(fmt: str, block_size: int) -> None:
    """Raises ValueError naming the problem if (fmt, block_size) is not a valid state format."""
    if fmt not in STATE_FORMATS:
        raise ValueError(f"unknown state format {fmt!r}; use one of {STATE_FORMATS}")
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if CODEBOOK_FORMATS.get(fmt) == 4 and block_size % 2:
        raise ValueError(f"4-bit formats pack two codes per byte: block_size must be even, got {block_size}")


def can_quantize(shape: tuple, block_size: int, min_size: int) -> bool:
    """Whether a tensor of `shape` is stored quantized: size >= min_size and size % block_size == 0."""
    size = int(np.prod(shape, dtype=np.int64))
    return size >= min_size and size % block_size == 0 and size > 0


def _blocks(x: jax.Array, block_size: int) -> jax.Array:
    if x.size % block_size:
        raise ValueError(f"tensor of shape {x.shape} ({x.size} elements) is not a whole number of blocks of "
                         f"{block_size}; keep it in float32 (see can_quantize) or pick another block_size")
    return x.astype(jnp.float32).reshape(-1, block_size)


def quantize_codebook(x: jax.Array, qmap_name: str, block_size: int) -> CodebookState:
    """float tensor -> CodebookState: absmax per block, nearest code of x * (1 / absmax)
    (`codebooks.quantize_blocks`)."""
    codes, absmax = codebooks.quantize_blocks(_blocks(x, block_size), codebooks.get_map(qmap_name))
    if CODEBOOK_FORMATS[qmap_name] == 4:
        codes = codebooks.pack_4bit(codes)
    return CodebookState(codes, absmax, tuple(x.shape), qmap_name)


def dequantize_codebook(q: CodebookState) -> jax.Array:
    codes = codebooks.unpack_4bit(q.codes) if CODEBOOK_FORMATS[q.qmap] == 4 else q.codes
    return (codebooks.decode(codes, codebooks.get_map(q.qmap)) * q.absmax[:, None]).reshape(q.shape)


def quantize_fp8(x: jax.Array, block_size: int) -> Fp8State:
    """float tensor -> Fp8State: scale = absmax / 448 per block, codes = e4m3(x / scale), round to nearest even."""
    codes, scale = adam_math.quantize_e4m3_blocks(_blocks(x, block_size))
    return Fp8State(codes, scale, tuple(x.shape))


def dequantize_fp8(q: Fp8State) -> jax.Array:
    return (q.codes.astype(jnp.float32) * q.scale[:, None]).reshape(q.shape)


def quantize_fp8_expanded(x: jax.Array, block_size: int) -> Fp8ExpandedState:
    """float tensor -> Fp8ExpandedState (COAT dynamic range expansion, then e4m3 with absmax scaling): the formula
    of `adam_math.quantize_e4m3_expanded_blocks`, which the fused step kernel calls too."""
    codes, scale, expand, centre = adam_math.quantize_e4m3_expanded_blocks(_blocks(x, block_size))
    return Fp8ExpandedState(codes, scale, expand, centre, tuple(x.shape))


def dequantize_fp8_expanded(q: Fp8ExpandedState) -> jax.Array:
    return adam_math.dequantize_e4m3_expanded_blocks(q.codes, q.scale, q.expand, q.centre).reshape(q.shape)


@functools.partial(jax.jit, static_argnames=("fmt", "block_size"))
def quantize(x: jax.Array, fmt: str, block_size: int) -> QuantizedTensor:
    """Quantizes float tensor `x` (size % block_size == 0) to state format `fmt` (one of STATE_FORMATS)."""
    check_format(fmt, block_size)
    if fmt == "e4m3":
        return quantize_fp8(x, block_size)
    if fmt == "e4m3_dre":
        return quantize_fp8_expanded(x, block_size)
    return quantize_codebook(x, fmt, block_size)


@jax.jit
def dequantize(q: QuantizedTensor) -> jax.Array:
    """Quantized state tensor -> float32 array of its original shape."""
    if isinstance(q, CodebookState):
        return dequantize_codebook(q)
    if isinstance(q, Fp8State):
        return dequantize_fp8(q)
    if isinstance(q, Fp8ExpandedState):
        return dequantize_fp8_expanded(q)
    raise TypeError(f"not a quantized state tensor: {type(q).__name__}")


def is_quantized(x) -> bool:
    return isinstance(x, (CodebookState, Fp8State, Fp8ExpandedState))


def nbytes(tree) -> int:
    """Total bytes of all arrays in a pytree (quantized states included)."""
    return sum(int(np.prod(a.shape, dtype=np.int64)) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))
