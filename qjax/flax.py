"""Using qjax inside Flax models: `make_dot_general`, `DotGeneral`, `einsum` and `recipe_for_layer`.

  nn.Dense(4096, dot_general=qjax.make_dot_general("int8_rowwise"))
  nn.Dense(4096, dot_general_cls=functools.partial(qjax.DotGeneral, recipe=sr_recipe))   # draws keys from 'quant'
  y = qjax.einsum("btd,fd->btf", x, w, recipe="fp8_tensorwise")
  r = qjax.recipe_for_layer("int8_rowwise", "lm_head", features_in=2048, features_out=32000,
                            keep_high_precision=("lm_head",))     # -> the bf16 recipe
  with qjax.flax.weight_shardings(lookup):                         # while tracing a model over a sharded mesh
      model.apply(...)                                             # DotGeneral layers ask lookup(layer name)
"""

import contextlib
import contextvars
import dataclasses
import re
from typing import Any, Callable

import flax.linen as nn

from qjax import health
from qjax import int8_params
from qjax import recipes as recipes_lib
from qjax.dot_general import dot_general
from qjax.weight_sharding import WeightSharding

_WEIGHT_SHARDINGS: contextvars.ContextVar = contextvars.ContextVar("qjax_weight_shardings", default=None)


@contextlib.contextmanager
def weight_shardings(lookup: Callable[[str], WeightSharding | None]):
    """While tracing inside this context, each `DotGeneral` layer passes `lookup(layer name)` (its parent module's
    path, e.g. "layers_0/attn/qkv_proj") to `qjax.dot_general` as `sharding=`: how that layer's kernel lies on the
    mesh set while tracing (FSDP, tensor parallelism). The train step builds `lookup` from its sharding rules
    (`qjax.train.mesh.layer_sharding`); layers it returns None for take their weight whole."""
    token = _WEIGHT_SHARDINGS.set(lookup)
    try:
        yield
    finally:
        _WEIGHT_SHARDINGS.reset(token)


def layer_weight_sharding(layer: str) -> WeightSharding | None:
    """How the kernel of `layer` (a module path) lies on the mesh, per the enclosing `weight_shardings` lookup;
    None outside one."""
    lookup = _WEIGHT_SHARDINGS.get()
    return None if lookup is None else lookup(layer)


def make_dot_general(recipe, key=None):
    """A `lax.dot_general`-compatible function quantized per `recipe`, for `nn.Dense(dot_general=...)`.

    Recipes with stochastic rounding need a key. A key passed here is baked into the function: every layer built
    with it and every training step would reuse the same random bits, so for training use `DotGeneral`, which draws
    a fresh key per call from a Flax RNG stream; pass `key` only for one-off calls.
    """
    recipe = recipes_lib.recipe(recipe)
    if recipe.needs_key and key is None:
        raise ValueError(f"recipe {recipe.name!r} rounds stochastically and needs a key: use nn.Dense(dot_general_cls="
                         f"functools.partial(qjax.DotGeneral, recipe=...)) with rngs={{'quant': key}}, or pass key=")

    def quantized_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **unused):
        return dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type, recipe=recipe, key=key)

    return quantized_dot_general


class DotGeneral(nn.Module):
    """`dot_general_cls` for Flax layers: quantized per `recipe`, SR keys drawn from the `rng_collection` stream.

    Use as nn.Dense(..., dot_general_cls=functools.partial(qjax.DotGeneral, recipe="int8_rowwise")); recipes with
    stochastic rounding then need `rngs={"quant": key}` in `apply`. The rhs may be an int8 weight-only parameter
    (`qjax.int8_params.Int8Param`, passed through by `nn.Dense(promote_dtype=qjax.int8_params.promote_dtype)`): a
    forward that reads the weight as int8 rows runs on its stored codes, otherwise on its dequantized values. Inside
    `weight_shardings(lookup)`, the kernel's sharding comes from lookup(the parent layer's path). Applied with the
    "health" collection mutable, it reports its operands' quantization health (`qjax.health`).
    """

    recipe: Any
    rng_collection: str = "quant"

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **unused):
        recipe = recipes_lib.recipe(self.recipe)
        if recipe.recompute_weight_codes and preferred_element_type is None:
            preferred_element_type = lhs.dtype  # the kernel comes in its param dtype (qjax.models.layers.dense)
        key = self.make_rng(self.rng_collection) if recipe.needs_key else None
        rhs_quantized = None
        if isinstance(rhs, int8_params.Int8Param):
            rhs, rhs_quantized = int8_params.weight_operands(recipe, lhs, rhs, dimension_numbers)
            # rhs is now a dequantized copy, not the param: saving it would cost more than its codes
            recipe = dataclasses.replace(recipe, recompute_weight_codes=False)
        sharding = layer_weight_sharding("/".join(self.path[:-1]))
        out = dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type, recipe=recipe, key=key,
                          sharding=sharding, rhs_quantized=rhs_quantized)
        if health.is_collecting(self):  # only when asked: nothing is traced otherwise (qjax.health)
            out = health.observe_gemm(self, recipe, lhs, rhs, dimension_numbers, out)
        return out


def einsum(subscripts: str, lhs, rhs, *, recipe, key=None, precision=None, preferred_element_type=None):
    """Quantized two-operand einsum with an explicit output, e.g. "btd,fd->btf" (lhs quantized as x, rhs as w).

    Every label appears once per operand; labels in both operands and the output are batch dims, labels in both
    operands only are contracted. Ellipses and labels summed within one operand are rejected (ValueError).
    """
    spec = subscripts.replace(" ", "")
    inputs, arrow, out = spec.partition("->")
    lhs_labels, comma, rhs_labels = inputs.partition(",")
    if not arrow or not comma or "," in rhs_labels or "." in spec:
        raise ValueError(f"qjax.einsum needs two operands and an explicit output without '...', e.g. 'btd,fd->btf'; "
                         f"got {subscripts!r}")
    for name, labels, array in (("lhs", lhs_labels, lhs), ("rhs", rhs_labels, rhs), ("output", out, None)):
        if len(set(labels)) != len(labels):
            raise ValueError(f"{name} labels {labels!r} repeat a label; qjax.einsum does not take diagonals")
        if array is not None and len(labels) != array.ndim:
            raise ValueError(f"{name} labels {labels!r} do not match its shape {array.shape}")
    for label in lhs_labels + rhs_labels:
        if label not in out and not (label in lhs_labels and label in rhs_labels):
            raise ValueError(f"label {label!r} is summed within one operand; sum it before qjax.einsum")
    for label in out:
        if label not in lhs_labels + rhs_labels:
            raise ValueError(f"output label {label!r} appears in no operand")
    batch = [c for c in lhs_labels if c in rhs_labels and c in out]
    contract = [c for c in lhs_labels if c in rhs_labels and c not in out]
    dims = ((tuple(lhs_labels.index(c) for c in contract), tuple(rhs_labels.index(c) for c in contract)),
            (tuple(lhs_labels.index(c) for c in batch), tuple(rhs_labels.index(c) for c in batch)))
    y = dot_general(lhs, rhs, dims, precision, preferred_element_type, recipe=recipe, key=key)
    produced = batch + [c for c in lhs_labels if c not in rhs_labels] + [c for c in rhs_labels if c not in lhs_labels]
    return y.transpose([produced.index(c) for c in out])


def recipe_for_layer(recipe, layer_name: str, *, features_in: int, features_out: int,
                     keep_high_precision: tuple[str, ...] = (), min_features: int = 0) -> recipes_lib.Recipe:
    """The recipe a layer should use: `recipe`, or the "bf16" recipe for layers kept in high precision.

    Flax's counterpart of torchao's `module_filter_fn`. A layer stays in high precision when a regex in
    `keep_high_precision` matches `layer_name` (e.g. "lm_head", "patch_embed"), when min(features_in, features_out)
    < `min_features` (tiny GEMMs gain nothing from 8 bits), or when a block-scaled recipe cannot tile its features
    (not multiples of 128; the token count M must also be a multiple of 128 for wgrad, which this cannot see).
    """
    recipe = recipes_lib.recipe(recipe)
    if isinstance(keep_high_precision, str):  # a lone string would be read as one regex per character
        raise TypeError(f"keep_high_precision must be a tuple of regexes, got the string {keep_high_precision!r}: "
                        f"pass ({keep_high_precision!r},)")
    keep = any(re.search(pattern, layer_name) for pattern in keep_high_precision)
    keep |= min(features_in, features_out) < min_features
    keep |= recipe.is_block_scaled and (features_in % 128 != 0 or features_out % 128 != 0)
    return recipes_lib.RECIPES["bf16"] if keep else recipe
