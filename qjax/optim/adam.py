"""The Adam core with low-precision states: `scale_by_quantized_adam` and its per-tensor math.

The optimizers built on it (adamw_8bit, adamw_4bit, adamw_fp8, the fused step) are in `qjax.optim.adamw`; the fused
step's reference (`qjax.optim.fused_adam`) calls `update_reference`, and its kernel the same `adam_math.adam_math`.

Per tensor, with t the step (1-based) and g the gradient in float32 (torchao `low_bit_optim` semantics):
  m_old, v_old = dequantize(state)                     float32
  m = m_old + (1 - b1) (g - m_old);  v = v_old + (1 - b2) (g*g - v_old)
  direction = (m / (1 - b1**t)) / (sqrt(v) / sqrt(1 - b2**t) + eps)    from the *un-quantized* new m, v
  state = quantize(m), quantize(v)
Tensors with fewer than `min_quantized_size` elements, or whose size is not a multiple of the block, keep float32 m
and v (norm scales, biases); the same math applies.

Non-finite gradients (documented, tested): a NaN gradient element gives a NaN direction for that element at once;
its m and v become NaN and, once stored, NaN spreads to the whole state block (the block's absmax is NaN), so every
element of that block gets NaN updates from the next step on. NaN is never turned into a finite value; skip such
steps upstream (e.g. `optax.apply_if_finite`) to avoid the poisoning. An all-zero gradient is fine: with zero states
it gives a zero direction (0 / (0 + eps)), and otherwise m, v decay as in fp32 Adam.
"""

import dataclasses
import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from qjax.optim import adam_math, blockwise, streaming


def is_real_number(value) -> bool:
    """An int or float (NumPy's too), not a bool: the optimizers' argument checks (True is an int to Python, never a
    learning rate or a decay)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class StateConfig:
    """How Adam's two moments are stored.

    Attributes:
      mu_format, nu_format: state formats from `blockwise.STATE_FORMATS` (m is signed, v is non-negative).
      block_size: elements per absmax/scale block (per COAT group for "e4m3_dre").
      min_quantized_size: tensors smaller than this keep float32 states.
    """

    mu_format: str
    nu_format: str
    block_size: int
    min_quantized_size: int = 4096

    def __post_init__(self):
        blockwise.check_format(self.mu_format, self.block_size)
        blockwise.check_format(self.nu_format, self.block_size)
        if self.mu_format in ("dynamic_unsigned_8bit", "linear_unsigned_4bit"):
            raise ValueError(f"mu_format {self.mu_format!r} is unsigned but Adam's first moment is signed; use "
                             "'dynamic_signed_8bit', 'dynamic_signed_4bit', 'e4m3' or 'e4m3_dre'")
        if not isinstance(self.min_quantized_size, int) or self.min_quantized_size < 0:
            raise ValueError(f"min_quantized_size must be a non-negative int, got {self.min_quantized_size!r}")

    def quantizes(self, shape) -> bool:
        return blockwise.can_quantize(tuple(shape), self.block_size, self.min_quantized_size)


class QuantizedAdamState(NamedTuple):
    """count: int32 (), the steps taken; mu, nu: pytrees like params whose leaves are float32 arrays or quantized
    state tensors (`init_moment`)."""

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


def _load(moment) -> jax.Array:
    return blockwise.dequantize(moment) if blockwise.is_quantized(moment) else moment


def _store(value: jax.Array, like, fmt: str, block_size: int):
    return blockwise.quantize(value, fmt, block_size) if blockwise.is_quantized(like) else value


def update_reference(g, mu, nu, config: StateConfig, b1, b2, eps, bc1, bc2_sqrt):
    """jnp reference for one tensor: (grad, mu state, nu state) -> (direction f32, new mu state, new nu state)."""
    direction, m, v = adam_math.adam_math(g, _load(mu), _load(nu), b1, b2, eps, bc1, bc2_sqrt)
    return (direction, _store(m, mu, config.mu_format, config.block_size),
            _store(v, nu, config.nu_format, config.block_size))


def bias_corrections(count, b1: float, b2: float):
    """float32 1 - b1**t and sqrt(1 - b2**t) for the 1-based step t = count."""
    t = count.astype(jnp.float32)
    return 1 - jnp.float32(b1) ** t, jnp.sqrt(1 - jnp.float32(b2) ** t)


def scale_by_quantized_adam(config: StateConfig, b1: float = 0.9, b2: float = 0.999,
                            eps: float = 1e-8) -> optax.GradientTransformation:
    """Adam's direction (no lr, no weight decay) with states stored per `config` (module docstring).

    Updates have the grads' shapes and dtypes (computed in float32).
    """
    if not all(is_real_number(v) for v in (b1, b2, eps)):
        raise TypeError(f"b1, b2 and eps must be numbers, got b1={b1!r}, b2={b2!r}, eps={eps!r}")
    if not 0 <= b1 < 1 or not 0 <= b2 < 1:
        raise ValueError(f"b1 and b2 must be in [0, 1), got b1={b1}, b2={b2}")
    if not 0 <= eps < float("inf"):  # also refuses NaN
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")

    def init_fn(params):
        return QuantizedAdamState(
            count=jnp.zeros((), jnp.int32),
            mu=jax.tree.map(lambda p: init_moment(p, config.mu_format, config), params),
            nu=jax.tree.map(lambda p: init_moment(p, config.nu_format, config), params))

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        bc1, bc2_sqrt = bias_corrections(count, b1, b2)

        def tensor(g, mu, nu, p, offset):
            del p, offset
            direction, mu, nu = update_reference(g, mu, nu, config, b1, b2, eps, bc1, bc2_sqrt)
            return direction.astype(g.dtype), mu, nu

        g_leaves, treedef = jax.tree.flatten(updates)
        # Streamed: temporaries of about one group of tensors, not every tensor's float32 m and v at once.
        out = streaming.run(tensor, [(g, mu, nu, None) for g, mu, nu in zip(
            g_leaves, treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu))], in_place=False)
        new_updates = treedef.unflatten([o[0] for o in out])
        new_mu = treedef.unflatten([o[1] for o in out])
        new_nu = treedef.unflatten([o[2] for o in out])
        return new_updates, QuantizedAdamState(count, new_mu, new_nu)

    return optax.GradientTransformation(init_fn, update_fn)
