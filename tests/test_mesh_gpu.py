"""The mesh checks on real GPUs, and that the FSDP train step runs the Pallas kernels per device.

tests/test_dot_general_mesh.py and tests/train/test_fsdp.py run their scripts on 8 CPU host devices; the `gpu`
tests here run the same scripts on every visible GPU (2, 4 or 8; benchmarks/device_run.sh step
tests-mesh-gpu), where the per-device GEMMs are the compiled kernels, compared with the same kernels on one device.

With several devices, backend "auto" runs the kernels only on device-local arrays (`qjax.dispatch`), so the FSDP
step must trace its quantized GEMMs inside `shard_map`: the kernel check lowers the train step and counts its Mosaic
GPU custom calls, with dispatch's "kernels off" warning as a failure. On the CPU it emulates Hopper on 8 host
devices (dispatch told it is on one, the step lowered for CUDA): the same decisions, taken where CI runs. The
other scripts run the kernels on the GPUs. All four run at once there, each its own process over every GPU, so the
device step takes as long as the longest.
"""

import importlib.util
import os
import pathlib
import subprocess
import sys
import tempfile
import textwrap

import jax
import pytest

import test_dot_general_mesh

ROOT = pathlib.Path(__file__).resolve().parent.parent
# tests/train/test_fsdp.py's scripts (loaded by path: the repository's train.py takes the name "train")
_spec = importlib.util.spec_from_file_location("fsdp_scripts", ROOT / "tests" / "train" / "test_fsdp.py")
test_fsdp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(test_fsdp)
# NVLink multicast stays off on the shared multi-GPU machines (NCCL and the libraries beside it).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

KERNELS = textwrap.dedent("""
    import warnings
    import jax, numpy as np
    import qjax
    from configs import llama_base
    from qjax import dispatch
    from qjax.train import make_mesh, make_task, make_train_step

    ON_GPU = jax.default_backend() == "gpu"
    if not ON_GPU:  # emulate Hopper: dispatch's one question, and the SM count the GEMM kernel's grid reads
        from qjax.kernels import scaled_matmul_mgpu
        dispatch.on_hopper_gpu = lambda: True
        scaled_matmul_mgpu.persistent_ctas = lambda requested, interpret: requested or (2 if interpret else 132)
    N = len(jax.devices())
    SEQ = 32 * N  # 256 tokens per device: the kernels take multiples of 128 (features too)
    rng = np.random.RandomState(0)
    batch = {"inputs": rng.randint(0, 256, (8, SEQ)).astype(np.int32),
             "targets": rng.randint(0, 256, (8, SEQ)).astype(np.int32)}
    cases = (("bf16", "fsdp"), ("int8_rowwise", "fsdp"), ("int8_rowwise", "fsdp_tensor2"),
             ("fp8_tensorwise", "fsdp"), ("int8_dataflow", "fsdp"), ("int8_dataflow_sr", "fsdp"))
    meshes = {"fsdp": dict(fsdp=N), "fsdp_tensor2": dict(fsdp=N // 2, tensor=2)}
    for recipe, name in cases:
        c = llama_base.get_config()
        c.model.update(size="tiny", n_layers=1, dim=128, n_heads=2, n_kv_heads=1, ffn_dim=256, vocab_size=256)
        c.batch_size, c.seq_len, c.steps = 8, SEQ, 4
        if recipe == "int8_dataflow_sr":  # Jetfire's stochastic gradients: a Recipe, not a name
            del c.recipe
            c.recipe = qjax.with_stochastic_gradients(qjax.recipe("int8_dataflow"))
        else:
            c.recipe = recipe
        c.optimizer.warmup_steps = 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            init, step = make_train_step(c, make_task(c, vocab_size=256), make_mesh(**meshes[name]))
            traced = step.trace(jax.eval_shape(init), batch)
            lowered = traced.lower() if ON_GPU else traced.lower(lowering_platforms=("cuda",))
        text = lowered.as_text()
        calls = sum("mosaic_gpu" in line for line in text.splitlines() if "stablehlo.custom_call" in line)
        off = [str(w.message) for w in caught if "qjax" in str(w.message)]
        assert not off, (recipe, name, off)
        assert (calls == 0) == (recipe == "bf16"), (recipe, name, calls)
        print(recipe, name, "ok")
""")
KERNELS_EXPECTED = ["bf16", "fsdp", "ok", "int8_rowwise", "fsdp", "ok", "int8_rowwise", "fsdp_tensor2", "ok",
                    "fp8_tensorwise", "fsdp", "ok", "int8_dataflow", "fsdp", "ok", "int8_dataflow_sr", "fsdp", "ok"]


def _env(cpu_devices: int = 0) -> dict:
    # The caller's PYTHONPATH stays after the repo (the GPU image finds carried wheels, e.g. ml_collections, there).
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    env = dict(os.environ, PYTHONPATH=path, XLA_PYTHON_CLIENT_PREALLOCATE="false", **NO_MULTICAST)
    if cpu_devices:
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={cpu_devices}")
    return env


def _read(file) -> str:
    file.seek(0)
    return file.read()


def test_fsdp_step_runs_kernels_per_device_on_emulated_hopper():
    out = subprocess.run([sys.executable, "-c", KERNELS], env=_env(cpu_devices=8), capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr[-5000:]
    assert out.stdout.split() == KERNELS_EXPECTED


@pytest.mark.gpu
def test_mesh_checks_on_gpus():
    """The kernel check, tests/test_dot_general_mesh.py's script and tests/train/test_fsdp.py's two, on every GPU."""
    if jax.device_count() < 2 or 8 % jax.device_count():
        pytest.skip(f"needs 2, 4 or 8 GPUs (the scripts' meshes split 8 rows), {jax.device_count()} visible")
    scripts = {"kernels": (KERNELS, KERNELS_EXPECTED),
               "dot_general": (test_dot_general_mesh.SCRIPT, test_dot_general_mesh.EXPECTED),
               "meshes": (test_fsdp.GRADS, test_fsdp.EXPECTED_GRADS),
               "state": (test_fsdp.STATE, test_fsdp.EXPECTED_STATE)}
    # Output to files, not pipes: a full pipe would stall a script until its turn to be read.
    logs = {name: (tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for name in scripts}
    running = {name: subprocess.Popen([sys.executable, "-c", script], env=_env(), stdout=logs[name][0],
                                      stderr=logs[name][1], text=True, cwd=ROOT)
               for name, (script, _) in scripts.items()}
    failures = []
    for name, proc in running.items():
        proc.wait(timeout=900)
        out, err = (_read(f) for f in logs[name])
        if proc.returncode or out.split() != scripts[name][1]:
            failures.append(f"{name}: exit {proc.returncode}\n{out}\n{err[-4000:]}")
    assert not failures, "\n\n".join(failures)
