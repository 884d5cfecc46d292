"""Peak memory of the low-bit AdamW step (XLA's CPU memory analysis) and bit-identity of the chunked step.

The step runs one tensor after another and large tensors in chunks (`adam.map_in_sequence`, `adam.in_chunks`), so
its temporaries stay about one chunk's, not all tensors' float32 m and v at once (issue 22; numbers in
benchmarks/NOTES.md, "Optimizer step memory (CPU memory analysis)")."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from qjax import optim
from qjax.optim import adam

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from optim_memory import OPTIMIZERS, llama_param_shapes, step_memory  # noqa: E402


@pytest.fixture(scope="module")
def baseline():
    """optax.adamw's (fp32 state) state + temp bytes per param on one layer of Llama 125m (+ embed, head)."""
    return step_memory(OPTIMIZERS["optax.adamw"](), llama_param_shapes("125m", layers=1))["total"]


@pytest.mark.parametrize("name", ["adamw_8bit", "adamw_4bit", "adamw_fp8", "adamw_fp8_dre"])
def test_low_bit_step_peaks_at_most_half_of_fp32_adamw(name, baseline):
    memory = step_memory(OPTIMIZERS[name](), llama_param_shapes("125m", layers=1))
    assert memory["total"] <= 0.5 * baseline, (memory, baseline)


def test_bf16_sr_8bit_step_under_5_bytes_per_param():
    params = llama_param_shapes("125m", layers=1, dtype=jnp.bfloat16)
    memory = step_memory(OPTIMIZERS["adamw_8bit"](), params, stochastic_rounding=True)
    assert memory["total"] <= 5.0, memory


def _bits(tree):
    return [np.ascontiguousarray(np.atleast_1d(np.asarray(x))).view(np.uint8) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("make", [
    lambda: optim.adamw_8bit(optax.linear_schedule(1e-3, 1e-4, 5), weight_decay=0.1, min_quantized_size=1024,
                             mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)),
    lambda: optim.adamw_4bit(1e-3, weight_decay=0.1, min_quantized_size=1024),
    lambda: optim.adamw_fp8(1e-3, weight_decay=0.1, min_quantized_size=1024),
    lambda: optim.adamw_fp8(1e-3, weight_decay=0.0, dynamic_range_expansion=True, min_quantized_size=1024),
], ids=["8bit", "4bit", "fp8", "fp8_dre"])
def test_chunks_are_bit_identical_to_whole_tensors(make, monkeypatch):
    """Chunks of 1024 elements (embed: 25 chunks; blocks of 256 or 128) give the whole-tensor results bit for bit,
    through update and through apply_gradients."""
    keys = jax.random.split(jax.random.key(0), 6)
    shapes = {"embed": (100, 256), "w": (64, 64), "norm": (64,)}
    params = {n: jax.random.normal(k, s) for k, (n, s) in zip(keys, shapes.items())}
    grads = [{n: jax.random.normal(jax.random.fold_in(k, i), s) for k, (n, s) in zip(keys, shapes.items())}
             for i in range(1)]
    tx = make()

    def run():
        p, s, outs = params, tx.init(params), []
        for g in grads:
            outs.append(jax.jit(tx.update)(g, s, p))
            p, s = jax.jit(lambda g, s, p: optim.apply_gradients(tx, g, s, p))(g, s, p)
        return outs, p, s

    whole = run()
    monkeypatch.setattr(adam, "CHUNK_ELEMENTS", 1024)
    chunked = run()
    assert len(_bits(whole)) == len(_bits(chunked))
    for a, b in zip(_bits(whole), _bits(chunked)):
        np.testing.assert_array_equal(a, b)
