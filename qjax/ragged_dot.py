"""`qjax.ragged_dot`: `jax.lax.ragged_dot` (the grouped GEMM of mixture-of-experts layers) with its forward, dgrad and
wgrad GEMMs quantized per a recipe.

  lhs x (M, K): tokens sorted by group; rhs w (G, K, N): one weight per group (expert); group_sizes (G,) int32
  out[m] = x[m] . w[group of m] for the first sum(group_sizes) rows, 0 for the rows after them

As in `qjax.dot_general`, every operand is quantized in the layout its GEMM reads, contracting dimension last, so a
recipe's "row" is one scale per row along that GEMM's contracting dimension:

  GEMM    lhs (rows, K)     rhs (rows, K)          contracting     "row" scales
  fwd     x  (M, K)         w as (G, N, K)         K               per token x per expert and output channel
  dgrad   g  (M, N)         w as (G, K, N)         N               per token x per expert and input channel
  wgrad   x as (K, M)       g as (N, M)            M (ragged)      per feature of x and of g, over all tokens

The wgrad GEMM is `lax.ragged_dot_general` with the tokens as a ragged contracting dimension: dw[e] sums over group
e's tokens only; its row scales (constant along the tokens) factor out of every group's sum. They span all groups'
tokens (one quantization of x and g for every expert, as dot_general's), so a NaN or Inf in one group's tokens
makes every non-empty group's weight gradient non-finite, where lax's stays finite for the other groups.
Block-scaled operands ("1x128", "128x128", "1x32") are dequantized for the GEMM
(`qjax.kernels.scaled_matmul.dequantize_for_gemm`); a 128x128 weight block is 128 x 128 of one expert. Quantization
runs through `qjax.dispatch.quantize_pair` (x, g) and `quantize_grouped_pair` (the experts' weights): the fused
kernel where it applies. Row/tensor-scaled GEMMs run on
`qjax.kernels.grouped_matmul_mgpu`'s kernels where the recipe's backend selects them (a Hopper GPU), block-scaled
ones on XLA (`_grouped_gemm` is the kernels' reference). Recipe "bf16" runs JAX's Mosaic GPU grouped kernels
(`qjax.kernels.grouped_bf16_mgpu`) on a Hopper GPU where the shapes tile (`_bf16_kernel_ragged_dot`),
`lax.ragged_dot` elsewhere; their wgrad zeroes other groups' rows by multiplying, so
there an Inf in one group's x makes the neighbouring groups' dw NaN where lax's stays finite.

Rows after sum(group_sizes) (padding) are quantized as zeros (`dispatch.quantize_pair`'s valid_rows: the fused
quantize kernel masks them as it reads x and g, with no pass of its own), so they neither produce output nor enter
the scales of real tokens, as lax.ragged_dot ignores them.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qjax import dispatch, numerics
from qjax import recipes as recipes_lib
from qjax.kernels import grouped_bf16_mgpu, grouped_contract_mgpu, grouped_matmul_mgpu
from qjax.kernels.scaled_matmul import dequantize_for_gemm
from qjax.linear_core import (DGRAD_LHS, DGRAD_RHS, FWD_LHS, FWD_RHS, WGRAD_LHS, WGRAD_RHS, operand_seeds,
                              operand_spec)
from qjax.numerics import INT32_SAFE_K
from qjax.qtensor import QTensor


# (rows, K) x (G, rows', K) -> (rows, rows'), rows ragged over the groups: the forward and dgrad GEMMs.
_RAGGED_ROWS = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
                                             rhs_group_dimensions=[0])
# (K, M) x (N, M) -> (G, K, N), M ragged: the wgrad GEMM, each group summing over its own tokens.
_RAGGED_CONTRACT = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [1]), ([], [])),
                                                 lhs_ragged_dimensions=[1], rhs_group_dimensions=[])


def _check_group_sizes(group_sizes, m: int, groups: int):
    if not isinstance(group_sizes, jax.Array | np.ndarray) or group_sizes.dtype != jnp.int32:
        got = getattr(group_sizes, "dtype", type(group_sizes).__name__)
        raise ValueError(f"group_sizes must be an int32 array of shape ({groups},), got {got}; use "
                         "jnp.asarray(sizes, jnp.int32)")
    if group_sizes.shape != (groups,):
        raise ValueError(f"group_sizes must have shape ({groups},), one size per group of rhs (G, K, N), got "
                         f"{group_sizes.shape}")
    try:
        sizes = np.asarray(group_sizes)
    except jax.errors.JAXTypeError:
        return  # values unknown while tracing (under jit the caller's sizes are trusted, as by lax.ragged_dot)
    if (sizes < 0).any() or sizes.sum() > m:
        raise ValueError(f"group_sizes must be >= 0 and sum to at most lhs rows M = {m}, got {sizes.tolist()}")


def _ragged(a, b, group_sizes, dims, out_dtype, precision=None):
    return lax.ragged_dot_general(a, b, group_sizes, dims, precision=precision, preferred_element_type=out_dtype)


def _int_ragged(a, b, group_sizes, dims):
    """int8 codes -> exact float32: int32 GEMMs in chunks of the contracting dim short enough not to overflow (wgrad
    contracts over every token), each chunk of ragged tokens with its share of every group."""
    k = a.shape[1]
    chunk = 1 << (INT32_SAFE_K.bit_length() - 1)
    if k <= INT32_SAFE_K:
        return _ragged(a, b, group_sizes, dims, jnp.int32).astype(jnp.float32)
    ends = jnp.cumsum(group_sizes)
    total = 0
    for start in range(0, k, chunk):
        sizes = group_sizes
        if dims is _RAGGED_CONTRACT:  # the tokens of each group that fall into [start, start + chunk)
            clip = lambda v: jnp.clip(v, start, start + chunk) - start
            sizes = clip(ends) - clip(ends - group_sizes)
        part = _ragged(a[:, start:start + chunk], b[..., start:start + chunk], sizes, dims, jnp.int32)
        total = total + part.astype(jnp.float32)
    return total


def _rows_and_groups(m: int, group_sizes):
    """(whether each row belongs to a group (M,), its group (M,), clipped for the padding rows)."""
    ends = jnp.cumsum(group_sizes)
    rows = jnp.arange(m, dtype=jnp.int32)
    return rows < ends[-1], jnp.minimum(jnp.searchsorted(ends, rows, side="right"), group_sizes.shape[0] - 1)


def _zero_outside(out, group_sizes, dims):
    """out with lax.ragged_dot's zeros: rows past sum(group_sizes) (rows ragged) or empty groups (the wgrad). The
    kernels write those zeros themselves; XLA's paths need the mask, since XLA's ragged dot can spread a NaN weight
    into the padding rows and an empty group's dw is 0 times scales that span all tokens (maybe not finite)."""
    if dims is _RAGGED_ROWS:
        keep = (jnp.arange(out.shape[0]) < jnp.sum(group_sizes))[:, None]
    else:
        keep = group_sizes[:, None, None] > 0
    return jnp.where(keep, out, jnp.zeros((), out.dtype))


def _grouped_gemm(a: QTensor, b: QTensor, group_sizes, dims, group_ids, out_dtype, precise: bool,
                  backend: str = "xla"):
    """Quantized grouped GEMM -> out_dtype, zero outside the groups: on the codes with scales after it, or
    dequantized (block scales). `grouped_matmul_mgpu`'s (rows ragged: forward and dgrad) and
    `grouped_contract_mgpu`'s (wgrad) kernels run where `backend` selects them and they support the operands; the
    rest of this function is their reference."""
    rows = dims is _RAGGED_ROWS
    supports = (functools.partial(grouped_matmul_mgpu.supports, a, b, group_sizes, out_dtype) if rows
                else functools.partial(grouped_contract_mgpu.supports_contract, a, b, out_dtype))
    run_kernel, interpret = dispatch.kernel_if_supported(backend, "grouped GEMM", lambda _: supports())
    if run_kernel:
        kernel = grouped_matmul_mgpu.grouped_matmul_kernel if rows else grouped_contract_mgpu.grouped_contract_kernel
        return kernel(a, b, group_sizes, out_dtype, precise=precise, interpret=interpret)
    if a.is_block_scaled or b.is_block_scaled:
        a_values, b_values, precision = dequantize_for_gemm(a, b)
        out = _ragged(a_values, b_values, group_sizes, dims, jnp.float32, precision).astype(out_dtype)
        return _zero_outside(out, group_sizes, dims)
    if jnp.issubdtype(a.data.dtype, jnp.integer):
        acc = _int_ragged(a.data, b.data, group_sizes, dims)
    else:  # fp8: precise (HIGHEST) accumulation in dgrad and wgrad, as `scaled_matmul`
        precision = lax.Precision.HIGHEST if precise else lax.Precision.DEFAULT
        acc = _ragged(a.data, b.data, group_sizes, dims, jnp.float32, precision)
    if dims is _RAGGED_CONTRACT:  # (K, M) x (N, M) -> (G, K, N): row scales (K, 1) and (N, 1)
        b_scale = b.scale if b.granularity == "tensor" else b.scale[:, 0]
    else:  # (rows, K) x (G, rows', K): b's scale (G, rows', 1) taken per row's group
        b_scale = b.scale if b.granularity == "tensor" else b.scale[group_ids, :, 0]
    return _zero_outside((acc * a.scale * b_scale).astype(out_dtype), group_sizes, dims)


def _dense_ragged(a, b, group_sizes, dims, out_dtype, precision):
    """A GEMM the recipe leaves in high precision, in the operands' promoted dtype, zero outside the groups."""
    dtype = jnp.promote_types(a.dtype, b.dtype)
    out = _ragged(a.astype(dtype), b.astype(dtype), group_sizes, dims, out_dtype, precision)
    return _zero_outside(out, group_sizes, dims)


@functools.lru_cache(maxsize=None)
def _quantized_ragged_dot(recipe: recipes_lib.Recipe, out_dtype, lhs_dtype, rhs_dtype, precision):
    """The custom_vjp function (x, w, group_sizes, seeds) -> out for one static configuration."""
    quantize_both = functools.partial(dispatch.quantize_pair, backend=recipe.backend)
    fwd, dgrad, wgrad = recipe.fwd, recipe.dgrad, recipe.wgrad

    def forward_gemm(x, w, group_sizes, seeds, with_residuals):
        rows, group_ids = jnp.sum(group_sizes), _rows_and_groups(x.shape[0], group_sizes)[1]
        x_spec_t = operand_spec(wgrad, "rhs") if with_residuals else None
        w_spec_t = operand_spec(dgrad, "rhs") if with_residuals else None
        xq, x_res = quantize_both(x, operand_spec(fwd, "lhs"), x_spec_t, seeds[FWD_LHS], seeds[WGRAD_RHS],
                                  operands=("ragged forward lhs x as (M, K)", "ragged wgrad lhs x as (K, M)"),
                                  valid_rows=rows)
        x = numerics.zero_rows(x, rows)  # for the high-precision GEMMs (XLA computes it only where they read it)
        wq, w_res = dispatch.quantize_grouped_pair(w, operand_spec(fwd, "rhs"), w_spec_t, seeds[FWD_RHS],
                                                   seeds[DGRAD_RHS], backend=recipe.backend,
                                                   operands=("ragged forward rhs w as (G, N, K)",
                                                             "ragged dgrad rhs w as (G, K, N)"))
        if fwd is None:
            out = _dense_ragged(x, jnp.swapaxes(w, 1, 2), group_sizes, _RAGGED_ROWS, out_dtype, precision)
        else:
            out = _grouped_gemm(xq, wq, group_sizes, _RAGGED_ROWS, group_ids, out_dtype, precise=False,
                                backend=recipe.backend)
        residuals = (w if w_spec_t is None else w_res, x if x_spec_t is None else x_res, group_sizes, seeds)
        return out, residuals

    def backward(residuals, g):
        w_res, x_res, group_sizes, seeds = residuals
        rows, group_ids = jnp.sum(group_sizes), _rows_and_groups(g.shape[0], group_sizes)[1]
        gq_dgrad, gq_wgrad = quantize_both(g, operand_spec(dgrad, "lhs"), operand_spec(wgrad, "lhs"),
                                           seeds[DGRAD_LHS], seeds[WGRAD_LHS],
                                           operands=("ragged dgrad lhs g as (M, N)", "ragged wgrad rhs g as (N, M)"),
                                           valid_rows=rows)
        g = numerics.zero_rows(g, rows)  # for the high-precision GEMMs
        if dgrad is None:
            dx = _dense_ragged(g, w_res, group_sizes, _RAGGED_ROWS, lhs_dtype, precision)
        else:
            dx = _grouped_gemm(gq_dgrad, w_res, group_sizes, _RAGGED_ROWS, group_ids, lhs_dtype, precise=True,
                               backend=recipe.backend)
        if wgrad is None:
            dw = _dense_ragged(x_res.T, g.T, group_sizes, _RAGGED_CONTRACT, rhs_dtype, precision)
        else:
            dw = _grouped_gemm(x_res, gq_wgrad, group_sizes, _RAGGED_CONTRACT, None, rhs_dtype, precise=True,
                               backend=recipe.backend)
        return dx, dw, None, None

    @jax.custom_vjp
    def quantized_ragged_dot(x, w, group_sizes, seeds):
        return forward_gemm(x, w, group_sizes, seeds, with_residuals=False)[0]

    quantized_ragged_dot.defvjp(lambda *args: forward_gemm(*args, with_residuals=True), backward)
    return quantized_ragged_dot


@jax.custom_vjp
def _bf16_kernel_ragged_dot(x, w, group_sizes):
    """lax.ragged_dot of bf16 x (M, K) and w (G, K, N) on JAX's Mosaic GPU grouped kernels (all three GEMMs)."""
    return grouped_bf16_mgpu.bf16_rows(x, w, group_sizes)


def _bf16_kernel_backward(residuals, g):
    x, w, group_sizes = residuals
    valid = _rows_and_groups(x.shape[0], group_sizes)[0][:, None]
    g = jnp.where(valid, g, jnp.zeros((), g.dtype))
    dx = grouped_bf16_mgpu.bf16_rows(g, w, group_sizes, transpose_rhs=True)
    # the wgrad kernel masks rows outside a group by multiplying them with 0: the padding rows must be finite
    dw = grouped_bf16_mgpu.bf16_contract(jnp.where(valid, x, jnp.zeros((), x.dtype)), g, group_sizes)
    return dx, dw, None


_bf16_kernel_ragged_dot.defvjp(lambda x, w, group_sizes: (_bf16_kernel_ragged_dot(x, w, group_sizes),
                                                          (x, w, group_sizes)), _bf16_kernel_backward)


def _use_bf16_kernels(recipe: recipes_lib.Recipe, lhs, rhs, preferred_element_type) -> bool:
    """Whether a high-precision ragged_dot runs on JAX's grouped kernels (compiled, Hopper, bf16, shapes tile).
    An optional fast path, so never an error: where they cannot run, `lax.ragged_dot` does, for any backend."""
    out_dtype = preferred_element_type or jnp.result_type(lhs, rhs)
    run_kernel, interpret = dispatch.kernel_mode(recipe.backend)
    return run_kernel and grouped_bf16_mgpu.bf16_supports(lhs, rhs, out_dtype, interpret) is None


def ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, *, recipe, key=None):
    """Quantized `jax.lax.ragged_dot`: same arguments and output, the GEMMs quantized per `recipe`.

    Args:
      lhs: (M, K) float, rows sorted by group (group 0's first).
      rhs: (G, K, N) float, one (K, N) weight per group.
      group_sizes: (G,) int32, rows per group, >= 0 and summing to at most M (checked when concrete).
      precision: used only by GEMMs the recipe leaves in high precision.
      preferred_element_type: output dtype (default: the inputs' result type); gradients come back in the dtypes of
        lhs and rhs.
      recipe: a `qjax.Recipe` or a recipe name; "bf16" *is* lax.ragged_dot.
      key: `jax.random.key`, required when the recipe rounds stochastically.

    Returns:
      (M, N): rows after sum(group_sizes) are 0. Differentiable in lhs and rhs (custom VJP with quantized dgrad and
      wgrad); works under jit, grad, vmap and scan.
    """
    recipe = recipes_lib.recipe(recipe)
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"ragged_dot takes lhs (M, K) and rhs (G, K, N) with equal K, got {lhs.shape} and {rhs.shape}")
    _check_group_sizes(group_sizes, lhs.shape[0], rhs.shape[0])
    if lhs.size == 0 or rhs.size == 0:
        return lax.ragged_dot(lhs, rhs, group_sizes, precision, preferred_element_type)
    if recipe.is_high_precision:
        if _use_bf16_kernels(recipe, lhs, rhs, preferred_element_type):
            return _bf16_kernel_ragged_dot(lhs, rhs, group_sizes)
        return lax.ragged_dot(lhs, rhs, group_sizes, precision, preferred_element_type)
    for name, array in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(array.dtype, jnp.floating):
            raise TypeError(f"recipe {recipe.name!r} quantizes float inputs; {name} has dtype {array.dtype}")
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
    fn = _quantized_ragged_dot(recipe, out_dtype, lhs.dtype, rhs.dtype, precision)
    return fn(lhs, rhs, group_sizes, operand_seeds(recipe, key))
