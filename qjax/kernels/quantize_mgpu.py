"""Fused quantization of x (M, K) into both GEMM layouts: Pallas Mosaic GPU kernels, bit-identical to
`qjax.quantize.quantize_with_seed` (`qjax.quantize.quantize_pair_reference` for both layouts).

A linear layer quantizes its activation x (M, K) twice: as (M, K) for the forward GEMM (scales along K) and as its
transpose (K, M) for wgrad (scales along M), generally with different specs and seeds. `quantize_pair_kernel` makes
both from as few reads of x as the granularities allow:

  granularity (each side)   passes over x   how
  1x128, 128x128            1               tile kernel: per-block amax in registers, scales written by the kernel
  row (and tensor)          2               amax kernel (row and column amax from one read), then the tile kernel
  tensor (no row side)      2               XLA's max of |x| (a scalar), then the tile kernel
  ternary (a tensor side)   +1              XLA's mean |x| in place of that side's amax (BitNet b1.58's scale)

Tile kernel (on `tile_pipeline_mgpu.run_tiles`): programs of TILES_PER_PROGRAM consecutive 128 x 128 tiles (i, j)
along K, two SMEM slots for x (tile t + 1 loads while tile t is computed) and one per output (its stores leave SMEM
before tile t + 1 writes there: the smaller footprint lets two programs share an SM, faster than double-buffered
outputs). Per tile:
  GMEM -> SMEM (TMA)  x tile (128, 128) bf16/f16/f32 (128-byte swizzled); for row/tensor sides 128 inverse scales
  row side            x in registers (Mosaic GPU's WGMMA layout, 64 rows at a time): amax along K, scale,
                      y = x * (1 / scale), round (half-even or stochastic), cast -> codes (128, 128)
  column side         the same on the transposed tile, read through a transposed SMEM view (`x_smem.T`, loaded in
                      WGMMA_TRANSPOSED layout and converted in registers to WGMMA: 16/32-bit data is transposed,
                      never the 8-bit codes, which are computed in the transposed layout and stored row-major)
  SMEM -> GMEM (TMA)  codes to out[i, j] and out_t[j, i]; block scales as 128-float rows (below)

Block scales leave the kernel as (K/128, M) (row side) and (M/128, K) (column side) arrays so each tile writes one
contiguous 512-byte row (a TMA box needs >= 16 contiguous bytes; a (128, 1) column would have 4); the wrapper
transposes these small arrays (1/128 of x's elements) into the reference's scale shapes. For 128x128 blocks every
entry of a tile's row is the tile's scale and the wrapper keeps every 128th.

Amax kernel (row sides): the same tiles, writing each tile's 128 row maxima and 128 column maxima (the partial
maxima); XLA reduces those (M/128 or K/128 values per row / column: small) to row amax (M,), column amax (K,) and
the tensor amax (COAT's two-stage max). Scales are then computed by `numerics.scale_from_amax` in XLA.

Bit-exactness: the kernel calls the reference's own numerics (`numerics.amax`, `numerics.scale_from_amax`) and
their kernel-safe forms of rounding and casting (`numerics.cast_codes`, `stochastic.stochastic_codes`), in the
reference's order: amax, scale, y = x * (1 / scale), round, clamp, cast. Stochastic rounding draws
`stochastic.paired_bits` over the quantized layout's own row-major order ((M, K) codes, or (K, M) for the
transpose): one hash per two elements, columns c and c + 64 of a tile row, computed on the chunk's (64, 64) word
array and joined into its (64, 128) bits by `stochastic.pair_bits` (a concatenation of registers in the WGMMA
layout, no data movement).

Rows from `valid_rows` on (a mixture-of-experts ragged_dot's padding rows after sum(group_sizes)) read as zeros
where given: every chunk is masked as it leaves SMEM, in place of an XLA pass that would zero them in x first.
`col_groups` G quantizes a batch of G matrices stacked along M (the experts' weights): the column side per group,
its codes tiles of (G, K, M / G), its scales per (group, column), from the amax kernel's per-tile partial maxima.

Shapes: M and K must be multiples of 128 (`supports` says why not otherwise). Ragged shapes are rejected rather than
padded: padding would cost a full extra pass over x (`qjax.dispatch` runs the jnp reference for them instead).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from qjax import formats, numerics, stochastic
from qjax.kernels import resolve_interpret
from qjax.kernels import tile_pipeline_mgpu as tiles
from qjax.qtensor import QTensor, QuantSpec, row_split_amax_axes

TILE = tiles.TILE
_CHUNK = 64  # rows of a tile held in registers at a time (WGMMA layout: multiples of 64); bounds register use
_LAYOUT = plgpu.Layout.WGMMA
_LAYOUT_T = plgpu.Layout.WGMMA_TRANSPOSED  # loads a transposed SMEM view with vectors along its contiguous dim
_ROWS = _LAYOUT.reduce(1)  # (rows,) per-row values of a WGMMA-layout array
_COLS = _LAYOUT.reduce(0)  # (cols,) per-column values
_INPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Tiles along K each program pipelines (fewer when K/128 is not a multiple). More steps overlap loads, compute and
# stores within a program; one step leaves SMEM for ~3 programs per SM instead.
TILES_PER_PROGRAM = 4


@dataclasses.dataclass(frozen=True)
class _Side:
    """Static description of one output layout for the tile kernel."""

    fmt: str  # "int8", "e4m3", "e5m2"
    block: str | None  # "1x128" / "128x128": scales computed in the kernel; None: inverse scales passed in
    stochastic: bool
    pow2_scale: bool

    @classmethod
    def of(cls, spec: QuantSpec | None):
        if spec is None:
            return None
        block = spec.granularity if spec.is_block_scaled else None
        return cls(spec.dtype, block, spec.stochastic, spec.pow2_scale)


def supports(x, row_spec: QuantSpec, col_spec: QuantSpec | None = None, col_groups: int = 1) -> str | None:
    """None if `quantize_pair_kernel(x, row_spec, col_spec, ..., col_groups=col_groups)` can run, else the reason
    it cannot."""
    for name, spec in (("row_spec", row_spec), ("col_spec", col_spec)):
        if spec is not None and not isinstance(spec, QuantSpec):
            return f"{name} must be a qjax.QuantSpec, got {type(spec).__name__}"
    if row_spec is None:
        return "row_spec is required (col_spec alone: quantize x.T with quantize_kernel instead)"
    if any(spec is not None and spec.granularity == "1x32" for spec in (row_spec, col_spec)):
        return "MX (1x32) scales are computed by the jnp reference only"
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or len(shape) != 2:
        return f"the quantize kernel takes a 2-D x (M, K), got shape {shape}; reshape leading dims into M"
    if dtype is None or jnp.dtype(dtype) not in _INPUT_DTYPES:
        return f"the quantize kernel takes float32, bfloat16 or float16 x, got {dtype}"
    m, k = shape
    if m == 0 or k == 0 or m % TILE or k % TILE:
        return (f"the quantize kernel needs M and K to be positive multiples of {TILE}, got x of shape {shape}; "
                "pad x, or use the jnp reference qjax.quantize.quantize_with_seed")
    if col_groups > 1:
        if col_spec is None or col_spec.is_block_scaled or col_spec.dtype == "ternary":
            return f"col_groups takes a row or tensor scaled int8 / fp8 col_spec, got {col_spec}"
        if m % (col_groups * TILE):
            return f"col_groups={col_groups} needs M a multiple of {col_groups * TILE}, got x of shape {shape}"
    return None



def _broadcast_rows(values, shape):
    """(rows,) in the _ROWS layout -> (rows, cols) in the WGMMA layout, constant along each row."""
    return plgpu.layout_cast(lax.broadcast_in_dim(values, shape, (0,)), _LAYOUT)


def _paired_bits(seed, row0, col0, n_cols, shape):
    """`stochastic.paired_bits` of the chunk (rows, 128) at (row0, col0) (uint32; col0 a multiple of 128) of a
    layout with rows of n_cols (a multiple of 128): one hash for columns c and c + 64, so a thread hashes half of
    its elements. Word of (r, c): r * n_cols / 2 + col0 / 2 + c for c < 64, built from a per-row and a per-column
    vector (2 + 16 registers a thread) rather than from full (rows, 64) iotas, which stayed live across the tile's
    chunks and sides."""
    assert shape[1] == stochastic.PAIR_RUN, shape  # a chunk row is one run of paired bits
    n_rows, n_words = shape[0], shape[1] // 2
    word_shape = (n_rows, n_words)
    row_starts = ((plgpu.broadcasted_iota(jnp.uint32, (n_rows,), 0, layout=_ROWS) + row0) * jnp.uint32(n_cols // 2)
                  + (col0 >> jnp.uint32(1)))
    cols = plgpu.broadcasted_iota(jnp.uint32, (n_words,), 0, layout=_COLS)
    words = _broadcast_rows(row_starts, word_shape) + plgpu.layout_cast(
        lax.broadcast_in_dim(cols, word_shape, (1,)), _LAYOUT)
    return stochastic.pair_bits(stochastic.hash_uint32(seed, words))


def _codes(x32, inv_rows, side: _Side, seed, row0, col0, n_cols):
    """Quantizes f32 (rows, cols) with per-row inverse scales -> codes; row0/col0: the chunk's position (uint32) in
    the quantized layout, whose row length is n_cols (for the stochastic-rounding element index)."""
    fmt = formats.get_format(side.fmt)
    y = x32 * _broadcast_rows(inv_rows, x32.shape)
    if side.stochastic:
        # y is finite, or NaN in a NaN block (x * 1/NaN) or an Inf block (Inf * 1/Inf = Inf * 0): never +-Inf
        return stochastic.stochastic_codes(y, fmt, _paired_bits(seed, row0, col0, n_cols, x32.shape),
                                           may_be_inf=False)
    return numerics.cast_codes(y, fmt, may_be_inf=False)  # int8 rounds half to even inside cast_codes


def _load_chunk(x_smem, h, transposed, row_limit=None):
    """Rows [h*64, h*64+64) of the tile (or of its transpose) as f32 (64, 128) in the WGMMA layout. row_limit: None,
    or int32: the tile's rows (x's, which are the transpose's columns) from row_limit on read as 0."""
    if not transposed:
        x32 = plgpu.load(x_smem.at[pl.ds(h * _CHUNK, _CHUNK)], layout=_LAYOUT).astype(jnp.float32)
    else:
        view = x_smem.at[:, pl.ds(h * _CHUNK, _CHUNK)].T
        x32 = plgpu.layout_cast(plgpu.load(view, layout=_LAYOUT_T), _LAYOUT).astype(jnp.float32)
    if row_limit is None:
        return x32
    rows = plgpu.broadcasted_iota(jnp.int32, x32.shape, 1 if transposed else 0, layout=_LAYOUT)
    return jnp.where(rows < (row_limit if transposed else row_limit - h * _CHUNK), x32, jnp.float32(0))


def _quantize_tile_side(x_smem, side, transposed, inv_smem, codes_smem, scale_smem, seed, row0, col0, n_cols,
                        row_limit):
    """One side of one tile: codes (and block scales) into SMEM. row0/col0: the tile's origin in that layout;
    row_limit: as in `_load_chunk`."""
    fmt = formats.get_format(side.fmt)
    load = lambda h: _load_chunk(x_smem, h, transposed, row_limit)
    tile_amax = None
    if side.block == "128x128":  # the scale needs the whole tile's amax before any chunk is quantized
        chunk_amax = [jnp.max(numerics.amax(load(h), axis=1)) for h in range(TILE // _CHUNK)]
        tile_amax = functools.reduce(jnp.maximum, chunk_amax)
    for h in range(TILE // _CHUNK):
        x32 = load(h)
        rows = pl.ds(h * _CHUNK, _CHUNK)
        if side.block is None:
            inv = plgpu.load(inv_smem.at[rows], layout=_ROWS)
        else:
            if tile_amax is None:
                block_amax = numerics.amax(x32, axis=1)
            else:
                block_amax = plgpu.layout_cast(jnp.broadcast_to(tile_amax, (_CHUNK,)), _ROWS)
            scale = numerics.scale_from_amax(block_amax, fmt, side.pow2_scale)
            scale_smem[rows] = scale
            inv = jnp.float32(1) / scale
        codes_smem[rows] = _codes(x32, inv, side, seed, row0 + jnp.uint32(h * _CHUNK), col0, n_cols)



def _row_limit(seeds_ref, i, masked: bool):
    """Tile row i's valid rows (`_load_chunk`'s row_limit) from seeds_ref[2] (x's valid rows), or None."""
    return seeds_ref[2].astype(jnp.int32) - i * TILE if masked else None


@functools.partial(jax.jit, static_argnames=("row", "col", "steps", "masked", "groups", "out_slots", "interpret"))
def _tile_call(x, seeds, row_inv, col_inv, *, row: _Side, col: _Side | None, steps, masked, groups=1, out_slots=1,
               interpret):
    """The tile kernel. seeds: uint32 (3,): the sides' seeds and x's valid rows (read where `masked`). row_inv (M,)
    / col_inv (K,) (with groups: (G, K)): f32 inverse scales for sides without blocks (else unused). groups: the
    col side per group of M / G rows of x (`quantize_pair_kernel`'s col_groups): its codes (G, K, M / G).
    out_slots: SMEM slots per output (`tile_pipeline_mgpu.run_tiles`); 1, the default, is faster (module docstring).

    Returns [row codes (M, K), row block scales (K/128, M)?, col codes (K, M)?, col block scales (M/128, K)?]."""
    m, k = x.shape
    group_rows = m // groups  # x's rows per group; the grouped col layout's row length
    sides = [(row, False), (col, True)] if col is not None else [(row, False)]
    inverses = [inv for (side, _), inv in zip(sides, (row_inv, col_inv)) if side.block is None]
    out_type = []
    for side, transposed in sides:
        shape = ((groups, k, group_rows) if groups > 1 else (k, m)) if transposed else (m, k)
        out_type.append(jax.ShapeDtypeStruct(shape, formats.get_format(side.fmt).dtype))
        if side.block is not None:
            out_type.append(jax.ShapeDtypeStruct((m // TILE, k) if transposed else (k // TILE, m), jnp.float32))

    def regions(transposed):  # (codes, inverse scales) GMEM regions of a side
        if transposed and groups > 1:
            return tiles.grouped_tile_region(group_rows // TILE), tiles.grouped_inverse_region(group_rows // TILE)
        return tiles.tile_region(transposed), tiles.inverse_region(transposed)

    # Inverse scales of a side without blocks: the tile's 128 rows of x (the same for all tiles of a program:
    # loaded once), or its 128 columns for the transpose.
    in_streams = [tiles.Stream((TILE,), jnp.float32, regions(transposed)[1], per_tile=transposed)
                  for side, transposed in sides if side.block is None]
    out_streams = []
    for side, transposed in sides:
        codes_dtype = formats.get_format(side.fmt).dtype
        out_streams.append(tiles.Stream((TILE, TILE), codes_dtype, regions(transposed)[0], swizzled=True))
        if side.block is not None:
            out_streams.append(tiles.Stream((TILE,), jnp.float32, tiles.scale_row_region(transposed)))

    def step(seeds_ref, i, j, in_refs, out_refs):
        x_smem, inv_refs, out_refs = in_refs[0], list(in_refs[1:]), list(out_refs)
        origin_m, origin_k = (i * TILE).astype(jnp.uint32), (j * TILE).astype(jnp.uint32)
        for s, (side, transposed) in enumerate(sides):
            seed = seeds_ref[s] if side.stochastic else None
            row0, col0, n_cols = (origin_k, origin_m, m) if transposed else (origin_m, origin_k, k)
            if transposed and groups > 1:  # row-major in (G, K, M / G): rows g * K + column of x, length M / G
                group = origin_m // jnp.uint32(group_rows)
                row0, col0 = group * jnp.uint32(k) + origin_k, origin_m - group * jnp.uint32(group_rows)
                n_cols = group_rows
            inv_ref = inv_refs.pop(0) if side.block is None else None
            codes_ref = out_refs.pop(0)
            scale_ref = out_refs.pop(0) if side.block is not None else None
            _quantize_tile_side(x_smem, side, transposed, inv_ref, codes_ref, scale_ref, seed, row0, col0, n_cols,
                                _row_limit(seeds_ref, i, masked))

    return tiles.run_tiles(step, x, seeds, inverses, in_streams, out_type, out_streams, steps=steps,
                           out_slots=out_slots, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("steps", "masked", "interpret"))
def _amax_call(x, seeds, *, steps, masked, interpret):
    """Partial maxima from one read of x: (K/128, M) per-tile row amax and (M/128, K) per-tile column amax.
    seeds: as in `_tile_call` (only the valid rows are read, where `masked`)."""
    m, k = x.shape

    def step(seeds_ref, i, j, in_refs, out_refs):
        (x_smem,), (row_ref, col_ref) = in_refs, out_refs
        row_limit = _row_limit(seeds_ref, i, masked)
        for h in range(TILE // _CHUNK):
            rows = pl.ds(h * _CHUNK, _CHUNK)
            row_ref[rows] = numerics.amax(_load_chunk(x_smem, h, False, row_limit), axis=1)
            col_ref[rows] = numerics.amax(_load_chunk(x_smem, h, True, row_limit), axis=1)

    out_type = (jax.ShapeDtypeStruct((k // TILE, m), jnp.float32), jax.ShapeDtypeStruct((m // TILE, k), jnp.float32))
    out_streams = [tiles.Stream((TILE,), jnp.float32, tiles.scale_row_region(False)),
                   tiles.Stream((TILE,), jnp.float32, tiles.scale_row_region(True))]
    return tiles.run_tiles(step, x, seeds, [], [], out_type, out_streams, steps=steps, out_slots=2,
                           interpret=interpret)


def _seeds(row_seed, col_seed, valid_rows):
    """The kernels' uint32 (3,) scalars: the two sides' seeds and x's valid rows (0 where not masked)."""
    valid = jnp.uint32(0) if valid_rows is None else jnp.asarray(valid_rows, jnp.int32).astype(jnp.uint32)
    return jnp.stack([row_seed, col_seed, valid.reshape(())])


def amax_pair(x: jax.Array, *, col_groups: int = 1, valid_rows=None, interpret=False,
              tiles_per_program=TILES_PER_PROGRAM) -> tuple[jax.Array, jax.Array]:
    """Row and column amax of x (M, K) from one read: (M,) and (K,) f32 with `numerics.amax`'s NaN / Inf (the
    reference's `amax` for granularity "row" of x and of x.T); with col_groups G > 1 the column amax per group of
    M / G rows, (G, K).
    valid_rows: as in `quantize_pair_kernel`."""
    reason = supports(x, QuantSpec("int8"))
    if reason is not None:
        raise ValueError(reason)
    row_partial, col_partial = _amax_call(x, _seeds(jnp.uint32(0), jnp.uint32(0), valid_rows),
                                          steps=tiles_per_program, masked=valid_rows is not None,
                                          interpret=resolve_interpret(interpret))
    col_amax = numerics.amax(col_partial.reshape(col_groups, -1, x.shape[1]), axis=1)
    return numerics.amax(row_partial, axis=0), col_amax if col_groups > 1 else col_amax[0]



def _inverse_scale(spec, row_amax, col_amax, x, shape, transposed, row_axes, col_axes):
    """(scale in the reference's shape, inverse scale per row of this layout (`shape`)) for a row/tensor side;
    amax reduced over the mesh axes x's rows (and columns) are split over where the scale spans them
    (`row_split_amax_axes`). A ternary side's statistic is XLA's mean |x| instead (`numerics.mean_abs`)."""
    axes = row_split_amax_axes(spec, transposed, row_axes, col_axes)
    if spec.dtype == "ternary":
        side_amax, axes = numerics.mean_abs(x.astype(jnp.float32), axes), ()
    else:
        side_amax = numerics.amax(row_amax) if spec.granularity == "tensor" else col_amax if transposed else row_amax
    if axes:
        side_amax = numerics.amax_across(side_amax, axes)
    scale = numerics.scale_from_amax(side_amax, spec.format, spec.pow2_scale)
    if spec.granularity == "tensor":
        return scale, jnp.broadcast_to(jnp.float32(1) / scale, shape)
    return scale[..., None], jnp.float32(1) / scale


def _block_scales(scales, granularity):
    """Kernel scale rows (blocks along the layout's rows, rows) -> the reference's (rows, K/128) / (R/128, K/128)."""
    if granularity == "128x128":
        scales = scales[:, ::TILE]
    return scales.T


def _seed(seed, spec):
    if spec is None or not spec.stochastic:
        return jnp.uint32(0)
    if seed is None:
        raise ValueError(f"{spec} rounds stochastically: pass a uint32 seed (stochastic.key_to_seed(key))")
    return jnp.asarray(seed, jnp.uint32).reshape(())


def quantize_pair_kernel(x: jax.Array, row_spec: QuantSpec, col_spec: QuantSpec | None, row_seed=None,
                         col_seed=None, *, col_groups: int = 1, valid_rows=None, interpret=False,
                         tiles_per_program=TILES_PER_PROGRAM, row_axes: tuple[str, ...] = (),
                         col_axes: tuple[str, ...] = ()) -> tuple[QTensor, QTensor | None]:
    """Quantizes x (M, K) as (M, K) per row_spec and, if col_spec is given, x.T (K, M) per col_spec.

    Args:
      x: float32 / bfloat16 / float16 (M, K), M and K multiples of 128 (see `supports`).
      row_spec, col_spec: `QuantSpec`s (any dtype and granularity each); col_spec None skips the transpose.
      row_seed, col_seed: uint32 scalars, needed by the stochastic specs.
      col_groups: G > 1: x is G matrices stacked along M (e.g. experts' weights (G, K', N) as (G * K', N)), and
        the col side quantizes each one's transpose: codes (G, K, M / G) equal to `quantize_with_seed` of x
        reshaped (G, M / G, K) and transposed to (G, K, M / G), row scales (G, K, 1) or a tensor scale. M must be
        a multiple of G * 128; row or tensor col_spec only; not inside shard_map (row_axes / col_axes).
      valid_rows: None, or an int32 scalar in [0, M]: x's rows from it on are read as zeros (the results equal
        those of x with those rows zeroed), e.g. the padding rows after a ragged_dot's groups.
      interpret: False / None compile the kernels (needs a Hopper GPU); True or a `plgpu.InterpretGPUParams` run
        them under the Mosaic GPU interpreter (CPU, slow: tests).
      tiles_per_program: 128 x 128 tiles along K each program pipelines (a tuning knob; results do not depend on
        it).
      row_axes / col_axes: inside `jax.shard_map`, the mesh axes M / K are split over: the amax of every scale
        that spans them is then reduced over them (`qtensor.row_split_amax_axes`), so the scales are the
        unsharded array's.

    Returns:
      (QTensor (M, K), QTensor (K, M) or None), equal bit for bit to `quantize_with_seed(x, row_spec, row_seed)`
      and `quantize_with_seed(x.T, col_spec, col_seed)`.
    """
    reason = supports(x, row_spec, col_spec, col_groups)
    if reason is None and col_groups > 1 and (row_axes or col_axes or valid_rows is not None):
        reason = "col_groups takes neither row_axes / col_axes nor valid_rows"
    if reason is not None:
        raise ValueError(reason)
    interpret = resolve_interpret(interpret)
    m, k = x.shape
    seeds = _seeds(_seed(row_seed, row_spec), _seed(col_seed, col_spec), valid_rows)
    masked = valid_rows is not None
    specs = [(row_spec, False), (col_spec, True)] if col_spec is not None else [(row_spec, False)]
    given = [(spec, transposed) for spec, transposed in specs if not spec.is_block_scaled]
    scales, inverses = {}, {False: None, True: None}
    if given and all(spec.granularity == "tensor" for spec, _ in given):
        # One scalar: XLA's full reduction of |x| beats the amax kernel, which also takes row and column maxima
        row_amax = col_amax = numerics.amax(numerics.zero_rows(x, valid_rows).astype(jnp.float32))
    elif given:
        row_amax, col_amax = amax_pair(x, col_groups=col_groups, valid_rows=valid_rows, interpret=interpret,
                                       tiles_per_program=tiles_per_program)
    for spec, transposed in given:
        shape = ((col_groups, k) if col_groups > 1 else (k,)) if transposed else (m,)
        scales[transposed], inverses[transposed] = _inverse_scale(
            spec, row_amax, col_amax, numerics.zero_rows(x, valid_rows), shape, transposed, row_axes, col_axes)
    outs = list(_tile_call(x, seeds, inverses[False], inverses[True], row=_Side.of(row_spec),
                           col=_Side.of(col_spec), steps=tiles_per_program, masked=masked, groups=col_groups,
                           interpret=interpret))
    results = []
    for spec, transposed in specs:
        codes = outs.pop(0)
        scale = _block_scales(outs.pop(0), spec.granularity) if spec.is_block_scaled else scales[transposed]
        results.append(QTensor(codes, scale, spec.granularity))
    return results[0], (results[1] if col_spec is not None else None)


def quantize_kernel(x: jax.Array, spec: QuantSpec, seed=None, *, interpret=False,
                    tiles_per_program=TILES_PER_PROGRAM) -> QTensor:
    """One layout: the kernel form of `quantize_with_seed(x, spec, seed)` for x (M, K) (see `quantize_pair_kernel`)."""
    return quantize_pair_kernel(x, spec, None, seed, None, interpret=interpret, tiles_per_program=tiles_per_program)[0]

