"""generate: the KV cache against the full forward, sampling, end tokens, and quantized inference's logits."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import INT8_DATAFLOW_SR, snr_db

import qjax
from qjax import models
from qjax.models.generate import _filter_logits

# XLA's CPU backend spends most of a test's time compiling; -O0 halves that and the tiny model still runs fast.
FAST_COMPILE = {"xla_backend_optimization_level": 0}
CONFIG = models.llama_config("tiny", vocab_size=96, max_seq_len=48, compute_dtype="float32")
PROMPT = jax.random.randint(jax.random.key(1), (3, 7), 0, 96)


@pytest.fixture(autouse=True)
def _float32_gemms():
    """On a GPU float32 GEMMs would run in TF32, and the cached and full forwards differ by more than its rounding."""
    with jax.default_matmul_precision("highest"):
        yield


def _params(config=CONFIG, std=0.3):
    """Random weights large enough that the logits are far from uniform (a 0.02-std init gives near-ties)."""
    params = models.Llama(config).init(jax.random.key(0), PROMPT)["params"]
    return jax.tree.map(lambda x: jax.random.normal(jax.random.key(x.size), x.shape) * std
                        if x.ndim == 2 else x, params)


PARAMS = _params()


@functools.cache
def _greedy(steps=12):
    return np.asarray(models.generate(CONFIG, PARAMS, PROMPT, max_new_tokens=steps))


def test_greedy_equals_full_forward_argmax_loop():
    """Each new token is the argmax of the full (no cache) forward over the prompt and the tokens before it."""
    new = models.generate(CONFIG, PARAMS, PROMPT, max_new_tokens=12)
    assert new.shape == (3, 12) and new.dtype == jnp.int32
    apply = jax.jit(models.Llama(CONFIG).apply, compiler_options=FAST_COMPILE)
    p = PROMPT.shape[1]
    tokens = jnp.concatenate([PROMPT, jnp.zeros((3, 12), PROMPT.dtype)], axis=1)  # causal: the zeros are unseen
    for i in range(12):
        next_token = jnp.argmax(apply({"params": PARAMS}, tokens)[:, p + i - 1], axis=-1)
        tokens = tokens.at[:, p + i].set(next_token)
    np.testing.assert_array_equal(new, tokens[:, p:])
    assert len(np.unique(np.asarray(new))) > 3  # not one repeated token: the test would prove little


def test_cached_logits_equal_full_forward():
    """Prefill 5 tokens, then feed 3 one by one: each step's logits equal the full forward's at that position."""
    model = models.Llama(dataclasses.replace(CONFIG, max_seq_len=8))
    apply = jax.jit(functools.partial(model.apply, mutable=["cache"]), compiler_options=FAST_COMPILE)
    tokens = jnp.concatenate([PROMPT, PROMPT[:, :1]], axis=1)  # (3, 8)
    full = jax.jit(model.apply, compiler_options=FAST_COMPILE)({"params": PARAMS}, tokens)
    logits, state = apply({"params": PARAMS}, tokens[:, :5])
    steps = [logits]
    for t in range(5, 8):
        logits, state = apply({"params": PARAMS, **state}, tokens[:, t:t + 1])
        steps.append(logits)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=1e-5, atol=1e-5)


def test_sampling_reproducible():
    sample = lambda key, **kw: np.asarray(models.generate(CONFIG, PARAMS, PROMPT, 12, temperature=1.0,
                                                          key=jax.random.key(key), **kw))
    np.testing.assert_array_equal(sample(3), sample(3))
    assert (sample(3) != sample(4)).any()
    assert (sample(3) != _greedy()).any()
    np.testing.assert_array_equal(sample(5, top_k=1), _greedy())


def test_filter_logits_keeps_top_k_and_nucleus():
    logits = jnp.log(jnp.array([[0.5, 0.05, 0.3, 0.15]]))
    keep = lambda **kw: np.isfinite(np.asarray(_filter_logits(logits, kw.get("k"), kw.get("p"))))[0]
    np.testing.assert_array_equal(keep(k=2), [True, False, True, False])
    np.testing.assert_array_equal(keep(p=0.75), [True, False, True, False])   # 0.5 + 0.3 reaches 0.75
    np.testing.assert_array_equal(keep(p=0.81), [True, False, True, True])
    np.testing.assert_array_equal(keep(p=0.5), [True, False, False, False])


def test_eos_stops_rows():
    greedy = _greedy()
    eos = int(greedy[0, 3])
    new = np.asarray(models.generate(CONFIG, PARAMS, PROMPT, 12, eos_token=eos))
    for row, ref in zip(new, greedy):
        hits = np.flatnonzero(ref == eos)
        stop = hits[0] if hits.size else 12
        np.testing.assert_array_equal(row[:stop + 1], ref[:stop + 1])
        assert (row[stop:] == eos).all()


@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": 60}, "exceeds config.max_seq_len"),
    ({"temperature": 0.5}, "needs key"),
    ({"top_k": 0, "temperature": 1.0, "key": jax.random.key(0)}, "top_k"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
])
def test_bad_arguments_raise(kwargs, message):
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        models.generate(CONFIG, PARAMS, PROMPT, **kwargs)


# SNR of the logits of quantized inference against bf16 inference (same weights; the tiny 64-wide model, random
# weights of std 1/sqrt(dim)). The CPU measures int8 rowwise 30.0 dB, fp8 rowwise 18.5 dB, int8 weight-only 32.6 dB.
SNR_CONFIG = dataclasses.replace(CONFIG, compute_dtype="bfloat16", keep_high_precision=())


@functools.cache
def _snr_weights_and_bf16_logits():
    weights = _params(std=CONFIG.dim ** -0.5)  # the scale of a trained model's weights
    return weights, jax.jit(models.Llama(SNR_CONFIG).apply, compiler_options=FAST_COMPILE)({"params": weights}, PROMPT)


@pytest.mark.parametrize("recipe, min_snr", [("int8_rowwise", 26), ("fp8_rowwise", 15), ("int8_weights", 28)])
def test_quantized_inference_logits_snr(recipe, min_snr):
    weights, bf16 = _snr_weights_and_bf16_logits()
    config, params = SNR_CONFIG, weights
    if recipe == "int8_weights":
        params = models.dequantize_weights(models.int8_weights(weights), jnp.float32)
    else:
        config = dataclasses.replace(config, recipe=recipe)
    quantized = jax.jit(models.Llama(config).apply, compiler_options=FAST_COMPILE)({"params": params}, PROMPT)
    snr = snr_db(bf16, quantized)
    assert min_snr <= snr < 100, snr  # < 100: the recipe really quantized


def test_int8_weight_only_generate():
    """int8_weights keeps int8 codes and generate dequantizes them: the same tokens as the dequantized params."""
    q = models.int8_weights(PARAMS)
    kernel = q["layers_0"]["attn"]["qkv_proj"]["kernel"]
    assert isinstance(kernel, qjax.int8_params.Int8Param) and kernel.data.dtype == jnp.int8
    assert kernel.data.shape == PARAMS["layers_0"]["attn"]["qkv_proj"]["kernel"].shape
    dequantized = models.dequantize_weights(q, jnp.float32)
    np.testing.assert_array_equal(models.generate(CONFIG, q, PROMPT, 8),
                                  models.generate(CONFIG, dequantized, PROMPT, 8))


def test_generate_runs_recipes_that_round_stochastically():
    """int8_dataflow with Jetfire's stochastic gradients asks for a "quant" key; its forward is int8_rowwise's."""
    config = models.llama_config("tiny", recipe="int8_rowwise")
    prompt = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
    params = models.Llama(config).init(jax.random.key(0), prompt)["params"]
    flow = models.generate(dataclasses.replace(config, recipe=INT8_DATAFLOW_SR), params, prompt, max_new_tokens=4)
    np.testing.assert_array_equal(flow, models.generate(config, params, prompt, max_new_tokens=4))
