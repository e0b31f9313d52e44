"""Report writers of the benchmarks: CSV, JSON, markdown tables (with the machine header) and plots."""

from __future__ import annotations

import csv
import json
import os
import sys
from dataclasses import asdict

from .cases import BenchResult
from .harness import TIMING_ENVIRONMENT
from .causal import CausalResult
from .seq2seq import Seq2SeqResult


def seq2seq_markdown(results: list[Seq2SeqResult]) -> str:
    if not results:
        return ""
    r0 = results[0]
    lines = [
        f"**encoder-decoder, batch {r0.batch}, source {r0.source_length} / target {r0.target_length} tokens, "
        f"width {r0.width}, {r0.layers}+{r0.layers} layers, {r0.heads} heads, FFN {r0.ffn}, vocabulary {r0.vocab}, "
        f"{r0.dtype}, {r0.device}**\n",
        "| model | parameters | train step ms | train tokens/s (vs BART) | greedy generate ms | sentences/s (vs BART) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        train_ratio = f" ({r.train_speedup_vs_bart:.2f}x)" if r.train_speedup_vs_bart is not None else ""
        gen_ratio = f" ({r.generate_speedup_vs_bart:.2f}x)" if r.generate_speedup_vs_bart is not None else ""
        lines.append(
            f"| {r.model} | {r.parameters / 1e6:.1f}M | {r.train_step_ms:.0f} | {r.train_tokens_per_s:.0f}{train_ratio} | "
            f"{r.generate_ms:.0f} | {r.sentences_per_s:.2f}{gen_ratio} |"
        )
    lines.append("")
    lines.extend(f"- `{r.model}`: {r.description}" for r in results)
    return "\n".join(lines) + "\n"


def write_seq2seq_reports(results: list[Seq2SeqResult], output_prefix: str, metadata: dict) -> dict:
    """Write `<prefix>.csv`, `<prefix>.json` and `<prefix>.md` of the encoder-decoder level; returns the paths."""
    paths = _report_paths(output_prefix)
    _write_csv(results, paths["csv"], list(Seq2SeqResult.__dataclass_fields__),
               {"train_times_ms": ".1f", "generate_times_ms": ".1f"})
    write_json(results, paths["json"], metadata)
    _write_markdown(paths["md"], metadata, seq2seq_markdown(results))
    return paths


def causal_markdown(results: list[CausalResult]) -> str:
    """One table per kind (training, generation): a row per length, per model its tokens/s with
    the time ratio and the nominal FLOP ratio against GPT-2 (and, generating, the cache size)."""
    if not results:
        return ""
    r0 = results[0]
    models = list(dict.fromkeys(r.model for r in results))
    cell = {(r.model, r.kind, r.length): r for r in results}
    lines = [
        f"**decoder-only, batch {r0.batch}, width {r0.width}, {r0.layers} layers, {r0.heads} heads, FFN {r0.ffn}, "
        f"vocabulary {r0.vocab}, {r0.dtype}, {r0.device}**\n",
        "Each cell: tokens/s (tokens/s ratio vs GPT-2; nominal FLOP ratio vs GPT-2)"
        + ("; generating: cache MB at the end" if any(r.kind == "generate" for r in results) else "") + ".\n",
    ]
    for kind, title in (("train", "training (forward + backward + AdamW step, batch x n tokens)"),
                        ("generate", "greedy generation with the cache (prompt n/2, n/2 new tokens)")):
        lengths = sorted({r.length for r in results if r.kind == kind})
        if not lengths:
            continue
        lines += [f"{title}:\n", "| n | " + " | ".join(models) + " |", "|---:|" + "---:|" * len(models)]
        for n in lengths:
            row = []
            for model in models:
                r = cell.get((model, kind, n))
                if r is None or r.tokens_per_s is None:
                    row.append("—")
                    continue
                ratios = f" ({_fmt(r.speedup_vs_gpt2, '.2f')}x; FLOPs {_fmt(r.flops_ratio_vs_gpt2, '.2f')})"
                cache = f"; {r.cache_mb:.3g} MB" if r.cache_mb is not None else ""
                row.append(f"{r.tokens_per_s:.0f}{ratios}{cache}")
            lines.append(f"| {n} | " + " | ".join(row) + " |")
        lines.append("")
    parameters = {r.model: (r.parameters, r.description) for r in results}
    lines.extend(f"- `{m}`: {d}, {p / 1e6:.2f}M parameters" for m, (p, d) in parameters.items())
    return "\n".join(lines) + "\n"


def write_causal_reports(results: list[CausalResult], output_prefix: str, metadata: dict) -> dict:
    """Write `<prefix>.csv`, `<prefix>.json` and `<prefix>.md` of the decoder-only level; returns the paths."""
    paths = _report_paths(output_prefix)
    _write_csv(results, paths["csv"], list(CausalResult.__dataclass_fields__), {"times_ms": ".1f"})
    write_json(results, paths["json"], metadata)
    _write_markdown(paths["md"], metadata, causal_markdown(results))
    return paths


CSV_FIELDS = [
    "level", "attention_type", "mode", "batch", "length", "width", "heads", "dtype", "device", "mask", "status",
    "time_ms", "speedup_vs_full", "peak_memory_mb", "flops", "executed_flops", "tflops", "flops_fraction",
    "executed_fraction", "note", "times_ms",
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
        groups.setdefault((r.level, r.mode, r.batch, r.width, r.heads, r.dtype, r.device, r.mask), []).append(r)
    for (level, mode, batch, width, heads, dtype, device, mask), rows in groups.items():
        types = list(dict.fromkeys(r.attention_type for r in rows))
        lengths = sorted({r.length for r in rows})
        by_key = {(r.length, r.attention_type): r for r in rows}
        out.append(
            f"**{level}, {mode}, batch {batch}, width {width}, {heads} heads, {dtype}, {device}"
            f"{', all-ones padding mask' if mask else ''}** — time ms (speedup vs fused SDPA `full`) · "
            f"peak extra memory MiB · nominal FLOP/s as % of matmul (executed FLOP/s %, where it differs)\n"
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
    paths = _report_paths(output_prefix)
    write_csv(results, paths["csv"])
    write_json(results, paths["json"], metadata)
    _write_markdown(paths["md"], metadata, markdown_table(results))
    if make_plot:
        paths["png"] = output_prefix + ".png"
        plot(results, paths["png"])
    return paths


def markdown_header(metadata: dict) -> str:
    matmul = metadata.get("matmul", {})
    lines = [
        f"Command: `{metadata.get('command', '')}`",
        "",
        f"Machine: {metadata.get('cpu', '?')} ({metadata.get('cpu_count', '?')} CPUs, {metadata.get('threads', '?')} "
        f"torch threads){', ' + metadata['gpu'] if 'gpu' in metadata else ''}; torch {metadata.get('torch', '?')}, "
        f"transformers {metadata.get('transformers', '?')}; {metadata.get('date', '')}.",
        f"Environment: {metadata.get('environment') or 'defaults'}; load average at start "
        f"{metadata.get('load_average')}, at end {metadata.get('load_average_end')}.",
    ]
    if matmul:
        lines.append(
            f"Measured matmul: {matmul['size']}x{matmul['size']} {matmul['dtype']}, "
            f"{matmul['flops'] / 1e9:.1f} GFLOP/s (the 100% of the FLOP/s column)."
        )
    return "\n".join(lines) + "\n"


def command_line() -> str:
    """`python <script> <args>`, prefixed by the timing-relevant environment variables that are set."""
    environment = [f"{k}={os.environ[k]}" for k in TIMING_ENVIRONMENT if k in os.environ]
    script = os.path.relpath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return " ".join(environment + ["python", script] + sys.argv[1:])
