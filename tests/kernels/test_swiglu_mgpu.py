"""The fused SwiGLU kernels (qjax.kernels.swiglu_mgpu) against the composition they replace: `ops.SWIGLU`'s
forward with `prologue.save`, and `prologue.restore` with SwiGLU's backward.

Off a Hopper GPU the kernels run under the Mosaic GPU interpreter and must equal the jitted references bit for bit
(codes as raw bytes, scales as f32 bits, h and d(gate_up) as bf16 bits; NaN only as NaN, whose sign bit is a
backend choice). On a GPU (marked tests, the 1.1B Llama's 16384 x 2 * 5632) the compiled kernels are compared with
XLA:GPU's references: codes and scales exact, h and d(gate_up) to a few bf16 ulps (exp may differ by an ulp, and
XLA may evaluate the reference's bf16 steps with excess precision). The `lowers` test runs the Mosaic GPU lowering
(register layouts, group reductions) for sm_90 on any host.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mosaic_gpu_kernel_texts

from qjax import dispatch, formats, models, numerics, prologue
from qjax.dispatch import on_hopper_gpu
from qjax.kernels import swiglu_mgpu
from qjax.models import ops
from qjax.qtensor import QuantSpec

# (format, group): int8_dataflow's and fp8_dataflow's saved copies, and e5m2 with power-of-two scales.
RECIPES = [(QuantSpec("int8", "row"), 32), (QuantSpec("e4m3", "row"), 16), (QuantSpec("e5m2", "row", pow2_scale=True),
                                                                            32)]
_TIES = {"int8": [0.5, 1.5, 2.5, -2.5, -0.5, 126.5], "e4m3": [17.0, 19.0, -21.0, 304.0, 0.53125, -9.0],
         "e5m2": [4.5, 5.5, -6.5, 0.875, 40960.0, -1.25]}


def _input(shape, fmt, group, specials=True, seed=0):
    """bf16 gate_up: normal values over decades, ties at scale 1 in row 1's first gate and up groups (beside the
    format's max), an all-zero gate group and up group, and NaN / +-Inf in separate groups of gate and up."""
    *lead, two_f = shape
    key_n, key_e = jax.random.split(jax.random.key(seed))
    x = np.array(jax.random.normal(key_n, shape) * 10.0 ** jax.random.uniform(key_e, shape, minval=-3, maxval=1))
    x = x.reshape(-1, two_f)
    f = two_f // 2
    ties = _TIES[fmt]
    for start in (0, f):
        x[1, start] = formats.get_format(fmt).max_value
        x[1, start + 1:start + 1 + len(ties)] = ties
    x[2, group:2 * group] = 0  # a zero gate group
    x[0, f + 2 * group:f + 3 * group] = 0  # a zero up group
    if specials:
        x[3, 5] = np.nan  # gate
        x[2, f + group + 3] = np.inf  # up
        x[-1, 3 * group] = -np.inf  # gate
    return jnp.asarray(x.reshape(shape), jnp.bfloat16)


def _bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _assert_same(got, want, compiled=False):
    """Equal dtype and shape, NaN at the same places, other values equal bit for bit; compiled on a GPU, bf16 within
    4 ulps (2^-6 relative: exp's ulps, and XLA may drop the reference's bf16 roundings) or 2^-16 of the largest
    value (where the backward's 1 + g (1 - sigmoid) cancels), float32 within 2^-18 (exp's and the logistic's ulps).
    8-bit codes stay exact."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    want32, got32 = np.asarray(want, np.float32), np.asarray(got, np.float32)
    nan = np.isnan(want32)
    np.testing.assert_array_equal(np.isnan(got32), nan)
    if compiled and want.dtype in (jnp.bfloat16, jnp.float32):
        finite = np.isfinite(want32)
        np.testing.assert_array_equal(got32[~finite & ~nan], want32[~finite & ~nan])  # +-Inf
        rtol = 2**-6 if want.dtype == jnp.bfloat16 else 2**-18
        np.testing.assert_allclose(got32[finite], want32[finite], rtol=rtol,
                                   atol=rtol / 4 * 2**-8 * np.abs(want32[finite]).max())
        return
    g, w = _bits(got)[~nan], _bits(want)[~nan]
    assert int(np.sum(g != w)) == 0, f"{int(np.sum(g != w))} of {g.size} differ"


def _kernel_calls(fn, *args):
    """SwiGLU kernel calls (forward and backward) in fn's jaxpr."""
    jaxpr = str(jax.make_jaxpr(fn)(*args))
    return jaxpr.count("name=_forward_call") + jaxpr.count("name=_backward_call")


def _reference_forward(x, spec, group):
    return jax.jit(lambda x: (ops.SWIGLU.forward(x)[0], prologue.save(x, spec, group)))(x)


def _reference_backward(saved, x, dh):
    x_like = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.jit(lambda s, dh: ops.SWIGLU.backward(
        ops.SWIGLU.forward(prologue.restore(s, x_like.shape, x_like.dtype))[1], dh)[0])(saved, dh)


def _check(x, spec, group):
    compiled = on_hopper_gpu()
    interpret = None if compiled else True
    h, saved = jax.jit(lambda x: swiglu_mgpu.swiglu_quantize(x, spec, group, interpret=interpret))(x)
    h_ref, saved_ref = _reference_forward(x, spec, group)
    _assert_same(h, h_ref, compiled)
    assert saved.granularity == saved_ref.granularity == "row"
    _assert_same(saved.data, saved_ref.data)  # codes exactly (fp8 NaN codes: NaN on both sides)
    np.testing.assert_array_equal(_bits(saved.scale), _bits(saved_ref.scale))
    dh = (jax.random.normal(jax.random.key(7), h.shape) * 0.1).astype(jnp.bfloat16)
    dx = jax.jit(lambda s, dh: swiglu_mgpu.swiglu_backward(s, dh, interpret=interpret))(saved_ref, dh)
    _assert_same(dx, _reference_backward(saved_ref, x, dh), compiled)
    return h, saved, dx


@pytest.mark.skipif(on_hopper_gpu(), reason="CPU interpreter tests (GPU: the gpu tests)")
@pytest.mark.parametrize("spec,group", RECIPES)
@pytest.mark.parametrize("shape", [(8, 512), (2, 4, 1024)])  # one program; several along tokens and features
def test_kernels_match_reference(spec, group, shape):
    x = _input(shape, spec.dtype, group)
    h, saved, dx = _check(x, spec, group)
    scale = np.asarray(saved.scale).reshape(-1, saved.scale.shape[-2])
    assert saved.data.shape == (*shape[:-1], shape[-1] // group, group)
    assert scale[2, 1] == 1 and not np.asarray(saved.data).reshape(scale.shape + (group,))[2, 1].any()  # zero group
    assert np.isnan(scale[3, 0]) and np.isinf(scale[-1, 3])  # NaN group: NaN scale; Inf group (no NaN): Inf
    h32, dx32 = np.asarray(h, np.float32).reshape(-1, h.shape[-1]), np.asarray(dx, np.float32).reshape(-1, x.shape[-1])
    assert np.isnan(h32[3, 5]) and np.isnan(dx32[3, :group]).all()  # NaN stays NaN, over its whole group
    if spec.pow2_scale:
        np.testing.assert_array_equal(np.frexp(scale[np.isfinite(scale)])[0], 0.5)


def test_tile_size_does_not_change_results():
    spec, group = RECIPES[0]
    x = _input((16, 1024), spec.dtype, group, specials=False)
    interpret = None if on_hopper_gpu() else True
    outs = [jax.jit(lambda x, e=e: swiglu_mgpu.swiglu_quantize(x, spec, group, interpret=interpret,
                                                                tile_elements=e))(x)
            for e in (1024, 8192)]  # 8 programs of (4, 8, 32) / one of (16, 16, 32)
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
        np.testing.assert_array_equal(_bits(a), _bits(b))


def test_swiglu_formula_is_xlas_silu():
    """numerics.swiglu (each op rounded to the inputs' dtype) is `jax.nn.silu(gate) * up` as XLA:CPU computes it,
    bit for bit: ops.swiglu, the non-data-flow path, did not change on the CPU by calling it. On a GPU XLA may
    round the steps differently: close, and the count of differing bf16 values is printed (pytest -s)."""
    for dtype in (jnp.bfloat16, jnp.float32):
        g, u = (jax.random.normal(k, (65536,)) * 4 for k in jax.random.split(jax.random.key(3)))
        g = g.at[:3].set(jnp.array([jnp.nan, jnp.inf, -jnp.inf]))
        g, u = g.astype(dtype), u.astype(dtype)
        got, want = jax.jit(numerics.swiglu)(g, u), jax.jit(lambda g, u: jax.nn.silu(g) * u)(g, u)
        if on_hopper_gpu():
            print(f"numerics.swiglu vs jax.nn.silu on XLA:GPU, {dtype.__name__}: "
                  f"{int(np.sum(_bits(got) != _bits(want)))} of {got.size} differ")
        _assert_same(got, want, compiled=on_hopper_gpu())


def test_supports_and_fallbacks():
    spec = QuantSpec("int8", "row")
    ok = jnp.zeros((8, 512), jnp.bfloat16)
    assert swiglu_mgpu.supports_forward(ok, spec, 32) is None
    assert "multiple of 256" in swiglu_mgpu.supports_forward(jnp.zeros((8, 256), jnp.bfloat16), spec, 32)
    assert "multiple of 4" in swiglu_mgpu.supports_forward(jnp.zeros((6, 512), jnp.bfloat16), spec, 32)
    assert "bfloat16" in swiglu_mgpu.supports_forward(jnp.zeros((8, 512)), spec, 32)
    assert "groups of" in swiglu_mgpu.supports_forward(ok, spec, 12)
    assert "nearest rounding" in swiglu_mgpu.supports_forward(ok, QuantSpec("int8", "row", stochastic=True), 32)
    assert "nearest rounding" in swiglu_mgpu.supports_forward(ok, QuantSpec("int8", "1x128"), 32)
    saved = prologue.save(_input((8, 512), "int8", 32), spec, 32)
    dh, x_like = jnp.zeros((8, 256), jnp.bfloat16), jax.ShapeDtypeStruct((8, 512), jnp.bfloat16)
    assert swiglu_mgpu.supports_backward(saved, dh, x_like) is None
    assert "grouped view" in swiglu_mgpu.supports_backward(prologue.save(ok, spec, 0), dh, x_like)  # per-row scales
    assert "share a dtype" in swiglu_mgpu.supports_backward(saved, dh.astype(jnp.float32), x_like)
    with pytest.raises(ValueError, match="multiple of 256"):
        swiglu_mgpu.swiglu_quantize(jnp.zeros((8, 256), jnp.bfloat16), spec, 32, interpret=True)
    # Shapes the kernels cannot tile run the reference under "auto" (here forced to the interpreter) and are an
    # error for the explicit backend "pallas".
    for x in (_input((6, 512), "int8", 32), _input((8, 256), "int8", 32)):
        with dispatch.force("interpret"):
            h, saved = jax.jit(lambda x: ops.SWIGLU.forward_saving(x, spec=spec, group=32, backend="auto"))(x)
            assert _kernel_calls(lambda x: ops.SWIGLU.forward_saving(x, spec=spec, group=32, backend="auto"), x) == 0
        h_ref, saved_ref = _reference_forward(x, spec, 32)
        _assert_same(h, h_ref)
        _assert_same(saved.data, saved_ref.data)
        with pytest.raises(ValueError, match="backend 'pallas'"):
            dispatch.swiglu_forward_saving(x, spec, 32, None, backend="pallas")


FAST_COMPILE = {"xla_backend_optimization_level": 0}
# A 2-layer Llama whose SwiGLU input (64 tokens, 2 * 256) the kernels tile.
LLAMA = models.llama_config("tiny", vocab_size=128, dim=128, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=256,
                            max_seq_len=32)


@pytest.mark.skipif(on_hopper_gpu(), reason="CPU interpreter tests (GPU: the gpu tests)")
def test_llama_with_kernels_equals_reference_path(monkeypatch):
    """Loss and every gradient bit for bit, with the SwiGLU kernels (interpreted) and without. The GEMM and
    quantize kernels stay on their references in both runs (their GEMMs agree to float32 rounding only, and take a
    minute interpreted): `dot_general` reaches them through `qjax.dispatch`, patched here to backend "xla"."""
    for name in ("quantized_matmul", "quantize_pair"):
        original = getattr(dispatch, name)
        monkeypatch.setattr(dispatch, name, lambda *a, backend, _f=original, **k: _f(*a, backend="xla", **k))
    config = dataclasses.replace(LLAMA, recipe="int8_dataflow")  # fp8_dataflow: the kernel tests' e4m3 cases
    tokens = jax.random.randint(jax.random.key(0), (2, 32), 0, 128)
    model = models.Llama(config)
    params = jax.jit(lambda k: model.init(k, tokens)["params"])(jax.random.key(1))

    def loss(params):
        logits = model.apply({"params": params}, tokens, rngs={"quant": jax.random.key(2)})
        return models.lm_loss(logits[:, :-1], tokens[:, 1:])

    results = {}
    for mode in ("interpret", "reference"):
        with dispatch.force(mode):
            traced = jax.jit(jax.value_and_grad(loss)).trace(params)
        jaxpr = str(traced.jaxpr)
        assert jaxpr.count("name=_forward_call") == jaxpr.count("name=_backward_call") == (mode == "interpret") * 2
        results[mode] = traced.lower().compile(FAST_COMPILE)(params)
    (loss_k, grads_k), (loss_r, grads_r) = results["interpret"], results["reference"]
    assert float(loss_k) == float(loss_r)
    for got, want in zip(jax.tree.leaves(grads_k), jax.tree.leaves(grads_r)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_lowers_for_hopper():
    """The Mosaic GPU lowering (the grouped register layout, group reductions by shuffles, GMEM vector loads and
    stores) succeeds for sm_90 on any host, with no CTA-wide barrier around the stores
    (`qjax.kernels.NO_AUTO_BARRIERS`); it cannot run ptxas or the kernel."""
    for spec, group in RECIPES[:2]:
        x = jnp.zeros((64, 1024), jnp.bfloat16)
        forward = jax.jit(lambda x: swiglu_mgpu.swiglu_quantize(x, spec, group))
        saved = jax.eval_shape(lambda x: prologue.save(x, spec, group), x)
        dh = jax.ShapeDtypeStruct((64, 512), jnp.bfloat16)
        backward = jax.jit(lambda s, dh: swiglu_mgpu.swiglu_backward(s, dh))
        for lowered in (forward.trace(x).lower(lowering_platforms=("cuda",)),
                        backward.trace(saved, dh).lower(lowering_platforms=("cuda",))):
            assert _mosaic_calls(lowered.as_text()) == 1
            (kernel,) = mosaic_gpu_kernel_texts(lowered)
            assert "llvm.inline_asm" in kernel and "bar.sync" not in kernel


def _mosaic_calls(hlo_text):
    return sum("mosaic_gpu" in line for line in hlo_text.splitlines() if "stablehlo.custom_call" in line)


# ---------------------------------------------------------------- GPU (H100/H200): compiled kernels vs XLA:GPU


@pytest.mark.gpu
@pytest.mark.parametrize("spec,group", RECIPES[:2])
def test_gpu_real_size(spec, group):
    """The 1.1B Llama's SwiGLU input at batch 8 x 2048: 16384 tokens x 2 * 5632, NaN / Inf groups included."""
    assert on_hopper_gpu(), jax.devices()
    _check(_input((16384, 2 * 5632), spec.dtype, group, seed=1), spec, group)
