"""JAX's own bf16 grouped GEMM kernels (mixture-of-experts `ragged_dot`) for Hopper, as `qjax.ragged_dot` calls them.

  `bf16_rows`: `jax.experimental.pallas.ops.gpu.ragged_dot_mgpu.ragged_dot` (the forward and dgrad shape, rows ragged)
  `bf16_contract`: `transposed_ragged_dot_mgpu.transposed_ragged_dot` (the wgrad shape, contracting over each
    group's rows)

called with the block sizes below where the shapes tile (`bf16_supports`). They run compiled only (no interpreted
mode); their reference is `lax.ragged_dot`. The scaled 8-bit grouped kernels are ours: `grouped_matmul_mgpu`.
"""

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

# 128 x 128 output tiles, 64 of K per step (128 bytes of bf16: one 128B swizzle row), 4 stages.
BF16_BLOCKS = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=8)


def bf16_supports(lhs, rhs, out_dtype, interpret: bool) -> str | None:
    """None if `bf16_rows` and `bf16_contract` run all three GEMMs of lhs (M, K) x rhs (G, K, N) -> out_dtype
    (forward, dgrad, wgrad), else why not."""
    if interpret:
        return "JAX's bf16 grouped kernels have no interpreted mode"
    dtypes = {jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype), jnp.dtype(out_dtype)}
    if dtypes != {jnp.dtype(jnp.bfloat16)}:
        return f"JAX's grouped kernels run here for bfloat16 operands and output only, got {sorted(map(str, dtypes))}"
    (m, k), n = lhs.shape, rhs.shape[2]
    tile = BF16_BLOCKS["block_m"]
    if m % tile or k % tile or n % tile:
        return f"M, K and N must be multiples of {tile} (no padding), got M={m}, K={k}, N={n}"
    return None


def bf16_rows(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, transpose_rhs: bool = False) -> jax.Array:
    """JAX's grouped kernel: lhs (M, K) bf16 x rhs (G, K, N) (or (G, N, K) with transpose_rhs) -> (M, N) bf16,
    f32 accumulation; rows >= sum(group_sizes) are 0 (the kernel leaves them unwritten)."""
    out = ragged_dot_mgpu.ragged_dot(lhs, rhs, group_sizes=group_sizes, transpose_rhs=transpose_rhs, **BF16_BLOCKS)
    valid = jnp.arange(lhs.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(valid[:, None], out, jnp.zeros((), out.dtype))


def bf16_contract(x: jax.Array, g: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """JAX's transposed grouped kernel: x (M, K) bf16, g (M, N) bf16 -> (G, K, N) bf16, out[e] = x[rows of e]^T .
    g[rows of e] with f32 accumulation. It masks the rows of neighbouring groups by multiplying them with 0, so rows
    after sum(group_sizes) must be finite (callers zero them), and an Inf in one group's rows of x makes the
    neighbouring groups' sums NaN where lax.ragged_dot_general keeps them finite."""
    return transposed_ragged_dot_mgpu.transposed_ragged_dot(x, g, group_sizes=group_sizes, **BF16_BLOCKS)
