"""One tensor's AdamW step with quantized moments: the jnp reference, and the fused Mosaic GPU kernel's entry point.

`fused_step(p, g, mu, nu, ...)` -> (new p, new mu, new nu) runs `qjax.kernels.adam_step_mgpu` (one kernel reads
param, gradient and moments once and writes them once: 16 bytes per float32 param instead of the ~28 of the optax
path, where `apply_updates` is a separate pass over an update tensor). `fused_step_reference` is the same
computation in jnp: `adam.update_reference` (what `scale_by_quantized_adam` does to one tensor), then optax's weight
decay, learning rate and `apply_updates`. Both call the same formulas (`adam_math.adam_math`,
`adam_math.param_update`, the state quantizers of `blockwise`), so they are bit-identical under the CPU interpreter.

Which tensors take the kernel (`kernel_eligible`): float32 param and gradient (or bfloat16 ones with a stochastic
rounding seed: the kernel rounds the new param as `sr_params.round_param` does), moments in one of `KERNEL_FORMATS`
(e4m3 `Fp8State`s, COAT's range-expanded e4m3 `Fp8ExpandedState`s, 8-bit `CodebookState`s on the signed /
unsigned dynamic maps, or adamw_4bit's 4-bit ones) with
blocks of 128 or 256 and a block count that is a multiple of 4. Everything else stays on the jnp path. Whether
kernels run at all is `qjax.dispatch.kernel_mode()`: on a Hopper GPU, or as `qjax.dispatch.force` says. Under a mesh
of several devices, `fused_step_per_device` runs the kernel on each device's shard inside `jax.shard_map`, for a
tensor whose layout gives every device whole state blocks (`per_device_layout`: split along dim 0, along one
other dim, along both, or whole on every device).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from qjax.kernels import adam_step_mgpu
from qjax.optim import adam, adam_math, blockwise, sr_params

__all__ = ["KERNEL_BLOCK_SIZES", "KERNEL_FORMATS", "ShardLayout", "fused_step", "fused_step_per_device",
           "fused_step_reference", "kernel_eligible", "per_device_layout"]

KERNEL_FORMATS = adam_step_mgpu.KERNEL_FORMATS  # (m, v format) pairs: "e4m3", "e4m3_dre" or a code book map's name
KERNEL_BLOCK_SIZES = adam_step_mgpu.BLOCK_SIZES


def fused_step_reference(p, g, mu, nu, config, b1, b2, eps, bc1, bc2_sqrt, step_size, weight_decay: float,
                         seed=None, offset=0, runs=None, clip=None):
    """jnp reference of one tensor's fused step, any state format: g clipped (with `clip`), `adam.update_reference`,
    then the param update in float32, rounded to p's dtype (`sr_params.round_param`: stochastically for bfloat16 with
    a `seed`; p's elements have indices offset + row-major index in the whole param, or with `runs` = (run, stride)
    offset + j * stride + e for element e of the j-th run of `run` elements). Args as in `fused_step`, plus the
    `adam.StateConfig`."""
    if clip is not None:
        g = adam_math.clip_gradient(g.astype(jnp.float32), *clip, g.dtype)
    direction, mu, nu = adam.update_reference(g, mu, nu, config, b1, b2, eps, bc1, bc2_sqrt)
    new_p = adam_math.param_update(p.astype(jnp.float32), direction, step_size, weight_decay)
    if runs is None:
        return sr_params.round_param(new_p, p.dtype, seed, offset), mu, nu
    run, stride = runs
    starts = jnp.asarray(offset, jnp.uint32) + jnp.uint32(stride) * lax.iota(jnp.uint32, new_p.size // run)
    rounded = jax.vmap(lambda x, start: sr_params.round_param(x, p.dtype, seed, start))(new_p.reshape(-1, run), starts)
    return rounded.reshape(p.shape), mu, nu


def _state_format(state) -> str | None:
    """The kernel's name for a moment's format ("e4m3", "e4m3_dre" or a code book map's name), None for any other
    state."""
    if isinstance(state, blockwise.Fp8State):
        return "e4m3"
    if isinstance(state, blockwise.Fp8ExpandedState):
        return "e4m3_dre"
    if isinstance(state, blockwise.CodebookState):
        return state.qmap
    return None


def _block_size(state) -> int:
    """Elements per block of a quantized state (its codes hold half as many columns when 4-bit codes are packed)."""
    return math.prod(state.shape) // state.codes.shape[0]


# A state's per-block (n,) arrays, in the order the kernel takes them after the codes.
_ROW_FIELDS = {blockwise.CodebookState: ("absmax",), blockwise.Fp8State: ("scale",),
               blockwise.Fp8ExpandedState: ("scale", "expand", "centre")}


def _state_arrays(state) -> tuple:
    """A quantized state as the kernel reads it: (codes, *per-block arrays)."""
    return (state.codes, *(getattr(state, name) for name in _ROW_FIELDS[type(state)]))


def _with_state(like, arrays):
    """Inverse of `_state_arrays`: a state of like's type and static fields holding `arrays`."""
    codes, *rows = arrays
    return dataclasses.replace(like, codes=codes, **dict(zip(_ROW_FIELDS[type(like)], rows, strict=True)))


def kernel_eligible(p, g, mu, nu, seeded: bool = False) -> bool:
    """Whether one tensor's step can run in the kernel (module docstring); otherwise it takes the jnp path.
    seeded: a stochastic-rounding seed comes with the tensor (needed for bfloat16 params)."""
    dtypes = (jnp.dtype(p.dtype), jnp.dtype(g.dtype))
    return ((_state_format(mu), _state_format(nu)) in KERNEL_FORMATS
            and _block_size(mu) in KERNEL_BLOCK_SIZES and mu.codes.shape[0] % adam_step_mgpu.ROW_MULTIPLE == 0
            and (dtypes == (jnp.float32, jnp.float32) or (seeded and dtypes == (jnp.bfloat16, jnp.bfloat16))))


def fused_step(p, g, mu, nu, b1, b2, eps, bc1, bc2_sqrt, step_size, weight_decay: float, *, seed=None, offset=0,
               runs=None, clip=None, interpret=None):
    """One tensor's AdamW step with quantized moments in one kernel; the result of `fused_step_reference`.

    Args:
      p, g: float32 param and gradient of the same shape, size == mu's size; or both bfloat16, with `seed`.
      mu, nu: moments in one of `KERNEL_FORMATS`: `blockwise.Fp8State` (codes float8_e4m3fn (n, B), scale float32
        (n,)), `blockwise.Fp8ExpandedState` (codes float8_e4m3fn (n, B), scale float32, expand uint8, centre
        bfloat16 (n,)) or `blockwise.CodebookState` (codes uint8 (n, B), or (n, B / 2) for 4 bits, absmax float32
        (n,)); B = 128 or 256, n % 4 == 0.
      b1, b2, eps: Python floats. bc1, bc2_sqrt: float32 scalars 1 - b1**t and sqrt(1 - b2**t).
      step_size: float32 scalar, -learning_rate at this step. weight_decay: Python float (0: none, as optax).
      seed: uint32 scalar, for bfloat16 p: stochastic rounding's seed. offset: uint32 scalar, the index of p's first
        element in the whole param (a device's shard: `fused_step_per_device`), even; runs: None (p's elements follow
        one another in the whole param) or static (run, stride) (runs of `run` elements, a multiple of B, `stride`
        apart), as in `fused_step_reference`.
      clip: None, or `adam_math.clip_factors` (keep, divisor, multiplier) for g's dtype: g is clipped by the global
        norm as it is read (`adam_math.clip_gradient`, `qjax.optim.clipping`).
      interpret: None / False runs the compiled kernel (needs a Hopper GPU); True or a `plgpu.InterpretGPUParams`
        runs it under the Mosaic GPU interpreter (CPU).
    Returns:
      (new param of p's shape and dtype, new mu, new nu) of mu's and nu's types.
    """
    if not kernel_eligible(p, g, mu, nu, seed is not None):
        raise ValueError(f"fused_step needs float32 p and g (or bfloat16 ones with a seed) and moments in "
                         f"{KERNEL_FORMATS} with blocks of {KERNEL_BLOCK_SIZES}, a multiple of "
                         f"{adam_step_mgpu.ROW_MULTIPLE} blocks; got p {p.dtype}, g {g.dtype}, mu "
                         f"{type(mu).__name__} {_state_format(mu)}, nu {type(nu).__name__} {_state_format(nu)}")
    n_blocks, block = mu.codes.shape[0], _block_size(mu)
    if nu.codes.shape != mu.codes.shape or mu.shape != nu.shape or p.shape != mu.shape or g.shape != p.shape:
        raise ValueError(f"shapes differ: p {p.shape}, g {g.shape}, mu {mu.shape} {mu.codes.shape}, nu {nu.shape} "
                         f"{nu.codes.shape}")
    coefficients = (bc1, bc2_sqrt, step_size)
    if clip is not None:
        keep, divisor, multiplier = clip  # kept: divided and multiplied by 1, g exactly (no select in the kernel)
        coefficients += (jnp.where(keep, 1, divisor), jnp.where(keep, 1, multiplier))
    coef = jnp.stack([jnp.asarray(c, jnp.float32) for c in coefficients])
    p_new, m_state, v_state = adam_step_mgpu.adam_step_kernel(
        p.reshape(n_blocks, block), g.reshape(n_blocks, block), _state_arrays(mu), _state_arrays(nu), coef,
        formats=(_state_format(mu), _state_format(nu)), b1=float(b1), b2=float(b2), eps=float(eps),
        weight_decay=float(weight_decay), seed=seed, offset=offset, runs=runs, interpret=interpret)
    return p_new.reshape(p.shape), _with_state(mu, m_state), _with_state(nu, v_state)


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """How the per-device step cuts one param over the mesh (`per_device_layout`).

    Attributes:
      axes: per dim of the param, the mesh axes splitting it (() where whole); only dim 0 and `inner` are split.
      inner: the split dim past dim 0, or 0 where none is (the param split along dim 0 alone, or whole).
    """

    axes: tuple[tuple[str, ...], ...]
    inner: int


def per_device_layout(p, mu, spec: PartitionSpec | None, mesh) -> tuple[ShardLayout | None, str | None]:
    """Whether one kernel-eligible tensor's step can run per device on the `mesh` its param is laid out on by
    `spec`: (its `ShardLayout`, None), or (None, why not).

    It can when `spec` splits at most dim 0 and one other dim d (the innermost split), each evenly, and every
    device then holds whole state blocks, a multiple of `ROW_MULTIPLE`: a device's shard is runs of
    (size of d on a device) * prod(shape[d + 1:]) consecutive elements of the flattened param (one run when only
    dim 0 is split), each a whole number of the blocks the moments are quantized in (along the flattened param).
    A param whole on every device (data parallelism) runs whole on each. Where d's shards cut blocks (an LM head
    whose vocab shard is not a multiple of the block), the step runs on the same devices with the param split along
    dim 0 over all of the spec's axes, if that gives whole blocks: p and g move there and the new p back (the
    train step's states lie so already). Not covered: a spec splitting two dims past dim 0, or shards of part of a
    block either way.
    """
    dims = tuple(spec) if spec is not None else ()
    if len(dims) > p.ndim or any(d is not None and not isinstance(d, (str, tuple)) for d in dims):
        return None, f"PartitionSpec {spec} does not lay out a param of shape {p.shape} dim by dim"
    axes = tuple(() if d is None else (d,) if isinstance(d, str) else tuple(d)
                 for d in dims + (None,) * (p.ndim - len(dims)))
    if any(a not in mesh.axis_names for dim_axes in axes for a in dim_axes):
        return None, f"PartitionSpec {spec} names an axis the mesh {tuple(mesh.axis_names)} lacks"
    inner = [d for d in range(1, p.ndim) if axes[d]]
    if len(inner) > 1:
        return None, f"PartitionSpec {spec} splits dims {inner} past dim 0; the per-device kernel takes at most one"
    own = ShardLayout(axes, inner[0] if inner else 0)
    why = _whole_blocks(p, mu, own, mesh)
    if why and own.inner:  # the same devices along dim 0 (the train step's state layout): p and g move there
        moved = ShardLayout((sum(axes, ()),) + ((),) * (p.ndim - 1), 0)
        if _whole_blocks(p, mu, moved, mesh) is None:
            return moved, None
    return (None, f"PartitionSpec {spec}: {why}") if why else (own, None)


def _whole_blocks(p, mu, layout: ShardLayout, mesh) -> str | None:
    """None where `layout` gives each device whole state blocks, a multiple of `ROW_MULTIPLE`; else why not."""
    devices = _devices(layout, mesh)
    if any(size % n for size, n in zip(p.shape, devices)):
        return f"shape {p.shape} does not split evenly over the mesh {dict(mesh.shape)}"
    run, block = _runs(p.shape, layout, mesh)[0], _block_size(mu)
    if run % block or p.size // math.prod(devices) // block % adam_step_mgpu.ROW_MULTIPLE:
        return (f"a device's shard, runs of {run} consecutive elements, is not a multiple of "
                f"{adam_step_mgpu.ROW_MULTIPLE} whole state blocks of {block}")
    return None


def _devices(layout: ShardLayout, mesh) -> list[int]:
    """The number of shards of each dim of the param."""
    return [math.prod(mesh.shape[a] for a in dim_axes) for dim_axes in layout.axes]


def _runs(shape: tuple, layout: ShardLayout, mesh) -> tuple[int, int]:
    """(run, stride): a device's shard of a param of `shape` is runs of `run` consecutive elements of the whole
    param, `stride` apart (one run, stride = run, when no dim past 0 is split)."""
    inner, local = layout.inner, [size // n for size, n in zip(shape, _devices(layout, mesh))]
    after = math.prod(shape[inner + 1:])
    if inner == 0:
        return math.prod(local), math.prod(local)
    return local[inner] * after, shape[inner] * after


def fused_step_per_device(p, g, mu, nu, layout: ShardLayout, b1, b2, eps, bc1, bc2_sqrt, step_size,
                          weight_decay: float, *, seed=None, clip=None, interpret=None):
    """`fused_step` of each device's shard, inside `jax.shard_map` over the context mesh: p and g split as
    `layout` says (`per_device_layout`), the moments' blocks alike: their codes and per-block arrays viewed as
    (*shape[:inner], blocks of shape[inner:], ...) and split the same way, so each device gets the blocks of its
    elements (XLA moves them there from however the state lies: for a dim-0 split, where the train step keeps
    them, nothing moves). Same args and result as `fused_step` (global arrays); a bfloat16 param's stochastic
    rounding hashes each element's index in the whole param (`fused_step_reference`'s offset and runs), so the
    result is the unsharded step's."""
    mesh = jax.sharding.get_abstract_mesh()
    inner, shape = layout.inner, p.shape
    run, stride = _runs(shape, layout, mesh)
    runs = None if run == stride else (run, stride)
    param_spec = PartitionSpec(*(a or None for a in layout.axes))
    state_spec = PartitionSpec(*(a or None for a in layout.axes[:inner + 1]))
    blocks = (*shape[:inner], math.prod(shape[inner:]) // _block_size(mu))  # a state's dims, its blocks last
    as_view = lambda s: jax.tree.map(lambda a: a.reshape(*blocks, *a.shape[1:]), s)

    def local(p, g, mu, nu, coef, seed):
        def first(dim):  # the global index along `dim` of the shard's first element, times dim's stride
            index = lax.axis_index(layout.axes[dim]).astype(jnp.uint32) if layout.axes[dim] else jnp.uint32(0)
            return index * jnp.uint32(p.shape[dim] * math.prod(shape[dim + 1:]))

        offset = first(0) + (first(inner) if inner else jnp.uint32(0))
        flat = lambda s: dataclasses.replace(
            jax.tree.map(lambda a: a.reshape(-1, *a.shape[inner + 1:]), s), shape=p.shape)
        new_p, new_mu, new_nu = fused_step(p, g, flat(mu), flat(nu), b1, b2, eps, *coef[:3], weight_decay, seed=seed,
                                           offset=offset, runs=runs, clip=coef[3:] or None, interpret=interpret)
        return new_p, _reshaped(new_mu, mu), _reshaped(new_nu, nu)

    # check_vma=False: the kernel updates its operands as mutable refs, which take no per-device (varying) type
    # (jax 0.11); every device of the axes that do not split the param computes the same values, so out_specs hold.
    new_p, new_mu, new_nu = jax.shard_map(
        local, in_specs=(param_spec, param_spec, state_spec, state_spec, PartitionSpec(), PartitionSpec()),
        out_specs=(param_spec, state_spec, state_spec), check_vma=False)(
            p, g, as_view(mu), as_view(nu), (bc1, bc2_sqrt, step_size, *(clip or ())), seed)
    return new_p, _reshaped(new_mu, mu), _reshaped(new_nu, nu)


def _reshaped(state, like):
    """`state`'s arrays in the shapes of `like`'s, as a state of like's static fields (one view of its blocks)."""
    leaves = [a.reshape(b.shape) for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(like), strict=True)]
    return jax.tree.unflatten(jax.tree.structure(like), leaves)
