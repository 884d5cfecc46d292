"""FSDP and tensor parallelism on 8 CPU devices: the same loss and gradients as one device, params and optimizer
states split 1/fsdp per device, 8-bit weight all-gathers in the compiled step, checkpoints across mesh shapes.

XLA_FLAGS must be set before jax initialises, so each check runs in a subprocess (as tests/test_dot_general_mesh.py).
A tiny Llama (1 layer, dim 64, 4 heads / 2 KV heads, FFN 128, vocab 256) in float32 compute, so that the bf16
recipe compares to one device up to reduction order. The scripts take their mesh sizes from the device count (2, 4
or 8): tests/test_mesh_gpu.py runs them on every visible GPU, with dims and tokens the kernels take.
"""

import os
import subprocess
import sys
import textwrap

import pytest

_SETUP = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from configs import llama_base
    from qjax.flax import weight_shardings
    from qjax.train import make_mesh, make_task, make_train_step
    from qjax.train import mesh as mesh_lib
    N = len(jax.devices())  # 8 CPU devices here; every GPU in tests/test_mesh_gpu.py
    assert N >= 2 and N % 2 == 0 and 8 % N == 0, jax.devices()
    ON_GPU = jax.default_backend() == "gpu"
    # On a GPU the kernels need multiples of 128 (features, and tokens per device): 256 tokens per device.
    # The vocabulary differs from every layer width, so no float gather of the head has an int8 layer's shape.
    DIM, FFN, SEQ, VOCAB = (128, 256, 32 * N, 384) if ON_GPU else (64, 128, 16, 256)

    def config(recipe, optimizer="adamw"):
        c = llama_base.get_config()
        c.model.update(size="tiny", n_layers=1, dim=DIM, n_heads=4, n_kv_heads=2, ffn_dim=FFN, vocab_size=VOCAB,
                       compute_dtype="float32")
        c.batch_size, c.seq_len, c.steps, c.recipe = 8, SEQ, 4, recipe
        c.optimizer.name, c.optimizer.warmup_steps = optimizer, 1
        return c

    rng = np.random.RandomState(0)
    batch = {"inputs": rng.randint(0, VOCAB, (8, SEQ)).astype(np.int32),
             "targets": rng.randint(0, VOCAB, (8, SEQ)).astype(np.int32)}
    MESHES = {"fsdp": dict(data=1, fsdp=N), "fsdp_tensor2": dict(data=1, fsdp=N // 2, tensor=2),
              "data2_fsdp": dict(data=2, fsdp=N // 2)}
""")

GRADS = _SETUP + textwrap.dedent("""
    import contextlib
    from qjax import dispatch

    def loss_and_grads(task, params, mesh):
        # what the train step runs: params split per the rules, the model traced with the mesh and layer shardings
        shardings = mesh_lib.named(mesh_lib.param_specs(params, mesh), mesh)
        lookup = mesh_lib.layer_sharding(params, mesh)
        key = jax.random.key(1)

        def fn(params, batch):
            with mesh_lib.tracing_on(mesh), weight_shardings(lookup):
                return jax.value_and_grad(lambda p: task.loss(p, batch, key)[0])(params)

        return jax.jit(fn, in_shardings=(shardings, mesh_lib.batch_sharding(mesh)),
                       out_shardings=(mesh_lib.replicated(mesh), shardings))(params, batch)

    cases = {"bf16": list(MESHES), "int8_rowwise": ["fsdp_tensor2", "data2_fsdp"], "fp8_tensorwise": ["fsdp"]}
    for recipe, meshes in cases.items():
        task = make_task(config(recipe), vocab_size=VOCAB)
        params = task.init(jax.random.key(0))
        # GPU: the kernels on one device, as each device runs them ("auto" keeps them off while several GPUs are
        # visible and the arrays are global)
        with dispatch.force("kernel") if ON_GPU else contextlib.nullcontext():
            ref_loss, ref_grads = loss_and_grads(task, params, make_mesh(jax.devices()[:1]))
        for name in meshes:
            loss, grads = loss_and_grads(task, params, make_mesh(**MESHES[name]))
            # bf16: reduction order only. 8-bit: a gradient code may round the other way where an output moved by
            # one float32 ulp (row-parallel partial sums), one step of the 8-bit grid.
            # GPU: the per-device kernels against the same kernels on one device round less predictably (other
            # reduction orders): compared in norm too.
            rtol = 1e-5 if recipe == "bf16" and not ON_GPU else 1e-2
            np.testing.assert_allclose(float(loss), float(ref_loss), rtol=rtol / 10)
            for path, g, r in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(grads),
                                  jax.tree.leaves(ref_grads)):
                g, r = np.asarray(g), np.asarray(r)
                where = f"{recipe} {name} {mesh_lib.path_name(path[0])}"
                np.testing.assert_allclose(g, r, rtol=rtol, atol=rtol * np.abs(r).max(), err_msg=where)
                if ON_GPU:  # fp8: 3.87e-3 measured on 4 GPUs (rounding flips, one e4m3 step each, of ~0.5-1%)
                    err = np.linalg.norm(g - r) / np.linalg.norm(r)
                    assert err < (6e-3 if recipe.startswith("fp8") else 2e-3), f"{where}: relative error {err:.2e}"
            print(recipe, name, "ok")
""")

STATE = _SETUP + textwrap.dedent("""
    import re
    import tempfile
    from jax.sharding import PartitionSpec as P
    from qjax.train.checkpoint import Checkpointer, abstract_like
    from qjax.train.step import train_state_shardings

    # Two meshes that split the state differently: fsdp=4 x tensor=2 and data=2 x fsdp=4 on 8 devices; on 2,
    # fsdp=2 and tensor=2.
    FIRST, OTHER = ("fsdp_tensor2", "data2_fsdp") if N >= 4 else ("fsdp", "fsdp_tensor2")
    c = config("int8_rowwise", optimizer="adamw_8bit")
    task = make_task(c, vocab_size=VOCAB)
    mesh = make_mesh(**MESHES[FIRST])
    F = mesh.shape["fsdp"]
    init, step = make_train_step(c, task, mesh)
    state = init()
    step = step.lower(state, batch).compile()  # compiled once: run below and its HLO read
    state, _ = step(state, batch)

    # Every param with ndim >= 2 and every array of the low-bit moments (codes, scales) is split: a device holds
    # 1/fsdp of it (1/8 of the tensor-parallel kernels under fsdp=4 x tensor=2).
    matrices = [(path, p) for path, p in jax.tree_util.tree_flatten_with_path(state.params)[0] if p.ndim >= 2]
    assert len(matrices) == 6, matrices  # embed, qkv, o, gate_up, down, lm_head
    for path, leaf in matrices:
        assert leaf.addressable_shards[0].data.size * F <= leaf.size, (mesh_lib.path_name(path), leaf.sharding)
    quantized = [p for p in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
                 if mesh_lib.path_name(p[0]).endswith(("codes", "absmax"))]
    assert len(quantized) >= 8, len(quantized)
    for path, leaf in quantized:
        assert leaf.addressable_shards[0].data.size * F == leaf.size, (mesh_lib.path_name(path), leaf.shape)
    print("shards ok")

    # The compiled step gathers the quantized layers' weights as int8 codes: two layouts (forward, dgrad) for each
    # of qkv, o, gate_up, down, and no float gather of any of those shapes. With fp32 AdamW: under fsdp x tensor,
    # the 8-bit AdamW's blocks (flat, split over fsdp) make XLA gather o's and down's float params and moments.
    # The result types of the all-gathers: synchronous on the CPU, async start / done pairs on a GPU, several
    # gathers possibly combined into a tuple.
    c32 = config("int8_rowwise")
    init32, step32 = make_train_step(c32, make_task(c32, vocab_size=VOCAB), mesh)
    gathers = []
    for line in step32.lower(jax.eval_shape(init32), batch).compile().as_text().splitlines():
        result = re.search(r"= (.*?) all-gather(-done)?\\(", line)
        gathers += re.findall(r"(\\w+)\\[([\\d,]*)\\]", result.group(1)) if result else []
    int8_shapes = {shape for dtype, shape in gathers if dtype == "s8"}
    assert sum(dtype == "s8" for dtype, _ in gathers) >= 8, gathers
    floats = [(dtype, shape) for dtype, shape in gathers if dtype in ("f32", "bf16") and shape in int8_shapes]
    assert not floats, (floats, int8_shapes)
    print("int8 gathers ok")

    # fp8: the gathers carry e4m3 codes (read before XLA:CPU's passes, which widen float8 collectives to f16, a
    # CPU-only rewrite: the CPU has no float8 collectives).
    c8 = config("fp8_tensorwise")
    task8 = make_task(c8, vocab_size=VOCAB)
    mesh8 = make_mesh(**MESHES["fsdp"])
    init8, step8 = make_train_step(c8, task8, mesh8)
    text = step8.lower(jax.eval_shape(init8), batch).as_text()
    fp8 = [line for line in text.splitlines() if "all_gather" in line and "f8E4M3FN" in line]
    assert len(fp8) >= 8, len(fp8)
    print("fp8 gathers ok")

    # A checkpoint written under the first mesh restores under the other (each array into the new shards), and
    # training continues: the next step equals the one the first mesh takes.
    with tempfile.TemporaryDirectory() as directory:
        saved = jax.device_get(state)
        ckpt = Checkpointer(directory, keep=1)
        ckpt.save(1, state)
        ckpt.close()
        other = make_mesh(**MESHES[OTHER])
        init2, step2 = make_train_step(c, task, other)
        abstract = jax.eval_shape(init2)
        target = abstract_like(abstract, train_state_shardings(abstract, other))
        restored = Checkpointer(directory, keep=1).restore_latest(target)
        for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        qkv = restored.params["layers_0"]["attn"]["qkv_proj"]["kernel"]
        spec = mesh_lib.param_spec("layers_0/attn/qkv_proj/kernel", qkv.shape, other)
        assert qkv.sharding.mesh.shape == other.shape and qkv.sharding.spec == spec != P(), qkv.sharding
        next_batch = {k: np.roll(v, 1, axis=0) for k, v in batch.items()}
        new_state, new_metrics = step2(restored, next_batch)
        old_state, old_metrics = step(state, next_batch)
        np.testing.assert_allclose(float(new_metrics["loss"]), float(old_metrics["loss"]),
                                   rtol=1e-3 if ON_GPU else 1e-5)  # GPU: other per-device GEMM splits
        leaves = lambda tree: [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree.params)]
        if ON_GPU:  # other GEMM splits round the gradients otherwise: an 8-bit moment's code or an Adam direction
            # where g ~ 0 may flip, moving that param the other way (by up to 2 lr); the updates agree as a whole
            # (10% of their norm) and per param (30%: a flip weighs more in a small norm scale)
            parts = list(zip(*(leaves(t) for t in (new_state, old_state, saved))))
            for name, part in (("all params", [np.concatenate(x) for x in zip(*parts)]), *enumerate(parts)):
                new, old, start = part
                assert np.abs(new - old).max() <= 2 * c.optimizer.lr, (name, np.abs(new - old).max())
                error = np.linalg.norm(new - old) / np.linalg.norm(old - start)
                assert error <= (0.1 if name == "all params" else 0.3), f"{name}: updates {error:.3f} apart"
        else:
            for a, b in zip(leaves(new_state), leaves(old_state)):
                np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)
    print("checkpoint ok")
""")


EXPECTED_GRADS = ["bf16", "fsdp", "ok", "bf16", "fsdp_tensor2", "ok", "bf16", "data2_fsdp", "ok", "int8_rowwise",
                  "fsdp_tensor2", "ok", "int8_rowwise", "data2_fsdp", "ok", "fp8_tensorwise", "fsdp", "ok"]
EXPECTED_STATE = ["shards", "ok", "int8", "gathers", "ok", "fp8", "gathers", "ok", "checkpoint", "ok"]


def _run(script: str) -> str:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=root)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                         cwd=root)
    assert out.returncode == 0, out.stdout + out.stderr[-5000:]
    return out.stdout


def test_meshes_match_one_device():
    """fsdp=8, fsdp=4 x tensor=2 and data=2 x fsdp=4: loss and every gradient as on one device."""
    assert _run(GRADS).split() == EXPECTED_GRADS


def test_split_state_8bit_gathers_and_checkpoint_across_meshes():
    assert _run(STATE).split() == EXPECTED_STATE


def test_mesh_sizes_and_their_errors():
    from qjax.train.mesh import axis_sizes

    assert axis_sizes(8) == (8, 1, 1)
    assert axis_sizes(8, fsdp=-1) == (1, 8, 1)  # data's default -1 gives way
    assert axis_sizes(8, fsdp=4, tensor=2) == (1, 4, 2)
    assert axis_sizes(8, data=2, fsdp=-1) == (2, 4, 1)
    for kwargs, message in ((dict(fsdp=3), "not a multiple of 3"), (dict(data=2, fsdp=2), "has 4 devices"),
                            (dict(fsdp=-1, tensor=-1), "at most one"), (dict(fsdp=0), "positive int or -1")):
        with pytest.raises(ValueError, match=message):
            axis_sizes(8, **kwargs)


def test_config_mesh_errors(token_dir):
    import ml_collections
    from train_helpers import tiny_llama_config

    from qjax.train import ConfigError, check_config

    for field, value, message in (("fsdp", 0, "config.mesh.fsdp must be an int >= 1 or -1"),
                                  ("gather_8bit", 1, "config.mesh.gather_8bit must be True or False")):
        config = tiny_llama_config(token_dir)
        config.mesh = ml_collections.ConfigDict({**config.mesh.to_dict(), field: value})  # as a config file may
        with pytest.raises(ConfigError, match=message):
            check_config(config)
    config = tiny_llama_config(token_dir)
    config.mesh.fsdp = config.mesh.tensor = -1
    with pytest.raises(ConfigError, match="both -1"):
        check_config(config)


def test_sharding_rules_follow_megatron_and_fsdp():
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from qjax.train import mesh as mesh_lib

    class FakeMesh:  # the rules read only axis sizes
        shape = {"data": 1, "fsdp": 4, "tensor": 2}
        axis_names = ("data", "fsdp", "tensor")

    mesh = FakeMesh()
    assert mesh_lib.param_spec("layers_0/attn/qkv_proj/kernel", (64, 128), mesh) == P("fsdp", "tensor")
    assert mesh_lib.param_spec("layers_0/mlp/down_proj/kernel", (128, 64), mesh) == P("tensor", "fsdp")
    assert mesh_lib.param_spec("embed/embedding", (256, 64), mesh) == P("fsdp", None)
    assert mesh_lib.param_spec("layers_0/attn_norm/scale", (64,), mesh) == P(None)
    assert mesh_lib.param_spec("layers_0/attn/o_proj/kernel", (64, 6), mesh) == P("tensor", None)  # 6 % 4
    lookup = mesh_lib.layer_sharding({"layers_0": {"attn": {"o_proj": {"kernel": np.zeros((64, 64))}}}}, mesh)
    o = lookup("layers_0/attn/o_proj")
    assert (o.fsdp, o.fsdp_dim, o.tensor, o.tensor_dim) == ("fsdp", "n", "tensor", "k") and lookup("lm_head") is None
