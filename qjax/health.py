"""Quantization health: how each quantized GEMM operand of a model uses its 8-bit format, measured during training.

Per quantized layer and operand (x: the forward GEMM's lhs, the activation; w: its rhs, the weight; g: the output's
gradient as dgrad quantizes it), three float32 numbers, `STATS`:

  amax        max |operand| (NaN if it holds a NaN: bad values stay visible)
  saturated   fraction of its codes at the format's largest magnitude (int8 127, e4m3 448, e5m2 57344, ternary 1)
  underflow   fraction of its nonzero elements whose code is zero or subnormal (fp8 codes below 2^min_exponent;
              int8 has no subnormals: code 0)

Codes are those of the operand's `QuantSpec` in the layout the GEMM reads it (`qjax.quantize`), rounded to nearest:
a stochastically rounding spec is measured by its nearest codes, the two grid points SR picks between lie on either
side of them, so saturation and flushing are the same facts (SR recipes need nothing extra). Amax scaling puts each
scale block's largest element at or near the format's max, so `saturated` has a floor of about one element per block
(1/K of a row-scaled operand) and rises only where many values tie at their block's max; an outlier channel shows as
amax growth, and pushes the other channels' codes down into `underflow`. Ternary weights (absmean scaling) sit mostly
at +-1 by design.

A model collects them when applied with the "health" collection mutable (`COLLECTION`); otherwise none of this is
traced and the GEMMs are unchanged (zero cost when off):

  out, state = model.apply({"params": params, "perturbations": probes}, tokens, mutable=["health"])
  # state["health"][...layer path...]["x"], ["w"]: float32 (3,) each; the gradient of the loss with respect to
  # probes (same tree) holds the g stats: `observe_gemm` plants a zero probe whose cotangent is g's stats.

`qjax.train` does this every `config.health_every` steps (`HealthMonitor`: amax growth since the first measurement,
the progress line's worst saturation, one warning line when a threshold is crossed).
"""

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from qjax import numerics
from qjax import recipes as recipes_lib
from qjax.linear_core import layout_from
from qjax.qtensor import QuantSpec
from qjax.quantize import quantize_with_seed

COLLECTION = "health"  # the Flax collection x and w stats are sown into
PROBES = "perturbations"  # the Flax collection (`nn.Module.perturb`) whose gradient carries the g stats
STATS = ("amax", "saturated", "underflow")


def operand_stats(x: jax.Array, spec: QuantSpec) -> jax.Array:
    """float32 (3,) `STATS` of x quantized per spec (module docstring).

    x: float (..., R, K), K the contracting dimension last (the layout the GEMM reads; any shape for "tensor").
    """
    spec = dataclasses.replace(spec, stochastic=False)
    x32 = x.astype(jnp.float32)
    codes = jnp.abs(quantize_with_seed(x32, spec, None, operand="health operand").data.astype(jnp.float32))
    fmt = spec.format
    smallest_normal = 1.0 if fmt.is_integer else 2.0 ** fmt.min_exponent
    nonzero = x32 != 0
    flushed = jnp.sum(nonzero & (codes < smallest_normal), dtype=jnp.float32)
    return jnp.stack([numerics.amax(x32), jnp.mean(codes >= fmt.max_value, dtype=jnp.float32),
                      flushed / jnp.maximum(jnp.sum(nonzero, dtype=jnp.float32), 1.0)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def gradient_probe(out: jax.Array, probe: jax.Array, measure) -> jax.Array:
    """out unchanged, forward and backward; the cotangent of `probe` (float32 (3,), zeros) is measure(g), g the
    cotangent of out. `measure`: a hashable function g -> float32 (3,)."""
    del probe, measure
    return out


def _probe_fwd(out, probe, measure):
    del probe, measure
    return out, None


def _probe_bwd(measure, _, g):
    return g, measure(g)


gradient_probe.defvjp(_probe_fwd, _probe_bwd)


def _g_stats(g, layout, spec):
    return operand_stats(layout.out_mn(g), spec)


def is_collecting(module: nn.Module) -> bool:
    """Whether `module` is applied (not initialized: init makes every collection mutable) with the health
    collection mutable (module docstring)."""
    return module.is_mutable_collection(COLLECTION) and not module.is_initializing()


def observe_gemm(module: nn.Module, recipe: recipes_lib.Recipe, lhs, rhs, dimension_numbers, out) -> jax.Array:
    """Sows the x and w stats of a GEMM of `module` (lhs . rhs per dimension_numbers, quantized per recipe) into
    the health collection, and returns out with a g probe (`gradient_probe`, probe variable "g" of `PROBES`).
    Operands a recipe leaves in high precision are not measured. Call only where `is_collecting(module)`."""
    layout = layout_from(lhs.shape, rhs.shape, dimension_numbers)
    keep_last = lambda _, value: value  # noqa: E731 (a layer called again in one apply reports its last call)
    if recipe.fwd is not None:
        module.sow(COLLECTION, "x", operand_stats(layout.lhs_mk(lhs), recipe.fwd.lhs), reduce_fn=keep_last)
        module.sow(COLLECTION, "w", operand_stats(layout.rhs_nk(rhs), recipe.fwd.rhs), reduce_fn=keep_last)
    if recipe.dgrad is None:
        return out
    probe = module.perturb("g", jnp.zeros((len(STATS),), jnp.float32), collection=PROBES)
    return gradient_probe(out, probe, functools.partial(_g_stats, layout=layout, spec=recipe.dgrad.lhs))


def flatten(health_tree, probe_grads=None) -> dict[str, np.ndarray]:
    """{"<layer path>/<operand>": float (3,) stats} from the sown health collection and the probes' gradients.

    The layer path is the module path without the GEMM module itself, e.g. "layers_0/mlp/down_proj"."""
    out = {}
    for tree in (health_tree, probe_grads):
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree or {})[0]:
            keys = [str(getattr(k, "key", k)) for k in path]
            operand = keys[-1]
            layer = [k for k in keys[:-1] if not k.startswith("DotGeneral_")]
            out["/".join(layer + [operand])] = np.asarray(leaf, np.float64).reshape(-1)
    return dict(sorted(out.items()))


def record(stats: dict[str, np.ndarray]) -> dict[str, float]:
    """The metrics.jsonl / TensorBoard row of flattened stats: "health/<layer>/<operand>/<stat>" -> float."""
    return {f"health/{name}/{stat}": float(value[i]) for name, value in stats.items()
            for i, stat in enumerate(STATS)}


class HealthMonitor:
    """Host-side bookkeeping of the stats over a run: amax growth since each operand's first measurement, the
    worst saturation, and one warning line when an operand crosses a threshold.

    Args:
      saturation_warn: warn when an operand's saturated fraction exceeds this (0 < . <= 1).
      amax_growth_warn: warn when a forward operand's (x or w) amax exceeds this many times its first measured amax
        (> 1). Gradient operands (g) are recorded but not warned on: their amax swings widely in healthy runs (x84
        from the first measurement in a 125M fp8_rowwise run that matched bf16) and, under amax scaling, growth alone
        cannot saturate them.
      initial: {"<layer>/<operand>": first amax} of a resumed run (`initial_amax` reads it from metrics rows).
      ternary: the "<layer>/<operand>" names quantized to ternary (bitnet_b158's weights). Absmean scaling puts
        most of their codes at +-1 by design (about 70% of a Gaussian weight's), so their saturation is recorded
        but neither warned on nor counted in "health_saturation_max".
    """

    def __init__(self, saturation_warn: float, amax_growth_warn: float, initial: dict[str, float] | None = None,
                 ternary: frozenset[str] = frozenset()):
        if not 0 < saturation_warn <= 1:
            raise ValueError(f"saturation_warn must be a fraction in (0, 1], got {saturation_warn!r}")
        if not amax_growth_warn > 1:
            raise ValueError(f"amax_growth_warn must be a ratio > 1, got {amax_growth_warn!r}")
        self.saturation_warn = saturation_warn
        self.amax_growth_warn = amax_growth_warn
        self.initial = dict(initial or {})
        self.ternary = frozenset(ternary)
        self._warned: set[tuple[str, str]] = set()  # (operand, kind) over its threshold at the last update

    def update(self, step: int, stats: dict[str, np.ndarray]) -> tuple[dict[str, float], str | None]:
        """(the metrics row of `step`'s stats with each operand's amax growth, a warning line or None).

        The row holds record(stats), "health/<layer>/<operand>/amax_growth" per operand, and "health_saturation_max"
        (the worst operand's saturated fraction, for the progress line). An operand warns once when it crosses a
        threshold, again only after it has fallen back below it."""
        row = record(stats)
        crossed, over = [], set()
        for name, (amax, saturated, _) in stats.items():
            first = self.initial.setdefault(name, float(amax))
            growth = float(amax) / first if first > 0 else (math.inf if amax > 0 else 1.0)
            if math.isnan(amax):
                growth = math.nan
            row[f"health/{name}/amax_growth"] = growth
            checks = [] if name in self.ternary else [
                ("saturated", saturated, self.saturation_warn,
                 f"saturation {100 * saturated:.2f}% > {100 * self.saturation_warn:.2f}%")]
            if not name.endswith("/g"):
                text = f"amax x{growth:.3g} since its first measurement > x{self.amax_growth_warn:g}"
                checks.append(("amax_growth", growth, self.amax_growth_warn, text))
            for kind, value, limit, text in checks:
                if not value <= limit:  # NaN counts as crossed
                    over.add((name, kind))
                    if (name, kind) not in self._warned:
                        crossed.append(f"{name} {text}")
        self._warned = over
        row["health_saturation_max"] = max((float(s[1]) for n, s in stats.items() if n not in self.ternary),
                                           default=0.0)
        warning = None
        if crossed:
            warning = (f"quantization health warning @ step {step}: " + "; ".join(crossed)
                       + " (config.health_saturation_warn / health_amax_growth_warn set the thresholds)")
        return row, warning


def ternary_operands(layer_recipes: dict) -> frozenset[str]:
    """The "<layer>/w" operand names whose recipe quantizes the weight to ternary, from {layer name: qjax.Recipe}
    (`qjax.models.layer_recipes`): the names `HealthMonitor` does not warn on for saturation."""
    return frozenset(f"{name}/w" for name, recipe in layer_recipes.items()
                     if recipe.fwd is not None and recipe.fwd.rhs.dtype == "ternary")


def initial_amax(rows) -> dict[str, float]:
    """{"<layer>/<operand>": amax} of the first metrics row holding each operand's health stats (a resumed run's
    growth stays relative to the run's start)."""
    initial = {}
    for row in rows:
        for key, value in row.items():
            if key.startswith("health/") and key.endswith("/amax"):
                initial.setdefault(key[len("health/"):-len("/amax")], value)
    return initial


def worst(rows, ternary: frozenset[str] = frozenset()) -> dict[str, tuple[float, str, int]]:
    """Where a run's quantization was least healthy, from its metrics rows (`record` + `HealthMonitor.update`):
    {"saturated" / "underflow" / "amax_growth": (the largest value, "<layer>/<operand>", its step)}, amax growth
    over the forward operands (x, w) only and saturation over the operands not in `ternary` (`ternary_operands`),
    as the warnings read them; {} for rows without health stats. NaN counts as the largest."""
    out = {}
    for row in rows:
        for key, value in row.items():
            if not key.startswith("health/"):
                continue
            name, _, stat = key[len("health/"):].rpartition("/")
            if (stat not in ("saturated", "underflow", "amax_growth") or (stat == "amax_growth" and name.endswith("/g"))
                    or (stat == "saturated" and name in ternary)):
                continue
            best = out.get(stat)
            if best is None or not value <= best[0] and not math.isnan(best[0]):
                out[stat] = (float(value), name, int(row.get("step", -1)))
    return out

