#!/usr/bin/env python
"""Milliseconds per generated token of assisted (speculative) decoding against plain greedy decoding,
batch 1, for a `ZformerLlamaForCausalLM` with a fixed-size state: the same tokens, timed side by side.

The models are random (nothing is downloaded), so a draft agrees with the target only by
construction. `--draft shallow`: the target's first `--draft_layers` layers with its embeddings,
final norm and head, and the target's deeper layers scaled down (`--depth_scale`, the output
projections of their attention and MLP) so that they change the next token rarely: the draft is
right as often as a good small model would be, and the timing shows what a crop costs when most
drafts are kept. `--draft independent`: a random one-layer model of the same vocabulary, almost
always wrong: the timing shows what assisted decoding costs when every draft is rejected.
Prints one line per setting: ms/token of each, the speed-up, the tokens drafted (transformers' draft
stops early when it is unsure, `assistant_confidence_threshold`) and the share kept, and the target's
forwards (verifications, and the re-reads of kept tokens after a rejection).

    OMP_NUM_THREADS=1 python scripts/benchmark_assisted.py --draft shallow independent --new_tokens 64
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from hf_zformer import ZformerCache, ZformerLlamaConfig, ZformerLlamaForCausalLM  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--draft", nargs="+", choices=["shallow", "independent"], default=["shallow", "independent"])
    parser.add_argument("--attention_type", default="zformer", help="the target's attention type (every layer)")
    parser.add_argument("--hidden_size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab_size", type=int, default=4096)
    parser.add_argument("--draft_layers", type=int, default=1)
    parser.add_argument("--depth_scale", type=float, default=0.02,
                        help="factor on the deeper layers' output projections (--draft shallow)")
    parser.add_argument("--draft_tokens", type=int, default=4, help="num_assistant_tokens")
    parser.add_argument("--assistant_confidence_threshold", type=float, default=None,
                        help="the draft stops when its next token's probability is below this (default: "
                             "transformers', 0.4; 0 drafts --draft_tokens every time)")
    parser.add_argument("--prompt_length", type=int, default=32)
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each; the median is reported")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def config(args, layers, hidden_size=None, heads=None):
    hidden_size = hidden_size or args.hidden_size
    heads = heads or args.heads
    return ZformerLlamaConfig(vocab_size=args.vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 8 // 3,
                              num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                              attention_type=args.attention_type, max_position_embeddings=4096, pad_token_id=0,
                              bos_token_id=1, eos_token_id=2)


def models(args, draft: str):
    torch.manual_seed(args.seed)
    target = ZformerLlamaForCausalLM(config(args, args.layers)).eval()
    with torch.no_grad():
        for parameter in target.parameters():  # wider than the init: the next token depends on the context
            if parameter.dim() == 2:
                parameter.normal_(std=0.1)
    if draft == "independent":
        torch.manual_seed(args.seed + 1)
        return target, ZformerLlamaForCausalLM(config(args, 1, hidden_size=128, heads=2)).eval()
    small = ZformerLlamaForCausalLM(config(args, args.draft_layers)).eval()
    state = {name: tensor for name, tensor in target.state_dict().items()
             if not name.startswith("model.layers.") or int(name.split(".")[2]) < args.draft_layers}
    small.load_state_dict(state)
    with torch.no_grad():
        for layer in target.model.layers[args.draft_layers:]:
            layer.self_attn.o_proj.weight.mul_(args.depth_scale)
            layer.mlp.down_proj.weight.mul_(args.depth_scale)
    return target, small


class Counts:
    """The target's decoder forwards, the tokens they read and the tokens crops dropped, inside `with`
    blocks (one per assisted generate())."""

    def __init__(self, target):
        self.forwards = self.dropped = self.crops = self.tokens = 0
        self.active, self.cache = False, None
        target.model.register_forward_pre_hook(self._forward, with_kwargs=True)
        self._crop = ZformerCache.crop

    def _forward(self, module, args, kwargs):
        if self.active:
            self.forwards += 1
            self.tokens += (args[0] if args else kwargs["input_ids"]).shape[1]
            self.cache = kwargs.get("past_key_values", kwargs.get("cache"))  # the target's, not the draft's

    def __enter__(self):
        counts, crop = self, self._crop

        def counted(cache, tokens_to_remove):
            if cache.record_past and tokens_to_remove and cache is counts.cache:
                counts.crops += 1
                counts.dropped -= tokens_to_remove
            return crop(cache, tokens_to_remove)

        self.active = True
        ZformerCache.crop = counted
        return self

    def __exit__(self, *exc):
        self.active = False
        ZformerCache.crop = self._crop


def timed(functions, repeats):
    """The median seconds of each of `functions` over `repeats` rounds, run in turn within each round
    (so load on the machine hits them alike), and each one's last result."""
    times, results = [[] for _ in functions], [None] * len(functions)
    for _ in range(repeats):
        for index, function in enumerate(functions):
            start = time.perf_counter()
            results[index] = function()
            times[index].append(time.perf_counter() - start)
    return [statistics.median(each) for each in times], results


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(5, args.vocab_size, (1, args.prompt_length), generator=generator)
    asked = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    print(f"target: {args.layers} x {args.attention_type}, hidden {args.hidden_size}, vocab {args.vocab_size}; "
          f"prompt {args.prompt_length}, {args.new_tokens} new tokens, {args.draft_tokens} drafted per step, "
          f"{args.threads} thread(s)")
    for draft in args.draft:
        target, assistant = models(args, draft)
        counts = Counts(target)
        assist = dict(assistant_model=assistant)  # transformers reads the draft settings from the draft's config
        assistant.generation_config.num_assistant_tokens = args.draft_tokens
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        if args.assistant_confidence_threshold is not None:
            assistant.generation_config.assistant_confidence_threshold = args.assistant_confidence_threshold
        with torch.inference_mode():
            target.generate(ids, **asked)  # warm-up of both (the first assisted call imports more modules)
            target.generate(ids, **asked, **assist)
            def assisted_run():
                with counts:
                    return target.generate(ids, **asked, **assist)

            (greedy_time, assisted_time), (greedy, assisted) = timed(
                [lambda: target.generate(ids, **asked), assisted_run], args.repeats)
        if not torch.equal(greedy, assisted):
            raise SystemExit(f"--draft {draft}: assisted decoding gave other tokens than greedy decoding")
        runs = args.repeats
        verifications = counts.forwards / runs
        greedy_ms, assisted_ms = 1e3 * greedy_time / args.new_tokens, 1e3 * assisted_time / args.new_tokens
        # a verification reads the token before the drafts and the drafts (the first one, the prompt too)
        drafted = (counts.tokens - counts.forwards) / runs - (args.prompt_length - 1)
        kept = 1 - counts.dropped / runs / drafted if drafted else 0.0
        print(f"--draft {draft}: greedy {greedy_ms:.2f} ms/token, assisted {assisted_ms:.2f} ms/token "
              f"({greedy_ms / assisted_ms:.2f}x); {drafted:.0f} tokens drafted per run, {kept:.0%} kept; target forwards: "
              f"{verifications:.0f} verifications + {counts.crops / runs:.0f} re-reads (greedy: {args.new_tokens})")


if __name__ == "__main__":
    main()
