"""The scaled grouped GEMM contracting over each group's rows (the wgrad of a mixture-of-experts `ragged_dot`), a
Pallas Mosaic GPU kernel for Hopper:

  dw (G, K, N) [e] = a (K, M) [:, rows of e] . b (N, M) [:, rows of e]^T

a and b are int8 / fp8 codes with per-row f32 scales; scales in the epilogue as the reference multiplies them, fp8
with `precise` promoted every tile_k (`grouped_matmul_mgpu`'s tile sum and epilogue). The kernel walks
(group, m-tile, n-tile) tiles, each a pipeline over the tile_k token blocks its group's tokens touch; on the first
and last, which it may share with a neighbouring group, it zeroes a's other tokens in SMEM before the wgmma (an
empty group's tiles are stored as zeros, with no pipeline): one warpgroup, or with
`GroupedConfig.compute_warpgroups=2` a memory warpgroup and two compute warpgroups on (2 * tile_m, tile_n) tiles
(`grouped_pipeline_mgpu.two_warpgroup_pipeline`). Its reference is
`qjax.ragged_dot._grouped_gemm` with the tokens as the ragged contracting dimension.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from qjax.kernels import resolve_interpret
from qjax.kernels.grouped_config_mgpu import GroupedConfig, resolve_config
from qjax.kernels.grouped_matmul_mgpu import (check_operands, epilogue_scratch, pad_to, persistent_kernel, round_up,
                                              stage_scaled, stage_zeros, tile_sum)
from qjax.kernels.grouped_pipeline_mgpu import two_warpgroup_pipeline, two_warpgroup_scratch
from qjax.qtensor import QTensor


def supports_contract(a, b, out_dtype) -> str | None:
    """None if `grouped_contract_kernel(a, b, group_sizes, out_dtype)` handles these operands, else why not."""
    return check_operands(a, b, out_dtype, "(K, M)", "(N, M)", 2)


def group_blocks(group_sizes: jax.Array, tile_k: int) -> jax.Array:
    """(4, G) int32, per group: its first tile_k token block, the number of blocks its tokens touch (0 for an empty
    group), its first token and its end (one past its last token). Neighbouring groups may share a block."""
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    first = starts // tile_k
    blocks = jnp.where(group_sizes > 0, (ends - 1) // tile_k - first + 1, 0)
    return jnp.stack([first, blocks, starts, ends]).astype(jnp.int32)


def _other_tokens_zeroed(start, end, first_block, tile_k: int):
    """mask_a for a group's pipeline (`tile_sum`, `two_warpgroup_pipeline`): zeroes the a tile's token columns
    outside [start, end) in SMEM, on the blocks the group shares with a neighbour or the padding (its first and
    last), so that its sum counts its own tokens only. b's codes there meet zeros, so they must be finite (a NaN
    code in a token's column means a non-finite input, so a non-finite scale for that feature: every group's output
    is NaN there anyway)."""
    def mask_a(step, a_smem):
        origin = (first_block + step) * tile_k
        lo, hi = start - origin, end - origin

        @pl.when((lo > 0) | (hi < tile_k))
        def _():
            layout = plgpu.Layout.WGMMA_8BIT
            tokens = plgpu.broadcasted_iota(jnp.int32, a_smem.shape, 1, layout=layout)
            # an AND with an all-ones or zero byte: Mosaic GPU has bitwise ops only on 8-bit registers
            keep = jnp.where((tokens >= lo) & (tokens < hi), jnp.int32(-1), jnp.int32(0)).astype(jnp.int8)
            codes = lax.bitcast_convert_type(plgpu.load(a_smem, layout=layout), jnp.int8)
            a_smem[...] = lax.bitcast_convert_type(codes & keep, a_smem.dtype)
            plgpu.commit_smem()  # the generic-proxy stores, visible to the wgmma that reads them

    return mask_a


def _tile_of(loop_info, cfg: GroupedConfig, blocks_table, groups: int, m_tiles: int, n_tiles: int):
    """The (group, m tile, n tile) a persistent CTA's loop step computes, in `plgpu.planar_snake` order, that
    group's first token block and block count, and its mask_a: (group, m_idx, n_idx, first, steps, mask_a)."""
    (lin,) = loop_info.index
    group_m, n_idx = plgpu.planar_snake(lin, (groups * m_tiles, n_tiles), 1, cfg.grid_tile_width)
    group = lax.div(group_m, m_tiles)
    first, steps = blocks_table[0, group], blocks_table[1, group]
    mask_a = _other_tokens_zeroed(blocks_table[2, group], blocks_table[3, group], first, cfg.tile_k)
    return group, lax.rem(group_m, m_tiles), n_idx, first, steps, mask_a


def _contract_kernel(cfg: GroupedConfig, promote: bool, blocks_table, a_gmem, b_gmem, sa_gmem, sb_gmem, out_gmem):
    """refs: blocks (4, G) int32 (`group_blocks`), a codes (Kp, Mp), b codes (Np, Mp) (the tokens in group order,
    Mp a multiple of tile_k), sa (Kp,) f32, sb (Np,) f32, out (G, Kp, Np)."""
    tile_m, tile_n = cfg.tile_m, cfg.tile_n
    groups, m_tiles, n_tiles = out_gmem.shape[0], out_gmem.shape[1] // tile_m, out_gmem.shape[2] // tile_n

    def scoped(out_smem, rs_smem, cs_smem, barriers):
        @plgpu.nd_loop((groups * m_tiles * n_tiles,), collective_axes="sm")
        def _(loop_info):
            group, m_idx, n_idx, first, steps, mask_a = _tile_of(loop_info, cfg, blocks_table, groups, m_tiles,
                                                                 n_tiles)
            rows, cols = pl.ds(m_idx * tile_m, tile_m), pl.ds(n_idx * tile_n, tile_n)

            @pl.when(steps == 0)
            def _():  # an empty group: its dw tile is 0
                stage_zeros(out_smem)
                plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[group, rows, cols])

            @pl.when(steps > 0)
            def _():
                plgpu.copy_gmem_to_smem(sa_gmem.at[rows], rs_smem, barriers.at[0])
                plgpu.copy_gmem_to_smem(sb_gmem.at[cols], cs_smem, barriers.at[1])
                acc = tile_sum(cfg, promote, a_gmem.at[rows, :], b_gmem.at[cols, :], first, steps, mask_a)
                stage_scaled(acc, out_smem, rs_smem, cs_smem, barriers.at[0], barriers.at[1])
                plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[group, rows, cols])

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pl.run_scoped(scoped, **epilogue_scratch(cfg, out_gmem.dtype))


def _contract_kernel_2wg(cfg: GroupedConfig, promote: bool, stages: int, blocks_table, a_gmem, b_gmem, sa_gmem,
                         sb_gmem, out_gmem):
    """`_contract_kernel` with a memory warpgroup and two compute warpgroups, each one tile_m-row half of a
    (2 * tile_m, tile_n) tile (`grouped_pipeline_mgpu.two_warpgroup_pipeline`); the same refs."""
    tile_m, tile_n, cta_m = cfg.tile_m, cfg.tile_n, 2 * cfg.tile_m
    groups, m_tiles, n_tiles = out_gmem.shape[0], out_gmem.shape[1] // cta_m, out_gmem.shape[2] // tile_n
    acc_dtype = jnp.int32 if a_gmem.dtype == jnp.int8 else jnp.float32
    pipeline = functools.partial(two_warpgroup_pipeline, cfg, promote, stages, acc_dtype)
    gmem_refs = lambda m_idx, n_idx: (a_gmem.at[pl.ds(m_idx * cta_m, cta_m), :],
                                      b_gmem.at[pl.ds(n_idx * tile_n, tile_n), :])

    def scoped(pipeline_allocs, out_smem, rs_smem, cs_smem, barriers):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((groups * m_tiles * n_tiles,), collective_axes="sm")
        def _(loop_info):
            group, m_idx, n_idx, first, steps, mask_a = _tile_of(loop_info, cfg, blocks_table, groups, m_tiles,
                                                                 n_tiles)
            rows, cols = pl.ds(m_idx * cta_m + wg * tile_m, tile_m), pl.ds(n_idx * tile_n, tile_n)

            def epilogue(acc):
                stage_scaled(acc, out_smem.at[wg], rs_smem.at[wg], cs_smem.at[wg], barriers.at[2 * wg],
                             barriers.at[2 * wg + 1])
                plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[group, rows, cols])

            @pl.when((steps == 0) & (wg < 2))
            def _():  # an empty group: the compute warpgroups store zeros, no pipeline runs
                stage_zeros(out_smem.at[wg])
                plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[group, rows, cols])

            @pl.when(steps > 0)
            def _():
                @pl.when(wg < 2)
                def _():  # the compute warpgroups' epilogue scales arrive while the main loop runs
                    plgpu.copy_gmem_to_smem(sa_gmem.at[rows], rs_smem.at[wg], barriers.at[2 * wg])
                    plgpu.copy_gmem_to_smem(sb_gmem.at[cols], cs_smem.at[wg], barriers.at[2 * wg + 1])

                pipeline((steps,), first, True, epilogue, mask_a)(*gmem_refs(m_idx, n_idx),
                                                                  allocations=pipeline_allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    ignore = lambda *_, **__: None
    # allocated for a static grid of at least `stages` steps (a shorter one would allocate fewer stages)
    allocation_grid = (max(stages, a_gmem.shape[1] // cfg.tile_k),)
    scratch = two_warpgroup_scratch(cfg, pipeline(allocation_grid, 0, True, ignore), *gmem_refs(0, 0),
                                    out_gmem.dtype)
    pl.run_scoped(scoped, **scratch, collective_axes="wg")


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "promote", "interpret"))
def _launch_contract(a_codes, b_codes, a_scale, b_scale, group_sizes, *, out_dtype, config, promote, interpret):
    (k, m), n, groups = a_codes.shape, b_codes.shape[0], group_sizes.shape[0]
    cta_m = config.compute_warpgroups * config.tile_m
    kp, np_ = round_up(k, cta_m), round_up(n, config.tile_n)
    mp = round_up(m, config.tile_k)
    tiles = groups * (kp // cta_m) * (np_ // config.tile_n)
    kernel = persistent_kernel(config, promote, (_contract_kernel, _contract_kernel_2wg), (groups, kp, np_),
                               out_dtype, tiles, interpret)
    return kernel(group_blocks(group_sizes, config.tile_k), pad_to(a_codes, (kp, mp), 0),
                  pad_to(b_codes, (np_, mp), 0), pad_to(a_scale, (kp,), 1), pad_to(b_scale, (np_,), 1))[:, :k, :n]


def grouped_contract_kernel(a: QTensor, b: QTensor, group_sizes: jax.Array, out_dtype, *, precise: bool = False,
                            config: GroupedConfig | None = None, interpret=False) -> jax.Array:
    """Grouped GEMM contracting over each group's rows (the wgrad), on a Hopper GPU: out[e] = a[:, rows of e] .
    b[:, rows of e]^T with a's and b's row scales; rows >= sum(group_sizes) and empty groups give 0.

    Each (group, m-tile, n-tile) item is a pipeline over the token blocks of its group, whose first and last have
    the other groups' tokens zeroed in a's SMEM tile.

    Args:
      a: QTensor, data (K, M) int8 / float8 (the tokens last), scale () or (K, 1) float32.
      b: QTensor, data (N, M) of the same code family, scale () or (N, 1) float32; its codes finite where its
        row scale is and in the tokens past sum(group_sizes) (as `dispatch.quantize_pair(valid_rows=)` writes
        them: saturated codes, zeros past the groups).
      group_sizes: (G,) int32, >= 0, summing to at most M (trusted).
      out_dtype: jnp.bfloat16 or jnp.float32.
      precise, config, interpret: as in `grouped_matmul_kernel` (config.tile_m tiles K, tile_k the tokens).

    Returns:
      (G, K, N) array of out_dtype; equal to `qjax.ragged_dot._grouped_gemm` with the tokens as the ragged
      contracting dimension up to float32 summation order.
    """
    reason = supports_contract(a, b, out_dtype)
    if reason is not None:
        raise ValueError(f"grouped_contract_kernel: {reason}")
    row_scale = lambda q: jnp.broadcast_to(q.scale.reshape(-1), (q.data.shape[0],))
    promote = precise and a.data.dtype != jnp.int8
    config = resolve_config(config or _unpadded_default(a.data.shape[0], promote), promote)
    return _launch_contract(a.data, b.data, row_scale(a), row_scale(b), group_sizes.astype(jnp.int32),
                            out_dtype=jnp.dtype(out_dtype), config=config, promote=promote,
                            interpret=resolve_interpret(interpret))


def _unpadded_default(k: int, promote: bool) -> GroupedConfig:
    """The default config, with 64-row halves where K is a multiple of 128 but not of its (2 * 128)-row tiles
    (1408, an expert FFN width): padding K would cost a copy of a's codes and a slice of the (G, K, N) output."""
    config = resolve_config(None, promote)
    cta_m = config.compute_warpgroups * config.tile_m
    if k % cta_m and k % (config.compute_warpgroups * 64) == 0:
        return dataclasses.replace(config, tile_m=64)
    return config
