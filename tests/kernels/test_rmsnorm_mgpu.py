"""The fused RMSNorm producer kernel (qjax.kernels.rmsnorm_mgpu.forward_saving) against its reference, the
composition it replaces: `ops.rms_norm`'s forward and `prologue.save`. (The norm's backward has no kernel: XLA's
restore + backward.)

Off a GPU the kernel runs under the Mosaic GPU interpreter: saved codes and scales equal the reference bit for bit,
y to float32 rounding (the kernel sums a row group by group; XLA in its own order), so a bf16 y may differ by one
bf16 ulp where the float32 value sits at a rounding boundary. On a Hopper GPU the same tests run the compiled kernel
(the Llama test is the interpreter's alone), and the `gpu` test compiles it at the 1.1B model's size (16384 x 2048)
and compares with XLA:GPU's reference the same way.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mosaic_gpu_kernel_texts
from helpers import snr_db

from qjax import dispatch, models
from qjax.kernels import rmsnorm_mgpu
from qjax.models import ops
from qjax.prologue import save
from qjax.qtensor import QuantSpec

EPS = 1e-5
RECIPES = {"int8_dataflow": (QuantSpec("int8"), 32), "fp8_dataflow": (QuantSpec("e4m3"), 16)}
_ULP = {jnp.dtype(jnp.float32): 2.0**-20, jnp.dtype(jnp.bfloat16): 2.0**-7}  # a few f32 ulps; one bf16 ulp


def _inputs(shape, dtype, specials=True, seed=0):
    """x (..., D) over decades with an all-zero group (row 0), one NaN (row 1) and one Inf (row 2); a norm scale."""
    keys = jax.random.split(jax.random.key(seed), 3)
    x = np.array(jax.random.normal(keys[0], shape) * 10.0 ** jax.random.uniform(keys[1], shape, minval=-2,
                                                                                  maxval=1))
    flat = x.reshape(-1, shape[-1])
    flat[0, 32:64] = 0
    if specials:
        flat[1, 40] = np.nan
        flat[2, 7] = -np.inf
    scale = 1 + 0.1 * jax.random.normal(keys[2], (shape[-1],))
    return jnp.asarray(x, dtype), scale


def _reference_forward(x, scale, spec, group, dtype):
    return jax.jit(lambda x, scale: (ops._rms_norm_forward(x, scale, EPS, dtype)[0], save(x, spec, group)))(x, scale)


def _bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_close(got, want, rtol):
    """Equal to rounding: same NaN positions and infinities, finite values within rtol * |want|."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = np.isfinite(want)
    np.testing.assert_array_equal(got[~finite & ~np.isnan(want)], want[~finite & ~np.isnan(want)])
    np.testing.assert_allclose(got[finite], want[finite], rtol=rtol)


def _interpret():
    return None if dispatch.on_hopper_gpu() else True


def assert_same_codes(got, want):
    """Codes and scales bit for bit; compiled on a GPU, fp8 NaN codes need only be NaN on both sides (their sign
    and payload bits are each backend's choice, as in test_quantize_mgpu)."""
    assert got.granularity == want.granularity == "row"
    assert got.data.shape == want.data.shape and got.data.dtype == want.data.dtype
    assert got.scale.shape == want.scale.shape and got.scale.dtype == jnp.float32
    np.testing.assert_array_equal(_bits(got.scale), _bits(want.scale))
    codes, codes_ref = _bits(got.data), _bits(want.data)
    if dispatch.on_hopper_gpu() and jnp.issubdtype(want.data.dtype, jnp.floating):
        nan, nan_ref = np.isnan(np.asarray(got.data, np.float32)), np.isnan(np.asarray(want.data, np.float32))
        np.testing.assert_array_equal(nan, nan_ref)
        codes, codes_ref = codes[~nan_ref], codes_ref[~nan_ref]
    np.testing.assert_array_equal(codes, codes_ref)


# Each recipe with one x dtype; programs of 32 rows (the default) and of 4 (rows_per_program, the tuning knob).
@pytest.mark.parametrize("recipe,x_dtype,rows_per_program", [("int8_dataflow", jnp.float32, 32),
                                                             ("fp8_dataflow", jnp.bfloat16, 4)])
def test_forward_saving_matches_reference(recipe, x_dtype, rows_per_program):
    spec, group = RECIPES[recipe]
    x, scale = _inputs((2, 4, 256), x_dtype)
    y_dtype = x_dtype  # the compute dtype: a float32 model's too
    interpret = _interpret()
    y, saved = jax.jit(lambda x, scale: rmsnorm_mgpu.forward_saving(
        x, scale, eps=EPS, dtype=y_dtype, spec=spec, group=group, interpret=interpret,
        rows_per_program=rows_per_program))(x, scale)
    y_ref, saved_ref = _reference_forward(x, scale, spec, group, y_dtype)
    assert saved.data.shape == (2, 4, 256 // group, group)
    assert_same_codes(saved, saved_ref)
    scales = np.asarray(saved.scale).reshape(8, -1)
    assert scales[0, 32 // group] == 1 and np.isnan(scales[1, 40 // group]) and np.isinf(scales[2, 0])
    assert_close(y, y_ref, rtol=_ULP[jnp.dtype(y_dtype)])
    rows = np.asarray(y, np.float32).reshape(8, -1)
    assert np.isnan(rows[1]).all() and np.isfinite(rows[3:]).all()  # the NaN row stays NaN, the others finite


@pytest.mark.parametrize("shape,group,reason", [
    ((8, 160), 32, "multiple of 256"), ((6, 256), 32, "multiple of 4 rows"),
    ((4, 2 * rmsnorm_mgpu.MAX_FEATURES), 32, "up to"), ((8, 128), 0, "groups of"), ((8, 128), 64, "groups of")])
def test_unsupported_shapes_are_refused(shape, group, reason):
    x, scale = _inputs(shape, jnp.bfloat16, specials=False)
    spec = QuantSpec("int8")
    assert reason in rmsnorm_mgpu.supports(x, scale, spec, group)
    forward = lambda **backend: dispatch.rms_norm_forward_saving(x, scale, spec, group, lambda *a: "reference",
                                                                 eps=EPS, dtype=jnp.bfloat16, **backend)
    with dispatch.force("interpret"):
        assert forward() == "reference"  # "auto" falls back
    with pytest.raises(ValueError, match="backend 'pallas'.*fused RMSNorm"):
        forward(backend="pallas")
    with pytest.raises(ValueError, match=reason):
        rmsnorm_mgpu.forward_saving(x, scale, eps=EPS, dtype=jnp.bfloat16, spec=spec, group=group)


def test_ragged_rows_take_the_reference_through_the_prologue():
    """6 rows (not a multiple of 4): the prologue's forward hook runs the reference, the composition bit for bit.
    The norm has no backward hook: `prologue_dot` composes `restore` and the norm's backward in XLA."""
    x, scale = _inputs((6, 256), jnp.bfloat16)
    spec, group = RECIPES["int8_dataflow"]
    op = ops.rms_norm_prologue(EPS, jnp.bfloat16)
    assert op.backward_saved is None
    with dispatch.force("interpret"):
        y, saved = jax.jit(lambda x, scale: op.forward_saving(x, scale, spec=spec, group=group,
                                                              backend="auto"))(x, scale)
    y_ref, saved_ref = _reference_forward(x, scale, spec, group, jnp.bfloat16)
    for got, want in zip(jax.tree.leaves((y, saved)), jax.tree.leaves((y_ref, saved_ref))):
        np.testing.assert_array_equal(_bits(got), _bits(want))


def test_other_specs_are_refused():
    x, scale = _inputs((8, 256), jnp.bfloat16, specials=False)
    assert "nearest rounding" in rmsnorm_mgpu.supports(x, scale, QuantSpec("int8", stochastic=True), 32)
    assert "nearest rounding" in rmsnorm_mgpu.supports(x, scale, QuantSpec("e5m2"), 32)
    assert "amax scales" in rmsnorm_mgpu.supports(x, scale, QuantSpec("e4m3", pow2_scale=True), 16)
    assert "scale of shape (256,)" in rmsnorm_mgpu.supports(x, scale[:64], QuantSpec("int8"), 32)
    assert "float32, bfloat16 or float16" in rmsnorm_mgpu.supports(x.astype(jnp.int32), scale, QuantSpec("int8"), 32)


def test_lowers_for_hopper():
    """The Mosaic GPU lowering (register layouts, group and row reductions, the scale staged in shared memory)
    succeeds for sm_90 on any host, for both recipes' groups, with no CTA-wide barrier around the stores
    (`qjax.kernels.NO_AUTO_BARRIERS`)."""
    for (spec, group), x_dtype in zip(RECIPES.values(), (jnp.bfloat16, jnp.float32)):
        x, scale = _inputs((64, 256), x_dtype, specials=False)
        forward = lambda x, scale: rmsnorm_mgpu.forward_saving(x, scale, eps=EPS, dtype=jnp.bfloat16, spec=spec,
                                                               group=group)
        lowered = jax.jit(forward).trace(x, scale).lower(lowering_platforms=("cuda",))
        assert _mosaic_calls(lowered.as_text()) == 1
        (kernel,) = mosaic_gpu_kernel_texts(lowered)
        assert "llvm.inline_asm" in kernel and "bar.sync" not in kernel


def _mosaic_calls(hlo_text):
    return sum("mosaic_gpu" in line for line in hlo_text.splitlines() if "stablehlo.custom_call" in line)


@pytest.mark.skipif(dispatch.on_hopper_gpu(), reason="CPU interpreter test (GPU: the gpu tests)")
def test_llama_int8_dataflow_with_kernels_equals_reference_path(monkeypatch):
    """A 2-layer Llama (bf16) under int8_dataflow: its 4 norms take the forward kernel (interpreted, as does the
    SwiGLU kernel; the norm's backward is XLA's), and loss and gradients equal the reference path's to rounding. The
    norms' outputs equal to float32 rounding, so a bf16 y may differ by an ulp where XLA's sum of squares rounds
    otherwise, and that ulp can move an int8 code of the next GEMM's input: ~40 dB of gradient SNR at -O0. XLA's
    excess precision is off: by default XLA may keep the bf16 residual sum that the reference norm reads in float32
    inside a fusion, where the kernel reads it rounded to bf16 (y then differs by a bf16 ulp in ~1/4 of its
    elements)."""
    calls = []
    kernel = rmsnorm_mgpu.forward_saving
    monkeypatch.setattr(rmsnorm_mgpu, "forward_saving", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    # The GEMM and quantize kernels stay on their references in both runs (interpreted, they take most of a minute
    # here; tests/kernels/test_dispatch.py runs them inside dot_general): `dot_general` reaches them through
    # `qjax.dispatch`, patched to backend "xla".
    for name in ("quantized_matmul", "quantize_pair"):
        original = getattr(dispatch, name)
        monkeypatch.setattr(dispatch, name, lambda *a, backend, _f=original, **k: _f(*a, backend="xla", **k))
    config = models.llama_config("tiny", vocab_size=128, dim=256, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=256,
                                 max_seq_len=32, recipe="int8_dataflow")  # dim: bf16 rows of 256 (8 per lane)
    tokens = jax.random.randint(jax.random.key(0), (2, 32), 0, 128)
    model = models.Llama(config)
    params = jax.jit(lambda key: model.init(key, tokens)["params"])(jax.random.key(1))

    def loss(params):
        logits = model.apply({"params": params}, tokens, rngs={"quant": jax.random.key(2)})
        return models.lm_loss(logits[:, :-1], tokens[:, 1:])

    results = {}
    # -O0 halves the CPU compile time (tests/models do the same)
    compile_options = {"xla_backend_optimization_level": 0, "xla_allow_excess_precision": False}
    for mode in ("interpret", "reference"):
        with dispatch.force(mode):
            step = jax.jit(jax.value_and_grad(loss), compiler_options=compile_options)
            results[mode] = step(params)
    assert len(calls) == 4  # traced once, under "interpret"
    (loss_k, grads_k), (loss_r, grads_r) = results["interpret"], results["reference"]
    np.testing.assert_allclose(float(loss_k), float(loss_r), rtol=1e-4)
    for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(grads_r), jax.tree.leaves(grads_k)):
        assert snr_db(want, got) > 30, jax.tree_util.keystr(path)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_gpu_real_size_matches_reference(recipe):
    """16384 x 2048 (the 1.1B model's batch of 8 x 2048 tokens), compiled, against XLA:GPU's reference."""
    assert dispatch.on_hopper_gpu(), jax.devices()
    spec, group = RECIPES[recipe]
    x, scale = _inputs((16384, 2048), jnp.bfloat16, specials=False, seed=3)
    y, saved = jax.jit(lambda x, scale: rmsnorm_mgpu.forward_saving(x, scale, eps=EPS, dtype=jnp.bfloat16,
                                                                    spec=spec, group=group))(x, scale)
    y_ref, saved_ref = _reference_forward(x, scale, spec, group, jnp.bfloat16)
    assert_same_codes(saved, saved_ref)
    assert_close(y, y_ref, rtol=2.0**-7)
