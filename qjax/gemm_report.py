"""`qjax.report`: which GEMMs of a training step actually run in 8 bits, and why the others do not.

  rows = qjax.report(qmodel, variables, x)            # linen: variables as for apply; NNX: qjax.report(qmodel, None, x)
  print(rows)                                         # a table: module path, shapes, recipe, 8-bit GEMMs, why not
  qjax.report(qmodel, variables, x, strict=True)      # ValueError where a layer given a quantized recipe would not be

It traces (never runs) jax.value_and_grad of the sum of the model's outputs with respect to its params, so the
forward, dgrad and wgrad GEMMs of every layer are in the traced program, and reads that program: a GEMM counts as
8-bit only where its dot_general (or Pallas GEMM kernel) takes int8 / float8 operands. What the rules asked for is
not taken on trust: a recipe the backend emulates in high precision (block-scaled recipes and MXFP8 on the XLA
backend dequantize before a float GEMM) shows up as such. Shapes may be jax.ShapeDtypeStruct (nothing is
computed), e.g. report(qmodel, jax.eval_shape(qmodel.init, key, x), x).
"""

import dataclasses
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp

from qjax import gemm_rules

_ROLES = ("fwd", "dgrad", "wgrad")
_EIGHT_BIT = ("int8", "uint8", "float8_e4m3fn", "float8_e5m2", "float8_e4m3", "float8_e4m3b11fnuz",
              "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")


@dataclasses.dataclass(frozen=True)
class GemmRow:
    """One layer's GEMM call (or a group of dot_generals no layer claimed) in the traced step.

    path: module path relative to the model ("" the model itself; "?" where unknown). op: "dot_general",
    "einsum <subscripts>", or "not intercepted". lhs_shape, rhs_shape: the forward operands. recipe: the recipe
    name it ran, None for high precision. eight_bit / high_precision: which of fwd, dgrad, wgrad lowered to 8-bit
    dots, and which did not (for "not intercepted" rows: how many dot_generals). reason: why any ran in high
    precision. calls: how many times it was traced (layers called again, traced twice by a transform).
    assigned: the quantized recipe a rule gave it, None where a rule, skip or min_features chose high precision.
    fix: for a layer given a quantized recipe that runs in high precision, what would make it run in 8 bits.

    The traced step is the program before XLA's dead-code elimination: the dgrad of a layer whose input needs no
    gradient (the first layer's, of the model's inputs) is listed though the compiled step drops it.
    """

    path: str
    op: str
    lhs_shape: tuple
    rhs_shape: tuple
    recipe: str | None
    eight_bit: tuple[str, ...]
    high_precision: tuple[str, ...]
    reason: str
    calls: int = 1
    assigned: str | None = None
    fix: str = ""

    @property
    def quantized(self) -> bool:
        """Whether every GEMM its recipe quantizes lowered to an 8-bit dot."""
        return self.recipe is not None and not self.reason


class Report(list):
    """The rows of `report`, printed as a table."""

    def __str__(self):
        header = ("module", "op", "lhs", "rhs", "recipe", "8-bit", "high precision", "why")
        lines = [header] + [(r.path or "(model)", r.op, "x".join(map(str, r.lhs_shape)),
                             "x".join(map(str, r.rhs_shape)), r.recipe or "-", " ".join(r.eight_bit) or "-",
                             " ".join(r.high_precision) or "-", r.reason + (f" ({r.calls} calls)" if r.calls > 1
                                                                             else "")) for r in self]
        widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
        text = [("  ".join(c.ljust(w) for c, w in zip(line, widths)) + "  " + line[-1]).rstrip() for line in lines]
        quantized = sum(r.quantized for r in self)
        return "\n".join(text + [f"{quantized} of {len(self)} GEMM calls run every GEMM their recipe quantizes "
                                 "in 8 bits"])


def _jaxprs_in(params):
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jax.extend.core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jax.extend.core.Jaxpr):
                yield item


class _Gemm(NamedTuple):
    stack: str            # the eqn's name stack, holding convert's scopes
    eight_bit: bool
    dtypes: tuple         # the two operands' dtypes
    shapes: tuple         # and shapes


def _gemms(jaxpr, found):
    """Every GEMM in `jaxpr` and the jaxprs inside it, in program order: dot_general, and Pallas calls reading two
    8-bit operands into a float output (the GEMM kernels; the quantize kernels read floats)."""
    for eqn in jaxpr.eqns:
        avals = [v.aval for v in eqn.invars if hasattr(v.aval, "dtype")]
        stack = str(eqn.source_info.name_stack)
        if eqn.primitive.name == "dot_general":
            operands = avals[:2]
        elif eqn.primitive.name == "pallas_call" and all(jnp.issubdtype(v.aval.dtype, jnp.floating)
                                                         for v in eqn.outvars):
            operands = [a for a in avals if str(a.dtype) in _EIGHT_BIT][:2]
            operands = operands if len(operands) == 2 else []
        else:
            operands = []
        if operands:
            dtypes = tuple(str(a.dtype) for a in operands)
            found.append(_Gemm(stack, all(d in _EIGHT_BIT for d in dtypes), dtypes,
                               tuple(tuple(a.shape) for a in operands)))
        for inner in _jaxprs_in(eqn.params):
            _gemms(inner, found)
    return found


def _roles(n: int) -> list[str]:
    """Roles of a quantized call's n GEMMs in program order: the forward (again where remat recomputes it), then
    the backward's dgrad and wgrad (`qjax.dot_general`'s order)."""
    return (["fwd"] * max(n - 2, 1) + ["dgrad", "wgrad"])[:n]


def _row(record: gemm_rules.CallRecord, gemms: list[_Gemm]) -> GemmRow:
    decision, recipe = record.decision, record.decision.recipe
    assigned = decision.assigned.name if decision.assigned is not None else None
    if recipe is None:
        return GemmRow(record.path, record.op, record.lhs_shape, record.rhs_shape, None, (), ("all",),
                       decision.reason, assigned=assigned, fix=decision.fix)
    ran = {}  # role -> dtypes of a dot of that role that did not run in 8 bits, or None
    for role, gemm in zip(_roles(len(gemms)), gemms):
        ran[role] = ran.get(role) or (None if gemm.eight_bit else gemm.dtypes)
    eight = tuple(r for r in _ROLES if r in ran and ran[r] is None)
    high = tuple(r for r in _ROLES if ran.get(r) is not None)
    fallen = [r for r in high if getattr(recipe, r) is not None]
    reason, fix = "", decision.fix
    if fallen and any(getattr(recipe, r).lhs.granularity == "1x32" for r in fallen):
        reason = (f"{' '.join(fallen)} lowered to {ran[fallen[0]][0]} dots: MX (1x32) blocks have no Hopper "
                  f"GEMM, so {recipe.name} runs an exact float GEMM on its 8-bit codes")
        fix = f"use an fp8 recipe with row or 128-block scales for 8-bit GEMMs, or skip it (skip=({record.path!r},))"
    elif fallen:
        reason = (f"{' '.join(fallen)} lowered to {ran[fallen[0]][0]} dots: the {recipe.backend} backend on "
                  f"{jax.default_backend()} emulates {recipe.name} (dequantize, then a float GEMM)")
        fix = (f"run it where the Pallas kernels run {recipe.name} (backend 'auto' or 'pallas' on a Hopper GPU), "
               f"or skip it (skip=({record.path!r},))")
    return GemmRow(record.path, record.op, record.lhs_shape, record.rhs_shape, recipe.name, eight, high, reason,
                   assigned=assigned, fix=fix)


def _unclaimed_row(path: str, gemms: list[_Gemm]) -> GemmRow:
    eight = sum(g.eight_bit for g in gemms)
    counts = lambda n: (f"{n} dots",) if n else ()  # noqa: E731
    first = gemms[0].shapes
    return GemmRow(path, "not intercepted", first[0], first[1], None, counts(eight), counts(len(gemms) - eight),
                   "not intercepted: `@`, jnp.dot / jnp.matmul, a jax-internal op, or a layer quantize_model does "
                   "not convert")


def _merge(rows: list[GemmRow]) -> list[GemmRow]:
    """Rows of the same call traced more than once, as one row with its count."""
    merged = {}
    for row in rows:
        key = dataclasses.replace(row, calls=1)
        merged[key] = dataclasses.replace(row, calls=merged[key].calls + 1) if key in merged else row
    return list(merged.values())


def _loss(qmodel, params, args, kwargs):
    """(scalar loss of params, params to differentiate): the sum of the model's float outputs."""

    def total(out):
        return sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in jax.tree.leaves(out)
                   if jnp.issubdtype(leaf.dtype, jnp.inexact))

    if hasattr(type(qmodel), "_qjax_rules"):  # linen
        if not isinstance(params, dict) or "params" not in params:
            raise ValueError("qjax.report takes the linen model's variables as apply does: {'params': ...}")
        return (lambda p: total(qmodel.apply({**params, "params": p}, *args, **kwargs))), params["params"]
    from flax import nnx

    if not isinstance(qmodel, nnx.Module):
        raise TypeError(f"qjax.report takes a model from qjax.quantize_model, got {type(qmodel).__name__}")
    graphdef, own_params, rest = nnx.split(qmodel, nnx.Param, ...)
    return (lambda p: total(nnx.merge(graphdef, p, rest)(*args, **kwargs))), (own_params if params is None
                                                                             else params)


def report(qmodel, params, *args, strict: bool = False, **kwargs) -> Report:
    """Every GEMM of one traced training step of `qmodel` (from `qjax.quantize_model`) and whether it ran in 8 bits.

    Args:
      qmodel: a linen or NNX model returned by `qjax.quantize_model`.
      params: linen: the variables dict apply takes; NNX: None (the model's own nnx.Param state) or such a state.
      *args, **kwargs: the model's inputs, as for apply / a call (linen kwargs may hold rngs=...).
      strict: raise ValueError where a layer a rule gives a quantized recipe would run a GEMM of it in high
        precision (an untileable shape, a dtype, a backend that emulates the recipe).

    Returns a `Report`: a list of `GemmRow`s (one per layer GEMM call, plus one per module whose dot_generals
    quantize_model did not intercept), printed as a table.
    """
    loss, differentiated = _loss(qmodel, params, args, kwargs)
    records = []
    token = gemm_rules.RECORDS.set(records)
    try:
        jaxpr = jax.make_jaxpr(jax.value_and_grad(loss))(differentiated)
    finally:
        gemm_rules.RECORDS.reset(token)
    gemms = _gemms(jaxpr.jaxpr, [])
    if not gemms:
        raise ValueError(f"qjax.report: the traced step of {type(qmodel).__name__} has no dot_general at all")
    by_call, unclaimed = {}, {}
    for gemm in gemms:
        calls = re.findall(r"qjax_gemm:(\d+)", gemm.stack)
        if calls:
            by_call.setdefault(int(calls[-1]), []).append(gemm)
        else:
            modules = re.findall(r"qjax_module:([^/()]*)", gemm.stack)
            unclaimed.setdefault(modules[-1].replace(".", "/") if modules else "?", []).append(gemm)
    rows = [_row(record, by_call[i]) for i, record in enumerate(records) if i in by_call]
    rows += [_unclaimed_row(path, found) for path, found in unclaimed.items()]
    rows = Report(_merge(rows))
    if strict:
        failing = [r for r in rows if r.assigned is not None and not r.quantized]
        if failing:
            raise ValueError("\n".join(
                f"qjax.report(strict=True): {r.path or '(the model itself)'} (lhs {r.lhs_shape}, rhs "
                f"{r.rhs_shape}) would run in high precision: {r.reason}. Fix: {r.fix}" for r in failing))
    return rows
