"""The fused AdamW step per device under a mesh (`apply_gradients(..., param_specs=)`): each tensor whose shards are
whole state blocks (split along dim 0, along one inner dim as FSDP's row-parallel kernels and LM heads are, along
both, or whole on every device as under data parallelism) runs the kernel on its shards inside `jax.shard_map`, and
the result equals the unsharded step's, bit for bit (bfloat16 params with stochastic rounding included: the kernel
hashes each element's index in the whole param); the other tensors take the jnp step, with one warning that names
why (equal to ~1 float32 ulp: XLA:CPU fuses the sharded program otherwise, as in tests/optim/test_sharding.py); a
data-parallel mesh gives no warning.

XLA_FLAGS must be set before jax initialises, so the mesh checks run in a subprocess on 8 CPU devices. There the
kernel runs under the Mosaic GPU interpreter for e4m3 states only: with 8-bit or 4-bit states each program copies
its code tables to SMEM behind a barrier, and the interpreter, shared by the devices running at once, then fails
with "Barrier remains allocated" (jax 0.11.2). For those the script lowers the step for CUDA on emulated Hopper and
counts the kernel calls (one per tensor the kernel takes), and `test_shard_offsets` runs the kernel shard by shard
on one device with each shard's offset and runs. The `gpu` test runs the same script on every visible GPU
(compiled kernels, all three state formats, compared with the kernel on one device)."""

import functools
import math
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import cpu_devices_env
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
    from qjax.train import mesh as train_mesh

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
    # every param on the data-parallel mesh); "head", whose column shards cut blocks, moves to a split along dim 0.
    # The others take the jnp step: "few" with 1 or 2 blocks, or half a block, per device, "bias" with 1 block (never
    # the kernel).
    SHAPES = {"rows": (4 * N, 256), "cols": (4, 256 * N), "both": (8, 1024), "stack": (4, 4, 512),
              "head": (8 * N, 384), "few": (N, 256), "rep": (4, 256), "bias": (256,)}  # few programs to interpret
    CASES = {"fsdp": (mesh_of(N, 1), {"rows": P("fsdp", None), "cols": P(None, "fsdp"), "both": P("fsdp", None),
                                      "stack": P(), "head": P(None, "fsdp"),
                                      "few": P("fsdp", None), "rep": P(),
                                      "bias": P()}),
             "fsdp_tensor": (mesh_of(N // 2, 2), {"rows": P(("fsdp", "tensor"), None),
                                                  "cols": P(None, ("fsdp", "tensor")), "both": P("tensor", "fsdp"),
                                                  "stack": P("fsdp", None, "tensor"), "few": P("fsdp", "tensor"),
                                                  "head": P(None, ("fsdp", "tensor")), "rep": P(None, None),
                                                  "bias": P()}),
             "data": (jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,)), {k: P() for k in SHAPES})}
    SPLIT = {"fsdp": ["rows", "cols", "both", "stack", "head", "rep"],
             "fsdp_tensor": ["rows", "cols", "both", "stack", "head", "rep"]}

    def kernel_params(case, params, grads, state):  # on the data-parallel mesh: every tensor the kernel takes
        eligible = lambda k: fused_adam.kernel_eligible(params[k], grads[k], state.mu[k], state.nu[k], seeded=True)
        return SPLIT[case] if case in SPLIT else [k for k in SHAPES if eligible(k)]

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
                whole = jax.device_put(state, train_mesh.named(train_mesh.state_specs(state, params, mesh),
                                                                   mesh))
                calls.clear()
                optim.adamw._warn_unsplit.cache_clear()  # warned once per case and process: here once per run
                with warnings.catch_warnings(record=True) as caught, dispatch.force(MODE):
                    warnings.simplefilter("always")
                    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                        traced = jax.jit(lambda p, g, s: step(p, g, s, specs)).trace(put(params), put(grads), whole)
                    got = traced.lower().compile()(put(params), put(grads), whole)
                split = kernel_params(case, params, grads, state)
                assert sorted(calls) == sorted(SHAPES[k] for k in split), (fmt, case, calls)
                messages = [str(w.message) for w in caught if "qjax" in str(w.message)]
                unsplit = [k for k in SHAPES if k not in split and fused_adam.kernel_eligible(
                    params[k], grads[k], state.mu[k], state.nu[k], seeded=True)]  # kernel-eligible on one device
                assert len(messages) == (1 if unsplit else 0), messages
                assert all("through jnp instead of the per-device kernel" in m for m in messages), messages
                assert jax.tree.structure(got) == jax.tree.structure(ref)
                for k in split:  # the new params keep their layout ("head" comes back from its dim-0 split)
                    assert got[0][k].sharding.is_equivalent_to(NamedSharding(mesh, specs[k]), len(SHAPES[k])), k
                for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(ref)):
                    name = jax.tree_util.keystr(path)
                    same(a, b, f"{fmt} {case} {np.dtype(dtype).name} {name}",
                         kernel=any(f"['{k}']" in name for k in split))
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
                assert n_calls == len(kernel_params(case, params, grads, state)) and "mosaic_gpu" in text, (
                    fmt, case, n_calls)
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
    env = {**os.environ, **env_extra, "PYTHONPATH": path, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                          cwd=ROOT)


def test_per_device_step_on_8_cpu_devices_equals_unsharded():
    out = _run(cpu_devices_env(8))
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
@pytest.mark.parametrize("formats, block, split", [
    (("dynamic_signed_8bit", "dynamic_unsigned_8bit"), 256, 0),  # FSDP's column-parallel kernels, embeddings
    (("dynamic_signed_8bit", "dynamic_unsigned_8bit"), 256, 1),  # row-parallel kernels, LM heads
    (("dynamic_signed_4bit", "linear_unsigned_4bit"), 128, 1)])
def test_shard_offsets(formats, block, split):
    """The kernel on each of 4 shards of a param split along `split`, with the shard's offset and runs, equals the
    unsharded jnp step bit for bit (bfloat16 params, stochastic rounding), and so does the reference with the same
    offset and runs: what each device computes in `fused_step_per_device`."""
    shape, shards = (16, 1024), 4
    kp, kg, km, kv = jax.random.split(jax.random.key(3), 4)
    p = (jax.random.normal(kp, shape) * 0.02).astype(jnp.bfloat16)
    g = (jax.random.normal(kg, shape) * 1e-3).astype(jnp.bfloat16)
    mu = blockwise.quantize(jax.random.normal(km, shape) * 1e-3, formats[0], block)
    nu = blockwise.quantize(jax.random.normal(kv, shape) ** 2 * 1e-6, formats[1], block)
    config = fused_adam.adam.StateConfig(*formats, block, 0)
    args = (0.9, 0.999, 1e-8, jnp.float32(0.1), jnp.float32(0.03), jnp.float32(-1e-3), 0.01)
    seed = jnp.uint32(99)
    local = list(shape)
    local[split] //= shards
    runs = None if split == 0 else (local[1], shape[1])
    view = (shape[0], -1) if split else (-1,)  # the state's blocks as the param's dims (`fused_step_per_device`)

    def part(x, i, dim):  # shard i of x along dim
        return jax.lax.slice_in_dim(x, i * x.shape[dim] // shards, (i + 1) * x.shape[dim] // shards, axis=dim)

    def state_part(s, i):
        leaves = [part(a.reshape(*view, *a.shape[1:]), i, split).reshape(-1, *a.shape[1:]) for a in jax.tree.leaves(s)]
        return type(s)(*leaves, tuple(local), s.qmap)

    def sharded(step, p, g, mu, nu):
        outs = [step(part(p, i, split), part(g, i, split), state_part(mu, i), state_part(nu, i),
                     offset=jnp.uint32(i * math.prod(local) if split == 0 else i * local[1])) for i in range(shards)]
        whole = lambda xs: jnp.concatenate([x.reshape(*view, *x.shape[1:]) for x in xs], axis=split).reshape(
            -1, *xs[0].shape[1:])
        return [jnp.concatenate([o[0] for o in outs], axis=split)] + [
            whole([getattr(o[j], f) for o in outs]) for j in (1, 2) for f in ("codes", "absmax")]

    kernel = lambda p, g, mu, nu, offset: fused_adam.fused_step(p, g, mu, nu, *args, seed=seed, offset=offset,
                                                                 runs=runs, interpret=True)
    reference = lambda p, g, mu, nu, offset: fused_adam.fused_step_reference(p, g, mu, nu, config, *args[:3],
                                                                             *args[3:], seed, offset, runs)
    ref = jax.jit(lambda p, g, mu, nu: fused_adam.fused_step_reference(p, g, mu, nu, config, *args, seed))(
        p, g, mu, nu)
    ref = [ref[0], ref[1].codes, ref[1].absmax, ref[2].codes, ref[2].absmax]
    for step in (kernel, reference):
        got = jax.jit(functools.partial(sharded, step))(p, g, mu, nu)
        for a, b in zip(got, ref, strict=True):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    assert not np.array_equal(np.asarray(ref[0]), np.asarray(fused_adam.sr_params.round_param(
        p.astype(jnp.float32), jnp.bfloat16, seed)))  # the step moved the params


def test_per_device_layout():
    """Which layouts the per-device kernel takes (`fused_adam.per_device_layout`), and why not the others."""
    mesh = jax.sharding.AbstractMesh((4, 2), ("fsdp", "tensor"))
    state = lambda shape, block=256: blockwise.quantize(jnp.zeros(shape), "e4m3", block)
    layout = lambda shape, spec: fused_adam.per_device_layout(jnp.zeros(shape), state(shape), spec, mesh)
    covered = {((4096, 1024), P("fsdp", "tensor")): ((("fsdp",), ("tensor",)), 1),  # column-parallel kernel
               ((4096, 1024), P("tensor", "fsdp")): ((("tensor",), ("fsdp",)), 1),  # row-parallel kernel
               ((1024, 8192), P(None, "fsdp")): (((), ("fsdp",)), 1),  # LM head
               ((8192, 1024), P(("fsdp", "tensor"))): ((("fsdp", "tensor"), ()), 0),
               ((4, 8, 1024), P("fsdp", None, "tensor")): ((("fsdp",), (), ("tensor",)), 2),
               ((64, 1280), P(None, "fsdp")): ((("fsdp",), ()), 0),  # columns cut blocks: moved to dim 0
               ((64, 256), P()): (((), ()), 0),  # data parallel: whole on every device
               ((64, 256), None): (((), ()), 0)}
    for (shape, spec), (axes, inner) in covered.items():
        assert layout(shape, spec) == (fused_adam.ShardLayout(axes, inner), None), (shape, spec)
    refused = {((4096, 1024), P("fsdp", "data")): "names an axis the mesh",
               ((4, 8, 1024), P(None, "fsdp", "tensor")): "splits dims [1, 2] past dim 0",
               ((6, 1024), P("fsdp", None)): "shape (6, 1024) does not split evenly",
               ((8, 256), P(None, "fsdp")): "runs of 64 consecutive elements, is not a multiple of 4 whole",
               ((8, 256), P("fsdp", None)): "is not a multiple of 4 whole state blocks of 256",
               ((64, 256), P(None, None, "fsdp")): "does not lay out a param of shape (64, 256)"}
    for (shape, spec), reason in refused.items():
        got, why = layout(shape, spec)
        assert got is None and reason in why, (shape, spec, why)


def test_param_specs_without_a_mesh_is_an_error():
    tx = optim.adamw_8bit(1e-3, use_kernel=True)
    params = {"w": jnp.zeros((64, 256))}
    with pytest.raises(ValueError, match="no mesh is set while tracing"):
        optim.apply_gradients(tx, params, tx.init(params), params, param_specs={"w": P("fsdp", None)})
