"""The device mesh of a run: axes "data" (data parallel), "fsdp" (params, gradients and optimizer states split, batch
split) and "tensor" (Megatron tensor parallelism), and the batch's sharding over it.

XLA is the distributed engine: the train step is jitted with the shardings of `qjax.train.sharding`, and XLA
inserts the collectives (gradient all-reduces and reduce-scatters, float weights' all-gathers). The model is traced
with the mesh set (`tracing_on`), so that `qjax.dot_general` runs its quantized GEMMs per device, where the Pallas
kernels can run, and gathers FSDP-split weights as 8-bit codes. Several hosts (one process each, docs/distributed.md):
`initialize_distributed()` first (the loop does); each process then places its devices' rows of the global batch
(`put_batch`; the data is a pure function of (seed, step), the same in every process), and process 0 alone writes
the workdir's files (`is_main_process`).
"""

import os

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

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


def check_batch_size(batch_size: int, grad_accum_steps: int, mesh: Mesh) -> None:
    """Each micro-batch (batch_size / grad_accum_steps examples) must split evenly over the data x fsdp devices."""
    devices = int(np.prod([mesh.shape[a] for a in batch_axes(mesh)]))
    if not isinstance(grad_accum_steps, int) or grad_accum_steps < 1:
        raise ValueError(f"config.grad_accum_steps must be an int >= 1, got {grad_accum_steps!r}")
    if not isinstance(batch_size, int) or batch_size < 1 or batch_size % (grad_accum_steps * devices):
        raise ValueError(
            f"config.batch_size={batch_size!r} must be a positive multiple of grad_accum_steps ({grad_accum_steps}) "
            f"x data x fsdp devices ({devices}) = {grad_accum_steps * devices}, so every micro-batch splits evenly "
            "over the devices; change config.batch_size or config.grad_accum_steps")
