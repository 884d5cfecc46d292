"""Clipping by the global norm that a fused AdamW step applies inside its own pass over each tensor.

  tx = qjax.optim.chain_fused(qjax.optim.clip_by_global_norm(1.0), qjax.optim.adamw_8bit(lr))

`clip_by_global_norm(max_norm)` is `optax.clip_by_global_norm(max_norm)` (same `init`, `update` and state), marked
so that `chain_fused` folds it into the step of the AdamW after it: the step computes the gradients' global norm
(one reduction, `optax.tree.norm`) and each tensor's update clips its gradient as it reads it
(`adam_math.clip_gradient`), instead of a first pass writing a clipped copy of every gradient (2 to 4 bytes per
param of temporaries at the step's peak). Anywhere else (`optax.chain`, before a transformation without a fused
step) it is optax's.
"""

import math

import jax
import optax

from qjax.optim import adam, adam_math


class ClipByGlobalNorm(optax.GradientTransformation):
    """`optax.clip_by_global_norm(max_norm)` (its `init` and `update`), with `max_norm` for `chain_fused` to fold."""

    max_norm: float  # set in __new__: a NamedTuple subclass cannot add fields, but may add attributes

    def __new__(cls, max_norm: float):
        clip = optax.clip_by_global_norm(max_norm)
        self = super().__new__(cls, clip.init, clip.update)
        self.max_norm = max_norm
        return self


def clip_by_global_norm(max_norm: float) -> ClipByGlobalNorm:
    """Scales all gradients by max_norm / global norm where that norm is >= max_norm, as optax does (module
    docstring). max_norm: a positive Python number (compared and multiplied with optax's weak typing)."""
    if not adam.is_real_number(max_norm) or not (max_norm > 0 and math.isfinite(max_norm)):
        raise ValueError(f"clip_by_global_norm needs a positive finite Python number max_norm, got {max_norm!r}")
    return ClipByGlobalNorm(float(max_norm))


def leaf_clips(grads, max_norm: float) -> list:
    """Per gradient leaf, `adam_math.clip_factors` (keep, divisor, multiplier) of the gradients' global norm: the
    scalars with which `adam_math.clip_gradient` clips that leaf as `optax.clip_by_global_norm(max_norm)` would."""
    norm = optax.tree.norm(grads)
    return [adam_math.clip_factors(norm, max_norm, g.dtype) for g in jax.tree.leaves(grads)]
