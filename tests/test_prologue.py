"""`qjax.prologue.prologue_dot`: a norm / activation fused with the linear layer after it (the data-flow recipes).

Its forward is the unfused composition's, bit for bit; its weight gradient too (wgrad reads the same codes); the
input gradient differs only by the 8-bit copy of the op's input the backward reads; and what it saves for the
backward is 8-bit codes plus small float32 scales and statistics, never an activation in bf16 or float32. With
`Recipe.recompute_prologue_output` it saves no copy of the op's output: only wgrad changes, by a second rounding.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals

import qjax
from helpers import INT8_DATAFLOW_SR, snr_db
from qjax.models import ops
from qjax.prologue import prologue_dot

M, D, F = 256, 128, 192
KEY = jax.random.key(7)
# The data-flow recipes and Jetfire's stochastic gradients (SR's key path).
DATAFLOW = ["fp8_dataflow", "int8_dataflow", pytest.param(INT8_DATAFLOW_SR, id="int8_dataflow_sr")]


def _inputs(dtype=jnp.bfloat16):
    x = (jax.random.normal(jax.random.key(0), (2, M // 2, D)) * 3).astype(dtype)
    scale = 1 + 0.1 * jax.random.normal(jax.random.key(1), (D,))
    kernel = (jax.random.normal(jax.random.key(2), (D, F)) * 0.05).astype(dtype)
    gate_up = jax.random.normal(jax.random.key(3), (2, M // 2, 2 * D)).astype(dtype)
    return x, scale, kernel, gate_up


def _fused(op, recipe):
    return lambda x, params, kernel: prologue_dot(op, x, params, kernel, recipe=recipe, key=KEY)


def _unfused(op, recipe):
    def f(x, params, kernel):
        y = op.apply(x, *params)
        return qjax.dot_general(y, kernel, (((y.ndim - 1,), (0,)), ((), ())), recipe=recipe, key=KEY)
    return f


def _loss(f):
    # A fixed random projection of the output: gradients of every magnitude, not a sum's constant cotangent.
    def loss(x, params, kernel):
        out = f(x, params, kernel).astype(jnp.float32)
        return jnp.sum(out * jax.random.normal(jax.random.key(9), out.shape))
    return loss


CASES = [("rms_norm", lambda: ops.rms_norm_prologue(1e-5, jnp.bfloat16), True),
         ("layer_norm", lambda: ops.layer_norm_prologue(1e-5, jnp.bfloat16), True),
         ("swiglu", lambda: ops.SWIGLU, False),
         ("gelu", lambda: ops.GELU, False),
         ("gelu_exact", lambda: ops.GELU_EXACT, False)]


def _case(name, make_op, has_scale):
    x, scale, kernel, gate_up = _inputs()
    op = make_op()
    if name == "layer_norm":
        return op, x, (scale, 0.1 * scale), kernel
    if name == "swiglu":
        return op, gate_up, (), kernel
    return op, x, ((scale,) if has_scale else ()), kernel


@pytest.mark.parametrize("recipe", DATAFLOW)
@pytest.mark.parametrize("name,make_op,has_scale", CASES)
def test_forward_and_wgrad_bit_exact_dgrad_close(recipe, name, make_op, has_scale):
    op, x, params, kernel = _case(name, make_op, has_scale)
    fused, unfused = _fused(op, recipe), _unfused(op, recipe)
    np.testing.assert_array_equal(np.asarray(fused(x, params, kernel)), np.asarray(unfused(x, params, kernel)))
    got = jax.grad(_loss(fused), argnums=(0, 1, 2))(x, params, kernel)
    want = jax.grad(_loss(unfused), argnums=(0, 1, 2))(x, params, kernel)
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))  # wgrad: the same saved codes
    # dx and dparams: the op's backward reads its input from 8 bits (e4m3 1x16: ~30 dB, int8 1x32: ~40 dB).
    floor = 25 if recipe == "fp8_dataflow" else 33
    assert snr_db(want[0].astype(jnp.float32), got[0].astype(jnp.float32)) > floor
    for g, w in zip(got[1], want[1]):
        assert snr_db(w, g) > floor


def _recomputing(recipe):
    return dataclasses.replace(qjax.recipe(recipe), recompute_prologue_output=True)


@pytest.mark.parametrize("recipe", DATAFLOW)
@pytest.mark.parametrize("name,make_op,has_scale", CASES)
def test_recomputed_output_changes_only_wgrad(recipe, name, make_op, has_scale):
    op, x, params, kernel = _case(name, make_op, has_scale)
    saving, recomputing = _fused(op, recipe), _fused(op, _recomputing(recipe))
    np.testing.assert_array_equal(np.asarray(recomputing(x, params, kernel)), np.asarray(saving(x, params, kernel)))
    got = jax.grad(_loss(recomputing), argnums=(0, 1, 2))(x, params, kernel)
    want = jax.grad(_loss(saving), argnums=(0, 1, 2))(x, params, kernel)
    for g, w in zip(jax.tree.leaves(got[:2]), jax.tree.leaves(want[:2])):  # dgrad and the op's backward: unchanged
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    # wgrad reads y recomputed from the 8-bit copy of x, quantized again: the saved copy's error (measured ~26-28 dB
    # e4m3 1x16, ~36-40 dB int8 1x32 against the saved-codes wgrad).
    floor = 25 if recipe == "fp8_dataflow" else 33
    assert snr_db(want[2].astype(jnp.float32), got[2].astype(jnp.float32)) > floor


def test_stochastic_gradients_reach_the_fused_backward():
    # Jetfire's SR of the gradient operand: the fused backward's wgrad must round as the unfused one does (same key),
    # and differently from round-to-nearest, else the SR recipe would silently train as int8_dataflow.
    op, x, params, kernel = _case(*CASES[0])

    def wgrad(f):
        return np.asarray(jax.grad(_loss(f), argnums=2)(x, params, kernel))

    fused_sr = wgrad(_fused(op, INT8_DATAFLOW_SR))
    np.testing.assert_array_equal(fused_sr, wgrad(_unfused(op, INT8_DATAFLOW_SR)))
    assert not np.array_equal(fused_sr, wgrad(_fused(op, "int8_dataflow")))


def test_recomputed_output_under_jit_and_scan():
    op, x, params, _ = _case(*CASES[0])
    kernels = (jax.random.normal(jax.random.key(4), (2, D, D)) * 0.1).astype(jnp.bfloat16)
    layer = lambda h, kernel: prologue_dot(op, h, params, kernel, recipe=_recomputing("int8_dataflow"), key=KEY)
    scanned = lambda x, kernels: jax.lax.scan(lambda h, k: (layer(h, k), None), x, kernels)[0]
    unrolled = lambda x, kernels: layer(layer(x, kernels[0]), kernels[1])
    loss = lambda f: lambda x, kernels: jnp.sum(f(x, kernels).astype(jnp.float32) ** 2)
    got = jax.jit(jax.grad(loss(scanned), argnums=(0, 1)))(x, kernels)
    for g, w in zip(got, jax.grad(loss(unrolled), argnums=(0, 1))(x, kernels)):  # the same ops: bit for bit
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_without_saved_spec_equals_unfused_exactly():
    op, x, params, kernel = _case(*CASES[0])
    fused, unfused = _fused(op, "int8_rowwise"), _unfused(op, "int8_rowwise")
    for a, b in zip(jax.tree.leaves(jax.grad(_loss(fused), argnums=(0, 1, 2))(x, params, kernel)),
                    jax.tree.leaves(jax.grad(_loss(unfused), argnums=(0, 1, 2))(x, params, kernel))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("recipe", DATAFLOW)
@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=["rms_norm", "swiglu"])
@pytest.mark.parametrize("recompute", [False, True], ids=["output_saved", "output_recomputed"])
def test_saves_only_8bit_activations(recipe, case, recompute):
    op, x, params, kernel = _case(*case)
    fused = _fused(op, _recomputing(recipe) if recompute else recipe)
    loss = lambda x, params, kernel: jnp.sum(fused(x, params, kernel).astype(jnp.float32))
    residuals = saved_residuals(loss, x, params, kernel)
    wide = [(aval, source) for aval, source in residuals
            if aval.size > x.size // 16 and aval.dtype.itemsize > 1 and aval.size != kernel.size]
    assert not wide, wide  # scales: one float32 per 16 or 32 features at most
    eight_bit = [aval.size for aval, _ in residuals if aval.dtype.itemsize == 1 and aval.size != kernel.size]
    # The op's input (groups) and, unless recomputed, its output as wgrad reads it.
    output = [] if recompute else [op.apply(x, *params).size]
    assert sorted(eight_bit) == sorted([x.size] + output), residuals


@pytest.mark.parametrize("recipe", DATAFLOW)
def test_nan_stays_visible(recipe):
    op, x, params, kernel = _case(*CASES[0])
    x = x.at[0, 3, 5].set(jnp.nan)
    out = _fused(op, recipe)(x, params, kernel)
    assert np.isnan(np.asarray(out[0, 3], np.float32)).all()
    dx = jax.grad(_loss(_fused(op, recipe)))(x, params, kernel)
    assert not np.isfinite(np.asarray(dx, np.float32)).all()


def test_group_that_does_not_tile_names_the_layer():
    op = ops.rms_norm_prologue(1e-5, jnp.bfloat16)
    x = jnp.ones((4, 40), jnp.bfloat16)
    with pytest.raises(ValueError, match="layers_0/attn/qkv_proj input.*groups of 32.*multiple of 32"):
        prologue_dot(op, x, (jnp.ones(40),), jnp.ones((40, 8), jnp.bfloat16), recipe="int8_dataflow", key=KEY,
                     layer="layers_0/attn/qkv_proj")


def test_saved_spec_must_be_rowwise_nearest():
    with pytest.raises(ValueError, match="Recipe.saved"):
        qjax.Recipe("bad", saved=qjax.QuantSpec("int8", "tensor"))


def test_recompute_needs_saved_activations():
    with pytest.raises(ValueError, match="recompute_prologue_output=True.*Recipe.saved"):
        dataclasses.replace(qjax.recipe("int8_rowwise"), recompute_prologue_output=True)
    with pytest.raises(TypeError, match="recompute_prologue_output must be a bool"):
        dataclasses.replace(qjax.recipe("int8_dataflow"), recompute_prologue_output=1)
