"""`qjax.dot_general` under a context mesh of 8 CPU devices: the GEMMs run per device inside `jax.shard_map` and
give the unsharded results (scales from global amax; weight gradient summed over devices), also under vmap and scan,
and so does a norm fused with its linear layer (`qjax.prologue`).

XLA_FLAGS must be set before jax initialises, so the checks run in a subprocess. Only the reference (XLA) path can
run per device here: the Mosaic GPU interpreter does not run on several CPU devices at once (it fails with
"Barrier remains allocated", jax 0.11.2); the kernels' part (`row_axes` in the fused quantize kernel) is checked
on a one-device mesh in tests/kernels/test_quantize_mgpu.py. The same script runs on every visible GPU (2, 4
or 8) in tests/test_mesh_gpu.py, where the per-device GEMMs are the compiled kernels.
"""

import os
import subprocess
import sys
import textwrap

from helpers import cpu_devices_env

SCRIPT = textwrap.dedent("""
    import contextlib
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import qjax
    from qjax import dispatch
    N = len(jax.devices())  # 8 CPU devices here; every GPU in tests/test_mesh_gpu.py
    assert N >= 2 and N % 2 == 0 and 16 % N == 0, jax.devices()
    ON_GPU = jax.default_backend() == "gpu"
    mesh = Mesh(np.array(jax.devices()).reshape(N // 2, 2), ("data", "model"))
    x = jax.random.normal(jax.random.key(0), (16, 64, 256), jnp.float32)  # 1024 / N tokens per device

    def unsharded(fn, *args, static_argnums=()):
        # GPU: the kernels on one device, as each device runs them ("auto" keeps them off while several GPUs are
        # visible and no mesh is set)
        with dispatch.force("kernel") if ON_GPU else contextlib.nullcontext():
            return jax.jit(fn, static_argnums=static_argnums)(*args)

    def close(a, b, rtol, name):
        a, b = np.asarray(a), np.asarray(b)
        if ON_GPU:
            # Other summation orders (the tokens split, the weight gradient summed over devices; compiled kernels
            # round less predictably than XLA:CPU), so an 8-bit code may round the other way where an output moved
            # by an ulp. Per-device scales instead of global ones would be ~1e-2 off in norm.
            err = np.linalg.norm(a - b) / np.linalg.norm(b)
            assert err < 2e-3, f"{name}: relative error {err:.2e}"
            rtol = max(rtol, 2e-2)
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.abs(b).max(), err_msg=name)

    def mosaic_calls(jitted, *args):
        text = jitted.lower(*args).as_text()
        return sum("mosaic_gpu" in line for line in text.splitlines() if "stablehlo.custom_call" in line)
    w = jax.random.normal(jax.random.key(1), (256, 384), jnp.float32) * 0.05
    dims = (((2,), (0,)), ((), ()))

    def loss(x, w, recipe, key):
        return jnp.sum(qjax.dot_general(x, w, dims, recipe=recipe, key=key) ** 2)

    grad = jax.value_and_grad(loss, argnums=(0, 1))

    def on_mesh(x, w, recipe, key):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return grad(x, w, recipe, key)

    shardings = (NamedSharding(mesh, P(("data", "model"))), NamedSharding(mesh, P()))
    sr = qjax.recipes.with_stochastic_gradients(qjax.recipes.recipe("int8_rowwise"))
    for recipe in ["int8_rowwise", "fp8_tensorwise", "fp8_blockwise", sr]:
        key = jax.random.key(3)
        jaxpr = str(jax.make_jaxpr(on_mesh, static_argnums=2)(x, w, recipe, key))
        assert "shard_map" in jaxpr and "psum" in jaxpr, recipe  # per device, weight gradient summed
        if recipe != "fp8_blockwise":  # tensor / per-feature scales span the tokens: global amax
            assert "pmax" in jaxpr, recipe
        ref = unsharded(grad, x, w, recipe, key, static_argnums=2)
        mesh_grad = jax.jit(on_mesh, static_argnums=2, in_shardings=(*shardings, None))
        if ON_GPU:  # the per-device GEMMs are the Pallas kernels
            assert mosaic_calls(mesh_grad, x, w, recipe, key) > 0, recipe
        got = mesh_grad(x, w, recipe, key)
        names = ("loss", "dx", "dw")
        if recipe is sr:
            # per-device rounding streams: not the unsharded bits, the same values up to rounding noise
            for a, b, name in zip(jax.tree.leaves(got), jax.tree.leaves(ref), names):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0.05, atol=0.05 * np.abs(b).max(),
                                           err_msg=name)
        else:
            # Nearest rounding: the same codes and scales as unsharded; dw's per-device partial sums are added
            # in another order (float32 rounding). Per-device scales would be off by ~1e-2 here.
            for a, b, name in zip(jax.tree.leaves(got), jax.tree.leaves(ref), names):
                close(a, b, 1e-5 if name == "dw" else 1e-6, f"{recipe} {name}")
        assert got[1][0].sharding.spec == P(("data", "model")), got[1][0].sharding
        print("sr" if recipe is sr else recipe, "ok")

    # Under vmap and scan (arrays on the mesh; the per-example lhs leads with 16 rows, split N ways).
    xs = jax.device_put(x[:3, :16], NamedSharding(mesh, P()))
    w_rep = jax.device_put(w, NamedSharding(mesh, P()))
    f = lambda xi, w: jnp.sum(qjax.dot_general(xi, w, (((1,), (0,)), ((), ())), recipe="int8_rowwise") ** 2)
    per_example = jax.vmap(jax.grad(f, argnums=(0, 1)), in_axes=(0, None))
    summed = lambda xs, w: jax.lax.scan(lambda c, xi: (c + f(xi, w), None), 0.0, xs)[0]
    for name, fn in (("vmap", per_example), ("scan", jax.grad(summed, argnums=(0, 1)))):
        def traced(xs, w, fn=fn):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return fn(xs, w)
        assert "shard_map" in str(jax.make_jaxpr(traced)(xs, w_rep)), name
        for a, b in zip(jax.tree.leaves(jax.jit(traced)(xs, w_rep)), jax.tree.leaves(unsharded(fn, x[:3, :16], w))):
            close(a, b, 1e-5, name)
        print(name, "ok")

    # A norm fused with its linear layer (qjax.prologue, the data-flow recipes) runs per device the same way, also
    # where its backward recomputes the norm's output for wgrad.
    import dataclasses
    from qjax.models import ops
    from qjax.prologue import prologue_dot
    norm = ops.rms_norm_prologue(1e-5, jnp.float32)
    scale = 1 + 0.1 * jax.random.normal(jax.random.key(5), (256,))
    fp8_flow = qjax.recipe("fp8_dataflow")
    for recipe in (fp8_flow, dataclasses.replace(fp8_flow, recompute_prologue_output=True)):
        fused = lambda x, scale, w: jnp.sum(prologue_dot(norm, x, (scale,), w, recipe=recipe) ** 2)
        fused_grad = jax.value_and_grad(fused, argnums=(0, 1, 2))

        def fused_on_mesh(x, scale, w):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return fused_grad(x, scale, w)

        assert "shard_map" in str(jax.make_jaxpr(fused_on_mesh)(x, scale, w))
        got = jax.jit(fused_on_mesh, in_shardings=(shardings[0], None, None))(x, scale, w)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(unsharded(fused_grad, x, scale, w))):
            close(a, b, 1e-5, "prologue")
    print("prologue ok")

    # Left to XLA (no shard_map): a leading dim that does not split evenly over the N devices, and batch dims.
    uneven = x[:N - 1]
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        assert "shard_map" not in str(jax.make_jaxpr(lambda x, w: grad(x, w, "int8_rowwise", None))(uneven, w))
        batched = lambda a, b: qjax.dot_general(a, b, (((2,), (2,)), ((0,), (0,))), recipe="int8_rowwise")
        assert "shard_map" not in str(jax.make_jaxpr(batched)(x[:8], x[:8]))
    print("fallbacks ok")
""")


EXPECTED = ["int8_rowwise", "ok", "fp8_tensorwise", "ok", "fp8_blockwise", "ok", "sr", "ok", "vmap", "ok", "scan",
            "ok", "prologue", "ok", "fallbacks", "ok"]


def test_per_device_gemms_on_8_cpu_devices_match_unsharded():
    env = cpu_devices_env(8)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stdout + out.stderr[-5000:]
    assert out.stdout.split() == EXPECTED, out.stdout
