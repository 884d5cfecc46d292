"""qjax: quantized (INT8 / FP8) training for JAX.

Public API:
  recipe(name), RECIPES, Recipe, GemmSpec, QuantSpec      how each GEMM of a linear layer is quantized
  dot_general(lhs, rhs, dims, ..., recipe=, key=, sharding=)  quantized, differentiable lax.dot_general
  WeightSharding                                           how a weight lies on the mesh (FSDP, tensor parallel)
  einsum(subscripts, lhs, rhs, recipe=, key=)              quantized two-operand einsum
  ragged_dot(lhs, rhs, group_sizes, recipe=, key=)         quantized lax.ragged_dot (mixture-of-experts GEMMs)
  make_dot_general(recipe), DotGeneral, recipe_for_layer   Flax integration
  quantize_model(model, rules, skip=, min_features=)       quantize an unmodified Flax model (linen or NNX)
  report(qmodel, variables, *inputs, strict=)              which GEMMs of a traced step run in 8 bits, and why not
  quantize, dequantize, QTensor                            reference quantization (tensor/row/1x128/128x128)
  stochastic_round(x, dtype, key)                          unbiased rounding to bf16 / fp8
  int8_params                                              INT8 weight-only parameters (Int8Param, its Flax glue)
  with_stochastic_gradients(recipe)                        the recipe with its gradient operand rounded stochastically
  optim                                                    low-bit AdamW (qjax.optim)
  qjax.models, qjax.data, qjax.train                       Llama / GPT-2 / ViT, datasets, the loop (import them)

`import qjax` imports nothing but this file: each name loads its module (and flax, optax or the kernels) on first
use, e.g. `qjax.dot_general` or `from qjax import quantize_model`.
"""

import importlib
import sys
import types

__version__ = "0.2.0"

# public name -> the module that defines it (module names written out in full: tests/test_layering.py reads them)
_EXPORTS = {
    "quantize_model": "qjax.convert", "dot_general": "qjax.dot_general",
    "DotGeneral": "qjax.flax", "einsum": "qjax.flax", "make_dot_general": "qjax.flax", "recipe_for_layer": "qjax.flax",
    "report": "qjax.gemm_report",
    "QTensor": "qjax.qtensor", "QuantSpec": "qjax.qtensor", "dequantize": "qjax.qtensor",
    "quantize": "qjax.quantize", "ragged_dot": "qjax.ragged_dot",
    "RECIPES": "qjax.recipes", "GemmSpec": "qjax.recipes", "Recipe": "qjax.recipes", "recipe": "qjax.recipes",
    "with_stochastic_gradients": "qjax.recipes",
    "stochastic_round": "qjax.stochastic", "WeightSharding": "qjax.weight_sharding",
}
# Subpackages and modules imported on first attribute access; the layers above the core (optim, models, train)
# import `qjax` without a circle.
_SUBMODULES = ("data", "int8_params", "models", "optim", "train")

__all__ = sorted(_EXPORTS) + ["__version__", "int8_params", "optim"]


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"qjax.{name}")
    raise AttributeError(f"module 'qjax' has no attribute {name!r}")


class _Package(types.ModuleType):
    """Keeps the public functions named like their modules (dot_general, quantize, ragged_dot) bound to the
    functions: importing the submodule `qjax.dot_general` would otherwise rebind `qjax.dot_general` to it."""

    def __setattr__(self, name, value):
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return  # the submodule stays in sys.modules; `from qjax.<name> import ...` reads it there
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))
