"""Checkpoints of the whole train state with orbax: params, optimizer state (quantized states too), step, RNG key.

  ckpt = Checkpointer(workdir / "checkpoints", keep=3)
  state = ckpt.restore_latest(abstract_state) or init()     # None when the directory has no checkpoint
  ckpt.save(step, state); ...; ckpt.close()

A checkpoint is the `TrainState` pytree as it is (quantized Adam states are plain pytrees of arrays; the RNG key is
stored as its uint32 key data), one sub-directory per step. Each array is saved whole (written shard by shard from
the devices holding it) and restored into the shardings the reading run asks for (`abstract_like`), so a run may
resume on another mesh shape. Saves are atomic: orbax writes into a temporary
directory and renames it only once everything is on disk, so a run killed mid-save leaves the previous checkpoint
as the latest; orbax keeps only the last `keep`. Saving is asynchronous: the arrays are copied to host memory
before `save` returns (so the next step may donate them) and written in the background.

A checkpoint that cannot be read (a truncated or missing file: a full disk, a copy cut short) is not the end of a
run: `restore_latest` falls back to the newest one that restores and renames each unreadable one to
`<step>.corrupt-<n>` (kept for inspection, never deleted; orbax does not list that name as a step). A checkpoint that
reads but does not fit the run (another model, optimizer or dtypes) is a ConfigError and is left where it is.

Several processes (one run over several hosts, one shared directory) call every method together: orbax writes each
array from the processes holding its shards and syncs them; a checkpoint counts as restored only if it restored in
every process (each reads its own shards), and process 0 alone moves unreadable ones aside.

The workdir also keeps the best checkpoint by eval loss (`BestCheckpoint`: <workdir>/best/<step>/ and best.json), and
a start from scratch in a workdir an earlier run left files in moves them aside first (`set_aside_previous_run`).
"""

import contextlib
import json
import logging
import math
import os
import sys
import threading

import jax
import orbax.checkpoint as ocp

from qjax.train import mesh as mesh_lib
from qjax.train.config import ConfigError
from qjax.train.metrics import METRICS_FILE, read_metrics

# orbax's layout of a step directory: <step>/default/_METADATA (the tree: paths, shapes, dtypes) beside the arrays.
_ITEM = "default"
_TREE_METADATA = "_METADATA"
BEST_DIR = "best"
BEST_FILE = "best.json"


class CorruptCheckpointError(ConfigError):
    """A checkpoint whose files cannot be read (truncated, missing, garbled); `reason` says which in one line."""

    def __init__(self, step: int, directory: str, reason: str):
        super().__init__(f"checkpoint {step} in {directory} does not restore ({reason}): move it out of {directory} "
                         "(or delete it) to resume from an older one")
        self.step, self.reason = step, reason


def _short_reason(error: BaseException, directory: str, limit: int = 200) -> str:
    """The first line of the innermost cause of `error` (tensorstore's message, not orbax's wrapper), with paths
    relative to `directory` and shortened."""
    while error.__cause__ is not None:
        error = error.__cause__
    lines = str(error).replace(directory + os.sep, "").strip().splitlines()
    text = lines[0] if lines else type(error).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _chain(error: BaseException):
    """`error` and the exceptions it was raised from or while handling."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _out_of_memory(error: BaseException) -> bool:
    """True if `error` or one of its causes is an allocation failure (host or device memory)."""
    return any(isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in str(e) for e in _chain(error))


# TensorStore's status codes for a file that is missing, short or garbled (a truncated chunk reads OUT_OF_RANGE).
_DATA_ERRORS = ("DATA_LOSS", "OUT_OF_RANGE", "NOT_FOUND", "INVALID_ARGUMENT")


def _unreadable_data(error: BaseException) -> bool:
    """True if `error` says a checkpoint file is missing or garbled; other failures (permissions, I/O errors of the
    storage) are not the checkpoint's fault and must not get it moved aside."""
    return any(isinstance(e, (FileNotFoundError, json.JSONDecodeError)) or any(code in str(e) for code in _DATA_ERRORS)
               for e in _chain(error))


@contextlib.contextmanager
def _quiet_logs():
    """Mutes orbax's and asyncio's log records while reading: a failed read logs a multi-kilobyte TensorStore spec
    per array (thousands of lines); the caller reports the failure in one line instead."""
    loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


class Checkpointer:
    """Save / restore train states in `directory` (created if missing), keeping the newest `keep` steps (an int
    >= 1: `train()` checks config.keep_checkpoints up front)."""

    def __init__(self, directory: str | os.PathLike, keep: int):
        self.directory = os.path.abspath(os.fspath(directory))
        # Several processes: orbax's barrier keys are named after the step, so two checkpointers saving the same step
        # at once (checkpoints/ and best/) would share a barrier; the directory's name keeps them apart.
        processes = ocp.options.MultiprocessingOptions(barrier_sync_key_prefix=os.path.basename(self.directory))
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, cleanup_tmp_directories=True,
                                               multiprocessing_options=processes)
        # The handler is named up front so that a new manager can read a checkpoint's metadata before restoring
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_handlers=ocp.StandardCheckpointHandler())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state, *, replace: bool = False) -> None:
        """Save `state` as checkpoint `step` (asynchronous; see module docstring). Saving a step twice is a no-op,
        unless `replace`: then the saved one is deleted first."""
        if step in self._manager.all_steps():
            if not replace:
                return
            self._manager.wait_until_finished()
            self._manager.delete(step)
        self._manager.save(step, args=ocp.args.StandardSave(state), force=True)

    def restore(self, step: int, abstract_state):
        """The state saved at `step`, with the structure, dtypes and shardings of `abstract_state`.

        `abstract_state` is a pytree of `jax.ShapeDtypeStruct` with `sharding` set (e.g. from `jax.eval_shape` of
        the init function). A checkpoint of another model or optimizer, or of an older layout of the train state
        (an older one nested grad clipping's empty state in the optimizer state: `optax.chain(clip, adamw)`),
        raises ConfigError (a ValueError; train.py prints it as one line) naming the checkpoint and the mismatching
        entry. So does one whose arrays have other dtypes than the run's (e.g. float32 params resumed with
        `model.param_dtype=bfloat16`): orbax would cast them silently. A checkpoint whose files cannot be read
        raises CorruptCheckpointError (a ConfigError): its tree metadata is missing or unreadable, or, with the
        tree matching the run's, reading the arrays fails.
        """
        with _quiet_logs():
            saved = self._saved_tree(step)
            self._check_fits(step, saved, abstract_state)
            try:
                return self._manager.restore(step, args=ocp.args.StandardRestore(abstract_state))
            except Exception as e:  # the tree fits (checked above): a file that does not read, or the machine's fault
                if _out_of_memory(e) or not _unreadable_data(e):  # never move a checkpoint aside for those
                    raise
                raise CorruptCheckpointError(step, self.directory, _short_reason(e, self.directory)) from e

    def _saved_tree(self, step: int) -> dict:
        """{path tuple: array metadata} of checkpoint `step`; CorruptCheckpointError if that cannot be read."""
        if not os.path.isfile(os.path.join(self.directory, str(step), _ITEM, _TREE_METADATA)):
            raise CorruptCheckpointError(step, self.directory, f"{_ITEM}/{_TREE_METADATA} is missing")
        try:
            metadata = self._manager.item_metadata(step)
            return ocp.tree.to_flat_dict(metadata.tree)
        except Exception as e:  # a garbled metadata or manifest file: tensorstore / json errors of any type
            raise CorruptCheckpointError(step, self.directory, _short_reason(e, self.directory)) from e

    def _check_fits(self, step: int, saved: dict, abstract_state) -> None:
        """ConfigError if checkpoint `step`'s tree has other entries, shapes or dtypes than `abstract_state`."""
        wanted = ocp.tree.to_flat_dict(ocp.tree.serialize_tree(abstract_state, keep_empty_nodes=True))
        name = lambda path: "/".join(map(str, path))  # noqa: E731
        if saved.keys() != wanted.keys():
            parts = []
            for where, paths in (("checkpoint", saved.keys() - wanted.keys()), ("run", wanted.keys() - saved.keys())):
                if paths:
                    parts.append(f"only in the {where}: {', '.join(sorted(map(name, paths))[:3])}")
            entries = "; ".join(parts)
            raise ConfigError(f"checkpoint {step} in {self.directory} does not fit this run's train state (another "
                              "model, optimizer or grad-clipping setting, or a layout from an older qjax): train in a "
                              f"new workdir, or restore with the config and qjax version that wrote it ({entries})")
        shapes = [f"{name(path)} is {tuple(saved[path].shape)}, this run's is {tuple(leaf.shape)}"
                  for path, leaf in wanted.items()
                  if getattr(saved[path], "shape", None) is not None and hasattr(leaf, "shape")
                  and tuple(saved[path].shape) != tuple(leaf.shape)]
        if shapes:
            more = f" (and {len(shapes) - 3} more)" if len(shapes) > 3 else ""
            raise ConfigError(f"checkpoint {step} in {self.directory} does not fit this run's train state (another "
                              f"model size?): {'; '.join(shapes[:3])}{more}. Train in a new workdir, or resume with "
                              "the config that wrote the checkpoint.")
        differ = [f"{name(path)} is {saved[path].dtype}, this run's is {leaf.dtype}"
                  for path, leaf in wanted.items()
                  if getattr(saved[path], "dtype", None) not in (None, getattr(leaf, "dtype", None))]
        if differ:
            more = f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""
            raise ConfigError(f"checkpoint {step} in {self.directory} holds other dtypes than this run's train state: "
                              f"{'; '.join(differ[:3])}{more}. A changed param_dtype or optimizer state format? Train "
                              "in a new workdir, or resume with the config that wrote the checkpoint.")

    def restore_latest(self, abstract_state, report=None):
        """The newest checkpoint that restores into `abstract_state`'s layout, or None if there is none.

        Unreadable checkpoints are skipped, newest first. Once an older one restores, each skipped one is renamed
        to `<step>.corrupt-<n>` and `report` (default: print to stderr) gets one line saying which, why and where
        it went. If none restores, ConfigError naming the directory, and nothing is moved. A checkpoint that does
        not fit the run raises ConfigError at once (see `restore`).
        """
        report = report or (lambda line: print(line, file=sys.stderr, flush=True))
        skipped = []
        for step in sorted(self._manager.all_steps(), reverse=True):
            try:
                state, error = self.restore(step, abstract_state), None
            except CorruptCheckpointError as e:
                state, error = None, e
            # several processes: one that read its shards must not go on alone while another failed on its own
            if not mesh_lib.all_processes(error is None):
                skipped.append(error or CorruptCheckpointError(step, self.directory, "unreadable in another process"))
                continue
            if skipped:
                mesh_lib.sync_processes("checkpoints tried")  # no process still reads one that is moved next
            for bad in skipped:
                moved = self._move_aside(bad.step)
                report(f"checkpoint {bad.step} in {self.directory} does not restore ({bad.reason}): moved aside to "
                       f"{moved}; resuming from {step}")
            if skipped:
                mesh_lib.sync_processes("checkpoints moved aside")
                self._manager.reload()  # forget the moved steps (orbax caches the step list)
            return state
        if skipped:
            reasons = "; ".join(f"{e.step}: {e.reason}" for e in skipped[:3])
            raise ConfigError(f"no checkpoint in {self.directory} restores ({reasons}): move {self.directory} aside "
                              "(or delete it) to start this run from scratch, or train in a new workdir")
        return None

    def _move_aside(self, step: int) -> str:
        """Renames checkpoint `step` to `<step>.corrupt-<n>` (first free n): out of orbax's view, not deleted.
        Process 0 renames; the others only return the name."""
        n = 1
        while os.path.exists(os.path.join(self.directory, f"{step}.corrupt-{n}")):
            n += 1
        target = os.path.join(self.directory, f"{step}.corrupt-{n}")
        if mesh_lib.is_main_process():
            os.rename(os.path.join(self.directory, str(step)), target)
        return target

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def has_checkpoint(directory: str | os.PathLike) -> bool:
    """True if `directory` holds a step directory (a checkpoint, complete: orbax renames it into place last). Checks
    without starting orbax, whose threads would outlive a program that then stops with an error."""
    return os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))


def join_background_threads(timeout: float = 30.0) -> None:
    """Waits for non-daemon threads (orbax's checkpoint I/O, e.g. of a failed restore) before the interpreter shuts
    down: a thread that starts another during shutdown prints tracebacks after a program's one error line."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join(timeout)


def abstract_like(state, sharding) -> object:
    """`state` (arrays or ShapeDtypeStructs) as ShapeDtypeStructs placed with `sharding`: one for every leaf, or a
    pytree of shardings shaped like `state`. Restoring into it reads each array straight into its shards, whatever
    mesh wrote the checkpoint (orbax stores whole arrays, not a mesh's shards)."""
    if isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), state)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, sharding)


def set_aside_previous_run(workdir: str) -> str | None:
    """Before a start from scratch: moves an earlier run's metrics.jsonl, TensorBoard events and best checkpoint
    (left behind when its checkpoints were moved or deleted) into <workdir>/previous-<n>/, so this run neither
    appends to nor reports them. Returns that directory, or None when there was nothing to move (or this is not
    process 0)."""
    if not mesh_lib.is_main_process():
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
        if not mesh_lib.is_main_process():  # every process saved its shards above; best.json is process 0's
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
