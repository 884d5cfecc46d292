"""The quantized-array types every layer shares: `QuantSpec` (how an operand is quantized) and `QTensor` (codes and
scales), with `dequantize`. Shapes and granularities:

  granularity   scale shape          one scale per
  "tensor"      ()                   whole array (leading dims included)
  "row"         (..., R, 1)          row, i.e. reduced along K
  "1x128"       (..., R, K/128)      1 row x 128 consecutive K
  "128x128"     (..., R/128, K/128)  128 x 128 tile
  "1x32"        (..., R, K/32)       1 row x 32 consecutive K: OCP MX blocks, power-of-two (E8M0) scales

Arrays are (..., R, K) with K, the contracting dimension of the GEMM that reads them, last. Scales are float32
*dequantization* multipliers: x ~= code * scale. `qjax.quantize` computes them (the reference semantics).
"""

import dataclasses

import jax
import jax.numpy as jnp

from qjax import formats

GRANULARITIES = ("tensor", "row", "1x128", "128x128", "1x32")
# block-scaled granularities: (rows, K) per scale
BLOCK_SHAPES = {"1x128": (1, 128), "128x128": (128, 128), "1x32": (1, 32)}


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How one GEMM operand is quantized.

    Attributes:
      dtype: "int8", "e4m3" or "e5m2"; or "ternary" (BitNet b1.58 weights: int8 codes in {-1, 0, 1}, one "tensor"
        scale = mean |x|, round to nearest).
      granularity: "tensor", "row", "1x128", "128x128" or "1x32" (blocks are rows x K of the (..., R, K) operand).
      stochastic: stochastic rounding instead of round-half-to-even (needs a key).
      pow2_scale: round each scale up to a power of two, 2^ceil(log2(amax / max)) (torchao's fp8 rowwise does, so
        scaling is exact). "1x32" (MX) requires it: its E8M0 scale, in NVIDIA's (cuBLAS's) RCEIL mode, so no element
        saturates.
    """

    dtype: str
    granularity: str = "row"
    stochastic: bool = False
    pow2_scale: bool = False

    def __post_init__(self):
        fmt = formats.get_format(self.dtype)
        if fmt.name == "bf16":
            raise ValueError("QuantSpec.dtype must be an 8-bit format: 'int8', 'e4m3' or 'e5m2'")
        object.__setattr__(self, "dtype", fmt.name)
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"unknown granularity {self.granularity!r}; use one of {GRANULARITIES}")
        if self.is_mx and not self.pow2_scale:
            raise ValueError("granularity '1x32' (MX) has power-of-two E8M0 scales: pass pow2_scale=True")
        if self.dtype == "ternary" and (self.granularity != "tensor" or self.stochastic or self.pow2_scale):
            raise ValueError("QuantSpec('ternary') takes one scale per tensor (the mean |x|) and rounds to nearest: "
                             "use QuantSpec('ternary', 'tensor') without stochastic or pow2_scale")

    @property
    def format(self) -> formats.Format:
        return formats.get_format(self.dtype)

    @property
    def is_block_scaled(self) -> bool:
        """Scaled per block of K ("1x128", "128x128" or "1x32"), not per row or tensor."""
        return self.granularity in BLOCK_SHAPES

    @property
    def is_mx(self) -> bool:
        """OCP MX: blocks of 32 along K with E8M0 (power-of-two) scales, as MXFP8."""
        return self.granularity == "1x32"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QTensor:
    """A quantized array: codes, float32 scales and the granularity that relates them (see module docstring).

    Attributes:
      data: (..., R, K) int8 / float8 codes.
      scale: float32 dequantization multipliers, shape per `granularity`.
      granularity: static; one of GRANULARITIES.
    """

    data: jax.Array
    scale: jax.Array
    granularity: str = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self):
        return self.data.shape

    @property
    def is_block_scaled(self) -> bool:
        return self.granularity in BLOCK_SHAPES

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return dequantize(self, dtype)


def blocked(x, granularity):
    """(..., R, K) -> (..., R/br, br, K/bk, bk) so a scale block's elements are axes (-3, -1) ("row": bk = K)."""
    rows, k = x.shape[-2:]
    block_r, block_k = BLOCK_SHAPES.get(granularity, (1, k))
    return x.reshape(*x.shape[:-2], rows // block_r, block_r, k // block_k, block_k)


def broadcast_scale(scale, granularity):
    """Scale -> shape broadcastable against the `blocked` view of an (..., R, K) array."""
    if granularity == "tensor":
        return scale
    return scale[..., :, None, :, None]


def dequantize(q: QTensor, dtype=jnp.float32) -> jax.Array:
    """QTensor -> float array of `dtype` (computed in float32: code * scale)."""
    data32 = q.data.astype(jnp.float32)
    if q.granularity == "tensor":
        out = data32 * q.scale
    else:
        out = (blocked(data32, q.granularity) * broadcast_scale(q.scale, q.granularity)).reshape(q.shape)
    return out.astype(dtype)


def row_split_amax_axes(spec: QuantSpec | None, transposed: bool, row_axes: tuple[str, ...],
                        col_axes: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The mesh axes a quantization's amax must be reduced over when an array's rows (R of (..., R, C)) are split
    over `row_axes` and its columns C over `col_axes` (inside `jax.shard_map`): a tensor scale spans both, a row
    scale of x (..., R, C) spans C, a row scale of the transpose (..., C, R) spans R; 128-blocks stay local (shard
    boundaries fall on block boundaries)."""
    if spec is None or spec.is_block_scaled:
        return ()
    if spec.granularity == "tensor":
        return tuple(row_axes) + tuple(col_axes)
    return tuple(row_axes) if transposed else tuple(col_axes)
