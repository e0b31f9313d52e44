"""Before/after of the model-layer change (output projection folded into the attention, in-place
residuals and embeddings): the one-layer model with the FFN shrunk away, as `--level model` builds
it, from an older commit and from this tree, with the same weights, timed interleaved in one
process (old call, new call, old call, ...). Prints markdown rows: n, type, old ms, new ms,
speedup, max relative difference of the outputs.

    mkdir -p /tmp/old && git archive 4f4fe2b hf_zformer/modeling | tar -x -C /tmp/old
    mv /tmp/old/hf_zformer/modeling /tmp/old/old_modeling
    python docs/bench/model_layer_before_after.py /tmp/old

(`hf_zformer/modeling` is self-contained, so the old copy imports as its own package.)
"""

import statistics
import sys
import time

import torch

import hf_zformer.modeling as new_modeling
from hf_zformer.benchmark import make_config


def build(package, attention_type: str, length: int):
    reference = make_config(attention_type, length, 512, 8)
    config_class = package.ZformerConfig
    config = config_class(
        **{k: v for k, v in reference.to_dict().items() if k in config_class.__dataclass_fields__}
    )
    config._attn_implementation = "sdpa"
    return package.ZformerModel(config).eval()


def main(old_root: str):
    sys.path.insert(0, old_root)
    import old_modeling

    print("| n | type | before ms | after ms | speedup | max rel. difference |")
    print("|---:|---|---:|---:|---:|---:|")
    for length in (2048, 8192):
        for attention_type in ("zformer", "fastformer", "full"):
            torch.manual_seed(0)
            new = build(new_modeling, attention_type, length)
            old = build(old_modeling, attention_type, length)
            old.load_state_dict(new.state_dict())
            ids = torch.randint(3, 1000, (4, length))
            mask = torch.ones(4, length, dtype=torch.long)
            models = {"old": old, "new": new}
            times = {"old": [], "new": []}
            repeats = 3 if attention_type == "full" and length == 8192 else 7
            with torch.inference_mode():
                outputs = {k: m(input_ids=ids, attention_mask=mask).last_hidden_state for k, m in models.items()}
                for _ in range(repeats):
                    for name, model in models.items():
                        start = time.perf_counter()
                        model(input_ids=ids, attention_mask=mask)
                        times[name].append(time.perf_counter() - start)
            difference = ((outputs["old"] - outputs["new"]).abs().max() / outputs["old"].abs().max()).item()
            before, after = (statistics.median(times[k]) * 1e3 for k in ("old", "new"))
            print(f"| {length} | {attention_type} | {before:.1f} | {after:.1f} | {before / after:.2f}x | {difference:.1e} |",
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/old")
