"""qjax.train: the training loop behind `python train.py --config configs/<name>.py`.

Public API:
  train(config, workdir, stop_at=None) -> TrainResult     the whole run, resuming from the newest checkpoint
  make_train_step(config, task=None, mesh=None)           (init_state, train_step), jitted with mesh shardings;
                                                          data-free, for benchmarks (random tokens)
  make_eval_step(task, mesh), TrainState, TrainResult
  make_task(config, vocab_size=, num_classes=, image_shape=) -> Task    model + loss from a config
  check_config(config), ConfigError                       config validation with messages that say the fix
  make_optimizer(opt_config, total_steps) -> Optimizer    clipping + AdamW (fp32 / 8-bit / 4-bit / fp8) + lr; OPTIMIZERS
  Checkpointer                                            orbax CheckpointManager wrapper (keep last K, atomic)
  ProgressMeter, peak_flops                               progress line, metrics.jsonl, MFU
  make_mesh(data=, fsdp=, tensor=)                        the data x fsdp x tensor device mesh
  step.check_fits(config, task, abstract_state, mesh)     per-device memory estimate, ConfigError when it cannot fit
  metrics.recipe_summary(model_config)                    which recipe each layer runs, for the start-up lines
  config.show_config(config, path), config.field_docs     config files' fields and docs (train.py --show_config)
  stopping.Interrupted, stopping.StopRequest              SIGINT / SIGTERM: save the step in flight, exit 130 / 143

Modules, in the order `train()` (loop.py) meets them: config (every check, run once before anything is built, plus
the config files' fields and config.json), task (data and model), optimizer, step (train state, jitted steps, the
memory estimate), loop (the run), stopping (saving the step in flight on a signal), checkpoint (orbax checkpoints,
the best one, the workdir's earlier runs); beside them mesh (the devices and where each array lies) and metrics
(what a run prints and writes, and `python -m qjax.train.metrics` for loss curves). Each is one concept of the run
and under 400 lines.
"""

from qjax.train.checkpoint import Checkpointer
from qjax.train.config import OPTIMIZERS, ConfigError, check_config
from qjax.train.loop import TrainResult, train
from qjax.train.mesh import make_mesh
from qjax.train.metrics import ProgressMeter, peak_flops
from qjax.train.optimizer import Optimizer, make_optimizer
from qjax.train.step import TrainState, make_eval_step, make_train_step
from qjax.train.task import Task, make_task

__all__ = [
    "Checkpointer", "ConfigError", "OPTIMIZERS", "Optimizer", "ProgressMeter", "Task", "TrainResult", "TrainState",
    "check_config", "make_eval_step", "make_mesh", "make_optimizer", "make_task", "make_train_step", "peak_flops",
    "train",
]
