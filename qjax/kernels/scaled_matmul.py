"""Scaled matmul of two quantized operands: the jnp/XLA reference every GEMM kernel is tested against (and the GEMM
`qjax.dispatch.quantized_matmul` runs where no kernel does).

(B?, M, K) x (B?, N, K) QTensors -> (B?, M, N): the GEMM runs on the 8-bit codes and the scales are applied after it
(row/tensor scales) or, for block-scaled operands, the reference dequantizes and multiplies in float32 (MX "1x32"
operands in bfloat16, exactly: `dequantize_for_gemm`).
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
    output is bf16): XLA turns a dequantize-in-f32 form into an f32 GEMM. Block-scaled
    operands are dequantized and multiplied in f32 (reference path).

    precise_accumulation: fp8 only. XLA runs fp8 GEMMs with Hopper's fast (reduced-precision) accumulation unless
    the precision is HIGHEST; like TransformerEngine, torchao and Flax we keep it in the forward GEMM and turn it
    off for dgrad and wgrad, whose contracting dims (N, and M = all tokens) are long.
    """
    dims = contract_last(a.data.ndim)
    if a.is_block_scaled or b.is_block_scaled:
        a_values, b_values, precision = dequantize_for_gemm(a, b)
        out = lax.dot_general(a_values, b_values, dims, precision, preferred_element_type=jnp.float32)
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


def dequantize_for_gemm(a: QTensor, b: QTensor):
    """Block-scaled operands -> (a values, b values, precision) for a float GEMM accumulating in float32.

    MX operands (both "1x32": 8-bit codes times power-of-two scales) dequantize to bfloat16 exactly (a code has at
    most 7 significant bits, bf16 holds 8, with float32's exponent range; only products below bf16's normal range,
    blocks with amax under ~2^-100, round), so a bf16 GEMM with float32 accumulation computes what an MX tensor core
    does, at bf16 speed: Hopper has no MX GEMM. Other block scales are not powers of two: float32 at HIGHEST."""
    if a.granularity == b.granularity == "1x32":
        return dequantize(a, jnp.bfloat16), dequantize(b, jnp.bfloat16), lax.Precision.DEFAULT
    return dequantize(a), dequantize(b), lax.Precision.HIGHEST


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
