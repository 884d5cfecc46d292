"""The fused AdamW step per device under a mesh (`apply_gradients(..., param_specs=)`): each tensor whose spec splits
its param's dim 0 into whole state blocks per device runs the kernel on its shards inside `jax.shard_map`, and the
result equals the unsharded step's, bit for bit (bfloat16 params with stochastic rounding included: the kernel
hashes each element's index in the whole param); the other tensors take the jnp step, with one warning that names
why (equal to ~1 float32 ulp: XLA:CPU fuses the sharded program otherwise, as in tests/optim/test_sharding.py).

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
from jax.sharding import PartitionSpec as P

from qjax import optim
from qjax.optim import blockwise, fused_adam

ROOT = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import warnings
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from qjax import dispatch, optim
    from qjax.optim import fused_adam
    from qjax.train import sharding as train_sharding

    N = len(jax.devices())
    ON_GPU = jax.default_backend() == "gpu"
    MODE = "kernel" if ON_GPU else "interpret"
    calls = []  # the params the per-device kernel step runs on
    _per_device = fused_adam.fused_step_per_device
    fused_adam.fused_step_per_device = lambda p, *a, **k: calls.append(p.shape) or _per_device(p, *a, **k)
    TXS = {"fp8": optim.adamw_fp8, "8bit": optim.adamw_8bit, "4bit": optim.adamw_4bit}

    def mesh_of(fsdp, tensor):
        return jax.make_mesh((fsdp, tensor), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)

    # The params, and their specs on three meshes; SPLIT: the params whose shards are whole state blocks, a multiple
    # of 4 per device (the kernel per device): split along dim 0 ("rows"), an inner dim ("cols", a row-parallel
    # kernel or an LM head under FSDP), both ("both"; "stack" with an unsplit dim between), or whole ("rep", and
    # every param on the data-parallel mesh). The others take the jnp step: "few" with 1 or 2 blocks, or half a
    # block, per device, "stack" on "fsdp" in runs of 64 elements, "bias" with 1 block (never the kernel).
    SHAPES = {"rows": (4 * N, 256), "cols": (4, 256 * N), "both": (8, 1024), "stack": (4, 4, 512),
              "few": (N, 256), "rep": (4, 256), "bias": (256,)}  # few programs to interpret
    CASES = {"fsdp": (mesh_of(N, 1), {"rows": P("fsdp", None), "cols": P(None, "fsdp"), "both": P("fsdp", None),
                                      "stack": P(None, None, "fsdp"), "few": P("fsdp", None), "rep": P(),
                                      "bias": P()}),
             "fsdp_tensor": (mesh_of(N // 2, 2), {"rows": P(("fsdp", "tensor"), None),
                                                  "cols": P(None, ("fsdp", "tensor")), "both": P("tensor", "fsdp"),
                                                  "stack": P("fsdp", None, "tensor"), "few": P("fsdp", "tensor"),
                                                  "rep": P(None, None), "bias": P()}),
             "data": (jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,)), {k: P() for k in SHAPES})}
    SPLIT = {"fsdp": ["rows", "cols", "both", "rep"], "fsdp_tensor": ["rows", "cols", "both", "stack", "rep"],
             "data": ["rows", "cols", "both", "stack", "few", "rep"]}

    def inputs(tx, dtype):  # params, grads, and the state after a jnp step (the checked step reads its moments)
        keys = iter(jax.random.split(jax.random.key(0), 2 * len(SHAPES)))
        params = {k: (jax.random.normal(next(keys), s) * 0.02).astype(dtype) for k, s in SHAPES.items()}
        grads = {k: (jax.random.normal(next(keys), s) * 1e-3).astype(dtype) for k, s in SHAPES.items()}
        with dispatch.force("reference"):
            step = lambda p, g: optim.apply_gradients(tx, g, tx.init(p), p, jax.random.key(1))
            params, state = jax.jit(step)(params, jax.tree.map(lambda x: -x, grads))
        return params, grads, state

    def same(a, b, name, kernel):
        a, b = np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)
        if (kernel and not ON_GPU) or a.dtype.kind in "iu" and a.dtype.itemsize > 1:  # counts: exact
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), name
        elif a.dtype.itemsize == 1:  # codes: but where a value's last bit crosses a rounding boundary
            assert np.mean(a.view(np.uint8) == b.view(np.uint8)) > 0.99, name
        else:
            # The jnp step on sharded tensors: XLA:CPU fuses the sharded program otherwise (test_sharding.py), and
            # so may a compiled kernel whose tiles are cut otherwise per device: ~1 float32 ulp, which moves a
            # bfloat16 param's stochastic rounding to the other grid point now and then (and the next step on).
            a, b = a.astype(np.float32), b.astype(np.float32)
            close = np.isclose(a, b, rtol=1e-5 if a.dtype == b.dtype == np.float32 else 1e-2, atol=1e-7)
            assert np.mean(close) > 0.99 and np.linalg.norm(a - b) <= 1e-3 * np.linalg.norm(b), name

    for fmt in ("fp8", "8bit", "4bit") if ON_GPU else ("fp8",):
        tx = TXS[fmt](1e-3, min_quantized_size=256, use_kernel=True)
        for dtype in (jnp.float32, jnp.bfloat16):  # float32: on one mesh (the same kernel, no rounding offsets)
            params, grads, state = inputs(tx, dtype)
            key = jax.random.key(7)
            step = lambda p, g, s, specs=None: optim.apply_gradients(tx, g, s, p, key, specs)
            with dispatch.force(MODE):  # unsharded: the kernel on one device
                ref = jax.jit(step)(params, grads, state)
            for case in CASES if dtype == jnp.bfloat16 else ["fsdp_tensor"]:
                mesh, specs = CASES[case]
                put = lambda t: {k: jax.device_put(x, NamedSharding(mesh, specs[k])) for k, x in t.items()}
                # the moments as the train step lays them out: blocks split along dim 0 over "fsdp"
                whole = jax.device_put(state, train_sharding.named(train_sharding.state_specs(state, params, mesh),
                                                                   mesh))
                calls.clear()
                optim.adamw._warn_unsplit.cache_clear()  # warned once per case and process: here once per run
                with warnings.catch_warnings(record=True) as caught, dispatch.force(MODE):
                    warnings.simplefilter("always")
                    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                        traced = jax.jit(lambda p, g, s: step(p, g, s, specs)).trace(put(params), put(grads), whole)
                    got = traced.lower().compile()(put(params), put(grads), whole)
                assert sorted(calls) == sorted(SHAPES[k] for k in SPLIT[case]), (fmt, case, calls)
                messages = [str(w.message) for w in caught if "qjax" in str(w.message)]
                unsplit = [k for k in SHAPES if k not in SPLIT[case] and fused_adam.kernel_eligible(
                    params[k], grads[k], state.mu[k], state.nu[k], seeded=True)]  # kernel-eligible on one device
                assert len(messages) == (1 if unsplit else 0), messages
                assert all("through jnp instead of the per-device kernel" in m for m in messages), messages
                assert jax.tree.structure(got) == jax.tree.structure(ref)
                for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(ref)):
                    name = jax.tree_util.keystr(path)
                    same(a, b, f"{fmt} {case} {np.dtype(dtype).name} {name}",
                         kernel=any(f"['{k}']" in name for k in SPLIT[case]))
                print(fmt, case, np.dtype(dtype).name, "ok")

    if not ON_GPU:  # 8-bit and 4-bit: the step lowered for CUDA on emulated Hopper runs one kernel per split tensor
        dispatch.on_hopper_gpu = lambda: True
        for fmt in ("8bit", "4bit"):
            tx = TXS[fmt](1e-3, min_quantized_size=256, use_kernel=True)
            params = grads = {k: jax.ShapeDtypeStruct(shape, jnp.bfloat16) for k, shape in SHAPES.items()}
            state = jax.eval_shape(tx.init, params)
            for case, (mesh, specs) in CASES.items():
                step = lambda p, g, s: optim.apply_gradients(tx, g, s, p, jax.random.key(1), specs)
                with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the jnp tensors' warning (checked above)
                    lowered = jax.jit(step).trace(params, grads, state).lower(lowering_platforms=("cuda",))
                text = lowered.as_text()
                # calls of the kernel's jitted wrapper (shards of one shape share one function and its custom call)
                n_calls = sum("call @_step_call" in line for line in text.splitlines())
                assert n_calls == len(SPLIT[case]) and "mosaic_gpu" in text, (fmt, case, n_calls)
                print(fmt, case, "lowered", "ok")
""")


def _expected(on_gpu: bool) -> list[str]:
    cases = ("fsdp", "fsdp_tensor", "data")
    runs = [f"{fmt} {case} {dtype} ok" for fmt in (("fp8", "8bit", "4bit") if on_gpu else ("fp8",))
            for dtype in ("float32", "bfloat16") for case in (cases if dtype == "bfloat16" else ("fsdp_tensor",))]
    if not on_gpu:
        runs += [f"{fmt} {case} lowered ok" for fmt in ("8bit", "4bit") for case in cases]
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
    # NVLink multicast stays off on the shared multi-GPU machines (as in tests/test_mesh_gpu.py)
    out = _run({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})
    assert out.returncode == 0, out.stdout + out.stderr[-5000:]
    assert out.stdout.split() == _expected(on_gpu=True)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="bit-exact under the interpreter; on GPUs the gpu test")
def test_shard_offsets_8bit():
    """The 8-bit kernel on each of 4 shards, with the shard's first element as offset, equals the unsharded jnp step
    bit for bit (bfloat16 params, stochastic rounding): what each device computes in `fused_step_per_device`."""
    shape, shards = (64, 256), 4
    kp, kg, km, kv = jax.random.split(jax.random.key(3), 4)
    p = (jax.random.normal(kp, shape) * 0.02).astype(jnp.bfloat16)
    g = (jax.random.normal(kg, shape) * 1e-3).astype(jnp.bfloat16)
    mu = blockwise.quantize(jax.random.normal(km, shape) * 1e-3, "dynamic_signed_8bit", 256)
    nu = blockwise.quantize(jax.random.normal(kv, shape) ** 2 * 1e-6, "dynamic_unsigned_8bit", 256)
    config = fused_adam.adam.StateConfig("dynamic_signed_8bit", "dynamic_unsigned_8bit", 256, 0)
    coef = (jnp.float32(0.1), jnp.float32(0.03), jnp.float32(-1e-3))
    seed = jnp.uint32(99)

    def sharded(p, g, mu, nu):
        rows, blocks = shape[0] // shards, mu.codes.shape[0] // shards
        part = lambda s, i: type(s)(s.codes[i * blocks:(i + 1) * blocks], s.absmax[i * blocks:(i + 1) * blocks],
                                    (rows, shape[1]), s.qmap)
        outs = [fused_adam.fused_step(p[i * rows:(i + 1) * rows], g[i * rows:(i + 1) * rows], part(mu, i),
                                      part(nu, i), 0.9, 0.999, 1e-8, *coef, 0.01, seed=seed,
                                      offset=jnp.uint32(i * rows * shape[1]), interpret=True)
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


def test_param_specs_without_a_mesh_is_an_error():
    tx = optim.adamw_8bit(1e-3, use_kernel=True)
    params = {"w": jnp.zeros((64, 256))}
    with pytest.raises(ValueError, match="no mesh is set while tracing"):
        optim.apply_gradients(tx, params, tx.init(params), params, param_specs={"w": P("fsdp", None)})
