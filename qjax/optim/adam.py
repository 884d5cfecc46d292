"""AdamW with low-precision states as optax transformations: adamw_8bit, adamw_4bit, adamw_fp8.

  tx = qjax.optim.adamw_8bit(learning_rate=schedule, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
  state = tx.init(params); updates, state = tx.update(grads, state, params); params = optax.apply_updates(...)
  params, state = qjax.optim.apply_gradients(tx, grads, state, params)     # the same step, fused where possible

All three are `optax.chain(scale_by_quantized_adam(config, ...), add_decayed_weights(wd, mask),
scale_by_learning_rate(lr))`, exactly how `optax.adamw` is built, so they compose with `optax.chain`, clipping,
schedules, `optax.MultiSteps`, sharded params and orbax like any optax optimizer. They are returned as a
`QuantizedAdamW`: an `optax.GradientTransformation` (init, update) with a `step` attribute besides. `apply_gradients`
calls `step`, and with `use_kernel=True` (e4m3 or 8-bit states, on a single Hopper GPU) it updates each eligible
tensor's param and moments in one fused kernel (`qjax.optim.fused_adam`: 16 instead of ~28 bytes moved per float32
param); every other tensor, and every tensor without `use_kernel`, takes exactly the optax path. Only a bare
`QuantizedAdamW` passed to `apply_gradients` takes the kernel: inside `optax.chain` (e.g. after clipping) or
`optax.MultiSteps` it is an ordinary optax optimizer (`qjax.train` clips the gradients before the step instead, so
its adamw_8bit and adamw_fp8 run the kernel).

Per tensor, with t the step (1-based) and g the gradient in float32 (torchao `low_bit_optim` semantics):
  m_old, v_old = dequantize(state)                     float32
  m = m_old + (1 - b1) (g - m_old);  v = v_old + (1 - b2) (g*g - v_old)
  direction = (m / (1 - b1**t)) / (sqrt(v) / sqrt(1 - b2**t) + eps)    from the *un-quantized* new m, v
  state = quantize(m), quantize(v)
  update = -lr * (direction + wd * param)              decoupled weight decay, from the old param
Tensors with fewer than `min_quantized_size` elements, or whose size is not a multiple of the block, keep float32 m
and v (norm scales, biases); the same math applies.

Non-finite gradients (documented, tested): a NaN gradient element gives a NaN update for that element at once; its
m and v become NaN and, once stored, NaN spreads to the whole state block (the block's absmax is NaN), so every
element of that block gets NaN updates from the next step on. NaN is never turned into a finite value; skip such
steps upstream (e.g. `optax.apply_if_finite`) to avoid the poisoning. An all-zero gradient is fine: with zero states
it gives a zero direction (0 / (0 + eps)), and otherwise m, v decay as in fp32 Adam.
"""

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from qjax.optim import blockwise, fused_adam
from qjax.optim.fused_adam import update_reference

_DEFAULT_BLOCK = {"dynamic_signed_8bit": 256, "dynamic_unsigned_8bit": 256, "dynamic_signed_4bit": 128,
                  "linear_unsigned_4bit": 128, "e4m3": 256, "e4m3_dre": 128}


@dataclasses.dataclass(frozen=True)
class StateConfig:
    """How Adam's two moments are stored.

    Attributes:
      mu_format, nu_format: state formats from `blockwise.STATE_FORMATS` (m is signed, v is non-negative).
      block_size: elements per absmax/scale block (per COAT group for "e4m3_dre").
      min_quantized_size: tensors smaller than this keep float32 states.
      use_kernel: True: `apply_gradients` runs e4m3 and 8-bit states through the fused Mosaic GPU step kernel on a
        single Hopper GPU (elsewhere the optax path; see `qjax.optim.fused_adam`). `tx.update` always runs the
        reference.
    """

    mu_format: str
    nu_format: str
    block_size: int
    min_quantized_size: int = 4096
    use_kernel: bool = False

    def __post_init__(self):
        blockwise.check_format(self.mu_format, self.block_size)
        blockwise.check_format(self.nu_format, self.block_size)
        if self.mu_format in ("dynamic_unsigned_8bit", "linear_unsigned_4bit"):
            raise ValueError(f"mu_format {self.mu_format!r} is unsigned but Adam's first moment is signed; use "
                             "'dynamic_signed_8bit', 'dynamic_signed_4bit', 'e4m3' or 'e4m3_dre'")
        if not isinstance(self.min_quantized_size, int) or self.min_quantized_size < 0:
            raise ValueError(f"min_quantized_size must be a non-negative int, got {self.min_quantized_size!r}")
        if not isinstance(self.use_kernel, bool):
            raise ValueError(f"use_kernel must be True or False, got {self.use_kernel!r}")
        if self.use_kernel and not ((self.mu_format, self.nu_format) in fused_adam.KERNEL_FORMATS
                                    and self.block_size in fused_adam.KERNEL_BLOCK_SIZES):
            raise ValueError(f"use_kernel=True: the fused kernel supports e4m3 states (adamw_fp8 without dynamic "
                             f"range expansion) and adamw_8bit's states, with block_size 128 or 256; got mu "
                             f"{self.mu_format!r}, nu {self.nu_format!r}, block {self.block_size}; use "
                             "use_kernel=False")

    def quantizes(self, shape) -> bool:
        return blockwise.can_quantize(tuple(shape), self.block_size, self.min_quantized_size)


class QuantizedAdamState(NamedTuple):
    """count: int32 (); mu, nu: pytrees like params whose leaves are float32 arrays or quantized state tensors."""

    count: jax.Array
    mu: Any
    nu: Any


def init_moment(param: jax.Array, fmt: str, config: StateConfig):
    """Zero state for one param: quantized if `config.quantizes(param.shape)`, else float32 zeros."""
    if not config.quantizes(param.shape):
        return jnp.zeros(param.shape, jnp.float32)
    # One quantized zero block, repeated: quantizing the whole zero tensor made XLA constant-fold a reduction over
    # it at compile time ("Constant folding an instruction is taking > 4s" on the 1.1B model's init).
    block = blockwise.quantize(jnp.zeros(config.block_size, jnp.float32), fmt, config.block_size)
    n_blocks = math.prod(param.shape) // config.block_size
    repeat = lambda a: jnp.broadcast_to(a, (n_blocks, *a.shape[1:]))
    return dataclasses.replace(jax.tree.map(repeat, block), shape=tuple(param.shape))


def _bias_corrections(count, b1: float, b2: float):
    """float32 1 - b1**t and sqrt(1 - b2**t) for the 1-based step t = count."""
    t = count.astype(jnp.float32)
    return 1 - jnp.float32(b1) ** t, jnp.sqrt(1 - jnp.float32(b2) ** t)


def scale_by_quantized_adam(config: StateConfig, b1: float = 0.9, b2: float = 0.999,
                            eps: float = 1e-8) -> optax.GradientTransformation:
    """Adam's direction (no lr, no weight decay) with states stored per `config` (module docstring).

    Updates have the grads' shapes and dtypes (computed in float32).
    """
    if not 0 <= b1 < 1 or not 0 <= b2 < 1:
        raise ValueError(f"b1 and b2 must be in [0, 1), got b1={b1}, b2={b2}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    def init_fn(params):
        return QuantizedAdamState(
            count=jnp.zeros((), jnp.int32),
            mu=jax.tree.map(lambda p: init_moment(p, config.mu_format, config), params),
            nu=jax.tree.map(lambda p: init_moment(p, config.nu_format, config), params))

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        bc1, bc2_sqrt = _bias_corrections(count, b1, b2)

        g_leaves, treedef = jax.tree.flatten(updates)
        out = [update_reference(g, mu, nu, config, b1, b2, eps, bc1, bc2_sqrt)
               for g, mu, nu in zip(g_leaves, treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu))]
        new_updates = treedef.unflatten([d.astype(g.dtype) for (d, _, _), g in zip(out, g_leaves)])
        new_mu = treedef.unflatten([o[1] for o in out])
        new_nu = treedef.unflatten([o[2] for o in out])
        return new_updates, QuantizedAdamState(count, new_mu, new_nu)

    return optax.GradientTransformation(init_fn, update_fn)


class QuantizedAdamW(optax.GradientTransformation):
    """What adamw_8bit / _4bit / _fp8 return: an `optax.GradientTransformation` (`init`, `update`; isinstance
    checks and tuple unpacking work as for any optax transformation) that also carries
    `step(grads, state, params) -> (params, state)`, the step `apply_gradients` runs (module docstring)."""

    step: Callable  # set in __new__: a NamedTuple subclass cannot add fields, but may add attributes

    def __new__(cls, init: Callable, update: Callable, step: Callable):
        self = super().__new__(cls, init, update)
        self.step = step
        return self


def apply_gradients(tx, grads, opt_state, params):
    """One optimizer step -> (new params, new opt_state); the same result as `tx.update` + `optax.apply_updates`.

    Any optax transformation works. For a `QuantizedAdamW` made with `use_kernel=True`, each float32 tensor with
    e4m3 or 8-bit states is updated by one fused kernel that reads and writes param, gradient and states once (see
    `qjax.optim.fused_adam`; on a GPU its results may differ from the optax path by float32 rounding).
    """
    if isinstance(tx, QuantizedAdamW):
        return tx.step(grads, opt_state, params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def _decay_per_leaf(weight_decay: float, mask, params) -> list:
    """Each param leaf's weight decay (0 where `mask` is False), as optax.masked applies the mask (tree prefix)."""
    if mask is None:
        return [weight_decay] * len(jax.tree.leaves(params))
    mask_tree = mask(params) if callable(mask) else mask  # optax calls it on the updates: same structure
    per_leaf = jax.tree.map(lambda m, sub: jax.tree.map(lambda _: weight_decay if m else 0.0, sub), mask_tree,
                            params)
    return jax.tree.leaves(per_leaf)


def _adamw(config, learning_rate, b1, b2, eps, weight_decay, mask):
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    weight_decay = float(weight_decay)  # a Python float: optax skips a zero decay only then, and so does the kernel
    chain = optax.chain(
        scale_by_quantized_adam(config, b1, b2, eps),
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )

    def step(grads, state, params):
        updates, new_state = chain.update(grads, state, params)
        new_params = optax.apply_updates(params, updates)
        if not config.use_kernel:
            return new_params, new_state
        run_kernel, interpret = fused_adam.kernel_mode()
        if not run_kernel:
            return new_params, new_state

        # The optax results of the tensors the kernel takes are left unused, and XLA removes their computation.
        adam_state, _, lr_state = state
        bc1, bc2_sqrt = _bias_corrections(optax.safe_increment(adam_state.count), b1, b2)
        lr = learning_rate(lr_state.count) if callable(learning_rate) else learning_rate
        step_size = jnp.asarray(-1 * lr, jnp.float32)
        p_leaves, treedef = jax.tree.flatten(params)
        leaves = [p_leaves, treedef.flatten_up_to(grads), treedef.flatten_up_to(adam_state.mu),
                  treedef.flatten_up_to(adam_state.nu), treedef.flatten_up_to(new_params),
                  treedef.flatten_up_to(new_state[0].mu), treedef.flatten_up_to(new_state[0].nu)]
        outs = []
        for p, g, mu, nu, p_new, mu_new, nu_new, wd in zip(*leaves, _decay_per_leaf(weight_decay, mask, params)):
            if fused_adam.kernel_eligible(p, g, mu, nu):
                p_new, mu_new, nu_new = fused_adam.fused_step(p, g, mu, nu, b1, b2, eps, bc1, bc2_sqrt, step_size,
                                                              wd, interpret=interpret)
            outs.append((p_new, mu_new, nu_new))
        new_params, new_mu, new_nu = (treedef.unflatten([o[i] for o in outs]) for i in range(3))
        return new_params, (new_state[0]._replace(mu=new_mu, nu=new_nu), *new_state[1:])

    return QuantizedAdamW(chain.init, chain.update, step)


def adamw_8bit(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-4,
               mask=None, block_size: int = 256, min_quantized_size: int = 4096,
               use_kernel: bool = False) -> QuantizedAdamW:
    """AdamW with 8-bit states: blocks of 256, fp32 absmax, m on the signed and v on the unsigned dynamic tree map.

    State: 2 bytes + 8 / block_size bytes per element (0.254x fp32 AdamW at block 256). `learning_rate` is a float
    or an optax schedule; `mask` as in `optax.adamw` (which params get weight decay); `use_kernel` as in
    `StateConfig` (the fused step in `apply_gradients`).
    """
    config = StateConfig("dynamic_signed_8bit", "dynamic_unsigned_8bit", block_size, min_quantized_size, use_kernel)
    return _adamw(config, learning_rate, b1, b2, eps, weight_decay, mask)


def adamw_4bit(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-4,
               mask=None, block_size: int = 128, min_quantized_size: int = 4096) -> QuantizedAdamW:
    """AdamW with 4-bit states: blocks of 128, two codes per byte; m on the 3-exponent-bit signed dynamic map, v on
    the linear map 1/16..1 (no zero). State: 1 byte + 8 / block_size bytes per element (0.133x fp32 AdamW)."""
    config = StateConfig("dynamic_signed_4bit", "linear_unsigned_4bit", block_size, min_quantized_size)
    return _adamw(config, learning_rate, b1, b2, eps, weight_decay, mask)


def adamw_fp8(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-4,
              mask=None, block_size: int | None = None, dynamic_range_expansion: bool = False,
              min_quantized_size: int = 4096, use_kernel: bool = False) -> QuantizedAdamW:
    """AdamW with e4m3 states: blocks of 256 with scale = absmax / 448 (torchao), or with
    `dynamic_range_expansion=True` COAT's per-group (128) expansion storing (codes, scale, k, c).

    State: 2 bytes + 8 / 256 bytes per element (0.254x), or 2 + 14 / 128 with expansion (0.264x).
    """
    if dynamic_range_expansion not in (True, False):
        raise TypeError(f"dynamic_range_expansion must be a bool, got {dynamic_range_expansion!r}")
    fmt = "e4m3_dre" if dynamic_range_expansion else "e4m3"
    block_size = _DEFAULT_BLOCK[fmt] if block_size is None else block_size
    config = StateConfig(fmt, fmt, block_size, min_quantized_size, use_kernel)
    return _adamw(config, learning_rate, b1, b2, eps, weight_decay, mask)
