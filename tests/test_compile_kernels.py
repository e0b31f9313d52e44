"""`scripts/compile_kernels.py`: every Triton kernel compiled for a CUDA GPU on this CPU (triton's
bundled ptxas; no GPU, no driver), each one's registers, spills and shared memory read from the
compiled code, and the dispatch's shared-memory bounds checked against them.

Default run: one architecture at a toy width (every kernel family, forward and backward), and a
bound made too small on purpose, which must fail. `-m slow`: the script's default (sm_80 and sm_90,
bf16 and fp32, head widths 32 to 256), which must pass: no compile error, no kernel over the GPU's
shared memory or its family's bound.
"""

import json
import os

import pytest
import warm_scripts
from conftest import REPO_ROOT

pytest.importorskip("triton")

SCRIPT = REPO_ROOT / "scripts" / "compile_kernels.py"
EVERY_KERNEL = {"_fused_forward", "_fused_backward", "_outer_sum", "_sum_parts", "_state_product", "_pool",
                "merge_pools", "_pool_backward", "_shared_pool", "_shared_pool_backward", "_shared_pool_backward_paired",
                "_prefix_pool", "_prefix_pool_backward", "_gate_grads", "_column_scale", "_column_scale_backward",
                "_scaled_product"}


# compiling needs triton's real `jit`, not the interpreter the kernel tests switch on: the runs fork
# from a warm interpreter of this environment without TRITON_INTERPRET (tests/warm_scripts.py)
COMPILING_ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def _run(script, argv, timeout=1800, prelude=None):
    """`script` with `argv` in a process of COMPILING_ENV, `prelude` run first; text streams."""
    return warm_scripts.as_text(warm_scripts.run(script, argv, REPO_ROOT, COMPILING_ENV, COMPILING_ENV, timeout, prelude))


def _compile(tmp_path, *args, prelude=None):
    """Runs the script in a process of its own, with `prelude` run first."""
    out = tmp_path / "kernels.json"
    result = _run(SCRIPT, [*args, "--json", out], prelude=prelude)
    return result, (json.loads(out.read_text()) if result.returncode in (0, 1) else None)


def test_every_kernel_compiles_for_an_h100_with_its_resources_read(tmp_path):
    result, report = _compile(tmp_path, "--arch", "90", "--widths", "16", "--dtypes", "bf16", "--jobs", "1")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    kernels = report["kernels"]
    assert {k["kernel"] for k in kernels} == EVERY_KERNEL
    for kernel in kernels:
        assert kernel["arch"] == 90 and not kernel["error"]
        assert 0 < kernel["registers"] <= 255 and kernel["spilled_bytes"] >= 0
        assert kernel["shared_bytes"] <= kernel["shared_limit"] == 232_448
        assert kernel["bound"] is None or kernel["shared_bytes"] <= kernel["bound"]
        assert kernel["programs_per_sm"] >= 1
    # fused and split plans, with and without a mask and a scale: one report per compiled variant
    assert {k["constants"].split("HAS_MASK=")[1][:4] for k in kernels if k["kernel"] == "_fused_forward"} == {
        "True", "Fals"}
    assert "| sm_90 | _shared_pool_backward | bfloat16 |" in result.stdout
    assert report["command"].startswith("python scripts/compile_kernels.py --arch 90") and report["commit"]


def test_a_bound_below_what_the_kernel_asks_fails_the_check(tmp_path):
    """The bounds the dispatch trusts are checked, not assumed: a prefix-pool bound of 1 KiB is
    exceeded by the compiled kernel, and the script says so and exits 1. Two head widths compile in
    two processes, each seeing the bound as the caller set it, their reports merged."""
    prelude = ("from hf_zformer.modeling import triton_prefix_pool\n"
               "triton_prefix_pool.PREFIX_POOL_SHARED = ((64, 1024), (128, 1024), (256, 1024))")
    result, report = _compile(tmp_path, "--arch", "90", "--widths", "16", "32", "--dtypes", "bf16", "--jobs", "2",
                              prelude=prelude)
    assert result.returncode == 1
    over = [k for k in report["kernels"] if k["shared_bytes"] > (k["bound"] or float("inf"))]
    assert over and {k["kernel"] for k in over} <= {"_prefix_pool", "_prefix_pool_backward"}
    assert {k["constants"].split("D=")[1].split(",")[0] for k in over} == {"16", "32"}  # both processes' parts
    assert "OVER" in result.stdout
    # the same report as one process compiling both widths: each distinct kernel once
    (tmp_path / "alone").mkdir()
    _, alone = _compile(tmp_path / "alone", "--arch", "90", "--widths", "16", "32", "--dtypes", "bf16", "--jobs", "1",
                        prelude=prelude)
    assert sorted(map(_fields, report["kernels"])) == sorted(map(_fields, alone["kernels"]))
    assert report["torch_forms"] == alone["torch_forms"]


def test_compile_processes_that_die_leave_the_work_to_the_script(tmp_path):
    """Workers that end without a word (as a fork that cannot run would): the script says so and
    compiles every part itself, with the full report."""
    out = tmp_path / "kernels.json"
    dying = tmp_path / "dying_workers.py"
    dying.write_text(f"import importlib.util, os, sys\n"
                     f"spec = importlib.util.spec_from_file_location('compile_kernels', {str(SCRIPT)!r})\n"
                     f"module = importlib.util.module_from_spec(spec)\n"
                     f"spec.loader.exec_module(module)\n"
                     f"module._compile_share = lambda *args: os._exit(3)\n"
                     f"sys.exit(module.main(['--arch', '90', '--widths', '16', '32', '--dtypes', 'bf16', '--jobs', '2', "
                     f"'--json', {str(out)!r}]))\n")
    result = _run(dying, [], timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "exit codes [3]" in result.stderr and "compiling in this process instead" in result.stderr
    kernels = json.loads(out.read_text())["kernels"]
    assert {k["constants"].split("D=")[1].split(",")[0] for k in kernels if k["kernel"] == "_pool"} == {"16", "32"}


def _fields(kernel: dict) -> str:
    return json.dumps({name: value for name, value in kernel.items() if name != "seconds"}, sort_keys=True)


def test_a_users_file_is_never_overwritten(tmp_path):
    mine = tmp_path / "kernels.json"
    mine.write_text("mine")
    result, _ = _compile(tmp_path, "--arch", "90", "--widths", "16")
    assert result.returncode == 2 and "--json" in result.stderr and mine.read_text() == "mine"


def test_bad_arguments_are_named(tmp_path):
    result, _ = _compile(tmp_path, "--arch", "75")
    assert result.returncode == 2 and "--arch" in result.stderr and "75" in result.stderr
    result, _ = _compile(tmp_path, "--widths", "0")
    assert result.returncode == 2 and "--widths: 0" in result.stderr
    result, _ = _compile(tmp_path, "--jobs", "0")
    assert result.returncode == 2 and "--jobs: 0" in result.stderr


@pytest.mark.slow
def test_every_kernel_the_dispatch_admits_fits_a100_and_h100(tmp_path):
    """The script's default matrix: what the dispatch runs on sm_80 and sm_90 compiles within the
    GPU's shared memory and its family's bound; what it leaves to the torch forms is listed."""
    result, report = _compile(tmp_path)
    assert result.returncode == 0, result.stdout[-4000:]
    assert {k["arch"] for k in report["kernels"]} == {80, 90}
    assert "linear attention 256 x 129" in report["torch_forms"]["sm_90"]  # a Hedgehog map at d = 128
