"""One tensor's AdamW step with quantized moments: the jnp reference, and the fused Mosaic GPU kernel's entry point.

`fused_step(p, g, mu, nu, ...)` -> (new p, new mu, new nu) runs `qjax.kernels.adam_step_mgpu` (one kernel reads
param, gradient and moments once and writes them once: 16 bytes per float32 param instead of the ~28 of the optax
path, where `apply_updates` is a separate pass over an update tensor). `fused_step_reference` is the same
computation in jnp: `adam.update_reference` (what `scale_by_quantized_adam` does to one tensor), then optax's weight
decay, learning rate and `apply_updates`. Both call the same formulas (`qjax.numerics.adam_math`,
`numerics.param_update`, the state quantizers of `blockwise`), so they are bit-identical under the CPU interpreter.

Which tensors take the kernel (`kernel_eligible`): float32 param and gradient (or bfloat16 ones with a stochastic
rounding seed: the kernel rounds the new param as `sr_params.round_param` does), moments in one of `KERNEL_FORMATS`
(e4m3 `Fp8State`s, COAT's range-expanded e4m3 `Fp8ExpandedState`s, 8-bit `CodebookState`s on the signed /
unsigned dynamic maps, or adamw_4bit's 4-bit ones) with
blocks of 128 or 256 and a block count that is a multiple of 4. Everything else stays on the jnp path. Whether
kernels run at all is `qjax.dispatch.kernel_mode()`: on a Hopper GPU, or as `qjax.dispatch.force` says. Under a mesh
of several devices, `fused_step_per_device` runs the kernel on each device's shard inside `jax.shard_map`, for a
tensor whose layout gives every device whole state blocks of a contiguous run of the param (`per_device_axes`).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from qjax import numerics
from qjax.kernels import adam_step_mgpu
from qjax.optim import adam, blockwise, sr_params

__all__ = ["KERNEL_BLOCK_SIZES", "KERNEL_FORMATS", "fused_step", "fused_step_per_device", "fused_step_reference",
           "kernel_eligible", "per_device_axes"]

KERNEL_FORMATS = adam_step_mgpu.KERNEL_FORMATS  # (m, v format) pairs: "e4m3", "e4m3_dre" or a code book map's name
KERNEL_BLOCK_SIZES = adam_step_mgpu.BLOCK_SIZES


def fused_step_reference(p, g, mu, nu, config, b1, b2, eps, bc1, bc2_sqrt, step_size, weight_decay: float,
                         seed=None, offset=0):
    """jnp reference of one tensor's fused step, any state format: `adam.update_reference`, then the param update in
    float32, rounded to p's dtype (`sr_params.round_param`: stochastically for bfloat16 with a `seed`, from element
    index `offset` on). Args as in `fused_step`, plus the `adam.StateConfig`."""
    direction, mu, nu = adam.update_reference(g, mu, nu, config, b1, b2, eps, bc1, bc2_sqrt)
    new_p = numerics.param_update(p.astype(jnp.float32), direction, step_size, weight_decay)
    return sr_params.round_param(new_p, p.dtype, seed, offset), mu, nu


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
               interpret=None):
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
        element in the whole param (a device's shard: `fused_step_per_device`), as in `fused_step_reference`.
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
    coef = jnp.stack([jnp.asarray(c, jnp.float32) for c in (bc1, bc2_sqrt, step_size)])
    p_new, m_state, v_state = adam_step_mgpu.adam_step_kernel(
        p.reshape(n_blocks, block), g.reshape(n_blocks, block), _state_arrays(mu), _state_arrays(nu), coef,
        formats=(_state_format(mu), _state_format(nu)), b1=float(b1), b2=float(b2), eps=float(eps),
        weight_decay=float(weight_decay), seed=seed, offset=offset, interpret=interpret)
    return p_new.reshape(p.shape), _with_state(mu, m_state), _with_state(nu, v_state)


def per_device_axes(p, mu, spec: PartitionSpec | None, mesh) -> tuple[tuple[str, ...], str | None]:
    """Whether one kernel-eligible tensor's step can run per device on the `mesh` its param is laid out on by
    `spec`: (the mesh axes that split it, None), or ((), why not).

    It can when `spec` splits the param's dim 0 only, over mesh axes whose devices each get a whole number of
    state blocks, a multiple of `ROW_MULTIPLE`: each device then holds a contiguous run of the flattened param, and
    the blocks of the moments' codes and scales split the same way along their dim 0 hold the same elements. A
    param split along another dim (e.g. a row-parallel kernel's columns) holds no such run on a device.
    """
    dims = tuple(spec) if spec is not None else ()
    if any(d is not None for d in dims[1:]):
        return (), f"PartitionSpec {spec} splits a dim other than 0, so no device holds whole state blocks"
    first = dims[0] if dims else None
    axes = () if first is None else (first,) if isinstance(first, str) else tuple(first)
    if not axes:
        return (), f"PartitionSpec {spec} does not split it over the mesh"
    if any(a not in mesh.axis_names for a in axes):
        return (), f"PartitionSpec {spec} names an axis the mesh {tuple(mesh.axis_names)} lacks"
    devices = math.prod(mesh.shape[a] for a in axes)
    n_blocks = mu.codes.shape[0]
    if p.shape[0] % devices or n_blocks % (devices * adam_step_mgpu.ROW_MULTIPLE):
        return (), (f"its {n_blocks} state blocks do not split into multiples of {adam_step_mgpu.ROW_MULTIPLE} "
                    f"over the {devices} devices of {axes}")
    return axes, None


def fused_step_per_device(p, g, mu, nu, axes: tuple[str, ...], b1, b2, eps, bc1, bc2_sqrt, step_size,
                          weight_decay: float, *, seed=None, interpret=None):
    """`fused_step` of each device's shard, inside `jax.shard_map` over the context mesh: p and g split along dim 0
    and the moments' codes and scales along their blocks over `axes` (`per_device_axes`), whole over the other
    axes. Same args and result as `fused_step` (global arrays); a bfloat16 param's stochastic rounding hashes each
    element's index in the whole param (the shard's offset added), so the result is the unsharded step's."""
    split = PartitionSpec(axes)

    def local(p, g, mu, nu, coef, seed):
        offset = lax.axis_index(axes).astype(jnp.uint32) * jnp.uint32(p.size)  # the shard's first element
        new_p, new_mu, new_nu = fused_step(p, g, dataclasses.replace(mu, shape=p.shape),
                                           dataclasses.replace(nu, shape=p.shape), b1, b2, eps, *coef, weight_decay,
                                           seed=seed, offset=offset, interpret=interpret)
        return new_p, dataclasses.replace(new_mu, shape=mu.shape), dataclasses.replace(new_nu, shape=nu.shape)

    # check_vma=False: the kernel updates its operands as mutable refs, which take no per-device (varying) type
    # (jax 0.11); every device of the axes not in `axes` computes the same values, so out_specs hold.
    return jax.shard_map(local, in_specs=(split, split, split, split, PartitionSpec(), PartitionSpec()),
                         out_specs=(split, split, split), check_vma=False)(p, g, mu, nu, (bc1, bc2_sqrt, step_size),
                                                                          seed)
