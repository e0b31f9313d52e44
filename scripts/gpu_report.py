"""What a GPU check measured, against what the fused kernels must reach. Reads the folder that
`scripts/gpu_check.sh` writes and writes `acceptance.md` and `acceptance.json` into it:

- the bars: each linear type's speed against fused SDPA (bf16, batch 40, width 512, 8 heads),
  forward at 512 and 2,048 tokens and forward + backward at 2,048, for the attention alone and for
  whole modules (the CUDA-graph grids);
- each folded form against its plain form at the lengths where it is taken (where their executed
  FLOPs differ): whether to add "cuda" to the type's `folded_autocast` in the execution policy
  (`hf_zformer/modeling/policy.py`; on a CPU the
  default forms fold under autocast too, so there is nothing to compare);
- decoding: ms/token by context length (tokens generated, plus the prefix where one was read
  first) against the full decoder with its KV cache: flat, and below it from 4,096 tokens;
- the training scripts' tokens/s against full attention;
- fastformer's A/B (`ab_fastformer.json` of `docs/bench/ab/fastformer_gpu.py`): each variant of the
  module against the shipped form, and whether to add "cuda" to the policy's experimental
  `fused_product` (the fused product of the pooled output, in one of its two tile plans).

The check runs it after every step, so its archive always carries the report of what has run.
It reads only JSON (standard library; no torch), so it runs anywhere the archive is unpacked:

    python scripts/gpu_report.py gpu_check/
    python scripts/gpu_report.py gpu_check/ --bundle docs/bench/gpu_check_h200.json   # every JSON in one file
"""

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

# The acceptance shape and bars: (mode, tokens, the speed-up over SDPA a linear type must reach)
SHAPE = {"batch": 40, "width": 512, "heads": 8, "dtype": "bf16"}
BARS = (("forward", 512, 1.0), ("forward", 2048, 2.0), ("train", 2048, 1.5))
GRIDS = {"attention_grid_bf16_graphs": "the attention alone", "module_grid_bf16_graphs": "whole modules"}
LINEAR = ("zformer", "fastformer")
BASELINE = "full"
DECODING_FROM = 4096  # from this context on, each linear decoder must beat the full decoder's KV cache
FLAT = 1.25  # ms/token called flat: the slowest context within 25% of the fastest
REPORT = "acceptance"
AB = "ab_fastformer"
# the A/B's variants of the fused product: what to set where one is faster wherever it was timed
FUSED_PRODUCT = {"fused_product": 'add "cuda" to the policy\'s fused_product',
                 "fused_product_n64": 'add "cuda" to the policy\'s fused_product, with the variant\'s tiles as '
                                      "its product_tiles (docs/bench/ab/fastformer_gpu.py)"}
WRITTEN_BY = "scripts/gpu_check.sh"  # the mark of a bundle: one that may be written over


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # a step still writing, or stopped before it wrote; not JSON
        return None


def _grid_rows(folder: Path, name: str) -> tuple[list[dict], dict]:
    data = _load(folder / f"{name}.json")
    if not isinstance(data, dict):
        return [], {}
    return [r for r in data.get("results", []) if r.get("status") == "ok"], data.get("metadata", {})


def _shape(rows: list[dict]) -> dict:
    """The acceptance shape where the grid has it, else the grid's most common shape (a dry run)."""
    shapes = Counter(tuple((key, row[key]) for key in SHAPE) for row in rows)
    if not shapes or tuple(SHAPE.items()) in shapes:
        return dict(SHAPE)
    return dict(shapes.most_common(1)[0][0])


def _row(rows: list[dict], shape: dict, attention_type: str, mode: str, length: int) -> dict | None:
    return next((r for r in rows if r["attention_type"] == attention_type and r["mode"] == mode
                 and r["length"] == length and all(r[key] == value for key, value in shape.items())), None)


def bars(rows: list[dict]) -> list[dict]:
    """Per linear type of the grid and bar: its speed-up over SDPA at the acceptance shape (the
    grid's own `speedup_vs_full`; None where not measured) and whether it meets the bar."""
    types = sorted({r["attention_type"] for r in rows if r["attention_type"].split("_")[0] in LINEAR},
                   key=lambda name: (LINEAR.index(name.split("_")[0]), name))
    found = []
    for attention_type in types:
        for mode, length, bar in BARS:
            row = _row(rows, SHAPE, attention_type, mode, length)
            speedup = None if row is None else row.get("speedup_vs_full")
            found.append({"type": attention_type, "mode": mode, "length": length, "bar": bar, "speedup": speedup,
                          "meets": None if speedup is None else speedup >= bar})
    return found


def folded(rows: list[dict]) -> list[dict]:
    """Each folded form against its plain form, at the grid's shape, wherever the folded form is
    taken (its executed FLOPs differ from the plain form's): plain time / folded time."""
    shape = _shape(rows)
    found = []
    for base in LINEAR:
        for mode, length in sorted({(r["mode"], r["length"]) for r in rows}):
            plain, form = (_row(rows, shape, name, mode, length) for name in (base, f"{base}_folded"))
            if plain and form and plain.get("executed_flops") != form.get("executed_flops"):
                found.append({"type": base, "mode": mode, "length": length, "faster": plain["time_ms"] / form["time_ms"]})
    return found


def verdict(ratios: list[float], remedy: str, keep: str, where: str = "wherever it is taken") -> str:
    """What to do with a form that ran at old time / new time = `ratios`: `remedy` where it is faster
    in every one, else `keep`."""
    if not ratios:
        return "not measured"
    faster = [ratio > 1 for ratio in ratios]
    if all(faster):
        return f"faster {where}: {remedy}"
    return f"slower {where}: {keep}" if not any(faster) else f"mixed: {keep}"


def folded_verdict(comparisons: list[dict]) -> str:
    return verdict([c["faster"] for c in comparisons], 'add "cuda" to the policy\'s folded_autocast',
                   "keep the plain form")


def variants(folder: Path) -> tuple[list[dict], dict]:
    """(per length and mode, each variant's speed against the A/B's baseline (baseline time /
    variant time), the A/B's settings) from `ab_fastformer.json`."""
    data = _load(folder / f"{AB}.json")
    if not isinstance(data, dict):
        return [], {}
    baseline = data.get("baseline", "shipped")
    found = []
    for row in data.get("rows", []):
        times = row.get("ms") or {}
        if times.get(baseline):
            found.append({"length": row["length"], "mode": row["mode"],
                          "faster": {name: times[baseline] / ms for name, ms in times.items() if ms}})
    return found, {**(data.get("settings") or {}), "baseline": baseline}


def decoding(folder: Path) -> list[dict]:
    """ms/token per decoder by context: the tokens generated so far, after the prefix a prefill
    run read first (`decoding*.json` of `scripts/benchmark_generation.py`)."""
    points = []
    for path in sorted(folder.glob("decoding*.json")):
        data = _load(path)
        if not isinstance(data, dict):
            continue
        prefill = (data.get("settings") or {}).get("prefill") or 0
        for row in data.get("rows", []):
            times = {name: ms for name, ms in row.items() if name != "length" and ms is not None}
            points.append({"context": prefill + row["length"], **times})
    return sorted(points, key=lambda point: point["context"])


def decoding_verdicts(points: list[dict]) -> dict[str, dict]:
    """Per linear decoder: the spread of its ms/token over the contexts (slowest / fastest), whether
    that is flat, and whether it beats the full decoder at every context from `DECODING_FROM`."""
    verdicts = {}
    names = {key for point in points for key in point} - {"context", BASELINE}
    for name in sorted(names, key=lambda name: (LINEAR.index(name) if name in LINEAR else len(LINEAR), name)):
        times = [point[name] for point in points if name in point]
        late = [point[name] < point[BASELINE] for point in points
                if point["context"] >= DECODING_FROM and name in point and BASELINE in point]
        spread = max(times) / min(times)
        verdicts[name] = {"spread": spread, "flat": spread <= FLAT, "beats_full_from": all(late) if late else None}
    return verdicts


def training(folder: Path) -> list[dict]:
    """The training scripts' tokens/s per task and attention, against full attention's."""
    records = _load(folder / "training_records.json")
    if not isinstance(records, list):
        return []
    rates = {}
    for record in records:
        attention = record.get("attention")
        attention = "+".join(attention) if isinstance(attention, list) else str(attention)
        if record.get("tokens_per_s"):
            rates[(record.get("task"), attention)] = record["tokens_per_s"]
    found = []
    for (task, attention), rate in sorted(rates.items(), key=lambda item: (str(item[0][0]), item[0][1])):
        base = rates.get((task, BASELINE))
        found.append({"task": task, "attention": attention, "tokens_per_s": rate,
                      "vs_full": None if base is None else rate / base})
    return found


def _times(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.2f}x"


def _bars_table(found: list[dict]) -> list[str]:
    heads = [f"{mode} {length:,} (bar {bar:.1f}x)" for mode, length, bar in BARS]
    lines = ["| type | " + " | ".join(heads) + " | every bar |", "|" + " --- |" * (len(heads) + 2)]
    for attention_type in dict.fromkeys(entry["type"] for entry in found):
        cells = [entry for entry in found if entry["type"] == attention_type]
        text = [_times(c["speedup"]) + ("" if c["meets"] is None else " meets" if c["meets"] else " misses")
                for c in cells]
        meets = [c["meets"] for c in cells]
        verdict = "not measured" if None in meets else "yes" if all(meets) else "no"
        lines.append(f"| {attention_type} | " + " | ".join(text) + f" | {verdict} |")
    return lines


def _folded_section(grids: dict[str, list[dict]]) -> tuple[list[str], dict]:
    compared = {name: folded(rows) for name, rows in grids.items()}
    shapes = {name: _shape(rows) for name, rows in grids.items() if rows}
    lines = ["## Folded forms against the plain ones, where taken", "",
             "Plain time over folded time (above 1: the folded form is faster); "
             + "; ".join(f"`{name}` at batch {s['batch']}, width {s['width']}" for name, s in shapes.items()) + ".", "",
             "| type | mode | tokens | " + " | ".join(GRIDS[name] for name in grids) + " |",
             "|" + " --- |" * (3 + len(grids))]
    keys = sorted({(c["type"], c["mode"], c["length"]) for found in compared.values() for c in found})
    for attention_type, mode, length in keys:
        cells = [next((f"{c['faster']:.2f}" for c in compared[name] if (c["type"], c["mode"], c["length"])
                       == (attention_type, mode, length)), "-") for name in grids]
        lines.append(f"| {attention_type} | {mode} | {length:,} | " + " | ".join(cells) + " |")
    verdicts = {base: folded_verdict([c for found in compared.values() for c in found if c["type"] == base])
                for base in LINEAR}
    lines += [""] + [f"- {base}_folded: {verdict}" for base, verdict in verdicts.items()]
    return lines, {"comparisons": compared, "verdicts": verdicts}


def _decoding_section(points: list[dict]) -> tuple[list[str], dict]:
    verdicts = decoding_verdicts(points)
    names = [BASELINE, *verdicts]
    lines = ["## Decoding, ms/token by context (speed-up over the full decoder)", "",
             "| context | " + " | ".join(names) + " |", "|" + " --- |" * (1 + len(names))]
    for point in points:
        cells = []
        for name in names:
            ms = point.get(name)
            ratio = "" if name == BASELINE or ms is None or BASELINE not in point else f" ({point[BASELINE] / ms:.1f}x)"
            cells.append("-" if ms is None else f"{ms:.3f}{ratio}")
        lines.append(f"| {point['context']:,} | " + " | ".join(cells) + " |")
    lines.append("")
    for name, verdict in verdicts.items():
        beats = {None: "not measured", True: "yes", False: "no"}[verdict["beats_full_from"]]
        lines.append(f"- {name}: spread {verdict['spread']:.2f} ({'flat' if verdict['flat'] else 'not flat'}: "
                     f"within {FLAT:.2f}); below the full decoder from {DECODING_FROM:,} tokens: {beats}")
    return lines, verdicts


def _training_section(found: list[dict]) -> list[str]:
    lines = ["## Training scripts, tokens/s", "", "| task | attention | tokens/s | against full |", "| --- | --- | --- | --- |"]
    lines += [f"| {e['task']} | {e['attention']} | {e['tokens_per_s']:,.0f} | {_times(e['vs_full'])} |" for e in found]
    return lines


def _variants_section(found: list[dict], settings: dict) -> tuple[list[str], dict]:
    names = list(dict.fromkeys(name for row in found for name in row["faster"]))
    lines = ["## Fastformer's variants against the shipped form (A/B, whole modules)", "",
             f"{settings['baseline'].capitalize()} time over each variant's (above 1: the variant is faster); batch "
             f"{settings.get('batch')}, width {settings.get('width')}, "
             f"{'CUDA-graph replays' if settings.get('graphs') else 'eager calls on a CPU'} (`{AB}.json`).", "",
             "| tokens | mode | " + " | ".join(names) + " |", "|" + " --- |" * (2 + len(names))]
    for row in found:
        cells = [f"{row['faster'][name]:.2f}" if name in row["faster"] else "-" for name in names]
        lines.append(f"| {row['length']:,} | {row['mode']} | " + " | ".join(cells) + " |")
    verdicts = {name: verdict([row["faster"][name] for row in found if name in row["faster"]], remedy,
                              "keep cuBLAS's product over the map", where="wherever it was timed")
                if settings.get("graphs") else "not timed on a GPU (the kernel runs on CUDA only)"
                for name, remedy in FUSED_PRODUCT.items()}
    lines += [""] + [f"- {name}: {text}" for name, text in verdicts.items()]
    return lines, {"rows": found, "verdicts": verdicts}


def report(folder: Path) -> tuple[str, dict]:
    """(acceptance.md's text, acceptance.json's content) of a check's folder."""
    grids, metadata = {}, {}
    for name in GRIDS:
        grids[name], grid_metadata = _grid_rows(folder, name)
        metadata = metadata or grid_metadata
    commit, device = str(metadata.get("commit") or "unknown")[:7], metadata.get("gpu") or metadata.get("device") or "unknown"
    lines = ["# GPU check: acceptance", "",
             f"Commit `{commit}`, {device}, {metadata.get('date', 'date unknown')} (`python scripts/gpu_report.py`).", "",
             "## Speed against SDPA: bf16, batch 40, width 512, 8 heads, CUDA-graph replays"]
    summary = {"commit": metadata.get("commit"), "device": device, "bars": {}}
    for name, rows in grids.items():
        found = bars(rows)
        summary["bars"][name] = found
        lines += ["", f"### {GRIDS[name].capitalize()} (`{name}`)", ""]
        lines += _bars_table(found) if found else ["Not run."]
    section, summary["folded"] = _folded_section(grids)
    lines += [""] + section
    points = decoding(folder)
    if points:
        section, summary["decoding"] = _decoding_section(points)
        lines += [""] + section
    summary["training"] = training(folder)
    if summary["training"]:
        lines += [""] + _training_section(summary["training"])
    found, settings = variants(folder)
    if found:
        section, summary["variants"] = _variants_section(found, settings)
        lines += [""] + section
    return "\n".join(lines) + "\n", summary


def bundle(folder: Path, summary: dict) -> dict:
    """Every JSON of the check's folder in one object, keyed by file name, with the commit and device."""
    runs = {path.stem: _load(path) for path in sorted(folder.glob("*.json")) if path.stem != REPORT}
    return {"written_by": WRITTEN_BY, "commit": summary["commit"], "device": summary["device"], "runs": runs}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="the GPU check's output folder")
    parser.add_argument("--bundle", type=Path, help="also write every JSON of the folder into this one file")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.folder.is_dir():
        print(f"gpu_report.py: error: folder: {args.folder} is not a folder (the GPU check's output)", file=sys.stderr)
        return 2
    earlier = _load(args.bundle) if args.bundle and args.bundle.exists() else {"written_by": WRITTEN_BY}
    if not isinstance(earlier, dict) or earlier.get("written_by") != WRITTEN_BY:
        print(f"gpu_report.py: error: --bundle: {args.bundle} exists and is not a GPU check's bundle; "
              "it is left as it is (name a new file)", file=sys.stderr)
        return 2
    text, summary = report(args.folder)
    (args.folder / f"{REPORT}.md").write_text(text)
    (args.folder / f"{REPORT}.json").write_text(json.dumps(summary, indent=1) + "\n")
    if args.bundle:
        args.bundle.parent.mkdir(parents=True, exist_ok=True)
        args.bundle.write_text(json.dumps(bundle(args.folder, summary), indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
