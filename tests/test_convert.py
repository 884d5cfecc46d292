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
