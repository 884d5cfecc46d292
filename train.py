"""Train a model with quantized GEMMs from a config file.

  python -m qjax.data.prepare shakespeare --out data/shakespeare      # once, for the Llama configs
  python train.py --config configs/llama_int8.py                      # workdir: runs/llama_int8
  python train.py --config configs/llama_int8.py --workdir runs/x --config.steps=200 --config.optimizer.name=adamw_8bit
  python train.py --config configs/vit_int8.py                        # digits, offline
  python train.py --config configs/llama_int8.py --show_config        # every field, its value and its doc

Any config field can be overridden with --config.<field>=<value> (ml_collections); a name that is no field is one
line on stderr with the closest field (exit 2). Re-running with the same workdir resumes from its newest checkpoint.
--stop_at=N ends this invocation at step N (the run's schedule still ends at config.steps), to split a run into
pieces.
"""

import pathlib
import re
import sys
import threading

from absl import app, flags, logging
from ml_collections import config_flags

from qjax.train import ConfigError, fields, train

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file, e.g. configs/llama_int8.py.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics (default: runs/<config "
                               "file name>).")
_STOP_AT = flags.DEFINE_integer("stop_at", None, "Stop this invocation after this step (resume later).")
_SHOW_CONFIG = flags.DEFINE_bool("show_config", False, "Print every config field with its value and doc, then exit.")
flags.mark_flags_as_required(["config"])


def _config_arg(argv) -> str | None:
    """The config file named on the command line (--config=PATH or --config PATH), or None."""
    for i, arg in enumerate(argv):
        if re.fullmatch(r"-{1,2}config", arg) and i + 1 < len(argv):
            return argv[i + 1]
        match = re.fullmatch(r"-{1,2}config=(.*)", arg)
        if match:
            return match.group(1)
    return None


def parse_flags(argv):
    """absl's flag parsing, except that an override naming no config field (--config.step=30) is one line on
    stderr naming the closest field and exits 2, instead of config_flags' traceback."""
    try:
        return flags.FLAGS(argv)
    except (AttributeError, KeyError):  # what config_flags raises for a field the (locked) config does not have
        config_arg = _config_arg(argv)
        message = config_arg and fields.unknown_override_error(argv[1:], fields.load_config(config_arg), config_arg)
        if not message:
            raise
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    config_file = config_flags.get_config_filename(flags.FLAGS["config"])
    if _SHOW_CONFIG.value:
        print(fields.show_config(_CONFIG.value, config_file))
        return 0
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO; our progress lines say enough
    workdir = _WORKDIR.value
    if workdir is None:
        stem = pathlib.Path(config_file).stem
        workdir = str(pathlib.Path("runs") / stem)
    try:
        train(_CONFIG.value, workdir, stop_at=_STOP_AT.value)
    except ConfigError as e:
        # A config mistake is the user's to fix: one line saying what and how, no traceback.
        print(f"error: {e}", file=sys.stderr)
        _join_background_threads()
        return 2
    return 0


def _join_background_threads(timeout: float = 30.0) -> None:
    """Waits for non-daemon threads (checkpoint I/O of failed restores) before the interpreter shuts down: a thread
    that starts another during shutdown prints a traceback after the one error line (seen once in CI)."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join(timeout)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
