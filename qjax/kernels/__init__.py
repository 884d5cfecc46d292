"""Pallas (Mosaic GPU) kernels, each beside the jnp reference it is tested against, and where they run.

  scaled_matmul.py        reference + dispatcher for the quantized GEMM (row / tensor / block scales)
  scaled_matmul_mgpu.py   the Mosaic GPU GEMM kernel: int8 / fp8 wgmma, scales in the epilogue or per 128 of K
  quantize_mgpu.py        fused quantization kernels (both GEMM layouts from one read), reference: qjax.quantize
  tile_pipeline_mgpu.py   the TMA pipeline over 128 x 128 tiles that the quantize kernels run on
  stochastic_cast_mgpu.py stochastic-rounding casts, reference: qjax.stochastic

A recipe's `backend` ("auto", "xla", "pallas") picks between a kernel and its reference (see `qjax.Recipe`).
"""

import functools
import warnings

import jax


def on_hopper_gpu() -> bool:
    """Whether the default device is an NVIDIA Hopper GPU (H100/H200 or compute capability 9.x)."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return False
    kind = getattr(device, "device_kind", "")
    return "H100" in kind or "H200" in kind or str(getattr(device, "compute_capability", "")).startswith("9")


def per_device_region() -> bool:
    """Whether the code being traced runs on device-local arrays: inside `jax.shard_map` over every axis of the
    context mesh (where `qjax.dot_general` puts its quantized GEMMs when a mesh is set, see `qjax.dot_general`)."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and mesh.are_all_axes_manual


def use_kernel(backend: str) -> tuple[bool, bool]:
    """(run the kernel?, interpret it?) for a recipe backend: "pallas" always runs it (interpreted off a Hopper
    GPU), "auto" only compiled on a Hopper GPU, with one device or inside a per-device region, "xla" never.

    "auto" stays on XLA where several devices are visible and the arrays may be global: the kernels are custom
    calls without a partitioning rule, so XLA would gather their operands onto every device. `qjax.dot_general`
    runs its GEMMs per device under a context mesh (`jax.sharding.use_abstract_mesh` / `jax.set_mesh`).
    """
    if backend == "xla":
        return False, False
    hopper = on_hopper_gpu()
    if backend == "pallas":
        return True, not hopper
    if hopper and jax.device_count() > 1 and not per_device_region():
        _warn_kernels_off(jax.device_count())
        return False, False
    return hopper, False


@functools.lru_cache(maxsize=None)
def _warn_kernels_off(device_count: int) -> None:
    """Says once per process that "auto" left the kernels off (silently slow otherwise: the XLA path ran an int8
    linear layer at about half the kernels' speed)."""
    warnings.warn(f"qjax: {device_count} GPUs are visible and a kernel would see global arrays, so backend 'auto' "
                  "runs the XLA path instead of the Pallas kernels (they have no partitioning rule). Set the "
                  "mesh while tracing "
                  "(`with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):` or `jax.set_mesh(mesh)`): "
                  "qjax.dot_general then runs its GEMMs per device; qjax's train step does this.", stacklevel=3)

