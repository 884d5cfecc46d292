"""The Mosaic GPU scaled GEMM kernel against the jnp/XLA reference `qjax.kernels.scaled_matmul.scaled_matmul`.

Off a Hopper GPU the kernel runs under the Mosaic GPU interpreter (slow: few, small cases that each exercise several
properties: ragged shapes that pad, several output tiles per persistent CTA, zero and Inf blocks); on a Hopper GPU the
same tests run compiled. `test_lowers_for_cuda` lowers the default configs at real sizes for the GPU from any machine:
that runs the Pallas -> Mosaic GPU lowering (register layouts, wgmma operand checks, shared memory size) but not ptxas
or the hardware. Tests marked gpu (4096-sized, compiled) run only on the device.

Tolerances: int8 row scales equal the reference up to f32 rounding (same multiplication order); fp8 sums differ in f32
summation order only (bound: 1e-5 x (|a| |b|^T)); block scales promote per 128 of K where the reference dequantizes
and runs one f32 GEMM (same bound); bf16 outputs add one or two bf16 roundings (the fp8 reference accumulates in bf16).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qjax.dispatch import on_hopper_gpu
from qjax.kernels import gemm_config_mgpu as gemm_config
from qjax.kernels import scaled_matmul_mgpu as mgpu
from qjax.kernels.scaled_matmul import scaled_matmul
from qjax.quantize import QTensor, QuantSpec, quantize

INTERPRET = not on_hopper_gpu()
# The interpreter compiles each kernel variant for a few seconds; small tiles keep the unrolled epilogue short and
# give several output tiles per persistent CTA at small sizes. The default configs are lowered in test_lowers_for_cuda
# and run at size in the gpu tests.
SMALL = gemm_config.TuningConfig(tile_m=64, tile_n=64, tile_k=128, max_concurrent_steps=2)
F32_RTOL = 1e-5  # relative to |a| |b|^T: f32 summation-order differences over K <= 4096
BF16_RTOL = 2.0**-7  # two bf16 roundings (the fp8 reference rounds its bf16 accumulator, then the output)
# Compiled, Hopper's fp8 wgmma accumulates with reduced precision (as cuBLAS's fast fp8 path does): over all of K
# without promotion, or within each 128 of K with it (measured on an H100: up to 1.9e-4).
FAST_FP8_RTOL = F32_RTOL if INTERPRET else 2e-3
PROMOTED_FP8_RTOL = F32_RTOL if INTERPRET else 5e-4
_quantize = jax.jit(quantize, static_argnums=1)


def _operands(m, n, k, a_spec, b_spec, seed=0):
    """Random QTensors (M, K), (N, K); magnitudes spread over decades so per-row / per-block scales differ."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k), np.float32) * 10.0 ** rng.uniform(-2, 2, (m, 1)).astype(np.float32)
    w = rng.standard_normal((n, k), np.float32) * 10.0 ** rng.uniform(-1, 1, (1, k)).astype(np.float32)
    return _quantize(jnp.asarray(x), QuantSpec(*a_spec)), _quantize(jnp.asarray(w), QuantSpec(*b_spec))


@jax.jit
def _abs_product(a_abs, b_abs):
    return jnp.matmul(a_abs, b_abs.T, precision=jax.lax.Precision.HIGHEST)


def _magnitude(a: QTensor, b: QTensor) -> np.ndarray:
    """|a| |b|^T (non-finite scales counted as 0): the scale of each output's rounding error."""
    def absolute(q):
        x = jnp.abs(q.dequantize())
        return jnp.where(jnp.isfinite(x), x, 0)
    return np.asarray(_abs_product(absolute(a), absolute(b)), np.float64)


def _kernel(a, b, out_dtype, config=SMALL, **kwargs):
    # Jitted: run eagerly, interpreted kernels can deadlock with the next eager op (benchmarks/NOTES.md).
    out = jax.jit(lambda a, b: mgpu.scaled_matmul_kernel(a, b, out_dtype, config=config, interpret=INTERPRET,
                                                         **kwargs))(a, b)
    assert out.shape == (a.shape[0], b.shape[0]) and out.dtype == jnp.dtype(out_dtype)
    return np.asarray(out.astype(jnp.float32), np.float64)


def _reference(a, b, out_dtype, precise=False):
    return np.asarray(scaled_matmul(a, b, out_dtype, precise).astype(jnp.float32), np.float64)


def _assert_close(out, ref, mag, out_dtype, rtol=F32_RTOL, where=None):
    where = np.ones(out.shape, bool) if where is None else where
    bound = rtol * mag + (BF16_RTOL * np.abs(ref) if out_dtype == jnp.bfloat16 else 0)
    assert np.all(np.isfinite(out[where])), "non-finite outputs from finite operands"
    excess = np.where(where, np.abs(out - ref) - bound, -np.inf)
    worst = np.unravel_index(excess.argmax(), excess.shape)
    ratio = np.max(np.where(where & (mag > 0), np.abs(out - ref) / np.where(mag > 0, mag, 1), 0))
    assert excess.max() <= 0, (f"|out - ref| exceeds the bound by {excess.max()} at {worst}; max |out - ref| / "
                               f"(|a| |b|^T) = {ratio:.2e}")


def test_int8_row_scales_equal_reference_with_padding_zero_and_inf_rows():
    # M=200, N=150, K=300 pad to 256 x 192 x 384 (128 x 64 CTA tiles in a 2-CTA cluster sharing B): three output
    # tiles per CTA, three K steps through a two-stage pipeline, a K tail of zero codes.
    a, b = _operands(200, 150, 300, ("int8", "row"), ("int8", "row"))
    a = dataclasses.replace(a, data=a.data.at[5].set(0), scale=a.scale.at[5].set(1))  # all-zero row: scale 1
    a = dataclasses.replace(a, scale=a.scale.at[130, 0].set(jnp.inf))  # Inf scale: row 130 must not be finite
    out, ref = _kernel(a, b, jnp.float32, config=dataclasses.replace(SMALL, cluster_m=2)), _reference(a, b, jnp.float32)
    assert not np.any(np.isfinite(out[130])) and not np.any(np.isfinite(ref[130]))
    assert np.all(out[5] == 0)
    rest = np.delete(np.arange(200), 130)
    np.testing.assert_allclose(out[rest], ref[rest], rtol=1e-6, atol=0)  # same order of the two scale products
    assert np.abs(ref[rest]).max() > 1


def test_fp8_mixed_e4m3_e5m2_row_and_tensor_scales_bf16_out():
    # dgrad of fp8_tensorwise: e5m2 gradient codes x e4m3 codes; here with a row-scaled lhs and bf16 output.
    a, b = _operands(128, 64, 256, ("e5m2", "row"), ("e4m3", "tensor"), seed=2)
    _assert_close(_kernel(a, b, jnp.bfloat16), _reference(a, b, jnp.bfloat16), _magnitude(a, b), jnp.bfloat16,
                  rtol=FAST_FP8_RTOL)


def test_fp8_precise_accumulation_promotes_every_128_of_k():
    a, b = _operands(128, 64, 384, ("e4m3", "tensor"), ("e4m3", "row"), seed=3)
    out = _kernel(a, b, jnp.float32, precise_accumulation=True)
    _assert_close(out, _reference(a, b, jnp.float32, precise=True), _magnitude(a, b), jnp.float32,
                  rtol=PROMOTED_FP8_RTOL)


def test_block_int8_1x128_times_128x128_with_zero_and_inf_blocks():
    # fwd/dgrad layout: a 1x128 (M ragged: 200 -> 256), b 128x128; eight output tiles.
    a, b = _operands(200, 256, 384, ("int8", "1x128"), ("int8", "128x128"), seed=4)
    a = dataclasses.replace(a, data=a.data.at[64:128].set(0), scale=a.scale.at[64:128].set(1))  # all-zero blocks
    a = dataclasses.replace(a, scale=a.scale.at[10, 1].set(jnp.inf))  # one Inf block in row 10
    b = dataclasses.replace(b, scale=b.scale.at[1, 2].set(jnp.inf))  # one Inf 128x128 block: columns 128..255
    out, ref = _kernel(a, b, jnp.float32), _reference(a, b, jnp.float32)
    bad = np.zeros(out.shape, bool)
    bad[10, :], bad[:, 128:] = True, True
    assert not np.any(np.isfinite(out[bad])), "an Inf scale must make its outputs NaN/Inf"
    assert not np.any(np.isfinite(ref[bad]))
    assert np.all(out[64:128, :128] == 0), "all-zero blocks (scale 1) must give exact zeros"
    _assert_close(out, ref, _magnitude(a, b), jnp.float32, where=~bad)


def test_block_fp8_1x128_times_1x128_bf16_out():
    # wgrad layout: both operands 1x128 along K; N ragged (100 -> 128).
    a, b = _operands(128, 100, 256, ("e4m3", "1x128"), ("e4m3", "1x128"), seed=5)
    _assert_close(_kernel(a, b, jnp.bfloat16), _reference(a, b, jnp.bfloat16), _magnitude(a, b), jnp.bfloat16,
                  rtol=PROMOTED_FP8_RTOL)


@pytest.mark.parametrize("code, b_gran", [("int8", "128x128"), ("e4m3", "1x128")])
def test_block_two_k_blocks_per_step(code, b_gran):
    # tile_k=256 (BLOCK_CONFIG's): two wgmma groups per step, the first promoted while the second runs; K = 384 pads
    # to 512 (zero codes, scale 1); four output tiles per CTA.
    config = dataclasses.replace(SMALL, tile_k=256)
    a, b = _operands(256, 128, 384, (code, "1x128"), (code, b_gran), seed=6)
    a = dataclasses.replace(a, scale=a.scale.at[3, 2].set(jnp.nan))  # a NaN scale in the last real K block
    out, ref = _kernel(a, b, jnp.float32, config=config), _reference(a, b, jnp.float32)
    assert np.all(np.isnan(out[3])) and np.all(np.isnan(ref[3]))
    rows = np.arange(out.shape[0]) != 3
    _assert_close(out[rows], ref[rows], _magnitude(a, b)[rows], jnp.float32,
                  rtol=F32_RTOL if code == "int8" else PROMOTED_FP8_RTOL)


# ---- errors and support checks (no kernel run) ----

def _q(shape, dtype=jnp.int8, granularity="row", scale_shape=None):
    scale_shape = {"row": (shape[0], 1), "tensor": ()}.get(granularity) if scale_shape is None else scale_shape
    return QTensor(jnp.zeros(shape, dtype), jnp.ones(scale_shape, jnp.float32), granularity)


@pytest.mark.parametrize("a, b, out_dtype, error, match", [
    (_q((64, 128)), _q((64, 256)), jnp.float32, ValueError, "contracting dims"),
    (_q((64, 128)), _q((64, 128), jnp.float8_e4m3fn), jnp.float32, TypeError, "int8 codes cannot be mixed"),
    (_q((2, 64, 128), granularity="tensor"), _q((64, 128)), jnp.float32, ValueError, "2-D"),
    (_q((64, 128)), _q((64, 128)), jnp.float16, TypeError, "out_dtype"),
    (_q((64, 128), jnp.float32), _q((64, 128)), jnp.float32, TypeError, "codes must be"),
    (_q((64, 128), granularity="1x128", scale_shape=(64, 2)), _q((64, 128)), jnp.float32, ValueError, "scale must"),
    (_q((64, 100), granularity="1x128", scale_shape=(64, 1)), _q((64, 100)), jnp.float32, ValueError, "K % 128"),
])
def test_rejects_unsupported_operands_clearly(a, b, out_dtype, error, match):
    assert mgpu.supports(a, b, out_dtype) is not None
    with pytest.raises(error, match=match):
        mgpu.scaled_matmul_kernel(a, b, out_dtype, interpret=True)


def test_default_config_avoids_padding():
    """Two K blocks per step and CTA pairs where K and M allow them; fewer rather than padding the operands."""
    def block_operands(m, k):
        return (_q((m, k), granularity="1x128", scale_shape=(m, k // 128)),
                _q((128, k), granularity="128x128", scale_shape=(1, k // 128)))
    assert gemm_config.default_config(*block_operands(4096, 4096)) == gemm_config.BLOCK_CONFIG
    config = gemm_config.default_config(*block_operands(4096 + 128, 4096 + 128))
    assert (config.tile_k, config.cluster_m) == (128, 1)
    assert gemm_config.default_config(_q((4096 + 128, 4096)), _q((128, 4096))) == gemm_config.ROW_CONFIG


def test_supports_accepts_every_recipe_layout():
    for a, b in [(_q((64, 256)), _q((32, 256), granularity="tensor")),
                 (_q((64, 256), jnp.float8_e5m2, "tensor"), _q((32, 256), jnp.float8_e4m3fn, "tensor")),
                 (_q((64, 256), granularity="1x128", scale_shape=(64, 2)),
                  _q((128, 256), granularity="128x128", scale_shape=(1, 2)))]:
        assert mgpu.supports(a, b, jnp.bfloat16) is None


def test_config_errors():
    with pytest.raises(ValueError, match="tile_m"):
        gemm_config.TuningConfig(tile_m=32)
    with pytest.raises(ValueError, match="tile_n"):
        gemm_config.TuningConfig(tile_n=512)
    a = _q((64, 256), granularity="1x128", scale_shape=(64, 2))
    with pytest.raises(ValueError, match="registers"):  # block mode with 128 x 128 warpgroup tiles
        mgpu.scaled_matmul_kernel(a, a, jnp.float32, config=gemm_config.ROW_CONFIG, interpret=True)
    with pytest.raises(ValueError, match="registers"):  # three 64 x 128 tiles fit, three 64 x 192 do not
        mgpu.scaled_matmul_kernel(a, a, jnp.float32, interpret=True,
                                  config=dataclasses.replace(gemm_config.BLOCK_CONFIG, tile_n=192, tile_k=256))
    with pytest.raises(ValueError, match="shared memory"):
        mgpu.scaled_matmul_kernel(_q((64, 256)), _q((64, 256)), jnp.float32,
                                  config=dataclasses.replace(gemm_config.ROW_CONFIG, max_concurrent_steps=6),
                                  interpret=True)


@pytest.mark.parametrize("mode, code, out_dtype, overrides", [
    ("row", jnp.int8, jnp.bfloat16, {}), ("block", jnp.float8_e4m3fn, jnp.float32, {}),
    ("block", jnp.int8, jnp.bfloat16, {"cluster_m": 1}), ("promote", jnp.float8_e5m2, jnp.bfloat16, {}),
    ("block", jnp.float8_e4m3fn, jnp.bfloat16, {"tile_k": 128, "max_concurrent_steps": 5})])
def test_lowers_for_cuda(mode, code, out_dtype, overrides):
    """Configs at 4096 x 2048 x 1024 lower to a Mosaic GPU module (layouts, wgmma operands, SMEM budget)."""
    m, n, k = 4096, 2048, 1024
    config = dataclasses.replace(gemm_config.ROW_CONFIG if mode == "row" else gemm_config.BLOCK_CONFIG, **overrides)
    gemm_config.check_config(config, mode)
    plan = mgpu._Plan(mode, m, n, k, jnp.dtype(out_dtype), config, 132, b_scale_per_tile=code == jnp.int8)
    scale_shapes = ((k // 128, m), (k // 128, n)) if mode == "block" else ((m,), (n,))
    args = (jax.ShapeDtypeStruct((m, k), code), jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn if code != jnp.int8
                                                                     else code),
            *(jax.ShapeDtypeStruct(s, jnp.float32) for s in scale_shapes))
    lowered = jax.jit(lambda *xs: mgpu._launch(*xs, plan=plan, interpret=False)).trace(*args).lower(
        lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()[:5000]


# ---- compiled, real sizes (device only) ----

@pytest.mark.gpu
@pytest.mark.parametrize("dtype, a_gran, b_gran, out_dtype, precise", [
    ("int8", "row", "row", jnp.bfloat16, False),
    ("e4m3", "tensor", "tensor", jnp.bfloat16, False),
    ("int8", "1x128", "128x128", jnp.bfloat16, False),
    ("e4m3", "1x128", "128x128", jnp.float32, False),
    ("e4m3", "1x128", "1x128", jnp.bfloat16, False),
    ("e4m3", "row", "row", jnp.float32, True),
])
def test_gpu_4096(dtype, a_gran, b_gran, out_dtype, precise):
    m, n, k = 4096, 4096 - 64, 4096  # N not a multiple of the tile: the padding path at size
    if b_gran == "128x128":
        n = 4096
    a, b = _operands(m, n, k, (dtype, a_gran), (dtype, b_gran), seed=7)
    out = _kernel(a, b, out_dtype, config=None, precise_accumulation=precise)
    ref = _reference(a, b, out_dtype, precise)
    mag = _magnitude(a, b)
    # Hopper's reduced-precision fp8 accumulation: over all of K in row mode (kernel and cuBLAS alike), within each
    # 128 of K where the kernel promotes (block scales, precise accumulation).
    if dtype == "int8":
        rtol = F32_RTOL
    else:
        promoted = precise or a_gran not in ("row", "tensor")
        rtol = PROMOTED_FP8_RTOL if promoted else FAST_FP8_RTOL
    _assert_close(out, ref, mag, out_dtype, rtol=rtol)
