"""Progress of a run: one line per log interval on stdout, one JSON object per line in <workdir>/metrics.jsonl and
the same scalars as TensorBoard event files in <workdir> (`tensorboard --logdir runs/`; tags train/loss, eval/loss...).

  step 120/300 [########------------]  40% | loss 2.4137 | lr 8.10e-04 | 41,230 tok/s | MFU 37.2% | mem 21.3 GiB
    | ETA 1m12s      (one line)

MFU = (training FLOPs per token or image, from the model) x throughput / peak dense bf16 FLOP/s of the devices. The
peak is known only for the GPUs in `PEAK_BF16_FLOPS` (vendor figures); elsewhere MFU reads "n/a" rather than a
guess. Memory is the device's `peak_bytes_in_use` where `memory_stats()` reports it (GPUs; "n/a" on the CPU).

Also here: the start-up lines that say what will actually be quantized (`recipe_summary`, `quantizes_nothing`:
`qjax.recipe_for_layer` keeps some layers in bf16, the LM head, layers narrower than min_features, features a block
recipe cannot tile; on a small model that can be every layer, and a run would then train in bf16 under a quantized
recipe's name), reading metrics.jsonl back (`read_metrics`; `truncate_metrics` drops the rows after a restored step,
which a resumed run recomputes) and its loss curves as a PNG:

  python -m qjax.train.metrics runs/llama_int8                  # writes runs/llama_int8/loss.png
  python -m qjax.train.metrics runs/a runs/b --out cmp.png      # several runs on one figure

(train loss per log interval as a line, eval loss as dots, step on x; matplotlib's Agg backend, so it works over ssh
and in CI.)
"""

import argparse
import collections
import json
import math
import os
import re
import sys
import textwrap
import time

import jax
from tensorboardX import SummaryWriter
from tensorboardX.proto.summary_pb2 import Summary

import qjax
from qjax.models import layer_recipes
from qjax.train.mesh import is_main_process

METRICS_FILE = "metrics.jsonl"
# Dense bf16 tensor-core peak per device (no sparsity), by a substring of `device.device_kind`.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}


def peak_flops(device) -> float | None:
    """Dense bf16 FLOP/s of one `device`, or None for a device we have no number for (CPU, other GPUs)."""
    kind = getattr(device, "device_kind", "")
    for name, flops in PEAK_BF16_FLOPS.items():
        if name in kind:
            return flops
    return None


def peak_memory_bytes(device) -> int | None:
    """Peak bytes in use on `device` since start, or None where the backend does not report it."""
    try:
        stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None; memory is optional information
        return None
    return None if not stats else stats.get("peak_bytes_in_use")


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else (f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s")


BAR_WIDTH = 20


def progress_bar(step: int, total_steps: int) -> str:
    """A text bar of the run's progress, e.g. "[#####---------------]  25%" (one line per log point, so it reads
    the same in a terminal, a log file or a notebook)."""
    fraction = min(max(step / total_steps, 0.0), 1.0) if total_steps > 0 else 1.0
    filled = int(fraction * BAR_WIDTH)
    return f"[{'#' * filled}{'-' * (BAR_WIDTH - filled)}] {100 * fraction:3.0f}%"


def format_progress(record: dict, total_steps: int, unit: str) -> str:
    """The one-line display of a train record (see `ProgressMeter.train`)."""
    parts = [f"step {record['step']}/{total_steps} {progress_bar(record['step'], total_steps)}",
             f"loss {record['loss']:.4f}"]
    if "lr" in record:
        parts.append(f"lr {record['lr']:.2e}")
    if "throughput" in record:
        short = {"tokens": "tok", "images": "img"}.get(unit, unit)
        parts.append(f"{record['throughput']:,.0f} {short}/s")
    if "throughput" in record:  # "n/a": no peak FLOP/s known for this device (e.g. a CPU), so no MFU
        parts.append(f"MFU {100 * record['mfu']:.1f}%" if record.get("mfu") is not None else "MFU n/a")
    if "health_saturation_max" in record:  # the worst quantized operand's saturated codes (qjax.health)
        parts.append(f"sat {100 * record['health_saturation_max']:.2f}%")
    memory = record.get("peak_memory_bytes")  # "n/a": the backend does not report it (e.g. a CPU)
    parts.append(f"mem {memory / 2**30:.1f} GiB" if memory is not None else "mem n/a")
    if "eta_s" in record:
        parts.append(f"ETA {_duration(record['eta_s'])}")
    return " | ".join(parts)


def format_eval(record: dict) -> str:
    fields = [f"{k[5:]} {v:.4f}" for k, v in record.items() if k.startswith("eval_")]
    return f"eval @ step {record['step']} | " + " | ".join(fields)


class ProgressMeter:
    """Times the run between log points and writes train / eval records.

    Args:
      workdir: metrics.jsonl is appended to there (a resumed run continues the same file).
      total_steps: configured steps of the run (for "step s/N" and the ETA).
      unit: "tokens" or "images"; units_per_step: how many of them one train step consumes.
      flops_per_unit: training FLOPs per token / image, or None (then no MFU).
      devices: the devices the step runs on (peak FLOP/s and memory are summed / maxed over them).
      stream: where the lines go (stdout by default).
      start_step: the step the run starts from (a resumed run's); TensorBoard hides the events of earlier starts
        after it (they were recomputed), as metrics.jsonl drops those rows.
      tensorboard: also write TensorBoard event files into workdir. Call `close()` at the end to flush them.
    """

    def __init__(self, workdir, total_steps: int, unit: str, units_per_step: int, flops_per_unit: float | None,
                 devices=None, stream=None, *, start_step: int = 0, tensorboard: bool = True):
        self.path = os.path.join(os.fspath(workdir), METRICS_FILE)
        self.total_steps = total_steps
        self.unit = unit
        self.units_per_step = units_per_step
        self.flops_per_unit = flops_per_unit
        self.devices = list(jax.devices() if devices is None else devices)
        peaks = [peak_flops(d) for d in self.devices]
        self.peak_flops = None if any(p is None for p in peaks) else sum(peaks)
        self.stream = sys.stdout if stream is None else stream
        self._mark_step = None
        self._mark_time = None
        # purge_step: TensorBoard discards older files' events from this step on (a resumed run rewrites them)
        self._writes = jax.process_index() == 0  # several processes: process 0 writes the files (same records)
        self._writer = (SummaryWriter(os.fspath(workdir), purge_step=start_step + 1)
                        if tensorboard and self._writes else None)

    def mark(self, step: int) -> None:
        """Start timing from `step` (call after the first step so compilation is not counted as throughput)."""
        self._mark_step, self._mark_time = step, time.perf_counter()

    def skip(self, seconds: float) -> None:
        """Leave `seconds` out of the current window's throughput: a one-off compile mid-run (a step's first
        call), which would otherwise show as a slow log point and a wrong ETA."""
        if self._mark_time is not None:
            self._mark_time += seconds

    def _write(self, record: dict, prefix: str) -> None:
        if not self._writes:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._writer is not None:
            # One event for all the record's scalars (a health row has ~600; an event each took ~50 us apiece). A NaN
            # stops the run (check_finite) and stays in metrics.jsonl; TensorBoard would only warn about it.
            values = [Summary.Value(tag=key if prefix is None else f"{prefix}/{key.removeprefix('eval_')}",
                                    simple_value=float(value)) for key, value in record.items()
                      if key not in ("step", "time") and isinstance(value, (int, float)) and math.isfinite(value)]
            self._writer.file_writer.add_summary(Summary(value=values), global_step=record["step"],
                                                 walltime=record["time"])
            self._writer.flush()  # a few bytes per log point; a killed run keeps its curves

    def close(self) -> None:
        """Flushes and closes the TensorBoard writer."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def train(self, step: int, metrics: dict) -> dict:
        """Record the train metrics of `step` (floats: loss, lr, grad_norm, ...) plus throughput, MFU, memory, ETA.

        `step` counts completed steps. Throughput covers the steps since the last `mark` / `train` call; the
        caller must have waited for them to finish (fetching the loss does that).
        """
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}, "time": time.time()}
        now = time.perf_counter()
        if self._mark_step is not None and step > self._mark_step:
            seconds_per_step = (now - self._mark_time) / (step - self._mark_step)
            record["throughput"] = self.units_per_step / seconds_per_step
            record["seconds_per_step"] = seconds_per_step
            record["eta_s"] = seconds_per_step * max(self.total_steps - step, 0)
            if self.flops_per_unit is not None and self.peak_flops is not None:
                record["mfu"] = self.flops_per_unit * record["throughput"] / self.peak_flops
        memory = [m for m in (peak_memory_bytes(d) for d in self.devices) if m is not None]
        if memory:
            record["peak_memory_bytes"] = max(memory)
        self._mark_step, self._mark_time = step, now
        self._write(record, "train")
        print(format_progress(record, self.total_steps, self.unit), file=self.stream, flush=True)
        return record

    def health(self, step: int, row: dict) -> dict:
        """Record a quantization health row (`qjax.health.HealthMonitor.update`; its keys are the TensorBoard tags)."""
        record = {"step": step, **row, "time": time.time()}
        self._write(record, None)
        return record

    def eval(self, step: int, metrics: dict) -> dict:
        """Record eval metrics (keys get an "eval_" prefix) of the params after `step` steps."""
        record = {"step": step, **{f"eval_{k}": float(v) for k, v in metrics.items()}, "time": time.time()}
        self._write(record, "eval")
        print(format_eval(record), file=self.stream, flush=True)
        return record


DIVERGED_FIX = ("Restart from the last checkpoint with a lower config.optimizer.lr, a longer warmup, grad clipping "
                "(config.optimizer.grad_clip) or a less aggressive recipe.")


def check_finite(step: int, name: str, value: float) -> None:
    """Stop the run when a loss turns NaN/Inf: a diverged run is reported, never silently continued or saved."""
    if not math.isfinite(value):
        raise FloatingPointError(f"{name} is {value} at step {step}: training diverged. {DIVERGED_FIX}")


# "layers_3/attn/qkv_proj" -> "qkv" (a projection of every block); "lm_head" matches nothing (a single layer)
_BLOCK_LAYER = re.compile(r"layers_\d+/(?:\w+/)?(\w+?)(?:_proj)?")


def recipe_summary(model_config) -> str:
    """Which recipe each projection runs, projections with the same split grouped, e.g.
    "qkv/o/gate_up/down: fp8_blockwise x 22 layers; lm_head: bf16"."""
    per_projection: dict[tuple[str, bool], collections.Counter] = {}  # (short name, in every block): recipes
    for name, recipe in layer_recipes(model_config).items():
        match = _BLOCK_LAYER.fullmatch(name)
        key = (match.group(1), True) if match else (name, False)
        per_projection.setdefault(key, collections.Counter())[recipe.name] += 1
    groups: dict[tuple, list[str]] = {}  # projections whose layers split the same way are listed together
    for (short, in_blocks), counts in per_projection.items():
        groups.setdefault((in_blocks, tuple(counts.items())), []).append(short)
    parts = []
    for (in_blocks, counts), names in groups.items():
        if in_blocks:
            recipes = ", ".join(f"{recipe} x {n} layer{'s' * (n != 1)}" for recipe, n in counts)
        else:
            recipes = ", ".join(recipe for recipe, _ in counts)
        parts.append(f"{'/'.join(names)}: {recipes}")
    return "; ".join(parts)


def quantizes_nothing(model_config) -> str | None:
    """A one-line warning when `model_config.recipe` quantizes but every layer was kept in bf16, naming why and
    the fix; None otherwise."""
    recipe = qjax.recipe(model_config.recipe)
    gemms = [g for g in (recipe.fwd, recipe.dgrad, recipe.wgrad) if g is not None]
    if not gemms or any(r.name != "bf16" for r in layer_recipes(model_config).values()):
        return None
    shapes = model_config.projections().values()
    untileable = sorted({f"{fi}->{fo}" for fi, fo in shapes if fi % 128 or fo % 128})
    if untileable and any(g.is_block_scaled for g in gemms):
        why = (f"a block-scaled recipe needs features that are multiples of 128 and the layers are "
               f"{', '.join(untileable)}: use a larger model (--config.model.size=125m) or dims that are multiples "
               "of 128")
    elif model_config.min_features and all(min(s) < model_config.min_features for s in shapes):
        why = f"every layer is narrower than config.min_features={model_config.min_features}: lower it"
    else:
        why = (f"config.keep_high_precision={model_config.keep_high_precision} matches every layer: narrow its "
               "regexes")
    return f"warning: recipe {recipe.name!r} quantizes no layer, the whole model trains in bf16; {why}"


def rounds_params_to_nearest(config) -> str | None:
    """A one-line warning when bfloat16 params are updated without stochastic rounding, naming the fix; None
    otherwise. bfloat16 keeps 8 mantissa bits, so an update under half a weight's step rounds away."""
    if config.model.get("param_dtype") != "bfloat16" or config.optimizer.get("stochastic_rounding"):
        return None
    return ("warning: bfloat16 params are updated by rounding to nearest, which drops every update under half a "
            "weight's bfloat16 step and can stall training; set --config.optimizer.stochastic_rounding=True (or "
            "--config.model.param_dtype=float32)")


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


def curves(workdir: str) -> tuple[list, list]:
    """(train [(step, loss)], eval [(step, eval_loss)]) of a run, sorted by step (the last row of a step wins)."""
    train, evals = {}, {}
    for row in read_metrics(workdir):
        if "loss" in row:
            train[row["step"]] = row["loss"]
        if "eval_loss" in row:
            evals[row["step"]] = row["eval_loss"]
    return sorted(train.items()), sorted(evals.items())


def eval_gaps(runs: dict) -> dict:
    """{name: [(step, percent)]}: each run's eval loss relative to the first run's (the reference, e.g. bf16) at the
    steps both evaluated. runs: name -> (train, evals) as `curves` returns them, the reference first."""
    names = list(runs)
    reference = dict(runs[names[0]][1]) if names else {}
    gaps = {name: [(step, 100 * (loss / reference[step] - 1)) for step, loss in runs[name][1] if step in reference]
            for name in names[1:]}
    return {name: points for name, points in gaps.items() if points}


def plot_runs(workdirs: list[str], out: str, title: str | None = None) -> str:
    """Draws the train and eval loss of each run in `workdirs` (labelled by directory name) into the PNG `out`, and
    beside it each run's eval loss relative to the first run's (`eval_gaps`: where curves overlap, the gap shows);
    returns `out`. title: the figure's (default: the run names).

    Raises ValueError if a run has no metrics rows (a wrong path, or a run that has not logged yet)."""
    runs = {}
    for workdir in workdirs:
        train, evals = curves(workdir)
        if not train and not evals:
            raise ValueError(f"no metrics in {os.path.join(workdir, METRICS_FILE)}: is {workdir} a run's workdir?")
        runs[os.path.basename(os.path.normpath(workdir))] = (train, evals)
    import matplotlib  # noqa: PLC0415  only here: a run does not load it
    matplotlib.use("Agg")  # no display needed; must precede the pyplot import
    import matplotlib.pyplot as plt  # noqa: PLC0415

    gaps = eval_gaps(runs)
    fig, axes = plt.subplots(1, 2 if gaps else 1, figsize=(12 if gaps else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    colors = {name: f"C{i % 10}" for i, name in enumerate(runs)}  # matplotlib's cycle; a run keeps its color in both
    for name, (train, evals) in runs.items():
        if train:
            ax.plot(*zip(*train), color=colors[name], label=f"{name} train", linewidth=1.2)
        if evals:
            ax.plot(*zip(*evals), "o--", color=colors[name], label=f"{name} eval", markersize=4)
    if gaps:
        gap_ax, reference = axes[0][1], next(iter(runs))
        gap_ax.axhline(0, color=colors[reference], linewidth=1, label=reference)
        for name, points in gaps.items():
            gap_ax.plot(*zip(*points), "o-", color=colors[name], label=name, markersize=4)
        gap_ax.set_xlabel("step")
        gap_ax.set_ylabel(f"eval loss vs {reference} (%)")
        gap_ax.legend(fontsize="small")
        gap_ax.grid(alpha=0.3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    fig.suptitle(textwrap.fill(title or ", ".join(runs), 75 if not gaps else 130))  # a long list wraps, not cut
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qjax.train.metrics",
                                     description="Loss curves of runs to a PNG, from their metrics.jsonl.")
    parser.add_argument("workdirs", nargs="+", help="run directories holding metrics.jsonl (e.g. runs/llama_int8)")
    parser.add_argument("--out", help="PNG to write (default: <first workdir>/loss.png)")
    args = parser.parse_args(argv)
    out = args.out or os.path.join(args.workdirs[0], "loss.png")
    try:
        plot_runs(args.workdirs, out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
