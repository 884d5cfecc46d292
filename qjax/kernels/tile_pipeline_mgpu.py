"""A TMA pipeline over the 128 x 128 tiles of a 2-D array (Pallas Mosaic GPU), for kernels that transform each tile
from SMEM to SMEM: `qjax.kernels.quantize_mgpu`'s quantize and amax kernels.

Programs cover `steps` consecutive tiles of one tile row; each stream (the input tile, per-tile vectors, outputs)
names the GMEM region a tile reads or writes. Written as a plain loop rather than `plgpu.emit_pipeline`, whose
predicated stores the Mosaic GPU interpreter cannot run, so the CPU tests run the same code as the GPU.
"""

from typing import Any, Callable, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

TILE = 128


def swizzled(dtype):
    """SMEM transforms for a (128, 128) tile: 128-byte rows in 8-row tiles, 128-byte swizzle. TMA writes/reads
    tiles in this form, and the WGMMA-layout loads and stores of registers (plain and through the transposed view)
    are then free of bank conflicts."""
    return (plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(128))


def steps_per_program(k_tiles: int, steps: int) -> int:
    """The largest divisor of k_tiles that is <= steps (each program pipelines that many tiles along K)."""
    steps = max(1, min(steps, k_tiles))
    while k_tiles % steps:
        steps -= 1
    return steps


def tile_region(transposed):
    """GMEM region of tile (i, j): x[i, j] / codes[i, j], or codes_t[j, i] for the transposed layout."""
    if transposed:
        return lambda i, j: (pl.ds(j * TILE, TILE), pl.ds(i * TILE, TILE))
    return lambda i, j: (pl.ds(i * TILE, TILE), pl.ds(j * TILE, TILE))


def scale_row_region(transposed):
    """GMEM region of tile (i, j)'s 128 per-row values: a row of (K/128, M), or of (M/128, K) when transposed."""
    if transposed:
        return lambda i, j: (i, pl.ds(j * TILE, TILE))
    return lambda i, j: (j, pl.ds(i * TILE, TILE))


def inverse_region(transposed):
    """GMEM region of tile (i, j)'s 128 given inverse scales: rows of x (M,), or columns of x (K,) if transposed."""
    if transposed:
        return lambda i, j: pl.ds(j * TILE, TILE)
    return lambda i, j: pl.ds(i * TILE, TILE)


def grouped_tile_region(group_tiles: int):
    """GMEM region of tile (i, j) in a transposed layout per group of `group_tiles` tile rows of x: codes_t[g, j, i']
    of (G, K, M / G), g = i // group_tiles, i' = i % group_tiles (a batch of G matrices stacked along M)."""
    return lambda i, j: (i // group_tiles, pl.ds(j * TILE, TILE), pl.ds(lax.rem(i, group_tiles) * TILE, TILE))


def grouped_inverse_region(group_tiles: int):
    """GMEM region of tile (i, j)'s 128 given inverse scales of the grouped transposed layout: a row of (G, K)."""
    return lambda i, j: (i // group_tiles, pl.ds(j * TILE, TILE))


class Stream(NamedTuple):
    """One array moved between GMEM and SMEM per tile: `region(i, j)` indexes the GMEM ref for tile (i, j)."""

    block: tuple[int, ...]
    dtype: Any
    region: Callable
    swizzled: bool = False
    per_tile: bool = True  # False: the same region for all tiles of a program, loaded once


def run_tiles(step_body, x, seeds, inputs, in_streams, out_type, out_streams, *, steps, out_slots, interpret):
    """Runs step_body on every 128 x 128 tile of x: programs (M/128, K/128/steps), each a TMA pipeline over
    `steps` consecutive tiles of one tile row. Two SMEM slots per input stream: tile t + 1 loads while tile t is
    computed. out_slots (1 or 2) per output stream: with 2, tile t's stores drain while tile t + 1 is computed;
    with 1, tile t + 1 first waits for them to leave SMEM, but the program needs less SMEM, so more programs share
    an SM and overlap each other instead.

    x is streamed as the first input; `inputs` (GMEM arrays) follow, moved per in_streams; outputs per
    out_streams. step_body(seeds_ref, i, j, in_smem_refs, out_smem_refs) transforms tile (i, j) from SMEM to SMEM;
    seeds (uint32 scalars: rounding seeds, a row count) stay in GMEM. (plgpu.emit_pipeline does the same, but
    predicates its stores, which the Mosaic GPU interpreter cannot run; this loop has no predicated copies, so the
    tests run it.)"""
    m, k = x.shape
    k_tiles = k // TILE
    steps = steps_per_program(k_tiles, steps)
    in_streams = [Stream((TILE, TILE), x.dtype, tile_region(False), swizzled=True), *in_streams]
    n_in, n_out = len(in_streams), len(out_streams)
    tile_loads = sum(stream.per_tile for stream in in_streams)

    def smem(stream, slots):
        shape = (slots, *stream.block) if stream.per_tile else stream.block
        return plgpu.SMEM(shape, stream.dtype, transforms=swizzled(stream.dtype) if stream.swizzled else ())

    scratch = [smem(stream, 2) for stream in in_streams] + [smem(stream, out_slots) for stream in out_streams]
    scratch += [plgpu.Barrier(num_arrivals=tile_loads, num_barriers=2), plgpu.Barrier(num_barriers=1)]

    def body(seeds_ref, *refs):
        in_gmem, out_gmem = refs[:n_in], refs[n_in:n_in + n_out]
        in_smem, out_smem = refs[n_in + n_out:2 * n_in + n_out], refs[2 * n_in + n_out:2 * (n_in + n_out)]
        tile_barriers, once_barrier = refs[-2:]
        i, first = lax.axis_index("m"), lax.axis_index("k") * steps

        def load(t, slot):
            for stream, src, dst in zip(in_streams, in_gmem, in_smem):
                if stream.per_tile:
                    plgpu.copy_gmem_to_smem(src.at[stream.region(i, first + t)], dst.at[slot],
                                            tile_barriers.at[slot])

        once = [(stream, src, dst) for stream, src, dst in zip(in_streams, in_gmem, in_smem) if not stream.per_tile]
        for stream, src, dst in once:
            plgpu.copy_gmem_to_smem(src.at[stream.region(i, first)], dst, once_barrier.at[0])
        for slot in range(min(2, steps)):
            load(slot, slot)
        if once:
            plgpu.barrier_wait(once_barrier.at[0])

        @pl.loop(0, steps)
        def _(t):
            slot, out_slot = lax.rem(t, 2), lax.rem(t, out_slots)
            plgpu.barrier_wait(tile_barriers.at[slot])
            # The output slot's stores from tile t - out_slots must have read their SMEM: leave only tile t - 1's
            # in flight (two slots), or none (one slot).
            plgpu.wait_smem_to_gmem(n_out * (out_slots - 1), wait_read_only=True)
            step_body(seeds_ref, i, first + t,
                      [ref.at[slot] if stream.per_tile else ref for stream, ref in zip(in_streams, in_smem)],
                      [ref.at[out_slot] for ref in out_smem])
            plgpu.commit_smem()  # register -> SMEM stores visible to TMA; also all threads are done with the slot
            for stream, src, dst in zip(out_streams, out_smem, out_gmem):
                plgpu.copy_smem_to_gmem(src.at[out_slot], dst.at[stream.region(i, first + t)])

            @pl.when(t + 2 < steps)
            def _():
                load(t + 2, slot)

        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(body, out_type=tuple(out_type), scratch_types=tuple(scratch),
                        grid=(m // TILE, k_tiles // steps), grid_names=("m", "k"), interpret=interpret)(
                            seeds, x, *inputs)
