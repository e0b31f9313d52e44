"""Paired A/B of the opt-in CPU speed-ups (docs/benchmarks.md, "Opt-in CPU speed-ups"): in one
process, the models of an earlier commit's `hf_zformer/modeling` (`before`), of this checkout
(`plain`) and of this checkout with `hf_zformer.enable_cpu_speedups` (`speed-ups`), the same
weights, one call each per round in an order that rotates every round; prints each case's median
times and paired ratios with 95% bootstrap intervals. Cases: `model<n>:<type>` (the one-layer model
of "Long inputs", forward at n tokens), `train:<type>` and `generate:<type>` (the 32 + 32-token
seq2seq model of "Short inputs"). Run from the repository root:

    git archive 175912d hf_zformer/modeling | tar -x -C /tmp/before
    OMP_NUM_THREADS=1 python benchmarks/cpu_speedups_ab.py /tmp/before/hf_zformer/modeling 20 \\
        model2048:zformer model8192:fastformer train:zformer generate:zformer
"""
import copy
import importlib
import importlib.util
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: benchmarks/ beside hf_zformer/

import torch  # noqa: E402

from benchmarks import paired_ratio_interval  # noqa: E402
from benchmarks.cases import make_config  # noqa: E402
from benchmarks.seq2seq import Seq2SeqShape, build_seq2seq  # noqa: E402
from hf_zformer import disable_cpu_speedups, enable_cpu_speedups  # noqa: E402
from hf_zformer.modeling.modeling_zformer import ZformerModel  # noqa: E402


def earlier_modeling(folder: str):
    """The `modeling_zformer` module of a `hf_zformer/modeling` folder, imported as the package
    `before_modeling` (its imports are relative: it needs nothing else of its checkout)."""
    spec = importlib.util.spec_from_file_location("before_modeling", Path(folder) / "__init__.py",
                                                  submodule_search_locations=[folder])
    package = importlib.util.module_from_spec(spec)
    sys.modules["before_modeling"] = package
    spec.loader.exec_module(package)
    return importlib.import_module("before_modeling.modeling_zformer")


def models_and_call(case: str, before):
    """({variant: model}, call(model)) of one case, every model with the same weights."""
    kind, attention = case.split(":")
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    if kind.startswith("model"):
        config = make_config(attention, int(kind[5:]), 512, 8)
        plain, earlier = ZformerModel(config).eval(), before.ZformerModel(config).eval()
        ids = torch.randint(3, 1000, (4, int(kind[5:])), generator=generator)
        call = torch.inference_mode()(lambda model: model(input_ids=ids, attention_mask=torch.ones_like(ids)))
    else:
        plain = disable_cpu_speedups(build_seq2seq(attention, Seq2SeqShape(batch=4))[0])  # the builder enables them
        earlier = before.ZformerForConditionalGeneration(plain.config)
        source, labels = (torch.randint(3, 8000, (4, 32), generator=generator) for _ in range(2))
        call = train_step(source, labels) if kind == "train" else generate(source)
    earlier.load_state_dict(plain.state_dict())
    return {"before": earlier, "plain": plain, "speed-ups": enable_cpu_speedups(copy.deepcopy(plain))}, call


def train_step(source, labels):
    optimizers = {}

    def call(model):
        optimizer = optimizers.setdefault(id(model), torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))
        model.train()(input_ids=source, attention_mask=torch.ones_like(source), labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return call


def generate(source):
    @torch.inference_mode()
    def call(model):
        model.eval().generate(input_ids=source, attention_mask=torch.ones_like(source), max_new_tokens=32,
                              min_new_tokens=32, num_beams=1, do_sample=False)

    return call


def main(folder: str, repeats: int, cases: list[str]) -> None:
    before = earlier_modeling(folder)
    for case in cases:
        models, call = models_and_call(case, before)
        names = list(models)
        times = {name: [] for name in names}
        for round_ in range(1 + repeats):  # the first round warms up
            for name in names[round_ % 3:] + names[: round_ % 3]:
                start = time.perf_counter()
                call(models[name])
                if round_:
                    times[name].append(time.perf_counter() - start)
        medians = ", ".join(f"{name} {statistics.median(t) * 1e3:,.0f} ms" for name, t in times.items())
        ratios = ", ".join("{} / {} {:.3f}x [{:.3f}, {:.3f}]".format(a, b, *paired_ratio_interval(times[a], times[b]))
                           for a, b in (("before", "speed-ups"), ("before", "plain"), ("plain", "speed-ups")))
        print(f"{case}: {medians}; {ratios}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
