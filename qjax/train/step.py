"""The train state, the jitted train / eval steps, and the train step's memory per device.

  init_state, train_step = make_train_step(config)            # task from config.model; data-free (benchmarks)
  state = init_state()                                        # TrainState, laid out on the mesh
  state, metrics = train_step(state, batch)                   # batch: dict of (batch_size, ...) arrays

One train step = one optimizer update on `config.batch_size` examples. With `grad_accum_steps` = A > 1 the batch is
cut into A micro-batches of batch_size / A examples whose gradients are averaged inside the same jitted call
(`lax.scan`, float32 sums): memory of one micro-batch, the step count and LR schedule unchanged, and no
accumulator in the optimizer state (so nothing extra in checkpoints). Micro-batch i takes examples i, i + A, i + 2A,
... so that every micro-batch stays split evenly over the "data" devices without moving data between them.

Randomness is a pure function of the state: the "quant" key of step s, micro-batch i is
fold_in(fold_in(run_key, s), i), so a resumed run replays exactly the keys of an uninterrupted one. The key of step s's
stochastically rounded param update (config.optimizer.stochastic_rounding) is fold_in(fold_in(run_key, s),
UPDATE_STREAM), a stream no micro-batch index reaches.
The state is donated: the step updates params and optimizer state in place.

Over the mesh (`qjax.train.mesh`; `config.mesh` by default): params, their gradients and optimizer states lie as
its sharding rules say (split over "fsdp" and "tensor"), the batch splits over ("data", "fsdp"), and the model
is traced with the mesh set and each layer's weight sharding (`qjax.flax.weight_shardings`), so quantized GEMMs run
per device on 8-bit gathered weights.

Equal (config, task, mesh) give the very same jitted functions (a small LRU cache of this pure builder), so a
second `train()` in one process (a resumed run, a sweep repeating a config, tests) does not compile again.

Memory: a rough estimate of the train step's memory per device, checked before compiling (`check_fits`). A run that
cannot fit then fails in seconds with one line naming what to change, instead of minutes later with
XLA's `RESOURCE_EXHAUSTED: Out of memory allocating ... bytes`:

  estimate = check_fits(config, task, jax.eval_shape(init_state), mesh)   # ConfigError when it cannot fit
  print(estimate.summary())

Per device, in bytes (P params; c = bytes of the compute dtype, 2 for bfloat16):

  state        params + optimizer states, exactly: the leaves of `jax.eval_shape(init_state)` (float32 params
               4 B/param; Adam states fp32 8 B/param, 8-bit ~2, 4-bit ~1, fp8 ~2, plus their block scales)
  gradients    P x the param dtype's bytes (the compute dtype's for int8 weight-only params: their gradient is
               that of the dequantized weight, above), plus a float32 accumulator (4 B/param) when
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
               model's LM head runs over chunks of its vocabulary (`qjax.models.lm_head`), so at most one chunk's
               logits, `lm_head.CHUNK_ELEMENTS` of them, count.

XLA's temporaries, fusion choices and fragmentation are left out (docs/performance.md compares estimates with
measured peaks). It is used only to reject runs whose estimate exceeds the device's memory; a run close to the limit
is left to XLA to decide.
"""

import dataclasses
import functools
import os
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from qjax import optim as qoptim
from qjax.flax import weight_shardings
from qjax.models.layers import attention_implementation
from qjax.models.lm_head import CHUNK_ELEMENTS
from qjax.train import mesh as mesh_lib
from qjax.train.config import ConfigError, check_train_step
from qjax.train.optimizer import make_optimizer
from qjax.train.task import Task, make_task

UPDATE_STREAM = 2**31 - 1  # fold_in index of the param update's key (module docstring)
GiB = 2**30


class TrainState(NamedTuple):
    """Everything a checkpoint holds.

    step: int32 (), completed train steps. params: the model's params. opt_state: the optax state (quantized Adam
    states included). key: uint32 key data of the run's RNG key (`jax.random.key_data`), so orbax can save it.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    key: jax.Array


def _split_micro_batches(batch: dict, accum: int) -> dict:
    """(B, ...) -> (A, B / A, ...), micro-batch i holding examples i, i + A, ... (module docstring)."""
    def split(x):
        return jnp.swapaxes(x.reshape((x.shape[0] // accum, accum) + x.shape[1:]), 0, 1)
    return jax.tree.map(split, batch)


def _int8_dtype(task: Task):
    """The dtype of int8 weight-only params' gradients and AdamW states: the model's compute dtype."""
    return jnp.dtype(task.model_config.compute_dtype)


def _loss_and_grads(task: Task, params, batch: dict, key: jax.Array, accum: int, mesh, probes=None, loss_fn=None,
                    health_stats: bool = False):
    """Mean loss, aux metrics and gradients (params' dtypes; the compute dtype for int8 weight-only params, with
    respect to their dequantized values) over `batch`, in `accum` micro-batches. With `probes` (quantization
    health, `Task.health_probes`): aux["health"] = {"sown": x and w stats, "probes": g stats}, over the
    micro-batches the max of each amax and the mean of each fraction. loss_fn: differentiated instead of task.loss
    (same signature); health_stats: aux["health"] and the gradients' second half hold such stats (the probes call)."""
    if probes is not None:  # the probes are differentiated beside the params: their gradient is the g stats
        loss, aux, (grads, probe_grads) = _loss_and_grads(
            task, (params, probes), batch, key, accum, mesh,
            loss_fn=lambda both, b, k: task.loss(both[0], b, k, probes=both[1]), health_stats=True)
        return loss, {**aux, "health": {"sown": aux["health"], "probes": probe_grads}}, grads
    # jax.value_and_grad where no param is int8; int8 weights' gradients in the compute dtype the model multiplies
    # them in (exact, half float32's bytes)
    grad_fn = qoptim.int8_value_and_grad(loss_fn or task.loss, has_aux=True, grad_dtype=_int8_dtype(task))
    if accum == 1:
        (loss, aux), grads = grad_fn(params, batch, jax.random.fold_in(key, 0))
        return loss, aux, grads

    micro = _split_micro_batches(batch, accum)

    def body(carry, inputs):
        index, micro_batch = inputs
        micro_batch = jax.lax.with_sharding_constraint(micro_batch, mesh_lib.batch_sharding(mesh))
        (loss, aux), grads = grad_fn(params, micro_batch, jax.random.fold_in(key, index))
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        loss_sum, aux_sum, grad_sum = jax.tree.map(jnp.add, carry, (loss, aux, grads))
        if health_stats:  # a stat's amax (element 0): the max over micro-batches, times accum to survive the mean
            def amax_max(total, new, summed):
                return summed.at[0].set(jnp.maximum(total[0], new[0] * accum))
            aux_sum = {**aux_sum, "health": jax.tree.map(amax_max, carry[1]["health"], aux["health"],
                                                         aux_sum["health"])}
            grad_sum = (grad_sum[0], jax.tree.map(amax_max, carry[2][1], grads[1], grad_sum[1]))
        return (loss_sum, aux_sum, grad_sum), None

    # Zeros shaped like one micro-step's outputs (float32 throughout: sums of bf16 grads would lose bits).
    shapes = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], micro), key)
    (loss_shape, aux_shape), grad_shape = shapes
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), (loss_shape, aux_shape, grad_shape))
    (loss, aux, grads), _ = jax.lax.scan(body, zeros, (jnp.arange(accum), micro))
    scale = 1.0 / accum
    grads = jax.tree.map(lambda g, s: (g * scale).astype(s.dtype), grads, grad_shape)
    return loss * scale, jax.tree.map(lambda a: a * scale, aux), grads


def make_train_step(config, task: Task | None = None, mesh=None, *, health: bool = False,
                    check: bool = True) -> tuple[Callable, Callable]:
    """(init_state, train_step) for a training config, both jitted with the mesh's shardings.

    Args:
      config: a checked training config (see configs/llama_base.py): optimizer, steps, batch_size,
        grad_accum_steps, seed; `task` defaults to `make_task(config)` (the preset's vocab / classes).
      task: the model and loss (`qjax.train.task`).
      mesh: a `qjax.train.make_mesh` mesh (default: `config.mesh`'s sizes, or data parallel over all devices
        for a config without a mesh).
      health: the train step also measures quantization health (`qjax.health`): metrics["health"] = {"sown": x
        and w stats, "probes": g stats}, trees of float32 (3,) (`qjax.health.flatten` names them). The same update
        of the state; a separate jitted function, so the plain step traces none of it.
      check: ConfigError for a bad field the step reads (`qjax.train.config.check_train_step`); False where the
        whole config is checked already (`train()` checks it up front).

    Returns:
      init_state() -> TrainState, params from `config.seed`, laid out per `train_state_shardings`.
      train_step(state, batch) -> (state, metrics): batch a dict of arrays with leading dim config.batch_size
        (numpy arrays are put on the mesh split over "data" x "fsdp"); `state` is donated. metrics: float32 () arrays
        "loss" (mean over the batch), "grad_norm" (global norm before clipping), "lr" (this step's), plus the
        task's aux metrics ("accuracy" for images).
    """
    if mesh is None:
        mesh = mesh_lib.mesh_from_config(config.mesh) if "mesh" in config else mesh_lib.make_mesh()
    if check:
        check_train_step(config, mesh)
    task = make_task(config) if task is None else task
    return _build_train_step(ml_collections.FrozenConfigDict(config), task, mesh, health)


@functools.lru_cache(maxsize=8)
def _build_train_step(config: ml_collections.FrozenConfigDict, task: Task, mesh,
                      health: bool = False) -> tuple[Callable, Callable]:
    accum = config.grad_accum_steps
    optimizer = make_optimizer(config.optimizer, config.steps, check=False)  # checked (make_train_step)
    replicated, batch_sharding = mesh_lib.replicated(mesh), mesh_lib.batch_sharding(mesh)

    def init_state() -> TrainState:
        init_key, run_key = jax.random.split(jax.random.key(config.seed))
        params = task.init(init_key)
        return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params, _int8_dtype(task)),
                          jax.random.key_data(run_key))

    abstract = jax.eval_shape(init_state)
    state_shardings = train_state_shardings(abstract, mesh)
    gather_8bit = config.mesh.get("gather_8bit", True) if "mesh" in config else True
    lookup = mesh_lib.layer_sharding(abstract.params, mesh) if gather_8bit else lambda layer: None

    # Gradients are laid out like the params; an int8 weight-only param's gradient (float, its dequantized shape)
    # like its codes.
    is_int8 = lambda x: isinstance(x, qoptim.Int8Param)
    grad_shardings = jax.tree.map(lambda s: s.data if is_int8(s) else s, state_shardings.params, is_leaf=is_int8)
    param_specs = jax.tree.map(lambda s: s.spec, state_shardings.params)

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        step_key = jax.random.fold_in(jax.random.wrap_key_data(state.key), state.step)
        probes = task.health_probes() if health else None
        with mesh_lib.tracing_on(mesh), weight_shardings(lookup):  # quantized GEMMs per device (qjax.dot_general)
            loss, aux, grads = _loss_and_grads(task, state.params, batch, step_key, accum, mesh, probes)
        grads = jax.lax.with_sharding_constraint(grads, grad_shardings)  # reduce-scattered onto the shards
        with mesh_lib.tracing_on(mesh):  # the fused AdamW step per device (qjax.optim.apply_gradients)
            params, opt_state = optimizer.step(grads, state.opt_state, state.params, param_specs=param_specs,
                                               key=jax.random.fold_in(step_key, UPDATE_STREAM))
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": optimizer.schedule(state.step), **aux}
        return TrainState(state.step + 1, params, opt_state, state.key), metrics

    init_jit = jax.jit(init_state, out_shardings=state_shardings)
    step_jit = jax.jit(train_step, in_shardings=(state_shardings, batch_sharding),
                       out_shardings=(state_shardings, replicated), donate_argnums=0)
    return init_jit, step_jit


def train_state_shardings(abstract_state: TrainState, mesh) -> TrainState:
    """NamedSharding per leaf of a TrainState (arrays or ShapeDtypeStructs): params and optimizer state per
    `qjax.train.mesh.param_specs` / `state_specs`, step and key replicated."""
    params = mesh_lib.param_specs(abstract_state.params, mesh)
    opt_state = mesh_lib.state_specs(abstract_state.opt_state, abstract_state.params, mesh)
    replicated = mesh_lib.replicated(mesh)
    return TrainState(replicated, mesh_lib.named(params, mesh), mesh_lib.named(opt_state, mesh), replicated)


@functools.lru_cache(maxsize=8)
def make_eval_step(task: Task, mesh) -> Callable:
    """eval_step(params, batch, key) -> {"loss", plus aux}: float32 () means over the batch, jitted, no grads.

    `params` laid out as the train state's (`train_state_shardings`); `key` is uint32 key data (the "quant" stream
    of stochastic recipes)."""
    replicated, batch_sharding = mesh_lib.replicated(mesh), mesh_lib.batch_sharding(mesh)
    abstract_params = jax.eval_shape(task.init, jax.random.key(0))
    params_sharding = mesh_lib.named(mesh_lib.param_specs(abstract_params, mesh), mesh)
    lookup = mesh_lib.layer_sharding(abstract_params, mesh)

    def eval_step(params, batch, key):
        with mesh_lib.tracing_on(mesh), weight_shardings(lookup):
            loss, aux = task.loss(params, batch, jax.random.wrap_key_data(key))
        return {"loss": loss, **aux}

    return jax.jit(eval_step, in_shardings=(params_sharding, batch_sharding, replicated), out_shardings=replicated)


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
