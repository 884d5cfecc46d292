"""Small configs for the training tests (importable as `train_helpers`; conftest puts the repo root on the path)."""

import pathlib
import sys

from configs import llama_base, vit_base

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY_LLAMA = dict(size="tiny", n_layers=1, dim=32, n_heads=2, n_kv_heads=1, ffn_dim=64)


def tiny_llama_command(workdir, token_dir, *flags) -> list[str]:
    """`python train.py --config configs/llama_int8.py` on the tiny Llama, `token_dir`'s corpus and `workdir`, with
    `flags` (--config.steps=..., ...): the argv of the tests that run training as a process."""
    return ([sys.executable, str(ROOT / "train.py"), f"--config={ROOT / 'configs/llama_int8.py'}",
             f"--workdir={workdir}", f"--config.data.path={token_dir}", *flags]
            + [f"--config.model.{k}={v}" for k, v in TINY_LLAMA.items()])


def tiny_llama_config(token_dir, **top):
    """A Llama config that compiles and runs in seconds on a CPU: 1 layer, dim 32, 8 x 32 tokens per step."""
    config = llama_base.get_config()
    config.model.size = "tiny"
    config.model.n_layers = 1
    config.model.dim = 32
    config.model.n_heads = 2
    config.model.n_kv_heads = 1
    config.model.ffn_dim = 64
    config.data.path = token_dir
    config.batch_size, config.seq_len, config.steps = 8, 32, 6
    config.optimizer.warmup_steps = 1
    config.log_every, config.eval_every, config.eval_batches = 2, 3, 1
    config.checkpoint_every, config.keep_checkpoints = 2, 2
    for key, value in top.items():
        setattr(config, key, value)
    return config


def tiny_vit_config(**top):
    config = vit_base.get_config()
    config.model.size = "tiny"
    config.batch_size, config.steps = 32, 6
    config.optimizer.warmup_steps = 1
    config.log_every, config.eval_every, config.eval_batches = 2, 3, 1
    config.checkpoint_every, config.keep_checkpoints = 3, 2
    for key, value in top.items():
        setattr(config, key, value)
    return config
