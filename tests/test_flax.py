"""Flax integration: nn.Dense(dot_general=...), DotGeneral with a Flax RNG stream, einsum, recipe_for_layer."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import snr_db

import qjax

X = jax.random.normal(jax.random.key(0), (4, 32, 256))


def _dense_outputs_and_grads(dense, params, rngs=None):
    loss = lambda p: jnp.sum(dense.apply(p, X, rngs=rngs) ** 2)
    return dense.apply(params, X, rngs=rngs), jax.grad(loss)(params)


@pytest.mark.parametrize("name", ["int8_rowwise", "fp8_tensorwise", "fp8_blockwise"])
def test_dense_drop_in(name):
    reference = nn.Dense(384)
    params = reference.init(jax.random.key(1), X)
    y_ref, g_ref = _dense_outputs_and_grads(reference, params)
    y, g = _dense_outputs_and_grads(nn.Dense(384, dot_general=qjax.make_dot_general(name)), params)
    assert y.shape == (4, 32, 384) and snr_db(y_ref, y) > 18
    assert snr_db(g_ref["params"]["kernel"], g["params"]["kernel"]) > 17
    assert snr_db(g_ref["params"]["bias"], g["params"]["bias"]) > 17


def test_dot_general_cls_draws_keys_from_the_quant_stream():
    recipe = qjax.with_stochastic_gradients(qjax.recipe("int8_rowwise"))
    dense = nn.Dense(384, dot_general_cls=functools.partial(qjax.DotGeneral, recipe=recipe))
    params = dense.init({"params": jax.random.key(1), "quant": jax.random.key(2)}, X)
    grads = lambda seed: _dense_outputs_and_grads(dense, params, {"quant": jax.random.key(seed)})[1]
    a, b, c = grads(3), grads(3), grads(4)
    np.testing.assert_array_equal(a["params"]["kernel"], b["params"]["kernel"])
    assert not np.array_equal(a["params"]["kernel"], c["params"]["kernel"])
    reference = _dense_outputs_and_grads(nn.Dense(384), params)[1]
    assert snr_db(reference["params"]["kernel"], a["params"]["kernel"]) > 20
    with pytest.raises(Exception, match="quant"):
        dense.apply(params, X)


def test_make_dot_general_refuses_stochastic_recipe_without_key():
    with pytest.raises(ValueError, match="DotGeneral"):
        qjax.make_dot_general(qjax.with_stochastic_gradients(qjax.recipe("int8_rowwise")))


@pytest.mark.parametrize("subscripts, lhs_shape, rhs_shape", [
    ("btd,fd->btf", (2, 64, 256), (96, 256)),
    ("btd,df->btf", (2, 64, 256), (256, 96)),
    ("bqhd,bkhd->bhqk", (2, 64, 4, 128), (2, 32, 4, 128)),
    ("btd,fd->fbt", (2, 64, 256), (96, 256)),
])
def test_einsum_matches_jnp_einsum(subscripts, lhs_shape, rhs_shape):
    lhs = jax.random.normal(jax.random.key(1), lhs_shape)
    rhs = jax.random.normal(jax.random.key(2), rhs_shape)
    expected = jnp.einsum(subscripts, lhs, rhs, precision="highest")
    # jnp.einsum may order the operands differently: equal up to float32 summation order.
    assert snr_db(jnp.einsum(subscripts, lhs, rhs), qjax.einsum(subscripts, lhs, rhs, recipe="bf16")) > 100
    out = qjax.einsum(subscripts, lhs, rhs, recipe="int8_rowwise")
    assert out.shape == expected.shape and snr_db(expected, out) > 20


@pytest.mark.parametrize("subscripts, match", [
    ("btd,fd", "explicit output"), ("...d,fd->...f", "explicit output"), ("bdd,fd->bf", "repeat"),
    ("btd,fd->bf", "summed within one operand"), ("btd,fd->btfx", "appears in no operand"), ("bt,fd->btf", "shape"),
])
def test_einsum_bad_subscripts(subscripts, match):
    with pytest.raises(ValueError, match=match):
        qjax.einsum(subscripts, X, jnp.ones((8, 256)), recipe="int8_rowwise")


def test_recipe_for_layer():
    int8 = qjax.recipe("int8_rowwise")
    pick = functools.partial(qjax.recipe_for_layer, keep_high_precision=("lm_head", "embed"), min_features=128)
    assert pick(int8, "blocks_0/mlp/up", features_in=2048, features_out=5632) is int8
    assert pick(int8, "lm_head", features_in=2048, features_out=32000).name == "bf16"
    assert pick(int8, "blocks_0/tiny", features_in=64, features_out=2048).name == "bf16"
    assert qjax.recipe_for_layer("fp8_blockwise", "x", features_in=200, features_out=256).name == "bf16"
    assert qjax.recipe_for_layer("fp8_blockwise", "x", features_in=256, features_out=256).name == "fp8_blockwise"
