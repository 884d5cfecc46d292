"""The config of a training run (an ml_collections ConfigDict, see configs/llama_base.py): its checks, its fields and
the config.json a workdir keeps.

Checks. `train()` runs each check once, before anything is built: `check_config` (every field, the data files), then
`check_batch_size` (once the mesh is known) and, after the train state's shapes are known, the memory estimate
(`qjax.train.step.check_fits`); `check_resume` when a checkpoint is restored. The builders that benchmarks and tests
call alone (`make_train_step`, `make_optimizer`) check the fields they read themselves, unless `train()` calls them
with check=False, having checked the whole config already (`Checkpointer` takes a checked keep_checkpoints;
`qjax.data.make_dataset`, a lower layer's public function, still validates its own arguments). Every problem is a
`ConfigError` (a ValueError) naming the field, what it holds and how to fix it, so `train.py` can print it as one
line instead of a traceback. Model shape fields, and what the data dictates (vocabulary, image shape), are checked by
`qjax.train.task.make_task` as it builds the model config.

Fields, for train.py:

  config = load_config("configs/llama_int8.py")
  print(show_config(config, "configs/llama_int8.py"))   # "steps = 300  # optimizer steps of the run ..." per field
  unknown_override_error(["--config.step=30"], config, "configs/llama_int8.py")
  # -> "unknown config field 'step'; did you mean 'steps'? (python train.py --config configs/llama_int8.py
  #     --show_config lists the fields)"

A field's doc is its trailing comment in the config file, or in the base config it imports (`from configs import
llama_base`): configs/llama_base.py and configs/vit_base.py put one field per line with its comment, so the doc
lives beside the default it describes and cannot drift into a separate table.

config.json: `write_config` at every start (process 0); on a resume `config_changes(read_saved_config(workdir),
config)` lists the fields changed since the last start (["steps 300 -> 400", ...]).
"""

import ast
import difflib
import importlib.util
import io
import json
import math
import os
import pathlib
import re
import tokenize
from typing import Any

from ml_collections import config_dict

import qjax
from qjax.data import KINDS, field_problems
from qjax.models import LM_ARCHS, VIT_SIZES
from qjax.optim.adam import is_real_number
from qjax.train.mesh import batch_axes, is_main_process

TASKS = ("lm", "image")
OPTIMIZERS = ("adamw", "adamw_8bit", "adamw_4bit", "adamw_fp8")  # config.optimizer.name (`qjax.train.optimizer`)
CONFIG_FILE = "config.json"
# Data kinds with local files, and how to make them when they are missing.
_PREPARE_HINTS = {
    "tokens": "make them with `python -m qjax.data.prepare shakespeare --out {path}` (or `python -m "
              "qjax.data.prepare text --out {path} FILE...` for your own text)",
    "npz": "point config.data.path at an .npz file with train_images / test_images (uint8, (N, H, W, C)) and "
           "train_labels / test_labels ((N,) integers)",
}


class ConfigError(ValueError):
    """A training config field holds something train() cannot use; the message says which field and the fix."""


def _is_number(value) -> bool:
    """A finite int or float, not a bool (`qjax.optim.adam.is_real_number`)."""
    return is_real_number(value) and math.isfinite(value)


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
    _check_step_fields(config)
    for name in ("log_every", "keep_checkpoints"):
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
    if config.optimizer.get("stochastic_rounding") and config.model.get("param_dtype") != "bfloat16":
        raise ConfigError("config.optimizer.stochastic_rounding rounds bfloat16 params, but config.model.param_dtype "
                          f"is {config.model.get('param_dtype')!r}: set --config.model.param_dtype=bfloat16")
    check_mesh_config(config.get("mesh"))
    check_data_config(config.data)


def _check_step_fields(config) -> None:
    """The fields the train step reads: steps, batch_size, grad_accum_steps, seed and config.optimizer."""
    for name in ("steps", "batch_size", "grad_accum_steps"):
        _positive_int(config, name)
    _positive_int(config, "seed", minimum=0)
    check_optimizer_config(config.optimizer, config.steps)


def check_train_step(config, mesh) -> None:
    """What `make_train_step` needs of a config `train()` has not checked (benchmarks, tests): the step's fields
    and the batch split over `mesh`."""
    _check_step_fields(config)
    check_batch_size(config, mesh)


def get_field(cfg, name: str, default: Any = None) -> Any:
    """Field `name` of an optimizer config: a ConfigDict, dict or dataclass."""
    return cfg.get(name, default) if hasattr(cfg, "get") else getattr(cfg, name, default)


def check_optimizer_config(opt, total_steps: int) -> None:
    """ConfigError naming the bad field of an optimizer config (see `qjax.train.optimizer.make_optimizer`) and how
    to fix it; `total_steps` (config.steps) is a positive int."""
    name = get_field(opt, "name")
    if name not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {name!r}; set config.optimizer.name to one of {', '.join(OPTIMIZERS)}")
    lr = get_field(opt, "lr")
    if not _is_number(lr) or not lr > 0:
        raise ConfigError(f"config.optimizer.lr must be a positive number, got {lr!r}")
    warmup = get_field(opt, "warmup_steps")  # None: a default below total_steps (`qjax.train.optimizer.warmup_steps`)
    if warmup is not None and (not isinstance(warmup, int) or not 0 <= warmup < total_steps):
        raise ConfigError(f"config.optimizer.warmup_steps must be an int in [0, steps={total_steps}), got "
                          f"{warmup!r}; lower it or raise config.steps")
    ratio = get_field(opt, "min_lr_ratio", 0.1)
    if not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
        raise ConfigError(f"config.optimizer.min_lr_ratio must be in [0, 1], got {ratio!r}")
    for field in ("b1", "b2"):
        value = get_field(opt, field)
        if not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise ConfigError(f"config.optimizer.{field} must be in [0, 1), got {value!r}")
    for field in ("eps", "weight_decay"):
        value = get_field(opt, field)
        if not _is_number(value) or not value >= 0:
            raise ConfigError(f"config.optimizer.{field} must be a finite number >= 0, got {value!r}")
    clip = get_field(opt, "grad_clip")
    if clip is not None and (not _is_number(clip) or not clip >= 0):
        raise ConfigError(f"config.optimizer.grad_clip must be a finite number >= 0 (0 or None: no clipping), got "
                          f"{clip!r}")
    for field in ("dynamic_range_expansion", "stochastic_rounding"):
        if get_field(opt, field, False) not in (True, False):
            raise ConfigError(f"config.optimizer.{field} must be True or False, got {get_field(opt, field)!r}")
    if get_field(opt, "dynamic_range_expansion", False) and name != "adamw_fp8":
        raise ConfigError(f"config.optimizer.dynamic_range_expansion applies to adamw_fp8 states only, not {name!r}: "
                          "set config.optimizer.name=adamw_fp8 or leave it False")


def check_batch_size(config, mesh) -> None:
    """Each micro-batch (batch_size / grad_accum_steps examples, both checked ints) must split evenly over the
    data x fsdp devices of `mesh`."""
    batch_size, accum = config.batch_size, config.grad_accum_steps
    devices = 1
    for axis in batch_axes(mesh):
        devices *= mesh.shape[axis]
    if batch_size % (accum * devices):
        raise ConfigError(
            f"config.batch_size={batch_size!r} must be a positive multiple of grad_accum_steps ({accum}) x data x "
            f"fsdp devices ({devices}) = {accum * devices}, so every micro-batch splits evenly over the devices; "
            "change config.batch_size or config.grad_accum_steps")


def check_resume(config, step: int, directory: str) -> None:
    """ConfigError if `config` cannot continue a run whose newest checkpoint (in `directory`) is at `step`."""
    if config.steps < step:
        raise ConfigError(f"config.steps={config.steps} is below step {step} of the newest checkpoint in {directory}: "
                          f"pass --config.steps={step} or more to continue this run (more lengthens its schedule), "
                          "or train in a new workdir")


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


def load_config(path: str) -> config_dict.ConfigDict:
    """`get_config()` of the config file at `path` (imports like `from configs import llama_base` resolve against
    sys.path, which holds the repository root when train.py runs)."""
    spec = importlib.util.spec_from_file_location(f"_qjax_config_{pathlib.Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def flatten(config, prefix: str = "") -> dict[str, Any]:
    """{dotted field name: value} for every leaf of a ConfigDict or dict ("optimizer.lr": 0.002); placeholders give
    None."""
    out = {}
    for key, value in config.items():
        if isinstance(value, (config_dict.ConfigDict, dict)):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _dotted(node) -> str | None:
    """"model.dim" for the assignment target `config.model.dim`; None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or not parts:
        return None
    return ".".join(reversed(parts))


def field_docs(path) -> dict[str, str]:
    """{dotted field name: its trailing comment} of the config file at `path` and the sibling configs it imports.

    Handles `config.x = value  # doc` and the entries of `config.x = config_dict.ConfigDict({"y": value,  # doc`.
    """
    path = pathlib.Path(path)
    source = path.read_text()
    tree = ast.parse(source)
    docs = {}
    for node in ast.walk(tree):  # the base configs first, so the file's own comments win
        if isinstance(node, ast.ImportFrom) and (node.module == "configs" or node.level):
            for alias in node.names:
                sibling = path.parent / f"{alias.name}.py"
                if sibling.exists():
                    docs.update(field_docs(sibling))
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        name = _dotted(node.targets[0])
        if name is None:
            continue
        if node.lineno in comments:
            docs[name] = comments[node.lineno]
        value = node.value
        if isinstance(value, ast.Call) and value.args and isinstance(value.args[0], ast.Dict):
            for key in value.args[0].keys:
                if isinstance(key, ast.Constant) and key.lineno in comments:
                    docs[f"{name}.{key.value}"] = comments[key.lineno]
    return docs


def show_config(config, path) -> str:
    """Every field of `config` as `name = value  # doc`, one per line, sorted by name (as ConfigDict keeps them)."""
    docs = field_docs(path)
    rows = [(f"{name} = {value!r}", docs.get(name, "")) for name, value in flatten(config).items()]
    width = max(len(left) for left, _ in rows)
    return "\n".join(f"{left:<{width}}  # {doc}" if doc else left for left, doc in rows)


def unknown_override_error(argv, config, config_arg: str) -> str | None:
    """The one-line error for the first `--config.<name>` in `argv` naming no field of `config`, else None."""
    names = set(flatten(config))
    names |= {name.rsplit(".", i)[0] for name in names for i in range(1, name.count(".") + 1)}  # "model", ...
    for arg in argv:
        match = re.match(r"-{1,2}(?:no)?config\.([^=]+)", arg)
        if match and match.group(1) not in names:
            field = match.group(1)
            close = difflib.get_close_matches(field, sorted(names), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            return (f"unknown config field '{field}'{hint} (python train.py --config {config_arg} --show_config "
                    "lists the fields)")
    return None


def read_saved_config(workdir: str) -> dict | None:
    """The config.json of the workdir's last start as a dict, or None if there is none (or it does not parse)."""
    try:
        with open(os.path.join(workdir, CONFIG_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def config_as_dict(config) -> dict:
    """`config` as the plain dict that config.json holds (tuples become lists, as in JSON)."""
    text = config.to_json_best_effort() if hasattr(config, "to_json_best_effort") else json.dumps(dict(config))
    return json.loads(text)


def config_changes(saved: dict | None, config) -> list[str]:
    """The fields that differ between a saved config.json and `config`, as "field old -> new" (sorted)."""
    if saved is None:
        return []
    old, new = flatten(saved), flatten(config_as_dict(config))
    return [f"{key} {old.get(key, '(unset)')} -> {new.get(key, '(unset)')}"
            for key in sorted(old.keys() | new.keys()) if old.get(key) != new.get(key)]


def write_config(workdir: str, config) -> None:
    """config.json of this start, replaced atomically (a kill mid-write leaves the previous one); process 0 only."""
    if not is_main_process():
        return
    path = os.path.join(workdir, CONFIG_FILE)
    with open(path + ".tmp", "w") as f:
        f.write(config.to_json_best_effort(indent=2) if hasattr(config, "to_json_best_effort") else str(config))
    os.replace(path + ".tmp", path)
