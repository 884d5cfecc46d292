"""Checkpoints of the whole train state with orbax: params, optimizer state (quantized states too), step, RNG key.

  ckpt = Checkpointer(workdir / "checkpoints", keep=3)
  state = ckpt.restore_latest(abstract_state) or init()     # None when the directory has no checkpoint
  ckpt.save(step, state); ...; ckpt.close()

A checkpoint is the `TrainState` pytree as it is (quantized Adam states are plain pytrees of arrays; the RNG key is
stored as its uint32 key data), one sub-directory per step. Saves are atomic: orbax writes into a temporary
directory and renames it only once everything is on disk, so a run killed mid-save leaves the previous checkpoint
as the latest; orbax keeps only the last `keep`. Saving is asynchronous: the arrays are copied to host memory
before `save` returns (so the next step may donate them) and written in the background.
"""

import os

import jax
import orbax.checkpoint as ocp

from qjax.train.config import ConfigError


class Checkpointer:
    """Save / restore train states in `directory` (created if missing), keeping the newest `keep` steps."""

    def __init__(self, directory: str | os.PathLike, keep: int):
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"config.keep_checkpoints must be an int >= 1, got {keep!r}")
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, cleanup_tmp_directories=True)
        self.directory = os.path.abspath(os.fspath(directory))
        # The handler is named up front so that a new manager can read a checkpoint's metadata before restoring
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_handlers=ocp.StandardCheckpointHandler())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state) -> None:
        """Save `state` as checkpoint `step` (asynchronous; see module docstring). Saving a step twice is a no-op."""
        if step in self._manager.all_steps():
            return
        self._manager.save(step, args=ocp.args.StandardSave(state), force=True)

    def restore(self, step: int, abstract_state):
        """The state saved at `step`, with the structure, dtypes and shardings of `abstract_state`.

        `abstract_state` is a pytree of `jax.ShapeDtypeStruct` with `sharding` set (e.g. from `jax.eval_shape` of
        the init function). A checkpoint of another model or optimizer, or of an older layout of the train state
        (an older one nested grad clipping's empty state in the optimizer state: `optax.chain(clip, adamw)`),
        raises ConfigError (a ValueError; train.py prints it as one line) naming the checkpoint and orbax's
        mismatching entry. So does one whose arrays have other dtypes than the run's (e.g. float32 params resumed
        with `model.param_dtype=bfloat16`): orbax would cast them silently.
        """
        self._check_dtypes(step, abstract_state)
        try:
            return self._manager.restore(step, args=ocp.args.StandardRestore(abstract_state))
        except ValueError as e:
            raise ConfigError(f"checkpoint {step} in {self.directory} does not fit this run's train state (another "
                              "model, optimizer or grad-clipping setting, or a layout from an older qjax): train in a "
                              f"new workdir, or restore with the config and qjax version that wrote it. orbax: {e}"
                              ) from e

    def _check_dtypes(self, step: int, abstract_state) -> None:
        """ConfigError if an array saved at `step` has another dtype than the same entry of `abstract_state`."""
        metadata = self._manager.item_metadata(step)
        if metadata is None:  # nothing to compare against: the restore itself reports what does not fit
            return
        saved = ocp.tree.to_flat_dict(metadata.tree)
        wanted = ocp.tree.to_flat_dict(ocp.tree.serialize_tree(abstract_state, keep_empty_nodes=True))
        differ = [f"{'/'.join(map(str, path))} is {saved[path].dtype}, this run's is {leaf.dtype}"
                  for path, leaf in wanted.items()
                  if path in saved and getattr(saved[path], "dtype", None) not in (None, leaf.dtype)]
        if differ:
            more = f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""
            raise ConfigError(f"checkpoint {step} in {self.directory} holds other dtypes than this run's train state: "
                              f"{'; '.join(differ[:3])}{more}. A changed param_dtype or optimizer state format? Train "
                              "in a new workdir, or resume with the config that wrote the checkpoint.")

    def restore_latest(self, abstract_state):
        """The newest checkpoint restored into `abstract_state`'s layout, or None if there is none."""
        step = self.latest_step()
        return None if step is None else self.restore(step, abstract_state)

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def abstract_like(state, sharding) -> object:
    """`state` (arrays or ShapeDtypeStructs) as ShapeDtypeStructs placed with `sharding` (one for every leaf)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), state)
