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
  stochastic_round(x, dtype, key)                          unbiased rounding to bf16 / fp8 / int8
  int8_params                                              INT8 weight-only parameters (Int8Param, its Flax glue)
  optim, models, data, train                               low-bit AdamW, Llama / ViT, datasets, the training loop
                                                           (imported on first use: `qjax.optim.adamw_8bit(...)`)
"""

import importlib

from qjax import int8_params
from qjax.convert import quantize_model
from qjax.dot_general import dot_general
from qjax.flax import DotGeneral, einsum, make_dot_general, recipe_for_layer
from qjax.gemm_report import report
from qjax.qtensor import QTensor, QuantSpec, dequantize
from qjax.quantize import quantize
from qjax.ragged_dot import ragged_dot
from qjax.recipes import RECIPES, GemmSpec, Recipe, recipe, with_stochastic_gradients
from qjax.stochastic import stochastic_round
from qjax.weight_sharding import WeightSharding

__all__ = [
    "DotGeneral", "GemmSpec", "QTensor", "QuantSpec", "RECIPES", "Recipe", "dequantize", "dot_general", "einsum",
    "int8_params", "make_dot_general", "optim", "quantize", "quantize_model", "ragged_dot", "recipe",
    "recipe_for_layer", "report",
    "stochastic_round", "with_stochastic_gradients", "WeightSharding",
]

# Subpackages imported on first attribute access, so `import qjax` stays light (no optimizer, model, orbax or data
# code) and the layers above the core (optim, models, train) can import `qjax` without a circle.
_LAZY_SUBMODULES = ("data", "models", "optim", "train")


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"qjax.{name}")
    raise AttributeError(f"module 'qjax' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY_SUBMODULES))
