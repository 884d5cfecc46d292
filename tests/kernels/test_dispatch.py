"""qjax.dispatch: which implementation runs (recipe backends, the `force` override), and that the kernel path of
qjax.dot_general agrees with XLA."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from qjax import dispatch
from helpers import snr_db

DIMS = (((1,), (1,)), ((), ()))


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        dataclasses.replace(qjax.recipe("int8_rowwise"), backend="cuda")


def test_auto_is_xla_off_gpu_and_pallas_interprets():
    assert dispatch.kernel_mode("xla") == (False, False)
    if not dispatch.on_hopper_gpu():
        assert dispatch.kernel_mode("auto") == (False, False)
        assert dispatch.kernel_mode("pallas") == (True, True)
    else:
        assert dispatch.kernel_mode("auto") == (jax.device_count() == 1, False)
        assert dispatch.kernel_mode("pallas") == (True, False)


@pytest.mark.parametrize("mode,want", [("kernel", (True, False)), ("interpret", (True, True)),
                                       ("reference", (False, False))])
def test_force_overrides_auto_only_and_is_restored(mode, want):
    before = dispatch.kernel_mode("auto")
    with dispatch.force(mode):
        assert dispatch.kernel_mode("auto") == want
        assert dispatch.kernel_mode() == want  # the fused AdamW's use_kernel=True
        assert dispatch.kernel_mode("xla") == (False, False)  # explicit backends keep their meaning
        assert dispatch.kernel_mode("pallas")[0]
        with dispatch.force("reference"):
            assert dispatch.kernel_mode("auto") == (False, False)
        assert dispatch.kernel_mode("auto") == want
    assert dispatch.kernel_mode("auto") == before
    with pytest.raises(ValueError, match="unknown dispatch mode"):
        with dispatch.force("gpu"):
            pass
    with pytest.raises(ValueError, match="unknown backend"):
        dispatch.kernel_mode("cuda")


def test_forced_interpret_runs_the_kernels_inside_dot_general(monkeypatch):
    """force("interpret") sends a backend "auto" recipe's quantization and GEMMs to the (interpreted) kernels."""
    calls = []

    def recording(module, name):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args, **kwargs: calls.append(name) or original(*args, **kwargs))

    recording(dispatch.quantize_mgpu, "quantize_pair_kernel")
    recording(dispatch.scaled_matmul_mgpu, "scaled_matmul_kernel")
    x, w = jnp.ones((128, 256)), jnp.ones((128, 256))
    loss = lambda x, w: qjax.dot_general(x, w, DIMS, recipe="int8_rowwise").sum()
    with dispatch.force("interpret"):
        dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    # x, w and g each quantized once for both layouts; the forward, dgrad and wgrad GEMMs
    assert sorted(calls) == ["quantize_pair_kernel"] * 3 + ["scaled_matmul_kernel"] * 3
    np.testing.assert_allclose(dx, 128.0)
    np.testing.assert_allclose(dw, 128.0)
    calls.clear()
    with dispatch.force("reference"):
        jax.jit(jax.grad(loss, argnums=(0, 1)))(x + 1, w)
    assert calls == []


def test_auto_on_several_gpus_says_why_kernels_are_off(monkeypatch):
    monkeypatch.setattr(dispatch, "on_hopper_gpu", lambda: True)
    monkeypatch.setattr(jax, "device_count", lambda: 2)
    dispatch._warn_kernels_off.cache_clear()
    with pytest.warns(UserWarning, match="2 GPUs are visible.*Set the mesh while tracing"):
        assert dispatch.kernel_mode("auto") == (False, False)
    assert dispatch.kernel_mode("pallas") == (True, False)
    dispatch._warn_kernels_off.cache_clear()


def test_auto_runs_kernels_per_device_inside_shard_map(monkeypatch):
    """Where every mesh axis is manual (qjax.dot_general's per-device GEMMs), arrays are device-local: "auto" runs
    the kernels on several GPUs too."""
    from jax.sharding import Mesh, PartitionSpec as P

    monkeypatch.setattr(dispatch, "on_hopper_gpu", lambda: True)
    monkeypatch.setattr(jax, "device_count", lambda: 2)
    seen = []

    def body(x):
        seen.append((dispatch.per_device_region(), dispatch.kernel_mode("auto")))
        return x

    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    jax.make_jaxpr(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(jnp.zeros(4))
    assert seen == [(True, (True, False))]
    assert not dispatch.per_device_region()


# w's layout changes how dot_general lays out its quantize pair: both layouts for the GEMM kernel's two scale modes
# (int8_rowwise: "row", fp8_blockwise: "block"); fp8_tensorwise, "row" mode with fp8 codes, in one.
@pytest.mark.parametrize("name,w_layout", [("int8_rowwise", "nk"), ("int8_rowwise", "kn"), ("fp8_tensorwise", "kn"),
                                           ("fp8_blockwise", "nk"), ("fp8_blockwise", "kn")])
def test_pallas_backend_matches_xla_through_the_vjp(name, w_layout):
    """Forward, dgrad and wgrad through the kernel (interpreted on CPU) equal the XLA path up to f32 rounding; w
    stored as (N, K), or as (K, N) like a Dense kernel."""
    kx, kw, kg = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, (128, 256), jnp.float32)
    w = jax.random.normal(kw, (128, 256), jnp.float32)
    g = jax.random.normal(kg, (128, 128), jnp.float32)
    dims = DIMS if w_layout == "nk" else (((1,), (0,)), ((), ()))
    w = w if w_layout == "nk" else w.T

    # Jitted: eagerly, the main thread dispatched the next op while the interpreted kernel's callback threads
    # dispatched theirs, and the two deadlocked in about one run in three (jax 0.11.2, CPU).
    @functools.partial(jax.jit, static_argnums=0)
    def run(backend):
        r = dataclasses.replace(qjax.recipe(name), backend=backend)
        y, vjp = jax.vjp(lambda a, b: qjax.dot_general(a, b, dims, recipe=r), x, w)
        return (y, *vjp(g))

    for got, want in zip(run("pallas"), run("xla")):
        if dispatch.on_hopper_gpu() and name.startswith("fp8"):
            # Hopper's fp8 wgmma accumulates each 128-long block with reduced precision (hence the promotion to
            # f32 every 128 of K); the reference dequantizes and multiplies in f32: they agree to ~1e-3 relative.
            assert snr_db(want, got) > 45, snr_db(want, got)
        else:
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(want))))


def test_pallas_backend_rejects_what_the_kernel_cannot_run():
    r = dataclasses.replace(qjax.recipe("int8_rowwise"), backend="pallas")
    x = jnp.ones((2, 128, 256))
    with pytest.raises(ValueError, match="batched operands"):
        qjax.dot_general(x, x, (((2,), (2,)), ((0,), (0,))), recipe=r)


def test_reference_takes_the_block_path_when_either_operand_is_block_scaled():
    """A row-scaled lhs with a 1x128 rhs (the kernel accepts the mix) multiplies the dequantized operands."""
    from qjax.kernels.scaled_matmul import scaled_matmul

    kx, kw = jax.random.split(jax.random.key(5))
    a = qjax.quantize(jax.random.normal(kx, (4, 256)), qjax.QuantSpec("int8", "row"))
    b = qjax.quantize(jax.random.normal(kw, (8, 256)), qjax.QuantSpec("int8", "1x128"))
    want = jnp.dot(qjax.dequantize(a), qjax.dequantize(b).T, precision="highest")
    np.testing.assert_allclose(scaled_matmul(a, b, jnp.float32), want, rtol=1e-5, atol=1e-5)
