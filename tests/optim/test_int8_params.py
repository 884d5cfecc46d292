"""INT8 weight-only training: int8 + per-channel scale only, SR requantization, Flax layer, training tracks fp32."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from qjax import optim
from qjax import int8_params


def test_quantize_layout_and_roundtrip():
    w = jax.random.normal(jax.random.key(0), (64, 32)) * jnp.linspace(0.1, 2.0, 32)
    p = int8_params.quantize_int8_param(w)
    assert p.data.dtype == jnp.int8 and p.data.shape == (64, 32) and p.scale.shape == (1, 32)
    np.testing.assert_allclose(p.scale[0], jnp.max(jnp.abs(w), axis=0) / 127, rtol=1e-6)
    assert float(jnp.max(jnp.abs(p.dequantize() - w) / p.scale)) <= 0.5 + 1e-5  # nearest: half a step
    z = int8_params.quantize_int8_param(jnp.zeros((4, 3)))
    np.testing.assert_array_equal(z.scale, 1.0)
    n = int8_params.quantize_int8_param(jnp.ones((4, 3)).at[1, 2].set(jnp.nan))
    assert bool(jnp.all(jnp.isnan(n.dequantize()[:, 2]))) and bool(jnp.all(jnp.isfinite(n.dequantize()[:, :2])))
    with pytest.raises(ValueError, match="ndim >= 2"):
        int8_params.quantize_int8_param(jnp.ones(5))


def test_sr_requantization_is_unbiased():
    # Column 0 keeps absmax 127 (scale 1); the others sit on the grid at 10 and get a quarter step each.
    w = jnp.full((50_000, 1), 10.0).at[0].set(127.0)
    p = int8_params.quantize_int8_param(w)
    u = jnp.full((50_000, 1), 0.25).at[0].set(0.0)  # nearest rounding would drop the update
    new = optim.apply_updates_int8({"w": p}, {"w": u}, jax.random.key(0))["w"]
    np.testing.assert_array_equal(new.scale, 1.0)  # fresh absmax: still 127
    col = new.dequantize()[1:, 0]
    assert set(np.unique(np.asarray(col))) == {10.0, 11.0}
    assert abs(float(col.mean()) - 10.25) < 0.01
    again = optim.apply_updates_int8({"w": p}, {"w": u}, jax.random.key(0))["w"]
    np.testing.assert_array_equal(again.data, new.data)


def _dense(features):  # an nn.Dense that takes an Int8Param kernel, as qjax's models build theirs
    import functools

    import flax.linen as nn

    import qjax
    return nn.Dense(features, promote_dtype=int8_params.promote_dtype,
                    dot_general_cls=functools.partial(qjax.DotGeneral, recipe="bf16"))


class _MLP(__import__("flax").linen.Module):
    @__import__("flax").linen.compact
    def __call__(self, x):
        h = jax.nn.gelu(_dense(128)(x))  # constructed first: Dense_0
        return _dense(16)(h)


def test_flax_int8_training_tracks_fp32():
    x = jax.random.normal(jax.random.key(1), (256, 64))
    y = jnp.tanh(x @ jax.random.normal(jax.random.key(2), (64, 16)) / 8)
    model = _MLP()
    params = int8_params.to_int8_params(model.init(jax.random.key(0), x)["params"], min_size=0)
    assert isinstance(params["Dense_0"]["kernel"], optim.Int8Param)
    assert params["Dense_0"]["kernel"].data.dtype == jnp.int8
    stored = sum(a.nbytes for a in jax.tree.leaves(params))
    assert stored < 0.3 * 4 * (64 * 128 + 128 * 16 + 128 + 16)  # no high-precision copy is kept
    loss_fn = lambda p: jnp.mean((model.apply({"params": p}, x) - y) ** 2)
    tx = optax.adam(3e-3)

    @jax.jit
    def int8_step(p, s, key):
        loss, g = optim.int8_value_and_grad(loss_fn)(p)
        assert g["Dense_0"]["kernel"].shape == (64, 128) and g["Dense_0"]["kernel"].dtype == jnp.float32
        u, s = tx.update(g, s, optim.dequantize_params(p))
        return optim.apply_updates_int8(p, u, key), s, loss

    def float_loss(p):  # the same network on float32 weights: the fp32 reference run
        h = jax.nn.gelu(x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])
        return jnp.mean((h @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"] - y) ** 2)

    @jax.jit
    def fp32_step(p, s):
        loss, g = jax.value_and_grad(float_loss)(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    pf = optim.dequantize_params(params)
    sf = tx.init(pf)
    p8, s8 = params, tx.init(optim.dequantize_params(params))
    losses8, lossesf = [], []
    for i in range(30):
        p8, s8, l8 = int8_step(p8, s8, jax.random.fold_in(jax.random.key(5), i))
        pf, sf, lf = fp32_step(pf, sf)
        losses8.append(float(l8)); lossesf.append(float(lf))
    assert lossesf[-1] < 0.5 * lossesf[0]
    assert losses8[-1] < 0.5 * losses8[0]
    np.testing.assert_allclose(losses8, lossesf, rtol=0.1)
    assert isinstance(p8["Dense_1"]["kernel"], optim.Int8Param) and p8["Dense_1"]["kernel"].data.dtype == jnp.int8


def test_gradients_in_the_compute_dtype_are_exact():
    """grad_dtype=bfloat16 gives the float32 gradients' values: the bf16 GEMM's gradient is bf16 already."""
    w = int8_params.quantize_int8_param(jax.random.normal(jax.random.key(0), (64, 32)))
    x = jax.random.normal(jax.random.key(1), (16, 64), jnp.bfloat16)
    loss = lambda p: jnp.sum(jnp.sin((x @ p["w"].dequantize(jnp.bfloat16)).astype(jnp.float32)))
    (v32, g32), (v16, g16) = [jax.jit(optim.int8_value_and_grad(loss, grad_dtype=d))({"w": w})
                              for d in (jnp.float32, jnp.bfloat16)]
    assert g16["w"].dtype == jnp.bfloat16 and g32["w"].dtype == jnp.float32
    assert float(jnp.max(jnp.abs(g32["w"]))) > 0
    np.testing.assert_array_equal(np.asarray(g16["w"].astype(jnp.float32)), np.asarray(g32["w"]))
    assert v16 == v32
