"""The optimizer of a training run, from its config: AdamW (fp32 or low-bit states), warmup + cosine LR, clipping.

  optimizer = make_optimizer(config.optimizer, total_steps=config.steps)
  opt_state = optimizer.init(params)
  params, opt_state = optimizer.step(grads, opt_state, params)

    chain_fused(clip_by_global_norm(grad_clip), AdamW)   (optax.adamw or qjax.optim.adamw_8bit / _4bit / _fp8)
    One transformation, whose `qjax.optim.apply_gradients` step clips and then runs adamw_8bit, adamw_4bit and
    adamw_fp8 through the fused step kernel (one Mosaic GPU kernel per float32 tensor, or bf16 tensor with stochastic
    rounding; on a Hopper GPU, per device under a mesh where shards are whole blocks (`fused_adam.per_device_layout`);
    elsewhere the streamed jnp step). Its state is the tuple (clip state, AdamW state), or (AdamW state,) without
    clipping.
    lr(step) = linear warmup from 0 to `lr` over `warmup_steps`, then cosine decay to `lr * min_lr_ratio` at
    `total_steps`; the update of step s (0-based) uses lr(s + 1), so no step is wasted on lr = 0.

Options beyond AdamW's hyperparameters: `dynamic_range_expansion` (adamw_fp8 only: COAT's per-group expansion of
the e4m3 states) and `stochastic_rounding` (params kept in bfloat16, `config.model.param_dtype="bfloat16"`, are
updated with stochastic rounding by `qjax.optim.apply_gradients(..., key)`: no float32 master copy; the low-bit
AdamWs' streamed step computes each update in float32 and rounds it once with the bits `apply_updates_sr` draws).
Int8 weight-only params (`qjax.optim.Int8Param` leaves, `config.model.param_dtype="int8"`) go through `tx.update`:
AdamW sees their dequantized values in their gradients' dtype (its states are shaped like the weights, in that
dtype: the train step's compute dtype), and `qjax.optim.apply_updates_int8` requantizes each with a fresh absmax and
stochastic rounding.

Weight decay applies to every parameter with ndim >= 2 (weight matrices, and also the token embedding and the ViT's
position embedding and class token), not to norm scales and biases, as in nanoGPT.

Gradient accumulation is not done here (no optax.MultiSteps): the train step averages the gradients of its
micro-batches with `lax.scan` inside one jitted call (see `qjax.train.step`), so one train step is always one
optimizer update, the schedule's count equals the train step, and checkpoints hold no accumulator buffer.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from qjax import int8_params
from qjax import optim as qoptim
from qjax.optim import adamw as adamw_lib
from qjax.train.config import check_optimizer_config, get_field as _get

DEFAULT_WARMUP_STEPS = 30  # warmup_steps=None: this many, or a tenth of a shorter run


def warmup_steps(opt, total_steps: int) -> int:
    """The config's warmup_steps; None means min(DEFAULT_WARMUP_STEPS, total_steps // 10)."""
    value = _get(opt, "warmup_steps")
    return min(DEFAULT_WARMUP_STEPS, total_steps // 10) if value is None else value


def make_schedule(opt, total_steps: int) -> optax.Schedule:
    """lr as a function of the 0-based train step (module docstring)."""
    lr = float(_get(opt, "lr"))
    warmup = warmup_steps(opt, total_steps)
    cosine = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=lr, warmup_steps=warmup, decay_steps=total_steps,
        end_value=lr * float(_get(opt, "min_lr_ratio", 0.1)))
    return lambda step: cosine(step + 1)


def _decay_mask(params):
    return jax.tree.map(lambda p: p.ndim >= 2, params)


class Optimizer(NamedTuple):
    """A run's optimizer: `tx` the clipping + AdamW transformation (a `qjax.optim.chain_fused`), `schedule` the lr per
    0-based train step, `stochastic_rounding` whether bfloat16 params are updated with stochastic rounding."""

    tx: adamw_lib.FusedTransformation
    schedule: optax.Schedule
    stochastic_rounding: bool = False

    def init(self, params, int8_dtype=jnp.float32):
        """The optimizer state of `params`; AdamW's states of Int8Param leaves are in `int8_dtype`, the dtype of
        their gradients (`qjax.optim.int8_value_and_grad`'s grad_dtype)."""
        return self.tx.init(qoptim.dequantize_params(params, int8_dtype))

    def step(self, grads, opt_state, params, key=None, param_specs=None):
        """(grads, opt_state, params) -> (new params, new opt_state): clip, then one AdamW step.

        key: a `jax.random.key`, fresh every step; required when `stochastic_rounding` or params hold Int8Param
        leaves, unused otherwise. param_specs: the params' PartitionSpecs on the mesh set while tracing
        (`qjax.optim.apply_gradients`: the fused step runs per device)."""
        int8 = int8_params.has_int8_params(params)
        if not (self.stochastic_rounding or int8):
            return qoptim.apply_gradients(self.tx, grads, opt_state, params, param_specs=param_specs)
        if key is None:
            raise ValueError("stochastic rounding of bfloat16 or int8 params needs key= (a fresh jax.random.key per "
                             "step)")
        if int8:  # AdamW sees each int8 weight in its gradient's dtype, as `init` made its states
            updates, opt_state = self.tx.update(grads, opt_state, int8_params.dequantize_like(params, grads))
            return qoptim.apply_updates_int8(params, updates, key), opt_state
        return qoptim.apply_gradients(self.tx, grads, opt_state, params, key, param_specs)


def make_optimizer(opt, total_steps: int, *, check: bool = True) -> Optimizer:
    """The `Optimizer` of an optimizer config.

    Args:
      opt: a ConfigDict / dataclass / dict with name (one of OPTIMIZERS), lr, warmup_steps (None: see
        `warmup_steps`), b1, b2, eps, weight_decay, grad_clip (0 or None: off) and optionally min_lr_ratio (default
        0.1), dynamic_range_expansion and stochastic_rounding (default False; module docstring).
      total_steps: the configured length of the run (the cosine ends there, wherever a run is stopped).
      check: ConfigError for a bad field (`qjax.train.config.check_optimizer_config`); False where the config is
        checked already (`train()` checks it up front).
    """
    if check:
        check_optimizer_config(opt, total_steps)
    schedule = make_schedule(opt, total_steps)
    kwargs = dict(learning_rate=schedule, b1=float(_get(opt, "b1")), b2=float(_get(opt, "b2")),
                  eps=float(_get(opt, "eps")), weight_decay=float(_get(opt, "weight_decay")), mask=_decay_mask)
    name = _get(opt, "name")
    if name == "adamw":
        tx = optax.adamw(**kwargs)
    elif name == "adamw_fp8":  # the fused step where it can run (module docstring)
        expand = bool(_get(opt, "dynamic_range_expansion", False))
        tx = qoptim.adamw_fp8(**kwargs, use_kernel=True, dynamic_range_expansion=expand)
    elif name == "adamw_8bit":
        tx = qoptim.adamw_8bit(**kwargs, use_kernel=True)
    else:
        tx = qoptim.adamw_4bit(**kwargs, use_kernel=True)
    clip = _get(opt, "grad_clip")
    clipping = (qoptim.clip_by_global_norm(float(clip)),) if clip else ()
    return Optimizer(qoptim.chain_fused(*clipping, tx), schedule, bool(_get(opt, "stochastic_rounding", False)))
