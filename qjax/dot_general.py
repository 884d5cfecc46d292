"""`qjax.dot_general`: a drop-in for `jax.lax.dot_general` whose forward, dgrad and wgrad GEMMs are quantized.

The GEMM halves, operand layouts and mesh path are `qjax.linear_core`'s (its docstring: the TN views, what the custom
VJP saves, how the GEMM runs per device under a mesh and with a `WeightSharding`). This module wraps them in one
custom VJP per static configuration and checks the arguments.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from qjax import recipes as recipes_lib
from qjax.linear_core import Layout, device_axes, layout_from, linear_parts, operand_seeds, operand_spec, per_device
from qjax.qtensor import QTensor
from qjax.weight_sharding import WeightSharding, per_device_sharded, sharded_layout, without_trivial_axes


@functools.lru_cache(maxsize=None)
def _quantized_dot(layout: Layout, recipe: recipes_lib.Recipe, out_dtype, lhs_dtype, rhs_dtype, precision,
                   token_axes: tuple[str, ...] = (), sharding: WeightSharding | None = None):
    """The custom_vjp function (lhs, rhs, seeds, rhs_q) -> out for one static configuration (`linear_parts`)."""
    forward_gemm, backward = linear_parts(layout, recipe, out_dtype, lhs_dtype, rhs_dtype, precision, token_axes,
                                          sharding)

    def forward(lhs, rhs, seeds, rhs_q):
        out, (w_res, x_res) = forward_gemm(lhs, rhs, seeds, rhs_q, with_residuals=True)
        return out, (w_res, x_res, seeds)

    @jax.custom_vjp
    def quantized_dot(lhs, rhs, seeds, rhs_q):
        return forward_gemm(lhs, rhs, seeds, rhs_q, with_residuals=False)[0]

    quantized_dot.defvjp(forward, lambda residuals, g: (*backward(residuals, g), None, None))
    return quantized_dot


def _check_rhs_quantized(rhs_q, recipe: recipes_lib.Recipe, layout: Layout) -> None:
    """ValueError unless rhs_q can stand in for the forward GEMM's quantization of rhs."""
    spec = operand_spec(recipe.fwd, "rhs")
    if not isinstance(rhs_q, QTensor):
        raise TypeError(f"rhs_quantized must be a qjax.QTensor, got {type(rhs_q).__name__}")
    if spec is None or spec.stochastic or spec.is_block_scaled or spec.dtype == "ternary":
        raise ValueError(f"rhs_quantized replaces a row or tensor quantization of rhs in the forward GEMM; recipe "
                         f"{recipe.name!r} quantizes it as {spec}: pass rhs alone")
    expected = (layout.n, layout.k)
    if layout.batch or rhs_q.shape != expected or rhs_q.granularity != spec.granularity or \
            rhs_q.data.dtype != spec.format.dtype:
        raise ValueError(f"rhs_quantized must be rhs as (N, K) = {expected} in {spec.dtype} codes with "
                         f"{spec.granularity!r} scales (recipe {recipe.name!r}; no batch dims), got "
                         f"{rhs_q.data.dtype} {rhs_q.shape} with {rhs_q.granularity!r} scales")


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *, recipe, key=None,
                sharding: WeightSharding | None = None, rhs_quantized: QTensor | None = None):
    """Quantized `jax.lax.dot_general`: same arguments, same output shape, quantized per `recipe`.

    Args:
      lhs, rhs: float arrays (float32 / bfloat16 / float16); any batch and contracting dims, e.g. x (B, T, D) and
        w (F, D) with dimension_numbers (((2,), (1,)), ((), ())).
      dimension_numbers: ((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch)), as for lax.dot_general.
      precision: used only by GEMMs the recipe leaves in high precision.
      preferred_element_type: output dtype (default: the inputs' result type). Gradients come back in the dtypes
        of lhs and rhs.
      recipe: a `qjax.Recipe` or a recipe name (see `qjax.RECIPES`).
      key: `jax.random.key`, required when the recipe rounds stochastically; use a fresh one every step.
      sharding: how rhs, a weight, lies on the mesh set while tracing (FSDP / tensor parallelism, module
        docstring); None: rhs whole on every device.
      rhs_quantized: optional `QTensor`, rhs already quantized as the forward GEMM reads it: (N, K) codes in the
        recipe's fwd.rhs format and granularity (row or tensor, nearest rounding), e.g. an int8 weight-only
        parameter's stored codes and scales (`qjax.int8_params.Int8Param.forward_operand`). The forward GEMM then runs
        on them instead of quantizing rhs; rhs (the same weight, dequantized) still feeds dgrad and receives the
        gradient. Ignored by recipes that leave every GEMM in high precision; with it, `sharding` is not used
        (XLA gathers the weight).

    Returns:
      Array of shape (batch..., lhs free..., rhs free...), as lax.dot_general. Differentiable (custom VJP with
      quantized dgrad and wgrad); works under jit, grad, vmap, scan and remat. The "bf16" recipe *is*
      lax.dot_general.
    """
    recipe = recipes_lib.recipe(recipe)
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    layout = layout_from(lhs.shape, rhs.shape, dimension_numbers)
    if recipe.is_high_precision or lhs.size == 0 or rhs.size == 0:  # nothing to quantize in an empty operand
        return lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)
    for name, array in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(array.dtype, jnp.floating):
            raise TypeError(f"recipe {recipe.name!r} quantizes float inputs; {name} has dtype {array.dtype}. "
                            "Cast it to bfloat16/float32 first, or use jax.lax.dot_general for integer math")
    if rhs_quantized is not None:
        _check_rhs_quantized(rhs_quantized, recipe, layout)
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
    seeds = operand_seeds(recipe, key)
    if sharding is not None:
        sharding = without_trivial_axes(sharding)
    local = None if sharding is None or rhs_quantized is not None else sharded_layout(recipe, layout, sharding)
    if local is not None:
        fn = _quantized_dot(local, recipe, out_dtype, lhs.dtype, rhs.dtype, precision, sharding.tokens, sharding)
        return per_device_sharded(fn, sharding, layout)(lhs, rhs, seeds)
    axes = device_axes(recipe, layout)
    if not axes:
        return _quantized_dot(layout, recipe, out_dtype, lhs.dtype, rhs.dtype, precision)(lhs, rhs, seeds,
                                                                                           rhs_quantized)
    local = layout.split_rows(jax.sharding.get_abstract_mesh().size)
    fn = _quantized_dot(local, recipe, out_dtype, lhs.dtype, rhs.dtype, precision, axes)
    return per_device(fn, axes, n_extra=1)(lhs, rhs, seeds, rhs_quantized)
