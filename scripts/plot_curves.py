#!/usr/bin/env python
"""Plot validation curves (metric vs optimizer step) of several training runs into one PNG.

Reads ``eval_history.jsonl`` (written by run_translation.py / run_classification.py at every
evaluation: ``--eval_steps`` and each epoch) from each run folder; one line per run, the best
evaluation marked. Needs matplotlib (``pip install -e ".[plots]"``; in the dev extra).

    python scripts/plot_curves.py runs/multi30k-zformer runs/multi30k-full --output docs/img/multi30k_10ep_curves.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from hf_zformer import flags, folders  # noqa: E402
from hf_zformer.training.evaluation import HISTORY_FILE, read_history  # noqa: E402

KNOWN_METRICS = ("bleu", "accuracy")


def parse_args(argv=None) -> argparse.Namespace:
    parser = flags.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("runs", nargs="+", help=f"Run folders (--output_dir of the training scripts) with {HISTORY_FILE}.")
    parser.add_argument("--output", required=True, help="PNG file to write.")
    parser.add_argument("--metric", default=None,
                        help=f"History key to plot (default: the first of {KNOWN_METRICS} found in the histories).")
    parser.add_argument("--x", choices=("step", "epoch"), default="step", help="Horizontal axis.")
    parser.add_argument("--labels", default=None, help="Comma-separated legend labels (default: the folder names).")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    for run in args.runs:
        if not (Path(run) / HISTORY_FILE).is_file():
            parser.error(f"{run}: no {HISTORY_FILE} (train with run_translation.py/run_classification.py into it first)")
    if args.labels is not None and len(args.labels.split(",")) != len(args.runs):
        parser.error(f"--labels has {len(args.labels.split(','))} labels for {len(args.runs)} runs")
    try:  # before any work: no file of somebody else's is overwritten
        folders.check_output_files([args.output])
    except ValueError as error:
        parser.error(str(error))
    return args


def main(argv=None) -> Path:
    args = parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    histories = [read_history(run) for run in args.runs]
    metric = args.metric or next(
        (m for m in KNOWN_METRICS if any(m in r for history in histories for r in history)), None
    )
    if metric is None or not any(metric in r for history in histories for r in history):
        raise SystemExit(f"error: no metric {args.metric or KNOWN_METRICS} in the histories")
    labels = args.labels.split(",") if args.labels else [Path(run).resolve().name for run in args.runs]
    scale = 100.0 if metric == "accuracy" else 1.0  # accuracy in %
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for label, history in zip(labels, histories):
        points = [(r[args.x], scale * r[metric]) for r in history if metric in r]
        if not points:
            continue
        xs, ys = zip(*points)
        (line,) = axes.plot(xs, ys, marker="o", markersize=3, label=label)
        best = max(range(len(ys)), key=lambda i: (ys[i], -i))
        axes.plot([xs[best]], [ys[best]], marker="*", markersize=12, color=line.get_color())
    axes.set_xlabel("optimizer step" if args.x == "step" else "epoch")
    axes.set_ylabel(f"validation {metric}" + (" (%)" if metric == "accuracy" else ""))
    axes.set_title(args.title or f"validation {metric} (best marked *)")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=120)
    folders.record_files([output])
    plt.close(figure)
    print(f"wrote {output}")
    return output


if __name__ == "__main__":
    sys.exit(main() and 0)
