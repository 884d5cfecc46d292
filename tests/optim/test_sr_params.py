"""BF16 params + stochastic rounding: unbiased, reproducible, keeps small updates, matches the shared SR hash."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from qjax import optim, stochastic


def test_sr_update_is_unbiased_and_keyed():
    # 1e5 draws of 1.0 + u with u = 0.3 bf16 ulps: round-to-nearest always gives 1.0, SR gives 1 + u on average.
    n = 100_000
    params = {"w": jnp.ones((n,), jnp.bfloat16)}
    u = 0.3 * 2.0**-7
    updates = {"w": jnp.full((n,), u, jnp.float32)}
    new = optim.apply_updates_sr(params, updates, jax.random.key(0))["w"]
    assert new.dtype == jnp.bfloat16
    assert set(np.unique(np.asarray(new, np.float32))) == {1.0, 1.0 + 2.0**-7}
    mean = float(jnp.mean(new.astype(jnp.float32)))
    assert abs(mean - (1 + u)) <= 3e-5 * (1 + u), mean
    assert bool(jnp.all(optax.apply_updates(params, updates)["w"] == 1.0))  # nearest rounding loses the update
    again = optim.apply_updates_sr(params, updates, jax.random.key(0))["w"]
    np.testing.assert_array_equal(again, new)  # same key, same bits
    other = optim.apply_updates_sr(params, updates, jax.random.key(1))["w"]
    assert bool(jnp.any(other != new))


def test_sr_uses_the_shared_hash_per_leaf():
    params = {"a": jax.random.normal(jax.random.key(0), (8, 16)).astype(jnp.bfloat16),
              "b": jax.random.normal(jax.random.key(1), (32,)).astype(jnp.bfloat16)}
    updates = jax.tree.map(lambda p: jnp.full(p.shape, 1e-3, jnp.float32), params)
    key = jax.random.key(3)
    got = optim.apply_updates_sr(params, updates, key)
    seeds = optim.sr_params.leaf_seeds(key, 2)
    for (name, p), seed in zip(sorted(params.items()), seeds):
        want = stochastic.stochastic_round_with_seed(p.astype(jnp.float32) + 1e-3, jnp.bfloat16, seed)
        np.testing.assert_array_equal(got[name], want)


def test_float32_leaves_and_nonfinite():
    params = {"f": jnp.array([1.0, 2.0]), "h": jnp.array([1.0, jnp.inf, 3.0], jnp.bfloat16)}
    updates = {"f": jnp.array([0.5, jnp.nan]), "h": jnp.array([jnp.nan, 0.0, 0.0])}
    new = optim.apply_updates_sr(params, updates, jax.random.key(0))
    np.testing.assert_array_equal(new["f"], [1.5, np.nan])
    assert new["h"].dtype == jnp.bfloat16 and bool(jnp.isnan(new["h"][0])) and bool(jnp.isinf(new["h"][1]))
    with pytest.raises(ValueError, match="key"):
        optim.apply_updates_sr(params, updates, None)


def test_bf16_sr_training_tracks_fp32_master():
    """Linear regression: bf16 params + SR reach the fp32 loss; bf16 with nearest rounding stalls higher."""
    x = jax.random.normal(jax.random.key(0), (512, 32))
    w_true = jax.random.normal(jax.random.key(1), (32, 1))
    y = x @ w_true
    loss = lambda w: jnp.mean((x @ w.astype(jnp.float32) - y) ** 2)
    tx = optax.adam(3e-4)

    @__import__('functools').partial(jax.jit, static_argnums=1)
    def run(w0, use_sr):
        def body(carry, i):
            w, s = carry
            u, s = tx.update(jax.grad(loss)(w), s, w)
            w = optim.apply_updates_sr(w, u, jax.random.fold_in(jax.random.key(9), i)) if use_sr else \
                optax.apply_updates(w, u)
            return (w, s), None
        (w, _), _ = jax.lax.scan(body, (w0, tx.init(w0)), jnp.arange(3000))
        return loss(w)

    w0 = w_true + 0.25
    fp32, sr, nearest = run(w0, False), run(w0.astype(jnp.bfloat16), True), run(w0.astype(jnp.bfloat16), False)
    # fp32 converges to ~0; SR reaches bf16's noise floor (weights ~1, ulp 2**-7); nearest rounding stalls far above.
    assert float(fp32) < 1e-6 and float(sr) < 1e-3 and float(nearest) > 100 * float(sr), (fp32, sr, nearest)
