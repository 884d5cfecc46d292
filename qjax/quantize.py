"""Quantize / dequantize reference: `QuantSpec`, `QTensor`, scales at tensor, row, 1x128 and 128x128 granularity.

These functions define the semantics every kernel must reproduce bit for bit. Arrays are quantized in the layout the
GEMM reads them: shape (..., R, K) with K, the contracting dimension, last. Scales are float32 *dequantization*
multipliers (x ~= code * scale):

  granularity   scale shape          one scale per
  "tensor"      ()                   whole array (leading dims included)
  "row"         (..., R, 1)          row, i.e. reduced along K
  "1x128"       (..., R, K/128)      1 row x 128 consecutive K
  "128x128"     (..., R/128, K/128)  128 x 128 tile

  amax  = max |x| over the block                 (+Inf if the block holds a NaN or Inf)
  scale = max(amax / fmt.max, f32 tiny); 1 where amax == 0; optionally rounded *up* to a power of two
  code  = cast(round(x * (1 / scale)))           round = half-to-even, or stochastic (qjax.stochastic)

NaN or Inf in a block makes that block's scale Inf, so all its dequantized values (and any GEMM output that reads
them) are NaN: non-finite inputs stay visible. All-zero blocks get scale 1 and codes 0.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from qjax import formats, stochastic

GRANULARITIES = ("tensor", "row", "1x128", "128x128")
_BLOCK = {"1x128": (1, 128), "128x128": (128, 128)}


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How one GEMM operand is quantized.

    Attributes:
      dtype: "int8", "e4m3" or "e5m2".
      granularity: "tensor", "row", "1x128" or "128x128" (blocks are rows x K of the (..., R, K) operand).
      stochastic: stochastic rounding instead of round-half-to-even (needs a key).
      pow2_scale: round each scale up to a power of two (torchao's fp8 rowwise does, so scaling is exact).
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

    @property
    def format(self) -> formats.Format:
        return formats.get_format(self.dtype)


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

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return dequantize(self, dtype)


def _check_shape(shape, granularity, operand):
    if granularity == "tensor":
        return
    if len(shape) < 2:
        raise ValueError(f"{operand}: {granularity!r} quantization needs shape (..., rows, K), got {shape}")
    if granularity in _BLOCK:
        block_r, block_k = _BLOCK[granularity]
        rows, k = shape[-2:]
        if k % block_k or rows % block_r:
            raise ValueError(
                f"{operand}: {granularity!r} quantization needs rows % {block_r} == 0 and contracting % {block_k} == 0 "
                f"(its last dimension, the one the GEMM sums over), got rows={rows}, contracting={k}; pad the "
                "operand or use a 'row' or 'tensor' recipe")


def _blocked(x, granularity):
    """(..., R, K) -> (..., R/br, br, K/bk, bk) so a block's elements are axes (-3, -1)."""
    rows, k = x.shape[-2:]
    block_r, block_k = _BLOCK.get(granularity, (1, k))
    return x.reshape(*x.shape[:-2], rows // block_r, block_r, k // block_k, block_k)


def amax(x32, granularity):
    """max |x| per scale block of f32 x: () for "tensor", else the scale's shape (see `QuantSpec`)."""
    # NaN counts as +Inf: XLA's CPU max-reduction can drop NaN, and an Inf amax already makes the whole block
    # non-finite on dequantization (codes 0 times an Inf scale).
    magnitude = jnp.where(jnp.isnan(x32), jnp.inf, jnp.abs(x32))
    if granularity == "tensor":
        return jnp.max(magnitude)
    return jnp.max(_blocked(magnitude, granularity), axis=(-3, -1))


def scale_from_amax(amax: jax.Array, fmt: formats.Format, pow2_scale: bool = False) -> jax.Array:
    """amax -> float32 dequantization scale (see module docstring). NaN/Inf amax give NaN/Inf scales."""
    scale = jnp.maximum(amax.astype(jnp.float32) / jnp.float32(fmt.max_value), jnp.finfo(jnp.float32).tiny)
    if pow2_scale:
        bits = lax.bitcast_convert_type(scale, jnp.uint32)
        up = lax.bitcast_convert_type((bits + jnp.uint32(0x7FFFFF)) & jnp.uint32(0xFF800000), jnp.float32)
        scale = jnp.where(jnp.isfinite(scale), up, scale)
    return jnp.where(amax == 0, jnp.float32(1), scale)


def _broadcast_scale(scale, granularity):
    """Scale -> shape broadcastable against the blocked view of an (..., R, K) array."""
    if granularity == "tensor":
        return scale
    return scale[..., :, None, :, None]


def quantize_with_seed(x: jax.Array, spec: QuantSpec, seed: jax.Array | None, operand: str = "array",
                       amax_axes: tuple[str, ...] = ()) -> QTensor:
    """`quantize` with an explicit uint32 seed (the form kernels use); seed is ignored unless spec.stochastic.

    `operand` names the array in error messages (e.g. "wgrad rhs x as (K, M)"). `amax_axes`: mesh axes (inside
    `jax.shard_map`) over which x's blocks extend, whose amax is then the max over them (`lax.pmax`), so the scales
    are those of the unsharded array."""
    _check_shape(x.shape, spec.granularity, operand)
    fmt = spec.format
    x32 = x.astype(jnp.float32)
    block_amax = amax(x32, spec.granularity)
    if amax_axes:
        block_amax = lax.pmax(block_amax, amax_axes)
    scale = scale_from_amax(block_amax, fmt, spec.pow2_scale)
    inv_scale = jnp.float32(1) / scale
    if spec.granularity == "tensor":
        y = x32 * inv_scale
    else:
        y = (_blocked(x32, spec.granularity) * _broadcast_scale(inv_scale, spec.granularity)).reshape(x.shape)
    if spec.stochastic:
        if seed is None:
            raise ValueError("stochastic rounding needs a key (or seed)")
        y = stochastic.round_to_grid(y, fmt, stochastic.element_bits(seed, y.shape))
    elif fmt.is_integer:
        y = jnp.round(y)  # half to even
    return QTensor(formats.saturating_cast(y, fmt), scale, spec.granularity)


def quantize(x: jax.Array, spec: QuantSpec, key: jax.Array | None = None) -> QTensor:
    """Quantizes a float array per `spec`.

    Args:
      x: float array of shape (..., R, K) (any shape for "tensor"); K is the axis scales are taken along.
      spec: a `QuantSpec`, e.g. `QuantSpec("int8", "row")`.
      key: `jax.random.key`, required when `spec.stochastic`.

    Returns:
      `QTensor` with int8/float8 `data` of x's shape and float32 `scale`.
    """
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"quantize needs a float array, got {x.dtype}")
    if spec.stochastic and key is None:
        raise ValueError(f"{spec} rounds stochastically: pass key=jax.random.key(...)")
    seed = stochastic.key_to_seed(key) if spec.stochastic else None
    return quantize_with_seed(x, spec, seed)


def dequantize(q: QTensor, dtype=jnp.float32) -> jax.Array:
    """QTensor -> float array of `dtype` (computed in float32: code * scale)."""
    data32 = q.data.astype(jnp.float32)
    if q.granularity == "tensor":
        out = data32 * q.scale
    else:
        out = (_blocked(data32, q.granularity) * _broadcast_scale(q.scale, q.granularity)).reshape(q.shape)
    return out.astype(dtype)


def _swap_last(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, -1, -2)


def row_split_amax_axes(spec: QuantSpec | None, transposed: bool, row_axes: tuple[str, ...]) -> tuple[str, ...]:
    """The mesh axes a quantization's amax must be reduced over when an array's rows (R of (..., R, C)) are split
    over `row_axes` (inside `jax.shard_map`): a tensor scale always spans them, a row scale of the transpose
    (..., C, R) too; row scales of x and 128-blocks (shard boundaries fall on block boundaries) stay local."""
    if spec is None or not row_axes:
        return ()
    return row_axes if spec.granularity == "tensor" or (transposed and spec.granularity == "row") else ()


def quantize_pair(x: jax.Array, spec: QuantSpec | None, spec_t: QuantSpec | None, seed, seed_t, *,
                  backend: str = "xla", operands: tuple[str, str] = ("array", "transposed array"),
                  row_axes: tuple[str, ...] = ()):
    """Both quantized layouts two GEMMs read from one array: x (..., R, C) per `spec` and its transpose (..., C, R)
    per `spec_t` (e.g. an activation for the forward GEMM and for wgrad). Either spec may be None (that output is
    None). Same results as two `quantize_with_seed` calls.

    backend (see `qjax.Recipe`): where the fused Mosaic GPU kernel runs, both layouts come from one kernel
    (`qjax.kernels.quantize_mgpu`: an amax read, then one read writing both); elsewhere XLA fuses the two reference
    quantizations, and a tensorwise nearest quantization is done once and its codes transposed.
    row_axes: inside `jax.shard_map`, the mesh axes x's rows are split over (`row_split_amax_axes`): the scales are
    then those of the whole array.
    """
    axes, axes_t = row_split_amax_axes(spec, False, row_axes), row_split_amax_axes(spec_t, True, row_axes)
    if spec is not None and spec_t is not None and x.ndim == 2:
        from qjax import kernels  # imported here: the kernels import this module
        run_kernel, interpret = kernels.use_kernel(backend)
        if run_kernel:
            from qjax.kernels import quantize_mgpu
            reason = quantize_mgpu.supports(x, spec, spec_t)
            if reason is None:
                return quantize_mgpu.quantize_pair(x, spec, spec_t, seed, seed_t, interpret=interpret,
                                                   row_axes=row_axes)
            if backend == "pallas":
                raise ValueError(f"backend 'pallas': the fused quantize kernel cannot run this case ({reason}); use "
                                 "backend 'auto' to fall back to XLA")
    if spec is not None and spec == spec_t and spec.granularity == "tensor" and not spec.stochastic:
        q = quantize_with_seed(x, spec, seed, operand=operands[0], amax_axes=axes)
        return q, QTensor(_swap_last(q.data), q.scale, q.granularity)
    q = None if spec is None else quantize_with_seed(x, spec, seed, operand=operands[0], amax_axes=axes)
    q_t = None if spec_t is None else quantize_with_seed(_swap_last(x), spec_t, seed_t, operand=operands[1],
                                                         amax_axes=axes_t)
    return q, q_t
