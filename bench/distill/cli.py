"""`verity distill`: builds the embedded model's draft here (bench/distill/train.py has the recipe).

    verity distill            generate, train, evaluate, export (resumes from --work)
    verity distill measure    what a draft can pay on this machine: forward costs, needed acceptance
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from bench.common import print_report, progress_console
from cli.blas import reexec_with_blas

DEFAULT_WORK = Path.home() / ".cache" / "verity" / "distill"
GOAL = 1.3


def _bars():
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=progress_console)


def run_distill(args: argparse.Namespace) -> int:
    reexec_with_blas()
    from bench.distill import train as d
    from worker.draft.model import ASSET_DIR
    from worker.loader import load_model

    recipe = d.Recipe(seed=args.seed, prompts=args.prompts)
    if args.epochs:
        recipe.epochs = args.epochs
    if args.layers:
        recipe.layer_ids = args.layers
    target = load_model("embedded", float_weights=True)  # its layers are copied into the draft
    with _bars() as bars:
        def progress(description: str, total: int):
            task = bars.add_task(description, total=total)
            return lambda n=1: bars.advance(task, n)
        meta = d.run(target, asdict(target.model.args), Path(args.work), Path(args.out or ASSET_DIR), recipe, progress)
    h = meta["heldout"]
    rows = [(f"position {j + 1}", f"{a:.3f}", str(n)) for j, (a, n) in enumerate(zip(h["per_position"], h["positions"]))]
    print_report(f"held-out greedy acceptance ({h['prompts']} prompts never trained on)", rows,
                 ("draft position", "acceptance", "tried"), h, args.json,
                 f"trained on {meta['training_tokens']} teacher tokens; draft written to {args.out or ASSET_DIR}")
    return 0


def run_measure(args: argparse.Namespace) -> int:
    reexec_with_blas()
    from bench.distill.costs import forward_cost, needed_acceptance, speedup
    from worker.draft.model import init_from_target
    from worker.loader import load_model

    target = load_model("embedded")
    targs = asdict(target.model.args)
    n = targs["num_hidden_layers"]
    verify = {t: forward_cost(target.model, args.context, t, args.repeats) for t in range(1, 10)}
    v = {t: s / verify[1] for t, s in verify.items()}
    rows = [(f"target, {t} token{'s' * (t > 1)}", f"{s * 1e3:.1f}", f"{v[t]:.2f}") for t, s in verify.items()]
    drafts = {}
    for layers in args.draft_layers:
        for head in (None, args.head_size):
            ids = list(range(n - layers, n))
            d = init_from_target(target.model, targs, ids, None if head is None else list(range(head)))
            cost = forward_cost(d, args.context, 1, args.repeats)
            name = f"draft {layers} layer{'s' * (layers > 1)}, head {'all' if head is None else head}"
            drafts[name] = cost / verify[1]
            rows.append((name, f"{cost * 1e3:.1f}", f"{cost / verify[1]:.2f}"))
    needs = {}
    for name, c in drafts.items():
        for k in (1, 2, 3, 4):
            a = needed_acceptance(k, c, v, GOAL)
            needs[f"{name}, k={k}"] = a
            rows.append((f"  {name}: k={k} needs", "", "–" if a is None else f"a ≥ {a:.2f}"))
    figures = {"verify_s": verify, "draft_relative": drafts, "needed_acceptance": needs,
               "context": args.context, "goal": GOAL,
               "example": {"k=2, a=0.7": {nm: speedup(2, 0.7, c, v) for nm, c in drafts.items()}}}
    print_report(f"what a draft of SmolLM2-135M can pay here (context {args.context}; cost medians of {args.repeats})",
                 rows, ("forward", "ms", "÷ 1-token target"), figures, args.json,
                 f"speed-up S(k, a) = (1 + a + … + a^k) / (k·c + v(k+1)); 'needs' is the per-position acceptance for S = {GOAL}")
    return 0


def add_commands(sub) -> None:
    p = sub.add_parser("distill", help="build the embedded model's draft here (resumable)")
    p.add_argument("--work", default=str(DEFAULT_WORK), help=f"work folder, kept for resuming (default {DEFAULT_WORK})")
    p.add_argument("--out", default=None, help="where the draft is written (default: the package's worker/draft/embedded)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=None, help="default: the recipe's (3)")
    p.add_argument("--prompts", type=int, default=None, help="use only the first N training prompts")
    p.add_argument("--layers", type=int, nargs="*", default=None, help="target layers the draft starts from")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_distill)
    steps = p.add_subparsers(dest="step")
    m = steps.add_parser("measure", help="forward costs and the acceptance a draft needs for 1.3x")
    m.add_argument("--context", type=int, default=256, help="tokens already in the cache")
    m.add_argument("--repeats", type=int, default=15)
    m.add_argument("--draft-layers", type=int, nargs="*", default=[1, 2, 4, 6])
    m.add_argument("--head-size", type=int, default=8192)
    m.add_argument("--json", action="store_true")
    m.set_defaults(run=run_measure)
