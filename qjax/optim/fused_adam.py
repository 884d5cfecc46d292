"""Fused AdamW step for e4m3 states: one Mosaic GPU kernel per tensor writes the new param and moments.

`fused_step_fp8(p, g, mu, nu, ...)` -> (new p, new mu, new nu) does, for one float32 param with `Fp8State` moments
(codes float8_e4m3fn (n, B), scale f32 (n,) = absmax / 448, see `blockwise`), exactly what
`qjax.optim.adamw_fp8`'s optax chain followed by `optax.apply_updates` does to it; `fused_step_reference` is that
computation in jnp (the test reference). Why a kernel: through optax, the step writes an update tensor and reads it
back (`apply_updates` is a separate pass), 28 bytes per float32 param with fp32 states, and XLA splits the block
absmax from the quantization (~24 bytes with e4m3 states, no faster than fp32 AdamW). The kernel reads param, grad,
codes and scales once and writes param, codes and scales once: 16 bytes per param.

The tensor is viewed as n blocks of B elements, an (n, B) array, cut into tiles of R = 1024 // B rows (fewer when n
is not a multiple); one program per tile, with no shared memory:

  GMEM -> registers (vector loads): p (R, B) f32, g (R, B) f32, m codes (R, B), m scale (R,), v codes, v scale
  registers: m_old = codes * scale (same for v); adam.adam_math -> direction, m, v; u = direction + wd * p;
             p = p + (-lr) * u; per row: absmax (NaN-propagating), scale = absmax / 448 (1 for all-zero rows),
             codes = e4m3(clip(x / scale, -448, 448))
  registers -> GMEM (vector stores): p, m codes + scale, v codes + scale, written over the inputs (mutable refs:
                                      the kernel's outputs alias them, so a donated step updates params in place)

Register layout: one TILED layout for every (R, B) array: each of the 4 warps owns whole rows, its 32 lanes hold 4
consecutive columns each (128 columns per register sweep), so a warp's loads and stores are contiguous runs
(coalesced) and the per-row absmax is a warp shuffle reduction, never cross-warp.

Why no TMA pipeline: the first version staged tiles through SMEM with TMA copies, several tiles per program, and
moved ~1.5 TB/s even with the math removed; a million small register-only programs let the hardware hide the memory
latency through occupancy instead (H100 sweep, benchmarks/RESULTS.md).

Bit-exactness with the reference: the kernel calls `adam.adam_math`, does the weight decay and learning-rate ops in
optax's order, and clamps to +-448 before the e4m3 cast (Mosaic GPU's cast saturates, XLA's does not; after the
clamp they agree). The absmax is a max over the int32 bit patterns of |x| (monotone for non-negative floats; NaN
patterns sort above Inf), so NaN propagates without relying on the max instruction's NaN semantics. Under the CPU
interpreter the kernel's XLA ops equal the jitted reference bit for bit. Compiled on a GPU, XLA and Mosaic GPU may
contract a*b+c into FMAs differently, so values can differ by an ulp and, rarely, a code by an e4m3 step or two (see
tests/optim/test_fused_kernel.py).

Which tensors take the kernel (`kernel_eligible`): float32 param and gradient, e4m3 moments of block 128 or 256,
n % 4 == 0 (the layout's 4-row tiles; no padding pass). Everything else stays on the optax path. Other formats
(8/4-bit code books, e4m3 with expansion) have no kernel yet.

Measured (H100, jax 0.11.2, 2026-11-23, 1.1B float32 params, optax.adamw in the same process): 0.72x-0.90x of
optax.adamw's step time, median 0.79x over eight samples on five machines (e.g. 10.60 vs 14.78 ms); the
TMA-pipelined version took 12.6 ms where this one took 11.0, and 11.9 ms even as a pure copy.
Without the in-place refs, XLA copied every kernel output into the donated buffers (+12 bytes per param: 20 ms).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from qjax import kernels
from qjax.kernels.stochastic_cast_mgpu import resolve_interpret
from qjax.optim import adam, blockwise

_E4M3_MAX = 448.0  # formats.E4M3.max_value; blockwise's scale is absmax / this
_TILE_ELEMENTS = 1024  # elements per program (a million programs for 1B params: best in the H100 sweep)
_LANE_COLUMNS = 128  # a warp sweeps 32 lanes x 4 columns per register
_WARPS = 4
_MAX_BLOCK = 256  # a 1024-element tile must hold a row per warp (4 rows of <= 256); blockwise's default

# (R, B) arrays: tiles of 4 rows x 128 columns; warps split the 4 rows, lanes the 128 columns in vectors of 4.
_LAYOUT = plgpu.Layout.TILED(plgpu.Tiling(((_WARPS, _LANE_COLUMNS), (4,))), warp_dims=(-3,), lane_dims=(-2,),
                             vector_dim=-1)
_ROW_LAYOUT = _LAYOUT.reduce(1)  # (R,) per-row values (scales), replicated over a warp's lanes


def kernel_mode() -> tuple[bool, bool]:
    """(run the kernel?, interpret it?) for `use_kernel=True`: compiled on a single Hopper GPU, else not at all.

    Several devices keep the optax path: the kernel is a custom call without a partitioning rule (sharded params
    would be gathered). Tests patch this to (True, True) to run the kernel under the Mosaic GPU interpreter."""
    return kernels.use_kernel("auto")


def kernel_eligible(p, g, mu, nu) -> bool:
    """Whether one tensor's step can run in the kernel (module docstring); otherwise it takes the optax path."""
    return (isinstance(mu, blockwise.Fp8State) and isinstance(nu, blockwise.Fp8State)
            and mu.codes.shape[1] in (_LANE_COLUMNS, _MAX_BLOCK) and mu.codes.shape[0] % _WARPS == 0
            and jnp.dtype(p.dtype) == jnp.float32 and jnp.dtype(g.dtype) == jnp.float32)


def _param_update(p, direction, step_size, weight_decay: float):
    """optax's add_decayed_weights, scale_by_learning_rate and apply_updates on float32 arrays, in their order."""
    u = direction + jnp.float32(weight_decay) * p if weight_decay else direction  # optax skips a zero decay
    return p + step_size * u


def fused_step_reference(p, g, mu, nu, config, b1, b2, eps, bc1, bc2_sqrt, step_size, weight_decay: float):
    """jnp reference of one tensor's fused step, any state format: `adam.update_reference`, then the param update.
    Args as in `fused_step_fp8`, plus the `adam.StateConfig`."""
    direction, mu, nu = adam.update_reference(g, mu, nu, config, b1, b2, eps, bc1, bc2_sqrt)
    return _param_update(p, direction, step_size, weight_decay), mu, nu


def _broadcast_rows(row: jax.Array, shape) -> jax.Array:
    return plgpu.layout_cast(lax.broadcast_in_dim(row, shape, (0,)), _LAYOUT)


def _quantize_rows(x: jax.Array):
    """f32 (R, B) -> (e4m3 codes (R, B), scale f32 (R,)): `blockwise.quantize_fp8` row by row."""
    absmax = blockwise.block_absmax(x)  # NaN-propagating bit-pattern max, per row
    scale = absmax / jnp.float32(_E4M3_MAX)
    scale = jnp.where(scale == 0, jnp.float32(1), scale)
    # x / scale is finite or NaN here (an Inf element makes the scale Inf: Inf / Inf = NaN), so the clamp alone
    # matches formats.saturating_cast, and it makes XLA's cast (interpreter) agree with Mosaic GPU's saturating one.
    y = jnp.clip(x / _broadcast_rows(scale, x.shape), -_E4M3_MAX, _E4M3_MAX)
    return y.astype(jnp.float8_e4m3fn), scale


def _load(ref, layout):
    # optimized=False: Mosaic GPU's "optimized" (bank-conflict-free) transfers are for SMEM only; from GMEM each
    # register is one vector load, and a warp's loads are contiguous.
    return plgpu.load(ref, layout=layout, optimized=False)


def _tile_step(coef_ref, p_ref, g_ref, m_codes_ref, m_scale_ref, v_codes_ref, v_scale_ref, *, b1, b2, eps,
               weight_decay):
    """One tile in GMEM, updated in place: the fused step of `fused_step_reference` on (R, B) arrays."""
    def load_state(codes_ref, scale_ref):
        codes = _load(codes_ref, _LAYOUT).astype(jnp.float32)
        return codes * _broadcast_rows(_load(scale_ref, _ROW_LAYOUT), codes.shape)

    p = _load(p_ref, _LAYOUT)
    g = _load(g_ref, _LAYOUT)
    bc1, bc2_sqrt, step_size = coef_ref[0], coef_ref[1], coef_ref[2]
    m_old, v_old = load_state(m_codes_ref, m_scale_ref), load_state(v_codes_ref, v_scale_ref)
    direction, m, v = adam.adam_math(g, m_old, v_old, b1, b2, eps, bc1, bc2_sqrt)
    p_ref[...] = _param_update(p, direction, step_size, weight_decay)
    m_codes_ref[...], m_scale_ref[...] = _quantize_rows(m)
    v_codes_ref[...], v_scale_ref[...] = _quantize_rows(v)


def _tile_rows(n_rows: int, block_size: int) -> int:
    rows = _TILE_ELEMENTS // block_size
    while n_rows % rows:  # n_rows is a multiple of 4 and rows a power of two >= 4
        rows //= 2
    return rows


@functools.partial(jax.jit, static_argnames=("b1", "b2", "eps", "weight_decay", "interpret"))
def _fp8_step_call(p2, g2, m_codes, m_scale, v_codes, v_scale, coef, *, b1, b2, eps, weight_decay, interpret):
    n_rows, block = p2.shape
    rows = _tile_rows(n_rows, block)
    inputs = (p2, g2, m_codes, m_scale, v_codes, v_scale)
    written = (0, 2, 3, 4, 5)  # updated in place

    def body(coef_ref, *refs):
        tile = pl.ds(lax.axis_index("program") * rows, rows)
        _tile_step(coef_ref, *(ref.at[tile] for ref in refs), b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)

    # The param and state arrays go in as mutable refs, updated in place (the kernel's aliased outputs): with the
    # step's params and state donated, XLA then writes them where they are instead of copying each kernel output
    # into the donated buffer (12 more bytes moved per param).
    refs = [jax.new_ref(a) if i in written else a for i, a in enumerate(inputs)]
    plgpu.kernel(body, out_type=(), grid=(n_rows // rows,), grid_names=("program",), interpret=interpret)(coef, *refs)
    return tuple(jax.freeze(refs[i]) for i in written)


def fused_step_fp8(p, g, mu, nu, b1, b2, eps, bc1, bc2_sqrt, step_size, weight_decay: float, *, interpret=None):
    """One tensor's AdamW step with e4m3 moments in one kernel (module docstring); same result as the reference.

    Args:
      p, g: float32 param and gradient of the same shape, size == mu's size.
      mu, nu: `blockwise.Fp8State` (codes float8_e4m3fn (n, B), scale float32 (n,)), B = 128 or 256, n % 4 == 0.
      b1, b2, eps: Python floats. bc1, bc2_sqrt: float32 scalars 1 - b1**t and sqrt(1 - b2**t).
      step_size: float32 scalar, -learning_rate at this step. weight_decay: Python float (0: none, as optax).
      interpret: None / False runs the compiled kernel (needs a Hopper GPU); True or a `plgpu.InterpretGPUParams`
        runs it under the Mosaic GPU interpreter (CPU).
    Returns:
      (new param float32 of p's shape, new mu Fp8State, new nu Fp8State).
    """
    if not kernel_eligible(p, g, mu, nu):
        raise ValueError(f"fused_step_fp8 needs float32 p and g and Fp8State moments of block {_LANE_COLUMNS} or "
                         f"{_MAX_BLOCK} with a multiple of {_WARPS} blocks; got p {p.dtype}, g {g.dtype}, mu "
                         f"{type(mu).__name__}, nu {type(nu).__name__}")
    n_blocks, block = mu.codes.shape
    if nu.codes.shape != (n_blocks, block) or mu.shape != nu.shape or p.shape != mu.shape or g.shape != p.shape:
        raise ValueError(f"shapes differ: p {p.shape}, g {g.shape}, mu {mu.shape} {mu.codes.shape}, nu {nu.shape} "
                         f"{nu.codes.shape}")
    interpret = resolve_interpret(interpret)
    coef = jnp.stack([jnp.asarray(c, jnp.float32) for c in (bc1, bc2_sqrt, step_size)])
    p_new, m_codes, m_scale, v_codes, v_scale = _fp8_step_call(
        p.reshape(n_blocks, block), g.reshape(n_blocks, block), mu.codes, mu.scale, nu.codes, nu.scale, coef,
        b1=float(b1), b2=float(b2), eps=float(eps), weight_decay=float(weight_decay), interpret=interpret)
    return (p_new.reshape(p.shape), blockwise.Fp8State(m_codes, m_scale, mu.shape),
            blockwise.Fp8State(v_codes, v_scale, nu.shape))
