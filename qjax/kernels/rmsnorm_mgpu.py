"""RMSNorm fused with the data-flow recipes' 8-bit save of its input: a Pallas Mosaic GPU kernel, one read of x
(`qjax.models.ops.rms_norm_prologue`'s `forward_saving`).

Under `int8_dataflow` / `fp8_dataflow` a norm + linear layer saves its input x (the residual stream) in 8 bits, one
float32 scale per group of g consecutive features (`qjax.prologue.save`: int8 g = 32, e4m3 g = 16). The reference
composes XLA passes: the norm, then an amax pass and a codes pass over x. Here:

  forward_saving   x (M, D) -> y = rms_norm(x) * scale (M, D) in the compute dtype, codes (M, D/g, g) and
                   scales (M, D/g, 1) of x: reads x once, writes y, codes and scales

The backward has no kernel: `qjax.prologue.prologue_dot` restores x from the codes and runs the norm's backward in
XLA, whose fusion of the two is faster than a kernel.

The kernel calls the reference's own formulas: `numerics.rms_norm` (with per-row means and broadcasts in the
kernel's register layout) and `numerics.quantize_groups` (the quantizer's amax, scale and cast, as the fused
SwiGLU kernel's copy), so codes and scales equal `prologue.save`'s bit for bit; y equals the reference
to float32 rounding (the row sums are taken in another order).

Layout: x is viewed as (M, D/g, g) (a free reshape), so a group is the last axis and the group amax a reduction
along it. A program's 4 warps own 4 rows (one each, no cross-warp traffic); a warp's 32 lanes cover 32 v
consecutive features of its row per register, v per lane (v = 8 for bf16 / f16 activations, 4 for f32: 16-byte
vectors, contiguous and coalesced), so a group of g features spans g/v lanes and its amax is a shuffle over them,
and the row's sum of squares a shuffle over all 32 after summing the lane's registers. Mosaic GPU reduces one axis
at a time, so row means are taken group by group, then over the groups. Activations go GMEM -> registers -> GMEM
(vector loads and stores, as `adam_step_mgpu`; no TMA staging); a row of D features is D/32 elements per thread and
array, so D is capped at MAX_FEATURES (longer rows would spill registers; `supports`).

Each program takes ROWS_PER_PROGRAM rows (fewer where M is not a multiple), 4 at a time, and stages the norm scale
in shared memory once.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from qjax import formats, numerics
from qjax.kernels import NO_AUTO_BARRIERS, load_from_gmem, resolve_interpret
from qjax.qtensor import QTensor, QuantSpec

WARPS = 4  # rows per block: one per warp of the program's warpgroup
MAX_FEATURES = 4096  # D/32 elements per thread and array: longer rows would spill registers
GROUPS = (16, 32)  # saved groups the kernel takes: the data-flow recipes' (fp8: 16, int8: 32)
FORMATS = ("int8", "e4m3")
ROWS_PER_PROGRAM = 32  # rows per program (fewer where M is not a multiple)
_INPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _vector(dtype) -> int:
    """Elements per lane and register: 16 bytes of the activation's dtype (8 bf16 / f16, 4 f32)."""
    return min(8, 16 // jnp.dtype(dtype).itemsize)


def _layout(group: int, vector: int):
    """(rows, D/g, g) arrays: tiles of 4 rows x 32 vector/g groups x g; warps split the rows, lanes the groups and
    their features in vectors (lanes 0..g/vector-1 hold a group, the next g/vector the next group...)."""
    return plgpu.Layout.TILED(plgpu.Tiling(((WARPS, 32 * vector // group, group), (vector,))), warp_dims=(-4,),
                              lane_dims=(-3, -2), vector_dim=-1)


def supports(x, scale, spec: QuantSpec, group: int) -> str | None:
    """None if the kernel can run the norm of x (..., D) with scale (D,), saving x per `spec` in groups of `group`,
    else the reason it cannot."""
    if not isinstance(spec, QuantSpec):
        return f"spec must be a qjax.QuantSpec, got {type(spec).__name__}"
    if spec.dtype not in FORMATS or spec.granularity != "row" or spec.stochastic or spec.pow2_scale:
        return f"the RMSNorm kernel saves {FORMATS} per group with amax scales and nearest rounding, got {spec}"
    if group not in GROUPS:
        return f"the RMSNorm kernel saves groups of {GROUPS} features, got {group}"
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None or len(shape) < 1 or jnp.dtype(dtype) not in _INPUT_DTYPES:
        return f"the RMSNorm kernel takes float32, bfloat16 or float16 x (..., D), got {dtype} {shape}"
    d, m = shape[-1], int(np.prod(shape[:-1]))
    lane_features = 32 * _vector(dtype)  # the stream the kernel loads
    if d % lane_features or not 0 < d <= MAX_FEATURES:
        return (f"the RMSNorm kernel needs D a multiple of {lane_features} up to {MAX_FEATURES} (a row per warp in "
                f"registers), got x of shape {shape}")
    if m == 0 or m % WARPS:
        return f"the RMSNorm kernel needs a multiple of {WARPS} rows (one per warp), got x of shape {shape}"
    if getattr(scale, "shape", None) != (d,) or not jnp.issubdtype(scale.dtype, jnp.floating):
        return f"the RMSNorm kernel needs a float scale of shape ({d},), got {getattr(scale, 'shape', None)}"
    return None


class _RowLayout:
    """Per-row means and broadcasts of (4, D/g, g) f32 arrays in `_layout(group, vector)`, for the shared
    formulas."""

    def __init__(self, group: int, vector: int):
        self.layout = _layout(group, vector)

    def mean_rows(self, values):
        # one axis at a time (Mosaic GPU's reductions): the group sums, then their sum over the row
        return jnp.sum(jnp.sum(values, axis=2), axis=1) / jnp.float32(values.shape[1] * values.shape[2])

    def broadcast_rows(self, values, shape):
        return plgpu.layout_cast(lax.broadcast_in_dim(values, shape, (0,)), self.layout)

    def broadcast_groups(self, values, shape):
        """(4, D/g) per-group values -> (4, D/g, g)."""
        return plgpu.layout_cast(lax.broadcast_in_dim(values, shape, (0, 1)), self.layout)

    def broadcast_features(self, values, shape):
        """(D/g, g) per-feature values (the norm scale) -> (4, D/g, g)."""
        return plgpu.layout_cast(lax.broadcast_in_dim(values, shape, (1, 2)), self.layout)


def _rows_per_program(m: int, rows: int) -> int:
    """The largest multiple of WARPS that divides m and is at most `rows` (m is a multiple of WARPS)."""
    rows = max(WARPS, rows - rows % WARPS)
    while m % rows:
        rows -= WARPS
    return rows


def _run(block_step, inputs, out_type, *, rows, per_program, interpret):
    """Runs block_step(scale (4, D/g, g) f32, block (a pl.ds of 4 rows), *refs) over the row blocks: programs of
    `per_program` rows, 4 at a time (one per warp). refs: the inputs' but the scale's, then the outputs'. inputs:
    (M, D/g, g) arrays, the norm scale (D/g, g) last: each program stages it in SMEM as f32 once (each warp writes
    the whole of it, the same values, and reads back what it wrote: no synchronisation) and loads it per block,
    rather than holding D/32 more f32 per thread in registers or reading it from L2 for every 4 rows. rows: the
    `_RowLayout` of the arrays."""
    m, n_groups, group = inputs[0].shape
    n_in, n_out = len(inputs), len(out_type)
    shape = (WARPS, n_groups, group)

    def body(*refs):
        program = lax.axis_index("program")
        scale_ref, scale_smem = refs[n_in - 1], refs[n_in + n_out]
        scale_smem[...] = load_from_gmem(scale_ref, rows.layout.reduce(0)).astype(jnp.float32)
        step_refs = (*refs[:n_in - 1], *refs[n_in:n_in + n_out])

        @pl.loop(0, per_program // WARPS)
        def _(t):
            scale32 = rows.broadcast_features(load_from_gmem(scale_smem, rows.layout.reduce(0)), shape)
            block_step(scale32, pl.ds(program * per_program + t * WARPS, WARPS), *step_refs)

    # no automatic barriers: the staged scale is the only shared location, and every thread reads back its own
    # write of it (other warps write the same values there); the outputs alias no input
    return plgpu.kernel(body, out_type=out_type, grid=(m // per_program,), grid_names=("program",),
                        scratch_types=(plgpu.SMEM((n_groups, group), jnp.float32),), compiler_params=NO_AUTO_BARRIERS,
                        interpret=interpret)(*inputs)


@functools.partial(jax.jit, static_argnames=("eps", "dtype", "fmt", "per_program", "interpret"))
def _forward_call(x3, scale2, *, eps, dtype, fmt, per_program, interpret):
    """x3 (M, G, g), scale2 (G, g) -> y (M, G, g) dtype, codes (M, G, g), scales (M, G) f32."""
    m, n_groups, group = x3.shape
    rows = _RowLayout(group, _vector(x3.dtype))
    fmt = formats.get_format(fmt)

    def block_step(scale32, block, x_ref, y_ref, codes_ref, scales_ref):
        x32 = load_from_gmem(x_ref.at[block], rows.layout).astype(jnp.float32)
        y, _ = numerics.rms_norm(x32, scale32, eps, rows.mean_rows, rows.broadcast_rows)
        y_ref[block] = y.astype(dtype)
        # `quantize.quantize_with_seed` of the (M, G, g) view, granularity "row"
        codes_ref[block], scales_ref[block] = numerics.quantize_groups(x32, fmt, False, rows.broadcast_groups)

    out_type = (jax.ShapeDtypeStruct(x3.shape, dtype), jax.ShapeDtypeStruct(x3.shape, fmt.dtype),
                jax.ShapeDtypeStruct((m, n_groups), jnp.float32))
    return _run(block_step, (x3, scale2), out_type, rows=rows, per_program=per_program, interpret=interpret)


def forward_saving(x: jax.Array, scale: jax.Array, *, eps: float, dtype, spec: QuantSpec, group: int,
                   interpret=False, rows_per_program: int = ROWS_PER_PROGRAM) -> tuple[jax.Array, QTensor]:
    """RMSNorm of x and its 8-bit copy from one read of x.

    Args:
      x: float32 / bfloat16 / float16 (..., D); scale: float (D,); eps: Python float; dtype: y's dtype.
      spec, group: how x is saved (a recipe's `saved` and `saved_group`; `supports` lists the cases).
      interpret: False / None compile the kernel (a Hopper GPU); True or a `plgpu.InterpretGPUParams`: the
        Mosaic GPU interpreter (CPU).
      rows_per_program: rows each program runs, 4 at a time (a tuning knob: results do not depend on it).
    Returns:
      y (..., D) in dtype, `ops.rms_norm`'s forward (to float32 rounding), and the QTensor of `prologue.save(x,
      spec, group)` (codes (..., D/g, g), scales f32 (..., D/g, 1), bit for bit).
    """
    reason = supports(x, scale, spec, group)
    if reason is not None:
        raise ValueError(reason)
    *lead, d = x.shape
    y, codes, scales = _forward_call(x.reshape(-1, d // group, group), scale.reshape(d // group, group),
                                     eps=float(eps), dtype=jnp.dtype(dtype), fmt=spec.dtype,
                                     per_program=_rows_per_program(x.size // d, rows_per_program),
                                     interpret=resolve_interpret(interpret))
    saved = QTensor(codes.reshape(*lead, d // group, group), scales.reshape(*lead, d // group, 1), "row")
    return y.reshape(x.shape), saved
