"""`python SCRIPT ARGS` as a process of its own that starts without importing torch and transformers again.

A test whose point is what a process does (its exit code, what it prints, its answer to a signal or a kill -9, its
files, another run beside it) needs a process of its own; the ~6 s of CPU that each one spends importing torch,
transformers, datasets and Accelerate on a 2-core machine are not its point. Here each such process is forked from
a server that imported them once (multiprocessing's forkserver, its preload list): a real process, with its own pid,
signals, exit code, memory and environment, that runs the script's `__main__` block as `python SCRIPT` would, with
the test's environment and working folder, its stdout and stderr in pipes the test reads. `accelerate launch ARGS`
is such a script too: the launcher is forked, and the ranks it starts are new interpreters, as always.

What it does not do, so where these matter a test starts a real interpreter (subprocess) instead:
- modules imported by the server read their environment then: a variable that a library reads when it is imported
  (`HF_HOME` in huggingface_hub and datasets, `OMP_NUM_THREADS` in OpenMP) has the suite's value, whatever the test
  sets (the suite sets the ones that matter for every process, tests/conftest.py); the one that decides what
  `accelerate launch` does, its default config under `HF_HOME`, is checked in the child, which becomes a new
  interpreter (`exec`, same pid and pipes) where it would read another file than the server did;
- interpreter start-up itself (`sitecustomize`, `-X` options) does not run again: the bf16 switch of the suite is
  applied here as tests/bf16_switch/sitecustomize.py applies it.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path

# What the server imports once: the app's entry points (and through them torch, transformers, datasets, Accelerate).
PRELOAD = ["app.train", "app.predict", "accelerate.commands.launch"]
ACCELERATE_CLI = Path(sys.executable).parent / "accelerate"
_context = None


def _server():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _run_script(script: str, args: list[str], env: dict, cwd: str, out: Connection, err: Connection | None) -> None:
    """In the forked process: the environment, folder and streams of `python SCRIPT ARGS` (stderr into stdout's pipe
    without `err`), then its __main__."""
    os.dup2(out.fileno(), 1)
    os.dup2((err or out).fileno(), 2)
    for end in (out, err):
        if end is not None:
            end.close()
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a new interpreter
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    switch = env.get("AMP_TRAINER_TEST_BF16")
    if switch in ("0", "1"):  # tests/bf16_switch/sitecustomize.py, which a new interpreter would have run
        import app.amp.policy

        app.amp.policy.cpu_has_native_bf16 = lambda: switch == "1"
    if Path(script) == ACCELERATE_CLI and _stale_accelerate_config():
        os.execve(sys.executable, [sys.executable, script, *args], env)  # a new interpreter after all, same pid
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).parent))  # as python puts the script's folder first
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        if not isinstance(exit.code, (int, type(None))):
            print(exit.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _stale_accelerate_config() -> bool:
    """Whether `accelerate launch` would read another default config here than in a new interpreter: accelerate
    finds it under HF_HOME when `accelerate.commands.config` is imported, which the server did with its own HF_HOME."""
    import importlib.util

    spec = importlib.util.find_spec("accelerate.commands.config.config_args")
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)  # accelerate's own code, reading this process's environment
    served = sys.modules[spec.name].default_config_file
    return fresh.default_config_file != served and (os.path.isfile(fresh.default_config_file) or os.path.isfile(served))


class ForkedProcess:
    """The part of subprocess.Popen's interface that the suite uses, for a forked `python SCRIPT ARGS`."""

    def __init__(
        self, script: str, args: list[str], env: dict, cwd: str | Path | None, text: bool = True, merge: bool = False
    ):
        out_read, out_write = os.pipe()
        out = Connection(out_write)
        err_read, err = None, None
        if not merge:
            err_read, err_write = os.pipe()
            err = Connection(err_write)
        self._process = _server().Process(
            target=_run_script, args=(script, args, dict(env), str(cwd or os.getcwd()), out, err), daemon=False
        )
        self._process.start()
        for end in (out, err):
            if end is not None:
                end.close()
        mode = "r" if text else "rb"
        self.stdout = os.fdopen(out_read, mode)
        self.stderr = os.fdopen(err_read, mode) if err_read is not None else None
        self.pid = self._process.pid
        self.args = [sys.executable, script, *args]
        self.returncode = None

    def poll(self) -> int | None:
        if self.returncode is None and self._process.exitcode is not None:
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.pid, timeout)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Both streams to their end (read side by side, so that neither pipe fills), then the exit code."""
        import threading

        chunks: dict[str, str] = {}
        readers = [
            threading.Thread(target=lambda name=name, stream=stream: chunks.__setitem__(name, stream.read()))
            for name, stream in (("out", self.stdout), ("err", self.stderr))
            if stream is not None
        ]
        for reader in readers:
            reader.start()
        try:
            self.wait(timeout)
        finally:
            for reader in readers:
                reader.join(timeout=30)
        return chunks.get("out", ""), chunks.get("err") if self.stderr is not None else None


def python_script(cmd: list) -> tuple[str, list[str]] | None:
    """(script, args) if `cmd` is `python SCRIPT ARGS` with this interpreter, or `accelerate launch ARGS` (a Python
    script too: the launcher, whose ranks start as new interpreters), else None."""
    cmd = [str(part) for part in cmd]
    if len(cmd) >= 2 and cmd[0] == sys.executable and cmd[1].endswith(".py"):
        return cmd[1], cmd[2:]
    if len(cmd) >= 2 and cmd[0] == str(ACCELERATE_CLI) and cmd[1] == "launch":
        return cmd[0], cmd[1:]
    return None


def popen(cmd: list, env: dict, cwd=None, stdout=None, stderr=None, text: bool = True):
    """subprocess.Popen(cmd, ...) for any command; `python SCRIPT ARGS` forked (ForkedProcess), its streams always in
    pipes (stderr merged into stdout when asked for with subprocess.STDOUT)."""
    found = python_script(cmd)
    if found is None:
        return subprocess.Popen(list(map(str, cmd)), env=env, cwd=cwd, stdout=stdout, stderr=stderr, text=text)
    return ForkedProcess(*found, env=env, cwd=cwd, text=text, merge=stderr == subprocess.STDOUT)


def run(cmd: list, env: dict, cwd=None, timeout: float | None = None) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, env=env, capture_output=True, text=True, ...), `python SCRIPT ARGS` forked."""
    found = python_script(cmd)
    if found is None:
        return subprocess.run(
            list(map(str, cmd)), env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
        )
    process = ForkedProcess(*found, env=env, cwd=cwd)
    try:
        out, err = process.communicate(timeout)
    finally:
        process.kill()
    return subprocess.CompletedProcess([str(part) for part in cmd], process.returncode, out, err)
