"""The tests' script runner (tests/warm_scripts.py): a run forked from the warm interpreter behaves
as `subprocess.run` of a fresh one would, in what the tests read: exit status, streams, working
directory, environment, timeouts; a run that changes what libraries read at import goes fresh."""

import os
import subprocess
import sys
import textwrap

import pytest
import warm_scripts
from conftest import SHARES_THE_CORES, worker_threads

PROBE = textwrap.dedent("""
    import os, sys
    print("cwd", os.getcwd())
    print("argv", sys.argv[1:])
    print("warm", "transformers" in sys.modules)
    print("parent", os.getppid())
    print("precision", os.environ.get("ACCELERATE_MIXED_PRECISION"))
    print("to stderr", file=sys.stderr)
    if sys.argv[1] == "raise":
        raise ValueError("bad value 7")
    if sys.argv[1] == "message":
        sys.exit("stopped: bad value 8")
    if sys.argv[1] == "sleep":
        import time
        time.sleep(60)
    sys.exit(int(sys.argv[1]))
""")


@pytest.fixture()
def probe(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    return script


def run(script, *argv, env=None, timeout=120):
    base = dict(os.environ)
    return warm_scripts.run(script, argv, script.parent, {**base, **(env or {})}, base, timeout)


def test_a_forked_run_has_its_own_status_streams_directory_and_runtime_environment(probe):
    result = run(probe, "3", env={"ACCELERATE_MIXED_PRECISION": "bf16"})
    assert result.returncode == 3
    out = result.stdout.decode()
    assert f"cwd {probe.parent}" in out and "argv ['3']" in out
    assert "warm True" in out and "precision bf16" in out  # forked: the imports were already there
    assert result.stderr.decode() == "to stderr\n"
    assert run(probe, "0").returncode == 0
    assert "precision None" in run(probe, "0").stdout.decode()  # nothing carried over from the run before


def test_the_runs_of_every_test_share_one_warm_interpreter(probe, monkeypatch):
    """pytest names the running test in the environment: that alone must not start another server
    (each holds its imports), and no more than MAX_SERVERS are kept."""
    def parent(result):
        return next(line for line in result.stdout.decode().splitlines() if line.startswith("parent"))

    first = run(probe, "0")
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/other.py::test_other (call)")
    second = run(probe, "0")
    assert "warm True" in second.stdout.decode() and parent(second) == parent(first)
    assert len(warm_scripts._servers) <= warm_scripts.MAX_SERVERS


def test_failures_exit_as_the_interpreter_would(probe):
    raised = run(probe, "raise")
    assert raised.returncode == 1
    assert "Traceback (most recent call last)" in raised.stderr.decode() and "ValueError: bad value 7" in raised.stderr.decode()
    stopped = run(probe, "message")
    assert stopped.returncode == 1 and "stopped: bad value 8" in stopped.stderr.decode()
    fresh = subprocess.run([sys.executable, str(probe), "message"], capture_output=True)
    assert fresh.returncode == stopped.returncode and fresh.stderr.endswith(stopped.stderr)


def test_an_environment_read_at_import_gets_a_fresh_interpreter(probe):
    result = run(probe, "0", env={"HF_HUB_OFFLINE": "0" if os.environ.get("HF_HUB_OFFLINE") == "1" else "1"})
    assert result.returncode == 0 and "warm False" in result.stdout.decode()


def test_a_run_past_its_timeout_is_killed_and_the_next_one_runs(probe):
    with pytest.raises(subprocess.TimeoutExpired):
        run(probe, "sleep", timeout=2)
    assert run(probe, "5").returncode == 5


@pytest.mark.skipif(not SHARES_THE_CORES, reason="runs in parallel workers (pytest -n) without OMP_NUM_THREADS set")
def test_parallel_workers_and_their_scripts_keep_to_their_share_of_the_cores(tmp_path):
    """Under `pytest -n W` each worker runs torch on its share of the cores (conftest.py), and the
    scripts it starts inherit that share: W workers never run more threads than there are cores."""
    import torch

    share = worker_threads(int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    assert torch.get_num_threads() == share
    script = tmp_path / "threads.py"
    script.write_text("import torch\nprint(torch.get_num_threads())\n")
    assert run(script).stdout.decode().strip() == str(share)


def test_an_isolated_run_is_warm_without_the_library_and_takes_its_modules_cache(tmp_path):
    """`conftest.run_isolated` forks from a warm interpreter that never imported hf_zformer: the child
    cannot import it, has transformers already, and copies a checkpoint's code under its own
    HF_MODULES_CACHE, as a fresh interpreter with that environment would."""
    from conftest import run_isolated

    result = run_isolated("""
        import sys
        print("warm", "transformers" in sys.modules)
        try:
            import hf_zformer
        except ImportError:
            print("no library")
        import transformers.dynamic_module_utils as dynamic
        print("modules", dynamic.HF_MODULES_CACHE)
    """, cwd=tmp_path)
    assert "warm True" in result.stdout and "no library" in result.stdout
    assert f"modules {tmp_path / 'hf_modules'}" in result.stdout
    with pytest.raises(AssertionError, match="isolated run failed"):
        run_isolated("import hf_zformer", cwd=tmp_path)
