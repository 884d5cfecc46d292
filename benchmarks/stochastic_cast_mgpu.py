"""Stochastic-rounding cast of any float array to bf16 / e4m3 / e5m2 / int8: a Pallas Mosaic GPU kernel, bit-identical
to `qjax.stochastic.stochastic_round_with_seed`. Kept here for `benchmarks/kernels.py quantize` (kernel vs XLA);
the library does not call it (its stochastic rounding is fused into `qjax.kernels.quantize_mgpu`).

`stochastic_cast(x, dtype, seed)` flattens x (any shape), views it as (rows, 128), pads it to whole tiles of
64 x 128 elements, runs one program per tile and slices the padding off. Per tile:

  GMEM -> SMEM (TMA): x tile (64, 128) f32 / bf16 / f16
  registers:          bits = stochastic.hash_uint32(seed, flat index)   (the reference's own hash, same indices)
                      code = stochastic.stochastic_codes(x, fmt, bits)  (round_to_grid + saturating_cast with
                                                                         kernel-safe ops, see qjax.numerics)
  SMEM -> GMEM (TMA): codes (64, 128)

Register layout: each warp holds whole rows (32 lanes x 4 consecutive columns), so SMEM loads and stores are
contiguous per warp. Under the CPU interpreter the kernel's XLA ops equal the reference bit for bit; compiled on a
GPU they are the same IEEE operations, except that NaN payload/sign bits may differ (both NaN).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from qjax import formats, stochastic
from qjax.kernels import resolve_interpret

_COLUMNS = 128  # x is viewed as (rows, 128); TMA boxes allow at most 256 elements per dimension
_ROWS = 64  # rows per program: 32 KiB of f32 in + <= 16 KiB out of SMEM, so several programs share an SM
# Each warp sweeps whole rows: 32 lanes x 4 consecutive columns, so its SMEM accesses are one contiguous run
# (no bank conflicts in the untiled tile); the 4 warps take 4 consecutive rows.
LAYOUT = plgpu.Layout.TILED(plgpu.Tiling(((4, _COLUMNS), (4,))), warp_dims=(-3,), lane_dims=(-2,), vector_dim=-1)
_INPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_TARGETS = ("bf16", "e4m3", "e5m2", "int8")


# ------------------------------------------------------------------------------------------------------ kernel


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
        index = row * jnp.uint32(_COLUMNS) + col  # row-major flat index
        bits = (stochastic.bf16_bits(seed_ref[0], index) if target == "bf16"  # the reference's bits per format
                else stochastic.hash_uint32(seed_ref[0], index))
        out_smem[...] = stochastic.stochastic_codes(x, fmt, bits, may_be_inf=True)
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
    out = _cast_call(flat.reshape(-1, _COLUMNS), seed.reshape(1), target=fmt.name,
                     interpret=resolve_interpret(interpret))
    out = out.reshape(-1)
    out = (out[:x.size] if padded else out).reshape(x.shape)
    return lax.bitcast_convert_type(out, fmt.dtype) if out.dtype != fmt.dtype else out
