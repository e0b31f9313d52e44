import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest


def worker_threads(workers: int) -> int:
    """One parallel worker's share of the cores this process may use (Linux: its affinity)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // workers)


# Parallel workers (pytest-xdist's `-n`) share the machine's cores: each gets its share of threads,
# set before torch is imported, and the scripts the tests start inherit it.
SHARES_THE_CORES = bool(os.environ.get("PYTEST_XDIST_WORKER_COUNT")) and "OMP_NUM_THREADS" not in os.environ
if SHARES_THE_CORES:  # (a thread count set from outside is kept)
    os.environ["OMP_NUM_THREADS"] = str(worker_threads(int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

import torch  # noqa: E402

# Without a GPU the Triton kernels run through triton's interpreter (tests/test_kernels.py): it is
# chosen when triton is first imported, so before hf_zformer.
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import hf_zformer  # noqa: E402,F401  (registers the Auto classes)

# A run stopped from outside (SIGTERM: `timeout`, a CI runner, the GPU check's step limits) ends as
# Ctrl-C does: pytest reports the tests that ran and what failed before it exits.
signal.signal(signal.SIGTERM, signal.default_int_handler)



def pytest_configure(config):
    # The marks transformers' common test modules (tests/test_transformers_common.py) put on their tests
    for mark in ("accelerate_tests", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test",
                 "torch_compile_test", "is_training_test"):
        config.addinivalue_line("markers", f"{mark}: a mark of transformers' common tests")


REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # the benchmark harness (benchmarks/) lives beside the package, in the checkout
    sys.path.append(str(REPO_ROOT))
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
ATTENTION_TYPES = ["full", "zformer", "xformer", "fastformer"]

TINY = dict(
    vocab_size=97,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


class CountedOps(torch.utils._python_dispatch.TorchDispatchMode):
    """While active, counts the aten operations for which `counts(func, output)` is true (e.g. the
    reads of a tensor's value back to the host, or casts of one shape)."""

    def __init__(self, counts):
        super().__init__()
        self.counts, self.count = counts, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        self.count += bool(self.counts(func, output))
        return output


def tiny_config(**overrides):
    from transformers import AutoConfig

    model_type = overrides.pop("model_type", "zformer")
    return AutoConfig.for_model(model_type, **{**TINY, **overrides})


def random_batch(lengths, vocab_size=97, pad_to=None, seed=0):
    """input_ids/attention_mask for sequences of the given lengths, right-padded (pad id 0)."""
    generator = torch.Generator().manual_seed(seed)
    width = pad_to or max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, :length] = torch.randint(5, vocab_size, (length,), generator=generator)
        mask[row, :length] = 1
    return ids, mask


def repad(ids, mask, width):
    """The same batch right-padded to `width`."""
    extra = width - ids.shape[1]
    return (
        torch.nn.functional.pad(ids, (0, extra), value=0),
        torch.nn.functional.pad(mask, (0, extra), value=0),
    )


def run_isolated(code: str, cwd, timeout=600):
    """Run `code` in a process where `hf_zformer` cannot be imported (as on a machine that only has
    transformers), with the Hub switched off and its own HF_MODULES_CACHE (under `cwd`). The process
    is forked from a warm interpreter that imported torch and transformers and never this library
    (tests/script_server.py, `WARM_SERVER_WITHOUT`). Returns the completed process (text streams)."""
    import warm_scripts

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", WARM_SERVER_WITHOUT="hf_zformer")
    env["HF_MODULES_CACHE"] = str(Path(cwd) / "hf_modules")
    result = warm_scripts.run_code("import sys\n" + textwrap.dedent(code), cwd=cwd, env=env, timeout=timeout)
    assert result.returncode == 0, f"isolated run failed:\n{result.stdout}\n{result.stderr}"
    return result


def assert_same_generations_in_clean_process(tmp_path, auto_class: str, models: dict, inputs: dict, **generate_kwargs):
    """Save each of `models` ({name: model}) under `tmp_path`, load it back with
    `transformers.<auto_class>.from_pretrained(name, trust_remote_code=True)` in a clean process
    (`run_isolated`; the class must come from the folder's own code), and check that
    `generate(**inputs, **generate_kwargs)` gives there exactly the tokens it gives here."""
    expected = {}
    for name, model in models.items():
        model.save_pretrained(tmp_path / name)
        expected[name] = model.generate(**inputs, **generate_kwargs)
    torch.save({"inputs": inputs, "kwargs": generate_kwargs}, Path(tmp_path) / "generate_inputs.pt")
    run_isolated(
        f"""
        import torch, transformers
        saved = torch.load("generate_inputs.pt")
        results = {{}}
        for name in {list(models)!r}:
            model = transformers.{auto_class}.from_pretrained(name, trust_remote_code=True).eval()
            assert model.__module__.startswith("transformers_modules"), model.__module__
            results[name] = model.generate(**saved["inputs"], **saved["kwargs"])
        torch.save(results, "generated.pt")
        """,
        cwd=tmp_path,
    )
    remote = torch.load(Path(tmp_path) / "generated.pt")
    for name, tokens in expected.items():
        assert torch.equal(remote[name], tokens), name


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def few_row_form():
    """The opt-in CPU layer forms with the few-row rule on (the policy's `few_rows` = 4) whatever
    this machine's default (on for AMD CPUs only): yields `enable_cpu_speedups`, which a test applies
    to its model so that decoding steps of 1-4 rows run the transposed product on every machine."""
    from hf_zformer import cpu_speedups
    from hf_zformer.modeling.policy import use_policy

    with use_policy(few_rows=4):
        yield cpu_speedups.enable_cpu_speedups
