"""INT8 weight-only training: weights live as int8 codes + one float32 scale per output channel, nothing else.

  params = qjax.int8_params.to_int8_params(float_params)          # 2-D+ leaves with >= min_size elements
  loss, grads = qjax.int8_params.int8_value_and_grad(loss_fn)(params, batch)   # grads: float, weights' shapes
  updates, opt_state = tx.update(grads, opt_state, qjax.int8_params.dequantize_params(params))
  params = qjax.optim.apply_updates_int8(params, updates, key)   # dequantize -> add -> requantize with SR

This module is the parameter type and its Flax glue (below the layers that read it); the optimizer's update,
`apply_updates_int8`, is `qjax.optim.sr_params`'. `qjax.optim` re-exports all of it.

Layout: a weight of shape (..., in, out) (Flax's Dense kernel layout) is stored as `data` int8 of the same shape and
`scale` float32 of shape (1, ..., 1, out): one scale per output channel (a torch "row"), scale = absmax / 127 over
all other axes; all-zero channels get scale 1. Each update requantizes with a *fresh* absmax and stochastic
rounding (qjax.stochastic, one seed per leaf), so small updates survive in expectation: E[new w] = w + u.

The forward uses the int8 weight directly: in an `nn.Dense` with `qjax.DotGeneral` and
`promote_dtype=qjax.int8_params.promote_dtype` (as qjax's models build), a recipe whose forward reads the weight as int8 rows (int8_rowwise) multiplies the stored codes and scales
on the int8 GEMM (`Int8Param.forward_operand`), with no requantization; other recipes quantize the float view.

Gradients: int8 arrays are not differentiable, so `int8_value_and_grad` differentiates with respect to the
dequantized weight (the straight-through view used by torchao / gau-nernst int8 weight-only training) and returns a
gradient of the weight's shape in place of each `Int8Param`, in `grad_dtype` (float32 by default; the train step
uses the model's compute dtype, which holds the bf16 GEMM's gradient exactly).

Memory: a float view made from the params alone (`dequantize`) is something XLA may compute at the start of a
jitted step and keep until it is used; `Int8Param.after(x)` makes the view wait for the value that needs it, so
the views of a model's layers (and the optimizer's, `dequantize_like`) exist one layer / group at a time.

NaN: a NaN in w + u makes that channel's scale NaN, so the whole channel dequantizes to NaN (never finite again).
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import dtypes as flax_dtypes
from jax import lax

from qjax import recipes as recipes_lib
from qjax.quantize import QTensor, QuantSpec, quantize_with_seed

_INT8_ROW = QuantSpec("int8", "row")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Param:
    """An int8 weight. data: int8 (..., in, out); scale: float32 (1, ..., 1, out)."""

    data: jax.Array
    scale: jax.Array

    @property
    def shape(self):
        return self.data.shape

    @property
    def ndim(self):
        return self.data.ndim

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return (self.data.astype(jnp.float32) * self.scale).astype(dtype)

    def after(self, x) -> "Int8Param":
        """This weight, readable only once `x` (any array or pytree) exists: an optimization barrier. A float view
        made from it is computed where x is, e.g. per layer, instead of at the start of a jitted step, where XLA
        computes every weight's view (they depend on the params only) and keeps them all alive at once."""
        (data, scale), _ = lax.optimization_barrier(((self.data, self.scale), x))
        return dataclasses.replace(self, data=data, scale=scale)

    def forward_operand(self) -> QTensor:
        """A 2-D (in, out) weight as the forward GEMM of y = x . w reads it: (out, in) int8 codes with one scale per
        row (output channel), i.e. what `qjax.quantize(w.T, QuantSpec("int8", "row"))` computes, from the stored
        codes (a transpose of int8 data: no pass over a float copy, no rounding)."""
        if self.data.ndim != 2:
            raise ValueError(f"forward_operand needs a 2-D (in, out) weight, got shape {self.data.shape}")
        return QTensor(self.data.T, self.scale.T, "row")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Int8ParamWithDelta(Int8Param):
    # The differentiable stand-in int8_value_and_grad substitutes: dequantize() adds a float zero `delta`, and the
    # gradient with respect to delta is the gradient with respect to the dequantized weight.
    delta: jax.Array = None

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return (self.data.astype(jnp.float32) * self.scale + self.delta).astype(dtype)


def _is_int8(x) -> bool:
    return isinstance(x, Int8Param)


def quantize_int8_param(w: jax.Array, seed: jax.Array | None = None) -> Int8Param:
    """Float weight (..., out), ndim >= 2 -> Int8Param; stochastic rounding when a uint32 `seed` is given.

    One scale per output channel: the core int8 "row" quantization (`qjax.quantize`) of w viewed as (out, in), so
    all-zero channels get scale 1 and a NaN / Inf channel dequantizes to NaN.
    """
    if w.ndim < 2:
        raise ValueError(f"int8 weight-only params need ndim >= 2 (..., in, out), got shape {w.shape}")
    out = w.shape[-1]
    spec = QuantSpec("int8", "row", stochastic=seed is not None)
    q = quantize_with_seed(w.reshape(-1, out).T, spec, seed, operand="int8 weight as (out, in)")
    return Int8Param(q.data.T.reshape(w.shape), q.scale.T.reshape((1,) * (w.ndim - 1) + (out,)))


def check_recipe(recipe) -> None:
    """ValueError for block-scaled recipes with int8 weight-only params: the stored per-output-channel scales cannot
    serve as 128x128 block scales, so every step would requantize the weight from a dequantized copy (int8_rowwise
    reads the codes as stored); and for the data-flow recipes, whose fused layers take float kernels."""
    recipe = recipes_lib.recipe(recipe)
    if recipe.is_block_scaled:
        raise ValueError(f"int8 weight-only params (one scale per output channel) do not run block-scaled recipes "
                         f"such as {recipe.name!r}: use int8_rowwise (its forward reads the stored int8 codes) or "
                         "another row / tensor recipe, or float params")
    if recipe.saved is not None:
        raise ValueError(f"int8 weight-only params do not run the data-flow recipe {recipe.name!r} (its fused "
                         "norm + linear layers take float kernels): use int8_rowwise, or float params")


def weight_operands(recipe, lhs: jax.Array, weight: "Int8Param", dimension_numbers):
    """(float rhs, rhs_quantized or None) for `qjax.dot_general(lhs, rhs, ..., rhs_quantized=)` with an Int8Param
    weight as rhs: its dequantized values in lhs's dtype, and its stored codes where the forward GEMM of `recipe`
    reads the weight as int8 rows (nearest) and the weight is a 2-D (in, out) Dense kernel (rhs dim 0 contracted).

    Raises TypeError for non-float activations and ValueError for block-scaled recipes (`check_recipe`)."""
    if not jnp.issubdtype(lhs.dtype, jnp.floating):
        raise TypeError(f"an int8 weight-only param multiplies float activations, got lhs of dtype {lhs.dtype}: "
                        "cast it to bfloat16 / float32 first")
    check_recipe(recipe)
    recipe = recipes_lib.recipe(recipe)
    weight = weight.after(lhs)  # its float view (and transposed codes) made when the layer runs
    (_, rhs_contract), (_, rhs_batch) = dimension_numbers
    stored = (recipe.fwd is not None and recipe.fwd.rhs == _INT8_ROW and weight.ndim == 2
              and tuple(rhs_contract) == (0,) and not tuple(rhs_batch))
    return weight.dequantize(lhs.dtype), (weight.forward_operand() if stored else None)


def promote_dtype(*args, dtype=None, inexact=True) -> list:
    """Flax's `promote_dtype` (`nn.Dense(promote_dtype=...)`) that passes Int8Param leaves through unchanged, so
    the layer's dot_general (`qjax.DotGeneral`) gets the int8 weight; other arguments are promoted as usual."""
    floats = flax_dtypes.promote_dtype(*[None if _is_int8(a) else a for a in args], dtype=dtype, inexact=inexact)
    return [a if _is_int8(a) else f for a, f in zip(args, floats)]


def to_int8_params(params, min_size: int = 4096):
    """Converts float leaves with ndim >= 2 and at least `min_size` elements to Int8Param (round to nearest)."""
    return jax.tree.map(lambda w: quantize_int8_param(w) if w.ndim >= 2 and w.size >= min_size else w, params)


def has_int8_params(params) -> bool:
    """Whether a pytree holds Int8Param leaves."""
    return any(_is_int8(p) for p in jax.tree.leaves(params, is_leaf=_is_int8))


def dequantize_params(params, dtype=jnp.float32):
    """Int8Param leaves -> float arrays of `dtype`; other leaves unchanged."""
    return jax.tree.map(lambda p: p.dequantize(dtype) if _is_int8(p) else p, params, is_leaf=_is_int8)


def dequantize_like(params, grads):
    """Int8Param leaves -> their float view in their gradient's dtype (the params an optimizer's `update` sees, e.g.
    for weight decay); other leaves unchanged. Each view is made only once its gradient exists (a barrier): XLA
    would otherwise compute every view at the start of the train step and keep them all through the backward pass."""
    return jax.tree.map(lambda p, g: p.after(g).dequantize(g.dtype) if _is_int8(p) else p, params, grads,
                        is_leaf=_is_int8)


def int8_value_and_grad(fun, has_aux: bool = False, grad_dtype=jnp.float32):
    """`jax.value_and_grad(fun)` for `fun(params, *args)` whose params hold Int8Param leaves.

    Gradients of Int8Param leaves are arrays of `grad_dtype` and the weight's shape (gradient w.r.t. the dequantized
    weight); other leaves get ordinary gradients. The model must read Int8Param weights via `.dequantize()` (as
    a bf16 DotGeneral does). A model that multiplies the weight in its compute dtype (qjax's models: bfloat16 by default)
    computes the weight's gradient in that dtype: `grad_dtype` = the compute dtype holds it exactly, in half the
    bytes of float32 (torchao's int8 weight-only training does the same).
    """

    def wrapped(params, *args, **kwargs):
        int8_leaves = [p for p in jax.tree.leaves(params, is_leaf=_is_int8) if _is_int8(p)]
        deltas = [jnp.zeros(p.shape, grad_dtype) for p in int8_leaves]

        def with_deltas(float_parts, deltas):
            it = iter(deltas)
            return jax.tree.map(lambda p, f: _Int8ParamWithDelta(p.data, p.scale, next(it)) if _is_int8(p) else f,
                                params, float_parts, is_leaf=_is_int8)

        float_parts = jax.tree.map(lambda p: None if _is_int8(p) else p, params, is_leaf=_is_int8)
        value, (g_float, g_deltas) = jax.value_and_grad(
            lambda fp, d: fun(with_deltas(fp, d), *args, **kwargs), argnums=(0, 1), has_aux=has_aux)(
                float_parts, deltas)
        it = iter(g_deltas)
        grads = jax.tree.map(lambda p, g: next(it) if _is_int8(p) else g, params, g_float, is_leaf=_is_int8)
        return value, grads

    return wrapped
