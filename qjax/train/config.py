"""Checks a training config (an ml_collections ConfigDict, see configs/llama_base.py) before anything is built.

Every problem is a `ConfigError` (a ValueError) naming the field, what it holds and how to fix it, so `train.py`
can print it as one line instead of a traceback. Model shape fields are checked by the model configs themselves
(`LlamaConfig` / `ViTConfig`) when `qjax.train.task.make_task` builds them.
"""

import os

import qjax
from qjax.data import KINDS, field_problems
from qjax.models import LM_ARCHS, VIT_SIZES
from qjax.train.optimizer import check_optimizer_config

TASKS = ("lm", "image")
# Data kinds with local files, and how to make them when they are missing.
_PREPARE_HINTS = {
    "tokens": "make them with `python -m qjax.data.prepare shakespeare --out {path}` (or `python -m "
              "qjax.data.prepare text --out {path} FILE...` for your own text)",
    "npz": "point config.data.path at an .npz file with train_images / test_images (uint8, (N, H, W, C)) and "
           "train_labels / test_labels ((N,) integers)",
}


class ConfigError(ValueError):
    """A training config field holds something train() cannot use; the message says which field and the fix."""


def _positive_int(config, name: str, minimum: int = 1) -> int:
    value = config.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"config.{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_config(config) -> None:
    """Raise ConfigError for the first bad field of a training config (module docstring)."""
    task = config.get("task")
    if task not in TASKS:
        raise ConfigError(f"config.task must be one of {TASKS}, got {task!r}")
    try:
        recipe = qjax.recipe(config.get("recipe"))
    except ValueError as e:
        raise ConfigError(f"config.recipe: {e}") from None
    arch, sizes = "vit", VIT_SIZES
    if task == "lm":
        arch = config.model.get("arch", "llama")
        if arch not in LM_ARCHS:  # config.model.arch: "lm" only; absent, llama
            raise ConfigError(f"config.model.arch must be one of {tuple(LM_ARCHS)}, got {arch!r}")
        sizes = LM_ARCHS[arch].sizes
        if arch != "llama" and config.get("init_from"):
            raise ConfigError(f"config.init_from loads Hugging Face Llama checkpoints; config.model.arch is {arch!r}: "
                              "unset init_from or train a llama model")
    size = config.model.get("size")
    if size not in sizes:
        raise ConfigError(f"config.model.size {size!r} is not a {arch} preset; valid "
                          f"sizes: {', '.join(sizes)} (change shapes with config.model.<field>=...)")
    for name in ("steps", "batch_size", "grad_accum_steps", "log_every", "keep_checkpoints"):
        _positive_int(config, name)
    if task == "lm":
        _positive_int(config, "seq_len")
        if recipe.is_block_scaled and config.batch_size % config.grad_accum_steps == 0:
            tokens = config.batch_size // config.grad_accum_steps * config.seq_len
            if tokens % 128:
                raise ConfigError(f"recipe {recipe.name!r} is block-scaled: wgrad contracts over the tokens of a "
                                  f"micro-batch, batch_size / grad_accum_steps * seq_len = {tokens}, which must be a "
                                  "multiple of 128; change batch_size, grad_accum_steps or seq_len")
    for name in ("eval_every", "eval_batches", "checkpoint_every"):
        _positive_int(config, name, minimum=0)  # 0 turns it off
    _positive_int(config, "seed", minimum=0)
    if config.get("health_every") is not None:
        _positive_int(config, "health_every", minimum=0)  # 0 turns it off
        saturation, growth = config.get("health_saturation_warn"), config.get("health_amax_growth_warn")
        if not (isinstance(saturation, (int, float)) and 0 < saturation <= 1):
            raise ConfigError(f"config.health_saturation_warn must be a fraction in (0, 1], got {saturation!r}")
        if not (isinstance(growth, (int, float)) and growth > 1):
            raise ConfigError(f"config.health_amax_growth_warn must be a ratio > 1, got {growth!r}")
    min_features = config.get("min_features")
    if min_features is not None:
        _positive_int(config, "min_features", minimum=0)
    keep = config.get("keep_high_precision")
    if keep is not None and (isinstance(keep, str) or not all(isinstance(p, str) for p in keep)):
        raise ConfigError(f"config.keep_high_precision must be a tuple of regex strings, e.g. ('lm_head',), "
                          f"got {keep!r}")
    try:
        check_optimizer_config(config.optimizer, config.steps)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if config.optimizer.get("stochastic_rounding") and config.model.get("param_dtype") != "bfloat16":
        raise ConfigError("config.optimizer.stochastic_rounding rounds bfloat16 params, but config.model.param_dtype "
                          f"is {config.model.get('param_dtype')!r}: set --config.model.param_dtype=bfloat16")
    check_mesh_config(config.get("mesh"))
    check_data_config(config.data)


def check_mesh_config(mesh) -> None:
    """config.mesh holds data / fsdp / tensor sizes: ints >= 1, or -1 (the rest of the devices; for at most one of
    fsdp and tensor, and data's default -1 gives way to theirs).
    Whether they fit the devices is checked once the devices are known (`qjax.train.mesh.axis_sizes`)."""
    if mesh is None:
        raise ConfigError("config.mesh is missing: add data / fsdp / tensor sizes (configs/common.py)")
    rest = []
    for name in ("data", "fsdp", "tensor"):
        value = mesh.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
            raise ConfigError(f"config.mesh.{name} must be an int >= 1 or -1 (the rest of the devices), got {value!r}")
        if value == -1 and name != "data":  # data's -1 gives way (`qjax.train.mesh.axis_sizes`)
            rest.append(f"config.mesh.{name}")
    if len(rest) > 1:
        raise ConfigError(f"{' and '.join(rest)} are both -1: at most one mesh axis takes the rest of the devices")
    if not isinstance(mesh.get("gather_8bit", True), bool):
        raise ConfigError(f"config.mesh.gather_8bit must be True or False, got {mesh.get('gather_8bit')!r}")


def check_data_config(data) -> None:
    """The data kind exists and its local files are there (with the command that makes them when not)."""
    kind = data.get("kind")
    if kind not in KINDS:
        raise ConfigError(f"config.data.kind must be one of {sorted(KINDS)}, got {kind!r}")
    missing, unused = ([f"config.data.{name}" for name in names] for names in field_problems(kind, data))
    if missing:
        raise ConfigError(f"config.data.kind={kind!r} needs {', '.join(missing)} (e.g. --{missing[0]}=...)")
    if unused:
        raise ConfigError(f"{', '.join(unused)} is not used by config.data.kind={kind!r} (it takes "
                          f"{', '.join(sum(KINDS[kind], ())) or 'no fields'}): unset it")
    if kind in _PREPARE_HINTS:
        path = data.get("path")
        if not os.path.exists(path):
            raise ConfigError(f"config.data.path {path!r} does not exist: " + _PREPARE_HINTS[kind].format(path=path))
        if kind == "tokens" and not os.path.isdir(path):
            out = os.path.join("data", os.path.splitext(os.path.basename(path))[0])
            pairs = (" (prompt/answer pairs in JSONL: --config.data.kind=instruct, as configs/llama_finetune.py)"
                     if path.endswith(".jsonl") else "")
            raise ConfigError(f"config.data.path {path!r} is a file, not a token directory (train.bin, val.bin, "
                              "meta.json): make one from it with `python -m qjax.data.prepare text --out "
                              f"{out} {path}` and pass --config.data.path={out}{pairs}")
        if kind == "npz" and os.path.isdir(path):
            raise ConfigError(f"config.data.path {path!r} is a directory, not an .npz file: "
                              + _PREPARE_HINTS[kind])
