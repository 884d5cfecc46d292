"""`Recipe.recompute_weight_codes`: dgrad re-quantizes the weight in the backward instead of saving its 8-bit (K, N)
codes. The recomputed codes are the saved ones (same spec, seed and input), so the gradients are bit-identical (run
eagerly: jit may order the float8 reference GEMMs' sums differently); the saved residuals shrink by the codes (and, with
float32 params, by the bfloat16 cast of the kernel the layer no longer makes); under FSDP the backward gathers the
codes again and the gradients equal one device's.
"""

import dataclasses
import functools
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_on_cpu_devices, snr_db
from jax._src.ad_checkpoint import saved_residuals

import qjax
from qjax import models
from qjax import int8_params

DIMS = (((2,), (0,)), ((), ()))  # x (B, T, K) . a Dense kernel w (K, N)
TINY = models.llama_config("tiny", vocab_size=160, dim=128, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=256,
                           max_seq_len=64)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 128, (3, 64)), jnp.int32)  # 192 tokens: no kernel shape


def _recomputing(name: str) -> qjax.Recipe:
    return dataclasses.replace(qjax.recipe(name), recompute_weight_codes=True)


def _residual_bytes(fn, *args) -> int:
    """Bytes of what fn's vjp saves beyond its arguments (the params themselves cost nothing more)."""
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a, why in saved_residuals(fn, *args)
               if not str(why).startswith("from the argument"))


def test_recipe_validation():
    with pytest.raises(TypeError, match="recompute_weight_codes must be a bool"):
        dataclasses.replace(qjax.recipe("int8_rowwise"), recompute_weight_codes=1)
    with pytest.raises(ValueError, match="recompute_weight_codes=True needs a quantized dgrad"):
        dataclasses.replace(qjax.recipe("bitnet_b158"), dgrad=None, recompute_weight_codes=True)  # dgrad in bf16
    with pytest.raises(ValueError, match="recompute_weight_codes=True needs a quantized dgrad"):
        qjax.Recipe("forward_only", fwd=qjax.recipe("int8_rowwise").fwd, recompute_weight_codes=True)


@pytest.mark.parametrize("name", ["int8_rowwise", "int8_dataflow", "fp8_tensorwise", "fp8_blockwise"])
def test_dot_general_same_gradients_without_the_weight_codes(name):
    x = jax.random.normal(jax.random.key(0), (4, 32, 256), jnp.bfloat16)  # 128 tokens: blockwise tiles
    w = (jax.random.normal(jax.random.key(1), (256, 384)) * 0.05).astype(jnp.bfloat16)
    cot = jax.random.normal(jax.random.key(2), (4, 32, 384), jnp.float32)
    results = {}
    for recipe in (qjax.recipe(name), _recomputing(name)):
        loss = lambda x, w, recipe=recipe: jnp.sum(
            qjax.dot_general(x, w, DIMS, recipe=recipe, key=jax.random.key(3)).astype(jnp.float32) * cot)
        # eager: under jit XLA may fuse the float8 reference GEMMs' sums in another order on either side
        results[recipe.recompute_weight_codes] = (jax.grad(loss, argnums=(0, 1))(x, w), _residual_bytes(loss, x, w))
    (saved_grads, saved_bytes), (grads, recomputed_bytes) = results[False], results[True]
    for got, want in zip(grads, saved_grads):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert saved_bytes - recomputed_bytes >= w.size  # the (K, N) codes, one byte each, plus their scales


def test_int8_weight_only_param_keeps_its_codes_saved():
    """An int8 weight-only param reaches the GEMM dequantized (a forward that does not read its stored codes): that
    copy is not the param, so the layer saves the weight's 8-bit codes as without the flag, never the bf16 copy."""
    kernel = int8_params.quantize_int8_param(jax.random.normal(jax.random.key(1), (256, 384)) * 0.05)
    x = jax.random.normal(jax.random.key(0), (4, 32, 256), jnp.bfloat16)
    saved = {}
    for recipe in (qjax.recipe("fp8_tensorwise"), _recomputing("fp8_tensorwise")):
        layer = nn.Dense(384, use_bias=False, dtype=jnp.bfloat16, promote_dtype=int8_params.promote_dtype,
                         dot_general_cls=functools.partial(qjax.DotGeneral, recipe=recipe))
        loss = lambda x, layer=layer: layer.apply({"params": {"kernel": kernel}}, x).astype(jnp.float32).sum()
        saved[recipe.recompute_weight_codes] = sorted((a.shape, str(a.dtype)) for a, _ in saved_residuals(loss, x))
    assert saved[True] == saved[False]
    assert ((384, 256), "float8_e4m3fn") in saved[True] or ((256, 384), "float8_e4m3fn") in saved[True], saved[True]


def test_kernel_path_with_a_float32_weight():
    """The kernels (Mosaic GPU interpreter) on a float32 weight beside bf16 activations: its forward codes from one
    layout, dgrad's re-quantized in the backward, a float32 wgrad output; equal to the XLA path bit for bit."""
    x = jax.random.normal(jax.random.key(0), (1, 128, 256), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (256, 128), jnp.float32) * 0.05
    cot = jax.random.normal(jax.random.key(2), (1, 128, 128), jnp.float32)
    grads = []
    for backend in ("xla", "pallas"):
        recipe = dataclasses.replace(_recomputing("int8_rowwise"), backend=backend)
        loss = lambda x, w, recipe=recipe: jnp.sum(qjax.dot_general(
            x, w, DIMS, recipe=recipe, preferred_element_type=jnp.bfloat16).astype(jnp.float32) * cot)
        grads.append(jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w))
    assert grads[1][0].dtype == jnp.bfloat16 and grads[1][1].dtype == jnp.float32
    for got, want in zip(*grads):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("name", ["int8_rowwise", "int8_dataflow"])
def test_llama_bf16_params_bit_identical_with_less_saved(name):
    """bf16 params: the layers' kernels enter the custom VJPs as the params (no cast), so the gradients are bit for
    bit those of the saving recipe and the residuals lose every projection's codes."""
    results = {}
    for recipe in (qjax.recipe(name), _recomputing(name)):
        model = models.Llama(dataclasses.replace(TINY, recipe=recipe, param_dtype="bfloat16"))
        params = model.init(jax.random.key(1), TOKENS)["params"]
        loss = lambda p, key, model=model: models.lm_loss(
            model.apply({"params": p}, TOKENS, rngs={"quant": key})[:, :-1], TOKENS[:, 1:])
        results[recipe.recompute_weight_codes] = (jax.jit(jax.value_and_grad(loss))(params, jax.random.key(5)),
                                                 _residual_bytes(loss, params, jax.random.key(5)))
    ((loss0, grads0), bytes0), ((loss1, grads1), bytes1) = results[False], results[True]
    assert float(loss0) == float(loss1)
    for a, b in zip(jax.tree.leaves(grads0), jax.tree.leaves(grads1)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    per_layer = sum(k * n for k, n in TINY.projections().values()) - TINY.dim * TINY.vocab_size  # not the bf16 head
    assert bytes0 - bytes1 >= per_layer, (bytes0, bytes1, per_layer)


def test_llama_float32_params_saves_neither_codes_nor_a_cast():
    """float32 params: the kernel reaches the GEMM uncast (quantized from float32: one rounding where the saving
    recipe rounds to bf16 first), so the residuals hold no kernel-shaped array; gradients stay float32 and close."""
    results = {}
    for recipe in (qjax.recipe("int8_dataflow"), _recomputing("int8_dataflow")):
        model = models.Llama(dataclasses.replace(TINY, recipe=recipe))
        params = model.init(jax.random.key(1), TOKENS)["params"]
        loss = lambda p, key, model=model: models.lm_loss(
            model.apply({"params": p}, TOKENS, rngs={"quant": key})[:, :-1], TOKENS[:, 1:])
        logits = model.apply({"params": params}, TOKENS, rngs={"quant": jax.random.key(5)})
        saved = saved_residuals(loss, params, jax.random.key(5))
        results[recipe.recompute_weight_codes] = (jax.jit(jax.value_and_grad(loss))(params, jax.random.key(5)),
                                                 saved, logits.dtype)
    ((loss0, grads0), _, dtype0), ((loss1, grads1), saved, dtype1) = results[False], results[True]
    assert dtype0 == dtype1
    np.testing.assert_allclose(float(loss1), float(loss0), rtol=1e-3)
    kernel_shapes = {shape for name, (k, n) in TINY.projections().items() if name != "lm_head"
                     for shape in ((k, n), (n, k))}  # either layout; the bf16 head keeps its own
    held = [(a.shape, a.dtype) for a, why in saved if not str(why).startswith("from the argument")
            and tuple(a.shape) in kernel_shapes]
    assert not held, held
    for a, b in zip(jax.tree.leaves(grads0), jax.tree.leaves(grads1)):
        assert b.dtype == jnp.float32 and snr_db(np.asarray(a), np.asarray(b)) > 20


FSDP_SCRIPT = textwrap.dedent("""
    import dataclasses
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import qjax
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    x = jax.random.normal(jax.random.key(0), (8, 16, 64), jnp.float32)
    cot = jax.random.normal(jax.random.key(2), (8, 16, 96), jnp.float32)
    recipe = dataclasses.replace(qjax.recipe("int8_rowwise"), recompute_weight_codes=True)
    for fsdp_dim, spec in (("k", P("fsdp", None)), ("n", P(None, "fsdp"))):
        w = jax.random.normal(jax.random.key(1), (64, 96), jnp.float32) * 0.05
        sharding = qjax.WeightSharding(("fsdp",), fsdp="fsdp", fsdp_dim=fsdp_dim)
        loss = lambda x, w, sharding: jnp.sum(qjax.dot_general(x, w, (((2,), (0,)), ((), ())), recipe=recipe,
                                                               sharding=sharding) * cot)
        grad = jax.value_and_grad(loss, argnums=(0, 1))

        def on_mesh(x, w):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return grad(x, w, sharding)

        ref = jax.jit(grad, static_argnums=2)(x, w, None)
        got = jax.jit(on_mesh, in_shardings=(NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, spec)))(x, w)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
            a, b = np.asarray(a), np.asarray(b)
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())
        print(fsdp_dim, "ok")
""")


def test_fsdp_gathers_the_recomputed_codes_and_matches_one_device():
    stdout = run_on_cpu_devices(FSDP_SCRIPT, 4)
    assert stdout.split() == ["k", "ok", "n", "ok"], stdout
