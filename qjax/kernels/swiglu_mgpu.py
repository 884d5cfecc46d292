"""SwiGLU fused with the data-flow recipes' 8-bit saved copy of its input: Pallas Mosaic GPU kernels, equal to the
composition `qjax.prologue` runs without them (`ops.SWIGLU`'s forward / backward with `prologue.save` / `restore`).

A data-flow recipe (`int8_dataflow`: int8 in groups of 32 features, `fp8_dataflow`: e4m3 in groups of 16, one
float32 scale per group) saves only the 8-bit copy of SwiGLU's input gate_up (M, 2F) for the backward. Composed
in XLA that is the SwiGLU fusion, an amax pass and a codes pass over gate_up in the forward, and a dequantize pass
writing gate_up back in bf16 before SwiGLU's backward. Here each direction is one pass:

  forward   gate_up (M, 2F) bf16 -> h = silu(gate) * up (M, F) bf16, codes (M, 2F) and scales (M, 2F / g) f32
            (read 4 bytes per feature pair, write 2 + 2 + 8 / g)
  backward  codes, scales, dh (M, F) bf16 -> d(gate_up) (M, 2F) bf16
            (read 2 + 8 / g + 2, write 4)

Layout: gate_up is viewed as (M, 2C, g), C = F / g groups of g features per half (a free reshape; the codes are
the QTensor of exactly this view, as `prologue.save` quantizes it), so a group is the last axis. Each program
takes a (TM, TC, g) block of gate and the same block of up (groups c and C + c), from GMEM into registers and
back, no shared memory (as the fused AdamW kernel: many small register-only programs hide the latency). The
register layout (`_layouts`) gives each warp one token row of the block at a time and its 32 lanes 256
consecutive features (g / 8 lanes per group, 8 bf16 = 16 bytes per lane and load), so a warp's loads and stores
are contiguous and a group's amax is a reduction inside the lane's vector and a butterfly shuffle across its
g / 8 lanes, never across warps.

Bit-exactness: the kernels call the formulas the references call: `numerics.swiglu` (SwiGLU in float32 with each
op rounded to bf16, as XLA evaluates `jax.nn.silu(gate) * up`) and `numerics.swiglu_backward`; the saved copy
`numerics.quantize_groups` (amax, scale, round half to even, clamp, cast, in the order
`qjax.quantize.quantize_with_seed` applies them); the restore is code * scale rounded to bf16, as
`QTensor.dequantize` then `astype`. Under the CPU interpreter the kernels equal the references bit for bit;
compiled, codes and scales are exact, h and d(gate_up) agree to the ulps of exp (Mosaic GPU's and XLA's exp may
differ by an ulp, and XLA:GPU may fuse the bf16 steps of the reference with excess precision).

Shapes (`supports_forward` / `supports_backward`): bfloat16 gate_up, M (the leading dims' product) a multiple of
4 (the warps), F a multiple of 256 (a warp's row), g in GROUPS; anything else runs the references (`qjax.dispatch`).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from qjax import formats, numerics
from qjax.kernels import NO_AUTO_BARRIERS, load_from_gmem, resolve_interpret
from qjax.qtensor import QTensor, QuantSpec

_VECTOR = 8  # bf16 elements per lane and register: 16-byte loads
_WARPS = 4
_LANES = 32
FEATURE_MULTIPLE = _LANES * _VECTOR  # a warp's lanes cover 256 consecutive features of one row
TOKEN_MULTIPLE = _WARPS  # the warps take one row each
GROUPS = (8, 16, 32, 64, 128, 256)  # g / 8 lanes per group must divide the warp's 32
# gate elements per program (and as many of up): a tuning knob (benchmarks/kernels.py swiglu --tiles), results do
# not depend on it.
TILE_ELEMENTS = 2048
_DTYPE = jnp.dtype(jnp.bfloat16)


@functools.cache
def _layouts(group: int):
    """(layout of (rows, groups, group) blocks, layout of their (rows, groups) per-group values).

    Tiles of (4, 256 / group, group): warps split the 4 rows; lanes the 256 / group groups (major) and the group's
    group / 8 vectors of 8 (minor). The per-group layout is its reduction along the group: replicated over the
    group's lanes, whose butterfly shuffles compute it."""
    layout = plgpu.Layout.TILED(plgpu.Tiling(((_WARPS, FEATURE_MULTIPLE // group, group), (_VECTOR,))),
                                warp_dims=(-4,), lane_dims=(-3, -2), vector_dim=-1)
    return layout, layout.reduce(2)


def _broadcast_groups(values, shape, layout):
    """(rows, groups) per-group values -> (rows, groups, group) in `layout`, constant along each group."""
    return plgpu.layout_cast(lax.broadcast_in_dim(values, shape, (0, 1)), layout)


def _tile(m: int, c: int, group: int, elements: int) -> tuple[int, int]:
    """(TM, TC): rows and groups of a program's block, the largest that divide (m, c), keep the layout's tiling and
    hold about `elements` gate elements (at least one layout tile)."""
    lane_rows = FEATURE_MULTIPLE // group
    tc = max(d for d in range(lane_rows, c + 1, lane_rows)
             if c % d == 0 and (d == lane_rows or _WARPS * d * group <= elements))
    tm = max(d for d in range(_WARPS, m + 1, _WARPS) if m % d == 0 and (d == _WARPS or d * tc * group <= elements))
    return tm, tc


@functools.partial(jax.jit, static_argnames=("fmt", "pow2_scale", "tile", "interpret"))
def _forward_call(x3, *, fmt, pow2_scale, tile, interpret):
    """x3 (M, 2C, g) bf16 -> h (M, C, g) bf16, codes (M, 2C, g), scales (M, 2C) f32."""
    m, two_c, group = x3.shape
    c = two_c // 2
    tm, tc = tile
    layout, _ = _layouts(group)
    code_format = formats.get_format(fmt)
    broadcast = functools.partial(_broadcast_groups, layout=layout)

    def body(x_ref, h_ref, codes_ref, scale_ref):
        i, j = lax.axis_index("m"), lax.axis_index("c")
        rows, halves = pl.ds(i * tm, tm), (pl.ds(j * tc, tc), pl.ds(c + j * tc, tc))
        gate, up = (load_from_gmem(x_ref.at[rows, cols], layout) for cols in halves)
        h_ref.at[rows, halves[0]][...] = numerics.swiglu(gate, up)
        for x, cols in zip((gate, up), halves):
            codes, scale = numerics.quantize_groups(x.astype(jnp.float32), code_format, pow2_scale, broadcast)
            codes_ref.at[rows, cols][...] = codes
            scale_ref.at[rows, cols][...] = scale

    out_type = (jax.ShapeDtypeStruct((m, c, group), x3.dtype), jax.ShapeDtypeStruct(x3.shape, code_format.dtype),
                jax.ShapeDtypeStruct((m, two_c), jnp.float32))
    return plgpu.kernel(body, out_type=out_type, grid=(m // tm, c // tc), grid_names=("m", "c"),
                        compiler_params=NO_AUTO_BARRIERS, interpret=interpret)(x3)  # outputs: no input aliased


@functools.partial(jax.jit, static_argnames=("tile", "interpret"))
def _backward_call(codes, scale, dh3, *, tile, interpret):
    """codes (M, 2C, g), scales (M, 2C) f32, dh3 (M, C, g) bf16 -> d(gate_up) (M, 2C, g) in dh3's dtype."""
    m, two_c, group = codes.shape
    c = two_c // 2
    tm, tc = tile
    layout, group_layout = _layouts(group)
    dtype = dh3.dtype

    def body(codes_ref, scale_ref, dh_ref, dx_ref):
        i, j = lax.axis_index("m"), lax.axis_index("c")
        rows, halves = pl.ds(i * tm, tm), (pl.ds(j * tc, tc), pl.ds(c + j * tc, tc))

        def restore(cols):  # the saved half as prologue.restore gives it: code * scale rounded to the dtype
            values = load_from_gmem(codes_ref.at[rows, cols], layout).astype(jnp.float32)
            scales = load_from_gmem(scale_ref.at[rows, cols], group_layout)
            restored = values * _broadcast_groups(scales, values.shape, layout)
            return restored.astype(dtype).astype(jnp.float32)

        dh = load_from_gmem(dh_ref.at[rows, halves[0]], layout).astype(jnp.float32)
        grads = numerics.swiglu_backward(restore(halves[0]), restore(halves[1]), dh)
        for grad, cols in zip(grads, halves):
            dx_ref.at[rows, cols][...] = grad.astype(dtype)

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(codes.shape, dtype), grid=(m // tm, c // tc),
                        grid_names=("m", "c"), compiler_params=NO_AUTO_BARRIERS, interpret=interpret)(codes, scale, dh3)


# ------------------------------------------------------------------------------------------------------- public


def _shape_reason(shape, dtype, group, what: str) -> str | None:
    if jnp.dtype(dtype) != _DTYPE:
        return f"the SwiGLU kernels take bfloat16 {what}, got {jnp.dtype(dtype)}"
    if group not in GROUPS:
        return f"the SwiGLU kernels save groups of {GROUPS} features, got {group}"
    if len(shape) < 2 or shape[-1] == 0 or shape[-1] % (2 * FEATURE_MULTIPLE):
        return (f"the SwiGLU kernels need gate_up (..., 2F) with F a positive multiple of {FEATURE_MULTIPLE} and "
                f"leading dims, got {what} of shape {shape}")
    tokens = 1
    for d in shape[:-1]:
        tokens *= d
    if tokens == 0 or tokens % TOKEN_MULTIPLE:
        return (f"the SwiGLU kernels need a token count (leading dims) that is a multiple of {TOKEN_MULTIPLE}, "
                f"got {shape}")
    return None


def supports_forward(gate_up, spec, group: int) -> str | None:
    """None if `swiglu_quantize(gate_up, spec, group)` can run, else the reason it cannot."""
    if not isinstance(spec, QuantSpec) or spec.granularity != "row" or spec.stochastic or spec.dtype == "ternary":
        return f"the SwiGLU kernels save per group with nearest rounding (a 'row' QuantSpec), got {spec}"
    return _shape_reason(gate_up.shape, gate_up.dtype, group, "gate_up")


def supports_backward(saved, dh, x_like) -> str | None:
    """None if `swiglu_backward(saved, dh)` can run for gate_up like x_like (shape, dtype), else the reason."""
    if not isinstance(saved, QTensor) or saved.granularity != "row" or saved.data.ndim < 2:
        return "the SwiGLU backward kernel reads the saved QTensor of `prologue.save` (granularity 'row')"
    group = saved.data.shape[-1]
    if jnp.dtype(dh.dtype) != jnp.dtype(x_like.dtype):
        return f"dh ({dh.dtype}) and gate_up ({x_like.dtype}) must share a dtype"
    if (tuple(saved.data.shape[:-2]) + (saved.data.shape[-2] * group,) != tuple(x_like.shape)
            or tuple(saved.scale.shape) != tuple(saved.data.shape[:-1]) + (1,)):
        return (f"saved codes {saved.data.shape} and scales {saved.scale.shape} are not the grouped view of gate_up "
                f"{x_like.shape} (codes (..., 2F / g, g), scales (..., 2F / g, 1))")
    return _shape_reason(x_like.shape, x_like.dtype, group, "gate_up")


def swiglu_quantize(gate_up: jax.Array, spec: QuantSpec, group: int, *, interpret=False,
                    tile_elements: int = TILE_ELEMENTS) -> tuple[jax.Array, QTensor]:
    """SwiGLU of gate_up and its saved 8-bit copy from one read.

    Args:
      gate_up: bfloat16 (..., 2F), gate = [..., :F], up = [..., F:] (see `supports_forward`).
      spec: the saved format, a "row" QuantSpec (nearest rounding); group: features per scale.
      interpret: False / None compile (a Hopper GPU); True or a `plgpu.InterpretGPUParams`: the interpreter.
      tile_elements: gate elements per program (tuning; results do not depend on it).
    Returns:
      (h (..., F) bfloat16 = `numerics.swiglu(gate, up)`, QTensor of gate_up's (..., 2F / group, group) view: codes
      of that shape, scales (..., 2F / group, 1)), equal to `ops.SWIGLU.forward(gate_up)[0]` and
      `prologue.save(gate_up, spec, group)`.
    """
    reason = supports_forward(gate_up, spec, group)
    if reason is not None:
        raise ValueError(reason)
    *lead, two_f = gate_up.shape
    m, c = gate_up.size // two_f, two_f // 2 // group
    h, codes, scale = _forward_call(gate_up.reshape(m, 2 * c, group), fmt=spec.dtype, pow2_scale=spec.pow2_scale,
                                    tile=_tile(m, c, group, tile_elements), interpret=resolve_interpret(interpret))
    saved = QTensor(codes.reshape(*lead, 2 * c, group), scale.reshape(*lead, 2 * c, 1), "row")
    return h.reshape(*lead, c * group), saved


def swiglu_backward(saved: QTensor, dh: jax.Array, *, interpret=False,
                    tile_elements: int = TILE_ELEMENTS) -> jax.Array:
    """d(gate_up) from the saved copy of gate_up and dh = d(silu(gate) * up), from one read of each.

    Args:
      saved: the QTensor `swiglu_quantize` / `prologue.save` gave: codes (..., 2F / g, g), scales (..., 2F / g, 1).
      dh: bfloat16 (..., F).
    Returns:
      (..., 2F) in dh's dtype: SwiGLU's backward (`numerics.swiglu_backward`) at the restored gate_up
      (`prologue.restore`), rounded once.
    """
    x_like = jax.ShapeDtypeStruct((*dh.shape[:-1], 2 * dh.shape[-1]), dh.dtype)
    reason = supports_backward(saved, dh, x_like)
    if reason is not None:
        raise ValueError(reason)
    *lead, two_c, group = saved.data.shape
    m, c = dh.size // dh.shape[-1], two_c // 2
    dx = _backward_call(saved.data.reshape(m, two_c, group), saved.scale.reshape(m, two_c),
                        dh.reshape(m, c, group), tile=_tile(m, c, group, tile_elements),
                        interpret=resolve_interpret(interpret))
    return dx.reshape(x_like.shape)
