"""How `qjax.quantize_model` quantizes one intercepted GEMM: its rules (`Rules`), the decision for one call
(`decide`: skip, rules, min_features, dtype, tiling), and the call itself (`run_dot_general`, `run_einsum`: the
explicit `qjax.dot_general` / `qjax.einsum`, or the original jax function). Shared by the linen and NNX conversions
(`qjax.convert`); `qjax.report` reads the `CallRecord`s they leave while it traces.
"""

import contextlib
import contextvars
import dataclasses
import math
import re
import warnings

import jax
import jax.numpy as jnp

from qjax import flax as qflax
from qjax import recipes as recipes_lib
from qjax.dot_general import dot_general as quantized_dot_general
from qjax.qtensor import BLOCK_SHAPES

LAX_DOT_GENERAL = jax.lax.dot_general  # the originals, whatever is patched later
JNP_EINSUM = jax.numpy.einsum


@dataclasses.dataclass(frozen=True)
class Rules:
    """What `quantize_model` was asked (module docstring). `settled` (not compared): the rule / skip patterns
    already warned about or seen matching a module path, so that each unmatched pattern warns once, and a pattern
    that matched a module in one call (init's) does not warn in a call that skips that module (an LM's hidden
    states without its head)."""

    rules: tuple[tuple[str, recipes_lib.Recipe | None], ...]
    skip: tuple[str, ...] = ()
    min_features: int = 0
    rng_stream: str = "quant"
    settled: set = dataclasses.field(default_factory=set, compare=False, hash=False, repr=False)

    @property
    def needs_key(self) -> bool:
        return any(r is not None and r.needs_key for _, r in self.rules)

    def warn_unmatched(self, paths, model_name: str) -> None:
        """One warning line per rule / skip pattern found in none of `paths` (once per pattern)."""
        for kind, pattern in [("rule", p) for p, _ in self.rules] + [("skip", p) for p in self.skip]:
            if (kind, pattern) in self.settled:
                continue
            self.settled.add((kind, pattern))
            if not any(re.search(pattern, p) for p in paths):
                warnings.warn(f"qjax.quantize_model: {kind} {pattern!r} matches no module of {model_name}",
                              stacklevel=3)


@dataclasses.dataclass(frozen=True)
class Decision:
    """One GEMM call's outcome: `recipe` None runs it in high precision for `reason`. `assigned`: the quantized
    recipe a rule gave it (None where a rule, skip or min_features chose high precision)."""

    recipe: recipes_lib.Recipe | None
    reason: str = ""
    assigned: recipes_lib.Recipe | None = None
    fix: str = ""  # where `assigned` is set but `recipe` is not: what would let it run quantized


def make_rules(recipe_or_rules, skip=(), min_features=0, rng_stream="quant") -> Rules:
    """Validated `Rules`: ValueError for an unknown recipe name (listing the valid ones), a bad regex or a bad
    min_features; TypeError for rules of the wrong shape."""
    if isinstance(recipe_or_rules, (str, recipes_lib.Recipe)):
        rules = (("", recipes_lib.recipe(recipe_or_rules)),)
    elif not isinstance(recipe_or_rules, (tuple, list)):
        raise TypeError(f"pass a recipe name, a qjax.Recipe or a list of (module-path regex, recipe) rules, got "
                        f"{recipe_or_rules!r}")
    else:
        rules = []
        for rule in recipe_or_rules:
            if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
                raise TypeError(f"each rule is (module-path regex, recipe name / qjax.Recipe / None), got {rule!r}")
            rules.append((rule[0], None if rule[1] is None else recipes_lib.recipe(rule[1])))
        rules = tuple(rules)
    if not isinstance(skip, (str, tuple, list)):
        raise TypeError(f"skip must be a regex or a tuple of regexes (() for none), got {skip!r}")
    if not isinstance(rng_stream, str) or not rng_stream:
        raise TypeError(f"rng_stream must be the name of an rng stream, e.g. 'quant', got {rng_stream!r}")
    skip = (skip,) if isinstance(skip, str) else tuple(skip)
    for pattern in [p for p, _ in rules] + list(skip):
        try:
            re.compile(pattern)
        except (re.error, TypeError) as e:
            raise ValueError(f"{pattern!r} is not a valid module-path regex ({e})") from None
    if isinstance(min_features, bool) or not isinstance(min_features, int) or min_features < 0:
        raise ValueError(f"min_features must be an int >= 0, got {min_features!r}")
    return Rules(rules, skip, min_features, rng_stream)


def gemm_sizes(lhs_shape, rhs_shape, dimension_numbers) -> tuple[int, int, int]:
    """(M, K, N) of a dot_general viewed as a GEMM: lhs free, contracted, rhs free sizes."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    k = math.prod(lhs_shape[d] for d in lhs_contract)
    m = math.prod(s for d, s in enumerate(lhs_shape) if d not in tuple(lhs_contract) + tuple(lhs_batch))
    n = math.prod(s for d, s in enumerate(rhs_shape) if d not in tuple(rhs_contract) + tuple(rhs_batch))
    return m, k, n


def untileable(recipe: recipes_lib.Recipe, m: int, k: int, n: int) -> str:
    """Why a block-scaled `recipe` cannot tile a (M, K) x (K, N) GEMM and its gradients, or "" if it can. Each
    operand is blocked in the (rows, contracting) layout its GEMM reads (`qjax.recipes`' table)."""
    layouts = {"fwd": ((m, k), (n, k)), "dgrad": ((m, n), (k, n)), "wgrad": ((n, m), (k, m))}
    for name, (lhs, rhs) in layouts.items():
        gemm = getattr(recipe, name)
        for side, (rows, contracting) in (("lhs", lhs), ("rhs", rhs)):
            spec = None if gemm is None else getattr(gemm, side)
            if spec is not None and spec.granularity in BLOCK_SHAPES:
                block_rows, block_k = BLOCK_SHAPES[spec.granularity]
                if rows % block_rows or contracting % block_k:
                    return (f"not tileable: {recipe.name}'s {name} {side} needs ({block_rows}, {block_k})-blocks "
                            f"of (rows, contracting) = ({rows}, {contracting}) (M={m} tokens, K={k} in, N={n} out)")
    return ""


def decide(rules: Rules, path: str, lhs, rhs, dimension_numbers) -> Decision:
    """The recipe one weight GEMM runs (module docstring's order: skip, rules, min_features, dtype, tiling)."""
    for pattern in rules.skip:
        if re.search(pattern, path):
            return Decision(None, f"skip {pattern!r}")
    for pattern, recipe in rules.rules:
        if re.search(pattern, path):
            if recipe is None or recipe.is_high_precision:
                return Decision(None, f"rule {pattern!r} -> {recipe.name if recipe else None}")
            break
    else:
        return Decision(None, "no rule matches")
    m, k, n = gemm_sizes(lhs.shape, rhs.shape, dimension_numbers)
    if min(k, n) < rules.min_features:
        return Decision(None, f"min_features: in {k} or out {n} < {rules.min_features}")
    for name, array in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(array.dtype, jnp.floating):
            return Decision(None, f"dtype: {name} is {array.dtype}, only float operands quantize", recipe,
                            f"cast it to a float dtype, or skip it (skip=({path!r},))")
    reason = untileable(recipe, m, k, n)
    if reason:
        return Decision(None, reason, recipe, f"skip it (skip=({path!r},)), or pad its tokens and features to "
                                              "multiples of 128")
    return Decision(recipe, "", recipe)


# --- one intercepted GEMM, shared by linen and NNX ---------------------------------------------------------------

# While `qjax.report` traces: a list that each intercepted GEMM appends its record to (`report.py` reads them).
RECORDS: contextvars.ContextVar = contextvars.ContextVar("qjax_convert_records", default=None)


@dataclasses.dataclass(frozen=True)
class CallRecord:
    """One intercepted call, as traced: its GEMMs run inside jax.named_scope(`scope`)."""

    scope: str
    path: str
    op: str
    lhs_shape: tuple
    rhs_shape: tuple
    decision: Decision


@contextlib.contextmanager
def recorded(path, op, lhs, rhs, decision):
    records = RECORDS.get()
    if records is None:
        yield
        return
    scope = f"qjax_gemm:{len(records)}"
    records.append(CallRecord(scope, path, op, tuple(lhs.shape), tuple(rhs.shape), decision))
    with jax.named_scope(scope):
        yield


def run_dot_general(rules, path, sharding_name, make_key, lhs, rhs, dimension_numbers, precision=None,
                    preferred_element_type=None, **kwargs):
    """lax.dot_general(lhs, rhs, ...) for the layer at `path`, quantized per `decide` (module docstring)."""
    if any(v is not None for v in kwargs.values()):
        decision = Decision(None, f"called with {', '.join(k for k, v in kwargs.items() if v is not None)}")
    else:
        decision = decide(rules, path, lhs, rhs, dimension_numbers)
    with recorded(path, "dot_general", lhs, rhs, decision):
        if decision.recipe is None:
            return LAX_DOT_GENERAL(lhs, rhs, dimension_numbers, precision, preferred_element_type, **kwargs)
        recipe = decision.recipe
        if recipe.recompute_weight_codes and preferred_element_type is None:
            preferred_element_type = lhs.dtype  # as qjax.DotGeneral: the GEMM computes in the inputs' dtype
        return quantized_dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type, recipe=recipe,
                                     key=make_key() if recipe.needs_key else None,
                                     sharding=qflax.layer_weight_sharding(sharding_name))


def einsum_dimension_numbers(subscripts, lhs, rhs):
    """dot_general dimension numbers of a two-operand einsum that `qjax.einsum` runs, or None for other forms."""
    if not isinstance(subscripts, str):
        return None
    inputs, arrow, out = subscripts.replace(" ", "").partition("->")
    lhs_labels, comma, rhs_labels = inputs.partition(",")
    if (not arrow or not comma or "," in rhs_labels or "." in subscripts or len(lhs_labels) != lhs.ndim
            or len(rhs_labels) != rhs.ndim or any(len(set(s)) != len(s) for s in (lhs_labels, rhs_labels, out))
            or set(out) - set(lhs_labels + rhs_labels)
            or any(c not in out and not (c in lhs_labels and c in rhs_labels) for c in lhs_labels + rhs_labels)):
        return None
    contract = [c for c in lhs_labels if c in rhs_labels and c not in out]
    batch = [c for c in lhs_labels if c in rhs_labels and c in out]
    return ((tuple(map(lhs_labels.index, contract)), tuple(map(rhs_labels.index, contract))),
            (tuple(map(lhs_labels.index, batch)), tuple(map(rhs_labels.index, batch))))


def run_einsum(rules, path, sharding_name, make_key, subscripts, lhs, rhs, *, precision=None,
               preferred_element_type=None, **kwargs):
    """jnp.einsum(subscripts, lhs, rhs) for the layer at `path`: `qjax.einsum` per `decide`, or jnp.einsum."""
    dims = einsum_dimension_numbers(subscripts, lhs, rhs)
    extra = [k for k, v in kwargs.items() if v is not None and k != "optimize"]
    if dims is None:
        decision = Decision(None, f"einsum {subscripts!r}: qjax.einsum takes two operands, an explicit output, "
                                  "no '...' and no label summed within one operand")
    elif extra:
        decision = Decision(None, f"called with {', '.join(extra)}")
    else:
        decision = decide(rules, path, lhs, rhs, dims)
    with recorded(path, f"einsum {subscripts}", lhs, rhs, decision):
        if decision.recipe is None:
            return JNP_EINSUM(subscripts, lhs, rhs, precision=precision,
                               preferred_element_type=preferred_element_type, **kwargs)
        recipe = decision.recipe
        return qflax.einsum(subscripts, lhs, rhs, recipe=recipe, key=make_key() if recipe.needs_key else None,
                            precision=precision, preferred_element_type=preferred_element_type)
