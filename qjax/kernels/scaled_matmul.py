"""Scaled matmul of two quantized operands: the jnp/XLA reference every GEMM kernel is tested against (and the GEMM
`qjax.dispatch.quantized_matmul` runs where no kernel does).

(B?, M, K) x (B?, N, K) QTensors -> (B?, M, N): the GEMM runs on the 8-bit codes and the scales are applied after it
(row/tensor scales) or, for block-scaled operands, the reference dequantizes and multiplies in float32.
"""

import jax
import jax.numpy as jnp
from jax import lax

from qjax.numerics import INT32_SAFE_K
from qjax.qtensor import QTensor, dequantize


def contract_last(ndim):
    """dot_general dims for (B?, M, K) x (B?, N, K) -> (B?, M, N)."""
    batch = ((0,), (0,)) if ndim == 3 else ((), ())
    return ((ndim - 1,), (ndim - 1,)), batch


def scaled_matmul(a: QTensor, b: QTensor, out_dtype, precise_accumulation: bool = False) -> jax.Array:
    """(B?, M, K) x (B?, N, K) quantized operands -> (B?, M, N) of out_dtype, scales applied after the GEMM.

    int8 runs int8 x int8 -> int32 (the only fast int8 GEMM in XLA); fp8 runs on the fp8 arrays -> f32 (bf16 when the
    output is bf16): XLA turns a dequantize-in-f32 form into an f32 GEMM (benchmarks/NOTES.md). Block-scaled
    operands are dequantized and multiplied in f32 (reference path).

    precise_accumulation: fp8 only. XLA runs fp8 GEMMs with Hopper's fast (reduced-precision) accumulation unless
    the precision is HIGHEST; like TransformerEngine, torchao and Flax we keep it in the forward GEMM and turn it
    off for dgrad and wgrad, whose contracting dims (N, and M = all tokens) are long.
    """
    dims = contract_last(a.data.ndim)
    if a.is_block_scaled or b.is_block_scaled:
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
