"""Convergence: the same Llama (or GPT-2) run per recipe (default bf16, int8_rowwise, fp8_tensorwise); final eval
loss vs bf16 and a PNG.

  python benchmarks/convergence.py                       # the default config (tiny Llama, Shakespeare bytes)
  python benchmarks/convergence.py --size 125m --seq-len 1024 --batch-size 32 --steps 2000     # on a GPU
  python benchmarks/convergence.py --recipes bf16 bitnet_b158 --png benchmarks/convergence_bitnet.png
  python benchmarks/convergence.py --model gpt2 --size gpt2 --recipes bf16 int8_dataflow fp8_dataflow \
      --seq-len 1024 --batch-size 32 --steps 600 --lr 6e-4      # GPT-2 small, Jetfire's setting; on a GPU
  python benchmarks/convergence.py --lr 6e-4 --recipes bf16 bitnet_b158@1.2e-3 bitnet_b158@2.4e-3   # own peak LRs

Each recipe trains from the same seed, data order and schedule (`qjax.train.train`, workdir
runs/convergence/<model-size-steps-batch-seq-lr>/<recipe>; a finished run with the same settings is reused). A
recipe written RECIPE@LR (its workdir named so) trains at peak learning rate LR instead of --lr, the schedule's
shape unchanged (BitNet b1.58 trains at a higher LR than its full-precision baseline: configs/llama_bitnet.py).
Prints the final eval loss per recipe and its relative difference to bf16 (target: within 1%), appends the table to
RESULTS.md, and plots the train and eval loss curves to benchmarks/convergence.png (GPT-2:
benchmarks/convergence_gpt2.png).
Needs the corpus: `make data` (or python -m qjax.data.prepare shakespeare --out data/shakespeare).
"""

import argparse
import pathlib
import sys

from common import REPO, append_results

sys.path.insert(0, str(REPO))  # the configs/ package
from configs import gpt2_base, llama_base  # noqa: E402
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
    parser.add_argument("--workdir", default=str(REPO / "runs" / "convergence"))
    parser.add_argument("--no-append", action="store_true")
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

    workdirs, finals = [], {}
    for entry, (recipe, recipe_lr) in entries.items():
        config = base_config.get_config()
        config.recipe = recipe
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
        # One workdir per recipe and run shape: a finished run with the same settings is reused, never a different one.
        tag = (f"{args.model}-{config.model.size}-steps{config.steps}-b{config.batch_size}-t{config.seq_len}"
               f"-lr{config.optimizer.lr:g}")
        workdir = pathlib.Path(args.workdir) / tag / entry  # the entry names its curves in the PNG
        print(f"== {entry} -> {workdir}", flush=True)
        train(config, str(workdir))
        workdirs.append(str(workdir))
        finals[entry] = read_curves(str(workdir))[1][-1]

    base = finals.get("bf16")
    lines = ["| recipe | final step | final eval loss | vs bf16 |", "|---|---:|---:|---:|"]
    for recipe, (step, loss) in finals.items():
        rel = f"{(loss - base[1]) / base[1] * 100:+.2f}%" if base else "–"
        lines.append(f"| {recipe} | {step} | {loss:.4f} | {rel} |")
    config = base_config.get_config()
    size = args.size or config.model.size
    note = (f"{label} {size}, Shakespeare bytes, steps {args.steps or config.steps}, batch "
            f"{args.batch_size or config.batch_size} x seq {args.seq_len or config.seq_len}, peak lr "
            f"{args.lr or config.optimizer.lr:g} (RECIPE@LR: LR), same seed and data order per recipe; eval loss = "
            "mean over the config's eval batches.")
    report = "\n".join(lines) + "\n\n" + note + "\n"
    print("\n" + report)
    png = pathlib.Path(args.png or REPO / "benchmarks" / png_name)
    print(f"wrote {plot_runs(workdirs, str(png), f'{label} {size} on Shakespeare: ' + ' vs '.join(args.recipes))}")
    report += f"\nLoss curves: benchmarks/{png.name}\n"
    if not args.no_append:
        append_results("convergence" if args.model == "llama" else f"convergence, {label}", report)


if __name__ == "__main__":
    main()
