"""The streamed AdamW step (`qjax.optim.streaming`): peak memory from XLA's CPU memory analysis (issue 22's
targets), and bit-identity with the unstreamed step, through update and apply_gradients (bfloat16 params with
stochastic rounding included)."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from qjax import optim, stochastic
from qjax.optim import adam, fused_adam, sr_params, streaming

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from optim import llama_shapes, step_memory  # noqa: E402

OPTIMIZERS = {
    "adamw_8bit": lambda: optim.adamw_8bit(1e-3, weight_decay=0.01),
    "adamw_4bit": lambda: optim.adamw_4bit(1e-3, weight_decay=0.01),
    "adamw_fp8": lambda: optim.adamw_fp8(1e-3, weight_decay=0.01),
    "adamw_fp8_dre": lambda: optim.adamw_fp8(1e-3, weight_decay=0.01, dynamic_range_expansion=True),
}


def _llama_tree(dtype):
    """One layer of the 125m Llama with its embedding and LM head (the largest tensors: 24.6M elements each, 80% of
    the tree's 56M params), as ShapeDtypeStructs."""
    shapes = llama_shapes(d=768, layers=1, heads=12, kv_heads=12, ffn=2048, vocab=32000)
    return {name: jax.ShapeDtypeStruct(shape, dtype) for name, shape in shapes.items()}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_low_bit_step_peaks_at_most_half_of_fp32_adamw(name):
    """state + temporaries <= 0.5x optax.adamw's (8 + 8 B/param) for float32 params (unstreamed: 17-27 B/param)."""
    params = _llama_tree(jnp.float32)
    baseline = step_memory(optax.adamw(1e-3, weight_decay=0.01), params)["total"]
    memory = step_memory(OPTIMIZERS[name](), params)
    assert memory["total"] <= 0.5 * baseline, (memory, baseline)


def test_bf16_params_with_stochastic_rounding_8bit_under_5_bytes_per_param():
    memory = step_memory(OPTIMIZERS["adamw_8bit"](), _llama_tree(jnp.bfloat16), stochastic_rounding=True)
    assert memory["total"] <= 5.0, memory


def _bits(tree):
    return [np.ascontiguousarray(np.atleast_1d(np.asarray(x))).view(np.uint8) for x in jax.tree.leaves(tree)]


def _assert_bit_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(_bits(a), _bits(b), strict=True):
        np.testing.assert_array_equal(x, y)


MAKERS = {
    "8bit": lambda: optim.adamw_8bit(optax.linear_schedule(1e-3, 1e-4, 5), weight_decay=0.1, min_quantized_size=1024,
                                     mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)),
    "4bit": lambda: optim.adamw_4bit(1e-3, weight_decay=0.1, min_quantized_size=1024),
    "fp8": lambda: optim.adamw_fp8(1e-3, weight_decay=0.1, min_quantized_size=1024),
    "fp8_dre": lambda: optim.adamw_fp8(1e-3, weight_decay=0.0, dynamic_range_expansion=True, min_quantized_size=1024),
}


@pytest.mark.parametrize("name,dtype", [(name, jnp.float32) for name in sorted(MAKERS)]
                         + [("8bit", jnp.bfloat16), ("fp8_dre", jnp.bfloat16)],
                         ids=[*sorted(MAKERS), "8bit_bf16_sr", "fp8_dre_bf16_sr"])
def test_streamed_step_is_bit_identical_to_the_unstreamed_one(name, dtype, monkeypatch):
    """Groups of <= 1536 elements and chunks of 6 (blocks of 256) or 12 (128) blocks with a tail (embed: 100 blocks
    of 256) against one group of whole tensors: update, apply_gradients (with a key for bf16: stochastic rounding
    with each chunk's element offset), two steps."""
    keys = jax.random.split(jax.random.key(0), 4)
    shapes = {"embed": (100, 256), "w": (64, 64), "norm": (64,), "odd": (33, 64)}
    params = {n: (jax.random.normal(k, s) * 0.1).astype(dtype) for k, (n, s) in zip(keys, shapes.items())}
    grads = [{n: (jax.random.normal(jax.random.fold_in(k, i), s) * 0.01).astype(dtype)
              for k, (n, s) in zip(keys, shapes.items())} for i in range(2)]
    tx = MAKERS[name]()
    key = jax.random.key(7) if dtype == jnp.bfloat16 else None

    def run():
        update = jax.jit(tx.update)
        step = jax.jit(lambda g, s, p, k: optim.apply_gradients(tx, g, s, p, k))
        p, s, updates = params, tx.init(params), []
        for i, g in enumerate(grads):
            updates.append(update(g, s, p))
            p, s = step(g, s, p, None if key is None else jax.random.fold_in(key, i))
        return updates, p, s

    monkeypatch.setattr(streaming, "MIN_GROUP_ELEMENTS", 1 << 40)
    whole = run()
    monkeypatch.setattr(streaming, "MIN_GROUP_ELEMENTS", 1536)
    monkeypatch.setattr(streaming, "GROUPS", 1 << 20)
    _assert_bit_equal(run(), whole)


def test_bf16_step_rounds_the_float32_update_with_apply_updates_sr_bits():
    """apply_gradients(key=) on bfloat16 params: per tensor, the float32 step (fused_step_reference's update)
    rounded by `stochastic.stochastic_round_with_seed` with the leaf's seed from `sr_params.leaf_seeds` (the bits
    `apply_updates_sr` draws), and the states of the update path."""
    params = {"a": (jax.random.normal(jax.random.key(0), (64, 256)) * 0.1).astype(jnp.bfloat16),
              "b": jnp.ones((64,), jnp.bfloat16)}
    grads = jax.tree.map(lambda p: (jax.random.normal(jax.random.key(1), p.shape) * 1e-2).astype(p.dtype), params)
    tx = optim.adamw_8bit(1e-3, weight_decay=0.01, min_quantized_size=1024)
    state, key = tx.init(params), jax.random.key(3)
    new_params, new_state = jax.jit(lambda g, s, p, k: optim.apply_gradients(tx, g, s, p, k))(grads, state, params,
                                                                                               key)
    _, update_state = jax.jit(tx.update)(grads, state, params)
    _assert_bit_equal(new_state, update_state)
    seeds = sr_params.leaf_seeds(key, 2)
    config = adam.StateConfig("dynamic_signed_8bit", "dynamic_unsigned_8bit", 256, 1024)
    bc1, bc2_sqrt = optim.adam.bias_corrections(jnp.int32(1), 0.9, 0.999)
    for (name, p), seed in zip(sorted(params.items()), seeds):
        g, mu, nu = grads[name], state.mu[name], state.nu[name]

        @jax.jit
        def expected(p, g, mu, nu):
            p32, _, _ = fused_adam.fused_step_reference(p.astype(jnp.float32), g, mu, nu, config, 0.9, 0.999, 1e-8,
                                                        bc1, bc2_sqrt, jnp.float32(-1e-3), 0.01)
            return stochastic.stochastic_round_with_seed(p32, jnp.bfloat16, seed)

        _assert_bit_equal(new_params[name], expected(p, g, mu, nu))
