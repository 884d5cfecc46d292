"""ViT: shapes, recipes forward + backward, the high-precision filter, patches, losses, FLOPs, configs."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import adamw_losses, flat, snr_db, used_recipes

import qjax
from qjax import models
from qjax.models.vit import patchify

FAST_COMPILE = {"xla_backend_optimization_level": 0}  # CPU compile time dominates; see test_llama.py

# 8x8x8 images in 4x4 patches: 128 features per patch, widths of 128, mean pooling, so 32 images are 128 tokens and
# block-scaled recipes tile every GEMM. The filter keeps only the head in bf16, so patch_embed is quantized too.
BLOCK_TILED = models.vit_config("tiny", image_size=8, patch_size=4, channels=8, num_classes=10, dim=128, n_layers=1,
                                n_heads=2, mlp_dim=256, pool="mean", keep_high_precision=("head",))
RNG = np.random.default_rng(0)
IMAGES = RNG.normal(size=(32, 8, 8, 8)).astype(np.float32)
LABELS = RNG.integers(0, 10, size=32).astype(np.int32)


def _loss_fn(config):
    model = models.ViT(config)

    def loss(params, key):
        return models.classification_loss(model.apply({"params": params}, IMAGES, rngs={"quant": key}), LABELS)[0]

    return loss


@functools.lru_cache(maxsize=None)
def _value_and_grad(config):
    return jax.jit(jax.value_and_grad(_loss_fn(config)), compiler_options=FAST_COMPILE)


@pytest.fixture(scope="module")
def reference():
    """Params with a random (not zero-initialised) head, so every parameter gets a gradient; f32 loss and grads."""
    init = lambda key: models.ViT(BLOCK_TILED).init(key, IMAGES)["params"]
    params = jax.jit(init, compiler_options=FAST_COMPILE)(jax.random.key(1))
    params["head"]["kernel"] = jnp.asarray(RNG.normal(size=(128, 10)).astype(np.float32) * 0.1)
    loss, grads = _value_and_grad(dataclasses.replace(BLOCK_TILED, compute_dtype="float32"))(
        params, jax.random.key(2))
    return params, loss, grads


# Run numerically for int8 rows and for fp8 blocks with stochastic rounding (CPU compile time is the cost of each
# case); test_llama.py runs every recipe numerically, and test_every_recipe_traces traces them all through the ViT.
@pytest.mark.parametrize("name", ["int8_rowwise", "fp8_blockwise_sr"])
def test_recipes_train_close_to_float32(name, reference):
    params, ref_loss, ref_grads = reference
    recipe = qjax.with_stochastic_gradients(qjax.recipe("fp8_blockwise")) if name.endswith("_sr") else name
    config = dataclasses.replace(BLOCK_TILED, recipe=qjax.recipe(recipe))
    # Traced afresh (the jitted function may come from a cache, and intercepts only see a trace).
    used, _ = used_recipes(jax.eval_shape, jax.value_and_grad(_loss_fn(config)), params, jax.random.key(3))
    loss, grads = _value_and_grad(config)(params, jax.random.key(3))
    assert used == {layer: r.name for layer, r in models.layer_recipes(config).items()}
    assert {layer for layer, r in used.items() if r == "bf16"} == {"head"}  # patch_embed quantized here
    assert all(bool(jnp.all(jnp.isfinite(g))) and bool(jnp.any(g != 0)) for g in jax.tree.leaves(grads))
    assert abs(float(loss) - float(ref_loss)) < 0.02
    assert snr_db(flat(ref_grads), flat(grads)) > (25 if "int8" in name else 17)
    if name == "int8_rowwise":  # and it trains: a few AdamW steps on this batch lower the loss
        losses = adamw_losses(_value_and_grad(config), params, steps=5, learning_rate=3e-3)
        assert losses[-1] < 0.5 * losses[0]
    if config.recipe.needs_key:
        other = _value_and_grad(config)(params, jax.random.key(4))[1]
        assert not np.array_equal(flat(grads), flat(other))


def test_every_recipe_traces():
    """Forward + backward traced (not run) for every recipe: grads match the params, each layer gets its recipe."""
    recipes = [qjax.recipe(n) for n in qjax.RECIPES] + [qjax.with_stochastic_gradients(qjax.recipe("fp8_rowwise"))]
    for recipe in recipes:
        config = dataclasses.replace(BLOCK_TILED, recipe=recipe)
        params = jax.eval_shape(models.ViT(config).init, jax.random.key(0), IMAGES)["params"]
        used, (loss, grads) = used_recipes(jax.eval_shape, jax.value_and_grad(_loss_fn(config)), params,
                                            jax.random.key(1))
        assert used == {layer: r.name for layer, r in models.layer_recipes(config).items()}
        assert len(used) == 6 and used["layers_0/mlp/fc1"] == recipe.name and used["head"] == "bf16"
        assert loss.shape == () and loss.dtype == jnp.float32
        assert jax.tree.map(lambda g: (g.shape, g.dtype), grads) == jax.tree.map(lambda p: (p.shape, p.dtype), params)
    # With a class token, 32 images are 32 x (4 patches + 1) = 160 tokens: a block-scaled wgrad cannot tile them.
    config = dataclasses.replace(BLOCK_TILED, recipe="fp8_blockwise", pool="cls")
    params = jax.eval_shape(models.ViT(config).init, jax.random.key(0), IMAGES)["params"]
    with pytest.raises(ValueError, match="wgrad"):
        jax.eval_shape(jax.value_and_grad(_loss_fn(config)), params, jax.random.key(1))


def test_default_filter_shapes_and_dtypes():
    config = models.vit_config("digits", recipe="int8_rowwise")
    images = jnp.zeros((4, 8, 8, 1))
    used, variables = used_recipes(jax.eval_shape, models.ViT(config).init, jax.random.key(0), images)
    assert {layer for layer, r in used.items() if r == "bf16"} == {"patch_embed", "head"}
    assert used["layers_3/attn/qkv_proj"] == "int8_rowwise" and len(used) == 2 + 4 * config.n_layers
    out = jax.eval_shape(models.ViT(config).apply, variables, images)
    assert out.shape == (4, 10) and out.dtype == jnp.float32
    params = variables["params"]
    assert "cls_token" not in params and params["pos_embed"].shape == (1, 16, 128)
    assert params["patch_embed"]["kernel"].shape == (4, 128)  # 2x2x1 patches
    cls = dataclasses.replace(config, pool="cls", param_dtype="bfloat16")
    params = jax.eval_shape(models.ViT(cls).init, jax.random.key(0), images)["params"]
    assert params["cls_token"].shape == (1, 1, 128) and params["pos_embed"].shape == (1, 17, 128)
    assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(params))


def test_patchify():
    images = RNG.normal(size=(2, 8, 12, 3)).astype(np.float32)
    patches = np.asarray(patchify(jnp.asarray(images), 4))
    assert patches.shape == (2, 2 * 3, 4 * 4 * 3)
    # Row-major patch order; each patch flattened as (row, column, channel).
    np.testing.assert_array_equal(patches[1, 4], images[1, 4:8, 4:8, :].reshape(-1))
    np.testing.assert_array_equal(patches[0, 2], images[0, 0:4, 8:12, :].reshape(-1))


def test_classification_loss_and_flops():
    logits = np.array([[2.0, 0.0, -1.0], [0.0, 3.0, 1.0], [0.5, 0.2, 0.1]], np.float32)
    labels = np.array([0, 2, 1], np.int32)
    loss, accuracy = jax.jit(models.classification_loss)(logits, labels)
    log_probs = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(loss, -log_probs[np.arange(3), labels].mean(), rtol=1e-6)
    assert float(accuracy) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="labels"):
        models.classification_loss(logits, labels[:2])
    with pytest.raises(TypeError, match="int class ids"):
        models.classification_loss(logits, labels.astype(np.float32))

    # ViT-S/16 with a class token is quoted at 4.6 GMACs per 224 px image (timm), i.e. ~9.2 GFLOPs forward; the
    # training count is 3x the forward.
    s16 = models.vit_config("s16", pool="cls")
    assert models.flops_per_example(s16) / 3 == pytest.approx(2 * 4.6e9, rel=0.01)
    # And term by term from the real parameter shapes.
    params = jax.eval_shape(models.ViT(s16).init, jax.random.key(0), jnp.zeros((1, 224, 224, 3)))["params"]
    blocks = sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(params)
                 if "layers_" in str(path) and "kernel" in str(path))
    expected = 6 * (196 * params["patch_embed"]["kernel"].size + 197 * blocks + params["head"]["kernel"].size)
    assert models.flops_per_example(s16) == expected + 12 * 12 * 384 * 197 ** 2


@pytest.mark.parametrize("overrides, match", [
    (dict(patch_size=3), "multiple of patch_size"),
    (dict(n_heads=3), "multiple of n_heads"),
    (dict(pool="max"), "pool must be 'cls' or 'mean'"),
    (dict(channels=0), "channels must be a positive int"),
    (dict(recipe="fp4"), "unknown recipe 'fp4'"),
    (dict(keep_high_precision="head"), "tuple of regexes"),
    (dict(param_dtype="float64"), "param_dtype must be one of"),
    (dict(dropout=0.1), "unknown ViTConfig fields"),
])
def test_bad_configs(overrides, match):
    with pytest.raises(ValueError, match=match):
        models.vit_config("tiny", **overrides)


def test_bad_inputs():
    model = models.ViT(models.vit_config("tiny"))
    with pytest.raises(ValueError, match="unknown ViT size"):
        models.vit_config("b16")
    with pytest.raises(ValueError, match=r"\(batch, 8, 8, 3\)"):
        jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((2, 8, 8, 1)))
    with pytest.raises(ValueError, match="float images"):
        jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((2, 8, 8, 3), jnp.int32))
