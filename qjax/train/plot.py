"""Loss curves of a run to a PNG, from its metrics.jsonl.

  python -m qjax.train.plot runs/llama_int8                  # writes runs/llama_int8/loss.png
  python -m qjax.train.plot runs/a runs/b --out cmp.png      # several runs on one figure

Train loss (per log interval) as a line, eval loss as dots on the same axes, step on x. Headless (matplotlib's Agg
backend), so it works over ssh and in CI.
"""

import argparse
import os
import sys
import textwrap

import matplotlib

matplotlib.use("Agg")  # no display needed; must precede the pyplot import
import matplotlib.pyplot as plt  # noqa: E402

from qjax.train.workdir import METRICS_FILE, read_metrics  # noqa: E402


def curves(workdir: str) -> tuple[list, list]:
    """(train [(step, loss)], eval [(step, eval_loss)]) of a run, sorted by step (the last row of a step wins)."""
    train, evals = {}, {}
    for row in read_metrics(workdir):
        if "loss" in row:
            train[row["step"]] = row["loss"]
        if "eval_loss" in row:
            evals[row["step"]] = row["eval_loss"]
    return sorted(train.items()), sorted(evals.items())


def plot_runs(workdirs: list[str], out: str, title: str | None = None) -> str:
    """Draws the train and eval loss of each run in `workdirs` (labelled by directory name) into the PNG `out`;
    returns `out`. title: the figure's (default: the run names).

    Raises ValueError if a run has no metrics rows (a wrong path, or a run that has not logged yet)."""
    runs = {}
    for workdir in workdirs:
        train, evals = curves(workdir)
        if not train and not evals:
            raise ValueError(f"no metrics in {os.path.join(workdir, METRICS_FILE)}: is {workdir} a run's workdir?")
        runs[os.path.basename(os.path.normpath(workdir))] = (train, evals)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, (train, evals) in runs.items():
        color = None
        if train:
            (line,) = ax.plot(*zip(*train), label=f"{name} train", linewidth=1.2)
            color = line.get_color()
        if evals:
            ax.plot(*zip(*evals), "o--", color=color, label=f"{name} eval", markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(textwrap.fill(title or ", ".join(runs), 75))  # a long recipe list wraps, not cut at the edge
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qjax.train.plot", description=__doc__.split("\n")[0])
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
