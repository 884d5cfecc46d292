"""Quantize reference: scales at tensor, row, 1x128, 128x128 and 1x32 (MX) granularity (types: `qjax.qtensor`).

These functions define the semantics every kernel must reproduce bit for bit (docs/design.md, "Recipes"). Arrays
are quantized in the layout the GEMM reads them: shape (..., R, K) with K, the contracting dimension, last:

  amax  = max |x| over the block                 (`numerics.amax`: NaN if the block holds a NaN, else Inf if an Inf)
          or, for the "ternary" format, mean |x| over the tensor (`numerics.mean_abs`, BitNet b1.58's absmean)
  scale = max(amax / fmt.max, f32 tiny); 1 where amax == 0; optionally rounded *up* to a power of two
          (MX "1x32": that rounded-up E8M0 scale, RCEIL)
  code  = cast(round(x * (1 / scale)))           round = half-to-even, or stochastic (`qjax.stochastic.paired_bits`)

NaN or Inf in a block makes that block's scale NaN or Inf, so all its dequantized values (and any GEMM output that
reads them) are non-finite: bad inputs stay visible. All-zero blocks get scale 1 and codes 0.
"""

import jax
import jax.numpy as jnp

from qjax import formats, numerics, stochastic
from qjax.qtensor import BLOCK_SHAPES, QTensor, QuantSpec, blocked, broadcast_scale, dequantize, row_split_amax_axes

__all__ = ["QTensor", "QuantSpec", "amax", "dequantize", "quantize", "quantize_pair_reference", "quantize_with_seed"]


def _check_shape(shape, granularity, operand):
    if granularity == "tensor":
        return
    if len(shape) < 2:
        raise ValueError(f"{operand}: {granularity!r} quantization needs shape (..., rows, K), got {shape}")
    if granularity in BLOCK_SHAPES:
        block_r, block_k = BLOCK_SHAPES[granularity]
        rows, k = shape[-2:]
        if k % block_k or rows % block_r:
            raise ValueError(
                f"{operand}: {granularity!r} quantization needs rows % {block_r} == 0 and contracting % {block_k} == 0 "
                f"(its last dimension, the one the GEMM sums over), got rows={rows}, contracting={k}; pad the "
                "operand or use a 'row' or 'tensor' recipe")


def amax(x32, granularity):
    """max |x| per scale block of f32 x: () for "tensor", else the scale's shape (see `qjax.qtensor`); NaN / Inf
    per `numerics.amax`."""
    if granularity == "tensor":
        return numerics.amax(x32)
    return numerics.amax(blocked(x32, granularity), axis=(-3, -1))


def quantize_with_seed(x: jax.Array, spec: QuantSpec, seed: jax.Array | None, operand: str = "array",
                       amax_axes: tuple[str, ...] = ()) -> QTensor:
    """`quantize` with an explicit uint32 seed (the form kernels use); seed is ignored unless spec.stochastic.

    `operand` names the array in error messages (e.g. "wgrad rhs x as (K, M)"). `amax_axes`: mesh axes (inside
    `jax.shard_map`) over which x's blocks extend, whose amax is then the max over them (`numerics.amax_across`),
    so the scales are those of the unsharded array."""
    _check_shape(x.shape, spec.granularity, operand)
    fmt = spec.format
    x32 = x.astype(jnp.float32)
    if fmt.name == "ternary":  # granularity "tensor" (QuantSpec checks)
        block_amax = numerics.mean_abs(x32, amax_axes)
    else:
        block_amax = amax(x32, spec.granularity)
        if amax_axes:
            block_amax = numerics.amax_across(block_amax, amax_axes)
    scale = numerics.scale_from_amax(block_amax, fmt, spec.pow2_scale)
    inv_scale = jnp.float32(1) / scale
    if spec.granularity == "tensor":
        y = x32 * inv_scale
    else:
        y = (blocked(x32, spec.granularity) * broadcast_scale(inv_scale, spec.granularity)).reshape(x.shape)
    if spec.stochastic:
        if seed is None:
            raise ValueError("stochastic rounding needs a key (or seed)")
        y = stochastic.round_to_grid(y, fmt, stochastic.paired_bits(seed, y.shape))  # one hash per two elements
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


def _swap_last(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, -1, -2)


def quantize_pair_reference(x: jax.Array, spec: QuantSpec | None, spec_t: QuantSpec | None, seed, seed_t, *,
                            operands: tuple[str, str] = ("array", "transposed array"),
                            row_axes: tuple[str, ...] = (), col_axes: tuple[str, ...] = ()):
    """Both quantized layouts two GEMMs read from one array: x (..., R, C) per `spec` and its transpose (..., C, R)
    per `spec_t` (e.g. an activation for the forward GEMM and for wgrad). Either spec may be None (that output is
    None). Same results as two `quantize_with_seed` calls; a tensorwise nearest quantization is done once and its
    codes transposed. The reference of `qjax.kernels.quantize_mgpu.quantize_pair_kernel` (`qjax.dispatch` picks).

    operands: the two arrays' names in error messages. row_axes / col_axes: inside `jax.shard_map`, the mesh axes
    x's rows / columns are split over (`qtensor.row_split_amax_axes`): the scales are then those of the whole array.
    """
    axes = row_split_amax_axes(spec, False, row_axes, col_axes)
    axes_t = row_split_amax_axes(spec_t, True, row_axes, col_axes)
    if spec is not None and spec == spec_t and spec.granularity == "tensor" and not spec.stochastic:
        q = quantize_with_seed(x, spec, seed, operand=operands[0], amax_axes=axes)
        return q, QTensor(_swap_last(q.data), q.scale, q.granularity)
    q = None if spec is None else quantize_with_seed(x, spec, seed, operand=operands[0], amax_axes=axes)
    q_t = None if spec_t is None else quantize_with_seed(_swap_last(x), spec_t, seed_t, operand=operands[1],
                                                         amax_axes=axes_t)
    return q, q_t
