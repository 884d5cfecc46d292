"""The fused AdamW step per device under a mesh (`apply_gradients(..., param_specs=)`): each tensor whose spec splits
its param's dim 0 into whole state blocks per device runs the kernel on its shards inside `jax.shard_map`, and the
result equals the unsharded step's, bit for bit (bfloat16 params with stochastic rounding included: the kernel
hashes each element's index in the whole param); the other tensors take the jnp step, equally exact, with one
warning that names why.

XLA_FLAGS must be set before jax initialises, so the mesh checks run in a subprocess on 8 CPU devices. There the
kernel runs under the Mosaic GPU interpreter for e4m3 states only: with 8-bit or 4-bit states each program copies
its code tables to SMEM behind a barrier, and the interpreter, shared by the devices running at once, then fails
with "Barrier remains allocated" (jax 0.11.2). For those the script lowers the step for CUDA on emulated Hopper and
counts the kernels (one per split tensor), and `test_shard_offsets_8bit` runs the kernel shard by shard on one
device with each shard's offset. The `gpu` test runs the same script on every visible GPU (compiled kernels, all
three state formats, compared with the kernel on one device).
"""

import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qjax.dispatch import on_hopper_gpu
from qjax.optim import blockwise, fused_adam

ROOT = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import warnings
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from qjax import dispatch, optim
    from qjax.optim import fused_adam

    N = len(jax.devices())
    ON_GPU = jax.default_backend() == "gpu"
    MODE = "kernel" if ON_GPU else "interpret"
    calls = []  # the params the per-device kernel step runs on
    _per_device = fused_adam.fused_step_per_device
    fused_adam.fused_step_per_device = lambda p, *a, **k: calls.append(p.shape) or _per_device(p, *a, **k)
    TXS = {"fp8": optim.adamw_fp8, "8bit": optim.adamw_8bit, "4bit": optim.adamw_4bit}

    def mesh_of(fsdp, tensor):
        return jax.make_mesh((fsdp, tensor), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)

    # name: (shape, spec) per mesh. rows: dim 0 split (the kernel per device); cols: a column split (jnp); few: dim 0
    # split into 2 blocks per device (not a multiple of 4: jnp); bias: 1 block (never the kernel).
    CASES = {
        "fsdp": (mesh_of(N, 1), {"rows": ((8 * N, 256), P("fsdp", None)), "cols": ((256, 8 * N), P(None, "fsdp")),
                                 "few": ((2 * N, 256), P("fsdp", None)), "bias": ((256,), P())}),
        "fsdp_tensor": (mesh_of(N // 2, 2), {"rows": ((8 * N, 256), P(("fsdp", "tensor"), None)),
                                             "rep": ((4 * N, 256), P("fsdp", None)),  # whole over tensor
                                             "cols": ((8 * N, 256), P("fsdp", "tensor")), "bias": ((256,), P())}),
    }
    SPLIT = {"fsdp": ["rows"], "fsdp_tensor": ["rows", "rep"]}

    def inputs(shapes, dtype):
        keys = iter(jax.random.split(jax.random.key(0), 2 * len(shapes)))
        params = {k: (jax.random.normal(next(keys), s) * 0.02).astype(dtype) for k, s in shapes.items()}
        grads = {k: (jax.random.normal(next(keys), s) * 1e-3).astype(dtype) for k, s in shapes.items()}
        return params, grads

    def two_steps(tx, params, grads, key, specs=None):
        state = tx.init(params)
        for i in range(2):  # the second step reads quantized moments
            params, state = optim.apply_gradients(tx, grads, state, params, jax.random.fold_in(key, i), specs)
        return params, state

    def same(a, b, name):
        a, b = np.asarray(a), np.asarray(b)
        if not ON_GPU:
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), name
            return
        # compiled: the same kernel, its tiles cut differently per device, may contract a multiply-add otherwise
        assert np.mean(a.view(np.uint8) == b.view(np.uint8)) > 0.999, name
        np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=2e-2, atol=1e-6, err_msg=name)

    for fmt in ("fp8", "8bit", "4bit") if ON_GPU else ("fp8",):
        tx = TXS[fmt](1e-3, min_quantized_size=256, use_kernel=True)
        for case, (mesh, layout) in CASES.items():
            shapes = {k: s for k, (s, _) in layout.items()}
            specs = {k: spec for k, (_, spec) in layout.items()}
            for dtype in (jnp.float32, jnp.bfloat16):
                params, grads = inputs(shapes, dtype)
                key = jax.random.key(7)
                with dispatch.force(MODE):  # unsharded: the kernel on one device
                    ref = jax.jit(lambda p, g: two_steps(tx, p, g, key))(params, grads)
                put = lambda t: {k: jax.device_put(x, NamedSharding(mesh, specs[k])) for k, x in t.items()}
                calls.clear()
                with warnings.catch_warnings(record=True) as caught, dispatch.force(MODE):
                    warnings.simplefilter("always")
                    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                        traced = jax.jit(lambda p, g: two_steps(tx, p, g, key, specs)).trace(put(params), put(grads))
                    got = traced.lower().compile()(put(params), put(grads))
                assert sorted(calls) == sorted(2 * [shapes[k] for k in SPLIT[case]]), (fmt, case, calls)
                messages = [str(w.message) for w in caught if "qjax" in str(w.message)]
                assert len(messages) == 1 and "through jnp instead of the per-device kernel" in messages[0], messages
                assert jax.tree.structure(got) == jax.tree.structure(ref)
                for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(ref)):
                    same(a, b, f"{fmt} {case} {np.dtype(dtype).name} {jax.tree_util.keystr(path)}")
                print(fmt, case, np.dtype(dtype).name, "ok")

    if not ON_GPU:  # 8-bit and 4-bit: the step lowered for CUDA on emulated Hopper runs one kernel per split tensor
        from qjax.kernels import adam_step_mgpu
        dispatch.on_hopper_gpu = lambda: True
        for fmt in ("8bit", "4bit"):
            tx = TXS[fmt](1e-3, min_quantized_size=256, use_kernel=True)
            for case, (mesh, layout) in CASES.items():
                params, grads = inputs({k: s for k, (s, _) in layout.items()}, jnp.bfloat16)
                specs = {k: spec for k, (_, spec) in layout.items()}
                step = lambda p, g: optim.apply_gradients(tx, g, tx.init(p), p, jax.random.key(1), specs)
                with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the jnp tensors' warning (checked above)
                    text = jax.jit(step).trace(params, grads).lower(lowering_platforms=("cuda",)).as_text()
                kernels = sum("mosaic_gpu" in line for line in text.splitlines() if "stablehlo.custom_call" in line)
                assert kernels == len(SPLIT[case]), (fmt, case, kernels)
                print(fmt, case, "lowered", "ok")
""")


def _expected(on_gpu: bool) -> list[str]:
    runs = [f"{fmt} {case} {dtype} ok" for fmt in (("fp8", "8bit", "4bit") if on_gpu else ("fp8",))
            for case in ("fsdp", "fsdp_tensor") for dtype in ("float32", "bfloat16")]
    if not on_gpu:
        runs += [f"{fmt} {case} lowered ok" for fmt in ("8bit", "4bit") for case in ("fsdp", "fsdp_tensor")]
    return " ".join(runs).split()


def _run(env_extra: dict) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    env = dict(os.environ, PYTHONPATH=path, XLA_PYTHON_CLIENT_PREALLOCATE="false", **env_extra)
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                          cwd=ROOT)


def test_per_device_step_on_8_cpu_devices_equals_unsharded():
    out = _run({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    assert out.returncode == 0, out.stdout + out.stderr[-5000:]
    assert out.stdout.split() == _expected(on_gpu=False)


@pytest.mark.gpu
def test_per_device_step_on_gpus_equals_one_gpu():
    if jax.device_count() < 2 or 8 % jax.device_count():
        pytest.skip(f"needs 2, 4 or 8 GPUs, {jax.device_count()} visible")
    out = _run({"NCCL_NVLS_ENABLE": "0"})
    assert out.returncode == 0, out.stdout + out.stderr[-5000:]
    assert out.stdout.split() == _expected(on_gpu=True)


def test_shard_offsets_8bit():
    """The 8-bit kernel on each of 4 shards, with the shard's first element as offset, equals the unsharded jnp step
    (bfloat16 params, stochastic rounding): what each device computes in `fused_step_per_device`."""
    shape, shards = (64, 256), 4
    kp, kg, km, kv = jax.random.split(jax.random.key(3), 4)
    p = (jax.random.normal(kp, shape) * 0.02).astype(jnp.bfloat16)
    g = (jax.random.normal(kg, shape) * 1e-3).astype(jnp.bfloat16)
    mu = blockwise.quantize(jax.random.normal(km, shape) * 1e-3, "dynamic_signed_8bit", 256)
    nu = blockwise.quantize(jax.random.normal(kv, shape) ** 2 * 1e-6, "dynamic_unsigned_8bit", 256)
    config = fused_adam.adam.StateConfig("dynamic_signed_8bit", "dynamic_unsigned_8bit", 256, 0)
    coef = (jnp.float32(0.1), jnp.float32(0.03), jnp.float32(-1e-3))
    seed = jnp.uint32(99)
    interpret = None if on_hopper_gpu() else True

    def sharded(p, g, mu, nu):
        rows, blocks = shape[0] // shards, mu.codes.shape[0] // shards
        part = lambda s, i: type(s)(s.codes[i * blocks:(i + 1) * blocks], s.absmax[i * blocks:(i + 1) * blocks],
                                    (rows, shape[1]), s.qmap)
        outs = [fused_adam.fused_step(p[i * rows:(i + 1) * rows], g[i * rows:(i + 1) * rows], part(mu, i),
                                      part(nu, i), 0.9, 0.999, 1e-8, *coef, 0.01, seed=seed,
                                      offset=jnp.uint32(i * rows * shape[1]), interpret=interpret)
                for i in range(shards)]
        return [jnp.concatenate([o[0] for o in outs])] + [
            jnp.concatenate([getattr(o[j], f) for o in outs]) for j in (1, 2) for f in ("codes", "absmax")]

    got = jax.jit(sharded)(p, g, mu, nu)
    ref = jax.jit(lambda p, g, mu, nu: fused_adam.fused_step_reference(p, g, mu, nu, config, 0.9, 0.999, 1e-8,
                                                                       *coef, 0.01, seed))(p, g, mu, nu)
    ref = [ref[0], ref[1].codes, ref[1].absmax, ref[2].codes, ref[2].absmax]
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    assert not np.array_equal(np.asarray(got[0]), np.asarray(fused_adam.sr_params.round_param(
        p.astype(jnp.float32), jnp.bfloat16, seed)))  # the step moved the params
