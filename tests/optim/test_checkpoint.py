"""Quantized optimizer states round-trip through orbax exactly; training continues bit-identically after restore."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from qjax import optim


def _bits(a):
    return np.asarray(a).reshape(-1).view(np.uint8)


@pytest.mark.parametrize("make", [
    lambda: optim.adamw_8bit(optax.cosine_decay_schedule(1e-3, 100), weight_decay=0.01),
    lambda: optim.adamw_4bit(1e-3),
    lambda: optim.adamw_fp8(1e-3),
    lambda: optim.adamw_fp8(1e-3, dynamic_range_expansion=True),
], ids=["8bit", "4bit", "fp8", "fp8_dre"])
def test_orbax_roundtrip_and_resume(tmp_path, make):
    tx = make()
    params = {"w": jax.random.normal(jax.random.key(0), (64, 128)), "b": jnp.zeros(16)}
    grad = lambda i: jax.tree.map(lambda p: jax.random.normal(jax.random.fold_in(jax.random.key(1), i), p.shape), params)

    @jax.jit
    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    p, s = params, tx.init(params)
    for i in range(3):
        p, s = step(p, s, grad(i))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", {"params": p, "opt": s})
        ckpt.wait_until_finished()
    with ocp.StandardCheckpointer() as ckpt:
        target = jax.eval_shape(lambda: {"params": p, "opt": s})
        restored = ckpt.restore(tmp_path / "ckpt", target)
    assert jax.tree.structure(restored) == jax.tree.structure({"params": p, "opt": s})
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves({"params": p, "opt": s})):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(_bits(a), _bits(b))  # bit-exact
    p2, s2 = restored["params"], restored["opt"]
    for i in range(3, 6):
        p, s = step(p, s, grad(i))
        p2, s2 = step(p2, s2, grad(i))
    for a, b in zip(jax.tree.leaves((p, s)), jax.tree.leaves((p2, s2))):
        np.testing.assert_array_equal(_bits(a), _bits(b))
