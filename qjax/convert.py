"""`quantize_model`: one call that quantizes the weight GEMMs of an unmodified Flax model (linen or NNX).

  qmodel = qjax.quantize_model(model, "int8_rowwise", skip=("lm_head",), min_features=128)
  params = qmodel.init(key, x)                                  # linen: the same params tree as model.init's
  y = qmodel.apply(params, x, rngs={"quant": key})              # the stream: only for stochastic-rounding recipes
  qmodel = qjax.quantize_model(nnx_model, rules, rngs=nnx.Rngs(quant=key))   # NNX: a converted copy

Rules: a recipe (name or `qjax.Recipe`) for every layer, or an ordered list of (module-path regex, recipe or None);
the first regex found (`re.search`) in a layer's module path relative to the model, e.g. "layers_0/attn/q_proj",
gives its recipe, None keeping it in high precision; a layer no rule matches stays in high precision. Before the
rules: `skip` (regexes, plain names work) keeps matching layers in high precision, and so does `min_features` for
layers with input or output features below it. A layer a recipe cannot run also stays in high precision: non-float
operands, or a block-scaled recipe whose shape (tokens, in and out features) does not tile into 128-blocks.
`qjax.report` lists each layer's outcome and why.

What is quantized: the GEMMs of weights, a `lax.dot_general` or two-operand `jnp.einsum` whose second operand has
the shape of a parameter of the module calling it, or of one slice of it along its leading dims (nn.Dense,
nn.DenseGeneral, nn.Einsum, a hand-written `jnp.einsum("btd,df->btf", x, self.param(...))`, a layer of stacked
weights under jax.lax.scan). Products of two activations (attention scores) stay as they are.

Mechanism, linen: while a method of the returned module runs, `nn.intercept_methods` (Flax's documented hook
around every module method) tracks which module is running, and `jax.lax.dot_general` / `jax.numpy.einsum` are
rerouted to `qjax.dot_general` / `qjax.einsum` with that module's recipe. Cloning layers with
`dot_general=` cannot reach layers built inside compact methods (they exist only while the model runs), and
nn.Einsum has no such field; the module-method hook sees every layer, however it was built. The reroute is
scoped: it is installed only while a quantized model's method runs, acts only in the thread and context that runs
it (a context variable), and leaves calls from jax and qjax internals alone. The returned module is an instance
of a subclass of the model's class with the same fields, so params, `clone`, nesting inside another module,
`nn.scan` / `nn.remat` and qjax.train's sharding rules (by param path) see the model they saw before.
Mechanism, NNX: each nnx.Linear / nnx.LinearGeneral / nnx.Einsum of a copy of the model gets a `dot_general` /
`einsum_op` (arguments these layers take) that runs `qjax.dot_general` / `qjax.einsum`; no interception.

Stochastic rounding draws one key per GEMM call from the rng stream `rng_stream` ("quant", as for
`qjax.DotGeneral` and qjax's models): linen `apply(..., rngs={"quant": key})` (a fresh key per step; `init`
without it uses a fixed key); NNX `quantize_model(..., rngs=nnx.Rngs(quant=key))`, whose stream the converted
layers share. Under nn.scan, split the stream like "params" (split_rngs={"params": True, "quant": True}).

Not intercepted: `x @ w`, jnp.dot, jnp.matmul, `from jax.lax import dot_general` bound before the call, NNX layers
outside the three above, and a dot_general called with out_sharding. `qjax.report` lists them as high precision.
"""

import contextlib
import contextvars
import dataclasses
import functools
import sys
import threading
import types
from collections.abc import Mapping
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from qjax.gemm_rules import (JNP_EINSUM, LAX_DOT_GENERAL, RECORDS, Decision, Rules, make_rules, recorded,
                             run_dot_general, run_einsum)


# --- linen ---------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _LinenCall:
    """The quantized linen model whose method is running: its rules, its module path, what it has seen."""

    rules: Rules
    root: tuple
    model_name: str
    paths: set = dataclasses.field(default_factory=set)
    calls: int = 0


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("qjax_convert_active", default=None)
_MODULE: contextvars.ContextVar = contextvars.ContextVar("qjax_convert_module", default=None)
_PATCH_LOCK = threading.Lock()
_PATCH_DEPTH = 0


def _weight_shapes(module: nn.Module) -> set:
    """Shapes of the params `module` itself holds (not its children's), and of their slices along leading dims
    (one layer of stacked weights that the module scans over)."""
    params = module.variables.get("params", {}) if module.scope is not None else {}
    shapes = [tuple(jnp.shape(nn.meta.unbox(v))) for v in params.values() if not isinstance(v, Mapping)]
    return {shape[i:] for shape in shapes for i in range(max(len(shape) - 1, 1))}


# Callers whose GEMMs are never rerouted: jax itself, and qjax (its own dot_general calls lax inside)
_PASS_THROUGH = frozenset({"jax", __name__.split(".")[0]})


def _intercepted(run, original):
    """A stand-in for jax.lax.dot_general / jnp.einsum: `run` for a weight GEMM of the running quantized linen
    model's modules, `original` for anything else (module docstring)."""

    @functools.wraps(original)
    def hook(*args, **kwargs):
        state, module = _ACTIVE.get(), _MODULE.get()
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if state is None or module is None or caller.split(".")[0] in _PASS_THROUGH:
            return original(*args, **kwargs)
        path = tuple(module.path) if module.scope is not None else ()
        if path[:len(state.root)] != state.root:
            return original(*args, **kwargs)  # a module of another model, passed in
        state.calls += 1
        operands = args[1:] if run is run_einsum else args[:2]
        if len(operands) != 2:  # an einsum of one or three operands, dot_general's operands as keywords
            return original(*args, **kwargs)
        lhs, rhs = operands
        relative = "/".join(path[len(state.root):])
        if tuple(jnp.shape(rhs)) not in _weight_shapes(module):  # no weight: e.g. attention scores
            op = "dot_general" if run is run_dot_general else f"einsum {args[0]}"
            with recorded(relative, op, lhs, rhs, Decision(None, f"not a weight GEMM: the rhs is not a param of "
                                                                  f"{relative or 'the model'}")):
                return original(*args, **kwargs)
        stream = state.rules.rng_stream

        def make_key():
            if module.has_rng(stream):
                return module.make_rng(stream)
            if module.is_initializing():
                return jax.random.key(0)  # init's output under a fixed key (module docstring)
            raise ValueError(f"layer {relative!r} rounds stochastically: pass rngs={{{stream!r}: key}} to apply "
                             "(a fresh key per step)")

        token = _ACTIVE.set(None)  # what qjax runs inside is not intercepted again
        try:
            return run(state.rules, relative, "/".join(path), make_key, *args, **kwargs)
        finally:
            _ACTIVE.reset(token)

    return hook


_DOT_GENERAL_HOOK = _intercepted(run_dot_general, LAX_DOT_GENERAL)
_EINSUM_HOOK = _intercepted(run_einsum, JNP_EINSUM)


def _track_module(next_fun, args, kwargs, context):
    """nn.intercept_methods interceptor: which module is running, and its path for the rule warnings."""
    state = _ACTIVE.get()
    module = context.module
    if state is not None and module.scope is not None:
        path = tuple(module.path)
        if path[:len(state.root)] == state.root:
            state.paths.add("/".join(path[len(state.root):]))
    token = _MODULE.set(module)
    try:
        if RECORDS.get() is None or state is None or module.scope is None:
            return next_fun(*args, **kwargs)
        with jax.named_scope(f"qjax_module:{'.'.join(module.path[len(state.root):])}"):  # report's paths
            return next_fun(*args, **kwargs)
    finally:
        _MODULE.reset(token)


@contextlib.contextmanager
def _patched():
    """jax.lax.dot_general and jax.numpy.einsum rerouted through the hooks while any quantized model runs."""
    global _PATCH_DEPTH
    with _PATCH_LOCK:
        if _PATCH_DEPTH == 0:
            jax.lax.dot_general, jax.numpy.einsum = _DOT_GENERAL_HOOK, _EINSUM_HOOK
        _PATCH_DEPTH += 1
    try:
        yield
    finally:
        with _PATCH_LOCK:
            _PATCH_DEPTH -= 1
            if _PATCH_DEPTH == 0:
                jax.lax.dot_general, jax.numpy.einsum = LAX_DOT_GENERAL, JNP_EINSUM


@contextlib.contextmanager
def _running(module: nn.Module, method_name: str):
    """The context a quantized linen model's method runs in; on leaving its outermost call, warns about rules
    that matched no module and raises if its forward called no dot_general at all."""
    rules = type(module)._qjax_rules
    root = tuple(module.path) if module.scope is not None else ()
    outer = _ACTIVE.get()
    if outer is not None and outer.rules is rules and outer.root == root:
        yield  # a method called from another of the same model's methods
        return
    model_name = type(module).__mro__[1].__name__
    state = _LinenCall(rules, root, model_name)
    token = _ACTIVE.set(state)
    try:
        with _patched(), nn.intercept_methods(_track_module):
            yield
    finally:
        _ACTIVE.reset(token)
    if method_name == "__call__" and state.calls == 0:
        raise ValueError(f"qjax.quantize_model: {model_name} called no jax.lax.dot_general or jnp.einsum (as "
                         "nn.Dense, nn.DenseGeneral, nn.Einsum do), so there is nothing to quantize; `@`, jnp.dot "
                         "and jnp.matmul are not intercepted: write those layers with nn.Dense or jnp.einsum")
    rules.warn_unmatched(state.paths, model_name)


def _method_name(method) -> str:
    if method is None:
        return "__call__"
    return method if isinstance(method, str) else getattr(method, "__name__", "?")


def _wrap_method(name: str, method: Callable) -> Callable:
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with _running(self, name):
            return method(self, *args, **kwargs)
    return nn.nowrap(wrapper)


def _wrap_entry(name: str) -> Callable:
    """Module.init / init_with_output / apply, run in the quantized context (a `method=` of the original class
    would otherwise bypass the wrapped methods)."""
    entry = getattr(nn.Module, name)

    def wrapper(self, *args, method=None, **kwargs):
        with _running(self, _method_name(method)):
            return entry(self, *args, method=method, **kwargs)
    return nn.nowrap(functools.wraps(entry)(wrapper))


def _user_methods(cls) -> dict[str, Callable]:
    """The methods a quantized model's caller may enter by: __call__ and the public ones its classes define."""
    fields = {f.name for f in dataclasses.fields(cls)}
    methods = {}
    for klass in reversed(cls.__mro__[:cls.__mro__.index(nn.Module)]):
        for name, value in vars(klass).items():
            public = name == "__call__" or not (name.startswith("_") or name == "setup")
            if public and name not in fields and isinstance(value, types.FunctionType):
                methods[name] = value
    return methods


def _quantize_linen(model: nn.Module, rules: Rules) -> nn.Module:
    cls = type(model)
    namespace = {name: _wrap_method(name, fn) for name, fn in _user_methods(cls).items()}
    namespace.update({name: _wrap_entry(name) for name in ("init", "init_with_output", "apply")})
    namespace.update(_qjax_rules=rules, __module__=cls.__module__, __qualname__=f"Quantized{cls.__qualname__}")
    quantized_cls = type(f"Quantized{cls.__name__}", (cls,), namespace)
    fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(cls) if f.init and f.name != "parent"}
    return quantized_cls(**fields)


# --- NNX -----------------------------------------------------------------------------------------------------------

@functools.cache
def _nnx_gemm_class():
    from flax import nnx

    class QuantizedGemm(nnx.Module):
        """A converted NNX layer's `dot_general` or `einsum_op`: its GEMM quantized per `rules` for `path`.
        `rngs`: the stream stochastic rounding draws from (shared by the model's converted layers), or None."""

        def __init__(self, rules: Rules, path: str, op: str, rngs=None):
            self.rules, self.path, self.op, self.rngs = rules, path, op, rngs

        def make_key(self):
            return self.rngs[self.rules.rng_stream]()

        def __call__(self, *args, **kwargs):
            run = run_dot_general if self.op == "dot_general" else run_einsum
            return run(self.rules, self.path, self.path, self.make_key, *args, **kwargs)

    return QuantizedGemm


def _quantize_nnx(model, rules: Rules, rngs):
    from flax import nnx

    if rules.needs_key and (rngs is None or rules.rng_stream not in rngs):
        raise ValueError(f"a recipe of these rules rounds stochastically: pass rngs=nnx.Rngs({rules.rng_stream}="
                         "key) to quantize_model (NNX layers draw their keys from that stream)")
    qmodel = nnx.clone(model)
    modules = [("/".join(map(str, path)), module) for path, module in nnx.iter_modules(qmodel)]
    converted = 0
    for path, module in modules:
        if isinstance(module, (nnx.Linear, nnx.LinearGeneral)) and getattr(module, "dot_general_cls", None) is None \
                and getattr(module, "dot_general", None) in (None, LAX_DOT_GENERAL):
            module.dot_general = nnx.data(_nnx_gemm_class()(rules, path, "dot_general", rngs))
            converted += 1
        elif isinstance(module, nnx.Einsum) and module.einsum_op is JNP_EINSUM:
            module.einsum_op = nnx.data(_nnx_gemm_class()(rules, path, "einsum", rngs))
            converted += 1
    if not converted:
        raise ValueError(f"qjax.quantize_model: {type(model).__name__} has no nnx.Linear, nnx.LinearGeneral or "
                         "nnx.Einsum with the default dot_general / einsum_op, so there is nothing to quantize")
    rules.warn_unmatched([p for p, _ in modules], type(model).__name__)
    return qmodel


def quantize_model(model, recipe_or_rules, *, skip=(), min_features: int = 0, rng_stream: str = "quant",
                   rngs=None):
    """`model` (a flax.linen Module, or an NNX Module) with its weight GEMMs quantized per the rules.

    Args:
      model: an unbound linen module (returned: a module of a subclass of its class, same fields and params tree)
        or an NNX module (returned: a converted copy with the same nnx.Param state; `model` is left as it was).
      recipe_or_rules: a recipe name or `qjax.Recipe` for every layer, or an ordered list of
        (module-path regex, recipe name / Recipe / None); the first regex found in a layer's path wins, None and
        no match keep the layer in high precision.
      skip: regexes (plain names work) of module paths kept in high precision, checked before the rules.
      min_features: layers whose input or output features are below this stay in high precision.
      rng_stream: the rng stream stochastic-rounding recipes draw keys from (linen: rngs={rng_stream: key} in
        apply; NNX: the stream of `rngs`).
      rngs: NNX only: an nnx.Rngs holding `rng_stream`, needed where a recipe rounds stochastically.

    Raises ValueError for an unknown recipe name (listing the valid ones), a bad regex, and an NNX model without
    a layer to convert; a linen model whose forward calls no dot_general raises when it first runs. A rule or
    skip pattern that matches no module path gives one warning line.
    """
    rules = make_rules(recipe_or_rules, skip, min_features, rng_stream)
    if isinstance(model, nn.Module):
        if rngs is not None:
            raise TypeError("rngs= is for NNX models; a linen model takes rngs={"
                            f"{rng_stream!r}: key}} in apply")
        return _quantize_linen(model, rules)
    from flax import nnx

    if isinstance(model, nnx.Module):
        return _quantize_nnx(model, rules, rngs)
    raise TypeError(f"quantize_model takes a flax.linen or flax.nnx Module, got {type(model).__name__}")
