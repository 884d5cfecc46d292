"""AdamW with low-precision states as optax GradientTransformations: adamw_8bit, adamw_4bit, adamw_fp8.

  tx = qjax.optim.adamw_8bit(learning_rate=schedule, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
  state = tx.init(params); updates, state = tx.update(grads, state, params); params = optax.apply_updates(...)

All three are `optax.chain(scale_by_quantized_adam(config, ...), add_decayed_weights(wd, mask),
scale_by_learning_rate(lr))`, exactly how `optax.adamw` is built, so they compose with `optax.chain`, clipping,
schedules, `optax.MultiSteps`, sharded params and orbax like any optax optimizer.

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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from qjax.optim import blockwise

_DEFAULT_BLOCK = {"dynamic_signed_8bit": 256, "dynamic_unsigned_8bit": 256, "dynamic_signed_4bit": 128,
                  "linear_unsigned_4bit": 128, "e4m3": 256, "e4m3_dre": 128}


@dataclasses.dataclass(frozen=True)
class StateConfig:
    """How Adam's two moments are stored.

    Attributes:
      mu_format, nu_format: state formats from `blockwise.STATE_FORMATS` (m is signed, v is non-negative).
      block_size: elements per absmax/scale block (per COAT group for "e4m3_dre").
      min_quantized_size: tensors smaller than this keep float32 states.
      use_kernel: True runs e4m3 states through the fused Mosaic GPU kernel (opt-in, see
        `qjax.optim.fused_adam` for its status), False the jnp reference.
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

    def quantizes(self, shape) -> bool:
        return blockwise.can_quantize(tuple(shape), self.block_size, self.min_quantized_size)


class QuantizedAdamState(NamedTuple):
    """count: int32 (); mu, nu: pytrees like params whose leaves are float32 arrays or quantized state tensors."""

    count: jax.Array
    mu: Any
    nu: Any


def init_moment(param: jax.Array, fmt: str, config: StateConfig):
    """Zero state for one param: quantized if `config.quantizes(param.shape)`, else float32 zeros."""
    zeros = jnp.zeros(param.shape, jnp.float32)
    if config.quantizes(param.shape):
        return blockwise.quantize(zeros, fmt, config.block_size)
    return zeros


def _load(moment) -> jax.Array:
    return blockwise.dequantize(moment) if blockwise.is_quantized(moment) else moment


def _store(value: jax.Array, like, fmt: str, block_size: int):
    return blockwise.quantize(value, fmt, block_size) if blockwise.is_quantized(like) else value


def adam_math(g, m_old, v_old, b1, b2, eps, bias_correction1, bias_correction2_sqrt):
    """One Adam step on float32 arrays -> (direction, m, v). Shared by the reference and the fused kernel."""
    g = g.astype(jnp.float32)
    m = m_old + (1 - b1) * (g - m_old)
    v = v_old + (1 - b2) * (g * g - v_old)
    direction = (m / bias_correction1) / (jnp.sqrt(v) / bias_correction2_sqrt + eps)
    return direction, m, v


def update_reference(g, mu, nu, config: StateConfig, b1, b2, eps, bc1, bc2_sqrt):
    """jnp reference for one tensor: (grad, mu state, nu state) -> (direction f32, new mu state, new nu state)."""
    direction, m, v = adam_math(g, _load(mu), _load(nu), b1, b2, eps, bc1, bc2_sqrt)
    return (direction, _store(m, mu, config.mu_format, config.block_size),
            _store(v, nu, config.nu_format, config.block_size))


def scale_by_quantized_adam(config: StateConfig, b1: float = 0.9, b2: float = 0.999,
                            eps: float = 1e-8) -> optax.GradientTransformation:
    """Adam's direction (no lr, no weight decay) with states stored per `config` (module docstring).

    Updates have the grads' shapes and dtypes (computed in float32).
    """
    if not 0 <= b1 < 1 or not 0 <= b2 < 1:
        raise ValueError(f"b1 and b2 must be in [0, 1), got b1={b1}, b2={b2}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    from qjax.optim import fused_adam  # late import: fused_adam imports this module

    def init_fn(params):
        return QuantizedAdamState(
            count=jnp.zeros((), jnp.int32),
            mu=jax.tree.map(lambda p: init_moment(p, config.mu_format, config), params),
            nu=jax.tree.map(lambda p: init_moment(p, config.nu_format, config), params))

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        t = count.astype(jnp.float32)
        bc1 = 1 - jnp.float32(b1) ** t
        bc2_sqrt = jnp.sqrt(1 - jnp.float32(b2) ** t)

        g_leaves, treedef = jax.tree.flatten(updates)
        out = [fused_adam.adam_update(g, mu, nu, config, b1, b2, eps, bc1, bc2_sqrt)
               for g, mu, nu in zip(g_leaves, treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu))]
        new_updates = treedef.unflatten([d.astype(g.dtype) for (d, _, _), g in zip(out, g_leaves)])
        new_mu = treedef.unflatten([o[1] for o in out])
        new_nu = treedef.unflatten([o[2] for o in out])
        return new_updates, QuantizedAdamState(count, new_mu, new_nu)

    return optax.GradientTransformation(init_fn, update_fn)


def _adamw(config, learning_rate, b1, b2, eps, weight_decay, mask):
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    return optax.chain(
        scale_by_quantized_adam(config, b1, b2, eps),
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )


def adamw_8bit(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-4,
               mask=None, block_size: int = 256, min_quantized_size: int = 4096,
               use_kernel: bool = False) -> optax.GradientTransformation:
    """AdamW with 8-bit states: blocks of 256, fp32 absmax, m on the signed and v on the unsigned dynamic tree map.

    State: 2 bytes + 8 / block_size bytes per element (0.254x fp32 AdamW at block 256). `learning_rate` is a float
    or an optax schedule; `mask` as in `optax.adamw` (which params get weight decay).
    """
    config = StateConfig("dynamic_signed_8bit", "dynamic_unsigned_8bit", block_size, min_quantized_size, use_kernel)
    return _adamw(config, learning_rate, b1, b2, eps, weight_decay, mask)


def adamw_4bit(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-4,
               mask=None, block_size: int = 128, min_quantized_size: int = 4096,
               use_kernel: bool = False) -> optax.GradientTransformation:
    """AdamW with 4-bit states: blocks of 128, two codes per byte; m on the 3-exponent-bit signed dynamic map, v on
    the linear map 1/16..1 (no zero). State: 1 byte + 8 / block_size bytes per element (0.133x fp32 AdamW)."""
    config = StateConfig("dynamic_signed_4bit", "linear_unsigned_4bit", block_size, min_quantized_size, use_kernel)
    return _adamw(config, learning_rate, b1, b2, eps, weight_decay, mask)


def adamw_fp8(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-4,
              mask=None, block_size: int | None = None, dynamic_range_expansion: bool = False,
              min_quantized_size: int = 4096, use_kernel: bool = False) -> optax.GradientTransformation:
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
