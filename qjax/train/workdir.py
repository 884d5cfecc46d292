"""What a workdir keeps between starts of a run: config.json, metrics.jsonl and the best checkpoint by eval loss.

  changes = config_changes(read_saved_config(workdir), config)   # ["steps 300 -> 400", ...] on a resume
  dropped = truncate_metrics(workdir, step)                       # rows after the restored step are gone
  best = BestCheckpoint(workdir); best.update(step, eval_loss, state); best.close()

A run killed between two checkpoints has written metrics after the newest one; the restarted run recomputes those
steps, so their rows are dropped on resume (metrics.jsonl then holds one row per step and kind).

Several processes (one run over several hosts) share the workdir: only process 0 changes these files, the others
skip the writes (checkpoints are saved by all of them together, see qjax.train.checkpoint).
"""

import json
import math
import os

from qjax.train.checkpoint import Checkpointer
from qjax.train.config import ConfigError
from qjax.train.mesh import is_main_process

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
BEST_DIR = "best"
BEST_FILE = "best.json"


def read_saved_config(workdir: str) -> dict | None:
    """The config.json of the workdir's last start as a dict, or None if there is none (or it does not parse)."""
    try:
        with open(os.path.join(workdir, CONFIG_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_as_dict(config) -> dict:
    """`config` as the plain dict that config.json holds (tuples become lists, as in JSON)."""
    text = config.to_json_best_effort() if hasattr(config, "to_json_best_effort") else json.dumps(dict(config))
    return json.loads(text)


def config_changes(saved: dict | None, config) -> list[str]:
    """The fields that differ between a saved config.json and `config`, as "field old -> new" (sorted)."""
    if saved is None:
        return []
    old, new = _flatten(saved), _flatten(config_as_dict(config))
    return [f"{key} {old.get(key, '(unset)')} -> {new.get(key, '(unset)')}"
            for key in sorted(old.keys() | new.keys()) if old.get(key) != new.get(key)]


def check_resume(config, step: int, directory: str) -> None:
    """ConfigError if `config` cannot continue a run whose newest checkpoint (in `directory`) is at `step`."""
    if config.steps < step:
        raise ConfigError(f"config.steps={config.steps} is below step {step} of the newest checkpoint in {directory}: "
                          f"pass --config.steps={step} or more to continue this run (more lengthens its schedule), "
                          "or train in a new workdir")


def read_metrics(workdir: str) -> list[dict]:
    """The rows of metrics.jsonl (a line cut short by a kill is skipped)."""
    rows = []
    try:
        with open(os.path.join(workdir, METRICS_FILE)) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    continue
    except FileNotFoundError:
        pass
    return rows


def set_aside_previous_run(workdir: str) -> str | None:
    """Before a start from scratch: moves an earlier run's metrics.jsonl, TensorBoard events and best checkpoint
    (left behind when its checkpoints were moved or deleted) into <workdir>/previous-<n>/, so this run neither
    appends to nor reports them. Returns that directory, or None when there was nothing to move (or this is not
    process 0)."""
    if not is_main_process():
        return None
    names = [name for name in sorted(os.listdir(workdir))
             if name in (METRICS_FILE, BEST_DIR) or name.startswith("events.out.tfevents.")]
    if not names:
        return None
    n = 1
    while os.path.exists(os.path.join(workdir, f"previous-{n}")):
        n += 1
    target = os.path.join(workdir, f"previous-{n}")
    os.makedirs(target)
    for name in names:
        os.rename(os.path.join(workdir, name), os.path.join(target, name))
    return target


def write_config(workdir: str, config) -> None:
    """config.json of this start, replaced atomically (a kill mid-write leaves the previous one); process 0 only."""
    if not is_main_process():
        return
    path = os.path.join(workdir, CONFIG_FILE)
    with open(path + ".tmp", "w") as f:
        f.write(config.to_json_best_effort(indent=2) if hasattr(config, "to_json_best_effort") else str(config))
    os.replace(path + ".tmp", path)


def truncate_metrics(workdir: str, step: int) -> int:
    """Keeps the metrics.jsonl rows of steps <= `step` (the restored one); returns how many rows were dropped.

    The file is replaced atomically (written beside it, then renamed), so a kill here loses nothing. Process 0
    only (the others return 0)."""
    if not is_main_process():
        return 0
    path = os.path.join(workdir, METRICS_FILE)
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        lines = f.read().splitlines()
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):  # a row cut short by a kill, or not ours: dropped
            continue
    if len(kept) == len(lines):
        return 0
    with open(path + ".tmp", "w") as f:
        f.write("".join(line + "\n" for line in kept))
    os.replace(path + ".tmp", path)
    return len(lines) - len(kept)


class BestCheckpoint:
    """Keeps the train state with the lowest eval loss in <workdir>/best/<step>/, its step and loss in best.json.

    Resuming never reads it (the run continues from checkpoints/); it is the model to use after a run that went
    on past its best eval loss (overfitting). The best loss so far comes from metrics.jsonl, so a resumed run
    (whose rows after the restored step were dropped) keeps improving on the same record; a best checkpoint saved
    after the restored step by a killed run is replaced when the resumed run recomputes that eval.
    """

    def __init__(self, workdir: str):
        self.directory = os.path.join(workdir, BEST_DIR)
        losses = [(row["eval_loss"], row["step"]) for row in read_metrics(workdir)
                  if "eval_loss" in row and math.isfinite(row["eval_loss"])]
        self.loss, self.step = min(losses) if losses else (math.inf, None)
        self._checkpointer = None  # created on the first save: a run without eval makes no best/ directory

    def update(self, step: int, eval_loss: float, state) -> bool:
        """Saves `state` if `eval_loss` is the lowest so far; True if it was."""
        if not eval_loss < self.loss:
            return False
        if self._checkpointer is None:
            self._checkpointer = Checkpointer(self.directory, keep=1)
        # replace: a best checkpoint of this step from a killed run's lost steps may be there (recomputed now)
        self._checkpointer.save(step, state, replace=True)
        self.loss, self.step = eval_loss, step
        if not is_main_process():  # every process saved its shards above; best.json is process 0's
            return True
        with open(os.path.join(self.directory, BEST_FILE + ".tmp"), "w") as f:
            json.dump({"step": step, "eval_loss": eval_loss, "checkpoint": os.path.join(self.directory, str(step))}, f)
        os.replace(os.path.join(self.directory, BEST_FILE + ".tmp"), os.path.join(self.directory, BEST_FILE))
        return True

    def summary(self) -> str | None:
        """One line naming the best eval loss, its step and where its checkpoint is (None before any eval)."""
        try:
            with open(os.path.join(self.directory, BEST_FILE)) as f:
                best = json.load(f)
        except (OSError, ValueError):
            return None
        return (f"best eval loss {best['eval_loss']:.4f} at step {best['step']}: checkpoint {best['checkpoint']} "
                "(the newest is in checkpoints/)")

    def close(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.close()
