"""The optimizer of a training run, from its config: AdamW (fp32 or low-bit states), warmup + cosine LR, clipping.

  optimizer = make_optimizer(config.optimizer, total_steps=config.steps)
  opt_state = optimizer.init(params)
  params, opt_state = optimizer.step(grads, opt_state, params)

    clip_by_global_norm(grad_clip)  ->  AdamW (optax.adamw or qjax.optim.adamw_8bit / _4bit / _fp8)
    The clipping is applied to the gradients before the AdamW step, not chained into it, so that the step is a bare
    AdamW: `qjax.optim.apply_gradients` then runs adamw_8bit and adamw_fp8 through the fused step kernel (one
    Mosaic GPU kernel per float32 tensor; only on a single Hopper GPU, elsewhere the same math through optax).
    lr(step) = linear warmup from 0 to `lr` over `warmup_steps`, then cosine decay to `lr * min_lr_ratio` at
    `total_steps`; the update of step s (0-based) uses lr(s + 1), so no step is wasted on lr = 0.

Weight decay applies to every parameter with ndim >= 2 (weight matrices, and also the token embedding and the ViT's
position embedding and class token), not to norm scales and biases, as in nanoGPT.

Gradient accumulation is not done here (no optax.MultiSteps): the train step averages the gradients of its
micro-batches with `lax.scan` inside one jitted call (see `qjax.train.step`), so one train step is always one
optimizer update, the schedule's count equals the train step, and checkpoints hold no accumulator buffer.
"""

from typing import Any, NamedTuple

import jax
import optax

from qjax import optim as qoptim

OPTIMIZERS = ("adamw", "adamw_8bit", "adamw_4bit", "adamw_fp8")


def _get(cfg, name: str, default: Any = None) -> Any:
    return cfg.get(name, default) if hasattr(cfg, "get") else getattr(cfg, name, default)


def check_optimizer_config(opt, total_steps: int) -> None:
    """Raise ValueError naming the bad field of an optimizer config (see `make_optimizer`) and how to fix it."""
    name = _get(opt, "name")
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; set config.optimizer.name to one of {', '.join(OPTIMIZERS)}")
    if not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"config.steps must be a positive int, got {total_steps!r}")
    lr = _get(opt, "lr")
    if not isinstance(lr, (int, float)) or not lr > 0:
        raise ValueError(f"config.optimizer.lr must be a positive number, got {lr!r}")
    warmup = _get(opt, "warmup_steps", 0)
    if not isinstance(warmup, int) or not 0 <= warmup < total_steps:
        raise ValueError(f"config.optimizer.warmup_steps must be an int in [0, steps={total_steps}), got {warmup!r}; "
                         "lower it or raise config.steps")
    ratio = _get(opt, "min_lr_ratio", 0.1)
    if not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
        raise ValueError(f"config.optimizer.min_lr_ratio must be in [0, 1], got {ratio!r}")
    for field in ("b1", "b2"):
        value = _get(opt, field)
        if not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise ValueError(f"config.optimizer.{field} must be in [0, 1), got {value!r}")
    for field in ("eps", "weight_decay"):
        value = _get(opt, field)
        if not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"config.optimizer.{field} must be a number >= 0, got {value!r}")
    clip = _get(opt, "grad_clip")
    if clip is not None and (not isinstance(clip, (int, float)) or not clip >= 0):
        raise ValueError(f"config.optimizer.grad_clip must be a number >= 0 (0 or None: no clipping), got {clip!r}")


def make_schedule(opt, total_steps: int) -> optax.Schedule:
    """lr as a function of the 0-based train step (module docstring)."""
    lr = float(_get(opt, "lr"))
    warmup = _get(opt, "warmup_steps", 0)
    cosine = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=lr, warmup_steps=warmup, decay_steps=total_steps,
        end_value=lr * float(_get(opt, "min_lr_ratio", 0.1)))
    return lambda step: cosine(step + 1)


def _decay_mask(params):
    return jax.tree.map(lambda p: p.ndim >= 2, params)


class Optimizer(NamedTuple):
    """A run's optimizer: `tx` the AdamW (an optax transformation or a `qjax.optim.QuantizedAdamW`), `grad_clip`
    the global-norm bound applied before it (None: off), `schedule` the lr per 0-based train step."""

    tx: Any
    grad_clip: float | None
    schedule: optax.Schedule

    def init(self, params):
        return self.tx.init(params)

    def step(self, grads, opt_state, params):
        """(grads, opt_state, params) -> (new params, new opt_state): clip, then one AdamW step."""
        if self.grad_clip:
            grads, _ = optax.clip_by_global_norm(self.grad_clip).update(grads, optax.EmptyState())
        return qoptim.apply_gradients(self.tx, grads, opt_state, params)


def make_optimizer(opt, total_steps: int) -> Optimizer:
    """The `Optimizer` of an optimizer config.

    Args:
      opt: a ConfigDict / dataclass / dict with name (one of OPTIMIZERS), lr, warmup_steps, b1, b2, eps,
        weight_decay, grad_clip (0 or None: off) and optionally min_lr_ratio (default 0.1).
      total_steps: the configured length of the run (the cosine ends there, wherever a run is stopped).
    """
    check_optimizer_config(opt, total_steps)
    schedule = make_schedule(opt, total_steps)
    kwargs = dict(learning_rate=schedule, b1=float(_get(opt, "b1")), b2=float(_get(opt, "b2")),
                  eps=float(_get(opt, "eps")), weight_decay=float(_get(opt, "weight_decay")), mask=_decay_mask)
    name = _get(opt, "name")
    if name == "adamw":
        tx = optax.adamw(**kwargs)
    elif name in ("adamw_8bit", "adamw_fp8"):
        tx = getattr(qoptim, name)(**kwargs, use_kernel=True)  # the fused step where it can run (module docstring)
    else:
        tx = getattr(qoptim, name)(**kwargs)
    clip = _get(opt, "grad_clip")
    return Optimizer(tx, float(clip) if clip else None, schedule)
