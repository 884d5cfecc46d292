"""Fused quantized-Adam update: a Pallas Mosaic GPU kernel for e4m3 states, the jnp reference elsewhere.

`adam_update(g, mu, nu, config, ...)` -> (direction f32, new mu, new nu) for one tensor; `adam.update_reference` is
the jnp reference (dequantize, `adam.adam_math` in float32, requantize as separate XLA ops).

`adam_update_fp8_kernel` does the same for `Fp8State` moments (format "e4m3": codes float8_e4m3fn (n, B), scale f32
(n,) = absmax / 448, see `blockwise`) in one pass over the tensor. The tensor is viewed as n blocks of B = block_size
elements, i.e. an (n, B) array; each program handles one tile of R = 4096 // B consecutive blocks (R rows x B
columns; fewer rows when n is not a multiple of R, and the wrapper pads n to a multiple of 4 rows):

  GMEM -> SMEM (TMA): g (R, B) f32/bf16/f16, m codes (R, B) e4m3, m scale (R,), v codes, v scale
  registers:          m_old = codes * scale, v_old likewise; adam_math (the reference's own function) -> direction,
                      m, v; per row: absmax (NaN-propagating), scale = absmax / 448 (1 for all-zero rows),
                      codes = e4m3(clip(x / scale, -448, 448))
  SMEM -> GMEM (TMA): direction (R, B) f32, new m codes + scale, new v codes + scale

Register layout: one TILED layout for every (R, B) array: each of the 4 warps owns whole rows, its 32 lanes hold 4
consecutive columns each (128 columns per register sweep), so a warp's SMEM access is one contiguous 512-byte (f32)
or 128-byte (e4m3) run (no bank conflicts) and the per-row absmax is a warp shuffle reduction, never cross-warp.
The reduced (R,) layout holds the per-row scales.

Bit-exactness with the reference: the kernel calls `adam.adam_math`, divides and multiplies in the reference's order,
and clamps to +-448 before the e4m3 cast (Mosaic GPU's cast saturates, XLA's does not; after the clamp they agree).
The absmax is a max over the int32 bit patterns of |x| (monotone for non-negative floats; NaN patterns sort above
Inf), so NaN propagates without relying on the max instruction's NaN semantics, then NaN is made canonical.
Under the CPU interpreter the kernel's XLA ops equal the reference's bit for bit. On the GPU, XLA and Mosaic GPU may
contract a*b+c into FMAs differently, so m, v can differ by an ulp and, rarely, a code by one e4m3 step (see
tests/optim/test_fused_kernel.py).

The dispatcher (`adam_update`) takes the kernel only when `config.use_kernel` is True (under the Mosaic GPU
interpreter off a Hopper GPU: slow, for tests). It is opt-in because on an H200 (2026-11-22, jax 0.11.2) it compiled
and ran but measured no faster than XLA's fusion of the reference (15.9 vs 16.2 ms for a 1.1B-parameter AdamW step)
and its GPU tests did not yet pass their ulp-level tolerances (see tests/optim/test_fused_kernel.py). Other formats
(8/4-bit code books, e4m3 with expansion) always take the reference.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from qjax.kernels import on_hopper_gpu
from qjax.optim import adam, blockwise

_E4M3_MAX = 448.0  # formats.E4M3.max_value; blockwise's scale is absmax / this
_TILE_ELEMENTS = 4096  # elements per program: R = 4096 // B rows; ~12 bytes each in SMEM (48 KiB at f32 grads)
_LANE_COLUMNS = 128  # a warp sweeps 32 lanes x 4 columns per register
_WARPS = 4
_MAX_BLOCK = 256  # a TMA box has at most 256 elements per dimension, and one block is one row of the box
_GRAD_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# (R, B) arrays: tiles of 4 rows x 128 columns; warps split the 4 rows, lanes the 128 columns in vectors of 4.
_LAYOUT = plgpu.Layout.TILED(plgpu.Tiling(((_WARPS, _LANE_COLUMNS), (4,))), warp_dims=(-3,), lane_dims=(-2,),
                             vector_dim=-1)
_ROW_LAYOUT = _LAYOUT.reduce(1)  # (R,) per-row values (scales), replicated over a warp's lanes


def kernel_supports(config) -> bool:
    """Whether the fused kernel handles this StateConfig's quantized tensors (e4m3 m and v, block 128 or 256)."""
    return config.mu_format == "e4m3" and config.nu_format == "e4m3" and config.block_size in (_LANE_COLUMNS,
                                                                                               _MAX_BLOCK)


def _row_absmax(x: jax.Array) -> jax.Array:
    """max |x| over axis 1 of f32 (R, B), NaN (canonical) where a row holds NaN, like `blockwise.block_absmax`."""
    bits = lax.bitcast_convert_type(jnp.abs(x), jnp.int32)  # order of non-negative floats; NaN above Inf
    absmax = lax.bitcast_convert_type(jnp.max(bits, axis=1), jnp.float32)
    return jnp.where(absmax != absmax, jnp.float32(jnp.nan), absmax)


def _broadcast_rows(row: jax.Array, shape) -> jax.Array:
    return plgpu.layout_cast(lax.broadcast_in_dim(row, shape, (0,)), _LAYOUT)


def _quantize_rows(x: jax.Array):
    """f32 (R, B) -> (e4m3 codes (R, B), scale f32 (R,)): `blockwise.quantize_fp8` row by row."""
    absmax = _row_absmax(x)
    scale = absmax / jnp.float32(_E4M3_MAX)
    scale = jnp.where(scale == 0, jnp.float32(1), scale)
    # x / scale is finite or NaN here (an Inf element makes the scale Inf: Inf / Inf = NaN), so the clamp alone
    # matches formats.saturating_cast, and it makes XLA's cast (interpreter) agree with Mosaic GPU's saturating one.
    y = jnp.clip(x / _broadcast_rows(scale, x.shape), -_E4M3_MAX, _E4M3_MAX)
    return y.astype(jnp.float8_e4m3fn), scale


def _tile_update(coef_ref, g_s, mc_s, ms_s, vc_s, vs_s, d_s, mc_out, ms_out, vc_out, vs_out, *, b1, b2, eps):
    """One tile in SMEM: the Adam step of `adam.update_reference` on (R, B) arrays."""
    def load_state(codes_ref, scale_ref):
        codes = plgpu.load(codes_ref, layout=_LAYOUT).astype(jnp.float32)
        return codes * _broadcast_rows(plgpu.load(scale_ref, layout=_ROW_LAYOUT), codes.shape)

    g = plgpu.load(g_s, layout=_LAYOUT)
    bc1, bc2_sqrt = coef_ref[0], coef_ref[1]
    direction, m, v = adam.adam_math(g, load_state(mc_s, ms_s), load_state(vc_s, vs_s), b1, b2, eps, bc1, bc2_sqrt)
    d_s[...] = direction
    mc_out[...], ms_out[...] = _quantize_rows(m)
    vc_out[...], vs_out[...] = _quantize_rows(v)


def _rows_per_program(n_rows: int, block_size: int) -> int:
    rows = _TILE_ELEMENTS // block_size
    while n_rows % rows:  # n_rows is a multiple of 4 (padded) and rows a power of two >= 4
        rows //= 2
    return rows


@functools.partial(jax.jit, static_argnames=("b1", "b2", "eps", "interpret"))
def _fp8_kernel_call(g2, m_codes, m_scale, v_codes, v_scale, coef, *, b1, b2, eps, interpret):
    n_rows, block = g2.shape
    rows = _rows_per_program(n_rows, block)
    codes = jax.ShapeDtypeStruct((n_rows, block), jnp.float8_e4m3fn)
    scales = jax.ShapeDtypeStruct((n_rows,), jnp.float32)
    out_type = (jax.ShapeDtypeStruct((n_rows, block), jnp.float32), codes, scales, codes, scales)
    # SMEM tiles: inputs (g, m codes, m scale, v codes, v scale), then outputs (direction, m codes, ..., v scale).
    tile = lambda dtype: plgpu.SMEM((rows, block), dtype)
    state_tiles = (tile(jnp.float8_e4m3fn), plgpu.SMEM((rows,), jnp.float32)) * 2
    scratch = (tile(g2.dtype), *state_tiles, tile(jnp.float32), *state_tiles, plgpu.Barrier(num_barriers=5))

    def body(coef_ref, g_ref, mc_ref, ms_ref, vc_ref, vs_ref, d_ref, mco_ref, mso_ref, vco_ref, vso_ref, *scratch_refs):
        *buffers, barriers = scratch_refs
        in_smem, out_smem = buffers[:5], buffers[5:]
        tile_rows = pl.ds(lax.axis_index("tile") * rows, rows)
        # One barrier per input: the five TMA loads fly together, then the tile is computed and stored.
        for i, (src, dst) in enumerate(zip((g_ref, mc_ref, ms_ref, vc_ref, vs_ref), in_smem)):
            plgpu.copy_gmem_to_smem(src.at[tile_rows], dst, barriers.at[i])
        for i in range(5):
            plgpu.barrier_wait(barriers.at[i])
        _tile_update(coef_ref, *in_smem, *out_smem, b1=b1, b2=b2, eps=eps)
        plgpu.commit_smem()  # make the register->SMEM stores visible to the TMA engine
        for src, dst in zip(out_smem, (d_ref, mco_ref, mso_ref, vco_ref, vso_ref)):
            plgpu.copy_smem_to_gmem(src, dst.at[tile_rows])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=(n_rows // rows,), grid_names=("tile",),
                        interpret=interpret)(coef, g2, m_codes, m_scale, v_codes, v_scale)


def adam_update_fp8_kernel(g, mu, nu, b1, b2, eps, bc1, bc2_sqrt, *, interpret=None):
    """Fused Adam step for one tensor with e4m3 moments (see module docstring); same results as the reference.

    Args:
      g: gradient, float32/bfloat16/float16 of any shape with size == mu's size.
      mu, nu: `blockwise.Fp8State` (codes float8_e4m3fn (n, B), scale float32 (n,)), B = 128 or 256.
      b1, b2, eps: Python floats. bc1, bc2_sqrt: float32 scalars 1 - b1**t and sqrt(1 - b2**t).
      interpret: None runs the compiled kernel (needs a Hopper GPU); True or a `plgpu.InterpretGPUParams` runs it
        under the Mosaic GPU interpreter (CPU).
    Returns:
      (direction float32 of g's shape, new mu Fp8State, new nu Fp8State).
    """
    for name, state in (("mu", mu), ("nu", nu)):
        if not isinstance(state, blockwise.Fp8State):
            raise TypeError(f"{name} must be a blockwise.Fp8State (format 'e4m3'), got {type(state).__name__}")
    n_blocks, block = mu.codes.shape
    if nu.codes.shape != (n_blocks, block) or mu.shape != nu.shape:
        raise ValueError(f"mu and nu differ: codes {mu.codes.shape} vs {nu.codes.shape}, shape {mu.shape} vs "
                         f"{nu.shape}")
    if block not in (_LANE_COLUMNS, _MAX_BLOCK):
        raise ValueError(f"the fused kernel needs block_size {_LANE_COLUMNS} or {_MAX_BLOCK}, got {block}")
    if tuple(g.shape) != tuple(mu.shape):
        raise ValueError(f"gradient shape {g.shape} != state shape {mu.shape}")
    if jnp.dtype(g.dtype) not in _GRAD_DTYPES:
        raise TypeError(f"gradient dtype must be one of {[str(d) for d in _GRAD_DTYPES]}, got {g.dtype}")
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()

    g2 = g.reshape(n_blocks, block)
    arrays = [g2, mu.codes, mu.scale, nu.codes, nu.scale]
    pad = -n_blocks % _WARPS  # the layout tiles 4 rows at a time; padded rows are zeros (scale 1), sliced off below
    if pad:
        arrays = [jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1), constant_values=1 if a.ndim == 1 else 0)
                  for a in arrays]
    coef = jnp.stack([jnp.asarray(bc1, jnp.float32), jnp.asarray(bc2_sqrt, jnp.float32)])
    outs = _fp8_kernel_call(*arrays, coef, b1=float(b1), b2=float(b2), eps=float(eps), interpret=interpret)
    direction, m_codes, m_scale, v_codes, v_scale = (o[:n_blocks] for o in outs) if pad else outs
    return (direction.reshape(g.shape), blockwise.Fp8State(m_codes, m_scale, mu.shape),
            blockwise.Fp8State(v_codes, v_scale, nu.shape))


def adam_update(g, mu, nu, config, b1, b2, eps, bc1, bc2_sqrt):
    """One tensor's Adam update (see `adam` module docstring); picks the kernel or the jnp reference.

    config.use_kernel: True -> the kernel (interpreted off a Hopper GPU), NotImplementedError for formats it does
    not support; False -> the reference. Tensors kept in float32 (small or ragged) always take the reference.
    """
    quantized = blockwise.is_quantized(mu)
    if config.use_kernel and quantized and not kernel_supports(config):
        raise NotImplementedError(
            f"the fused Mosaic GPU Adam kernel supports e4m3 states (adamw_fp8 without dynamic range expansion) "
            f"with block_size 128 or 256; got mu {config.mu_format!r}, nu {config.nu_format!r}, "
            f"block {config.block_size}. Use use_kernel=False (the jnp reference)")
    if config.use_kernel and quantized and jnp.dtype(g.dtype) in _GRAD_DTYPES:
        interpret = None if on_hopper_gpu() else True
        return adam_update_fp8_kernel(g, mu, nu, b1, b2, eps, bc1, bc2_sqrt, interpret=interpret)
    return adam.update_reference(g, mu, nu, config, b1, b2, eps, bc1, bc2_sqrt)
