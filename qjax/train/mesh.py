"""Data parallelism over a `jax.sharding.Mesh`: one "data" axis over all devices, batch split, params replicated.

XLA is the distributed engine: the train step is jitted with these shardings, and the gradient all-reduce over the
"data" axis is inserted by the compiler. The model is traced with the mesh set (`tracing_on`), so that
`qjax.dot_general` runs its quantized GEMMs per device, where the Pallas kernels can run. Single host only for now:
the loop puts the whole global batch on the mesh from one process (several hosts would need
`jax.make_array_from_process_local_data` and per-host data).
"""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"


def make_mesh(devices=None) -> Mesh:
    """A 1-D mesh with axis "data" over `devices` (default: all of `jax.devices()`)."""
    devices = jax.devices() if devices is None else list(devices)
    if not devices:
        raise ValueError("make_mesh needs at least one device")
    return Mesh(np.array(devices), (DATA_AXIS,))


def tracing_on(mesh: Mesh):
    """Context manager: code traced inside sees `mesh` (`jax.sharding.get_abstract_mesh()`)."""
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array (params, optimizer state, scalars)."""
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dimension split over the "data" axis; other dimensions whole."""
    return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


def check_batch_size(batch_size: int, grad_accum_steps: int, mesh: Mesh) -> None:
    """Each micro-batch (batch_size / grad_accum_steps examples) must split evenly over the mesh's devices."""
    devices = mesh.shape[DATA_AXIS]
    if not isinstance(grad_accum_steps, int) or grad_accum_steps < 1:
        raise ValueError(f"config.grad_accum_steps must be an int >= 1, got {grad_accum_steps!r}")
    if not isinstance(batch_size, int) or batch_size < 1 or batch_size % (grad_accum_steps * devices):
        raise ValueError(
            f"config.batch_size={batch_size!r} must be a positive multiple of grad_accum_steps ({grad_accum_steps}) "
            f"x devices ({devices}) = {grad_accum_steps * devices}, so every micro-batch splits evenly over the "
            "devices; change config.batch_size or config.grad_accum_steps")
