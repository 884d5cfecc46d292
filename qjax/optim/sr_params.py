"""BF16 parameters updated with stochastic rounding: no float32 master copy.

  updates, opt_state = tx.update(grads, opt_state, params)        # params are bfloat16
  params = qjax.optim.apply_updates_sr(params, updates, key)       # new key every step

Rounding p + u to bfloat16 to nearest loses every update smaller than half a bf16 ulp of p (2**-9 relative), so
long training stalls; rounding stochastically keeps E[new p] = p + u exactly, which is what a float32 master copy
buys, at 2 bytes per parameter. The random bits are `qjax.stochastic.bf16_bits(seed, element index)` (one hash per
two elements) with one seed per leaf (`leaf_seeds`), so the same key gives the same params bit for bit, here and in
any kernel.

NaN / Inf in p + u stay NaN / Inf (stochastic rounding passes non-finite values through).

INT8 weight-only params (`qjax.int8_params.Int8Param`) are updated the same way by `apply_updates_int8`: dequantize,
add, requantize with stochastic rounding.
"""

import math

import jax
import jax.numpy as jnp
from jax import lax

from qjax import formats, stochastic
from qjax.int8_params import Int8Param, quantize_int8_param
from qjax.optim import streaming


def leaf_seeds(key: jax.Array, n: int) -> list:
    """n uint32 seeds, one per pytree leaf: key_to_seed(fold_in(key, i)) for leaf i in tree-flatten order."""
    return [stochastic.key_to_seed(jax.random.fold_in(key, i)) for i in range(n)]


def round_param(total: jax.Array, dtype, seed: jax.Array | None, offset=0) -> jax.Array:
    """float32 `total` -> `dtype`: stochastic rounding to bfloat16 with bits `stochastic.bf16_bits(seed, offset +
    row-major index)` (the bits `stochastic.stochastic_round_with_seed` draws for a whole tensor when offset is 0,
    so a tensor updated in chunks gets the same bits), plain rounding for other dtypes or when `seed` is None.

    Args:
      total: float32 array. dtype: the param's dtype. seed: uint32 scalar or None.
      offset: uint32 scalar, the index of `total`'s first element in the whole param (chunks of a flattened param).
    """
    if jnp.dtype(dtype) != jnp.bfloat16 or seed is None:
        return total.astype(dtype)
    index = jnp.asarray(offset, jnp.uint32) + lax.iota(jnp.uint32, total.size).reshape(total.shape)
    bits = stochastic.bf16_bits(seed, index)
    return stochastic.round_to_grid(total, formats.BF16, bits).astype(jnp.bfloat16)  # exact: on the bf16 grid


def add_sr(param: jax.Array, update: jax.Array, seed: jax.Array) -> jax.Array:
    """param + update in float32, stochastically rounded back to param's dtype when that is bfloat16.

    Args:
      param: array of any float dtype; bfloat16 gets stochastic rounding, others (e.g. float32) plain rounding.
      update: array of param's shape, any float dtype.
      seed: uint32 scalar.

    Returns:
      The new param, same shape and dtype as `param`.
    """
    return round_param(param.astype(jnp.float32) + update.astype(jnp.float32), param.dtype, seed)


def apply_updates_sr(params, updates, key: jax.Array):
    """`optax.apply_updates` with stochastic rounding for bfloat16 leaves (module docstring).

    Args:
      params: pytree of float arrays (bfloat16 leaves are rounded stochastically; None leaves are kept).
      updates: pytree of updates with params' structure.
      key: a `jax.random.key`; use a fresh one every step (e.g. fold_in(key, step)).

    Returns:
      The new params, same structure, shapes and dtypes.
    """
    if key is None:
        raise ValueError("apply_updates_sr needs key=jax.random.key(...) (a fresh one per step)")
    leaves, treedef = jax.tree.flatten(params)
    update_leaves = treedef.flatten_up_to(updates)
    for p in leaves:
        if not jnp.issubdtype(p.dtype, jnp.floating):
            raise TypeError(f"apply_updates_sr needs float params, got a {p.dtype} leaf; for int8 weights use "
                            "qjax.optim.apply_updates_int8")
    seeds = leaf_seeds(key, len(leaves))
    return treedef.unflatten([add_sr(p, u, s) for p, u, s in zip(leaves, update_leaves, seeds)])


def apply_updates_int8(params, updates, key: jax.Array):
    """Int8Param leaves: dequantize -> add the float update -> requantize (fresh absmax, stochastic rounding).

    Other leaves: `apply_updates_sr` semantics (bf16 rounded stochastically, float32 plainly). One seed per leaf
    from `leaf_seeds(key, n_leaves)`, leaves in tree-flatten order with Int8Param as one leaf.

    The leaves are updated in groups of about 1/`streaming.GROUPS` of the tree's elements, one group after another
    (`streaming.sequenced`), so that the float32 sums a requantization reads twice (the absmax, then the rounding)
    exist for one group at a time rather than for every tensor together. Each leaf's result does not depend on the
    grouping.
    """
    leaves, treedef = jax.tree.flatten(params, is_leaf=lambda x: isinstance(x, Int8Param))
    update_leaves = treedef.flatten_up_to(updates)
    seeds = leaf_seeds(key, len(leaves))

    def update(p, u, s):
        if isinstance(p, Int8Param):
            return quantize_int8_param(p.dequantize() + u.astype(jnp.float32), s)
        return add_sr(p, u, s)

    new = streaming.sequenced(update, list(zip(leaves, update_leaves, seeds)), [math.prod(p.shape) for p in leaves])
    return treedef.unflatten(new)
