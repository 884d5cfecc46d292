"""Grouped GEMMs (mixture-of-experts `ragged_dot`) as Pallas Mosaic GPU kernels for Hopper, rows ragged (the
forward and the dgrad):

  out (M, N) [r] = a (M, K) [r] . b (G, N, K) [group(r)]^T      rows r sorted by group; rows >= sum(sizes) are 0

`grouped_matmul_kernel`: a int8 / fp8 codes (M, K) with per-row f32 scales, b codes (G, N, K) (K-major: Hopper's
8-bit wgmma wants both operands so) with per-(group, n) f32 scales. int32 (int8) or f32 (fp8) accumulation, scales
in the epilogue as the reference multiplies them: out[r, n] = ((acc[r, n] * sa[r]) * sb[group(r), n]).astype(
out_dtype); fp8 with `precise` sums each tile_k of K in a fresh accumulator and adds it in float32 (Hopper's fp8
wgmma accumulates with reduced precision). The reference is `qjax.ragged_dot._grouped_gemm` (XLA's ragged_dot on the
codes, scales after it). The wgrad (rows contracted) is `qjax.kernels.grouped_contract_mgpu`, built from this
module's tile sum and epilogue; the bf16 grouped GEMMs are JAX's own kernels (`qjax.kernels.grouped_bf16_mgpu`).

Structure: the work items are (group, m-tile) pairs of cta_m = compute_warpgroups * tile_m rows: group g covers
m-tiles start_g // cta_m .. (end_g - 1) // cta_m, so a tile that straddles groups is computed once per group, at
most cdiv(M, cta_m) + G - 1 items. The wrapper computes each item's (group, tile, first row in the tile, rows) with
jnp and passes them as an int32 (4, items) table; the rows past sum(group_sizes) form one more group, G, whose
items store zero tiles (so no pass over the output zeroes them), and items past the last rows have 0 rows and are
skipped. Persistent
CTAs walk (item, n-tile) pairs; per pair a TMA pipeline over K (wgmma with b's (tile_n, tile_k) SMEM tile
transposed), the scales fetched by TMA meanwhile, then the epilogue writes the item's rows only: the tile goes to
SMEM and TMA stores it in power-of-two row pieces (one per set bit of the row count; TMA stores need static shapes).
  compute_warpgroups=1: one warpgroup issues the loads (`plgpu.emit_pipeline`) and the wgmma, then the epilogue.
  compute_warpgroups=2 (the dense kernel's structure, `grouped_pipeline_mgpu`): a memory warpgroup runs the TMA
    pipeline (`plgpu.emit_pipeline_warp_specialized`) and two compute warpgroups each own one tile_m-row half of the
    (2 * tile_m, tile_n) tile, sharing the b tile in SMEM; the memory warpgroup loads the next pair's first steps
    while the compute warpgroups run the epilogue. A half with none of the item's rows (a group boundary elsewhere
    in the tile) skips its wgmma and its epilogue, so the tensor-core work per boundary is that of tile_m-row items,
    while every item shares one b tile between 2 * tile_m rows.
Rows past sum(group_sizes) are written as zeros by group G's items. Rows never mix: a NaN in one group's rows
reaches only that group's outputs, as in lax.ragged_dot.

Shapes that do not tile are padded with zero codes (scale 1) and sliced. Off the GPU the kernel runs under the
Mosaic GPU interpreter (`interpret=True`); JAX's bf16 kernels have no interpreted mode and run only compiled.
Not checked off the GPU: ptxas, async wgmma/TMA timing, speed.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from qjax.kernels import persistent_ctas, resolve_interpret
from qjax.kernels.gemm_config_mgpu import FP8
# the kernel's configs (public here too: grouped_matmul_kernel takes them)
from qjax.kernels.grouped_config_mgpu import DEFAULT_CONFIG, PROMOTE_CONFIG, GroupedConfig, resolve_config
from qjax.kernels.grouped_pipeline_mgpu import two_warpgroup_pipeline, two_warpgroup_scratch
from qjax.numerics import INT32_SAFE_K
from qjax.qtensor import QTensor

_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def check_operands(a, b, out_dtype, a_shape: str, b_shape: str, b_ndim: int) -> str | None:
    """Checks shared by both kernels: QTensors a (rows, L) and b (..., rows', L), the contracting length L last,
    codes of one family, tensor scales or one scale per row (shape (..., rows, 1))."""
    if not isinstance(a, QTensor) or not isinstance(b, QTensor):
        return f"operands must be QTensors, got {type(a).__name__} and {type(b).__name__}"
    if a.data.ndim != 2 or b.data.ndim != b_ndim or a.data.shape[1] != b.data.shape[-1]:
        return f"operands must be a {a_shape} and b {b_shape}, got shapes {a.data.shape} and {b.data.shape}"
    if min(a.data.shape + b.data.shape) == 0:
        return f"empty operands {a.data.shape} x {b.data.shape}"
    da, db = jnp.dtype(a.data.dtype), jnp.dtype(b.data.dtype)
    if not ((da == db == jnp.int8) or (da in FP8 and db in FP8)):
        return f"codes must be int8 x int8 or float8 x float8, got {da} x {db}"
    if da == jnp.int8 and a.data.shape[1] > INT32_SAFE_K:
        return f"int8 sums over {a.data.shape[1]} > {INT32_SAFE_K} products could overflow int32"
    if jnp.dtype(out_dtype) not in _OUT_DTYPES:
        return f"out_dtype must be bfloat16 or float32, got {jnp.dtype(out_dtype)}"
    for name, q in (("a", a), ("b", b)):
        shape = (*q.data.shape[:-1], 1)
        if q.is_block_scaled or tuple(q.scale.shape) not in ((), shape):
            return f"{name}: needs tensor or row scales of shape {shape}, got {q.granularity!r} {q.scale.shape}"
        if jnp.dtype(q.scale.dtype) != jnp.float32:
            return f"{name}: scales must be float32, got {q.scale.dtype}"
    return None


def supports(a, b, group_sizes, out_dtype) -> str | None:
    """None if `grouped_matmul_kernel(a, b, group_sizes, out_dtype)` handles these operands, else why not."""
    reason = check_operands(a, b, out_dtype, "(M, K)", "(G, N, K)", 3)
    if reason is None and group_sizes.shape != (b.data.shape[0],):
        return f"group_sizes must have shape ({b.data.shape[0]},), got {group_sizes.shape}"
    return reason


def work_items(group_sizes: jax.Array, m: int, tile_m: int) -> jax.Array:
    """(4, cdiv(m, tile_m) + G) int32: per work item its group, m-tile, first row within the tile and row count.
    The rows from sum(group_sizes) to m are group G's (zero tiles); items past row m have 0 rows."""
    group_sizes = jnp.append(group_sizes, m - jnp.sum(group_sizes))
    groups = group_sizes.shape[0]
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    first, last = starts // tile_m, (ends - 1) // tile_m
    counts = jnp.where(group_sizes > 0, last - first + 1, 0)
    count_ends = jnp.cumsum(counts)
    item = jnp.arange(-(-m // tile_m) + groups - 1, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(count_ends, item, side="right"), groups - 1).astype(jnp.int32)
    tile = first[group] + item - (count_ends - counts)[group]
    row0 = jnp.maximum(starts[group], tile * tile_m)
    row1 = jnp.minimum(ends[group], (tile + 1) * tile_m)
    rows = jnp.where(item < count_ends[-1], row1 - row0, 0)
    return jnp.stack([group, tile, row0 - tile * tile_m, rows]).astype(jnp.int32)


def tile_sum(cfg: GroupedConfig, promote: bool, a_ref, b_ref, first_step, steps, mask_a=None):
    """(tile_m, tile_n) f32 sum in the WGMMA layout of a_ref (tile_m, K) . b_ref (tile_n, K)^T over the K steps
    first_step ..< first_step + steps (each tile_k wide), through a TMA pipeline; mask_a(step, a_smem), if given,
    edits each step's a tile in SMEM before its wgmma (step counted from 0)."""
    shape = (cfg.tile_m, cfg.tile_n)
    acc_dtype = jnp.int32 if a_ref.dtype == jnp.int8 else jnp.float32
    transforms = (plgpu.TilingTransform((8, cfg.tile_k)), plgpu.SwizzleTransform(cfg.tile_k))
    # Accumulating in the wgmma accumulator, a step's wgmma still runs while the next one is issued (a stage is
    # refilled one step late); promoting waits for each step's partial sum.
    in_specs = [plgpu.BlockSpec(block, lambda k: (0, first_step + k), transforms=transforms,
                                delay_release=int(not promote))
                for block in ((cfg.tile_m, cfg.tile_k), (cfg.tile_n, cfg.tile_k))]
    pipeline = functools.partial(plgpu.emit_pipeline, grid=(steps,), in_specs=in_specs,
                                 max_concurrent_steps=cfg.max_concurrent_steps)

    def accumulate(acc_ref):
        def step(indices, a_smem, b_smem):
            if mask_a is not None:
                mask_a(indices[0], a_smem)
            plgpu.wgmma(acc_ref, a_smem, b_smem.transpose((1, 0)))
            plgpu.wgmma_wait(1)  # the previous step's wgmma is done: its stage may be refilled

        pipeline(step)(a_ref, b_ref)
        return acc_ref[...]  # waits for every wgmma

    def promote_step(indices, a_smem, b_smem, acc):
        if mask_a is not None:
            mask_a(indices[0], a_smem)

        def product(part_ref):
            plgpu.wgmma(part_ref, a_smem, b_smem.transpose((1, 0)))
            return part_ref[...]  # waits for it

        return acc + pl.run_scoped(product, plgpu.ACC(shape, jnp.float32))

    if promote:  # fp8 wgmma accumulates with reduced precision: f32 sums of tile_k products each
        zeros = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)
        return pipeline(promote_step, init_carry=zeros)(a_ref, b_ref)
    return pl.run_scoped(accumulate, plgpu.ACC(shape, acc_dtype)).astype(jnp.float32)


def stage_scaled(acc, out_smem, rs_smem, cs_smem, rs_barrier, cs_barrier):
    """The epilogue up to the store: acc (tile_m, tile_n) f32 * the row and column scales TMA brought to SMEM (once
    their barriers say so), (acc * a_scale) * b_scale in the reference's order (two roundings), cast into out_smem
    once this thread's previous TMA store has read it out; committed, ready for the caller's store."""
    plgpu.barrier_wait(rs_barrier)
    plgpu.barrier_wait(cs_barrier)
    acc = acc * lax.broadcast_in_dim(plgpu.load(rs_smem, layout=plgpu.Layout.WGMMA.reduce(1)), acc.shape, [0])
    acc = acc * lax.broadcast_in_dim(plgpu.load(cs_smem, layout=plgpu.Layout.WGMMA.reduce(0)), acc.shape, [1])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    out_smem[...] = acc.astype(out_smem.dtype)
    plgpu.commit_smem()


def stage_zeros(out_smem):
    """A zero tile into out_smem once this thread's previous TMA store has read it out; committed, ready for the
    caller's store (empty groups' and padding rows' tiles: the kernels write every output element)."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    out_smem[...] = plgpu.layout_cast(jnp.zeros(out_smem.shape, out_smem.dtype), plgpu.Layout.WGMMA)
    plgpu.commit_smem()


def epilogue_scratch(cfg: GroupedConfig, out_dtype):
    return dict(out_smem=plgpu.SMEM((cfg.tile_m, cfg.tile_n), out_dtype),
                rs_smem=plgpu.SMEM((cfg.tile_m,), jnp.float32), cs_smem=plgpu.SMEM((cfg.tile_n,), jnp.float32),
                barriers=plgpu.Barrier(num_barriers=2))


def _store_rows(tile_smem, out_gmem, first, count):
    """TMA-stores rows first ..< first + count of tile_smem (rows, cols) to the same rows of out_gmem (rows, cols):
    one store per set bit of count (TMA stores need static shapes), largest first."""
    offset, size = first, 1 << (tile_smem.shape[0].bit_length() - 1)
    while size:
        @pl.when(count & size != 0)
        def _():
            plgpu.copy_smem_to_gmem(tile_smem.at[pl.ds(offset, size)], out_gmem.at[pl.ds(offset, size)])
        offset = offset + (count & size)
        size //= 2


def _rows_kernel(cfg: GroupedConfig, promote: bool, items_table, a_gmem, b_gmem, sa_gmem, sb_gmem, out_gmem):
    """refs: items (4, T) int32, a codes (Mp, Kp), b codes (G, Np, Kp), sa (Mp,) f32, sb (G, Np) f32, out (Mp, Np)."""
    tile_m, tile_n, groups = cfg.tile_m, cfg.tile_n, b_gmem.shape[0]
    items, n_tiles, k_steps = items_table.shape[1], out_gmem.shape[1] // tile_n, a_gmem.shape[1] // cfg.tile_k

    def scoped(out_smem, rs_smem, cs_smem, barriers):
        @plgpu.nd_loop((items * n_tiles,), collective_axes="sm")
        def _(loop_info):
            (lin,) = loop_info.index
            item, n_idx = plgpu.planar_snake(lin, (items, n_tiles), 1, cfg.grid_tile_width)
            group, tile, first, count = (items_table[i, item] for i in range(4))
            rows, cols = pl.ds(tile * tile_m, tile_m), pl.ds(n_idx * tile_n, tile_n)

            @pl.when((count > 0) & (group < groups))
            def _():
                # the epilogue's scales arrive while the main loop runs
                plgpu.copy_gmem_to_smem(sa_gmem.at[rows], rs_smem, barriers.at[0])
                plgpu.copy_gmem_to_smem(sb_gmem.at[group, cols], cs_smem, barriers.at[1])
                acc = tile_sum(cfg, promote, a_gmem.at[rows, :], b_gmem.at[group, cols, :], 0, k_steps)
                stage_scaled(acc, out_smem, rs_smem, cs_smem, barriers.at[0], barriers.at[1])
                _store_rows(out_smem, out_gmem.at[rows, cols], first, count)

            @pl.when((count > 0) & (group == groups))
            def _():  # rows past sum(group_sizes)
                stage_zeros(out_smem)
                _store_rows(out_smem, out_gmem.at[rows, cols], first, count)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pl.run_scoped(scoped, **epilogue_scratch(cfg, out_gmem.dtype))


def _rows_kernel_2wg(cfg: GroupedConfig, promote: bool, stages: int, items_table, a_gmem, b_gmem, sa_gmem, sb_gmem,
                     out_gmem):
    """`_rows_kernel` with a memory warpgroup and two compute warpgroups (module docstring); the same refs, items of
    2 * tile_m rows."""
    tile_m, tile_n, cta_m, groups = cfg.tile_m, cfg.tile_n, 2 * cfg.tile_m, b_gmem.shape[0]
    items, n_tiles, k_steps = items_table.shape[1], out_gmem.shape[1] // tile_n, a_gmem.shape[1] // cfg.tile_k
    pipeline = functools.partial(two_warpgroup_pipeline, cfg, promote, stages,
                                 jnp.int32 if a_gmem.dtype == jnp.int8 else jnp.float32, (k_steps,), 0)
    gmem_refs = lambda group, tile, n_idx: (a_gmem.at[pl.ds(tile * cta_m, cta_m), :],
                                            b_gmem.at[group, pl.ds(n_idx * tile_n, tile_n), :])

    def scoped(pipeline_allocs, out_smem, rs_smem, cs_smem, barriers):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((items * n_tiles,), collective_axes="sm")
        def _(loop_info):
            (lin,) = loop_info.index
            item, n_idx = plgpu.planar_snake(lin, (items, n_tiles), 1, cfg.grid_tile_width)
            group, tile, first, count = (items_table[i, item] for i in range(4))
            # this warpgroup's rows of the item: lo ..< lo + mine of its half
            lo = jnp.clip(first - wg * tile_m, 0, tile_m)
            mine = jnp.clip(first + count - wg * tile_m, 0, tile_m) - lo
            rows, cols = pl.ds(tile * cta_m + wg * tile_m, tile_m), pl.ds(n_idx * tile_n, tile_n)

            def epilogue(acc):
                stage_scaled(acc, out_smem.at[wg], rs_smem.at[wg], cs_smem.at[wg], barriers.at[2 * wg],
                             barriers.at[2 * wg + 1])
                _store_rows(out_smem.at[wg], out_gmem.at[rows, cols], lo, mine)

            @pl.when((count > 0) & (group < groups))
            def _():
                @pl.when((mine > 0) & (wg < 2))
                def _():  # the epilogue's scales arrive while the main loop runs
                    plgpu.copy_gmem_to_smem(sa_gmem.at[rows], rs_smem.at[wg], barriers.at[2 * wg])
                    plgpu.copy_gmem_to_smem(sb_gmem.at[group, cols], cs_smem.at[wg], barriers.at[2 * wg + 1])

                pipeline(mine > 0, epilogue)(*gmem_refs(group, tile, n_idx), allocations=pipeline_allocs)

            @pl.when((group == groups) & (mine > 0) & (wg < 2))
            def _():  # rows past sum(group_sizes): no pipeline, the compute warpgroups store zeros
                stage_zeros(out_smem.at[wg])
                _store_rows(out_smem.at[wg], out_gmem.at[rows, cols], lo, mine)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    ignore = lambda *_, **__: None
    scratch = two_warpgroup_scratch(cfg, pipeline(True, ignore), *gmem_refs(0, 0, 0), out_gmem.dtype)
    pl.run_scoped(scoped, **scratch, collective_axes="wg")


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def pad_to(x, shape, value):
    pad = [(0, size - dim) for dim, size in zip(x.shape, shape)]
    return jnp.pad(x, pad, constant_values=value) if any(p[1] for p in pad) else x


def persistent_kernel(config: GroupedConfig, promote: bool, bodies, out_shape, out_dtype, tiles: int, interpret):
    """The grouped kernel of `config.compute_warpgroups` over a persistent grid of at most `tiles` CTAs: bodies =
    (one compute warpgroup's body(config, promote, *refs), two's body(config, promote, stages, *refs)), the latter
    beside a memory warpgroup (threads "wg"); one output of out_shape and out_dtype."""
    one, two = bodies
    if config.compute_warpgroups == 1:
        body, threads = functools.partial(one, config, promote), {}
    else:
        body = functools.partial(two, config, promote, config.stages(out_dtype))
        threads = dict(num_threads=3, thread_name="wg")
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
                        grid=(min(persistent_ctas(config.num_ctas, interpret), tiles),), grid_names=("sm",),
                        interpret=interpret, **threads)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "promote", "interpret"))
def _launch(a_codes, b_codes, a_scale, b_scale, group_sizes, *, out_dtype, config, promote, interpret):
    (m, k), (groups, n, _) = a_codes.shape, b_codes.shape
    cta_m = config.compute_warpgroups * config.tile_m
    mp, np_, kp = round_up(m, cta_m), round_up(n, config.tile_n), round_up(k, config.tile_k)
    items = work_items(group_sizes, m, cta_m)
    tiles = items.shape[1] * (np_ // config.tile_n)
    kernel = persistent_kernel(config, promote, (_rows_kernel, _rows_kernel_2wg), (mp, np_), out_dtype, tiles,
                               interpret)
    return kernel(items, pad_to(a_codes, (mp, kp), 0), pad_to(b_codes, (groups, np_, kp), 0),
                  pad_to(a_scale, (mp,), 1), pad_to(b_scale, (groups, np_), 1))[:m, :n]


def grouped_matmul_kernel(a: QTensor, b: QTensor, group_sizes: jax.Array, out_dtype, *, precise: bool = False,
                          config: GroupedConfig | None = None, interpret=False) -> jax.Array:
    """Scaled grouped GEMM on a Hopper GPU (module docstring): out[r] = a[r] . b[group(r)]^T with a's row scale and
    b's (group, column) scale; rows >= sum(group_sizes) are 0.

    Args:
      a: QTensor, data (M, K) int8 / float8, rows sorted by group; scale () or (M, 1) float32.
      b: QTensor, data (G, N, K) of the same code family (K-major); scale () or (G, N, 1) float32.
      group_sizes: (G,) int32, >= 0, summing to at most M (trusted: the caller checks them).
      out_dtype: jnp.bfloat16 or jnp.float32.
      precise: fp8 only: sum each tile_k of K in a fresh wgmma accumulator and add it to a float32 sum in
        registers (Hopper's fp8 wgmma accumulates with reduced precision; the reference then uses
        Precision.HIGHEST). Slower: each step waits for its wgmma. int8 sums are exact either way.
      config: `GroupedConfig`; None takes DEFAULT_CONFIG, or PROMOTE_CONFIG where fp8 is promoted (both
        GroupedConfig's defaults).
      interpret: False compiles for the GPU; True runs the Mosaic GPU interpreter (any machine).

    Returns:
      (M, N) array of out_dtype; equal to `qjax.ragged_dot._grouped_gemm` up to float32 summation order (int8:
      exactly, before the output cast).

    Raises:
      ValueError: operands the kernel does not handle (the message says why; see `supports`), or a config whose
        promoting warpgroups would run out of registers (`resolve_config`).
    """
    reason = supports(a, b, group_sizes, out_dtype)
    if reason is not None:
        raise ValueError(f"grouped_matmul_kernel: {reason}")
    (m, _), (groups, n, _) = a.data.shape, b.data.shape
    a_scale = jnp.broadcast_to(a.scale.reshape(-1), (m,))
    b_scale = jnp.broadcast_to(b.scale.reshape(-1) if b.scale.ndim else b.scale, (groups * n,)).reshape(groups, n)
    promote = precise and a.data.dtype != jnp.int8
    return _launch(a.data, b.data, a_scale, b_scale, group_sizes.astype(jnp.int32), out_dtype=jnp.dtype(out_dtype),
                   config=resolve_config(config, promote), promote=promote, interpret=resolve_interpret(interpret))
