"""BitNet b1.58 under FSDP on 8 CPU devices: the ternary codes all-gather packed 2 bits per weight (uint8, a quarter
of the weight's element count in the compiled HLO), and loss and gradients equal one device's.

XLA_FLAGS must be set before jax initialises, so the checks run in a subprocess (as tests/test_dot_general_mesh.py).
"""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_on_cpu_devices

from qjax import formats

SCRIPT = textwrap.dedent("""
    import dataclasses
    import re
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import qjax
    N = len(jax.devices())
    assert N == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    x = jax.random.normal(jax.random.key(0), (8, 16, 72), jnp.float32)  # 16 tokens per device
    dims = (((2,), (0,)), ((), ()))  # x (B, T, K) . a Dense kernel w (K, N)

    def gathers(compiled_text):
        # (dtype, element count) of every all-gather's result; several may be combined into a tuple
        found = []
        for line in compiled_text.splitlines():
            result = re.search(r"= (.*?) all-gather(-start|-done)?\\(", line)
            for dtype, shape in re.findall(r"(\\w+)\\[([\\d,]*)\\]", result.group(1)) if result else []:
                found.append((dtype, int(np.prod([int(d) for d in shape.split(",") if d]))))
        return found

    # The weight split along K (9 rows a device: 810 codes, padded to 812 for the packing) or along N.
    for fsdp_dim, w_shape, spec in (("k", (72, 90), P("fsdp", None)), ("n", (72, 96), P(None, "fsdp"))):
        w = jax.random.normal(jax.random.key(1), w_shape, jnp.float32) * 0.05
        cot = jax.random.normal(jax.random.key(2), (8, 16, w_shape[1]), jnp.float32)
        sharding = qjax.WeightSharding(("fsdp",), fsdp="fsdp", fsdp_dim=fsdp_dim)
        bf16_backward = dataclasses.replace(qjax.recipe("bitnet_b158"), name="bitnet_b158_bf16_backward", dgrad=None,
                                            wgrad=None)
        for recipe in (qjax.recipe("bitnet_b158"), bf16_backward):
            def loss(x, w, sharding):
                return jnp.sum(qjax.dot_general(x, w, dims, recipe=recipe, sharding=sharding) * cot)

            grad = jax.value_and_grad(loss, argnums=(0, 1))

            def on_mesh(x, w):
                with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                    return grad(x, w, sharding)

            ref = jax.jit(grad, static_argnums=2)(x, w, None)
            sharded = jax.jit(on_mesh, in_shardings=(NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, spec)))
            compiled = sharded.lower(x, w).compile()
            got = compiled(x, w)
            # Same codes and scales as one device (the mean |w| a pmean of the shards' means: float32 rounding);
            # dw's per-device partial sums are added in another order.
            for a, b, name in zip(jax.tree.leaves(got), jax.tree.leaves(ref), ("loss", "dx", "dw")):
                a, b = np.asarray(a), np.asarray(b)
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max(), err_msg=recipe.name + name)
            assert got[1][1].sharding.is_equivalent_to(NamedSharding(mesh, spec), 2), got[1][1].sharding
            # The weight crosses the mesh only as packed ternary codes: uint8, a quarter of its elements, one
            # gather per layout read (forward (N, K); bitnet_b158's dgrad (K, N) too; the bf16 backward's dgrad
            # reads the forward's), never int8 or float.
            found = gathers(compiled.as_text())
            packed = [n for dtype, n in found if dtype == "u8"]
            assert packed == [N * -(-w.size // N // 4)] * (2 if recipe.name == "bitnet_b158" else 1), (found, w.size)
            assert all(dtype == "u8" for dtype, _ in found), found
            print(fsdp_dim, recipe.name, "ok")

    # What the train step runs: a tiny Llama (float32 compute) with configs/llama_bitnet.py's recipe, params split
    # by the sharding rules over fsdp=8, every projection's ternary codes gathered packed: loss and every gradient
    # as on one device.
    from configs import llama_bitnet
    from qjax.flax import weight_shardings
    from qjax.train import make_mesh, make_task
    from qjax.train import mesh as mesh_lib

    c = llama_bitnet.get_config()
    c.model.update(size="tiny", n_layers=1, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256,
                   compute_dtype="float32")
    c.batch_size, c.seq_len = 8, 16
    task = make_task(c, vocab_size=256)
    params = task.init(jax.random.key(0))
    rng = np.random.RandomState(0)
    batch = {k: rng.randint(0, 256, (8, 16)).astype(np.int32) for k in ("inputs", "targets")}

    def loss_and_grads(mesh):
        shardings = mesh_lib.named(mesh_lib.param_specs(params, mesh), mesh)
        lookup = mesh_lib.layer_sharding(params, mesh)

        def fn(params, batch):
            with mesh_lib.tracing_on(mesh), weight_shardings(lookup):
                return jax.value_and_grad(lambda p: task.loss(p, batch, jax.random.key(1))[0])(params)

        jitted = jax.jit(fn, in_shardings=(shardings, mesh_lib.batch_sharding(mesh)),
                         out_shardings=(mesh_lib.replicated(mesh), shardings))
        return jitted(params, batch), jitted.lower(params, batch).compile().as_text()

    (ref_loss, ref_grads), _ = loss_and_grads(make_mesh(jax.devices()[:1]))
    # fsdp=8; and fsdp=4 x tensor=2, where mean |w| spans both axes' shards
    for mesh in (make_mesh(data=1, fsdp=N // 2, tensor=2), make_mesh(data=1, fsdp=N)):
        (loss, grads), text = loss_and_grads(mesh)
        # 8-bit: a gradient code may round the other way where an output moved by one float32 ulp (as
        # tests/train/test_fsdp.py allows)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-3)
        for path, g, r in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(grads),
                              jax.tree.leaves(ref_grads)):
            g, r = np.asarray(g), np.asarray(r)
            np.testing.assert_allclose(g, r, rtol=1e-2, atol=1e-2 * np.abs(r).max(),
                                       err_msg=f"{dict(mesh.shape)} {mesh_lib.path_name(path[0])}")
    # fsdp=8: qkv, o, gate_up, down each gathered in two layouts as uint8, a quarter of the kernel's elements; no int8
    kernels = {mesh_lib.path_name(p): leaf.size for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
               if "layers_0" in mesh_lib.path_name(p) and leaf.ndim == 2}
    found = gathers(text)
    assert sorted(n for dtype, n in found if dtype == "u8") == sorted(2 * [n // 4 for n in kernels.values()]), (
        found, kernels)
    assert not [g for g in found if g[0] == "s8"], found
    print("llama fsdp ok")
""")

EXPECTED = ["k", "bitnet_b158", "ok", "k", "bitnet_b158_bf16_backward", "ok", "n", "bitnet_b158", "ok", "n",
            "bitnet_b158_bf16_backward", "ok", "llama", "fsdp", "ok"]


def test_fsdp_gathers_packed_ternary_codes_and_matches_one_device():
    stdout = run_on_cpu_devices(SCRIPT, 8)
    assert stdout.split() == EXPECTED, stdout


@pytest.mark.parametrize("shape", [(4,), (3, 8), (2, 5, 12)])
def test_pack_ternary_round_trips_four_codes_a_byte(shape):
    codes = jax.random.randint(jax.random.key(0), shape, -1, 2).astype(jnp.int8)
    packed = formats.pack_ternary(codes)
    assert packed.dtype == jnp.uint8 and packed.shape == (*shape[:-1], shape[-1] // 4)
    np.testing.assert_array_equal(formats.unpack_ternary(packed), codes)
    # element 4i in the high bits of byte i, each code stored as code + 1
    np.testing.assert_array_equal(formats.pack_ternary(jnp.array([-1, 0, 1, 1], jnp.int8)), [0b00011010])
