"""Greedy decoding of pretrained causal LMs in lockstep, one process per model: time per token and
resident memory against the generated length.

Each model (a folder or Hub id that `AutoModelForCausalLM` loads: a transformers Llama with its
`DynamicCache`, a converted `ZformerLlamaForCausalLM` with its fixed-size cache, ...) lives in a
process of its own, so the resident memory a process gains while generating is that model's alone.
The parent steps the processes in turn, one token each, so load on the machine hits every model
alike; each step is timed inside its process, the hand-over is not.

Memory at a length, per model: the bytes held by the tensors of the cache object (`cache_bytes`),
the resident set size (RSS) gained since the prompt and its first token were decoded, and the peak
RSS gained since then (Linux: `VmHWM`, reset through `/proc/self/clear_refs` when generation
starts; elsewhere the largest RSS seen after a step). The baseline is taken after the first token,
when the weights have been read once (a memory-mapped checkpoint counts as it is touched).
"""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import torch

from .causal import cache_bytes


def memory_status() -> dict:
    """Current and peak resident set size of this process in bytes (peak None where unknown)."""
    status = {"rss": None, "peak": None}
    try:
        with open("/proc/self/status") as lines:
            for line in lines:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    status["rss" if line.startswith("VmRSS") else "peak"] = int(line.split()[1]) * 1024
    except OSError:
        import resource

        status["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # best effort
    return status


def reset_peak() -> bool:
    """Reset this process's peak RSS to its current RSS (Linux); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def load_causal_lm(path: str, gguf_file: str | None = None):
    """(model in eval mode, tokenizer) from `path`; `gguf_file` is used where `path` holds that file
    (transformers dequantises it to fp32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    options = {"gguf_file": gguf_file} if gguf_file and (Path(path) / gguf_file).is_file() else {}
    model = AutoModelForCausalLM.from_pretrained(path, **options).eval()
    return model, AutoTokenizer.from_pretrained(path, **options)


class CausalStepper:
    """Greedy decoding of a causal LM by eager forwards with its own cache, as `generate()` runs each
    step (end-of-sequence tokens are decoded past: the length is the benchmark's). The constructor
    reads `input_ids` (1, N) in chunks of `chunk` tokens and picks the first new token."""

    def __init__(self, model, input_ids: torch.Tensor, chunk: int = 1024):
        from hf_zformer.modeling.modeling_zformer import CACHE_FIELD

        self.model, self.field, self.cache = model, CACHE_FIELD, None
        with torch.inference_mode():
            for start in range(0, input_ids.shape[1], chunk):
                output = model(input_ids=input_ids[:, start : start + chunk], use_cache=True, logits_to_keep=1,
                               **({self.field: self.cache} if self.cache is not None else {}))
                self.cache = getattr(output, self.field)
        self.tokens = output.logits[:, -1:].argmax(-1)

    @torch.inference_mode()
    def step(self) -> None:
        output = self.model(input_ids=self.tokens, use_cache=True, **{self.field: self.cache})
        self.cache = getattr(output, self.field)
        self.tokens = output.logits[:, -1:].argmax(-1)


def context_ids(tokenizer, prompt: str, length: int = 0) -> torch.Tensor:
    """(1, N) token ids: the prompt's, repeated to `length` tokens when `length` is longer."""
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    if length > ids.shape[1]:
        ids = ids.repeat(1, -(-length // ids.shape[1]))[:, :length]
    return ids


def greedy_samples(model, tokenizer, prompts: list[str], new_tokens: int) -> list[str]:
    """The greedy continuation of each prompt (`generate()`, `new_tokens` tokens at most), decoded."""
    texts = []
    with torch.inference_mode():
        for prompt in prompts:
            encoded = tokenizer(prompt, return_tensors="pt")
            tokens = model.generate(**encoded, max_new_tokens=new_tokens, do_sample=False)
            texts.append(tokenizer.decode(tokens[0, encoded["input_ids"].shape[1]:], skip_special_tokens=True))
    return texts


def _memory(stepper: CausalStepper, baseline: int, peak_tracked: bool, seen_peak: int) -> dict:
    status = memory_status()
    peak = status["peak"] if peak_tracked and status["peak"] is not None else seen_peak
    return {"cache_bytes": cache_bytes(stepper.cache), "cache_tokens": int(stepper.cache.get_seq_length()),
            "rss_growth": status["rss"] - baseline, "peak_rss_growth": peak - baseline}


def _worker(path: str, gguf_file: str | None, threads: int | None, connection) -> None:
    """One model's process: answers the parent's commands ("samples", "start", "step", "memory", "stop").
    Ctrl-C (which a terminal sends to every process of the run) and a closed pipe (the parent gone)
    end it quietly: the parent reports what was timed."""
    try:
        _serve(path, gguf_file, threads, connection)
    except (KeyboardInterrupt, EOFError, BrokenPipeError):
        pass


def _serve(path: str, gguf_file: str | None, threads: int | None, connection) -> None:
    if threads:
        torch.set_num_threads(threads)
    model, tokenizer = load_causal_lm(path, gguf_file)
    connection.send({"class": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters())})
    stepper = baseline = peak_tracked = None
    seen_peak = 0
    while True:
        command, *arguments = connection.recv()
        if command == "samples":
            connection.send(greedy_samples(model, tokenizer, *arguments))
        elif command == "start":
            input_ids = context_ids(tokenizer, *arguments)
            stepper = CausalStepper(model, input_ids)
            baseline = seen_peak = memory_status()["rss"]
            peak_tracked = reset_peak()
            connection.send(int(input_ids.shape[1]))
        elif command == "step":
            start = time.perf_counter()
            stepper.step()
            connection.send(time.perf_counter() - start)
            if not peak_tracked:
                seen_peak = max(seen_peak, memory_status()["rss"])
        elif command == "memory":
            connection.send(_memory(stepper, baseline, peak_tracked, seen_peak))
        else:
            connection.close()
            return


class LockstepModels:
    """One process per model path, stepped in turn by `step_all()`; use as a context manager."""

    def __init__(self, paths: list[str], gguf_file: str | None = None, threads: int | None = None):
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no memory shared with the parent
        self.connections, self.processes = [], []
        for path in paths:
            parent, child = context.Pipe()
            process = context.Process(target=_worker, args=(str(path), gguf_file, threads, child), daemon=True)
            process.start()
            self.connections.append(parent)
            self.processes.append(process)
        self.descriptions = [self._receive(i) for i in range(len(paths))]

    def _receive(self, index: int):
        connection = self.connections[index]
        while not connection.poll(1.0):
            if not self.processes[index].is_alive():
                raise RuntimeError(f"the process of model {index} ended (exit code {self.processes[index].exitcode})")
        return connection.recv()

    def ask_all(self, *command) -> list:
        """Send `command` to every model in turn, each after the previous one answered."""
        answers = []
        for index, connection in enumerate(self.connections):
            connection.send(command)
            answers.append(self._receive(index))
        return answers

    def step_all(self) -> list[float]:
        return self.ask_all("step")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for connection, process in zip(self.connections, self.processes):
            if process.is_alive():
                try:
                    connection.send(("stop",))
                except OSError:
                    pass
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        return False


__all__ = ["CausalStepper", "LockstepModels", "context_ids", "greedy_samples", "load_causal_lm", "memory_status",
           "reset_peak"]
