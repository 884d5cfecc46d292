"""What the multi-GPU benchmarks need before any child process owns a GPU: no jax or torch imported here.

NO_MULTICAST: the environment that keeps NVLink multicast off in NCCL, PyTorch and NVSHMEM (on shared machines it
can take the host's GPUs down); every child process gets it.
"""

import os
import subprocess

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def visible_gpus() -> list[str]:
    """The CUDA_VISIBLE_DEVICES entries of the GPUs this process may use (all that `nvidia-smi -L` lists where the
    variable is unset; none without a GPU)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        return os.environ["CUDA_VISIBLE_DEVICES"].split(",")
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return [str(i) for i in range(sum(line.startswith("GPU ") for line in out.splitlines()))]
