"""The TMA pipeline of the grouped 8-bit kernels with two compute warpgroups (`GroupedConfig.compute_warpgroups=2`,
`qjax.kernels.grouped_matmul_mgpu` and `grouped_contract_mgpu`): the dense scaled kernel's structure, a memory
warpgroup that loads while two compute warpgroups each multiply one tile_m-row half of a (2 * tile_m, tile_n) tile.

`cfg` below is a `grouped_matmul_mgpu.GroupedConfig` (its tile_m, tile_n, tile_k).
"""

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def two_warpgroup_pipeline(cfg, promote: bool, stages: int, acc_dtype, grid, first_step, active,
                           epilogue, mask_a=None):
    """The pipeline of a (2 * tile_m, tile_n) tile: a memory warpgroup TMA-loads the K steps first_step ..<
    first_step + grid[0] of a (2 * tile_m, K) and b (tile_n, K); compute warpgroup wg, where `active`, sums
    a[wg's tile_m-row half] . b^T (f32 in the WGMMA layout) and calls epilogue(acc) on it; an inactive one does no
    tensor-core work. mask_a(step, a_half_smem), if given, edits wg's half of each step's a tile in SMEM before its
    wgmma (step counted from 0). Call the result with the two GMEM refs and allocations= (from its
    `get_allocations`)."""
    tile_m, tile_n, tile_k = cfg.tile_m, cfg.tile_n, cfg.tile_k
    transforms = (plgpu.TilingTransform((8, tile_k)), plgpu.SwizzleTransform(tile_k))
    # Each step waits for its wgmma before the stage is released: with one wgmma left in flight (delay_release) the
    # next tile's first loads could overwrite the last step's stage while it still reads it (the dense kernel's
    # finding); the two compute warpgroups keep the tensor cores busy in turn instead.
    in_specs = [plgpu.BlockSpec(block, lambda k: (0, first_step + k), transforms=transforms)
                for block in ((2 * tile_m, tile_k), (tile_n, tile_k))]

    def product(step, acc_ref, a_smem, b_smem):
        @pl.when(active)
        def _():
            a_half = a_smem.at[pl.ds(lax.axis_index("wg") * tile_m, tile_m)]
            if mask_a is not None:
                mask_a(step, a_half)
            plgpu.wgmma(acc_ref, a_half, b_smem.transpose((1, 0)))
            plgpu.wgmma_wait(0)

    def accumulate_step(indices, a_smem, b_smem, acc_ref):
        product(indices[0], acc_ref, a_smem, b_smem)
        return acc_ref

    def promote_step(indices, a_smem, b_smem, acc):  # a fresh (zero) accumulator per tile_k, added in float32
        def part(part_ref):
            product(indices[0], part_ref, a_smem, b_smem)
            return part_ref[...]

        return acc + pl.run_scoped(part, plgpu.ACC((tile_m, tile_n), jnp.float32))

    def compute_context(run_pipeline):
        if promote:
            acc = run_pipeline(plgpu.layout_cast(jnp.zeros((tile_m, tile_n), jnp.float32), plgpu.Layout.WGMMA))
        else:
            def accumulate(acc_ref):
                run_pipeline(acc_ref)
                return acc_ref[...].astype(jnp.float32)  # waits for every wgmma

            acc = pl.run_scoped(accumulate, plgpu.ACC((tile_m, tile_n), acc_dtype))
        pl.when(active)(lambda: epilogue(acc))

    return plgpu.emit_pipeline_warp_specialized(
        promote_step if promote else accumulate_step, grid=grid, memory_registers=40, in_specs=in_specs,
        wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=stages, compute_context=compute_context)


def two_warpgroup_scratch(cfg, pipeline, a_ref, b_ref, out_dtype):
    """SMEM of a two-warpgroup kernel: the pipeline's buffers and per compute warpgroup an output tile, its row and
    column scales and their two barriers."""
    return dict(pipeline_allocs=pipeline.get_allocations(a_ref, b_ref),
                out_smem=plgpu.SMEM((2, cfg.tile_m, cfg.tile_n), out_dtype),
                rs_smem=plgpu.SMEM((2, cfg.tile_m), jnp.float32), cs_smem=plgpu.SMEM((2, cfg.tile_n), jnp.float32),
                barriers=plgpu.Barrier(num_barriers=4))
