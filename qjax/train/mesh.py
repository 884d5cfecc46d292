"""The device mesh of a run: axes "data" (data parallel), "fsdp" (params, gradients and optimizer states split, batch
split) and "tensor" (Megatron tensor parallelism), and the batch's sharding over it.

XLA is the distributed engine: the train step is jitted with the shardings below (`param_specs`), and XLA
inserts the collectives (gradient all-reduces and reduce-scatters, float weights' all-gathers). The model is traced
with the mesh set (`tracing_on`), so that `qjax.dot_general` runs its quantized GEMMs per device, where the Pallas
kernels can run, and gathers FSDP-split weights as 8-bit codes. Several hosts (one process each, docs/distributed.md):
`initialize_distributed()` first (the loop does); each process then places its devices' rows of the global batch
(`put_batch`; the data is a pure function of (seed, step), the same in every process), and process 0 alone writes
the workdir's files (`is_main_process`).

Where each array of the train state lies on the mesh, from parameter paths (`param_specs`, `state_specs`,
`layer_sharding`):

  specs = param_specs(params, mesh)                   # PartitionSpec per param (ShapeDtypeStructs work too)
  state_specs(opt_state, params, mesh)                # the same for an optimizer state
  with qjax.flax.weight_shardings(layer_sharding(params, mesh)): ...   # while tracing the model

Rules (Megatron tensor parallelism, FSDP over the other dim; a dim takes an axis only if the axis' size divides it):

  param (path ends with)                           dims            spec
  column-parallel kernels: qkv_proj, gate_up_proj,  (K, N)          (fsdp, tensor)
    fc1 (ViT)
  row-parallel kernels: o_proj, down_proj, fc2      (K, N)          (tensor, fsdp)
  any other param with ndim >= 2 (embedding,         (..., a, b)     fsdp on its largest dim
    lm_head, patch_embed, pos_embed, ...)
  1-D params (norm scales, biases) and scalars      -               replicated

The batch splits over ("data", "fsdp") (`batch_sharding`). Column-parallel layers leave their output
features split over "tensor" and row-parallel ones sum over it, so attention heads (qkv -> o) and the FFN
(gate_up -> down) stay split between the two GEMMs. A fused kernel's columns are [q | k | v] and [gate | up]: a
contiguous shard of them is not one device's heads, so XLA moves the fused output between the tensor devices
before the split (correct, one exchange of the layer's output; a per-shard interleaved column order would avoid it).

Optimizer states: a leaf shaped like its param (float32 AdamW moments, small tensors the low-bit optimizers keep in
float32) takes the param's spec; the low-bit states' codes (n_blocks, block) and scales (n_blocks,) split their
blocks over "fsdp" (dim 0); scalars (counts) are replicated. Gradients take the params' specs.
"""

import os
import re

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from qjax.weight_sharding import WeightSharding

DATA_AXIS, FSDP_AXIS, TENSOR_AXIS = "data", "fsdp", "tensor"
AXES = (DATA_AXIS, FSDP_AXIS, TENSOR_AXIS)
# Environment variables that start a multi-process run. JAX_COORDINATOR_ADDRESS (host:port of process 0) is read by
# `jax.distributed.initialize()` itself; JAX_NUM_PROCESSES and JAX_PROCESS_ID by us, as jax does not read them (it
# takes them as arguments, or from a cluster it detects). SLURM and Open MPI set everything themselves.
COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"
_CLUSTER_ENV = (COORDINATOR_ENV, "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE")


def axis_sizes(device_count: int, data: int = -1, fsdp: int = 1, tensor: int = 1) -> tuple[int, int, int]:
    """(data, fsdp, tensor) sizes whose product is `device_count`; -1 is the rest of the devices, for at most one of
    fsdp and tensor, and data's -1 (its default) gives way to theirs (data is then 1). ValueError naming the sizes
    when they do not fit."""
    sizes = {DATA_AXIS: data, FSDP_AXIS: fsdp, TENSOR_AXIS: tensor}
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
            raise ValueError(f"mesh axis {name!r} size must be a positive int or -1 (the rest), got {size!r}")
    if data == -1 and -1 in (fsdp, tensor):
        sizes[DATA_AXIS] = 1
    rest = [name for name, size in sizes.items() if size == -1]
    if len(rest) > 1:
        raise ValueError(f"mesh axes {rest} are all -1: at most one axis takes the rest of the devices")
    known = int(np.prod([size for size in sizes.values() if size != -1]))
    if rest:
        if device_count % known:
            raise ValueError(f"mesh {sizes} does not fit {device_count} devices: {device_count} is not a multiple "
                             f"of {known}; change config.mesh")
        sizes[rest[0]] = device_count // known
    if int(np.prod(list(sizes.values()))) != device_count:
        raise ValueError(f"mesh {sizes} has {int(np.prod(list(sizes.values())))} devices, but {device_count} are "
                         "visible; make the sizes multiply to the device count (or set one to -1)")
    return sizes[DATA_AXIS], sizes[FSDP_AXIS], sizes[TENSOR_AXIS]


def make_mesh(devices=None, *, data: int = -1, fsdp: int = 1, tensor: int = 1) -> Mesh:
    """A ("data", "fsdp", "tensor") mesh over `devices` (default: all of `jax.devices()`), axis types Auto.

    Sizes multiply to the device count; one may be -1, the rest of the devices. make_mesh() is pure data
    parallelism; make_mesh(fsdp=-1) FSDP over every device; make_mesh(fsdp=4, tensor=2) on 8 devices.
    """
    devices = jax.devices() if devices is None else list(devices)
    if not devices:
        raise ValueError("make_mesh needs at least one device")
    shape = axis_sizes(len(devices), data, fsdp, tensor)
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def mesh_from_config(mesh_config) -> Mesh:
    """`make_mesh` from a config's `mesh` fields (data, fsdp, tensor)."""
    return make_mesh(data=mesh_config.data, fsdp=mesh_config.fsdp, tensor=mesh_config.tensor)


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} must be an integer (e.g. {name}=0)") from None


def initialize_distributed() -> bool:
    """`jax.distributed.initialize()` when a cluster's environment variables are set (`_CLUSTER_ENV`), once per
    process; True if this process is one of several. Without them: nothing (one host).

    By hand, every process gets JAX_COORDINATOR_ADDRESS=<host of process 0>:<free port>, JAX_NUM_PROCESSES=<n> and
    its own JAX_PROCESS_ID=<0..n-1> (docs/distributed.md). On CPUs the processes' collectives go through gloo (jax's
    default `jax_cpu_collectives_implementation`)."""
    if any(name in os.environ for name in _CLUSTER_ENV) and not jax.distributed.is_initialized():
        num_processes, process_id = _int_env(NUM_PROCESSES_ENV), _int_env(PROCESS_ID_ENV)
        by_hand = COORDINATOR_ENV in os.environ and not any(n in os.environ for n in _CLUSTER_ENV[1:])
        if by_hand and (num_processes is None or process_id is None):
            raise ValueError(f"{COORDINATOR_ENV} is set, but not {NUM_PROCESSES_ENV} and {PROCESS_ID_ENV}: set both "
                             f"in every process ({NUM_PROCESSES_ENV}=<n>, {PROCESS_ID_ENV}=<0..n-1>), or unset "
                             f"{COORDINATOR_ENV} to train on this host alone")
        jax.distributed.initialize(num_processes=num_processes, process_id=process_id)
    return jax.process_count() > 1


def is_main_process() -> bool:
    """True in process 0, the one that writes the workdir's files and prints progress (and in a one-host run)."""
    return jax.process_index() == 0


def sync_processes(name: str) -> None:
    """Waits until every process of a multi-process run has reached the barrier `name` (the same name in all);
    nothing in a one-process run."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def all_processes(flag: bool) -> bool:
    """True if `flag` is True in every process (a collective: every process must call it); `flag` alone in a
    one-process run."""
    if jax.process_count() == 1:
        return flag
    return bool(np.all(multihost_utils.process_allgather(np.int32(flag))))


def put_batch(batch: dict, mesh: Mesh) -> dict:
    """A host batch (dict of numpy arrays, leading dim the global batch) as jax.Arrays split per `batch_sharding`.

    Every process holds the same global batch (data is a pure function of (seed, step)) and places only the rows
    of its own devices, so one host or several compute the very same step. jit itself refuses numpy inputs whose
    sharding spans other processes' devices."""
    sharding = batch_sharding(mesh)
    return jax.tree.map(lambda x: jax.make_array_from_callback(x.shape, sharding, lambda index: x[index]), batch)


def tracing_on(mesh: Mesh):
    """Context manager: code traced inside sees `mesh` (`jax.sharding.get_abstract_mesh()`)."""
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array (scalars, metrics)."""
    return NamedSharding(mesh, PartitionSpec())


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes the batch is split over: data and FSDP (tensor-parallel devices share their examples)."""
    return tuple(a for a in (DATA_AXIS, FSDP_AXIS) if a in mesh.axis_names)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dimension split over ("data", "fsdp"); other dimensions whole."""
    return NamedSharding(mesh, PartitionSpec(batch_axes(mesh)))


COLUMN_PARALLEL = re.compile(r"(^|/)(qkv_proj|gate_up_proj|fc1)/kernel$")
ROW_PARALLEL = re.compile(r"(^|/)(o_proj|down_proj|fc2)/kernel$")


def path_name(path) -> str:
    """A jax key path as "layers_0/attn/qkv_proj/kernel" (dict keys, attributes and indices joined by "/")."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
    return "/".join(parts)


def _fits(mesh: Mesh, axis: str, size: int) -> bool:
    return mesh.shape.get(axis, 1) > 1 and size % mesh.shape[axis] == 0


def param_spec(name: str, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """The PartitionSpec of the param at `name` (module docstring's rules)."""
    dims = [None] * len(shape)
    if len(shape) < 2:
        return PartitionSpec(*dims)
    if COLUMN_PARALLEL.search(name) or ROW_PARALLEL.search(name):
        k_axis, n_axis = (FSDP_AXIS, TENSOR_AXIS) if COLUMN_PARALLEL.search(name) else (TENSOR_AXIS, FSDP_AXIS)
        for dim, axis in ((0, k_axis), (1, n_axis)):
            if _fits(mesh, axis, shape[dim]):
                dims[dim] = axis
        return PartitionSpec(*dims)
    for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
        if _fits(mesh, FSDP_AXIS, shape[dim]):
            dims[dim] = FSDP_AXIS
            break
    return PartitionSpec(*dims)


def param_specs(params, mesh: Mesh):
    """PartitionSpec per leaf of a params pytree (arrays or ShapeDtypeStructs)."""
    return jax.tree_util.tree_map_with_path(lambda path, p: param_spec(path_name(path), p.shape, mesh), params)


def state_specs(opt_state, params, mesh: Mesh):
    """PartitionSpec per leaf of an optimizer state for `params` (module docstring): a leaf whose path ends with a
    param's path (then optionally a quantized state's field) and has its shape takes the param's spec; other
    leaves with ndim >= 1 split dim 0 over "fsdp" where it divides; the rest are replicated."""
    by_name = {path_name(path): (p.shape, param_spec(path_name(path), p.shape, mesh))
               for path, p in jax.tree_util.tree_flatten_with_path(params)[0]}

    def spec(path, leaf):
        name = path_name(path)
        for param_name, (shape, pspec) in by_name.items():
            if (name == param_name or name.endswith("/" + param_name)) and tuple(leaf.shape) == tuple(shape):
                return pspec
        if leaf.ndim >= 1 and _fits(mesh, FSDP_AXIS, leaf.shape[0]):
            return PartitionSpec(FSDP_AXIS, *[None] * (leaf.ndim - 1))
        return PartitionSpec()

    return jax.tree_util.tree_map_with_path(spec, opt_state)


def named(specs, mesh: Mesh):
    """PartitionSpecs -> NamedShardings on `mesh`."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def layer_sharding(params, mesh: Mesh):
    """lookup(layer name) -> `qjax.dot_general.WeightSharding` of that layer's kernel (or None when it is whole
    on every device), for `qjax.flax.weight_shardings`: the quantized GEMMs then gather 8-bit codes."""
    tokens = tuple(a for a in (DATA_AXIS, FSDP_AXIS) if a in mesh.axis_names)
    table = {}
    for path, p in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = path_name(path)
        if not name.endswith("/kernel") or len(p.shape) != 2:
            continue
        dims = tuple(param_spec(name, p.shape, mesh))
        if dims == (None, None):
            continue
        fsdp = [d for d in (0, 1) if dims[d] == FSDP_AXIS]
        tensor = [d for d in (0, 1) if dims[d] == TENSOR_AXIS]
        as_dim = lambda d: "k" if d == 0 else "n"  # noqa: E731  a Dense kernel is (K, N)
        table[name[:-len("/kernel")]] = WeightSharding(
            tokens, FSDP_AXIS if fsdp else None, as_dim(fsdp[0]) if fsdp else "k",
            TENSOR_AXIS if tensor else None, as_dim(tensor[0]) if tensor else "n")
    return table.get
