"""Scaled matmul of two quantized operands: the jnp/XLA reference every GEMM kernel is tested against.

(B?, M, K) x (B?, N, K) QTensors -> (B?, M, N): the GEMM runs on the 8-bit codes and the scales are applied after it
(row/tensor scales) or, for block-scaled operands, the reference dequantizes and multiplies in float32.
"""

import jax
import jax.numpy as jnp
from jax import lax

from qjax import kernels
from qjax.quantize import QTensor, dequantize


def _contract_last(ndim):
    """dot_general dims for (B?, M, K) x (B?, N, K) -> (B?, M, N)."""
    batch = ((0,), (0,)) if ndim == 3 else ((), ())
    return ((ndim - 1,), (ndim - 1,)), batch


def scaled_matmul(a: QTensor, b: QTensor, out_dtype, precise_accumulation: bool = False) -> jax.Array:
    """(B?, M, K) x (B?, N, K) quantized operands -> (B?, M, N) of out_dtype, scales applied after the GEMM.

    int8 runs int8 x int8 -> int32 (the only fast int8 GEMM in XLA); fp8 runs on the fp8 arrays -> f32 (bf16 when the
    output is bf16). (A dequantize-in-f32 form with scalar scales was measured on the H200 to be simplified by XLA
    into a quantize-dequantize pass plus an f32 GEMM: 0.46x bf16.) Block-scaled operands are dequantized and
    multiplied in f32 (reference path).

    precise_accumulation: fp8 only. XLA runs fp8 GEMMs with Hopper's fast (reduced-precision) accumulation unless
    the precision is HIGHEST; like TransformerEngine, torchao and Flax we keep it in the forward GEMM and turn it
    off for dgrad and wgrad, whose contracting dims (N, and M = all tokens) are long.
    """
    dims = _contract_last(a.data.ndim)
    if a.granularity in ("1x128", "128x128") or b.granularity in ("1x128", "128x128"):
        out = lax.dot_general(dequantize(a), dequantize(b), dims, lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32)
        return out.astype(out_dtype)
    if jnp.issubdtype(a.data.dtype, jnp.integer):
        acc = _int8_matmul(a.data, b.data, dims)
    else:
        # cuBLASLt accumulates fp8 in f32 and can write bf16: half the epilogue's bytes, an extra 2**-9 relative
        # rounding before the scales, far below fp8's own error. (Not f16: unscaled sums of codes reach 448**2 * K.)
        acc_dtype = jnp.bfloat16 if out_dtype == jnp.bfloat16 else jnp.float32
        precision = lax.Precision.HIGHEST if precise_accumulation else lax.Precision.DEFAULT
        acc = lax.dot_general(a.data, b.data, dims, precision, preferred_element_type=acc_dtype).astype(jnp.float32)
    b_scale = b.scale if b.granularity == "tensor" else jnp.swapaxes(b.scale, -1, -2)
    return (acc * a.scale * b_scale).astype(out_dtype)


# Largest K for which an int32 sum of K products of int8 codes (|code| <= 127) cannot overflow.
INT32_SAFE_K = (2**31 - 1) // 127**2


def _int8_matmul(a, b, dims):
    """int8 (B?, M, K) x (B?, N, K) -> float32 (B?, M, N), exact: int32 accumulation in K-chunks that cannot overflow
    (wgrad contracts over every token, which can exceed 133,143), chunk sums added in float32."""
    k = a.shape[-1]
    chunk = 1 << (INT32_SAFE_K.bit_length() - 1)  # 131072: keeps slices aligned
    if k <= INT32_SAFE_K:
        return lax.dot_general(a, b, dims, preferred_element_type=jnp.int32).astype(jnp.float32)
    parts = [lax.dot_general(a[..., i:i + chunk], b[..., i:i + chunk], dims, preferred_element_type=jnp.int32)
             for i in range(0, k, chunk)]
    return sum(part.astype(jnp.float32) for part in parts)


def quantized_matmul(a: QTensor, b: QTensor, out_dtype, *, precise_accumulation: bool = False,
                     backend: str = "auto") -> jax.Array:
    """The GEMM `qjax.dot_general` runs: the Mosaic GPU kernel where `backend` asks for it and it supports the case,
    else the reference `scaled_matmul`. Same arguments and result as `scaled_matmul` (see `qjax.Recipe.backend`).

    The kernel is 2-D; batched operands (B, M, K) take the reference. fp8 GEMMs that need precise accumulation
    (the fp8 recipes' dgrad and wgrad) run on the kernel too, which promotes their partial sums to float32 every 128
    of K. Against cuBLAS at Precision.HIGHEST plus XLA's separate pass for the scales (H200, 2026-11-25, steps
    queued back to back): linear layers within 2% either way except fp8_rowwise at 4096² (4.7% faster on the
    kernel), the 1.1B Llama fp8_tensorwise step 179.1-182.6 vs 179.8 ms, and that step compiled in 68-84 s instead
    of 175 s.
    """
    run_kernel, interpret = kernels.use_kernel(backend)
    if not run_kernel:
        return scaled_matmul(a, b, out_dtype, precise_accumulation)
    from qjax.kernels import scaled_matmul_mgpu  # imported here: Mosaic GPU is only needed when it runs

    reason = "batched operands" if a.data.ndim != 2 else scaled_matmul_mgpu.supports(a, b, out_dtype)
    if reason is None:
        return scaled_matmul_mgpu.scaled_matmul_kernel(a, b, out_dtype, precise_accumulation=precise_accumulation,
                                                        interpret=interpret)
    if backend == "pallas":
        raise ValueError(f"backend 'pallas': the scaled GEMM kernel cannot run this case ({reason}); use backend "
                         "'auto' to fall back to XLA")
    return scaled_matmul(a, b, out_dtype, precise_accumulation)

