"""Convergence: the same Llama (or GPT-2) run per recipe (default bf16, int8_rowwise, fp8_tensorwise); final eval
loss vs bf16 and a PNG.

  python benchmarks/convergence.py                       # the default config (tiny Llama, Shakespeare bytes)
  python benchmarks/convergence.py --size 125m --seq-len 1024 --batch-size 32 --steps 2000     # on a GPU
  python benchmarks/convergence.py --recipes bf16 bitnet_b158 --png benchmarks/convergence_bitnet.png
  python benchmarks/convergence.py --model gpt2 --size gpt2 --recipes bf16 int8_dataflow fp8_dataflow \
      --seq-len 1024 --batch-size 32 --steps 600 --lr 6e-4      # GPT-2 small, Jetfire's setting; on a GPU
  python benchmarks/convergence.py --lr 6e-4 --recipes bf16 bitnet_b158@1.2e-3 bitnet_b158@2.4e-3   # own peak LRs
  python benchmarks/convergence.py --seeds 0 1 2 ...     # each recipe under seeds 0, 1, 2: mean and standard error
  python benchmarks/convergence.py --recipes bf16 int8_dataflow_sr int8_rowwise_sr   # ablations: variants that
      # qjax.RECIPES does not hold (benchmarks/common.py, recipe_variant)

Each recipe trains from the same seed, data order and schedule (`qjax.train.train`, workdir
runs/convergence/<model-size-steps-batch-seq-lr>/<recipe>; a finished run with the same settings and the same
recipe definition, recorded in its recipe.txt, is reused; another definition under the name stops the script before
any run trains). A recipe written RECIPE@LR (its workdir named so) trains at peak learning rate LR instead of --lr,
the schedule's shape unchanged (BitNet b1.58 trains at a higher LR than its full-precision baseline:
configs/llama_bitnet.py).
Prints the final eval loss per recipe and its relative difference to bf16 (target: within 1%), appends the table to
the results JSON, and plots the train and eval loss curves to benchmarks/convergence.png (GPT-2:
benchmarks/convergence_gpt2.png). With several --seeds each recipe runs under each seed (init, data order,
stochastic rounding; seed s > 0 in the workdir <recipe>-seed<s>) and the difference to bf16 is taken per seed,
against bf16's run of the same seed, then averaged: mean and standard error over seeds (one run per recipe cannot
resolve 1% where bf16's own final eval loss moves by about that much between runs). The PNG shows the first seed's
runs. Runs of different seeds can train in separate processes (one GPU each) and a last call with all the seeds
reuses them to write the table.
Needs the corpus: `make data` (or python -m qjax.data.prepare shakespeare --out data/shakespeare).
"""

import argparse
import math
import pathlib
import statistics
import sys

from common import REPO, record_results, recipe_variant

sys.path.insert(0, str(REPO))  # the configs/ package
from configs import gpt2_base, llama_base  # noqa: E402
import qjax  # noqa: E402
from qjax.train import train  # noqa: E402
from qjax.train.plot import curves as read_curves, plot_runs  # noqa: E402

RECIPES = ("bf16", "int8_rowwise", "fp8_tensorwise")
MODELS = {"llama": (llama_base, "Llama", "convergence.png"), "gpt2": (gpt2_base, "GPT-2", "convergence_gpt2.png")}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="*", default=list(RECIPES))
    parser.add_argument("--model", choices=list(MODELS), default="llama", help="configs/<model>_base.py's model")
    parser.add_argument("--size", help="the model's preset (default: the config's)")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run per recipe and seed")
    parser.add_argument("--workdir", default=str(REPO / "runs" / "convergence"))
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--png", help="where the curves go (default: benchmarks/convergence.png, GPT-2's "
                                      "benchmarks/convergence_gpt2.png)")
    args = parser.parse_args()
    base_config, label, png_name = MODELS[args.model]

    entries = {}  # "RECIPE" or "RECIPE@LR" -> (recipe, its own peak lr or None)
    for entry in args.recipes:
        recipe, _, recipe_lr = entry.partition("@")
        try:
            entries[entry] = (recipe, float(recipe_lr) if recipe_lr else None)
        except ValueError:
            parser.error(f"--recipes {entry}: the learning rate after '@' must be a number, e.g. {recipe}@1.5e-3")
        try:
            recipe_variant(recipe)
        except ValueError as e:
            parser.error(f"--recipes {entry}: {e} (or a variant of benchmarks/common.py's recipe_variant)")

    if not args.recipes:
        parser.error("--recipes needs at least one recipe, e.g. --recipes bf16 int8_dataflow")
    if min(args.seeds) < 0 or len(set(args.seeds)) < len(args.seeds):
        parser.error(f"--seeds must be distinct non-negative integers, got {args.seeds}")
    runs = []  # (entry, seed, name, config, workdir), every workdir checked before any run trains
    for entry, (recipe, recipe_lr) in entries.items():
        for seed in args.seeds:
            config = base_config.get_config()
            config.seed = seed
            if recipe not in qjax.RECIPES:  # a benchmarks variant (common.recipe_variant): the Recipe itself
                del config.recipe
            config.recipe = recipe if recipe in qjax.RECIPES else recipe_variant(recipe)
            config.data.path = str(REPO / "data" / "shakespeare")
            for field, value in (("steps", args.steps), ("seq_len", args.seq_len), ("batch_size", args.batch_size)):
                if value is not None:
                    setattr(config, field, value)
            if args.size:
                config.model.size = args.size
            if args.lr:
                config.optimizer.lr = args.lr
            if recipe_lr is not None:
                config.optimizer.lr = recipe_lr
            config.eval_every = max(config.steps // 6, 1)
            # One workdir per recipe, seed and run shape: a finished run with the same settings is reused, never a
            # different one.
            tag = (f"{args.model}-{config.model.size}-steps{config.steps}-b{config.batch_size}-t{config.seq_len}"
                   f"-lr{config.optimizer.lr:g}")
            name = entry if seed == 0 else f"{entry}-seed{seed}"  # the name labels its curves in the PNG
            workdir = pathlib.Path(args.workdir) / tag / name
            check_same_recipe(workdir, qjax.recipe(config.recipe))
            runs.append((entry, seed, name, config, workdir))

    workdirs, finals = [], {}  # finals: entry -> [(final step, final eval loss) per seed]
    for entry, seed, name, config, workdir in runs:
        print(f"== {name} -> {workdir}", flush=True)
        train(config, str(workdir))
        if seed == args.seeds[0]:
            workdirs.append(str(workdir))
        finals.setdefault(entry, []).append(read_curves(str(workdir))[1][-1])

    lines = table(finals)
    config = base_config.get_config()
    size = args.size or config.model.size
    seeds = (f"seed {args.seeds[0]}, the same data order per recipe" if len(args.seeds) == 1 else
             f"seeds {', '.join(map(str, args.seeds))} per recipe, each seed's init and data order shared by the "
             "recipes")
    note = (f"{label} {size}, Shakespeare bytes, steps {args.steps or config.steps}, batch "
            f"{args.batch_size or config.batch_size} x seq {args.seq_len or config.seq_len}, peak lr "
            f"{args.lr or config.optimizer.lr:g} (RECIPE@LR: LR), {seeds}; eval loss = mean over the config's eval "
            "batches.")
    report = "\n".join(lines) + "\n\n" + note + "\n"
    print("\n" + report)
    png = pathlib.Path(args.png or REPO / "benchmarks" / png_name)
    print(f"wrote {plot_runs(workdirs, str(png), f'{label} {size} on Shakespeare: ' + ' vs '.join(args.recipes))}")
    report += f"\nLoss curves: benchmarks/{png.name}\n"
    if not args.no_record:
        record_results("convergence" if args.model == "llama" else f"convergence, {label}", report)


def check_same_recipe(workdir: pathlib.Path, recipe) -> None:
    """Records the recipe's full definition in workdir/recipe.txt, and exits with an error if the file holds another:
    a finished run is reused by name, and a name whose definition changed (int8_dataflow's gradient rounding did)
    must not pass an old run off as the new recipe's."""
    marker, spec = workdir / "recipe.txt", repr(recipe) + "\n"
    if marker.exists() and marker.read_text() != spec:
        sys.exit(f"error: {workdir} holds a run of another definition of {recipe.name!r}: pass a new --workdir "
                 f"(or delete that run)")
    if not marker.exists() and (workdir / "config.json").exists():
        sys.exit(f"error: {workdir} holds a run that did not record its recipe's definition: pass a new --workdir "
                 f"(or delete that run)")
    workdir.mkdir(parents=True, exist_ok=True)
    marker.write_text(spec)


def table(finals: dict) -> list[str]:
    """Markdown rows of the final eval losses, finals: entry -> [(step, loss) per seed, in one order]. One seed: the
    loss and its relative difference to bf16's. Several: the mean loss, each seed's difference to bf16's run of the
    same seed, and their mean ± standard error (s.e. = sample standard deviation / sqrt(seeds))."""
    base = finals.get("bf16")
    n_seeds = len(next(iter(finals.values())))
    if n_seeds == 1:
        lines = ["| recipe | final step | final eval loss | vs bf16 |", "|---|---:|---:|---:|"]
        for entry, [(step, loss)] in finals.items():
            rel = f"{(loss - base[0][1]) / base[0][1] * 100:+.2f}%" if base else "–"
            lines.append(f"| {entry} | {step} | {loss:.4f} | {rel} |")
        return lines
    lines = ["| recipe | final step | final eval loss, mean | vs bf16 per seed | vs bf16, mean ± s.e. |",
             "|---|---:|---:|---|---:|"]
    for entry, runs in finals.items():
        losses = [loss for _, loss in runs]
        per_seed, summary = "–", "–"
        if base:
            rel = [(loss - b) / b * 100 for loss, (_, b) in zip(losses, base, strict=True)]
            per_seed = ", ".join(f"{r:+.2f}%" for r in rel)
            summary = f"{statistics.mean(rel):+.2f}% ± {statistics.stdev(rel) / math.sqrt(len(rel)):.2f}%"
        lines.append(f"| {entry} | {runs[-1][0]} | {statistics.mean(losses):.4f} | {per_seed} | {summary} |")
    return lines


if __name__ == "__main__":
    main()
