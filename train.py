"""Train a model with quantized GEMMs from a config file.

  python -m qjax.data.prepare shakespeare --out data/shakespeare      # once, for the Llama configs
  python train.py --config configs/llama_int8.py                      # workdir: runs/llama_int8
  python train.py --config configs/llama_int8.py --workdir runs/x --config.steps=200 --config.optimizer.name=adamw_8bit
  python train.py --config configs/vit_int8.py                        # digits, offline
  python train.py --config configs/llama_int8.py --show_config        # every field, its value and its doc

Any config field can be overridden with --config.<field>=<value> (ml_collections). A mistake on the command line (a
name that is no field or flag, a value of the wrong type, a missing config file), a config the run cannot use and a
diverged loss are one line on stderr naming the fix (exit 2). Re-running with the same workdir resumes from its
newest checkpoint. --stop_at=N ends this invocation at step N (the run's schedule still ends at config.steps), to
split a run into pieces. Ctrl-C (SIGINT) or SIGTERM finishes the step in flight, saves a checkpoint there and exits
130 / 143 with one line; a second one exits at once without saving (qjax.train.stopping). Before the first step
(imports, data, compiles of the setup) there is nothing to save: a signal exits at once.
"""

import difflib
import os
import pathlib
import re
import signal
import sys


def _exit_while_starting(signum, frame):
    """Outside the training loop (before it, or when it passes on a signal that came during the last step): exit at
    once, in one line. (A KeyboardInterrupt raised here can land in a garbage-collection callback of jax, which
    swallows it, and the run would go on.)"""
    os.write(2, b"interrupted while no training step was running (starting up, or the run had ended): nothing to "
                b"save\n")
    os._exit(128 + signum)


if __name__ == "__main__":  # before the imports below, which take seconds
    for _signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(_signum) is not signal.SIG_IGN:  # a background job of a script ignores SIGINT: keep that
            signal.signal(_signum, _exit_while_starting)

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from qjax.train import ConfigError, train  # noqa: E402
from qjax.train import config as config_lib  # noqa: E402
from qjax.train.checkpoint import join_background_threads  # noqa: E402
from qjax.train.stopping import Interrupted  # noqa: E402

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


def _fail(message: str):
    """Ends the process with one line on stderr and exit status 2 (a usage error)."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def _missing_config_file(config_arg: str) -> str | None:
    """The error for a --config path that is no file (with the closest file beside it), else None."""
    path = config_arg if os.path.isfile(config_arg) else config_arg.split(":", 1)[0]  # "file.py:arg" passes arg
    if os.path.isfile(path):
        return None
    folder = pathlib.Path(path).parent
    siblings = sorted(str(p) for p in folder.glob("*.py")) if folder.is_dir() else []
    close = difflib.get_close_matches(path, siblings, n=1)
    hint = f"did you mean {close[0]}?" if close else "pass a config file, e.g. configs/llama_int8.py"
    return f"config file {path} does not exist: {hint}"


def _field_type(config, field: str) -> str:
    """The type name of config field "optimizer.lr" ("float")."""
    *parents, name = field.split(".")
    for parent in parents:
        config = config[parent]
    return config.get_type(name).__name__


def _bad_value_error(error: flags.IllegalFlagValueError, config_arg: str | None) -> str:
    """One line for a flag value that does not parse, e.g. --config.steps=abc, with the type the field takes."""
    match = re.match(r"flag --(config\.[^=]+)=(.*?): (.*)", str(error), flags=re.DOTALL)
    if config_arg is None and "--config" in str(error):  # absl's "must have a value other than None"
        return "--config is required, e.g. python train.py --config configs/llama_int8.py"
    if not (match and config_arg):
        return str(error).splitlines()[0] + " (python train.py --help lists the flags)"
    name, value, reason = match.groups()
    field = name.removeprefix("config.")
    config = config_lib.load_config(config_arg.split(":", 1)[0])
    default = config_lib.flatten(config).get(field)
    example = f", e.g. --{name}={default}" if default is not None else ""
    kind = _field_type(config, field)
    article = "an" if kind[0] in "aeiou" else "a"
    return f"--{name}={value}: {reason.splitlines()[0]}; config.{field} takes {article} {kind}{example}"


def _unknown_flag_error(error: flags.UnrecognizedFlagError, argv, config_arg: str | None) -> str:
    """One line for a flag train.py does not have (--stpes=10), naming the closest flag or config field."""
    name = error.flagname
    value = next((arg.split("=", 1)[1] for arg in argv if re.match(rf"-{{1,2}}{re.escape(name)}=", arg)), None)
    candidates = {flag: flag for flag in ("config", "workdir", "stop_at", "show_config")}
    if config_arg and not _missing_config_file(config_arg):
        for field in config_lib.flatten(config_lib.load_config(config_arg.split(":", 1)[0])):
            candidates.setdefault(field.rsplit(".", 1)[-1], f"config.{field}")  # "stpes" is close to "steps"
            candidates[field] = f"config.{field}"
    close = difflib.get_close_matches(name, list(candidates), n=1) or difflib.get_close_matches(
        name, [flag for flag in flags.FLAGS if not flag.startswith("config.")], n=1)
    flag = candidates.get(close[0], close[0]) if close else None
    hint = f"; did you mean --{flag}{'=' + value if value is not None else ''}?" if flag else ""
    return f"unknown flag --{name}{hint} (python train.py --help lists the flags, --show_config the config fields)"


def parse_flags(argv):
    """absl's flag parsing, except that a command-line mistake is one line on stderr naming the fix and exits 2,
    instead of a traceback: a config file that does not exist, an override naming no config field (--config.step=30),
    a value of the wrong type (--config.steps=abc) or a flag that does not exist (--stpes=10)."""
    config_arg = _config_arg(argv)
    if config_arg is not None:
        missing = _missing_config_file(config_arg)
        if missing:
            _fail(missing)
    try:
        return flags.FLAGS(argv)
    except flags.UnrecognizedFlagError as e:
        _fail(_unknown_flag_error(e, argv, config_arg))
    except flags.IllegalFlagValueError as e:
        _fail(_bad_value_error(e, config_arg))
    except (AttributeError, KeyError):  # what config_flags raises for a field the (locked) config does not have
        message = config_arg and config_lib.unknown_override_error(argv[1:], config_lib.load_config(config_arg),
                                                                   config_arg)
        if not message:
            raise
        _fail(message)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    config_file = config_flags.get_config_filename(flags.FLAGS["config"])
    if _SHOW_CONFIG.value:
        print(config_lib.show_config(_CONFIG.value, config_file))
        return 0
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO; our progress lines say enough
    workdir = _WORKDIR.value
    if workdir is None:
        stem = pathlib.Path(config_file).stem
        workdir = str(pathlib.Path("runs") / stem)
    try:
        train(_CONFIG.value, workdir, stop_at=_STOP_AT.value)
    except (ConfigError, FloatingPointError) as e:
        # A config mistake or a diverged loss is the user's to fix: one line saying what and how, no traceback.
        print(f"error: {e}", file=sys.stderr)
        join_background_threads()
        return 2
    except Interrupted as e:  # SIGINT / SIGTERM: the step in flight finished and was saved
        print(e, file=sys.stderr)
        join_background_threads()
        return e.exit_code
    return 0


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
