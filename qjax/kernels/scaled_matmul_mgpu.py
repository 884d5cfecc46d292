"""Scaled 8-bit GEMM as one Pallas Mosaic GPU kernel for Hopper: out (M, N) = a (M, K) . b (N, K)^T with scales.

Both operands are `QTensor`s laid out K-major (the TN form every `qjax.dot_general` GEMM is brought to). Codes are
int8 (wgmma s8 x s8 -> s32) or float8 e4m3 / e5m2 (wgmma -> f32; e4m3 x e5m2 mixes are accepted by this Mosaic GPU
version). Two scale modes, chosen from the granularities:

  "row"   a scale () or (M, 1), b scale () or (N, 1). One accumulator over all of K, then in the epilogue
          out = ((acc_f32 * a_scale[row]) * b_scale[col]).astype(out_dtype): the reference's multiplication order,
          so int8 results equal `scaled_matmul` bit for bit (int32 sums are exact in both).
  "block" a or b scaled per 128 of K ("1x128": (R, K/128), "128x128": (R/128, K/128); a row/tensor scale on the
          other operand is treated as constant over K). For every 128 of K the wgmma partial sum (int32 or f32) is
          converted to f32, multiplied by a_scale[row, kb] * b_scale[col, kb] and added into an f32 accumulator
          held in registers (DeepSeek-V3's fine-grained promotion); int8 partial sums are exact per block.

"row" with `precise_accumulation` (fp8; Hopper's fp8 wgmma accumulates with reduced precision) or with int8 and
K > 133,143 (an int32 sum could overflow) promotes every 128 of K the same way, without per-block scales.

Tilings (`TuningConfig`, the defaults, and their shared-memory and register checks) are in `gemm_config_mgpu`.

Kernel structure (per CTA, persistent over output tiles, `emit_pipeline_warp_specialized`):
  memory warpgroup:   TMA a (2*tile_m, tile_k) and b (tile_n, tile_k) into 128B-swizzled SMEM, plus (block mode) the
                      step's per-K-block scales (tile_k/128, 2*tile_m) and (tile_k/128, tile_n),
                      `max_concurrent_steps` stages deep.
  2 compute warpgroups: each owns tile_m rows x tile_n columns; wgmma with B passed as the transpose of its (N, K)
                      SMEM tile (8-bit wgmma operands must be K-major). Promoting modes issue one wgmma group per
                      128-K block of the step into its own accumulator, then promote them in order, each while the
                      later ones still run.
  epilogue:           scales in the WGMMA accumulator's row/column register layouts (`Layout.WGMMA.reduce(1)` /
                      `.reduce(0)`), cast, stored via SMEM in (64, 128-byte) tiles and TMA.
Scales reach the kernel as f32 vectors: row mode a (M,), b (N,); block mode transposed to (K/128, M), (K/128, N) so
one K-block's scales of a tile are contiguous for TMA (the wrapper does this; ~3% of the operand bytes). int8 block
sums become f32 by one conversion instruction; a 128x128 b scale is folded into the row scales.
Optionally (cluster_m=2) two CTAs on neighbouring M tiles share each B tile through TMA multicast.

Shapes that do not tile are padded with zero codes (scale 1) and sliced; K is padded to tile_k (zero codes add
nothing; block mode needs K % 128 == 0, and its default config takes one block per step where K % 256 != 0). Only
2-D operands (`qjax.dispatch` sends batched ones to the reference).

Checked off the GPU: the Mosaic GPU interpreter (`interpret=True`) runs this code with wgmma executed synchronously
by numpy and checks barriers (its race detector also flags jax's own warp-specialized pipeline when the compute
threads read pipeline buffers with plain loads: a false positive, so it is not used in the tests); lowering for
"cuda" on any machine runs the Pallas -> Mosaic GPU lowering (register layouts, wgmma operand rules, SMEM budget).
Not checked off the GPU: ptxas (register allocation, spills), async wgmma/TMA timing, speed.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from qjax.kernels import persistent_ctas
from qjax.kernels.gemm_config_mgpu import (BLOCK_K, COMPUTE_WGS, EPI_ROW_BYTES, EPI_TILE_M, FP8, TuningConfig,
                                           check_config, default_config, epilogue_slot_count, kernel_mode)
from qjax.qtensor import BLOCK_SHAPES, GRANULARITIES, QTensor

_CODE_DTYPES = (jnp.dtype(jnp.int8), *FP8)
_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static description of one kernel launch (hashable: a jit static argument)."""

    mode: str  # "row" | "block" | "promote" (row scales, promotion every tile_k)
    m: int  # padded sizes
    n: int
    k: int
    out_dtype: jnp.dtype
    config: TuningConfig
    num_ctas: int
    # Block mode: one b scale per (tile, K block): b "128x128" or "tensor" and 128 % tile_n == 0.
    b_scale_per_tile: bool = False


def supports(a, b, out_dtype) -> str | None:
    """None if `scaled_matmul_kernel(a, b, out_dtype)` handles these operands, else why not (one sentence)."""
    if not isinstance(a, QTensor) or not isinstance(b, QTensor):
        return f"operands must be QTensors, got {type(a).__name__} and {type(b).__name__}"
    if a.data.ndim != 2 or b.data.ndim != 2:
        return f"only 2-D operands (M, K) x (N, K), got shapes {a.data.shape} and {b.data.shape}"
    (m, k), (n, k2) = a.data.shape, b.data.shape
    if k != k2:
        return f"contracting dims differ: a is (M, K) = {a.data.shape}, b is (N, K) = {b.data.shape}"
    if min(m, n, k) == 0:
        return f"empty operands {a.data.shape} x {b.data.shape}"
    da, db = jnp.dtype(a.data.dtype), jnp.dtype(b.data.dtype)
    if da not in _CODE_DTYPES or db not in _CODE_DTYPES:
        return f"codes must be int8, float8_e4m3fn or float8_e5m2, got {da} and {db}"
    if (da == jnp.int8) != (db == jnp.int8):
        return f"int8 codes cannot be mixed with fp8 codes in one wgmma, got {da} x {db}"
    if jnp.dtype(out_dtype) not in _OUT_DTYPES:
        return f"out_dtype must be bfloat16 or float32, got {jnp.dtype(out_dtype)}"
    for name, q in (("a", a), ("b", b)):
        if q.granularity not in GRANULARITIES:
            return f"{name}: unknown granularity {q.granularity!r}"
        if q.granularity == "1x32":
            return f"{name}: MX (1x32) blocks have no Hopper GEMM; the reference runs them as an exact bf16 GEMM"
        if jnp.dtype(q.scale.dtype) != jnp.float32:
            return f"{name}: scales must be float32, got {q.scale.dtype}"
        rows = q.data.shape[0]
        expected = {"tensor": (), "row": (rows, 1), "1x128": (rows, k // BLOCK_K),
                    "128x128": (rows // 128, k // BLOCK_K)}[q.granularity]
        if q.granularity in BLOCK_SHAPES and (k % BLOCK_K or (q.granularity == "128x128" and rows % 128)):
            return (f"{name}: {q.granularity!r} scales need K % 128 == 0 (and rows % 128 == 0 for 128x128), got "
                    f"shape {q.data.shape}")
        if tuple(q.scale.shape) != expected:
            return f"{name}: {q.granularity!r} scale must have shape {expected}, got {tuple(q.scale.shape)}"
    return None


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _pad2(x, rows, cols, value):
    pad = ((0, rows - x.shape[0]), (0, cols - x.shape[1]))
    return jnp.pad(x, pad, constant_values=value) if any(p[1] for p in pad) else x


def _row_vector(q: QTensor, rows: int, padded: int) -> jax.Array:
    """Row/tensor scale -> f32 (padded,), padding scale 1."""
    vec = jnp.broadcast_to(q.scale.reshape(-1), (rows,)) if q.granularity == "tensor" else q.scale.reshape(rows)
    return jnp.pad(vec, (0, padded - rows), constant_values=1) if padded > rows else vec


def _block_scales(q: QTensor, k_blocks: int, padded_blocks: int, padded_rows: int) -> jax.Array:
    """Any scale -> f32 (padded_blocks, padded_rows): the scale of each row in each 128-wide K block, padding 1."""
    rows = q.data.shape[0]
    if not q.is_block_scaled:  # constant along K
        per_row = jnp.broadcast_to(q.scale, (rows, k_blocks))
    elif q.granularity == "1x128":
        per_row = q.scale
    else:  # 128x128: every row of a 128-row block shares its scales
        per_row = jnp.repeat(q.scale, 128, axis=0)
    return _pad2(per_row.T, padded_blocks, padded_rows, 1)


def _kernel(plan: _Plan, *refs):
    """Kernel body: refs = (a, b, scale_a, scale_b, out, *scratch) with shapes per `plan.mode` (module docstring)."""
    cfg = plan.config
    a_gmem, b_gmem, sa_gmem, sb_gmem, out_gmem = refs
    tile_m, tile_n, tile_k = cfg.tile_m, cfg.tile_n, cfg.tile_k
    cta_m = COMPUTE_WGS * tile_m
    cluster_m = cfg.cluster_m
    # m_iters counts clusters of `cluster_m` CTAs along M; the CTAs of a cluster share the B tile.
    m_iters, n_iters, k_iters = plan.m // (cluster_m * cta_m), plan.n // tile_n, plan.k // tile_k
    b_collective = ("cluster",) if cluster_m > 1 else ()
    block_mode = plan.mode == "block"
    promote = plan.mode != "row"
    blocks_per_step = tile_k // BLOCK_K if promote else 1
    epilogue_slots = epilogue_slot_count(cfg, plan.mode)
    code_bytes = 1
    swizzle = plgpu.find_swizzle(tile_k * code_bytes * 8)
    code_transforms = (plgpu.TilingTransform((8, swizzle // code_bytes)), plgpu.SwizzleTransform(swizzle))
    out_dtype = plan.out_dtype
    epi_n = EPI_ROW_BYTES // out_dtype.itemsize
    out_transforms = (plgpu.TilingTransform((8, epi_n)), plgpu.SwizzleTransform(EPI_ROW_BYTES))
    acc_dtype = jnp.int32 if a_gmem.dtype == jnp.int8 else jnp.float32
    # Every step waits for its wgmma before releasing the SMEM stage (the two compute warpgroups keep the tensor cores
    # busy in turn). Keeping one wgmma in flight (BlockSpec delay_release=1) would race in this persistent loop: the
    # pipeline never releases the last step's stage, so the next tile's prologue TMA can overwrite it while that
    # wgmma still reads it.
    row_layout = plgpu.Layout.WGMMA.reduce(1)  # (tile_m,): the rows of the WGMMA accumulator a thread holds
    col_layout = plgpu.Layout.WGMMA.reduce(0)  # (tile_n,): its columns

    in_specs = [
        plgpu.BlockSpec((cta_m, tile_k), lambda k: (0, k), transforms=code_transforms),
        plgpu.BlockSpec((tile_n, tile_k), lambda k: (0, k), transforms=code_transforms, collective_axes=b_collective),
    ]
    if block_mode:  # a step's K blocks' scales: rows of the transposed (K/128, rows) scale arrays
        in_specs += [plgpu.BlockSpec((blocks_per_step, cta_m), lambda k: (k, 0)),
                     plgpu.BlockSpec((blocks_per_step, tile_n), lambda k: (k, 0))]

    def make_pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_iters,), memory_registers=40, in_specs=in_specs, wg_axis="wg",
            num_compute_wgs=COMPUTE_WGS, max_concurrent_steps=cfg.max_concurrent_steps,
            compute_context=compute_context)

    def pipeline_gmem_refs(m_idx, n_idx):
        rows, cols = pl.ds(m_idx * cta_m, cta_m), pl.ds(n_idx * tile_n, tile_n)
        refs_ = [a_gmem.at[rows, :], b_gmem.at[cols, :]]
        if block_mode:
            refs_ += [sa_gmem.at[:, rows], sb_gmem.at[:, cols]]
        return refs_

    ignore = lambda *_, **__: None
    scratch = dict(
        pipeline_allocs=make_pipeline(ignore, ignore).get_allocations(*pipeline_gmem_refs(0, 0)),
        out_smem=plgpu.SMEM((COMPUTE_WGS, epilogue_slots, EPI_TILE_M, epi_n), out_dtype,
                            transforms=out_transforms),
    )
    if not block_mode:  # each compute warpgroup's row and column scales for the epilogue
        scratch.update(rs_smem=plgpu.SMEM((COMPUTE_WGS, tile_m), jnp.float32),
                       cs_smem=plgpu.SMEM((COMPUTE_WGS, tile_n), jnp.float32),
                       scale_barriers=plgpu.Barrier(num_barriers=2 * COMPUTE_WGS))

    def scoped(pipeline_allocs, out_smem, rs_smem=None, cs_smem=None, scale_barriers=None):
        wg = lax.axis_index("wg")
        wg_rows = pl.ds(wg * tile_m, tile_m)

        @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
        def _tile_loop(loop_info):
            (lin,) = loop_info.index
            m_idx, n_idx = plgpu.planar_snake(lin, (m_iters, n_iters), cfg.grid_minor_dim, cfg.grid_tile_width)
            if cluster_m > 1:
                m_idx = m_idx * cluster_m + lax.axis_index("cluster")
            out_rows = pl.ds(m_idx * cta_m + wg * tile_m, tile_m)
            out_cols = pl.ds(n_idx * tile_n, tile_n)

            def epilogue(acc_f32):
                """(tile_m, tile_n) f32 WGMMA-layout sum -> scaled, cast, stored to out via SMEM + TMA."""
                if not block_mode:
                    plgpu.barrier_wait(scale_barriers.at[2 * wg])
                    plgpu.barrier_wait(scale_barriers.at[2 * wg + 1])
                    row_scale = plgpu.load(rs_smem.at[wg], layout=row_layout)
                    col_scale = plgpu.load(cs_smem.at[wg], layout=col_layout)
                    # (acc * a_scale) * b_scale: the reference's order (two roundings, no FMA contraction possible)
                    acc_f32 = acc_f32 * lax.broadcast_in_dim(row_scale, acc_f32.shape, [0])
                    acc_f32 = acc_f32 * lax.broadcast_in_dim(col_scale, acc_f32.shape, [1])
                out = acc_f32.astype(out_dtype)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's stores have left SMEM
                for i in range(tile_m // EPI_TILE_M):
                    for j in range(tile_n // epi_n):
                        slot = (i * (tile_n // epi_n) + j) % epilogue_slots
                        rows = slice(i * EPI_TILE_M, (i + 1) * EPI_TILE_M)
                        cols = slice(j * epi_n, (j + 1) * epi_n)
                        # this slot's previous store has been read
                        plgpu.wait_smem_to_gmem(epilogue_slots - 1, wait_read_only=True)
                        out_smem[wg, slot] = out[rows, cols]
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], out_gmem.at[out_rows, out_cols].at[rows, cols])

            def compute_context(run_pipeline):
                if not block_mode:  # fetch the epilogue's scales while the main loop runs
                    plgpu.copy_gmem_to_smem(sa_gmem.at[out_rows], rs_smem.at[wg], scale_barriers.at[2 * wg])
                    plgpu.copy_gmem_to_smem(sb_gmem.at[out_cols], cs_smem.at[wg], scale_barriers.at[2 * wg + 1])
                if promote:
                    zeros = plgpu.layout_cast(jnp.zeros((tile_m, tile_n), jnp.float32), plgpu.Layout.WGMMA)
                    epilogue(run_pipeline(zeros))
                else:
                    def with_acc(acc_ref):
                        run_pipeline(acc_ref)
                        epilogue(acc_ref[...].astype(jnp.float32))  # acc_ref[...] waits for all wgmma
                    pl.run_scoped(with_acc, plgpu.ACC((tile_m, tile_n), acc_dtype))

            def accumulate_body(_, a_smem, b_smem, acc_ref):
                plgpu.wgmma(acc_ref, a_smem.at[wg_rows], b_smem.transpose((1, 0)))
                plgpu.wgmma_wait(0)
                return acc_ref

            def load_scales(scale_smem, block):
                """One 128-K block's scales in registers: () without block scales; (row,) with a per-tile b scale
                folded in; else (row, col)."""
                if not block_mode:
                    return ()
                sa_smem, sb_smem = scale_smem
                row_scale = plgpu.load(sa_smem.at[block, wg_rows], layout=row_layout)
                if plan.b_scale_per_tile:  # one b scale for the whole tile: fold it into the row scales
                    return (row_scale * sb_smem[block, 0],)
                return row_scale, plgpu.load(sb_smem.at[block], layout=col_layout)

            def promote_values(acc, part, scales):
                """acc + the scaled f32 partial sum of one 128-K block."""
                # exact: one 128-K block of int8 products sums to at most 128**3 = 2**21 in magnitude. One I2F
                # (cvt) per element: fewer instructions than the magic-number form, and the promotion is
                # instruction-bound
                part = part.astype(jnp.float32) if acc_dtype == jnp.int32 else part
                if not scales:
                    return acc + part
                scale = lax.broadcast_in_dim(scales[0], part.shape, [0])
                if len(scales) == 2:
                    scale = scale * lax.broadcast_in_dim(scales[1], part.shape, [1])
                return acc + part * scale

            def promote_body(_, a_smem, b_smem, *rest):
                *scale_smem, acc = rest

                def block_products(*part_refs):
                    for i, part_ref in enumerate(part_refs):  # one wgmma group per 128-K block
                        k_block = pl.ds(i * BLOCK_K, BLOCK_K)
                        plgpu.wgmma(part_ref, a_smem.at[wg_rows, k_block], b_smem.at[:, k_block].transpose((1, 0)))
                    out = acc
                    for i, part_ref in enumerate(part_refs):
                        # waits until block i's wgmma is done; the later blocks' keep running meanwhile
                        part = plgpu.wgmma_accumulator_load(part_ref, wait_n=blocks_per_step - 1 - i)
                        out = promote_values(out, part, load_scales(scale_smem, i))
                    return out

                return pl.run_scoped(block_products,
                                     *[plgpu.ACC((tile_m, tile_n), acc_dtype) for _ in range(blocks_per_step)])

            body = promote_body if promote else accumulate_body
            make_pipeline(body, compute_context)(*pipeline_gmem_refs(m_idx, n_idx), allocations=pipeline_allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pl.run_scoped(scoped, **scratch, collective_axes="wg")


@functools.partial(jax.jit, static_argnames=("plan", "interpret"))
def _launch(a_codes, b_codes, a_scale, b_scale, *, plan: _Plan, interpret):
    cluster_m = plan.config.cluster_m
    kernel = plgpu.kernel(
        functools.partial(_kernel, plan),
        out_type=jax.ShapeDtypeStruct((plan.m, plan.n), plan.out_dtype),
        grid=(plan.num_ctas // cluster_m,), grid_names=("sm",), cluster=(cluster_m,), cluster_names=("cluster",),
        num_threads=COMPUTE_WGS + 1, thread_name="wg", interpret=interpret)
    return kernel(a_codes, b_codes, a_scale, b_scale)


def scaled_matmul_kernel(a: QTensor, b: QTensor, out_dtype, *, precise_accumulation: bool = False,
                         config: TuningConfig | None = None, interpret=False) -> jax.Array:
    """(M, K) x (N, K) quantized operands -> (M, N) of out_dtype on a Hopper GPU (see module docstring).

    Same semantics as `qjax.kernels.scaled_matmul.scaled_matmul` (its reference) for 2-D operands.

    Args:
      a: QTensor, data (M, K) int8 / float8_e4m3fn / float8_e5m2, scale per its granularity (qjax.qtensor).
      b: QTensor, data (N, K) (K-major: the contracting dim last), same code family as a (fp8 may mix e4m3/e5m2).
      out_dtype: jnp.bfloat16 or jnp.float32.
      precise_accumulation: fp8 row/tensor scales only: promote the f32 sum every 128 of K (Hopper's fp8 wgmma
        accumulates with reduced precision). Block scales always promote; int8 sums are exact.
      config: `gemm_config_mgpu.TuningConfig`; None picks `gemm_config_mgpu.default_config`.
      interpret: False compiles for the GPU; True or a `plgpu.InterpretGPUParams` runs the Mosaic GPU interpreter.

    Returns:
      (M, N) array of out_dtype.

    Raises:
      TypeError / ValueError: operands the kernel does not handle (the message says why; see `supports`).
    """
    reason = supports(a, b, out_dtype)
    if reason is not None:
        type_problem = reason.startswith(("operands must", "codes must", "out_dtype", "int8 codes"))
        raise (TypeError if type_problem else ValueError)(f"scaled_matmul_kernel: {reason}")
    out_dtype = jnp.dtype(out_dtype)
    mode = kernel_mode(a, b, precise_accumulation)
    config = default_config(a, b, precise_accumulation) if config is None else config
    check_config(config, mode)
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()

    (m, k), n = a.data.shape, b.data.shape[0]
    cta_m = COMPUTE_WGS * config.tile_m
    mp, np_, kp = _round_up(m, cta_m * config.cluster_m), _round_up(n, config.tile_n), _round_up(k, config.tile_k)
    a_codes, b_codes = _pad2(a.data, mp, kp, 0), _pad2(b.data, np_, kp, 0)
    if mode == "block":
        a_scale = _block_scales(a, k // BLOCK_K, kp // BLOCK_K, mp)
        b_scale = _block_scales(b, k // BLOCK_K, kp // BLOCK_K, np_)
    else:
        a_scale, b_scale = _row_vector(a, m, mp), _row_vector(b, n, np_)
    tiles = (mp // cta_m) * (np_ // config.tile_n)
    num_ctas = persistent_ctas(config.num_ctas, interpret)
    num_ctas -= num_ctas % config.cluster_m
    if num_ctas < config.cluster_m:
        raise ValueError(f"num_ctas={config.num_ctas} is smaller than the cluster ({config.cluster_m} CTAs)")
    per_tile = mode == "block" and b.granularity in ("tensor", "128x128") and 128 % config.tile_n == 0
    plan = _Plan(mode, mp, np_, kp, out_dtype, config, min(num_ctas, tiles), per_tile)
    out = _launch(a_codes, b_codes, a_scale.astype(jnp.float32), b_scale.astype(jnp.float32), plan=plan,
                  interpret=interpret)
    return out[:m, :n] if (mp, np_) != (m, n) else out
