"""Train a model with quantized GEMMs from a config file.

  python -m qjax.data.prepare shakespeare --out data/shakespeare      # once, for the Llama configs
  python train.py --config configs/llama_int8.py                      # workdir: runs/llama_int8
  python train.py --config configs/llama_int8.py --workdir runs/x --config.steps=200 --config.optimizer.name=adamw_8bit
  python train.py --config configs/vit_int8.py                        # digits, offline

Any config field can be overridden with --config.<field>=<value> (ml_collections). Re-running with the same workdir
resumes from its newest checkpoint. --stop_at=N ends this invocation at step N (the run's schedule still ends at
config.steps), to split a run into pieces.
"""

import pathlib
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from qjax.train import ConfigError, train

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file, e.g. configs/llama_int8.py.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics (default: runs/<config "
                               "file name>).")
_STOP_AT = flags.DEFINE_integer("stop_at", None, "Stop this invocation after this step (resume later).")
flags.mark_flags_as_required(["config"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO; our progress lines say enough
    workdir = _WORKDIR.value
    if workdir is None:
        stem = pathlib.Path(config_flags.get_config_filename(flags.FLAGS["config"])).stem
        workdir = str(pathlib.Path("runs") / stem)
    try:
        train(_CONFIG.value, workdir, stop_at=_STOP_AT.value)
    except ConfigError as e:
        # A config mistake is the user's to fix: one line saying what and how, no traceback.
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    app.run(main)
