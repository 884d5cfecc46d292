"""AdamW with low-precision states (adamw_8bit, adamw_4bit, adamw_fp8) and the step that applies it in place.

  tx = qjax.optim.adamw_8bit(learning_rate=schedule, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
  state = tx.init(params); updates, state = tx.update(grads, state, params); params = optax.apply_updates(...)
  params, state = qjax.optim.apply_gradients(tx, grads, state, params)     # the same step, fused where possible
  tx = qjax.optim.chain_fused(qjax.optim.clip_by_global_norm(1.0), qjax.optim.adamw_fp8(schedule, use_kernel=True))

Each is one `quantized_adamw(config, ...)` transformation: Adam with m and v stored per `adam.StateConfig` (the
per-tensor math is in `qjax.optim.adam`), decoupled weight decay (optax's `mask`) and the learning rate, with the ops
and order of `optax.chain(scale_by_quantized_adam, add_decayed_weights, scale_by_learning_rate)` (how `optax.adamw`
is built), so `update` returns that chain's updates bit for bit. Per tensor, in float32, returned in the gradient's
dtype: update = -lr * (direction + wd * param), from the old param; wd is 0 where `mask` is False.

Its state is one `adam.QuantizedAdamState(count, mu, nu)`: count, the steps taken, gives Adam's step t = count + 1
(bias correction) and the schedule's argument lr(count), as the chain's two counts did. It composes with
`optax.chain`, clipping, schedules, `optax.MultiSteps`, sharded params and orbax like any optax transformation.

It is also a `FusedTransformation`: `step(grads, state, params, key=None, param_specs=None, max_grad_norm=None)
-> (params, state)` applies its own update: per tensor `fused_adam.fused_step_reference` (the update in float32,
rounded once to the param's dtype; bfloat16 stochastically with `key`), for float32 params and grads bit for bit
`update` + `optax.apply_updates`; with `max_grad_norm`, of the gradients clipped as `optax.clip_by_global_norm` clips
them, each as its tensor's update reads it (`qjax.optim.clipping`).
With `use_kernel=True` (e4m3, 8-bit or 4-bit states, on a Hopper GPU) the step updates each eligible tensor's
param and moments in place in one kernel (`qjax.optim.fused_adam`: 16 instead of ~28 bytes moved per float32 param).
On several GPUs the kernel runs per device: `step(..., param_specs=)` with the mesh set while tracing
(`jax.set_mesh(mesh)`), each tensor whose shards are whole state blocks (`fused_adam.per_device_layout`: split
along dim 0, one other dim or both, as FSDP and tensor parallelism split kernels, embeddings and LM heads, or whole
on every device) takes the kernel on its shards (`jax.shard_map`), the others the jnp step; qjax's train step
passes the specs.
`update` and `step` both stream (`qjax.optim.streaming`): groups of tensors in sequence, large tensors in chunks,
so their temporaries stay about one group's (under a mesh, `step` leaves a tensor split over it unchunked: XLA
would gather it for the chunk loop). `apply_gradients(tx, ...)` runs a
`FusedTransformation`'s step, any other transformation's update + `optax.apply_updates`. `chain_fused(*pre, tx)`
chains transformations before it (e.g. clipping) and keeps its step; a `qjax.optim.clip_by_global_norm` right before
tx is folded into tx's step (each tensor's gradient clipped as its update reads it: no clipped copy of the
gradients). Wrapped in `optax.chain` or `optax.MultiSteps` it is an ordinary optax transformation (the same results
through `update`, no kernel).
"""

import functools
import math
import warnings
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from qjax import dispatch
from qjax.optim import adam, clipping, fused_adam, sr_params, streaming

_DEFAULT_BLOCK = {"dynamic_signed_8bit": 256, "dynamic_unsigned_8bit": 256, "dynamic_signed_4bit": 128,
                  "linear_unsigned_4bit": 128, "e4m3": 256, "e4m3_dre": 128}


class FusedTransformation(optax.GradientTransformation):
    """An `optax.GradientTransformation` (`init`, `update`; isinstance checks and tuple unpacking work as for any
    optax transformation) that also applies its update itself: `step(grads, state, params) -> (params, state)`, the
    result of `update` + `optax.apply_updates` (where a kernel takes a tensor, up to float32 rounding on a GPU).
    `apply_gradients` calls it; `step(grads, state, params, key, param_specs)` takes a key for bfloat16 params'
    stochastic rounding (None: to nearest) and the params' PartitionSpecs on the context mesh (None: no mesh).
    Where `folds_clipping`, `step(..., max_grad_norm=x)` first clips the gradients as `optax.clip_by_global_norm(x)`
    does, inside each tensor's update (`qjax.optim.clipping`)."""

    step: Callable  # set in __new__: a NamedTuple subclass cannot add fields, but may add attributes
    folds_clipping: bool

    def __new__(cls, init: Callable, update: Callable, step: Callable, folds_clipping: bool = False):
        self = super().__new__(cls, init, update)
        self.step = step
        self.folds_clipping = folds_clipping
        return self


def apply_gradients(tx, grads, opt_state, params, key=None, param_specs=None):
    """One optimizer step -> (new params, new opt_state): `tx.update` + `optax.apply_updates`, or with `key`
    + `apply_updates_sr` (bfloat16 params rounded stochastically).

    Any optax transformation works. A `FusedTransformation` (the AdamWs here, `chain_fused`) runs its `step`: it
    streams (`qjax.optim.streaming`: temporaries of about one group of tensors) and computes each param's update in
    float32, then rounds it to the param's dtype (bfloat16: stochastically with `key`, bits as `apply_updates_sr`
    draws them); float32 params and gradients get exactly update + apply_updates. With `use_kernel=True`, each
    tensor with e4m3, 8-bit or 4-bit states and float32 params (or bfloat16 params and gradients, with `key`) is
    updated by one fused kernel that reads and writes param, gradient and states once (`qjax.optim.fused_adam`; on a
    GPU its results may differ from the jnp step by float32 rounding, which moves a bfloat16 param's stochastic
    rounding to the neighbouring grid point now and then).

    key: a `jax.random.key`, fresh every step, for bfloat16 params (None: they are rounded to nearest).
    param_specs: a `PartitionSpec` per param (a tree like params) laying them out on the mesh set while tracing
      (`jax.set_mesh(mesh)` or `jax.sharding.use_abstract_mesh`), their gradients alike (the low-bit states may lie
      in any layout; the train step splits their blocks along dim 0): the fused kernel then runs per device
      (module docstring).
      Other transformations leave the layout to XLA.
    """
    if isinstance(tx, FusedTransformation):
        return tx.step(grads, opt_state, params, key, param_specs)
    updates, opt_state = tx.update(grads, opt_state, params)
    if key is None:
        return optax.apply_updates(params, updates), opt_state
    return sr_params.apply_updates_sr(params, updates, key), opt_state


def chain_fused(*transforms) -> FusedTransformation:
    """`optax.chain(*transforms)` whose `step` runs the last transformation's `apply_gradients` (its fused step)
    after the others' updates, e.g. `chain_fused(qjax.optim.clip_by_global_norm(1.0), adamw_fp8(lr, use_kernel=True))`.
    A `qjax.optim.clip_by_global_norm` right before a last transformation that `folds_clipping` (the AdamWs here) is
    not run as an update: the last step clips each gradient as it reads it (`qjax.optim.clipping`).

    State: the tuple of the transformations' states, in order (`optax.chain`'s layout); `update` equals
    `optax.chain`'s.
    """
    if not transforms:
        raise ValueError("chain_fused needs at least one transformation")
    *pre, last = transforms
    folded = (bool(pre) and isinstance(pre[-1], clipping.ClipByGlobalNorm) and isinstance(last, FusedTransformation)
              and last.folds_clipping)

    def run(txs, updates, states, params):
        new_states = []
        for tx, state in zip(txs, states, strict=True):
            updates, state = tx.update(updates, state, params)
            new_states.append(state)
        return updates, tuple(new_states)

    def init_fn(params):
        return tuple(tx.init(params) for tx in transforms)

    def update_fn(updates, state, params=None):
        return run(transforms, updates, state, params)

    def step_fn(grads, state, params, key=None, param_specs=None):
        if not folded:
            grads, pre_states = run(pre, grads, state[:-1], params)
            params, last_state = apply_gradients(last, grads, state[-1], params, key, param_specs)
            return params, (*pre_states, last_state)
        grads, pre_states = run(pre[:-1], grads, state[:-2], params)
        params, last_state = last.step(grads, state[-1], params, key, param_specs, max_grad_norm=pre[-1].max_norm)
        return params, (*pre_states, state[-2], last_state)  # the clip's state: optax's, which update leaves as is

    return FusedTransformation(init_fn, update_fn, step_fn)


def _decays(weight_decay: float, mask, grads) -> list:
    """Each gradient leaf's weight decay (0 where `mask` is False), as optax.masked applies a mask (tree prefix).
    optax calls a callable mask on the updates reaching add_decayed_weights: the gradients' tree, shapes, dtypes."""
    if mask is None:
        return [weight_decay] * len(jax.tree.leaves(grads))
    mask_tree = mask(grads) if callable(mask) else mask
    per_leaf = jax.tree.map(lambda m, sub: jax.tree.map(lambda _: weight_decay if m else 0.0, sub), mask_tree, grads)
    return jax.tree.leaves(per_leaf)


class _Coefficients(NamedTuple):
    """One step's scalars: bc1, bc2_sqrt float32 1 - b1**t and sqrt(1 - b2**t); step_size -lr (float or scalar)."""

    bc1: jax.Array
    bc2_sqrt: jax.Array
    step_size: float | jax.Array


def quantized_adamw(config: adam.StateConfig, learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                    weight_decay: float = 1e-4, mask=None, use_kernel: bool = False) -> FusedTransformation:
    """AdamW with m and v stored per `config` (module docstring).

    Args:
      config: the moments' formats, block size and `min_quantized_size`.
      learning_rate: a float, or an optax schedule called with the count of steps taken (0 at the first step).
      b1, b2, eps: Adam's. weight_decay: >= 0, decoupled; mask: as in `optax.adamw` (which params get decay).
      use_kernel: `step` runs the fused kernel where `qjax.dispatch.kernel_mode()` allows it (a Hopper GPU; per
        device on several, given `param_specs`); needs `config`'s formats in `fused_adam.KERNEL_FORMATS` and its
        block size in `KERNEL_BLOCK_SIZES`.
    Returns:
      A `FusedTransformation` whose state is an `adam.QuantizedAdamState`; updates have the grads' dtypes.
    """
    if not adam.is_real_number(weight_decay):
        raise TypeError(f"weight_decay must be a number (0 for none), got {weight_decay!r}")
    if not 0 <= weight_decay < float("inf"):  # also refuses NaN
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay}")
    if not (callable(learning_rate) or adam.is_real_number(learning_rate) or isinstance(learning_rate, jax.Array)):
        raise TypeError(f"learning_rate must be a number or an optax schedule (a callable of the step count), got "
                        f"{learning_rate!r}")
    if not isinstance(use_kernel, bool):
        raise ValueError(f"use_kernel must be True or False, got {use_kernel!r}")
    if use_kernel and not ((config.mu_format, config.nu_format) in fused_adam.KERNEL_FORMATS
                           and config.block_size in fused_adam.KERNEL_BLOCK_SIZES):
        raise ValueError(f"use_kernel=True: the fused kernel supports e4m3 states (adamw_fp8, with or without "
                         f"dynamic range expansion), adamw_8bit's and adamw_4bit's states, with block_size 128 or "
                         f"256; got mu {config.mu_format!r}, nu {config.nu_format!r}, block {config.block_size}; use "
                         "use_kernel=False")
    weight_decay = float(weight_decay)  # a Python float: optax skips a zero decay only then, and so does the kernel
    init_fn = adam.scale_by_quantized_adam(config, b1, b2, eps).init  # checks b1, b2, eps; count 0, zero moments

    def map_tensors(tensor_step, grads, state, params, seeds=None, routes=None, in_place=False, whole=None,
                    clips=None):
        """tensor_step(g, mu, nu, p, offset, weight_decay, _Coefficients, seed, route, clip) -> (x, mu, nu) per
        tensor, streamed (`streaming.run`: groups in sequence, large tensors in chunks of blocks at element `offset`)
        -> (tree of x like grads, new state). x is the new param when `in_place`, else the update. `seeds`,
        `routes`, `whole` (True: never chunked), `clips` (`clipping.leaf_clips`): one per leaf, or None."""
        if params is None:
            raise ValueError("quantized_adamw's update needs params (weight decay): pass update(grads, state, params)")
        count = optax.safe_increment(state.count)
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate  # the schedule's step: count
        coefficients = _Coefficients(*adam.bias_corrections(count, b1, b2), -1 * lr)
        g_leaves, treedef = jax.tree.flatten(grads)
        seeds = [None] * len(g_leaves) if seeds is None else seeds
        routes = [False] * len(g_leaves) if routes is None else routes
        clips = [None] * len(g_leaves) if clips is None else clips
        tensors = zip(g_leaves, *(treedef.flatten_up_to(tree) for tree in (state.mu, state.nu, params)),
                      _decays(weight_decay, mask, grads), seeds, routes, clips, strict=True)
        out = streaming.run(lambda g, mu, nu, p, offset, wd, seed, route, clip: tensor_step(
            g, mu, nu, p, offset, wd, coefficients, seed, route, clip), list(tensors), in_place=in_place, whole=whole)
        x, mu, nu = (treedef.unflatten([o[i] for o in out]) for i in range(3))
        return x, adam.QuantizedAdamState(count, mu, nu)

    def tensor_update(g, mu, nu, p, offset, wd, c, seed, route, clip):
        """One tensor's update with optax's ops: Adam's direction in g's dtype, add_decayed_weights (skipped at 0),
        scale_by_learning_rate (a schedule's value cast to the update's dtype, a constant multiplied as it is)."""
        del offset, seed, route, clip
        direction, mu, nu = adam.update_reference(g, mu, nu, config, b1, b2, eps, c.bc1, c.bc2_sqrt)
        u = direction.astype(g.dtype)
        u = u + wd * p if wd else u
        u = jnp.array(c.step_size, dtype=u.dtype) * u if callable(learning_rate) else c.step_size * u
        return u, mu, nu

    def update_fn(grads, state, params=None):
        return map_tensors(tensor_update, grads, state, params)

    def step_fn(grads, state, params, key=None, param_specs=None, max_grad_norm=None):
        mesh = _sharded_mesh(param_specs)
        clips = None if max_grad_norm is None else clipping.leaf_clips(grads, max_grad_norm)
        run_kernel, interpret = (dispatch.kernel_mode(per_device=mesh is not None) if use_kernel
                                 else (False, False))
        seeds = None if key is None else sr_params.leaf_seeds(key, len(jax.tree.leaves(params)))
        g_leaves, treedef = jax.tree.flatten(grads)
        specs = [None] * len(g_leaves) if mesh is None else treedef.flatten_up_to(param_specs)
        unsplit = []  # (param shape, why not per device) of kernel-eligible tensors left to the jnp step

        def route_of(g, mu, nu, p, spec):
            """How one tensor's step runs: False the jnp step, True the kernel (no mesh), (`fused_adam.ShardLayout`,
            spec) the kernel per device. bfloat16 params take the kernel when a key seeds their stochastic rounding
            (to nearest: the jnp step)."""
            if not (run_kernel and fused_adam.kernel_eligible(p, g, mu, nu, key is not None)):
                return False
            if mesh is None:
                return True
            layout, reason = fused_adam.per_device_layout(p, mu, spec, mesh)
            if layout is None:
                unsplit.append((p.shape, reason))
                return False
            return layout, jax.sharding.PartitionSpec() if spec is None else spec

        routes = [route_of(*leaves) for leaves in zip(g_leaves, *(treedef.flatten_up_to(tree) for tree in (
            state.mu, state.nu, params)), specs, strict=True)]
        # Unchunked: the kernel's tensors (it streams them itself), and under a mesh the jnp step's tensors split
        # over it, since XLA partitions a chunk loop over a split tensor by gathering it; tensors whole on every
        # device are chunked as on one device.
        whole = [r is not False or (mesh is not None and _splits(spec, mesh)) for r, spec in zip(routes, specs)]

        def tensor_step(g, mu, nu, p, offset, wd, c, seed, route, clip):
            step_size = jnp.asarray(c.step_size, jnp.float32)
            args = (b1, b2, eps, c.bc1, c.bc2_sqrt, step_size, wd)
            if route is True:
                return fused_adam.fused_step(p, g, mu, nu, *args, seed=seed, clip=clip, interpret=interpret)
            if route is not False:
                layout, spec = route
                new_p, mu, nu = fused_adam.fused_step_per_device(p, g, mu, nu, layout, *args, seed=seed, clip=clip,
                                                                 interpret=interpret)
                return jax.lax.with_sharding_constraint(new_p, spec), mu, nu  # where a layout moved p: back
            return fused_adam.fused_step_reference(p, g, mu, nu, config, b1, b2, eps, c.bc1, c.bc2_sqrt, step_size,
                                                   wd, seed, offset, clip=clip)

        out = map_tensors(tensor_step, grads, state, params, seeds, routes, in_place=True, whole=whole, clips=clips)
        if unsplit:
            _warn_unsplit(len(unsplit), sum(math.prod(shape) for shape, _ in unsplit), *unsplit[0])
        return out

    return FusedTransformation(init_fn, update_fn, step_fn, folds_clipping=True)


def _sharded_mesh(param_specs):
    """The context mesh when the step runs per device (`param_specs` given, a mesh of several devices set while
    tracing, not already inside a shard_map), else None."""
    if param_specs is None:
        return None
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        raise ValueError("param_specs lay params out on a mesh, but no mesh is set while tracing: trace the step "
                         "inside `with jax.set_mesh(mesh):` (or jax.sharding.use_abstract_mesh), or pass "
                         "param_specs=None")
    return None if mesh.size == 1 or mesh.manual_axes else mesh


def _splits(spec, mesh) -> bool:
    """Whether PartitionSpec `spec` splits its array over the mesh (names an axis of more than one device)."""
    named = [a for d in (spec or ()) if d is not None for a in ((d,) if isinstance(d, str) else d)]
    return any(mesh.shape.get(a, 1) > 1 for a in named)


@functools.lru_cache(maxsize=None)
def _warn_unsplit(count: int, elements: int, shape: tuple, reason: str) -> None:
    """Says once per distinct case that some tensors' sharding kept them off the per-device kernel (slower)."""
    warnings.warn(f"qjax: the fused AdamW step runs {count} tensor(s) ({elements} elements) through jnp instead of "
                  f"the per-device kernel, e.g. the param of shape {shape}: {reason}", stacklevel=4)


def adamw_8bit(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-4,
               mask=None, block_size: int = 256, min_quantized_size: int = 4096,
               use_kernel: bool = False) -> FusedTransformation:
    """AdamW with 8-bit states: blocks of 256, fp32 absmax, m on the signed and v on the unsigned dynamic tree map.

    State: 2 bytes + 8 / block_size bytes per element (0.254x fp32 AdamW at block 256). `learning_rate` is a float
    or an optax schedule; `mask` as in `optax.adamw` (which params get weight decay); `use_kernel` as in
    `quantized_adamw` (the fused step in `apply_gradients`).
    """
    config = adam.StateConfig("dynamic_signed_8bit", "dynamic_unsigned_8bit", block_size, min_quantized_size)
    return quantized_adamw(config, learning_rate, b1, b2, eps, weight_decay, mask, use_kernel)


def adamw_4bit(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-4,
               mask=None, block_size: int = 128, min_quantized_size: int = 4096,
               use_kernel: bool = False) -> FusedTransformation:
    """AdamW with 4-bit states: blocks of 128, two codes per byte; m on the 3-exponent-bit signed dynamic map, v on
    the linear map 1/16..1 (no zero). State: 1 byte + 8 / block_size bytes per element (0.133x fp32 AdamW).
    `use_kernel` as in `quantized_adamw` (the fused step in `apply_gradients`)."""
    config = adam.StateConfig("dynamic_signed_4bit", "linear_unsigned_4bit", block_size, min_quantized_size)
    return quantized_adamw(config, learning_rate, b1, b2, eps, weight_decay, mask, use_kernel)


def adamw_fp8(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-4,
              mask=None, block_size: int | None = None, dynamic_range_expansion: bool = False,
              min_quantized_size: int = 4096, use_kernel: bool = False) -> FusedTransformation:
    """AdamW with e4m3 states: blocks of 256 with scale = absmax / 448 (torchao), or with
    `dynamic_range_expansion=True` COAT's per-group (128) expansion storing (codes, scale, k, c).

    State: 2 bytes + 8 / 256 bytes per element (0.254x), or 2 + 14 / 128 with expansion (0.264x).
    """
    if dynamic_range_expansion not in (True, False):
        raise TypeError(f"dynamic_range_expansion must be a bool, got {dynamic_range_expansion!r}")
    fmt = "e4m3_dre" if dynamic_range_expansion else "e4m3"
    block_size = _DEFAULT_BLOCK[fmt] if block_size is None else block_size
    config = adam.StateConfig(fmt, fmt, block_size, min_quantized_size)
    return quantized_adamw(config, learning_rate, b1, b2, eps, weight_decay, mask, use_kernel)
