"""Convergence: the same Llama (or GPT-2) run per recipe (default bf16, int8_rowwise, fp8_tensorwise); final eval
loss vs bf16 and a PNG.

  python benchmarks/convergence.py                       # the default config (tiny Llama, Shakespeare bytes)
  python benchmarks/convergence.py --size 125m --seq-len 1024 --batch-size 32 --steps 2000     # on a GPU
  python benchmarks/convergence.py --recipes bf16 bitnet_b158 --png benchmarks/convergence_bitnet.png
  python benchmarks/convergence.py --model gpt2 --size gpt2 --recipes bf16 int8_dataflow fp8_dataflow \
      --seq-len 1024 --batch-size 32 --steps 600 --lr 6e-4      # GPT-2 small, Jetfire's setting; on a GPU
  python benchmarks/convergence.py --lr 6e-4 --recipes bf16 bitnet_b158@1.2e-3 bitnet_b158@2.4e-3   # own peak LRs
  python benchmarks/convergence.py --recipes bf16 fp8_rowwise fp8_rowwise:smooth_swiglu int8_rowwise:lm_head_8bit
  python benchmarks/convergence.py --seeds 0 1 2 ...     # each recipe under seeds 0, 1, 2: mean and standard error
  python benchmarks/convergence.py --recipes bf16 int8_dataflow_sr int8_rowwise_sr   # ablations: variants that
      # qjax.RECIPES does not hold (benchmarks/common.py, recipe_variant)

Each recipe trains from the same seed, data order and schedule (`qjax.train.train`, workdir
runs/convergence/<model-size-steps-batch-seq-lr>/<recipe>; a finished run with the same settings and the same
recipe definition, recorded in its recipe.txt, is reused; another definition under the name stops the script before
any run trains). A recipe written RECIPE@LR (its workdir named so) trains at peak learning rate LR instead of --lr,
the schedule's shape unchanged (BitNet b1.58 trains at a higher LR than its full-precision baseline:
configs/llama_bitnet.py). Model options may follow the recipe as ":option" (benchmarks/common.py's MODEL_OPTIONS:
recompute_attention, smooth_swiglu, lm_head_8bit; the workdir writes them with '.').
Prints the final and the lowest eval loss per recipe and their relative differences to bf16 (target: within 1%),
appends the table to the results JSON, and plots the train and eval loss curves to benchmarks/convergence.png (GPT-2:
benchmarks/convergence_gpt2.png). With several --seeds each recipe runs under each seed (init, data order,
stochastic rounding; seed s > 0 in the workdir <recipe>-seed<s>) and the difference to bf16 is taken per seed,
against bf16's run of the same seed, then averaged: mean and standard error over seeds (one run per recipe cannot
resolve 1% where bf16's own final eval loss moves by about that much between runs). The PNG shows the first seed's
runs and, beside them, each one's eval loss relative to the first recipe's (so list bf16 first). Runs of different
seeds can train in separate processes (one GPU each) and a last call with all the seeds reuses them to write the
table.
Needs the corpus: `make data` (or python -m qjax.data.prepare shakespeare --out data/shakespeare).

The mixed corpus (--corpus mixed: ../shared/corpus/mixed-english.txt.xz, 102 MB of English in seven sections, a
slice of each held out; `qjax.data.corpus`) trains on 16k-token BPE shards, prepared from --corpus-file into
data/mixed-english-bpe16k on first use (about 2 minutes on 2 cores). To the device carry the .xz, or the prepared
train.bin, val.bin, tokenizer.json and meta.json (62 MB, under the 64 MiB a call carries):

  python benchmarks/convergence.py --corpus mixed --size 125m --seq-len 1024 --batch-size 32 --tokens 250e6 \
      --recipes bf16 int8_rowwise fp8_rowwise --recipe-seeds bf16=0,1,2 --seeds 0 1 --time-budget 540 --no-record \
      --health-every 100
  python benchmarks/convergence.py --corpus mixed --size 350m --seq-len 1024 --batch-size 32 --tokens 100e6 \
      --lr 3e-4 --recipes bf16 int8_rowwise --time-budget 540 --no-record --health-every 100   # 342M params

--tokens sets the steps from a token budget; --recipe-seeds gives an entry its own seeds (bitnet_b158=0);
--time-budget SECONDS stops the run in flight after SECONDS (`qjax.train.train`'s stop_event: it saves the step
reached) and exits with status 75, as it does when SIGINT / SIGTERM stops a run (a signal between runs or during a
run's last step ends the process; nothing is lost): the same command again resumes every run from its checkpoint
and, once all are done, writes the table (so runs longer than one device call finish over several). The table gives
each recipe's final eval loss (mean ± s.e. over its seeds: bf16's row is the seed spread the gaps are read against),
its gap to bf16 in %, and its train loss over the last 5% of steps: past the lowest eval loss, a run with a lower
train loss memorised more. A finished run is tabled from its metrics.jsonl, recipe.txt and config.json alone: copy
those back from a device (the 125M run's checkpoints are 1.5 GB) into the same --workdir layout and run the command
here.
"""

import argparse
import math
import pathlib
import statistics
import sys
import threading

from common import REPO, apply_options, record_results, recipe_variant, split_options

sys.path.insert(0, str(REPO))  # the configs/ package
from configs import gpt2_base, llama_base  # noqa: E402
import jax  # noqa: E402
import qjax  # noqa: E402
from qjax.data import corpus as corpus_lib, text as text_lib  # noqa: E402
from qjax.train import train  # noqa: E402
from qjax.train.stopping import Interrupted  # noqa: E402
from qjax import health  # noqa: E402
from qjax.models import layer_recipes  # noqa: E402
from qjax.train.metrics import curves as read_curves, plot_runs, read_metrics  # noqa: E402
from qjax.train.task import make_task  # noqa: E402

RECIPES = ("bf16", "int8_rowwise", "fp8_tensorwise")
MODELS = {"llama": (llama_base, "Llama", "convergence.png"), "gpt2": (gpt2_base, "GPT-2", "convergence_gpt2.png")}
# corpus -> (token shards under REPO/data, label, workdir tag suffix)
CORPORA = {"shakespeare": ("shakespeare", "Shakespeare bytes", ""),
           "mixed": ("mixed-english-bpe16k", "mixed English (BPE 16k)", "-mixed")}
MIXED_VOCAB, MIXED_VAL_FRACTION = 16384, 0.01
TIME_BUDGET_EXIT = 75  # --time-budget or a signal stopped a run: run the command again to resume (EX_TEMPFAIL)


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
    parser.add_argument("--recipe-seeds", nargs="*", default=[], metavar="ENTRY=S,S",
                        help="an entry's own seeds instead of --seeds, e.g. bf16=0,1,2 bitnet_b158=0")
    parser.add_argument("--corpus", choices=list(CORPORA), default="shakespeare")
    parser.add_argument("--corpus-file", help="--corpus mixed: the .xz (default: data/mixed-english.txt.xz, else "
                                              "../shared/corpus/mixed-english.txt.xz)")
    parser.add_argument("--tokens", type=float, help="token budget per run: steps = tokens / (batch x seq)")
    parser.add_argument("--time-budget", type=float, help="seconds; then save the step reached and exit "
                                                          f"{TIME_BUDGET_EXIT} (run again to resume)")
    parser.add_argument("--health-every", type=int, default=0,
                        help="steps between quantization health stats (config.health_every; 0: off)")
    parser.add_argument("--workdir", default=str(REPO / "runs" / "convergence"))
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--png", help="where the curves go (default: benchmarks/convergence.png, GPT-2's "
                                      "benchmarks/convergence_gpt2.png)")
    args = parser.parse_args()
    if args.time_budget is not None and not args.time_budget > 0:
        parser.error(f"--time-budget must be a positive number of seconds, got {args.time_budget:g}")
    base_config, label, png_name = MODELS[args.model]

    entries = {}  # "RECIPE[:OPTION...][@LR]" -> (recipe, its model options, its own peak lr or None)
    for entry in args.recipes:
        name, _, recipe_lr = entry.partition("@")
        try:
            recipe, options = split_options(name)
        except ValueError as e:
            parser.error(f"--recipes {entry}: {e}")
        try:
            entries[entry] = (recipe, options, float(recipe_lr) if recipe_lr else None)
        except ValueError:
            parser.error(f"--recipes {entry}: the learning rate after '@' must be a number, e.g. {name}@1.5e-3")
        try:
            recipe_variant(recipe)
        except ValueError as e:
            parser.error(f"--recipes {entry}: {e} (or a variant of benchmarks/common.py's recipe_variant)")

    if not args.recipes:
        parser.error("--recipes needs at least one recipe, e.g. --recipes bf16 int8_dataflow")
    seeds_of = {entry: args.seeds for entry in entries}
    for item in args.recipe_seeds:
        entry, _, seeds = item.partition("=")
        try:
            seeds_of[entry] = [int(seed) for seed in seeds.split(",")]
        except ValueError:
            parser.error(f"--recipe-seeds {item}: write ENTRY=S,S,... with integer seeds, e.g. bf16=0,1,2")
        if entry not in entries:
            parser.error(f"--recipe-seeds {item}: {entry!r} is not one of --recipes")
    for entry, seeds in seeds_of.items():
        if min(seeds) < 0 or len(set(seeds)) < len(seeds):
            parser.error(f"the seeds of {entry} must be distinct non-negative integers, got {seeds}")
    shards, corpus_label, corpus_tag = CORPORA[args.corpus]
    data_path = REPO / "data" / shards
    if args.corpus == "mixed":
        prepare_mixed(data_path, args.corpus_file)
    runs = []  # (entry, seed, name, config, workdir), every workdir checked before any run trains
    for entry, (recipe, options, recipe_lr) in entries.items():
        for seed in seeds_of[entry]:
            config = base_config.get_config()
            config.seed = seed
            if recipe not in qjax.RECIPES:  # a benchmarks variant (common.recipe_variant): the Recipe itself
                del config.recipe
            config.recipe = recipe if recipe in qjax.RECIPES else recipe_variant(recipe)
            apply_options(config, options)
            config.data.path = str(data_path)
            for field, value in (("steps", args.steps), ("seq_len", args.seq_len), ("batch_size", args.batch_size)):
                if value is not None:
                    setattr(config, field, value)
            if args.tokens:
                config.steps = max(round(args.tokens / (config.batch_size * config.seq_len)), 1)
            if args.size:
                config.model.size = args.size
            if args.lr:
                config.optimizer.lr = args.lr
            if recipe_lr is not None:
                config.optimizer.lr = recipe_lr
            config.eval_every = max(config.steps // 6, 1)
            config.checkpoint_every = checkpoint_interval(config.steps, config.checkpoint_every)
            config.health_every = args.health_every
            # One workdir per recipe, seed and run shape: a finished run with the same settings is reused, never a
            # different one.
            tag = (f"{args.model}-{config.model.size}-steps{config.steps}-b{config.batch_size}-t{config.seq_len}"
                   f"-lr{config.optimizer.lr:g}{corpus_tag}")
            # the name labels its curves in the PNG; no ':' in a path the device tool returns
            name = entry.replace(":", ".") + (f"-seed{seed}" if seed else "")
            workdir = pathlib.Path(args.workdir) / tag / name
            check_same_recipe(workdir, qjax.recipe(config.recipe))
            runs.append((entry, seed, name, config, workdir))

    # A run resumed in a new process compiles its steps again: the persistent cache makes that a load (jax reads
    # $JAX_COMPILATION_CACHE_DIR itself; this is the default when it is unset)
    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", str(REPO / "runs" / "jax_cache"))
    budget_over = time_budget(args.time_budget)
    workdirs, evals, fits, health_rows = [], {}, {}, []  # evals: entry -> {seed: [(step, eval loss), ...]}
    for entry, seed, name, config, workdir in runs:
        print(f"== {name} -> {workdir}", flush=True)
        if not run_is_complete(config, workdir) and (budget_over.is_set()
                                                     or not train_run(config, workdir, budget_over)):
            if budget_over.is_set():
                print(f"time budget of {args.time_budget:g} s reached: run the same command again to resume",
                      flush=True)
            sys.exit(TIME_BUDGET_EXIT)
        if seed == seeds_of[entry][0]:
            workdirs.append(str(workdir))
        train_curve, eval_curve = read_curves(str(workdir))
        evals.setdefault(entry, {})[seed] = eval_curve
        fits.setdefault(entry, {})[seed] = end_train_loss(train_curve)
        ternary = health.ternary_operands(layer_recipes(make_task(config).model_config))  # ~70% at +-1 by design
        worst = health.worst(read_metrics(str(workdir)), ternary)
        if worst:
            health_rows.append(health_row(name, worst))

    lines = table(evals, fits)
    config = base_config.get_config()
    size = args.size or config.model.size
    steps = runs[0][3].steps
    seeds = (f"seed {args.seeds[0]}, the same data order per recipe" if len(args.seeds) == 1 and not args.recipe_seeds
             else "seeds per recipe as listed, each seed's init and data order shared by the recipes")
    note = (f"{label} {size}, {corpus_label}, steps {steps}, batch "
            f"{args.batch_size or config.batch_size} x seq {args.seq_len or config.seq_len}, peak lr "
            f"{args.lr or config.optimizer.lr:g} (RECIPE@LR: LR), {seeds}; eval loss = mean over the config's eval "
            "batches.")
    report = "\n".join(lines) + "\n\n" + note + "\n"
    if health_rows:
        report += ("\n" + "\n".join(HEALTH_HEADER + health_rows) + "\n\nQuantization health over each run (every "
                   f"{args.health_every} steps; qjax.health.worst): the largest value, its layer/operand and step.\n")
    print("\n" + report)
    png = pathlib.Path(args.png or REPO / "benchmarks" / (png_name if args.corpus == "shakespeare" else
                                                         png_name.replace(".png", f"_{args.corpus}.png")))
    print(f"wrote {plot_runs(workdirs, str(png), f'{label} {size} on {corpus_label}: ' + ' vs '.join(args.recipes))}")
    report += f"\nLoss curves: benchmarks/{png.name}\n"
    if not args.no_record:
        record_results("convergence" if args.model == "llama" else f"convergence, {label}", report)


def prepare_mixed(out: pathlib.Path, corpus_file: str | None) -> None:
    """The mixed corpus's BPE shards in `out`, prepared from its .xz unless already there."""
    if text_lib.shards_are_valid(out):
        return
    candidates = [pathlib.Path(corpus_file)] if corpus_file else [
        REPO / "data" / "mixed-english.txt.xz", REPO.parent / "shared" / "corpus" / "mixed-english.txt.xz"]
    source = next((c for c in candidates if c.is_file()), None)
    if source is None:
        sys.exit(f"error: no {' or '.join(map(str, candidates))}: pass --corpus-file PATH/mixed-english.txt.xz")
    print(f"preparing {out} from {source} (BPE {MIXED_VOCAB}, {MIXED_VAL_FRACTION:.0%} of each section held out)",
          flush=True)
    meta = corpus_lib.prepare_corpus(source, out, tokenizer="bpe", val_fraction=MIXED_VAL_FRACTION,
                                     bpe_vocab_size=MIXED_VOCAB)
    print(f"  {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens in {meta['seconds']:.0f} s",
          flush=True)


def checkpoint_interval(steps: int, checkpoint_every: int) -> int:
    """At most 8 checkpoints a run: a run killed without warning (its machine withdrawn) loses at most an eighth, and
    a long run is not slowed by checkpoint writes (a signal or --time-budget saves the step reached). steps / 8 is
    rounded up: 7629 steps make 8 intervals of 954, not 8 of 953 and a ninth of 5."""
    return max(checkpoint_every, -(-steps // 8))


def time_budget(seconds: float | None) -> threading.Event:
    """An event set after `seconds` (never, for None). Passed to `train` as its stop_event, it stops the run in flight
    as SIGTERM would (the step reached is saved); set, it keeps the next runs from starting."""
    over = threading.Event()
    if seconds:
        timer = threading.Timer(seconds, over.set)
        timer.daemon = True
        timer.start()
    return over


def run_is_complete(config, workdir: pathlib.Path) -> bool:
    """Whether the run in `workdir` has logged its final eval (after its last train row): one copied back from a device
    without its checkpoints is tabled, and one killed between its last step and that eval trains again."""
    train_rows, eval_rows = read_curves(str(workdir))  # ([], []) before the first row
    evals = config.eval_every and config.eval_batches
    last = eval_rows if evals else train_rows  # a run without evals ends at its last train row
    return bool(last) and last[-1][0] >= config.steps


def train_run(config, workdir: pathlib.Path, stop_event: threading.Event) -> bool:
    """Trains the run in `workdir` to config.steps, resuming from its newest checkpoint. Returns True
    once it is complete, False when `stop_event` (the time budget) or SIGINT / SIGTERM stopped it: the step it
    reached is saved, and the same call resumes there."""
    try:
        train(config, str(workdir), stop_event=stop_event)
    except Interrupted as e:
        print(e, flush=True)
        return False
    except KeyboardInterrupt:  # Ctrl-C during the run's last step, passed on by train once the run had saved
        if not run_is_complete(config, workdir):  # Ctrl-C while train was starting up: nothing ran
            raise
        print(f"interrupted after {workdir.name}'s last step (saved): run the same command again to go on",
              file=sys.stderr, flush=True)
        sys.exit(130)
    return True


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


HEALTH_HEADER = ["| run | most saturated | most underflow | largest amax growth (x, w) |", "|---|---|---|---|"]


def health_row(name: str, worst: dict) -> str:
    """A markdown row of `qjax.health.worst`'s result for run `name`."""
    cells = []
    for stat, fmt in (("saturated", "{:.2%}"), ("underflow", "{:.2%}"), ("amax_growth", "x{:.3g}")):
        value, where, step = worst.get(stat, (None, "", 0))
        cells.append("–" if value is None else f"{fmt.format(value)} {where} @ {step}")
    return f"| {name} | " + " | ".join(cells) + " |"


def end_train_loss(train_curve: list[tuple[int, float]]) -> float:
    """The mean train loss over the last 5% of a run's steps. train_curve: [(step, loss), ...] sorted by step, each
    row the mean over the steps since the row before it, so weighted by them (a run's last row may cover fewer)."""
    if not train_curve:
        raise ValueError("no train loss rows in the run's metrics.jsonl: train it first (or copy its metrics.jsonl)")
    last, previous, total, steps = train_curve[-1][0], 0, 0.0, 0
    for step, loss in train_curve:
        if step > last * 0.95:
            total, steps = total + loss * (step - previous), steps + step - previous
        previous = step
    return total / steps


def table(evals: dict, fits: dict) -> list[str]:
    """Markdown rows of the eval losses, evals: entry -> {seed: [(step, eval loss), ...]} (each run's eval curve),
    and the train losses at the end, fits: entry -> {seed: `end_train_loss`}.
    Each run gives its final eval loss and its lowest (on a small corpus a long run over-fits, and the two part),
    and its train loss over the last 5% of steps (where eval loss rises, a lower train loss means it memorised more).
    All entries with one seed, the same: the losses and their relative differences to bf16's. Otherwise: each
    loss's mean ± standard error over the entry's seeds (bf16's row: the seed spread), each seed's final difference
    to bf16's run of the same seed, and the mean ± standard error of the paired differences (s.e. = sample standard
    deviation / sqrt(seeds); "–" for one seed)."""
    finals = {entry: {seed: curve[-1] for seed, curve in runs.items()} for entry, runs in evals.items()}
    lowest = {entry: {seed: min(curve, key=lambda point: point[1]) for seed, curve in runs.items()}
              for entry, runs in evals.items()}

    def gaps(entry, of):  # {seed: % difference to bf16's run of the same seed}
        base = of.get("bf16", {})
        return {seed: (loss - base[seed][1]) / base[seed][1] * 100 for seed, (_, loss) in of[entry].items()
                if seed in base}

    def mean_se(xs, fmt, unit=""):
        se = f" ± {statistics.stdev(xs) / math.sqrt(len(xs)):{fmt.lstrip('+')}}{unit}" if len(xs) > 1 else ""
        return f"{statistics.mean(xs):{fmt}}{unit}{se}" if xs else "–"

    if all(len(runs) == 1 for runs in evals.values()) and len({s for r in evals.values() for s in r}) == 1:
        lines = ["| recipe | final step | final eval loss | vs bf16 | lowest eval loss (step) | vs bf16 | "
                 "train loss, last 5% |", "|---|---:|---:|---:|---:|---:|---:|"]
        for entry in evals:
            [(step, loss)], [(low_step, low)] = finals[entry].values(), lowest[entry].values()
            gap, low_gap = (mean_se(list(gaps(entry, of).values()), "+.2f", "%") for of in (finals, lowest))
            [fit] = fits[entry].values()
            lines.append(f"| {entry} | {step} | {loss:.4f} | {gap} | {low:.4f} ({low_step}) | {low_gap} | "
                         f"{fit:.4f} |")
        return lines
    lines = ["| recipe | seeds | final step | final eval loss, mean ± s.e. | vs bf16 per seed | vs bf16, mean ± s.e. | "
             "lowest eval loss, mean ± s.e. | vs bf16, mean ± s.e. | train loss, last 5%, mean ± s.e. |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|"]
    for entry, runs in finals.items():
        paired = gaps(entry, finals)
        per_seed = ", ".join(f"{r:+.2f}%" for r in paired.values()) or "–"
        step = list(runs.values())[-1][0]
        lines.append(f"| {entry} | {', '.join(map(str, runs))} | {step} | "
                     f"{mean_se([loss for _, loss in runs.values()], '.4f')} | {per_seed} | "
                     f"{mean_se(list(paired.values()), '+.2f', '%')} | "
                     f"{mean_se([loss for _, loss in lowest[entry].values()], '.4f')} | "
                     f"{mean_se(list(gaps(entry, lowest).values()), '+.2f', '%')} | "
                     f"{mean_se(list(fits[entry].values()), '.4f')} |")
    return lines


if __name__ == "__main__":
    main()
