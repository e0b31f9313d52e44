"""Scripts run as processes of their own without paying for the imports each time.

`run(script, argv, cwd, env, timeout, prelude)` runs one script in a process forked from a warm
interpreter (tests/script_server.py, started on first use with the tests' base environment) and
returns a `subprocess.CompletedProcess` as `subprocess.run(..., capture_output=True)` would: its
own working directory, environment, exit status, stdout and stderr (bytes), nothing left behind in
the test's process, and a timeout that kills it. What a fork cannot give is a fresh import:
values a library reads from the environment while it is imported (the Hub's offline switch, cache
folders, triton's interpreter) are those of the base environment, so a run whose environment
differs from it other than in `RUNTIME_ENV` goes to a fresh interpreter instead (`fresh_env`).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SERVER = Path(__file__).resolve().with_name("script_server.py")
# variables no library reads when imported (pytest's name of the running test among them), or
# that the server applies to each child (HF_MODULES_CACHE): a run may differ in them from the warm
# interpreter's environment and still be forked from it
RUNTIME_ENV = frozenset({"ACCELERATE_MIXED_PRECISION", "PYTEST_CURRENT_TEST", "HF_MODULES_CACHE"})
MAX_SERVERS = 3  # warm interpreters kept at once (each holds its imports: some hundred MB)


class ScriptServer:
    def __init__(self, base_env: dict):
        self.base_env = dict(base_env)
        self.process = subprocess.Popen([sys.executable, str(SERVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        env=self.base_env, cwd=SERVER.parent)
        self.pending = b""

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self):
        if self.alive():
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def _answer(self, timeout: float) -> dict | None:
        """The server's next line as a dict, or None after `timeout` seconds without one."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.process.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.process.stdout.fileno(), 65536)
            if not chunk:
                raise RuntimeError(f"the script server ended (exit status {self.process.wait()})")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, script, argv, cwd, env: dict, timeout: float, prelude: str | None = None):
        with tempfile.TemporaryDirectory() as folder:
            out, err = Path(folder, "stdout"), Path(folder, "stderr")
            request = {"script": str(script), "argv": [str(script), *map(str, argv)], "cwd": str(cwd), "env": env,
                       "stdout": str(out), "stderr": str(err), "prelude": prelude}
            self.process.stdin.write((json.dumps(request) + "\n").encode())
            self.process.stdin.flush()
            pid = self._answer(120)["pid"]
            done = self._answer(timeout)
            if done is None:  # as subprocess.run does on a timeout: kill it, then say so
                os.kill(pid, signal.SIGKILL)
                self._answer(60)
                raise subprocess.TimeoutExpired(request["argv"], timeout, out.read_bytes(), err.read_bytes())
            return subprocess.CompletedProcess(request["argv"], done["returncode"], out.read_bytes(), err.read_bytes())


_servers: dict[tuple, ScriptServer] = {}  # by the environment that matters at import; the oldest first


def fresh_env(env: dict, base_env: dict) -> bool:
    """Whether a run with `env` needs a fresh interpreter: it differs from `base_env` in a variable
    read at import time."""
    changed = {k for k in env.keys() | base_env.keys() if env.get(k) != base_env.get(k)}
    return not changed <= RUNTIME_ENV


def run(script, argv, cwd, env: dict, base_env: dict, timeout: float, prelude: str | None = None):
    """`script` with `argv` in a process forked from the warm interpreter of `base_env` (or a fresh
    one where `env` asks for it, see `fresh_env`); a `subprocess.CompletedProcess` with bytes."""
    if fresh_env(env, base_env):
        code = [sys.executable, str(script), *map(str, argv)]
        if prelude is not None:
            code = [sys.executable, "-c", prelude + f"\nimport runpy, sys\nsys.argv = {[str(script), *map(str, argv)]!r}\n"
                    f"runpy.run_path({str(script)!r}, run_name='__main__')\n"]
        return subprocess.run(code, cwd=cwd, env=env, capture_output=True, timeout=timeout)
    key = tuple(sorted((k, v) for k, v in base_env.items() if k not in RUNTIME_ENV))
    server = _servers.pop(key, None)
    if server is None or not server.alive():
        while len(_servers) >= MAX_SERVERS:
            _servers.pop(next(iter(_servers))).close()
        server = ScriptServer(base_env)
    _servers[key] = server  # now the newest
    return server.run(script, argv, cwd, env, timeout, prelude)


def as_text(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """`result` with its streams decoded (UTF-8, bad bytes replaced; carriage returns kept, which
    `text=True` would turn into newlines), in place; returns it."""
    result.stdout, result.stderr = (stream.decode("utf-8", errors="replace") for stream in (result.stdout, result.stderr))
    return result


def run_python(command, cwd=None, env=None, timeout: float = 600):
    """`subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)`
    for a command ``[sys.executable, script, *argv]``, the script forked from the warm interpreter
    of that environment (default: this process's)."""
    python, script, *argv = map(str, command)
    assert python == sys.executable and script.endswith(".py"), command
    env = dict(os.environ if env is None else env)
    result = run(script, argv, cwd or os.getcwd(), env, env, timeout)
    return as_text(result)


def run_code(code: str, cwd=None, env=None, timeout: float = 600):
    """As `subprocess.run([sys.executable, "-c", code], ...)` with text streams: `code` as a script
    (sys.path[0] its temporary folder, not the working directory), forked from the warm interpreter
    of `env` (default: this process's environment)."""
    env = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "code.py"
        script.write_text(code)
        result = run(script, [], cwd or os.getcwd(), env, env, timeout)
    return as_text(result)


@atexit.register
def close_all():
    for server in _servers.values():
        server.close()
    _servers.clear()
