"""A quantized linear layer fused with the op before it: y = op(x, *params), out = y . kernel, one custom VJP.

The data-flow recipes (`fp8_dataflow`, `int8_dataflow`) keep only 8-bit tensors for the backward of a norm or an
activation function and the linear layer that reads its output (COAT, Jetfire, DeepSeek-V3). `qjax.dot_general`
alone cannot: its input y is the op's output, and what the op's own backward needs (the norm's input, SwiGLU's
gate and up) is saved by the op, in the compute dtype. Here the op and the GEMM share one VJP:

  forward    y = op(x, *params); out = the recipe's forward GEMM of y and the kernel
             saved: x quantized per `recipe.saved` in groups of `recipe.saved_group` consecutive features (one
             float32 scale per group), the params, and what the GEMM saves anyway (y and the kernel quantized as
             wgrad and dgrad read them, from one read of each: `qjax.dispatch.quantize_pair`). Not the op's
             compute-dtype input or its float32 statistics.
  backward   x' = dequantized x; the op's residuals recomputed from x' (elementwise, cheap)
             dy, dkernel = the recipe's dgrad and wgrad GEMMs
             dx, dparams = op.backward(op residuals, dy)

so a norm + linear saves an 8-bit copy of the norm's input beside the GEMM's 8-bit copy of its output, and
SwiGLU + linear an 8-bit copy of gate and up. The GEMMs are those of `qjax.dot_general`
(`linear_core.linear_parts`): same quantization, kernels and mesh path.

`Recipe.recompute_prologue_output` (opt-in) drops the GEMM's 8-bit wgrad copy of y from what is saved: the backward
recomputes y = op.forward(x') and hands it to the GEMM's backward, which quantizes it for wgrad with the recipe's
wgrad spec and seed (DeepSeek-V3 recomputes SwiGLU's output so). The forward is unchanged (its quantize kernel
still writes both layouts of y from one read; the wgrad layout is then a temporary); dy, dx and dparams are the
flag-off ones bit for bit, and wgrad reads a second rounding of y (from x', not x).
"""

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from qjax import recipes as recipes_lib
from qjax.linear_core import device_axes, layout_from, linear_parts, operand_seeds, per_device
from qjax.qtensor import QTensor, QuantSpec
from qjax.quantize import quantize_with_seed
from qjax.weight_sharding import varying


@dataclasses.dataclass(frozen=True)
class Prologue:
    """An op run before a linear layer, with its hand-written backward.

    apply(x, *params) -> y: the op alone, differentiable (where no linear layer is fused after it).
    forward(x, *params) -> (y, residuals): y (..., K) in the compute dtype, residuals what backward reads.
    backward(residuals, dy) -> (dx, *dparams), in the dtypes of x and params.

    Fused producers (optional; a data-flow recipe's `prologue_dot` uses them where set, else it composes the above
    with `save` / `restore`, which they must equal):
    forward_saving(x, *params, *, spec, group, backend) -> (y, saved): y = forward(x, *params)[0] and saved = save(x,
      spec, group), from one read of x; backend: the recipe's (`qjax.dispatch.kernel_mode`).
    backward_saved(saved, x_like, params, dy, *, backend) -> (dx, *dparams): backward(forward(restore(saved,
      x_like.shape, x_like.dtype), *params)[1], dy), from one read of the saved codes and dy (x_like: x's
      ShapeDtypeStruct).
    """

    name: str
    apply: Callable
    forward: Callable
    backward: Callable
    forward_saving: Callable | None = None
    backward_saved: Callable | None = None


def check_saved_group(recipe: recipes_lib.Recipe, features: int, layer: str) -> None:
    """ValueError naming `layer` when `recipe` saves activations in groups that do not tile `features`."""
    if recipe.saved is not None and recipe.saved_group and features % recipe.saved_group:
        raise ValueError(f"{layer}: recipe {recipe.name!r} saves activations in groups of {recipe.saved_group} "
                         f"features, which do not tile {features}; make the layer's width a multiple of "
                         f"{recipe.saved_group} or keep it in high precision (keep_high_precision)")


def save(x: jax.Array, spec: QuantSpec | None, group: int):
    """x (..., F) -> the QTensor of its (..., F / group, group) view, one scale per group (per row if group 0);
    x itself where spec is None."""
    if spec is None:
        return x
    view = x.reshape(*x.shape[:-1], x.shape[-1] // group, group) if group else x
    return quantize_with_seed(view, spec, None, operand="saved activation")


def restore(saved, shape: tuple[int, ...], dtype) -> jax.Array:
    """The inverse of `save`: x (shape, dtype) from its saved form."""
    if not isinstance(saved, QTensor):
        return saved
    return saved.dequantize(jnp.float32).reshape(shape).astype(dtype)


def prologue_dot(op: Prologue, x: jax.Array, params: tuple, kernel: jax.Array, *, recipe, key=None,
                 layer: str = "linear") -> jax.Array:
    """op(x, *params) . kernel, quantized per `recipe`; saves x (8-bit per `recipe.saved`, else as it is), not y.

    Args:
      op: the `Prologue` (e.g. `qjax.models.ops.rms_norm_prologue(eps, dtype)`, `ops.SWIGLU`).
      x: (B, ..., features) activation, the op's first input; params: the op's other inputs (norm scale, bias).
      kernel: (K, N), the Dense layout, in the compute dtype (cast it before: its gradient flows back through
        the cast); under `Recipe.recompute_weight_codes` the param itself, in any float dtype (quantized from it,
        saved as it is; the output then takes y's dtype).
      recipe: a `qjax.Recipe` or name; key: `jax.random.key` for recipes that round stochastically.
      layer: the layer's name in error messages.

    Returns:
      (B, ..., N) in the promoted dtype of y and kernel (y's under `Recipe.recompute_weight_codes`). Under a
      context mesh the layer runs per device as `qjax.dot_general` does (x split along dim 0, params and kernel
      whole).
    """
    recipe = recipes_lib.recipe(recipe)
    x, kernel = jnp.asarray(x), jnp.asarray(kernel)
    y = jax.eval_shape(lambda *a: op.forward(*a)[0], x, *params)
    if kernel.ndim != 2 or y.shape[-1] != kernel.shape[0]:
        raise ValueError(f"{layer}: kernel must be (features_in, features_out) = ({y.shape[-1]}, N), got "
                         f"{kernel.shape}")
    check_saved_group(recipe, x.shape[-1], f"{layer} input")
    layout = layout_from(y.shape, kernel.shape, (((y.ndim - 1,), (0,)), ((), ())))
    out_dtype = y.dtype if recipe.recompute_weight_codes else jnp.result_type(y.dtype, kernel.dtype)
    axes, seeds = device_axes(recipe, layout), operand_seeds(recipe, key)
    if axes:
        layout = layout.split_rows(jax.sharding.get_abstract_mesh().size)
    gemm_forward, gemm_backward = linear_parts(layout, recipe, out_dtype, y.dtype, kernel.dtype, None, axes)

    def fwd(x, *rest):
        *params, kernel, seeds = rest
        if op.forward_saving is not None and recipe.saved is not None:
            y, x_saved = op.forward_saving(x, *params, spec=recipe.saved, group=recipe.saved_group,
                                            backend=recipe.backend)
        else:
            y, x_saved = op.forward(x, *params)[0], save(x, recipe.saved, recipe.saved_group)
        out, (w_res, y_res) = gemm_forward(y, kernel, seeds, None, with_residuals=True)
        y_res = None if recipe.recompute_prologue_output else y_res  # recomputed in bwd instead
        return out, (x_saved, tuple(params), (w_res, y_res), seeds)

    def bwd(residuals, g):
        x_saved, params, (w_res, y_res), seeds = residuals  # y_res None: y is recomputed for wgrad
        x_like = jax.ShapeDtypeStruct(g.shape[:-1] + (x.shape[-1],), x.dtype)  # x's local (per-device) shape
        restored = lambda: restore(x_saved, x_like.shape, x_like.dtype)
        if op.backward_saved is not None and isinstance(x_saved, QTensor):
            if y_res is None:  # the kernel below reads the codes itself; y alone is recomputed here (XLA)
                y_res = op.forward(restored(), *params)[0]
            dy, dkernel = gemm_backward((w_res, y_res, seeds), g)
            grads = op.backward_saved(x_saved, x_like, params, dy, backend=recipe.backend)
            # a kernel's outputs carry no per-device type: give them their inputs' (varying over `axes`)
            return (*[varying(d, axes) for d in grads], dkernel, None)
        y, op_residuals = op.forward(restored(), *params)
        dy, dkernel = gemm_backward((w_res, y if y_res is None else y_res, seeds), g)
        return (*op.backward(op_residuals, dy), dkernel, None)

    @jax.custom_vjp
    def fused(x, *rest):
        *params, kernel, seeds = rest
        return gemm_forward(op.forward(x, *params)[0], kernel, seeds, None, with_residuals=False)[0]

    fused.defvjp(fwd, bwd)
    if axes:
        return per_device(fused, axes)(x, *params, kernel, seeds)
    return fused(x, *params, kernel, seeds)
