"""Kernel or reference: the one place that decides, for every op that has a Mosaic GPU kernel.

  op                  kernel                                       reference
  quantize_pair       kernels.quantize_mgpu.quantize_pair_kernel   quantize.quantize_pair_reference
  RMSNorm + saved copy  kernels.rmsnorm_mgpu (forward; the backward  models.ops.rms_norm_prologue's composition
                      is XLA's, which is faster)                  (passed in)
  quantized_matmul    kernels.scaled_matmul_mgpu.scaled_matmul_kernel  kernels.scaled_matmul.scaled_matmul
  fused AdamW step    kernels.adam_step_mgpu (via optim.fused_adam)   optim.fused_adam.fused_step_reference
  SwiGLU + saved copy kernels.swiglu_mgpu                          models.ops.SWIGLU's composition (passed in)
  grouped GEMMs       kernels.grouped_matmul_mgpu and               ragged_dot._grouped_gemm / lax.ragged_dot
                      grouped_contract_mgpu (via ragged_dot,
                      `kernel_if_supported`)

`kernel_mode(backend)` answers (run the kernel?, interpret it?) for a recipe backend ("auto", "xla", "pallas"; the
fused AdamW's `use_kernel=True` is "auto"). Tests and benchmarks override what "auto" finds with `force`:

  with qjax.dispatch.force("interpret"):   # "kernel": compiled, "interpret": the Mosaic GPU interpreter (CPU),
      step = jax.jit(step_fn)              # "reference": never a kernel
      step(...)

Decisions are taken while tracing, so jit (or re-trace) inside the `with`: a function traced before keeps the
decision it was traced with.
"""

import contextlib
import contextvars
import functools
import warnings

import jax
import jax.numpy as jnp

from qjax import numerics
from qjax.kernels import quantize_mgpu, rmsnorm_mgpu, scaled_matmul, scaled_matmul_mgpu, swiglu_mgpu
from qjax.qtensor import QTensor, QuantSpec
from qjax.quantize import quantize_pair_reference
from qjax.recipes import BACKENDS
FORCED_MODES = ("kernel", "interpret", "reference")
# A context variable, not a global: each thread (and asyncio task) sees only its own `force`.
_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("qjax_dispatch_forced", default=None)


@contextlib.contextmanager
def force(mode: str):
    """Within the `with`, backend "auto" means `mode`: "kernel" (compiled), "interpret" (the Mosaic GPU interpreter,
    any machine) or "reference" (never a kernel), whatever the machine. Backends "xla" and "pallas" are explicit
    requests and keep their meaning."""
    if mode not in FORCED_MODES:
        raise ValueError(f"unknown dispatch mode {mode!r}; use one of {FORCED_MODES}")
    token = _forced.set(mode)
    try:
        yield
    finally:
        _forced.reset(token)


def on_hopper_gpu() -> bool:
    """Whether the default device is an NVIDIA Hopper GPU (H100/H200 or compute capability 9.x)."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return False
    kind = getattr(device, "device_kind", "")
    return "H100" in kind or "H200" in kind or str(getattr(device, "compute_capability", "")).startswith("9")


def per_device_region() -> bool:
    """Whether the code being traced runs on device-local arrays: inside `jax.shard_map` over every axis of the
    context mesh (where `qjax.dot_general` puts its quantized GEMMs when a mesh is set)."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and mesh.are_all_axes_manual


def kernel_mode(backend: str = "auto", per_device: bool = False) -> tuple[bool, bool]:
    """(run the kernel?, interpret it?) for a backend: "pallas" always runs it (interpreted off a Hopper GPU),
    "auto" only compiled on a Hopper GPU, with one device or inside a per-device region (or as `force` says),
    "xla" never. per_device: the caller runs the kernel inside a `jax.shard_map` of its own (the fused AdamW step
    under a mesh), so on device-local arrays.

    "auto" stays on XLA where several devices are visible and the arrays may be global: the kernels are custom
    calls without a partitioning rule, so XLA would gather their operands onto every device. `qjax.dot_general`
    runs its GEMMs per device under a context mesh (`jax.sharding.use_abstract_mesh` / `jax.set_mesh`).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {BACKENDS}")
    if backend == "xla":
        return False, False
    hopper = on_hopper_gpu()
    if backend == "pallas":
        return True, not hopper
    forced = _forced.get()
    if forced is not None:
        return forced != "reference", forced == "interpret"
    if hopper and jax.device_count() > 1 and not (per_device or per_device_region()):
        _warn_kernels_off(jax.device_count())
        return False, False
    return hopper, False


@functools.lru_cache(maxsize=None)
def _warn_kernels_off(device_count: int) -> None:
    """Says once per process that "auto" left the kernels off (silently slow otherwise: the XLA path runs an int8
    linear layer at about half the kernels' speed)."""
    warnings.warn(f"qjax: {device_count} GPUs are visible and a kernel would see global arrays, so backend 'auto' "
                  "runs the XLA path instead of the Pallas kernels (they have no partitioning rule). Set the "
                  "mesh while tracing "
                  "(`with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):` or `jax.set_mesh(mesh)`): "
                  "qjax.dot_general then runs its GEMMs per device; qjax's train step does this, and passes the fused "
                  "AdamW step its params' PartitionSpecs (qjax.optim.apply_gradients' param_specs), so it runs "
                  "per device too.", stacklevel=3)


def _unsupported(backend: str, what: str, reason: str):
    """The kernel cannot run this case: an error for "pallas" (an explicit request), else the reference runs."""
    if backend == "pallas":
        raise ValueError(f"backend 'pallas': the {what} kernel cannot run this case ({reason}); use backend 'auto' "
                         "to fall back to XLA")


def kernel_if_supported(backend: str, what: str, supports) -> tuple[bool, bool]:
    """`kernel_mode(backend)` for an op whose kernel may not handle the case: supports(interpret) is None where it
    does, else the reason, and then the reference runs (an error for "pallas", an explicit request)."""
    run_kernel, interpret = kernel_mode(backend)
    if run_kernel:
        reason = supports(interpret)
        if reason is None:
            return True, interpret
        _unsupported(backend, what, reason)
    return False, False


def quantize_pair(x: jax.Array, spec: QuantSpec | None, spec_t: QuantSpec | None, seed, seed_t, *,
                  backend: str = "auto", operands: tuple[str, str] = ("array", "transposed array"),
                  row_axes: tuple[str, ...] = (), col_axes: tuple[str, ...] = (), valid_rows=None
                  ) -> tuple[QTensor | None, QTensor | None]:
    """x (..., R, C) quantized per `spec` and its transpose (..., C, R) per `spec_t` (either may be None): the fused
    kernel (both layouts from one read) where `backend` selects it and it supports the case, else
    `qjax.quantize.quantize_pair_reference` (same arguments but backend; results bit-identical). Batched x, a single
    layout and tensorwise pairs the reference does once take the reference. valid_rows: None, or an int32 scalar:
    x's rows from it on are quantized as zeros (`numerics.zero_rows`; the kernel masks them as it reads x)."""
    if spec is not None and spec_t is not None and x.ndim == 2:
        run_kernel, interpret = kernel_mode(backend)
        if run_kernel:
            reason = quantize_mgpu.supports(x, spec, spec_t)
            if reason is None:
                return quantize_mgpu.quantize_pair_kernel(x, spec, spec_t, seed, seed_t, valid_rows=valid_rows,
                                                          interpret=interpret, row_axes=row_axes, col_axes=col_axes)
            _unsupported(backend, "fused quantize", reason)
    return quantize_pair_reference(numerics.zero_rows(x, valid_rows), spec, spec_t, seed, seed_t, operands=operands,
                                   row_axes=row_axes, col_axes=col_axes)


def quantize_grouped_pair(w: jax.Array, spec: QuantSpec | None, spec_t: QuantSpec | None, seed, seed_t, *,
                          backend: str = "auto", operands: tuple[str, str] = ("array", "transposed array")
                          ) -> tuple[QTensor | None, QTensor | None]:
    """A ragged_dot's expert weights w (G, K, N) quantized as (G, N, K) per `spec` (the forward's layout) and as
    (G, K, N) per `spec_t` (dgrad's), either None: `quantize_pair_reference(swapaxes(w, 1, 2), ...)`'s results.
    Where `backend` selects it and it supports the case (G > 1, row or tensor scales), the fused kernel runs on w
    viewed as (G * K, N): its rows are spec_t's layout, its columns per group of K rows
    (`quantize_pair_kernel`'s col_groups) spec's: one amax and one tile kernel for the whole batch."""
    groups, k, n = w.shape
    if spec is not None and spec_t is not None and groups > 1 and not spec_t.is_block_scaled:
        run_kernel, interpret = kernel_mode(backend)
        stacked = w.reshape(groups * k, n)
        if run_kernel and quantize_mgpu.supports(stacked, spec_t, spec, col_groups=groups) is None:
            q_t, q = quantize_mgpu.quantize_pair_kernel(stacked, spec_t, spec, seed_t, seed, col_groups=groups,
                                                        interpret=interpret)
            scale_t = q_t.scale if q_t.scale.ndim == 0 else q_t.scale.reshape(groups, k, 1)
            return q, QTensor(q_t.data.reshape(groups, k, n), scale_t, q_t.granularity)
    return quantize_pair_reference(jnp.swapaxes(w, 1, 2), spec, spec_t, seed, seed_t, operands=operands)


def rms_norm_forward_saving(x: jax.Array, scale: jax.Array, spec: QuantSpec, group: int, reference, *, eps: float,
                            dtype, backend: str = "auto"):
    """(RMSNorm of x (..., D) with scale (D,) in `dtype`, x's saved 8-bit copy): the fused kernel
    (`kernels.rmsnorm_mgpu.forward_saving`, one read of x) where `backend` selects it and it supports the case, else
    `reference(x, scale, spec, group)`, the composition it equals (`qjax.models.ops.rms_norm`'s forward and
    `qjax.prologue.save`: the model layer owns it, so it is passed in)."""
    run_kernel, interpret = kernel_if_supported(backend, "fused RMSNorm",
                                                lambda _: rmsnorm_mgpu.supports(x, scale, spec, group))
    if run_kernel:
        return rmsnorm_mgpu.forward_saving(x, scale, eps=eps, dtype=dtype, spec=spec, group=group, interpret=interpret)
    return reference(x, scale, spec, group)


def quantized_matmul(a: QTensor, b: QTensor, out_dtype, *, precise_accumulation: bool = False,
                     backend: str = "auto") -> jax.Array:
    """(B?, M, K) x (B?, N, K) QTensors -> (B?, M, N) of out_dtype: the Mosaic GPU GEMM where `backend` selects it
    and it supports the case (2-D operands), else the reference `scaled_matmul` (equal to float32 rounding).
    precise_accumulation as in `scaled_matmul`; the kernel then promotes its fp8 partial sums to float32 every 128
    of K, as cuBLAS does at Precision.HIGHEST."""
    run_kernel, interpret = kernel_mode(backend)
    if run_kernel:
        reason = "batched operands" if a.data.ndim != 2 else scaled_matmul_mgpu.supports(a, b, out_dtype)
        if reason is None:
            return scaled_matmul_mgpu.scaled_matmul_kernel(a, b, out_dtype, precise_accumulation=precise_accumulation,
                                                            interpret=interpret)
        _unsupported(backend, "scaled GEMM", reason)
    return scaled_matmul.scaled_matmul(a, b, out_dtype, precise_accumulation)


def swiglu_forward_saving(gate_up: jax.Array, spec: QuantSpec, group: int, reference, *, backend: str = "auto"):
    """(silu(gate) * up, the saved 8-bit copy of gate_up) for gate_up (..., 2F): the fused kernel
    (`kernels.swiglu_mgpu.swiglu_quantize`, one read of gate_up) where `backend` selects it and it supports the
    case, else `reference(gate_up, spec, group)`, the composition it equals (`qjax.models.ops.SWIGLU`'s forward
    and `qjax.prologue.save`: the model layer owns it, so it is passed in)."""
    run_kernel, interpret = kernel_if_supported(backend, "fused SwiGLU",
                                                lambda _: swiglu_mgpu.supports_forward(gate_up, spec, group))
    if run_kernel:
        return swiglu_mgpu.swiglu_quantize(gate_up, spec, group, interpret=interpret)
    return reference(gate_up, spec, group)


def swiglu_backward_saved(saved: QTensor, x_like, dh: jax.Array, reference, *, backend: str = "auto") -> jax.Array:
    """d(gate_up) (x_like's shape and dtype) from gate_up's saved 8-bit copy and dh (..., F): the fused kernel
    (`kernels.swiglu_mgpu.swiglu_backward`, one read of codes and dh) where `backend` selects it and it supports
    the case, else `reference(saved, x_like, dh)` (`qjax.prologue.restore`, then SwiGLU's backward)."""
    run_kernel, interpret = kernel_if_supported(backend, "fused SwiGLU backward",
                                                lambda _: swiglu_mgpu.supports_backward(saved, dh, x_like))
    if run_kernel:
        return swiglu_mgpu.swiglu_backward(saved, dh, interpret=interpret)
    return reference(saved, x_like, dh)
