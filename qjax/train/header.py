"""The start-up lines of a run that say what will actually be quantized (not only which recipe was asked for).

  recipe_summary(model_config)   # "qkv/o/gate_up/down: int8_rowwise x 2 layers; lm_head: bf16"
  quantizes_nothing(model_config)  # None, or "warning: ..." when a quantized recipe ends up on no layer

`qjax.recipe_for_layer` keeps some layers in bf16 (the LM head, layers narrower than min_features, features a block
recipe cannot tile); on a small model that can be every layer, and a run would then train in bf16 under a quantized
recipe's name.
"""

import collections
import re

import qjax
from qjax.models import layer_recipes

# "layers_3/attn/qkv_proj" -> "qkv" (a projection of every block); "lm_head" matches nothing (a single layer)
_BLOCK_LAYER = re.compile(r"layers_\d+/(?:\w+/)?(\w+?)(?:_proj)?")


def recipe_summary(model_config) -> str:
    """Which recipe each projection runs, projections with the same split grouped, e.g.
    "qkv/o/gate_up/down: fp8_blockwise x 22 layers; lm_head: bf16"."""
    per_projection: dict[tuple[str, bool], collections.Counter] = {}  # (short name, in every block): recipes
    for name, recipe in layer_recipes(model_config).items():
        match = _BLOCK_LAYER.fullmatch(name)
        key = (match.group(1), True) if match else (name, False)
        per_projection.setdefault(key, collections.Counter())[recipe.name] += 1
    groups: dict[tuple, list[str]] = {}  # projections whose layers split the same way are listed together
    for (short, in_blocks), counts in per_projection.items():
        groups.setdefault((in_blocks, tuple(counts.items())), []).append(short)
    parts = []
    for (in_blocks, counts), names in groups.items():
        if in_blocks:
            recipes = ", ".join(f"{recipe} x {n} layer{'s' * (n != 1)}" for recipe, n in counts)
        else:
            recipes = ", ".join(recipe for recipe, _ in counts)
        parts.append(f"{'/'.join(names)}: {recipes}")
    return "; ".join(parts)


def quantizes_nothing(model_config) -> str | None:
    """A one-line warning when `model_config.recipe` quantizes but every layer was kept in bf16, naming why and
    the fix; None otherwise."""
    recipe = qjax.recipe(model_config.recipe)
    gemms = [g for g in (recipe.fwd, recipe.dgrad, recipe.wgrad) if g is not None]
    if not gemms or any(r.name != "bf16" for r in layer_recipes(model_config).values()):
        return None
    shapes = model_config.projections().values()
    untileable = sorted({f"{fi}->{fo}" for fi, fo in shapes if fi % 128 or fo % 128})
    if untileable and any(g.is_block_scaled for g in gemms):
        why = (f"a block-scaled recipe needs features that are multiples of 128 and the layers are "
               f"{', '.join(untileable)}: use a larger model (--config.model.size=125m) or dims that are multiples "
               "of 128")
    elif model_config.min_features and all(min(s) < model_config.min_features for s in shapes):
        why = f"every layer is narrower than config.min_features={model_config.min_features}: lower it"
    else:
        why = (f"config.keep_high_precision={model_config.keep_high_precision} matches every layer: narrow its "
               "regexes")
    return f"warning: recipe {recipe.name!r} quantizes no layer, the whole model trains in bf16; {why}"
