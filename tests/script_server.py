"""A warm interpreter that runs the repository's scripts in forked processes, for the tests
(tests/warm_scripts.py starts it and talks to it).

A fresh interpreter spends 5-10 seconds importing torch, transformers, accelerate and datasets
before a script's first line, and the tests run scripts some hundred times. This process imports
them once and then, for each request read from stdin (one JSON object per line: script, argv, cwd,
env, the files for stdout and stderr, optional prelude code), forks: the child takes the request's
working directory, environment and standard streams, runs the script as ``__main__`` and exits
with the script's exit status. It answers on stdout with the child's pid, then with its exit status
(``returncode`` as subprocess reports it: negative for a signal).

With ``WARM_SERVER_WITHOUT`` set to a module name in its environment (``hf_zformer``), the server
makes that module unimportable before anything else and imports only torch and transformers: its
children are processes of a machine that has transformers and not this library, where the tests
load a checkpoint's own code (``conftest.run_isolated``)."""

import atexit
import json
import os
import runpy
import sys
import traceback

WITHOUT = os.environ.get("WARM_SERVER_WITHOUT")
if WITHOUT:
    sys.modules[WITHOUT] = None  # importing it now fails, in the server and in every child

# what the scripts import at their top; nothing here runs an operation (no thread pool to fork)
import torch  # noqa: E402,F401
import transformers  # noqa: E402,F401
import transformers.dynamic_module_utils  # noqa: E402,F401
import transformers.utils.hub  # noqa: E402,F401

if WITHOUT:  # what loading and running a checkpoint's own code reaches
    import transformers.generation.utils  # noqa: F401
    import transformers.modeling_utils  # noqa: F401
else:
    import accelerate  # noqa: F401
    import datasets  # noqa: F401

    import hf_zformer  # noqa: F401
    import hf_zformer.training  # noqa: F401


def take_modules_cache(env: dict) -> None:
    """transformers reads HF_MODULES_CACHE (where a checkpoint's own code is copied and imported
    from) when it is imported: a child takes its request's value, as a fresh interpreter would."""
    folder = env.get("HF_MODULES_CACHE", os.path.join(transformers.utils.hub.constants.HF_HOME, "modules"))
    transformers.utils.hub.HF_MODULES_CACHE = transformers.dynamic_module_utils.HF_MODULES_CACHE = folder


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
    take_modules_cache(request["env"])
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
