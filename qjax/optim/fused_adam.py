"""Fused AdamW step for e4m3 or 8-bit states: one Mosaic GPU kernel per tensor writes the new param and moments.

`fused_step(p, g, mu, nu, ...)` -> (new p, new mu, new nu) does, for one float32 param with quantized moments, exactly
what `qjax.optim.adamw_fp8` / `adamw_8bit`'s optax chain followed by `optax.apply_updates` does to it;
`fused_step_reference` is that computation in jnp (the test reference). State formats (`KERNEL_FORMATS`):
  e4m3:  `Fp8State` m and v, codes float8_e4m3fn (n, B), scale f32 (n,) = absmax / 448 (see `blockwise`)
  8-bit: `CodebookState` m on the signed, v on the unsigned dynamic map, codes uint8 (n, B), absmax f32 (n,); the
         kernel decodes with one lookup per code and encodes with `maps.encode_unit` (position arithmetic and one
         lookup) in the map's `maps.codec_table`, which each program copies to SMEM and reads per lane (`_lookup`:
         Mosaic GPU has no gather).
Why a kernel: through optax, the step writes an update tensor and reads it back (`apply_updates` is a separate pass),
28 bytes per float32 param with fp32 states, and XLA splits the block absmax from the quantization (~24 bytes with
e4m3 states, no faster than fp32 AdamW; the 8-bit jnp path moves more and gathers from the code books). The kernel
reads param, grad, codes and scales once and writes param, codes and scales once: 16 bytes per param.

The tensor is viewed as n blocks of B elements, an (n, B) array, cut into tiles of R = T // B rows (fewer when n
is not a multiple); one program per tile, with no shared memory but the 8-bit code tables:

  GMEM -> registers (vector loads): p (R, B) f32, g (R, B) f32, m codes (R, B), m scale (R,), v codes, v scale
  registers: m_old = decode(codes) * scale (same for v); adam.adam_math -> direction, m, v;
             u = direction + wd * p; p = p + (-lr) * u; per row: absmax (NaN-propagating), then
             e4m3: scale = absmax / 448 (1 for all-zero rows), codes = e4m3(clip(x / scale, -448, 448))
             8-bit: codes = nearest code of x / absmax (divided by 1 for all-zero rows), absmax stored
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
contract a*b+c into FMAs differently, so values can differ by an ulp and, rarely, a code by one or two steps (e4m3,
or neighbouring 8-bit codes; see tests/optim/test_fused_kernel.py).

Which tensors take the kernel (`kernel_eligible`): float32 param and gradient, moments in one of `KERNEL_FORMATS`
with blocks of 128 or 256, n % 4 == 0 (the layout's 4-row tiles; no padding pass). Everything else stays on the
optax path. Other formats (4-bit code books, e4m3 with expansion) have no kernel yet.

Measured (H100, jax 0.11.2, 2026-11-24, 1.1B float32 params, GPU time of 10 steps in one jitted fori_loop, each
row timed alternately with optax.adamw; RESULTS.md): e4m3 0.65x of optax.adamw's step time (7.5 vs 11.6 ms), 8-bit
0.75x (8.8 vs 11.7 ms; its jnp path 2.1x). The 8-bit codec went from arithmetic (one division per decode, ~400
operations per element, ALU-bound at 1.33x) to table lookups. Dispatched one step at a time, both kernel steps are
host-bound (~1000 arrays: 6-26 ms per step), and that is how the tile size (2048 over 1024-8192) and the SMEM table
(over reading it from L1) were chosen: weak evidence, worth re-sweeping with the fori_loop timing. The TMA-pipelined
e4m3 version took 12.6 ms where a register-only one took 11.0 (2026-11-23), 11.9 ms even as a pure copy. Without
the in-place refs, XLA copied every kernel output into the donated buffers (+12 bytes per param: 20 ms).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, memref

from qjax import kernels
from qjax.kernels.stochastic_cast_mgpu import resolve_interpret
from qjax.optim import adam, blockwise, maps

_E4M3_MAX = 448.0  # formats.E4M3.max_value; blockwise's scale is absmax / this
# Elements per program: the fastest in H100 sweeps of 1024..8192 (1.1B tree, 2026-11-24, steps timed one by one,
# partly host-bound: e4m3 0.67x of optax.adamw at 2048 vs 0.71x at 1024; 8-bit (SMEM tables) 0.76-0.79x at 2048).
_TILE_ELEMENTS = 2048
_LANE_COLUMNS = 128  # a warp sweeps 32 lanes x 4 columns per register
_WARPS = 4
_MAX_BLOCK = 256  # a tile holds at least a row per warp (4 x 256 <= _TILE_ELEMENTS); blockwise's default

# (R, B) arrays: tiles of 4 rows x 128 columns; warps split the 4 rows, lanes the 128 columns in vectors of 4.
_LAYOUT = plgpu.Layout.TILED(plgpu.Tiling(((_WARPS, _LANE_COLUMNS), (4,))), warp_dims=(-3,), lane_dims=(-2,),
                             vector_dim=-1)
_ROW_LAYOUT = _LAYOUT.reduce(1)  # (R,) per-row values (scales), replicated over a warp's lanes

# (m format, v format) pairs the kernel reads and writes: "e4m3" (Fp8State) or a code book's map (CodebookState).
KERNEL_FORMATS = (("e4m3", "e4m3"), ("dynamic_signed_8bit", "dynamic_unsigned_8bit"))
KERNEL_BLOCK_SIZES = (_LANE_COLUMNS, _MAX_BLOCK)


def kernel_mode() -> tuple[bool, bool]:
    """(run the kernel?, interpret it?) for `use_kernel=True`: compiled on a single Hopper GPU, else not at all.

    Several devices keep the optax path: the kernel is a custom call without a partitioning rule (sharded params
    would be gathered). Tests patch this to (True, True) to run the kernel under the Mosaic GPU interpreter."""
    return kernels.use_kernel("auto")


def _state_format(state) -> str | None:
    """The kernel's name for a moment's format ("e4m3" or an 8-bit map name), None for any other state."""
    if isinstance(state, blockwise.Fp8State):
        return "e4m3"
    if isinstance(state, blockwise.CodebookState) and blockwise.CODEBOOK_FORMATS[state.qmap] == 8:
        return state.qmap
    return None


def _scale_field(state) -> str:
    """The name of a state's per-block scale: Fp8State.scale, CodebookState.absmax."""
    return "scale" if isinstance(state, blockwise.Fp8State) else "absmax"


def _scale(state) -> jax.Array:
    return getattr(state, _scale_field(state))


def kernel_eligible(p, g, mu, nu) -> bool:
    """Whether one tensor's step can run in the kernel (module docstring); otherwise it takes the optax path."""
    return ((_state_format(mu), _state_format(nu)) in KERNEL_FORMATS
            and mu.codes.shape[1] in KERNEL_BLOCK_SIZES and mu.codes.shape[0] % _WARPS == 0
            and jnp.dtype(p.dtype) == jnp.float32 and jnp.dtype(g.dtype) == jnp.float32)


def _param_update(p, direction, step_size, weight_decay: float):
    """optax's add_decayed_weights, scale_by_learning_rate and apply_updates on float32 arrays, in their order."""
    u = direction + jnp.float32(weight_decay) * p if weight_decay else direction  # optax skips a zero decay
    return p + step_size * u


def fused_step_reference(p, g, mu, nu, config, b1, b2, eps, bc1, bc2_sqrt, step_size, weight_decay: float):
    """jnp reference of one tensor's fused step, any state format: `adam.update_reference`, then the param update.
    Args as in `fused_step`, plus the `adam.StateConfig`."""
    direction, mu, nu = adam.update_reference(g, mu, nu, config, b1, b2, eps, bc1, bc2_sqrt)
    return _param_update(p, direction, step_size, weight_decay), mu, nu


def _broadcast_rows(row: jax.Array, shape) -> jax.Array:
    return plgpu.layout_cast(lax.broadcast_in_dim(row, shape, (0,)), _LAYOUT)


_TABLE_COLUMNS = 128  # code tables travel as (T / 128, 128) arrays: a TMA box is at most 256 wide


def _lookup(table_ref, index: jax.Array, interpret: bool) -> jax.Array:
    """table_ref float32 (T / 128, 128), index int32 (R, B) in [0, T) in `_LAYOUT` -> float32 (R, B) table[index].

    Mosaic GPU has no gather: each lane loads its elements one by one (`memref.load`: ld.shared for an SMEM table,
    where random indices cost only bank conflicts). The CPU interpreter cannot run `inline_mgpu`, so there the
    table is loaded whole and gathered."""
    if interpret:
        return jnp.take(table_ref[...].reshape(-1), index, axis=0)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), _LAYOUT),
                       return_type=plgpu.ShapeDtypeStruct(index.shape, jnp.float32, _LAYOUT))
    def gather(_, table, idx):
        def load(i, _):  # i: one lane's int32 index
            shift = arith.constant(i.type, _TABLE_COLUMNS.bit_length() - 1)
            row = arith.index_cast(ir.IndexType.get(), arith.shrui(i, shift))
            col = arith.index_cast(ir.IndexType.get(), arith.andi(i, arith.constant(i.type, _TABLE_COLUMNS - 1)))
            return memref.load(table, [row, col])

        return idx.foreach(load, create_array=True)

    return gather(table_ref, index)


def code_table(fmt: str) -> jax.Array:
    """An 8-bit format's `maps.codec_table` as the kernel reads it: float32 (T / 128, 128); a dummy for e4m3."""
    if fmt == "e4m3":
        return jnp.zeros((1, _TABLE_COLUMNS), jnp.float32)
    return jnp.asarray(maps.codec_table(maps.get_map(fmt)).reshape(-1, _TABLE_COLUMNS))


def _dequantize_rows(codes: jax.Array, scale: jax.Array, fmt: str, table) -> jax.Array:
    """codes (R, B) e4m3 or uint8, scale f32 (R,) -> f32 (R, B): `blockwise.dequantize` row by row.
    table: the 8-bit format's `maps.codec_table` lookup (index -> value); unused for e4m3."""
    if fmt == "e4m3":
        values = codes.astype(jnp.float32)
    else:
        values = table(codes.astype(jnp.int32) + maps.get_map(fmt).size)  # the map's values follow its thresholds
    return values * _broadcast_rows(scale, codes.shape)


def _quantize_rows(x: jax.Array, fmt: str, table):
    """f32 (R, B) -> (codes (R, B), scale f32 (R,)): `blockwise.quantize_fp8` / `quantize_codebook` row by row."""
    absmax = blockwise.block_absmax(x)  # NaN-propagating bit-pattern max, per row
    if fmt != "e4m3":
        divisor = jnp.where(absmax == 0, jnp.float32(1), absmax)  # |x / absmax| <= 1: encode_unit's domain
        return maps.encode_unit(x / _broadcast_rows(divisor, x.shape), maps.get_map(fmt), table), absmax
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


def _tile_step(coef_ref, m_table_ref, v_table_ref, p_ref, g_ref, m_codes_ref, m_scale_ref, v_codes_ref, v_scale_ref,
               *, formats, b1, b2, eps, weight_decay, interpret):
    """One tile in GMEM, updated in place: the fused step of `fused_step_reference` on (R, B) arrays.
    m_table_ref, v_table_ref: the 8-bit formats' `maps.codec_table` (unused for e4m3)."""
    m_format, v_format = formats
    m_table = functools.partial(_lookup, m_table_ref, interpret=interpret)
    v_table = functools.partial(_lookup, v_table_ref, interpret=interpret)

    def load_state(codes_ref, scale_ref, fmt, table):
        return _dequantize_rows(_load(codes_ref, _LAYOUT), _load(scale_ref, _ROW_LAYOUT), fmt, table)

    p = _load(p_ref, _LAYOUT)
    g = _load(g_ref, _LAYOUT)
    bc1, bc2_sqrt, step_size = coef_ref[0], coef_ref[1], coef_ref[2]
    m_old = load_state(m_codes_ref, m_scale_ref, m_format, m_table)
    v_old = load_state(v_codes_ref, v_scale_ref, v_format, v_table)
    direction, m, v = adam.adam_math(g, m_old, v_old, b1, b2, eps, bc1, bc2_sqrt)
    p_ref[...] = _param_update(p, direction, step_size, weight_decay)
    m_codes_ref[...], m_scale_ref[...] = _quantize_rows(m, m_format, m_table)
    v_codes_ref[...], v_scale_ref[...] = _quantize_rows(v, v_format, v_table)


def _tile_rows(n_rows: int, block_size: int) -> int:
    rows = _TILE_ELEMENTS // block_size
    while n_rows % rows:  # n_rows is a multiple of 4 and rows a power of two >= 4
        rows //= 2
    return rows


@functools.partial(jax.jit, static_argnames=("formats", "b1", "b2", "eps", "weight_decay", "interpret"))
def _step_call(p2, g2, m_codes, m_scale, v_codes, v_scale, coef, *, formats, b1, b2, eps, weight_decay, interpret):
    n_rows, block = p2.shape
    rows = _tile_rows(n_rows, block)
    inputs = (p2, g2, m_codes, m_scale, v_codes, v_scale)
    written = (0, 2, 3, 4, 5)  # updated in place

    code_tables = formats[0] != "e4m3"

    def body(coef_ref, m_table_ref, v_table_ref, *refs):
        if code_tables:  # each program copies the two 2 KB tables to SMEM (lookups: ld.shared)
            *refs, m_table_smem, v_table_smem, barrier = refs
            plgpu.copy_gmem_to_smem(m_table_ref, m_table_smem, barrier.at[0])
            plgpu.copy_gmem_to_smem(v_table_ref, v_table_smem, barrier.at[1])
            plgpu.barrier_wait(barrier.at[0])
            plgpu.barrier_wait(barrier.at[1])
            m_table_ref, v_table_ref = m_table_smem, v_table_smem
        tile = pl.ds(lax.axis_index("program") * rows, rows)
        _tile_step(coef_ref, m_table_ref, v_table_ref, *(ref.at[tile] for ref in refs), formats=formats, b1=b1,
                   b2=b2, eps=eps, weight_decay=weight_decay, interpret=interpret is not None)

    # The param and state arrays go in as mutable refs, updated in place (the kernel's aliased outputs): with the
    # step's params and state donated, XLA then writes them where they are instead of copying each kernel output
    # into the donated buffer (12 more bytes moved per param).
    refs = [jax.new_ref(a) if i in written else a for i, a in enumerate(inputs)]
    tables = [code_table(f) for f in formats]
    scratch = ()
    if code_tables:
        scratch = (*(plgpu.SMEM(t.shape, jnp.float32) for t in tables), plgpu.Barrier(num_barriers=2))
    plgpu.kernel(body, out_type=(), grid=(n_rows // rows,), grid_names=("program",), scratch_types=scratch,
                 interpret=interpret)(coef, *tables, *refs)
    return tuple(jax.freeze(refs[i]) for i in written)


def fused_step(p, g, mu, nu, b1, b2, eps, bc1, bc2_sqrt, step_size, weight_decay: float, *, interpret=None):
    """One tensor's AdamW step with quantized moments in one kernel (module docstring); same result as the reference.

    Args:
      p, g: float32 param and gradient of the same shape, size == mu's size.
      mu, nu: moments in one of `KERNEL_FORMATS`: `blockwise.Fp8State` (codes float8_e4m3fn (n, B), scale float32
        (n,)) or 8-bit `blockwise.CodebookState` (codes uint8 (n, B), absmax float32 (n,)); B = 128 or 256,
        n % 4 == 0.
      b1, b2, eps: Python floats. bc1, bc2_sqrt: float32 scalars 1 - b1**t and sqrt(1 - b2**t).
      step_size: float32 scalar, -learning_rate at this step. weight_decay: Python float (0: none, as optax).
      interpret: None / False runs the compiled kernel (needs a Hopper GPU); True or a `plgpu.InterpretGPUParams`
        runs it under the Mosaic GPU interpreter (CPU).
    Returns:
      (new param float32 of p's shape, new mu, new nu) of mu's and nu's types.
    """
    if not kernel_eligible(p, g, mu, nu):
        raise ValueError(f"fused_step needs float32 p and g and moments in {KERNEL_FORMATS} with blocks of "
                         f"{KERNEL_BLOCK_SIZES}, a multiple of {_WARPS} blocks; got p {p.dtype}, g "
                         f"{g.dtype}, mu {type(mu).__name__} {_state_format(mu)}, nu {type(nu).__name__} "
                         f"{_state_format(nu)}")
    n_blocks, block = mu.codes.shape
    if nu.codes.shape != (n_blocks, block) or mu.shape != nu.shape or p.shape != mu.shape or g.shape != p.shape:
        raise ValueError(f"shapes differ: p {p.shape}, g {g.shape}, mu {mu.shape} {mu.codes.shape}, nu {nu.shape} "
                         f"{nu.codes.shape}")
    interpret = resolve_interpret(interpret)
    coef = jnp.stack([jnp.asarray(c, jnp.float32) for c in (bc1, bc2_sqrt, step_size)])
    p_new, m_codes, m_scale, v_codes, v_scale = _step_call(
        p.reshape(n_blocks, block), g.reshape(n_blocks, block), mu.codes, _scale(mu), nu.codes, _scale(nu), coef,
        formats=(_state_format(mu), _state_format(nu)), b1=float(b1), b2=float(b2), eps=float(eps),
        weight_decay=float(weight_decay), interpret=interpret)
    return p_new.reshape(p.shape), _with_state(mu, m_codes, m_scale), _with_state(nu, v_codes, v_scale)


def _with_state(like, codes, scale):
    return dataclasses.replace(like, codes=codes, **{_scale_field(like): scale})
