"""`python SCRIPT ARGS` as a process of its own that starts without importing torch and transformers again.

A test whose point is what a process does (its exit code, what it prints, its answer to a signal or a kill -9, its
files, another run beside it) needs a process of its own; the ~10 s of CPU that each one spends importing torch,
transformers (its modeling code included), datasets and Accelerate on a 2-core machine are not its point. Here each
such process is forked from a server that imported them once (multiprocessing's forkserver, its preload list): a
real process, with its own pid, signals, exit code, memory and environment, that runs the script's `__main__` block
as `python SCRIPT` would, with the test's environment and working folder, its stdout and stderr in pipes the test
reads. `accelerate launch ARGS` is such a script too: the launcher is forked, and the processes it starts as
`python SCRIPT` (torchrun's ranks, or the one process of a plain launch) are forked from it in turn, each in the
session, environment and streams the launcher gives it; the launcher waits for them, signals and reaps them as its
own (they are).

What it does not do, so where these matter a test starts a real interpreter (subprocess) instead:
- modules imported by the server read their environment then: a variable that a library reads when it is imported
  (`HF_HOME` in huggingface_hub and datasets) has the suite's value, whatever the test sets (the suite sets the ones
  that matter for every process, tests/conftest.py). Two are read again in the child: `OMP_NUM_THREADS` (torch's
  thread count) and the default config of `accelerate launch` under `HF_HOME`;
- interpreter start-up itself (`sitecustomize`, `-X` options) does not run again: the bf16 switch of the suite is
  applied here as tests/bf16_switch/sitecustomize.py applies it.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path

# What the server imports once: the app's entry points (and through them torch, transformers, datasets, Accelerate),
# and what a run imports later, when it builds its model and writer (transformers' modeling code alone takes 3.6 s of
# CPU on a 2-core EPYC), for the model types the suite trains and LoRA.
PRELOAD = [
    "app.train",
    "app.predict",
    "accelerate.commands.launch",
    "transformers.modeling_utils",
    "transformers.models.bert.modeling_bert",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
    "torch.utils.tensorboard",
    "peft",
]
ACCELERATE_CLI = Path(sys.executable).parent / "accelerate"
_context = None


def _server():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _run_script(script: str, args: list[str], env: dict, cwd: str, out: Connection, err: Connection | None) -> None:
    """In the forked process: the streams of `python SCRIPT ARGS` (stderr into stdout's pipe without `err`), then the
    script."""
    os.dup2(out.fileno(), 1)
    os.dup2((err or out).fileno(), 2)
    for end in (out, err):
        if end is not None:
            end.close()
    if Path(script) == ACCELERATE_CLI:
        os.environ.clear()
        os.environ.update(env)
        _accelerate_config_of_this_environment()
        _fork_ranks_too()
    _become(script, args, env, cwd)


def _become(script: str, args: list[str], env: dict, cwd: str) -> None:
    """In a forked process whose fds 1 and 2 are set: `python SCRIPT ARGS` from here on, as a new interpreter would
    start it (environment, folder, signal handlers, thread count, the bf16 switch), then exit with its code."""
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
    for signum in signal.valid_signals():  # a launcher's handlers (torchrun's) are not the script's
        if callable(signal.getsignal(signum)):
            signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a new interpreter
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # found again from TMPDIR, as a new interpreter would
    os.chdir(cwd)
    switch = env.get("AMP_TRAINER_TEST_BF16")
    if switch in ("0", "1"):  # tests/bf16_switch/sitecustomize.py, which a new interpreter would have run
        import app.amp.policy

        app.amp.policy.cpu_has_native_bf16 = lambda: switch == "1"
    if env.get("OMP_NUM_THREADS", "").isdigit():  # what torch reads from it when a new interpreter imports it
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
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
    if (harness := sys.modules.get("tests.harness")) is not None:
        harness.remove_folders()  # a worker script's run folders: os._exit below skips the interpreter's clean-up
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _fork_ranks_too() -> None:
    """In the forked `accelerate launch`: the processes it starts as `python [-u] SCRIPT ARGS` (torchrun's ranks, or
    the one process of a plain launch) are forked from the launcher as well, which holds what the server imported,
    through a subprocess.Popen whose child forks instead of exec'ing (ForkedRank), so that the launcher watches,
    signals and reaps them as it does its own. Any other command starts as it would."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    started = subprocess.Popen

    def popen(args, *positional, **kwargs):
        cmd = [str(part) for part in args] if isinstance(args, (list, tuple)) else []
        found = python_script([cmd[0], *cmd[2:]] if cmd[1:2] == ["-u"] else cmd)  # torchrun adds -u
        if found is None or positional or kwargs.get("env") is None:
            return started(args, *positional, **kwargs)
        return ForkedRank(found, **kwargs)

    subprocess.Popen = subprocess_handler.Popen = popen  # the launcher's own process only


class ForkedRank(subprocess.Popen):
    """A subprocess.Popen of `python SCRIPT ARGS` whose child is this process forked, then the script (_become):
    pid, poll, wait, signals and the exit status are Popen's own."""

    def __init__(self, script_and_args: tuple[str, list[str]], **kwargs):
        self._script, self._script_args = script_and_args
        super().__init__([sys.executable, self._script, *self._script_args], **kwargs)

    def _execute_child(
        self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags, shell,
        p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, restore_signals, gid, gids, uid, umask,
        start_new_session, process_group,
    ) -> None:  # fmt: skip
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # or the child would write what the launcher had buffered once more
        pid = os.fork()
        if pid == 0:
            try:
                if start_new_session:
                    os.setsid()
                for fd, target in ((p2cread, 0), (c2pwrite, 1), (errwrite, 2)):
                    if fd != -1:
                        os.dup2(fd, target)
                # As exec'ing Popen's child would: none of the pipes' own fds outlive the dup2 above (the launcher's
                # ends among them, or its reads of them would never see the end of the stream).
                for fd in {p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite} - {-1, 0, 1, 2}:
                    os.close(fd)
                _become(self._script, self._script_args, dict(env), cwd or os.getcwd())
            except BaseException:  # before the script ran (it exits on its own): say why, as exec's failure would
                import traceback

                traceback.print_exc()
            finally:
                os._exit(1)
        self.pid = pid
        self._child_created = True
        # The child's ends, closed here as Popen's own _execute_child closes them: accelerate launch (1.16) reads its
        # rank's stderr until the end of the stream, which never comes while this process holds the write end.
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)


def _accelerate_config_of_this_environment() -> None:
    """accelerate finds its default config under HF_HOME when `accelerate.commands.config` is imported, which the
    server did with its own HF_HOME: here the paths it keeps are computed again by accelerate's own code in this
    process's environment, and set in each of accelerate's command modules that holds them, as a new interpreter
    would have them."""
    import importlib.util

    spec = importlib.util.find_spec("accelerate.commands.config.config_args")
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)  # accelerate's own code, reading this process's environment
    names = ["hf_cache_home", "cache_dir", "default_config_file"]
    names += ["default_json_config_file", "default_yaml_config_file"]
    served = {name: getattr(sys.modules[spec.name], name) for name in names}
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("accelerate.commands") and module is not None:
            for name in names:
                if getattr(module, name, None) == served[name]:
                    setattr(module, name, getattr(fresh, name))


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
            # As Popen's: the process may end between the poll and the kill (its reaper is the server, not this one).
            with contextlib.suppress(ProcessLookupError):
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
