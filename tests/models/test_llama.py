"""Llama: shapes, every recipe forward + backward, the high-precision filter, causality, GQA, RoPE, training."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import adamw_losses, flat, snr_db, used_recipes

import qjax
from qjax import models
from qjax.models.llama import apply_rope

# XLA's CPU backend spends most of a test's time compiling; -O0 halves that and the tiny models still run fast.
FAST_COMPILE = {"xla_backend_optimization_level": 0}

# Widths that are multiples of 128 so block-scaled recipes quantize q/o/gate/up/down, while k/v (one KV head of 64)
# cannot be tiled and fall back to bf16; 2 x 64 = 128 tokens, so wgrad tiles over the tokens too.
BLOCK_TILED = models.llama_config("tiny", vocab_size=128, dim=128, n_layers=1, n_heads=2, n_kv_heads=1,
                                  ffn_dim=256, max_seq_len=64)
TOKENS = jax.random.randint(jax.random.key(0), (2, 64), 0, 128)
SR_INT8 = qjax.with_stochastic_gradients(qjax.recipe("int8_rowwise"))


def _loss_fn(config, tokens=TOKENS):
    model = models.Llama(config)

    def loss(params, key):
        logits = model.apply({"params": params}, tokens, rngs={"quant": key})
        return models.lm_loss(logits[:, :-1], tokens[:, 1:])

    return loss


@functools.lru_cache(maxsize=None)
def _value_and_grad(config):
    """Jitted (params, quant key) -> (loss, grads) on TOKENS, cached so tests sharing a config compile it once."""
    return jax.jit(jax.value_and_grad(_loss_fn(config)), compiler_options=FAST_COMPILE)


def _init(config, tokens, seed=1):
    """Parameters from a jitted init (eager init compiles every initializer op separately: slow on CPU)."""
    init = lambda key: models.Llama(config).init(key, tokens)["params"]
    return jax.jit(init, compiler_options=FAST_COMPILE)(jax.random.key(seed))


def _random_params(config, tokens, seed=1):
    """Random parameters of the right shapes without compiling init (for tests of structural properties)."""
    shapes = jax.eval_shape(models.Llama(config).init, jax.random.key(0), tokens)["params"]
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(0, 0.1, s.shape), s.dtype), shapes)


@pytest.fixture(scope="module")
def reference():
    """The bf16 baseline (bf16 compute, no quantization): the loss and gradients each recipe is compared with."""
    params = _init(BLOCK_TILED, TOKENS)
    loss, grads = _value_and_grad(dataclasses.replace(BLOCK_TILED, recipe=qjax.recipe("bf16")))(
        params, jax.random.key(2))
    return params, loss, grads


# BitNet's ternary weights make another model, not an approximation of the bf16 one (tests/test_bitnet.py).
@pytest.mark.parametrize("name", [n for n in qjax.RECIPES if not n.startswith("bitnet")] + ["int8_rowwise_sr"])
def test_every_recipe_trains_close_to_bf16(name, reference):
    params, ref_loss, ref_grads = reference
    recipe = SR_INT8 if name == "int8_rowwise_sr" else qjax.recipe(name)
    config = dataclasses.replace(BLOCK_TILED, recipe=recipe)
    # Traced afresh (the jitted step may come from a cache, and intercepts only see a trace).
    used, _ = used_recipes(jax.eval_shape, jax.value_and_grad(_loss_fn(config)), params, jax.random.key(3))
    step = _value_and_grad(config)
    loss, grads = step(params, jax.random.key(3))

    # Each layer ran the recipe the filter promises: the LM head in bf16, every other layer quantized (the fused
    # 128 -> 128 + 2 * 64 qkv projection tiles by 128 where separate 64-wide k/v projections would not).
    assert used == {layer: r.name for layer, r in models.layer_recipes(config).items()}
    expected_bf16 = set(used) if name == "bf16" else {"lm_head"}
    assert len(used) == 5 and {layer for layer, r in used.items() if r == "bf16"} == expected_bf16

    assert jax.tree.structure(grads) == jax.tree.structure(params)
    assert all(g.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(g))) and bool(jnp.any(g != 0))
               for g in jax.tree.leaves(grads))
    assert abs(float(loss) - float(ref_loss)) < 0.01
    # Quantized gradients stay close to the bf16 run's: int8 GEMMs above 20 dB and fp8 ones at 17 dB or more, the
    # accuracy targets single GEMMs meet (tests/test_dot_general.py). (For "bf16" itself: the same computation.)
    assert snr_db(flat(ref_grads), flat(grads)) > (25 if "fp8" not in name else 17)
    if name == "int8_rowwise":  # and it trains: a few AdamW steps on this batch lower the loss
        losses = adamw_losses(step, params, steps=8, learning_rate=1e-2)
        assert losses[0] == pytest.approx(np.log(BLOCK_TILED.vocab_size), abs=0.1)  # small init: uniform predictions
        assert losses[-1] < 0.8 * losses[0]
    if recipe.needs_key:  # stochastic rounding: the same key gives the same gradients, another key others
        same = step(params, jax.random.key(3))[1]
        other = step(params, jax.random.key(4))[1]
        np.testing.assert_array_equal(flat(grads), flat(same))
        assert not np.array_equal(flat(grads), flat(other))


def test_block_recipe_needs_token_count_multiple_of_128():
    config = dataclasses.replace(BLOCK_TILED, recipe="fp8_blockwise")
    tokens = TOKENS[:, :48]  # 96 tokens: wgrad contracts over them and cannot tile
    params = jax.eval_shape(models.Llama(config).init, jax.random.key(1), tokens)["params"]
    with pytest.raises(ValueError, match="wgrad"):
        jax.eval_shape(jax.grad(_loss_fn(config, tokens)), params, jax.random.key(2))


def test_shapes_dtypes_and_parameter_names():
    config = models.llama_config("tiny", param_dtype="bfloat16")
    model = models.Llama(config)
    tokens = jnp.zeros((3, 10), jnp.int32)
    variables = jax.eval_shape(model.init, jax.random.key(0), tokens)
    params = variables["params"]
    assert jax.eval_shape(model.apply, variables, tokens).shape == (3, 10, config.vocab_size)
    assert jax.eval_shape(model.apply, variables, tokens).dtype == jnp.float32
    assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(params))
    assert params["layers_1"]["attn"]["qkv_proj"]["kernel"].shape == (64, 64 + 2 * 2 * 16)  # q, 2 KV heads of 16
    assert params["layers_1"]["mlp"]["gate_up_proj"]["kernel"].shape == (64, 2 * 128)
    assert params["layers_0"]["mlp"]["down_proj"]["kernel"].shape == (128, 64)
    assert params["lm_head"]["kernel"].shape == (64, 256)
    # Every projection the config lists exists with its (features_in, features_out) as the kernel shape.
    for layer, shape in config.projections().items():
        node = params
        for part in layer.split("/"):
            node = node[part]
        assert node["kernel"].shape == shape


def test_filter_and_tied_head():
    tokens = jnp.zeros((1, 8), jnp.int32)
    for tie in (False, True):
        for keep, head in ((("lm_head",), "bf16"), ((), "int8_rowwise"), ((r"layers_\d+/mlp",), "int8_rowwise")):
            config = models.llama_config("tiny", recipe="int8_rowwise", tie_embeddings=tie, keep_high_precision=keep)
            model = models.Llama(config)
            used, variables = used_recipes(jax.eval_shape, model.init, jax.random.key(0), tokens)
            assert used["lm_head"] == head
            mlp = "bf16" if keep and "mlp" in keep[0] else "int8_rowwise"
            assert used["layers_1/mlp/gate_up_proj"] == mlp and used["layers_1/attn/qkv_proj"] == "int8_rowwise"
            assert ("lm_head" in variables["params"]) == (not tie)
    # Every tiny projection has 64 features on one side: min_features=64 quantizes them, 65 keeps them in bf16.
    bf16_layers = lambda n: {name for name, r in models.layer_recipes(
        models.llama_config("tiny", recipe="int8_rowwise", min_features=n)).items() if r.name == "bf16"}
    assert bf16_layers(64) == {"lm_head"} and len(bf16_layers(65)) == 1 + 4 * 2


def test_tied_embeddings_share_the_parameter():
    config = models.llama_config("tiny", n_layers=1, tie_embeddings=True, compute_dtype="float32")
    model = models.Llama(config)
    tokens = jnp.array([[1, 2, 3, 4, 5, 6]])  # token 200 never appears in the input
    params = _random_params(config, tokens)
    untied = jax.eval_shape(models.Llama(dataclasses.replace(config, tie_embeddings=False)).init,
                            jax.random.key(0), tokens)
    assert models.num_params(untied) - models.num_params(params) == 256 * 64
    apply = jax.jit(lambda p: model.apply({"params": p}, tokens), compiler_options=FAST_COMPILE)
    before = apply(params)
    bumped = jax.tree.map(lambda x: x, params)
    bumped["embed"]["embedding"] = params["embed"]["embedding"].at[200].add(1.0)
    after = apply(bumped)
    # Row 200 reaches the output only through the head: exactly logit column 200 changes, everywhere.
    changed = np.any(np.asarray(before != after), axis=(0, 1))
    assert changed[200] and changed.sum() == 1


def test_causal_gqa_and_remat():
    """Changing token t leaves the logits before t unchanged; GQA equals MHA with each KV head repeated."""
    gqa = models.llama_config("tiny", n_layers=1, compute_dtype="float32")
    tokens = jax.random.randint(jax.random.key(0), (1, 12), 0, 256)
    pair = jnp.concatenate([tokens, tokens.at[0, 7].set((tokens[0, 7] + 1) % 256)])
    params = _random_params(gqa, tokens)
    run = lambda c, p: jax.jit(models.Llama(c).apply, compiler_options=FAST_COMPILE)({"params": p}, pair)
    logits = run(gqa, params)
    np.testing.assert_array_equal(logits[0, :7], logits[1, :7])
    assert np.any(logits[0, 7] != logits[1, 7])

    mha = dataclasses.replace(gqa, n_kv_heads=4)
    group = gqa.n_heads // gqa.n_kv_heads  # query head h reads KV head h // group

    def repeat_kv(path, x):
        if "qkv_proj" not in [getattr(p, "key", None) for p in path]:
            return x
        q, k, v = jnp.split(x, [gqa.dim, gqa.dim + gqa.n_kv_heads * gqa.head_dim], axis=-1)
        repeat = lambda y: jnp.repeat(y.reshape(gqa.dim, gqa.n_kv_heads, gqa.head_dim), group, axis=1)
        return jnp.concatenate([q, repeat(k).reshape(gqa.dim, -1), repeat(v).reshape(gqa.dim, -1)], axis=-1)

    mha_params = jax.tree_util.tree_map_with_path(repeat_kv, params)
    assert mha_params["layers_0"]["attn"]["qkv_proj"]["kernel"].shape == (64, 3 * 64)
    np.testing.assert_allclose(logits, run(mha, mha_params), atol=1e-5, rtol=1e-5)

    # remat wraps each block in jax.checkpoint and keeps the parameter names (checkpoints stay loadable).
    remat = dataclasses.replace(gqa, remat=True)
    remats = lambda c: [e.primitive.name for e in jax.make_jaxpr(
        lambda p: models.Llama(c).apply({"params": p}, tokens))(params).jaxpr.eqns].count("remat2")
    assert remats(remat) == remat.n_layers and remats(gqa) == 0
    # recompute_attention remats each attention; under remat it adds none inside the block's (counted at any depth)
    nested = lambda c: str(jax.make_jaxpr(lambda p: models.Llama(c).apply({"params": p}, tokens))(params)).count(
        "remat2")
    assert nested(dataclasses.replace(gqa, recompute_attention=True)) == gqa.n_layers
    assert nested(dataclasses.replace(remat, recompute_attention=True)) == nested(remat) == remat.n_layers
    assert jax.tree.structure(jax.eval_shape(models.Llama(remat).init, jax.random.key(1), tokens)["params"]) == \
        jax.tree.structure(params)


def test_rope():
    head_dim, theta = 8, 10000.0
    positions = jnp.array([3, 1, 40, 38, 0, 5, 17, 22, 2])
    x = np.random.default_rng(0).normal(size=(2, 1, 1, head_dim)).astype(np.float32).repeat(len(positions), axis=1)
    rotated = np.asarray(jax.jit(lambda x: apply_rope(x, positions, theta=theta))(x))[:, :, 0]  # (q|k, pos, dim)
    q, k = {int(p): v for p, v in zip(positions, rotated[0])}, {int(p): v for p, v in zip(positions, rotated[1])}
    score = lambda m, n: float(np.dot(q[m], k[n]))
    # Relative positions: the score depends on m - n only, and the rotation keeps norms.
    np.testing.assert_allclose(score(3, 1), score(40, 38), rtol=1e-4)
    np.testing.assert_allclose(score(0, 5), score(17, 22), rtol=1e-4)
    assert abs(score(3, 1) - score(3, 2)) > 1e-3
    np.testing.assert_allclose(np.linalg.norm(rotated, axis=-1), np.linalg.norm(x[:, :, 0], axis=-1), rtol=1e-5)
    # Half rotation: pair i is (x[i], x[i + head_dim/2]), rotated by position * theta^(-2i/head_dim).
    x0 = np.asarray(x[0, 0, 0], np.float64)
    angle = 5 * theta ** (-2 * np.arange(4) / head_dim)
    expected = np.concatenate([x0[:4] * np.cos(angle) - x0[4:] * np.sin(angle),
                               x0[4:] * np.cos(angle) + x0[:4] * np.sin(angle)])
    np.testing.assert_allclose(q[5], expected, rtol=1e-5, atol=1e-6)
    assert jax.eval_shape(lambda x: apply_rope(x, positions, theta=theta), x.astype(jnp.bfloat16)).dtype == \
        jnp.bfloat16


def test_lm_loss_num_params_and_flops():
    logits = np.random.default_rng(0).normal(size=(2, 3, 5)).astype(np.float32)
    targets = np.array([[0, 4, 2], [1, 1, 3]], np.int32)
    log_probs = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    expected = -np.mean(np.take_along_axis(log_probs, targets[..., None], axis=-1))
    lm_loss = jax.jit(models.lm_loss)
    np.testing.assert_allclose(lm_loss(logits, targets), expected, rtol=1e-6)
    logits[0, 0, 0] = np.nan
    assert np.isnan(lm_loss(logits, targets))  # NaN stays visible
    with pytest.raises(ValueError, match="targets"):
        models.lm_loss(logits, targets[:, :2])
    with pytest.raises(TypeError, match="int token ids"):
        models.lm_loss(logits, targets.astype(jnp.float32))

    # The "1b" preset is the TinyLlama-1.1B shape, whose Hugging Face checkpoint holds 1,100,048,384 parameters.
    config = models.llama_config("1b")
    params = jax.eval_shape(models.Llama(config).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    assert models.num_params(params) == 1_100_048_384
    # flops: 6 x every GEMM weight (all kernels; the embedding table is a lookup) + 12 L d T attention.
    n_matmul = sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(params) if "kernel" in str(path))
    assert models.flops_per_token(config, 2048) == 6 * n_matmul + 12 * 22 * 2048 * 2048
    tied = dataclasses.replace(config, tie_embeddings=True)
    assert models.flops_per_token(tied, 2048) == models.flops_per_token(config, 2048)  # the head GEMM still runs
    with pytest.raises(ValueError, match="seq_len"):
        models.flops_per_token(config, 0)
    # "350m", GPT-2-medium sized: 24 blocks of 4 x 1024^2 (attention) + 3 x 1024 x 2816 (SwiGLU) + two norm scales,
    # with the 16k BPE vocabulary of the convergence corpus in and out
    medium = models.llama_config("350m", vocab_size=16384)
    params = jax.eval_shape(models.Llama(medium).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    assert models.num_params(params) == 24 * (4 * 1024**2 + 3 * 1024 * 2816 + 2 * 1024) + 1024 + 2 * 16384 * 1024


@pytest.mark.parametrize("overrides, match", [
    (dict(dim=66), "multiple of n_heads"),
    (dict(n_kv_heads=3), "multiple of n_kv_heads"),
    (dict(dim=12, n_heads=4, n_kv_heads=4), "even for RoPE"),
    (dict(n_layers=0), "n_layers must be a positive int"),
    (dict(vocab_size=2.5), "vocab_size must be a positive int"),
    (dict(recipe="int4"), "unknown recipe 'int4'"),
    (dict(keep_high_precision="lm_head"), "tuple of regexes"),
    (dict(keep_high_precision=("lm_head[",)), "not a valid regex"),
    (dict(compute_dtype="fp8"), "compute_dtype must be one of"),
    (dict(min_features=-1), "min_features"),
    (dict(attention="flash"), "attention must be one of"),
    (dict(norm_eps=0.0), "norm_eps"),
    (dict(n_experts=8), "unknown LlamaConfig fields"),
    (dict(smooth_swiglu=True, moe=models.MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=64)), "dense MLPs only"),
])
def test_bad_configs(overrides, match):
    with pytest.raises(ValueError, match=match):
        models.llama_config("tiny", **overrides)


def test_bad_inputs():
    model = models.Llama(models.llama_config("tiny"))
    with pytest.raises(ValueError, match="unknown Llama size"):
        models.llama_config("7b")
    with pytest.raises(ValueError, match="int tokens"):
        jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((2, 8), jnp.float32))
    with pytest.raises(ValueError, match="max_seq_len 128"):
        jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 129), jnp.int32))
    assert models.llama_config("tiny", keep_high_precision=["lm_head"]).keep_high_precision == ("lm_head",)


def test_attention_auto_picks_cudnn_only_where_it_takes_the_case(monkeypatch):
    """On a GPU, "auto" attention is cuDNN's for even sequences and XLA's for odd causal ones (cuDNN rejected one),
    and for head dims it cannot take."""
    from qjax.models import layers
    monkeypatch.setattr(layers.jax, "default_backend", lambda: "gpu")
    config = models.llama_config("tiny")
    assert layers.attention_implementation(config, 16, 64) == "cudnn"
    assert layers.attention_implementation(config, 16, 63) == "xla"
    assert layers.attention_implementation(config, 16, 63, is_causal=False) == "cudnn"  # e.g. ViT's 197 tokens
    assert layers.attention_implementation(config, 12, 64) == "xla"
