"""The fused AdamW step for e4m3 (with or without range expansion), 8-bit or 4-bit states: one Mosaic GPU kernel per
tensor reads param, gradient and moment codes and scales once and writes them in place (16 bytes per float32 param
instead of the ~28 of the optax path).

Reference: `qjax.optim.fused_adam.fused_step_reference`; the kernel calls the same formulas, from the optimizer's
numerics-level modules (`qjax.optim.adam_math`: adam_math, param_update, the e4m3 state quantizers and the inverse of
the expanded one; `qjax.optim.codebooks.quantize_blocks`). States:
  e4m3:  codes float8_e4m3fn (n, B), scale f32 (n,) = absmax / 448
  e4m3_dre: COAT's dynamic range expansion: codes float8_e4m3fn (n, B), scale f32, expand uint8 (16 k), centre
         bf16 (n,); per row k and the centre from the bit patterns of the row's largest and smallest non-zero |x|
         (two warp reductions) by integer arithmetic, powers as exp(k log |x|), per element (Mosaic GPU has no pow).
  8-bit: m on the signed, v on the unsigned dynamic map, codes uint8 (n, B), absmax f32 (n,); decoded with one
         lookup per code and encoded with `codebooks.encode_unit` (position arithmetic and one lookup) in the map's
         `codebooks.codec_table`, which each program copies to SMEM and reads per lane (`_lookup`: Mosaic GPU has no
         gather).
  4-bit: m on the signed dynamic, v on the linear 4-bit map, codes uint8 (n, B / 2), two per byte (element 2i in
         the high nibble), absmax f32 (n,): loaded and stored in `_PACKED_LAYOUT`, whose lanes hold the 2 bytes of
         their 4 columns, split into codes and joined back in registers (`_unpack`, `_pack`); coded as 8-bit.

The tensor is viewed as n blocks of B elements, an (n, B) array, cut into tiles of R = T // B rows (fewer when n
is not a multiple); one program per tile, with no shared memory but the code tables:

  GMEM -> registers (vector loads): p (R, B) f32, g (R, B) f32, m codes (R, B), m scale (R,) (and the other
                                     per-row arrays), v codes, v scale
  registers: g clipped by the global norm where asked (adam_math.scale_gradient, scalars in coef);
             m_old = decode(codes) * scale (same for v); adam_math.adam_math -> direction, m, v;
             p = adam_math.param_update(p, direction, -lr, wd); per row: amax, then
             e4m3: adam_math.quantize_e4m3_blocks (or the expanded one); code books: codes = nearest code of
             x * (1 / absmax) (absmax 1 for all-zero rows)
  registers -> GMEM (vector stores): p, m codes + scale, v codes + scale, written over the inputs (mutable refs:
                                      the kernel's outputs alias them, so a donated step updates params in place)

Register layout: one TILED layout for every (R, B) array: each of the 4 warps owns whole rows, its 32 lanes hold 4
consecutive columns each (128 columns per register sweep), so a warp's loads and stores are contiguous runs
(coalesced) and the per-row amax is a warp shuffle reduction, never cross-warp. No TMA pipeline: many small
register-only programs hide the memory latency through occupancy, faster than staging tiles through SMEM.

Bit-exactness: under the CPU interpreter the kernel's XLA ops equal the jitted reference bit for bit. Compiled on a
GPU, XLA and Mosaic GPU may contract a*b+c into FMAs differently, so values can differ by an ulp and, rarely, a code
by one or two steps (e4m3, or neighbouring 8-bit codes; see tests/optim/test_fused_kernel.py); range expansion's
exp and log may also differ by ulps if XLA and Mosaic GPU evaluate them differently, while its k and centre are
integer functions of a row's max and min |x| (equal wherever those are). A bfloat16 param's
stochastic rounding then lands on the other grid point where its random bits sit within that ulp of the carry
(~2**-16 per float32 ulp): one bf16 ulp apart, or, where p + lr * u cancels to near zero, the few float32 ulps of p.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, memref, vector

from qjax import stochastic
from qjax.formats import BF16
from qjax.kernels import NO_AUTO_BARRIERS, load_from_gmem, resolve_interpret
from qjax.optim import adam_math, codebooks
from qjax.optim.adam_math import FP8_STATE_FORMATS  # e4m3 states: no code table

_TILE_ELEMENTS = 2048  # elements per program: a tuning knob (the fastest of a sweep); results do not depend on it
_LANE_COLUMNS = 128  # a warp sweeps 32 lanes x 4 columns per register
ROW_MULTIPLE = 4  # the warps: a tensor's block count must be a multiple (no padding pass)
_MAX_BLOCK = 256  # a tile holds at least a row per warp (4 x 256 <= _TILE_ELEMENTS)

# (R, B) arrays: tiles of 4 rows x 128 columns; warps split the 4 rows, lanes the 128 columns in vectors of 4.
_LAYOUT = plgpu.Layout.TILED(plgpu.Tiling(((ROW_MULTIPLE, _LANE_COLUMNS), (4,))), warp_dims=(-3,), lane_dims=(-2,),
                             vector_dim=-1)
_ROW_LAYOUT = _LAYOUT.reduce(1)  # (R,) per-row values (scales), replicated over a warp's lanes
# (R, B / 2) packed 4-bit codes: each lane holds the 2 bytes that hold its 4 columns of `_LAYOUT` (same registers)
_PACKED_LAYOUT = plgpu.Layout.TILED(plgpu.Tiling(((ROW_MULTIPLE, _LANE_COLUMNS // 2), (2,))), warp_dims=(-3,),
                                    lane_dims=(-2,), vector_dim=-1)

# (m format, v format) pairs the kernel reads and writes: "e4m3", or a code book's map name (8-bit or 4-bit).
KERNEL_FORMATS = (("e4m3", "e4m3"), ("e4m3_dre", "e4m3_dre"), ("dynamic_signed_8bit", "dynamic_unsigned_8bit"),
                  ("dynamic_signed_4bit", "linear_unsigned_4bit"))
BLOCK_SIZES = (_LANE_COLUMNS, _MAX_BLOCK)
_TABLE_COLUMNS = 128  # code tables travel as (T / 128, 128) arrays: a TMA box is at most 256 wide


def _broadcast_rows(row: jax.Array, shape) -> jax.Array:
    return plgpu.layout_cast(lax.broadcast_in_dim(row, shape, (0,)), _LAYOUT)


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
        # a 1-D view of the (T / 128, 128) table: one index cast per lookup instead of a shift, a mask and two casts
        shape = ir.MemRefType(table.type)
        flat_type = ir.MemRefType.get([shape.shape[0] * shape.shape[1]], shape.element_type,
                                      memory_space=shape.memory_space)
        flat = memref.collapse_shape(flat_type, table, [[0, 1]])

        def load(i, _):  # i: one lane's int32 index
            return memref.load(flat, [arith.index_cast(ir.IndexType.get(), i)])

        return idx.foreach(load, create_array=True)

    return gather(table_ref, index)


def code_table(fmt: str) -> jax.Array:
    """A code book format's `codebooks.codec_table` as the kernel reads it: float32 (T / 128, 128), zero-padded to
    whole rows (a 4-bit table has 32 entries); a dummy for the e4m3 formats."""
    if fmt in FP8_STATE_FORMATS:
        return jnp.zeros((1, _TABLE_COLUMNS), jnp.float32)
    table = codebooks.codec_table(codebooks.get_map(fmt))
    return jnp.asarray(np.pad(table, (0, -table.size % _TABLE_COLUMNS)).reshape(-1, _TABLE_COLUMNS))


def _is_packed(fmt: str) -> bool:
    """Whether a format stores two 4-bit codes per byte (codes (n, B / 2)): element 2i in the high nibble."""
    return fmt not in FP8_STATE_FORMATS and codebooks.get_map(fmt).size == 16


def _map_lanes(fa, out_length: int, fn):
    """A Mosaic GPU fragmented array -> one whose registers are fn(list of each register's elements), which returns
    out_length elements: the same register array in another vector width (`_LAYOUT` <-> `_PACKED_LAYOUT`)."""
    out = np.empty_like(fa.registers)
    for index, reg in np.ndenumerate(fa.registers):
        length = ir.VectorType(reg.type).shape[0]
        elements = fn([vector.extract(reg, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i]))
                       for i in range(length)])
        out[index] = vector.from_elements(ir.VectorType.get((out_length,), elements[0].type), elements)
    return out


def _relayout(x: jax.Array, to_packed: bool, fn) -> jax.Array:
    """x (R, C) in `_PACKED_LAYOUT` -> (R, 2 C) in `_LAYOUT` (to_packed False: each lane's 2 elements become 4 by
    fn), or (R, C) in `_LAYOUT` -> (R, C / 2) in `_PACKED_LAYOUT` (4 become 2): the same registers, compiled only
    (`inline_mgpu`); x's dtype kept."""
    n_rows, cols = x.shape
    src, dst, length, out_cols = ((_LAYOUT, _PACKED_LAYOUT, 2, cols // 2) if to_packed
                                  else (_PACKED_LAYOUT, _LAYOUT, 4, 2 * cols))

    @plgpu.inline_mgpu(arg_types=(src,), return_type=plgpu.ShapeDtypeStruct((n_rows, out_cols), x.dtype, dst))
    def body(_, fa):
        return type(fa)(_registers=_map_lanes(fa, length, fn), _layout=dst.to_mgpu(), _is_signed=False)

    return body(x)


def _unpack(packed: jax.Array, interpret: bool) -> jax.Array:
    """uint8 (R, B / 2) packed codes in `_PACKED_LAYOUT` -> uint8 (R, B) codes in `_LAYOUT` (`codebooks.unpack_4bit`:
    element 2i from the high nibble). Compiled, each lane splits its 2 bytes into its 4 codes in registers."""
    if interpret:
        return codebooks.unpack_4bit(packed)

    def split(elements):
        four, fifteen = (arith.constant(elements[0].type, c) for c in (4, 15))
        return [x for b in elements for x in (arith.shrui(b, four), arith.andi(b, fifteen))]

    return _relayout(packed, False, split)


def _pack(codes: jax.Array, interpret: bool) -> jax.Array:
    """Inverse of `_unpack`: uint8 (R, B) codes < 16 in `_LAYOUT` -> uint8 (R, B / 2) in `_PACKED_LAYOUT`."""
    if interpret:
        return codebooks.pack_4bit(codes)

    def join(elements):
        four = arith.constant(elements[0].type, 4)
        return [arith.ori(arith.shli(elements[i], four), elements[i + 1]) for i in range(0, len(elements), 2)]

    return _relayout(codes, True, join)


def _dequantize_rows(codes: jax.Array, rows: tuple, fmt: str, table) -> jax.Array:
    """codes (R, B) e4m3 or uint8 and the format's per-row arrays (R,) (`adam_step_kernel`) -> f32 (R, B): the
    reference's state dequantization row by row. table: the code book format's `codebooks.codec_table` lookup
    (index -> value); unused for the e4m3 formats."""
    if fmt == "e4m3_dre":
        return adam_math.dequantize_e4m3_expanded_blocks(codes, *rows, _broadcast_rows)
    if fmt == "e4m3":
        values = codes.astype(jnp.float32)
    else:
        values = table(codes.astype(jnp.int32) + codebooks.get_map(fmt).size)  # the map's values follow its thresholds
    (scale,) = rows
    return values * _broadcast_rows(scale, codes.shape)


def _quantize_rows(x: jax.Array, fmt: str, table):
    """f32 (R, B) -> (codes (R, B), per-row arrays (R,) as in `adam_step_kernel`): the reference's state
    quantization row by row (e4m3: `adam_math.quantize_e4m3_blocks`; with range expansion
    `adam_math.quantize_e4m3_expanded_blocks`; code books: `codebooks.quantize_blocks`)."""
    if fmt == "e4m3_dre":
        codes, *rows = adam_math.quantize_e4m3_expanded_blocks(x, _broadcast_rows)
        return codes, tuple(rows)
    if fmt == "e4m3":
        codes, scale = adam_math.quantize_e4m3_blocks(x, _broadcast_rows)
        return codes, (scale,)
    codes, absmax = codebooks.quantize_blocks(x, codebooks.get_map(fmt), table, _broadcast_rows)
    return codes, (absmax,)


def _split_words(words: jax.Array, interpret: bool) -> jax.Array:
    """uint32 (R, B / 2) hash words in `_PACKED_LAYOUT` -> `stochastic.bf16_bits` (R, B) in `_LAYOUT`
    (`stochastic.split_bf16_words`: word j gives elements 2j and 2j + 1). Compiled, each lane splits its 2 words
    into the bits of its 4 columns in registers."""
    if interpret:
        return stochastic.split_bf16_words(words)

    def halves(elements):
        sixteen = arith.constant(elements[0].type, 16)
        return [x for w in elements for x in (w, arith.shrui(w, sixteen))]

    return _relayout(words, False, halves)


def _round_param(p, seed, row0, offset, runs, interpret):
    """f32 (R, B) new param -> bfloat16 by stochastic rounding with bits `stochastic.bf16_bits(seed, element index
    in the whole param)` (the tile's first row is row0 of the (n, B) param; `adam_step_kernel` says how offset and
    runs place its elements in the whole param): `sr_params.round_param`'s bits, kernel-safe ops. One hash per
    word of two elements (their index halved: offset and the strides are even), split in registers."""
    n_rows, block = p.shape
    shape = (n_rows, block // 2)
    rows = plgpu.broadcasted_iota(jnp.uint32, shape, 0, layout=_PACKED_LAYOUT) + row0
    words = plgpu.broadcasted_iota(jnp.uint32, shape, 1, layout=_PACKED_LAYOUT)
    first = words << jnp.uint32(1)  # the word's first (even) element
    if runs is None:  # one run: p2 is a contiguous part of the param
        index = rows * jnp.uint32(block) + first + offset
    else:  # runs of run_blocks rows, `stride` elements apart (a shard split along an inner dim)
        run, stride = runs
        run_blocks = jnp.uint32(run // block)
        index = (rows // run_blocks) * jnp.uint32(stride) + (rows % run_blocks) * jnp.uint32(block) + first + offset
    # halved after the uint32 sum, as the reference halves the (wrapping) element index
    bits = _split_words(stochastic.hash_uint32(seed, index >> jnp.uint32(1)), interpret)
    return stochastic.stochastic_codes(p, BF16, bits, may_be_inf=True)


def _tile_step(coef_ref, seed_ref, m_table_ref, v_table_ref, p_ref, g_ref, m_refs, v_refs, *, row0, formats, b1, b2,
               eps, weight_decay, runs, interpret):
    """One tile in GMEM, updated in place: the fused step of `fused_step_reference` on (R, B) arrays.
    m_refs, v_refs: each moment's codes (R, B) (or (R, B / 2) packed) and per-row arrays (R,) (`adam_step_kernel`).
    m_table_ref, v_table_ref: the code book formats' `codebooks.codec_table` (unused for e4m3). A bfloat16 param is
    read as float32 and written back with stochastic rounding (seed_ref: seed and element offset, runs as in
    `adam_step_kernel`; the tile's first row row0)."""
    m_format, v_format = formats
    m_table = functools.partial(_lookup, m_table_ref, interpret=interpret)
    v_table = functools.partial(_lookup, v_table_ref, interpret=interpret)

    def load_state(refs, fmt, table):
        codes_ref, *row_refs = refs
        codes = (_unpack(load_from_gmem(codes_ref, _PACKED_LAYOUT), interpret) if _is_packed(fmt)
                 else load_from_gmem(codes_ref, _LAYOUT))
        return _dequantize_rows(codes, tuple(load_from_gmem(ref, _ROW_LAYOUT) for ref in row_refs), fmt, table)

    def store_state(x, refs, fmt, table):
        codes_ref, *row_refs = refs
        codes, rows = _quantize_rows(x, fmt, table)
        codes_ref[...] = _pack(codes, interpret) if _is_packed(fmt) else codes
        for ref, row in zip(row_refs, rows, strict=True):
            ref[...] = row

    p = load_from_gmem(p_ref, _LAYOUT).astype(jnp.float32)
    g = load_from_gmem(g_ref, _LAYOUT).astype(jnp.float32)
    if coef_ref.shape[0] > 3:  # clipped by the global norm as it is read (divisor and multiplier 1: kept as is)
        divisor = coef_ref[3]
        if interpret:  # XLA:CPU would divide by a broadcast scalar as a multiply by its reciprocal (other bits)
            divisor = lax.optimization_barrier(jnp.full(g.shape, divisor))
        # compiled, casts round (Mosaic GPU keeps them); the interpreter's XLA might drop a pair of casts
        rounded = adam_math.round_to if interpret else lambda x, dtype: x.astype(dtype).astype(jnp.float32)
        g = adam_math.scale_gradient(g, divisor, coef_ref[4], g_ref.dtype, rounded)
    bc1, bc2_sqrt, step_size = coef_ref[0], coef_ref[1], coef_ref[2]
    m_old = load_state(m_refs, m_format, m_table)
    v_old = load_state(v_refs, v_format, v_table)
    direction, m, v = adam_math.adam_math(g, m_old, v_old, b1, b2, eps, bc1, bc2_sqrt)
    new_p = adam_math.param_update(p, direction, step_size, weight_decay)
    p_ref[...] = (new_p if p_ref.dtype == jnp.float32
                  else _round_param(new_p, seed_ref[0], row0, seed_ref[1], runs, interpret))
    store_state(m, m_refs, m_format, m_table)
    store_state(v, v_refs, v_format, v_table)


def _tile_rows(n_rows: int, block_size: int) -> int:
    rows = _TILE_ELEMENTS // block_size
    while n_rows % rows:  # n_rows is a multiple of 4 and rows a power of two >= 4
        rows //= 2
    return rows


@functools.partial(jax.jit, static_argnames=("formats", "b1", "b2", "eps", "weight_decay", "runs", "interpret"))
def _step_call(p2, g2, m_state, v_state, coef, seed, *, formats, b1, b2, eps, weight_decay, runs, interpret):
    n_rows, block = p2.shape
    rows = _tile_rows(n_rows, block)
    inputs = (p2, g2, *m_state, *v_state)
    written = (0, *range(2, len(inputs)))  # all but the gradient: updated in place
    n_m = len(m_state)

    code_tables = formats[0] not in FP8_STATE_FORMATS

    def body(coef_ref, seed_ref, m_table_ref, v_table_ref, *refs):
        if code_tables:  # each program copies the two 2 KB tables to SMEM (lookups: ld.shared)
            *refs, m_table_smem, v_table_smem, barrier = refs
            plgpu.copy_gmem_to_smem(m_table_ref, m_table_smem, barrier.at[0])
            plgpu.copy_gmem_to_smem(v_table_ref, v_table_smem, barrier.at[1])
            plgpu.barrier_wait(barrier.at[0])
            plgpu.barrier_wait(barrier.at[1])
            m_table_ref, v_table_ref = m_table_smem, v_table_smem
        row0 = lax.axis_index("program") * rows
        p_ref, g_ref, *state_refs = (ref.at[pl.ds(row0, rows)] for ref in refs)
        _tile_step(coef_ref, seed_ref, m_table_ref, v_table_ref, p_ref, g_ref, state_refs[:n_m], state_refs[n_m:],
                   row0=row0.astype(jnp.uint32), formats=formats, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                   runs=runs, interpret=interpret is not None)

    # The param and state arrays go in as mutable refs, updated in place (the kernel's aliased outputs): with the
    # step's params and state donated, XLA then writes them where they are instead of copying each kernel output
    # into the donated buffer (12 more bytes moved per param).
    refs = [jax.new_ref(a) if i in written else a for i, a in enumerate(inputs)]
    tables = [code_table(f) for f in formats]
    scratch = ()
    if code_tables:
        scratch = (*(plgpu.SMEM(t.shape, jnp.float32) for t in tables), plgpu.Barrier(num_barriers=2))
    # Each warp reads and writes only its own rows (a row's scale: its lanes read it first and store it after the
    # row's amax shuffles), and SMEM holds the read-only tables: no automatic barriers (12 bar.sync a program).
    plgpu.kernel(body, out_type=(), grid=(n_rows // rows,), grid_names=("program",), scratch_types=scratch,
                 compiler_params=NO_AUTO_BARRIERS, interpret=interpret)(coef, seed, *tables, *refs)
    return tuple(jax.freeze(refs[i]) for i in written)


def adam_step_kernel(p2, g2, m_state, v_state, coef, *, formats, b1, b2, eps, weight_decay, seed=None, offset=0,
                     runs=None, interpret=None):
    """One tensor's AdamW step on (n, B) blocks, n % ROW_MULTIPLE == 0, B in BLOCK_SIZES (module docstring).

    Args:
      p2, g2: float32 (n, B) param and gradient, or both bfloat16: the new param is then rounded stochastically
        with `seed` (uint32 scalar; bits `stochastic.bf16_bits(seed, element index in the whole param)`, as
        `sr_params.round_param` draws them). offset: uint32 scalar, the index of p2's first element in the whole
        param (e.g. one device's shard), even (bits come in words of two elements). runs: None when p2's elements
        are consecutive in the whole param (index = offset + row-major index), or static ints (run, stride) when
        they come in runs of `run` consecutive elements (a multiple of B) whose starts lie `stride` apart (a shard
        split along an inner dim: run j's element e has index offset + j * stride + e;
        `fused_adam.fused_step_reference` with the same runs).
      m_state, v_state: each moment as a tuple (codes, *per-block arrays) in the formats `formats`, a pair from
        KERNEL_FORMATS: codes (n, B) float8_e4m3fn or uint8 (4-bit: (n, B / 2), packed), then the per-block (n,)
        arrays: code books absmax f32; e4m3 scale f32; e4m3_dre scale f32, expand uint8 (16 k), centre bfloat16.
      coef: float32 (3,): 1 - b1**t, sqrt(1 - b2**t), -learning_rate; or (5,), the gradient then clipped by its
        global norm: `adam_math.scale_gradient`'s divisor and multiplier after them (1 and 1 where not clipped).
      b1, b2, eps, weight_decay: Python floats (weight_decay 0: none, as optax).
      interpret: None / False compiled (a Hopper GPU); True or a `plgpu.InterpretGPUParams`: the interpreter.
    Returns:
      (p2, m_state, v_state), new, with the inputs' shapes and dtypes.
    """
    if p2.dtype != g2.dtype or p2.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"adam_step_kernel needs float32 or bfloat16 param and gradient of one dtype, got p "
                         f"{p2.dtype}, g {g2.dtype}")
    if p2.dtype == jnp.bfloat16 and seed is None:
        raise ValueError("a bfloat16 param is rounded stochastically: pass seed= (a uint32 scalar)")
    if runs is not None and (runs[0] % p2.shape[1] or p2.size % runs[0] or runs[1] < runs[0] or runs[1] % 2):
        raise ValueError(f"runs (run, stride) = {runs} must cut p2's {p2.size} elements into runs of whole blocks "
                         f"of {p2.shape[1]}, an even number of elements at least run apart")
    try:
        odd_offset = int(np.asarray(offset)) % 2
    except jax.errors.JAXTypeError:  # traced: the callers' offsets are whole blocks
        odd_offset = 0
    if odd_offset:
        raise ValueError(f"offset {int(np.asarray(offset))} must be even: the stochastic rounding's bits come in "
                         "words of two elements (stochastic.bf16_bits); start p2 at an even element of the param")
    seed = jnp.stack([jnp.asarray(0 if seed is None else seed, jnp.uint32).reshape(()),
                      jnp.asarray(offset, jnp.uint32).reshape(())])
    p2, *state = _step_call(p2, g2, tuple(m_state), tuple(v_state), coef, seed, formats=formats, b1=b1, b2=b2,
                            eps=eps, weight_decay=weight_decay, runs=None if runs is None else tuple(map(int, runs)),
                            interpret=resolve_interpret(interpret))
    return p2, tuple(state[:len(m_state)]), tuple(state[len(m_state):])
