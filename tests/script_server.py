"""A warm interpreter that runs the repository's scripts in forked processes, for the tests
(tests/warm_scripts.py starts it and talks to it).

A fresh interpreter spends 5-10 seconds importing torch, transformers, accelerate and datasets
before a script's first line, and the tests run scripts some hundred times. This process imports
them once and then, for each request read from stdin (one JSON object per line: script, argv, cwd,
env, the files for stdout and stderr, optional prelude code), forks: the child takes the request's
working directory, environment and standard streams, runs the script as ``__main__`` and exits
with the script's exit status. It answers on stdout with the child's pid, then with its exit status
(``returncode`` as subprocess reports it: negative for a signal)."""

import atexit
import json
import os
import runpy
import sys
import traceback

# what the scripts import at their top; nothing here runs an operation (no thread pool to fork)
import accelerate  # noqa: F401
import datasets  # noqa: F401
import torch  # noqa: F401
import transformers  # noqa: F401

import hf_zformer  # noqa: F401
import hf_zformer.training  # noqa: F401


def exit_status(code) -> int:
    """What the interpreter exits with for ``SystemExit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def run(request: dict):
    """In the forked child: become the script's process, run it, exit with its status."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(request["script"]))  # as `python script.py` sets it
    status = 0
    try:
        if request.get("prelude"):
            exec(compile(request["prelude"], "<prelude>", "exec"), {"__name__": "__main__"})
        runpy.run_path(request["script"], run_name="__main__")
    except SystemExit as stop:
        status = exit_status(stop.code)
    except BaseException:  # what the interpreter prints for an uncaught exception, and its status
        traceback.print_exc()
        status = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def serve():
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()  # nothing buffered may travel into the child
        pid = os.fork()
        if pid == 0:
            run(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve()
