"""`qjax.quantize_model` on unmodified Flax models (linen and NNX) and `qjax.report`.

The converted model must compute exactly what the same model written with qjax's explicit layers computes
(`qjax.DotGeneral`, `qjax.make_dot_general`, `qjax.einsum`): loss and gradients compared bit for bit, with 8-bit
dots in the lowered program. Shapes are small (CPU) but tile 128-blocks where a test needs it.
"""

import functools
import os
import re
import subprocess
import sys
import textwrap
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qjax

RECIPE = "int8_rowwise"
X = jax.random.normal(jax.random.key(1), (2, 64, 128), jnp.float32)


def eight_bit_dots(lowered) -> int:
    """dot_general ops of a lowered program whose operands are int8 or float8."""
    return sum(bool(re.search(r"dot_general.*tensor<[^>]*x(i8|f8E\w+)>", line))
               for line in lowered.as_text().splitlines())


def assert_bit_identical(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --- a small transformer block, written plainly and with qjax's explicit layers -----------------------------------

class Block(nn.Module):
    """Attention (q/k/v/o nn.Dense, scores by jnp.einsum) and a SwiGLU MLP (nn.DenseGeneral, a hand-written
    einsum weight, nn.Einsum). `dense(name, features)` and `einsum(name, subscripts, x, shape)` build the layers, so
    the explicit form below differs only in them."""

    heads: int = 2
    scanned: bool = False  # called by nn.scan: (carry, x) -> (carry, y)

    def dense(self, features, name):
        return nn.Dense(features, use_bias=False, name=name)

    def einsum(self, subscripts, x, shape, name):
        return nn.Einsum(shape, subscripts, use_bias=False, name=name)(x)

    @nn.compact
    def __call__(self, x, unused=None):
        d = x.shape[-1]
        q, k, v = (self.dense(d, n)(x).reshape(*x.shape[:2], self.heads, -1) for n in ("q", "k", "v"))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])  # activations: not quantized
        attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(x.shape)
        x = x + self.dense(d, "o")(attn)
        gate_up = nn.DenseGeneral((2, 2 * d), use_bias=False, name="gate_up", dot_general_cls=self.dot_general_cls())(x)
        h = jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :]
        w = self.param("down", nn.initializers.lecun_normal(), (2 * d, d))
        h = self.weight_einsum("btf,fd->btd", h, w)
        y = x + self.einsum("btd,de->bte", h, (d, d), "out")
        return (y, None) if self.scanned else y

    def dot_general_cls(self):
        return None

    def weight_einsum(self, subscripts, x, w):
        return jnp.einsum(subscripts, x, w)


class ExplicitBlock(Block):
    """The same block with qjax's layers: DotGeneral in the Dense layers, qjax.einsum for the weights."""

    recipe: str = RECIPE

    def dense(self, features, name):
        return nn.Dense(features, use_bias=False, name=name,
                        dot_general_cls=functools.partial(qjax.DotGeneral, recipe=self.recipe))

    def dot_general_cls(self):
        return functools.partial(qjax.DotGeneral, recipe=self.recipe)

    def weight_einsum(self, subscripts, x, w):
        return qjax.einsum(subscripts, x, w, recipe=self.recipe)

    def einsum(self, subscripts, x, shape, name):
        return QEinsum(shape, subscripts, self.recipe, name=name)(x)


class QEinsum(nn.Module):
    shape: tuple
    subscripts: str
    recipe: str

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), self.shape)
        return qjax.einsum(self.subscripts, x, kernel, recipe=self.recipe)


class Mlp(nn.Module):
    """Two nn.Dense layers (called by nn.scan when `scanned`); `recipe` set: the explicit form (qjax.DotGeneral)."""

    recipe: str | None = None
    scanned: bool = False

    @nn.compact
    def __call__(self, x, unused=None):
        dg = None if self.recipe is None else functools.partial(qjax.DotGeneral, recipe=self.recipe)
        h = jax.nn.relu(nn.Dense(256, name="up", dot_general_cls=dg)(x))
        y = x + nn.Dense(x.shape[-1], name="down", dot_general_cls=dg)(h)
        return (y, None) if self.scanned else y


class Stack(nn.Module):
    """Two MLP layers, scanned (nn.scan) and rematerialised (nn.remat) as a model's layers would be, and a head."""

    recipe: str | None = None

    @nn.compact
    def __call__(self, x):
        scanned = nn.scan(nn.remat(Mlp), variable_axes={"params": 0}, split_rngs={"params": True}, length=2)
        x, _ = scanned(self.recipe, scanned=True, name="layers")(x, None)
        return nn.Dense(128, use_bias=False, name="head")(x)


def loss_and_grads(model, params, x=X, **kwargs):
    loss = lambda p: jnp.sum(model.apply(p, x, **kwargs) ** 2)  # noqa: E731
    return jax.jit(jax.value_and_grad(loss))(params)


def lowered_grad(model, params, x=X, **kwargs):
    return jax.jit(jax.grad(lambda p: jnp.sum(model.apply(p, x, **kwargs) ** 2))).lower(params)


def test_linen_block_is_bit_identical_to_explicit_layers():
    qmodel = qjax.quantize_model(Block(), RECIPE)
    params = jax.jit(Block().init)(jax.random.key(0), X)
    shapes = lambda tree: jax.tree.map(lambda a: (a.shape, a.dtype), tree)  # noqa: E731
    assert shapes(jax.eval_shape(qmodel.init, jax.random.key(0), X)) == shapes(params)
    assert_bit_identical(loss_and_grads(qmodel, params), loss_and_grads(ExplicitBlock(), params))
    # q k v o, gate_up, down, out: 7 layers x 3 GEMMs, less the dgrads of q, k, v (their input needs no gradient)
    assert eight_bit_dots(lowered_grad(qmodel, params)) == eight_bit_dots(lowered_grad(ExplicitBlock(), params)) \
        == 7 * 3 - 3
    assert eight_bit_dots(lowered_grad(Block(), params)) == 0
    rows = qjax.report(qmodel, params, X)
    assert [r.path for r in rows if r.quantized] == ["q", "k", "v", "o", "gate_up", "", "out"]
    attention = [r for r in rows if r.op.startswith("einsum bqhd") or r.op.startswith("einsum bhqk")]
    assert len(attention) == 2 and all("not a weight GEMM" in r.reason for r in attention)


def test_params_are_the_original_models():
    model = Mlp()
    assert_bit_identical(jax.jit(qjax.quantize_model(model, RECIPE).init)(jax.random.key(0), X),
                         jax.jit(model.init)(jax.random.key(0), X))


def test_linen_under_scan_remat_jit_grad():
    """nn.scan over nn.remat layers: bit-identical to the explicit stack; the report sees the scanned layers."""
    qmodel = qjax.quantize_model(Stack(), RECIPE, skip=("head",))
    params = jax.jit(Stack().init)(jax.random.key(0), X)
    assert_bit_identical(loss_and_grads(qmodel, params), loss_and_grads(Stack(recipe=RECIPE), params))
    rows = {row.path: row for row in qjax.report(qmodel, params, X)}
    assert set(rows) == {"layers/up", "layers/down", "head"}
    assert rows["layers/up"].eight_bit == ("fwd", "dgrad", "wgrad") and rows["layers/up"].quantized
    assert rows["head"].recipe is None and rows["head"].reason == "skip 'head'"
    assert eight_bit_dots(lowered_grad(qmodel, params)) > 0


def test_jax_lax_scan_over_stacked_weights():
    """A model that runs its layers with jax.lax.scan over a stacked weight: each step's GEMM reads a slice."""

    def model(einsum):
        class Scanned(nn.Module):
            @nn.compact
            def __call__(self, x):
                ws = self.param("ws", nn.initializers.lecun_normal(), (3, 128, 128))
                return jax.lax.scan(lambda h, w: (jnp.tanh(einsum("btd,de->bte", h, w)), None), x, ws)[0]
        return Scanned()

    plain = lambda *args: jnp.einsum(*args)  # noqa: E731  looked up when called, as model code does
    params = model(plain).init(jax.random.key(0), X)
    qmodel = qjax.quantize_model(model(plain), RECIPE)
    explicit = model(functools.partial(qjax.einsum, recipe=RECIPE))
    assert_bit_identical(loss_and_grads(qmodel, params), loss_and_grads(explicit, params))
    [row] = qjax.report(qmodel, params, X)
    assert row.quantized and row.rhs_shape == (128, 128)


# --- NNX -------------------------------------------------------------------------------------------------------------

class NnxModel(nnx.Module):
    """nnx.Linear, nnx.LinearGeneral and nnx.Einsum; with `recipe`, the explicit form (their dot_general /
    einsum_op given qjax's)."""

    def __init__(self, rngs, recipe=None):
        dot = {} if recipe is None else {"dot_general": qjax.make_dot_general(recipe)}
        ein = {} if recipe is None else {"einsum_op": lambda s, a, b, precision=None, out_sharding=None, **kw:
                                         qjax.einsum(s, a, b, recipe=recipe, precision=precision, **kw)}
        self.up = nnx.Linear(128, 256, rngs=rngs, **dot)
        self.mix = nnx.LinearGeneral(256, (2, 64), rngs=rngs, **dot)
        self.out = nnx.Einsum("btd,de->bte", (128, 128), (128,), rngs=rngs, **ein)

    def __call__(self, x):
        h = jax.nn.relu(self.up(x))
        return self.out(self.mix(h).reshape(*x.shape[:-1], 128))


def nnx_loss_and_grads(model, lower=False):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    fn = jax.jit(jax.value_and_grad(lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(X) ** 2)))
    return fn.lower(params) if lower else fn(params)


def test_nnx_model_is_bit_identical_to_explicit_layers():
    model = NnxModel(nnx.Rngs(0))
    qmodel = qjax.quantize_model(model, RECIPE)
    assert_bit_identical(nnx.state(qmodel, nnx.Param), nnx.state(model, nnx.Param))
    assert model.up.dot_general is jax.lax.dot_general  # the original is left as it was
    explicit = NnxModel(nnx.Rngs(0), recipe=RECIPE)
    assert_bit_identical(nnx_loss_and_grads(qmodel), nnx_loss_and_grads(explicit))
    assert eight_bit_dots(nnx_loss_and_grads(qmodel, lower=True)) == 3 * 3 - 1  # up's dgrad: no gradient needed
    assert eight_bit_dots(nnx_loss_and_grads(model, lower=True)) == 0
    rows = qjax.report(qmodel, None, X)
    assert [(r.path, r.recipe, r.eight_bit) for r in rows] == [(p, RECIPE, ("fwd", "dgrad", "wgrad"))
                                                               for p in ("up", "mix", "out")]


def test_nnx_stochastic_rounding_draws_from_the_rngs_stream():
    sr = qjax.with_stochastic_gradients(qjax.recipe(RECIPE))
    with pytest.raises(ValueError, match=r"pass rngs=nnx.Rngs\(quant=key\)"):
        qjax.quantize_model(NnxModel(nnx.Rngs(0)), sr)
    qmodel = qjax.quantize_model(NnxModel(nnx.Rngs(0)), sr, rngs=nnx.Rngs(quant=3))
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(X) ** 2)))
    first, second = grads(qmodel), grads(qmodel)  # the stream advances between steps
    assert not np.array_equal(first["up"]["kernel"][...], second["up"]["kernel"][...])


def test_nnx_without_layers_to_convert():
    class NoLayers(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((4, 4)))

    with pytest.raises(ValueError, match="has no nnx.Linear, nnx.LinearGeneral or nnx.Einsum"):
        qjax.quantize_model(NoLayers(), RECIPE)


# --- rules, skip, min_features, and the report against the lowered program ---------------------------------------

class Named(nn.Module):
    """Layers named as a transformer's, of several widths."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(128, name="attn_q")(x)
        h = nn.Dense(256, name="mlp_up")(x)
        x = x + nn.Dense(128, name="mlp_down")(h)
        x = x + nn.Dense(128, name="gate")(nn.Dense(64, name="small")(x))
        return nn.Dense(128, name="lm_head")(x)


def test_rules_order_skip_min_features_and_report_against_hlo():
    params = jax.jit(Named().init)(jax.random.key(0), X)
    rules = [("attn", None), ("mlp_up", "fp8_rowwise"), ("", RECIPE)]
    qmodel = qjax.quantize_model(Named(), rules, skip=("lm_head",), min_features=100)
    rows = {r.path: r for r in qjax.report(qmodel, params, X)}
    assert {p: (r.recipe, r.reason) for p, r in rows.items()} == {
        "attn_q": (None, "rule 'attn' -> None"), "mlp_up": ("fp8_rowwise", ""), "mlp_down": (RECIPE, ""),
        "small": (None, "min_features: in 128 or out 64 < 100"), "gate": (None, "min_features: in 64 or out 128 < 100"),
        "lm_head": (None, "skip 'lm_head'")}
    # attn_q, the first layer, runs in high precision, so every quantized layer's dgrad is needed: the report's
    # 8-bit GEMMs are the lowered program's 8-bit dots
    assert sum(len(r.eight_bit) for r in rows.values()) == eight_bit_dots(lowered_grad(qmodel, params)) == 6
    # first match wins: the catch-all before "attn" quantizes attn_q too
    rows = {r.path: r for r in qjax.report(qjax.quantize_model(Named(), [("", RECIPE), ("attn", None)]), params, X)}
    assert rows["attn_q"].recipe == RECIPE and rows["small"].recipe == RECIPE


def test_report_lists_gemms_it_did_not_intercept():
    class MatMul(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(128, name="dense")(x) @ self.param("w", nn.initializers.lecun_normal(), (128, 128))

    params = jax.jit(MatMul().init)(jax.random.key(0), X)
    rows = qjax.report(qjax.quantize_model(MatMul(), RECIPE), params, X)
    assert [(r.path, r.op, r.quantized) for r in rows] == [("dense", "dot_general", True),
                                                           ("", "not intercepted", False)]
    assert rows[1].high_precision == ("3 dots",) and "not intercepted" in rows[1].reason
    assert "not intercepted" in str(rows) and "1 of 2 GEMM calls" in str(rows)


def test_strict_names_an_untileable_layer():
    class Odd(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(100, name="odd")(x)

    params = jax.jit(Odd().init)(jax.random.key(0), X)
    qmodel = qjax.quantize_model(Odd(), "fp8_blockwise")
    [row] = qjax.report(qmodel, params, X)
    assert row.recipe is None and row.reason.startswith("not tileable: fp8_blockwise's")
    with pytest.raises(ValueError, match=r"odd \(lhs \(2, 64, 128\), rhs \(128, 100\)\) would run in high "
                                         r"precision: not tileable.*skip it \(skip=\('odd',\)\), or pad"):
        qjax.report(qmodel, params, X, strict=True)
    qjax.report(qjax.quantize_model(Odd(), "fp8_blockwise", skip=("odd",)), params, X, strict=True)  # skipped: ok


# --- bad input -------------------------------------------------------------------------------------------------------

def test_unknown_recipe_lists_the_valid_names():
    with pytest.raises(ValueError, match="unknown recipe 'int9'; valid names: bf16, int8_rowwise"):
        qjax.quantize_model(Mlp(), "int9")
    with pytest.raises(ValueError, match="unknown recipe 'int9'"):
        qjax.quantize_model(Mlp(), [("up", "int9")])


def test_bad_rules():
    with pytest.raises(ValueError, match="is not a valid module-path regex"):
        qjax.quantize_model(Mlp(), [("up(", RECIPE)])
    with pytest.raises(TypeError, match="each rule is"):
        qjax.quantize_model(Mlp(), [RECIPE])
    with pytest.raises(ValueError, match="min_features must be an int >= 0"):
        qjax.quantize_model(Mlp(), RECIPE, min_features=-1)
    with pytest.raises(TypeError, match="rngs= is for NNX models"):
        qjax.quantize_model(Mlp(), RECIPE, rngs=nnx.Rngs(0))


def test_a_rule_that_matches_no_module_warns_once():
    qmodel = qjax.quantize_model(Mlp(), [("attention", None), ("", RECIPE)], skip=("embed",))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.eval_shape(qmodel.init, jax.random.key(0), X)
        jax.eval_shape(qmodel.init, jax.random.key(0), X)
    assert [str(w.message) for w in caught] == ["qjax.quantize_model: rule 'attention' matches no module of Mlp",
                                                "qjax.quantize_model: skip 'embed' matches no module of Mlp"]


def test_a_model_without_dot_general():
    class Elementwise(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x * self.param("scale", nn.initializers.ones, (x.shape[-1],))

    with pytest.raises(ValueError, match="Elementwise called no jax.lax.dot_general or jnp.einsum"):
        qjax.quantize_model(Elementwise(), RECIPE).init(jax.random.key(0), X)


def test_stochastic_rounding_draws_from_the_quantize_stream():
    sr = qjax.with_stochastic_gradients(qjax.recipe(RECIPE))
    qmodel = qjax.quantize_model(Mlp(), sr)
    params = jax.jit(qmodel.init)(jax.random.key(0), X)  # init: a fixed key
    with pytest.raises(ValueError, match=r"layer 'up' rounds stochastically: pass rngs=\{'quant': key\}"):
        loss_and_grads(qmodel, params)
    a, b, c = (loss_and_grads(qmodel, params, rngs={"quant": jax.random.key(k)}) for k in (1, 1, 2))
    assert_bit_identical(a, b)
    assert not np.array_equal(a[1]["params"]["up"]["kernel"], c[1]["params"]["up"]["kernel"])


def test_interception_is_scoped():
    qmodel = qjax.quantize_model(Mlp(), RECIPE)
    jax.eval_shape(qmodel.init, jax.random.key(0), X)
    assert jax.lax.dot_general is qjax.gemm_rules.LAX_DOT_GENERAL and jnp.einsum is qjax.gemm_rules.JNP_EINSUM


# --- a 2x2 mesh with FSDP --------------------------------------------------------------------------------------------

MESH_SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    import qjax
    from qjax.flax import weight_shardings
    from qjax.train import mesh as mesh_lib
    sys.path.insert(0, "tests")
    from test_convert import Mlp, RECIPE, assert_bit_identical

    mesh = mesh_lib.make_mesh(data=2, fsdp=2)
    x = jax.device_put(jax.random.normal(jax.random.key(1), (8, 16, 128)), mesh_lib.batch_sharding(mesh))
    params = jax.jit(Mlp().init)(jax.random.key(0), x[:1])["params"]
    params = jax.device_put(params, mesh_lib.named(mesh_lib.param_specs(params, mesh), mesh))
    assert params["up"]["kernel"].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
    lookup = mesh_lib.layer_sharding(params, mesh)

    def step(model):
        def loss(p):
            with mesh_lib.tracing_on(mesh), weight_shardings(lookup):
                return jnp.sum(model.apply({"params": p}, x) ** 2)
        return jax.jit(jax.value_and_grad(loss))

    converted, explicit = step(qjax.quantize_model(Mlp(), RECIPE)), step(Mlp(recipe=RECIPE))
    assert_bit_identical(converted(params), explicit(params))
    text = converted.lower(params).as_text()
    gathers = [line for line in text.splitlines() if "all_gather" in line]
    assert gathers and all("xi8>" in line or "xf32>" in line for line in gathers), gathers
    assert any("xi8>" in line for line in gathers)  # the weights travel as int8 codes
    print("mesh ok")
""")


def test_fsdp_on_a_2x2_cpu_mesh():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", MESH_SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                         cwd=root)
    assert out.returncode == 0, out.stdout + out.stderr[-5000:]
    assert out.stdout.split() == ["mesh", "ok"], out.stdout
