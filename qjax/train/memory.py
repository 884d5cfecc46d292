"""A rough estimate of a train step's memory per device, checked before compiling.

A run that cannot fit then fails in seconds with one line naming what to change, instead of minutes later with
XLA's `RESOURCE_EXHAUSTED: Out of memory allocating ... bytes`:

  estimate = check_fits(config, task, jax.eval_shape(init_state), mesh)   # ConfigError when it cannot fit
  print(estimate.summary())

Per device, in bytes (P params; c = bytes of the compute dtype, 2 for bfloat16):

  state        params + optimizer states, exactly: the leaves of `jax.eval_shape(init_state)` (float32 params
               4 B/param; Adam states fp32 8 B/param, 8-bit ~2, 4-bit ~1, fp8 ~2, plus their block scales)
  gradients    P x the param dtype's bytes (the compute dtype's for int8 weight-only params: their gradient is
               that of the dequantized weight, `qjax.train.step`), plus a float32 accumulator (4 B/param) when
               grad_accum_steps > 1
  activations  what the backward pass keeps of one micro-batch on one device, T = its tokens (micro-batch x
               seq_len, or x patches for a ViT), L = n_layers, per token and layer:
                 c x (6 dim + 2 kv_dim + 3 ffn_dim)   what a block saves for its backward (tests/models/test_ops.py
                                                      counts it): block input and mid-block sum, norm outputs, q/k/v,
                                                      attention output, the MLP's gate/up (ViT: fc1) output, hidden
                 + 8 x n_heads x seq_len              float32 attention scores and probabilities, where attention
                                                      is materialised (XLA; cuDNN flash attention keeps none)
               times L (with model.recompute_attention less c x (2 dim + 2 kv_dim) and the scores; with
               model.remat: c x dim x L, the block inputs, plus one block's worth), plus the output
               layer: T x vocab_size x 10 (the logits in c, float32 logits and their gradient); a language
               model's LM head runs over chunks of positions (`qjax.models.lm_head`), so at most one chunk's
               logits, `lm_head.CHUNK_ELEMENTS` of them, count.

XLA's temporaries, fusion choices and fragmentation are left out (docs/performance.md compares estimates with
measured peaks). It is used only to reject runs whose estimate exceeds the device's memory; a run close to the limit
is left to XLA to decide.
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from qjax import optim as qoptim
from qjax.models.layers import attention_implementation
from qjax.models.lm_head import CHUNK_ELEMENTS
from qjax.train.config import ConfigError

GiB = 2**30


def _size(n: int) -> str:
    """Bytes for a person: "42.8 GiB", or "96 MiB" below a GiB."""
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / 2**20:.0f} MiB"


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Bytes per device: state (params + optimizer), gradients, activations; available: the device's (or None)."""

    state: int
    gradients: int
    activations: int
    available: int | None
    platform: str

    @property
    def total(self) -> int:
        return self.state + self.gradients + self.activations

    def summary(self) -> str:
        """e.g. "~39.8 GiB per device estimated (params + optimizer 12.3 GiB, gradients 4.1 GiB, activations
        23.4 GiB) of 75.0 GiB"."""
        available = f" of {_size(self.available)}" if self.available else " (device memory unknown)"
        return (f"~{_size(self.total)} per device estimated ({self._parts()}){available}")

    def _parts(self) -> str:
        return (f"params + optimizer {_size(self.state)}, gradients {_size(self.gradients)}, activations "
                f"{_size(self.activations)}")


def _shape(x) -> tuple[int, ...]:
    """One device's shape of x: its shard's where x has a sharding (FSDP / tensor-parallel state), else x's."""
    sharding = getattr(x, "sharding", None)
    return tuple(sharding.shard_shape(x.shape)) if sharding is not None else tuple(x.shape)


def _tree_bytes(tree) -> int:
    return sum(int(np.prod(_shape(x))) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def activation_bytes(task, examples: int) -> int:
    """Activations the backward pass keeps for `examples` examples of `task` (module docstring's formula)."""
    c = task.model_config
    elt = np.dtype(c.compute_dtype).itemsize
    if task.kind == "lm":
        seq, outputs, output_rows = task.seq_len, c.vocab_size, examples * task.seq_len
    else:
        seq, outputs, output_rows = c.num_tokens, c.num_classes, examples
    # Llama's grouped k/v and SwiGLU width; GPT-2's and ViT's full-width k/v and GELU MLP.
    kv, ffn = (c.n_kv_heads * c.head_dim, c.ffn_dim) if hasattr(c, "ffn_dim") else (c.dim, c.mlp_dim)
    tokens = examples * seq
    causal = task.kind == "lm"  # the language models' attention is causal, the ViT's is not
    scores = 8 * c.n_heads * seq if attention_implementation(c, c.dim // c.n_heads, seq, causal) == "xla" else 0
    per_layer = elt * (6 * c.dim + 2 * kv + 3 * ffn) + scores
    if getattr(c, "recompute_attention", False) and not getattr(c, "remat", False):  # norm output, q, k, v
        per_layer -= elt * (2 * c.dim + 2 * kv) + scores
    if getattr(c, "remat", False):
        blocks = tokens * (c.n_layers * elt * c.dim + per_layer)
    else:
        blocks = tokens * c.n_layers * per_layer
    logits = min(output_rows * outputs, CHUNK_ELEMENTS) if task.kind == "lm" else output_rows * outputs
    return blocks + logits * 10


def device_memory_bytes(device, devices_sharing: int = 1) -> int | None:
    """Memory one device may use: the accelerator's `bytes_limit`, or on a CPU the host's physical memory (or its
    cgroup limit, when lower) split over the `devices_sharing` CPU devices; None where neither is known."""
    try:
        stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    if device.platform != "cpu":
        return None
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            host = min(host, int(limit))
    except OSError:
        pass
    return host // max(devices_sharing, 1)


def estimate(config, task, abstract_state, mesh) -> Estimate:
    """The per-device estimate of a train step (module docstring) for a checked config."""
    devices = mesh.devices.size
    # Gradients are shaped and sharded like the params (`_shape`); an int8 weight-only param's like its codes, in the
    # compute dtype.
    is_int8 = lambda x: isinstance(x, qoptim.Int8Param)
    compute = jnp.dtype(task.model_config.compute_dtype)
    grad_shapes = jax.tree.map(
        lambda p: jax.ShapeDtypeStruct(p.data.shape, compute, sharding=getattr(p.data, "sharding", None))
        if is_int8(p) else p, abstract_state.params, is_leaf=is_int8)
    n_params = sum(int(np.prod(_shape(x))) for x in jax.tree.leaves(grad_shapes))
    gradients = _tree_bytes(grad_shapes) + (4 * n_params if config.grad_accum_steps > 1 else 0)
    examples = max(config.batch_size // config.grad_accum_steps // devices, 1)
    device = mesh.devices.flat[0]
    sharing = devices if device.platform == "cpu" else 1
    return Estimate(state=_tree_bytes(abstract_state), gradients=gradients,
                    activations=activation_bytes(task, examples), available=device_memory_bytes(device, sharing),
                    platform=device.platform)


def check_fits(config, task, abstract_state, mesh) -> Estimate:
    """The estimate, or a ConfigError naming it, the device's memory and what to change when it cannot fit."""
    est = estimate(config, task, abstract_state, mesh)
    if est.available is None or est.total <= est.available:
        return est
    if est.activations >= est.state + est.gradients:
        fix = ("lower config.batch_size or config.seq_len, raise config.grad_accum_steps, or set "
               "--config.model.remat=True")
    else:
        fix = ("use a smaller config.model.size, a low-bit optimizer (--config.optimizer.name=adamw_8bit) or "
               "bfloat16 params (--config.model.param_dtype=bfloat16 --config.optimizer.stochastic_rounding=True) "
               "or int8 weight-only params (--config.model.param_dtype=int8)")
    raise ConfigError(f"this run needs an estimated {_size(est.total)} per device ({est._parts()}), more than the "
                      f"{_size(est.available)} of a {est.platform} device: {fix}")
