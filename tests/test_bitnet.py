"""BitNet b1.58 (`bitnet_b158`): ternary weights x int8 activations on the int8 GEMM, straight-through gradients."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import adamw_losses

import qjax
from qjax import dispatch

DIMS = (((1,), (1,)), ((), ()))  # x (M, K) . w (N, K) -> (M, N)


# BitNet's forward with a high-precision backward: dgrad reads the forward's ternary weight, dequantized
BF16_BACKWARD = dataclasses.replace(qjax.recipe("bitnet_b158"), name="bitnet_b158_bf16_backward", dgrad=None,
                                   wgrad=None)

def _xw(m=128, k=256, n=128):
    x = jax.random.normal(jax.random.key(0), (m, k), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (n, k), jnp.float32) * 0.02
    return x, w


def _formula(x, w):
    """The issue's formula in plain jnp: (int8 codes of x) . (ternary codes of w)^T * x_scale * w_scale."""
    w_scale = jnp.mean(jnp.abs(w))
    w_codes = jnp.clip(jnp.round(w / w_scale), -1, 1)
    x_scale = jnp.max(jnp.abs(x), axis=1, keepdims=True) / 127
    x_codes = jnp.clip(jnp.round(x / x_scale), -127, 127)
    acc = jnp.dot(x_codes, w_codes.T, precision="highest")
    return acc * x_scale * w_scale, w_codes, w_scale


def test_ternary_quantization_is_the_absmean_formula():
    _, w = _xw()
    q = qjax.quantize(w, qjax.QuantSpec("ternary", "tensor"))
    _, codes, scale = _formula(jnp.ones((1, w.shape[1])), w)
    assert q.data.dtype == jnp.int8 and q.scale.dtype == jnp.float32 and q.scale.shape == ()
    assert set(np.unique(np.asarray(q.data))) == {-1, 0, 1}
    np.testing.assert_array_equal(q.scale, scale)
    np.testing.assert_array_equal(q.data, codes)
    zero = qjax.quantize(jnp.zeros((4, 8)), qjax.QuantSpec("ternary", "tensor"))  # all-zero: scale 1, codes 0
    np.testing.assert_array_equal(zero.scale, 1.0)
    np.testing.assert_array_equal(zero.data, 0)


def test_fused_quantize_kernel_matches_the_reference_bit_for_bit():
    """The weight's pair (ternary (N, K) for the forward, ternary (K, N) for dgrad) from the fused kernel."""
    from qjax.kernels import quantize_mgpu
    from qjax.quantize import quantize_pair_reference

    _, w = _xw(k=128)
    w = w.at[5, 7].set(0.5)  # one large weight: most codes 0, a few +-1
    specs = (qjax.QuantSpec("ternary", "tensor"),) * 2
    got = quantize_mgpu.quantize_pair_kernel(w, *specs, interpret=True)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(quantize_pair_reference(w, *specs, None, None))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("mode", ["reference", "interpret"])
def test_forward_equals_the_formula(mode):
    x, w = _xw()
    expected, _, _ = _formula(x, w)
    with dispatch.force(mode):  # interpret: the weight's ternary codes by the reference, the GEMM by the kernel
        out = jax.jit(lambda x, w: qjax.dot_general(x, w, DIMS, recipe="bitnet_b158"))(x, w)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(expected))))


def test_gradients_are_the_forward_functions_with_a_straight_through_weight():
    x, w = _xw()
    cot = jax.random.normal(jax.random.key(2), (x.shape[0], w.shape[0]))

    def grads(recipe):
        loss = lambda x, w: jnp.sum(qjax.dot_general(x, w, DIMS, recipe=recipe) * cot)
        return jax.grad(loss, (0, 1))(x, w)

    dx, dw = grads("bitnet_b158")
    # wgrad: the int8_rowwise weight gradient, bit for bit, as if the forward had not rounded w to {-1, 0, 1}.
    np.testing.assert_array_equal(dw, grads("int8_rowwise")[1])
    # dgrad: the cotangent times the ternary weight the forward multiplied by (int8 rows of the cotangent), as the
    # reference BitLinear's w + (Q(w) - w).detach() gives; not times the float w.
    _, codes, scale = _formula(x, w)
    want = cot @ (codes * scale)
    np.testing.assert_allclose(dx, want, rtol=0, atol=1e-2 * float(jnp.max(jnp.abs(want))))
    assert float(jnp.max(jnp.abs(cot @ w - want))) > 0.1 * float(jnp.max(jnp.abs(want)))  # the test tells them apart
    g_scale = jnp.max(jnp.abs(cot), axis=1, keepdims=True) / 127  # exactly: int8 codes of cot . ternary codes
    g_codes = jnp.clip(jnp.round(cot / g_scale), -127, 127)
    np.testing.assert_allclose(dx, (g_codes @ codes) * g_scale * scale, rtol=1e-5,
                               atol=1e-5 * float(jnp.max(jnp.abs(want))))
    dx, dw = grads(BF16_BACKWARD)
    np.testing.assert_allclose(dw, cot.T @ x, rtol=1e-5, atol=1e-5)  # the exact gradient of x . w^T
    assert float(jnp.max(jnp.abs(dw))) > 0
    # its high-precision dgrad: the float cotangent times the same ternary weight, dequantized (not the float w)
    exact = jnp.dot(cot, codes * scale, precision="highest")
    np.testing.assert_allclose(dx, exact, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(exact))))


def test_bf16_backward_dgrad_reads_the_ternary_weight_in_the_weights_dtype():
    """bf16 operands (3-D x, w as (K, N)): dx = g . (codes * scale), the dequantized weight rounded to bf16 as w."""
    x, w = _xw(m=64, k=128, n=96)
    x, w_kn = x.reshape(4, 16, 128).astype(jnp.bfloat16), w.T.astype(jnp.bfloat16)
    cot = jax.random.normal(jax.random.key(2), (4, 16, 96), jnp.bfloat16)
    dims = (((2,), (0,)), ((), ()))
    loss = lambda x: jnp.sum(qjax.dot_general(x, w_kn, dims, recipe=BF16_BACKWARD).astype(jnp.float32)
                             * cot)
    dx = jax.grad(loss)(x)
    assert dx.dtype == jnp.bfloat16
    _, codes, scale = _formula(x[0], w_kn.T.astype(jnp.float32))
    w_used = (codes * scale).astype(jnp.bfloat16).astype(jnp.float32)  # (N, K)
    want = jnp.einsum("bmn,nk->bmk", cot.astype(jnp.float32), w_used, precision="highest")
    np.testing.assert_allclose(dx.astype(jnp.float32), want, rtol=1e-2, atol=1e-2 * float(jnp.max(jnp.abs(want))))
    far = jnp.einsum("bmn,kn->bmk", cot.astype(jnp.float32), w_kn.astype(jnp.float32), precision="highest")
    assert float(jnp.max(jnp.abs(far - want))) > 0.1 * float(jnp.max(jnp.abs(want)))  # the float w is far off


def test_non_finite_weights_stay_visible():
    x, w = _xw(m=8, k=32, n=16)
    for bad in (jnp.nan, jnp.inf):
        out = qjax.dot_general(x, w.at[3, 5].set(bad), DIMS, recipe="bitnet_b158")
        assert not bool(jnp.any(jnp.isfinite(out))), bad  # one bad weight: the tensor's scale, so every output
    zero = qjax.dot_general(x, jnp.zeros_like(w), DIMS, recipe="bitnet_b158")
    np.testing.assert_array_equal(zero, 0.0)


def test_bad_specs_and_inputs_raise():
    with pytest.raises(ValueError, match="ternary.*one scale per tensor"):
        qjax.QuantSpec("ternary", "row")
    with pytest.raises(ValueError, match="ternary"):
        qjax.QuantSpec("ternary", "tensor", stochastic=True)
    with pytest.raises(ValueError, match="cannot mix int8 and fp8"):
        qjax.GemmSpec(qjax.QuantSpec("e4m3", "row"), qjax.QuantSpec("ternary", "tensor"))
    x, w = _xw(m=8, k=32, n=16)
    with pytest.raises(TypeError, match="quantizes float inputs"):
        qjax.dot_general(x, w.astype(jnp.int32), DIMS, recipe="bitnet_b158")
    assert qjax.formats.get_format(jnp.int8).name == "int8"  # the int8 dtype never means ternary


def test_tiny_llama_trains_with_bitnet():
    config = qjax.models.llama_config("tiny", recipe="bitnet_b158", n_layers=1)
    model = qjax.models.Llama(config)
    tokens = jnp.tile(jnp.arange(32, dtype=jnp.int32) * 7 % 256, (4, 2))  # a repeating sequence to learn
    params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]

    def loss(params, key):
        logits = model.apply({"params": params}, tokens)
        return qjax.models.lm_loss(logits[:, :-1], tokens[:, 1:])

    layer_recipes = qjax.models.layers.layer_recipes(config)
    assert layer_recipes["layers_0/mlp/down_proj"].name == "bitnet_b158" and layer_recipes["lm_head"].name == "bf16"
    losses = adamw_losses(jax.jit(jax.value_and_grad(loss)), params, steps=12, learning_rate=1e-2)
    assert losses[-1] < 0.7 * losses[0], losses


def test_recipe_variants_are_dataclass_replacements():
    r = qjax.recipe("bitnet_b158")
    assert r.fwd.rhs == qjax.QuantSpec("ternary", "tensor") and r.fwd.lhs == qjax.QuantSpec("int8", "row")
    assert r.dgrad == r.fwd and r.wgrad == qjax.recipe("int8_rowwise").wgrad
    assert BF16_BACKWARD.dgrad_reads_forward_weight



@pytest.mark.gpu
def test_compiled_kernels_on_the_gpu():
    """The fused quantize kernel's ternary side and the int8 GEMM, compiled: as the reference and the formula."""
    from qjax.kernels import quantize_mgpu
    from qjax.quantize import quantize_pair_reference

    x, w = _xw(m=2048, k=1536, n=1024)
    specs = (qjax.QuantSpec("ternary", "tensor"),) * 2
    got = jax.jit(lambda w: quantize_mgpu.quantize_pair_kernel(w, *specs))(w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(quantize_pair_reference(w, *specs, None, None))):
        np.testing.assert_array_equal(a, b)
    expected, _, _ = _formula(x, w)
    with dispatch.force("kernel"):
        out = jax.jit(lambda x, w: qjax.dot_general(x, w, DIMS, recipe="bitnet_b158"))(x, w)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(expected))))
    cot = jax.random.normal(jax.random.key(2), out.shape)  # dgrad's int8 x ternary GEMM on the kernel: as the reference
    dx = lambda: jax.jit(jax.grad(lambda x: jnp.sum(qjax.dot_general(x, w, DIMS, recipe="bitnet_b158") * cot)))(x)
    with dispatch.force("kernel"):
        got = dx()
    with dispatch.force("reference"):
        want = dx()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))
