"""Report writers of the benchmarks: CSV, JSON, markdown tables (with the machine header) and plots."""

from __future__ import annotations

import csv
import json
import os
import sys
from dataclasses import asdict

from .cases import BenchResult
from .harness import TIMING_ENVIRONMENT, paired_ratio_interval
from .causal import CausalResult
from .classification import ClassificationResult
from .seq2seq import Seq2SeqResult


def _ratios(time_ratio, flops_ratio) -> str:
    """` (1.23x; FLOPs 0.81)`: a throughput ratio and the nominal FLOP ratio against the baseline."""
    return f" ({_fmt(time_ratio, '.2f')}x; FLOPs {_fmt(flops_ratio, '.2f')})"


def _length_table(title: str, models: list[str], lengths: list[int], cell) -> list[str]:
    """Markdown lines of one table: a row per length, a column per model, `cell(model, n)` its text
    (None: a dash)."""
    lines = [f"{title}:\n", "| n | " + " | ".join(models) + " |", "|---:|" + "---:|" * len(models)]
    for n in lengths:
        cells = [cell(model, n) for model in models]
        lines.append(f"| {n} | " + " | ".join("—" if c is None else c for c in cells) + " |")
    return lines + [""]


def _model_list(results: list) -> list[str]:
    """`- `model`: description, parameters` lines, one per model."""
    parameters = {r.model: (r.parameters, r.description) for r in results}
    return [f"- `{m}`: {d}, {p / 1e6:.2f}M parameters" for m, (p, d) in parameters.items()]


def seq2seq_markdown(results: list[Seq2SeqResult]) -> str:
    """One length: a row per model (times, tokens/s and sentences/s with the time and nominal FLOP
    ratios against BART). A sweep (several lengths): `seq2seq_sweep_markdown`."""
    if not results:
        return ""
    if len({(r.source_length, r.target_length) for r in results}) > 1:
        return seq2seq_sweep_markdown(results)
    r0 = results[0]
    lines = [
        f"**encoder-decoder, batch {r0.batch}, source {r0.source_length} / target {r0.target_length} tokens, "
        f"width {r0.width}, {r0.layers}+{r0.layers} layers, {r0.heads} heads, FFN {r0.ffn}, vocabulary {r0.vocab}, "
        f"{r0.dtype}, {r0.device}**\n",
        "| model | parameters | train step ms | train tokens/s (vs BART; FLOPs vs BART) | greedy generate ms | "
        "sentences/s (vs BART; FLOPs vs BART) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        train_ratio = _ratios(r.train_speedup_vs_bart, r.train_flops_ratio_vs_bart)
        gen_ratio = _ratios(r.generate_speedup_vs_bart, r.generate_flops_ratio_vs_bart)
        lines.append(
            f"| {r.model} | {r.parameters / 1e6:.1f}M | {r.train_step_ms:.0f} | {r.train_tokens_per_s:.0f}{train_ratio} | "
            f"{r.generate_ms:.0f} | {r.sentences_per_s:.2f}{gen_ratio} |"
        )
    lines.append("")
    lines.extend(f"- `{r.model}`: {r.description}" for r in results)
    lines.extend(_paired_lines(results))
    return "\n".join(lines) + "\n"


def _paired_lines(results: list[Seq2SeqResult]) -> list[str]:
    """Markdown lines of the paired ratios against BART (`harness.paired_ratio_interval`): per model,
    the median of BART's time / the model's time over the rounds of the run, with its 95% bootstrap
    interval. None without BART or with fewer than 5 rounds, too few for an interval."""
    base = next((r for r in results if r.model == "bart"), None)
    if base is None or len(base.train_times_ms) < 5:
        return []
    lines = [
        "",
        f"Paired per round ({len(base.train_times_ms)} rounds): the median of BART's time / the model's time "
        "over the rounds, each round timing every model once, with a 95% bootstrap interval of that median:",
        "",
        "| model | training vs BART [95%] | greedy generation vs BART [95%] |",
        "|---|---:|---:|",
    ]
    for r in results:
        if r is base:
            continue
        cells = []
        for kind in ("train_times_ms", "generate_times_ms"):
            median, low, high = paired_ratio_interval(getattr(base, kind), getattr(r, kind))
            cells.append(f"{median:.3f}x [{low:.3f}, {high:.3f}]")
        lines.append(f"| {r.model} | " + " | ".join(cells) + " |")
    return lines


def seq2seq_sweep_markdown(results: list[Seq2SeqResult]) -> str:
    """Two tables (training, greedy generation): a row per length n (source = target = n), per
    model its tokens/s or sentences/s with the time ratio and the nominal FLOP ratio against BART."""
    if not results:
        return ""
    r0 = results[0]
    models = list(dict.fromkeys(r.model for r in results))
    lengths = sorted({r.source_length for r in results})
    cell = {(r.model, r.source_length): r for r in results}
    lines = [
        _shape_line("encoder-decoder, source = target = n tokens", r0, f"{r0.layers}+{r0.layers} layers"),
        "Each cell: throughput (its ratio vs BART; nominal FLOP ratio vs BART).\n",
    ]

    def train(model, n):
        r = cell.get((model, n))
        return None if r is None else f"{r.train_tokens_per_s:.0f}" + _ratios(
            r.train_speedup_vs_bart, r.train_flops_ratio_vs_bart)

    def generate(model, n):
        r = cell.get((model, n))
        return None if r is None else f"{r.sentences_per_s:.3g}" + _ratios(
            r.generate_speedup_vs_bart, r.generate_flops_ratio_vs_bart)

    lines += _length_table("training, tokens/s (forward + backward + AdamW step; source + target tokens)",
                           models, lengths, train)
    lines += _length_table("greedy generation of n tokens, sentences/s", models, lengths, generate)
    lines += _model_list(results)
    return "\n".join(lines) + "\n"


def write_seq2seq_reports(results: list[Seq2SeqResult], output_prefix: str, metadata: dict,
                          make_plot: bool = True) -> dict:
    """Write `<prefix>.csv`, `<prefix>.json` and `<prefix>.md` of the encoder-decoder level, and for
    a sweep over lengths `<prefix>.png` (`seq2seq_plot`); returns the paths."""
    sweep = len({r.source_length for r in results}) > 1
    return _write_level_reports(results, output_prefix, metadata, list(Seq2SeqResult.__dataclass_fields__),
                                {"train_times_ms": ".1f", "generate_times_ms": ".1f"}, seq2seq_markdown(results),
                                seq2seq_plot if make_plot and sweep else None)


def seq2seq_plot(results: list[Seq2SeqResult], path: str):
    """Throughput ratio vs BART against n (source = target), training and generation panels."""
    panels = []
    for kind, speedup, flops in (("training", "train_speedup_vs_bart", "train_flops_ratio_vs_bart"),
                                 ("greedy generation", "generate_speedup_vs_bart", "generate_flops_ratio_vs_bart")):
        points = [(r.model, r.source_length, getattr(r, speedup), getattr(r, flops)) for r in results]
        panels.append((f"encoder-decoder {kind}, B={results[0].batch}, d={results[0].width}", points))
    ratio_plot(panels, path, "BART", "source = target length n")


def causal_markdown(results: list[CausalResult]) -> str:
    """One table per kind (training, generation): a row per length, per model its tokens/s with
    the time ratio and the nominal FLOP ratio against GPT-2 (and, generating, the cache size)."""
    if not results:
        return ""
    legend = ("Each cell: tokens/s (tokens/s ratio vs GPT-2; nominal FLOP ratio vs GPT-2)"
              + ("; generating: cache MB at the end" if any(r.kind == "generate" for r in results) else "") + ".\n")

    def text(r):
        cache = f"; {r.cache_mb:.3g} MB" if r.cache_mb is not None else ""
        return f"{r.tokens_per_s:.0f}" + _ratios(r.speedup_vs_gpt2, r.flops_ratio_vs_gpt2) + cache

    return _kind_markdown(results, "decoder-only", legend, (
        ("train", "training (forward + backward + AdamW step, batch x n tokens)"),
        ("generate", "greedy generation with the cache (prompt n/2, n/2 new tokens)")), text)


def _kind_markdown(results: list, what: str, legend: str, sections, text) -> str:
    """The by-length report of a side-by-side level whose results have a `kind`: the shape line,
    `legend`, then per (kind, title) of `sections` that has results a table (a row per length, a
    column per model, `text(result)` each cell), then the models."""
    models = list(dict.fromkeys(r.model for r in results))
    cell = {(r.model, r.kind, r.length): r for r in results if r.tokens_per_s is not None}
    lines = [_shape_line(what, results[0], f"{results[0].layers} layers"), legend]
    for kind, title in sections:
        lengths = sorted({r.length for r in results if r.kind == kind})
        if lengths:
            lines += _length_table(title, models, lengths, lambda model, n, kind=kind: (
                None if (model, kind, n) not in cell else text(cell[model, kind, n])))
    lines += _model_list(results)
    return "\n".join(lines) + "\n"


def _shape_line(what: str, r, layers: str) -> str:
    return (f"**{what}, batch {r.batch}, width {r.width}, {layers}, {r.heads} heads, FFN {r.ffn}, "
            f"vocabulary {r.vocab}, {r.dtype}, {r.device}**\n")


def write_causal_reports(results: list[CausalResult], output_prefix: str, metadata: dict) -> dict:
    """Write `<prefix>.csv`, `<prefix>.json` and `<prefix>.md` of the decoder-only level; returns the paths."""
    return _write_level_reports(results, output_prefix, metadata, list(CausalResult.__dataclass_fields__),
                                {"times_ms": ".1f"}, causal_markdown(results))


def classification_markdown(results: list[ClassificationResult]) -> str:
    """One table per kind (inference, training): a row per length, per model its tokens/s with the
    time ratio and the nominal FLOP ratio against BERT (and the executed FLOP ratio where it differs)."""
    if not results:
        return ""
    legend = ("Each cell: tokens/s (tokens/s ratio vs BERT; nominal FLOP ratio vs BERT; executed FLOP ratio, "
              "where hf_zformer's folded forms run fewer FLOPs than nominal).\n")

    def text(r):
        ratios = _ratios(r.speedup_vs_bert, r.flops_ratio_vs_bert)
        if r.executed_flops != r.flops and r.executed_flops_ratio_vs_bert is not None:
            ratios = ratios[:-1] + f"; executed {r.executed_flops_ratio_vs_bert:.2f})"
        return f"{r.tokens_per_s:.0f}{ratios}"

    return _kind_markdown(results, "sequence classification", legend, (
        ("forward", "inference (eval, torch.inference_mode, batch x n tokens)"),
        ("train", "training (forward with labels + backward + AdamW step, batch x n tokens)")), text)


def write_classification_reports(results: list[ClassificationResult], output_prefix: str, metadata: dict,
                                 make_plot: bool = True) -> dict:
    """Write `<prefix>.csv`, `<prefix>.json`, `<prefix>.md` and `<prefix>.png` (`classification_plot`)
    of the sequence-classification level; returns the paths."""
    return _write_level_reports(results, output_prefix, metadata, list(ClassificationResult.__dataclass_fields__),
                                {"times_ms": ".1f"}, classification_markdown(results),
                                classification_plot if make_plot else None)


def classification_plot(results: list[ClassificationResult], path: str):
    """Tokens/s ratio vs BERT against n, one panel per kind (inference, training)."""
    panels = []
    for kind in dict.fromkeys(r.kind for r in results):
        points = [(r.model, r.length, r.speedup_vs_bert, r.flops_ratio_vs_bert) for r in results if r.kind == kind]
        panels.append((f"classification {kind}, B={results[0].batch}, d={results[0].width}", points))
    ratio_plot(panels, path, "BERT", "sequence length n")


def ratio_plot(panels: list[tuple[str, list[tuple]]], path: str, baseline: str, xlabel: str):
    """One panel per (title, points), side by side; points: (model, n, time ratio, FLOP ratio).
    Solid lines: the measured throughput ratio vs `baseline` against n (log2 x, log y); dashed,
    same colour: the speedup the nominal FLOPs alone predict (1 / FLOP ratio)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (title, points) in zip(axes[0], panels):
        for index, model in enumerate(dict.fromkeys(p[0] for p in points)):
            color = f"C{index}"
            measured = sorted((n, ratio) for m, n, ratio, _ in points if m == model and ratio)
            predicted = sorted((n, 1 / flops) for m, n, _, flops in points if m == model and flops)
            if measured:
                ax.plot(*zip(*measured), marker="o", color=color, label=model)
            if predicted and model != baseline.lower():
                ax.plot(*zip(*predicted), linestyle="--", color=color, alpha=0.6)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"throughput ratio vs {baseline} (dashed: 1 / FLOP ratio)")
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


CSV_FIELDS = [
    "level", "attention_type", "mode", "batch", "length", "width", "heads", "dtype", "device", "mask", "graphs", "compiled",
    "status",
    "time_ms", "speedup_vs_full", "peak_memory_mb", "flops", "executed_flops", "tflops", "flops_fraction",
    "executed_fraction", "operations", "bytes", "bandwidth_fraction", "note", "times_ms",
]


def write_csv(results: list[BenchResult], path: str):
    _write_csv(results, path, CSV_FIELDS, {"times_ms": ".3f"})


def _write_csv(results: list, path: str, fields: list[str], time_lists: dict[str, str]):
    """One row per result (dataclass) with `fields`; the lists named in `time_lists` written as
    space-separated numbers in the given format."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for r in results:
            row = asdict(r)
            for key, spec in time_lists.items():
                row[key] = " ".join(format(t, spec) for t in row[key])
            writer.writerow({k: row[k] for k in fields})


def write_json(results: list, path: str, metadata: dict):
    with open(path, "w") as handle:
        json.dump({"metadata": metadata, "results": [asdict(r) for r in results]}, handle, indent=1)


def _report_paths(output_prefix: str) -> dict[str, str]:
    """`<prefix>.csv/.json/.md`, the prefix's folder created."""
    directory = os.path.dirname(output_prefix)
    if directory:
        os.makedirs(directory, exist_ok=True)
    return {"csv": output_prefix + ".csv", "json": output_prefix + ".json", "md": output_prefix + ".md"}


def _write_markdown(path: str, metadata: dict, body: str):
    with open(path, "w") as handle:
        handle.write(markdown_header(metadata) + "\n" + body)


def _fmt(value, spec):
    return "—" if value is None else format(value, spec)


def markdown_table(results: list[BenchResult]) -> str:
    """One table per (level, mode, width, heads, dtype, device): rows = n, one column group per type."""
    out = []
    groups = {}
    for r in results:
        key = (r.level, r.mode, r.batch, r.width, r.heads, r.dtype, r.device, r.mask, r.graphs, r.compiled)
        groups.setdefault(key, []).append(r)
    for (level, mode, batch, width, heads, dtype, device, mask, graphs, compiled), rows in groups.items():
        types = list(dict.fromkeys(r.attention_type for r in rows))
        lengths = sorted({r.length for r in rows})
        by_key = {(r.length, r.attention_type): r for r in rows}
        counted = any(r.bandwidth_fraction is not None for r in rows)  # compiled modules are not counted
        bandwidth_caption = " · bytes moved per second as % of the copy bandwidth (bw)" if counted else ""
        out.append(
            f"**{level}, {mode}, batch {batch}, width {width}, {heads} heads, {dtype}, {device}"
            f"{', all-ones padding mask' if mask else ''}{', CUDA graphs' if graphs else ''}"
            f"{f', torch.compile(mode={compiled!r})' if compiled else ''}** — time ms (speedup vs fused SDPA `full`) · "
            f"peak extra memory MiB · nominal FLOP/s as % of matmul (executed FLOP/s %, where it differs)"
            f"{bandwidth_caption}\n"
        )
        out.append("| n | " + " | ".join(types) + " |")
        out.append("|---:|" + "---|" * len(types))
        for n in lengths:
            cells = []
            for t in types:
                r = by_key.get((n, t))
                if r is None:
                    cells.append("")
                elif r.status != "ok":
                    cells.append(f"{r.status}")
                else:
                    speed = f" ({r.speedup_vs_full:.2f}x)" if r.speedup_vs_full is not None else ""
                    frac = ""
                    if r.flops_fraction is not None:
                        frac = f" · {100 * r.flops_fraction:.0f}%"
                        if r.executed_flops != r.flops:
                            frac += f" ({100 * r.executed_fraction:.0f}%)"
                    if r.bandwidth_fraction is not None:
                        frac += f" · bw {100 * r.bandwidth_fraction:.0f}%"
                    cells.append(f"{r.time_ms:.1f}{speed} · {_fmt(r.peak_memory_mb, '.0f')}{frac}")
            out.append(f"| {n} | " + " | ".join(cells) + " |")
        notes = sorted({f"{r.attention_type} n={r.length}: {r.note}" for r in rows if r.status != "ok" and r.note})
        if notes:
            out.append("")
            out.extend(f"- {note}" for note in notes)
        out.append("")
        for r in rows:
            if r.profile:
                out.append(f"<details><summary>profile: {r.attention_type}, n={r.length}</summary>\n")
                out.append("```\n" + r.profile.strip() + "\n```\n</details>\n")
    return "\n".join(out)


def plot(results: list[BenchResult], path: str):
    """Time and peak memory vs n, log-log, one line per type; one row of panels per
    (level, mode, width, heads, dtype)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = {}
    for r in results:
        groups.setdefault((r.level, r.mode, r.batch, r.width, r.heads, r.dtype, r.device), []).append(r)
    fig, axes = plt.subplots(len(groups), 2, figsize=(11, 4 * len(groups)), squeeze=False)
    for row, (key, rows) in enumerate(groups.items()):
        level, mode, batch, width, heads, dtype, device = key
        for col, (attr, label) in enumerate((("time_ms", "time per call (ms)"), ("peak_memory_mb", "peak extra memory (MiB)"))):
            ax = axes[row][col]
            for t in dict.fromkeys(r.attention_type for r in rows):
                points = sorted((r.length, getattr(r, attr)) for r in rows
                                if r.attention_type == t and r.status == "ok" and getattr(r, attr))
                if points:
                    ax.plot(*zip(*points), marker="o", label=t)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length n")
            ax.set_ylabel(label)
            ax.set_title(f"{level} {mode}, B={batch}, d={width}, h={heads}, {dtype}, {device}", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_reports(results: list[BenchResult], output_prefix: str, metadata: dict, make_plot: bool = True) -> dict:
    """Write `<prefix>.csv`, `<prefix>.json`, `<prefix>.md` (and `<prefix>.png`); returns the paths."""
    return _write_level_reports(results, output_prefix, metadata, CSV_FIELDS, {"times_ms": ".3f"},
                                markdown_table(results), plot if make_plot else None)


def _write_level_reports(results: list, output_prefix: str, metadata: dict, fields: list[str],
                         time_lists: dict[str, str], body: str, plotter=None) -> dict:
    """`<prefix>.csv` (`fields`, `time_lists` as in `_write_csv`), `<prefix>.json`, `<prefix>.md`
    (the machine header and `body`) and, given a `plotter(results, path)`, `<prefix>.png`; returns
    the paths."""
    paths = _report_paths(output_prefix)
    _write_csv(results, paths["csv"], fields, time_lists)
    write_json(results, paths["json"], metadata)
    _write_markdown(paths["md"], metadata, body)
    if plotter is not None:
        paths["png"] = output_prefix + ".png"
        plotter(results, paths["png"])
    return paths


def markdown_header(metadata: dict) -> str:
    matmul = metadata.get("matmul", {})
    allocator = metadata.get("args", {}).get("cpu_allocator", "system")
    lines = [
        f"Command: `{metadata.get('command', '')}`",
        "",
        f"Machine: {metadata.get('cpu', '?')} ({metadata.get('cpu_count', '?')} CPUs, {metadata.get('threads', '?')} "
        f"torch threads){', ' + metadata['gpu'] if 'gpu' in metadata else ''}; torch {metadata.get('torch', '?')}, "
        f"transformers {metadata.get('transformers', '?')}"
        f"{', triton ' + metadata['triton'] if metadata.get('triton') else ''}; {metadata.get('date', '')}"
        f"{'; commit ' + metadata['commit'] if metadata.get('commit') else ''}.",
        f"Environment: {metadata.get('environment') or 'defaults'}"
        f"{'; C allocator retains freed memory (--cpu_allocator retain)' if allocator == 'retain' else ''}; load average at start "
        f"{metadata.get('load_average')}, at end {metadata.get('load_average_end')}.",
    ]
    if matmul:
        lines.append(
            f"Measured matmul: {matmul['size']}x{matmul['size']} {matmul['dtype']}, "
            f"{matmul['flops'] / 1e9:.1f} GFLOP/s (the 100% of the FLOP/s column)."
        )
    bandwidth = metadata.get("bandwidth")
    if bandwidth:
        lines.append(
            f"Measured copy: {bandwidth['size_bytes'] / 2**20:.0f} MiB, {bandwidth['bytes_per_s'] / 1e9:.1f} GB/s "
            f"read plus written (the 100% of the bandwidth column, bw)."
        )
    return "\n".join(lines) + "\n"


def command_line() -> str:
    """`python <script> <args>`, prefixed by the timing-relevant environment variables that are set."""
    environment = [f"{k}={os.environ[k]}" for k in TIMING_ENVIRONMENT if k in os.environ]
    script = os.path.relpath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return " ".join(environment + ["python", script] + sys.argv[1:])
