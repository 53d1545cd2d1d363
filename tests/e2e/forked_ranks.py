"""Lightning's rank processes forked from a copy of the recipe process taken before the script ran.

A recipe run with ``trainer.devices=N`` on one node starts ranks ``1..N-1`` through Lightning's
``_SubprocessScriptLauncher``: ``subprocess.Popen([python, <script>, *args, hydra overrides], env=..., cwd=...)``,
a fresh interpreter per rank that imports torch and Lightning again (about 8 CPU-s each). Under
:func:`tests.e2e.helpers.run_recipe` the recipe's first process is itself forked from a fork server that imported
them once; :func:`install` (called there before the script runs, while the process is single-threaded) forks a
*rank server* from it and points that launcher's ``subprocess.Popen`` at :func:`_popen`, so each rank is forked from
the rank server instead: the same command line (``sys.argv``), environment, working directory, session and inherited
stdout / stderr as the ``Popen`` it replaces, the script run as ``__main__``, without the imports.

Invariants:

* Only Lightning's script launcher is redirected, and only for a command ``[sys.executable, <script path>, ...]``;
  anything else (``-m``, keyword arguments besides ``env`` / ``cwd``) goes to the real ``subprocess.Popen``.
* The object returned has what the launcher and its ``_ChildProcessObserver`` use of a ``Popen``: ``pid``,
  ``returncode`` (a signal's negative number when a signal ended the rank), ``poll``, ``wait``, ``send_signal``,
  ``terminate``, ``kill``.
* The rank server is the ranks' parent: it reaps them and reports each exit status; it leaves once the recipe process
  closed its end (it exited) and every rank it started has exited.
"""

from __future__ import annotations

import atexit
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
import types
from multiprocessing.connection import Connection
from typing import Any

_server: "_RankServer | None" = None


def run_script(script: str, args: list[str]) -> int:
    """Run ``script`` as ``__main__`` with ``sys.argv = [script, *args]`` and do what the interpreter does at exit
    (wait for non-daemon threads, run the ``atexit`` handlers, flush); return the exit status ``sys.exit`` gave
    (1 after an uncaught exception, printed to stderr as the interpreter prints it)."""
    sys.argv = [script, *args]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - the interpreter's behaviour: print and exit 1
        traceback.print_exc()
        code = 1
    finally:
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def become(cwd: str, env: dict[str, str], script: str) -> None:
    """Take ``cwd`` and exactly ``env``; put ``script``'s directory and the ``PYTHONPATH`` entries first on
    ``sys.path``, as the interpreter does for ``python <script>``."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    first = [os.path.dirname(script), *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    sys.path[:] = [*dict.fromkeys(first), *(p for p in sys.path if p not in first)]


def _serve(requests: Connection, statuses: Connection) -> None:
    """The rank server's loop (never returns): fork a rank per request ``(command, env, cwd)``, answer
    ``("started", pid)``; report ``("exited", pid, returncode)`` for each rank reaped."""
    running: set[int] = set()
    open_ = True
    while open_ or running:
        if open_ and requests.poll(0.05):
            try:
                command, env, cwd = requests.recv()
            except EOFError:  # the recipe process exited
                open_ = False
                continue
            pid = os.fork()
            if pid == 0:
                requests.close()
                statuses.close()
                become(cwd, env, command[1])
                os._exit(run_script(command[1], list(command[2:])))
            running.add(pid)
            statuses.send(("started", pid))
        elif not open_:
            time.sleep(0.05)
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            running.discard(pid)
            statuses.send(("exited", pid, os.waitstatus_to_exitcode(status)))
    os._exit(0)


class _RankServer:
    """The recipe side of the rank server: sends requests, keeps the exit statuses it reported."""

    def __init__(self) -> None:
        req_r, req_w = os.pipe()
        st_r, st_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(req_w)
            os.close(st_r)
            _serve(Connection(req_r), Connection(st_w))
        os.close(req_r)
        os.close(st_w)
        self.pid = pid
        self._requests, self._statuses = Connection(req_w), Connection(st_r)
        self._lock = threading.Lock()
        self.exit_codes: dict[int, int] = {}

    def start(self, command: list[str], env: dict[str, str], cwd: str) -> int:
        with self._lock:
            self._requests.send((command, env, cwd))
            while True:
                message = self._statuses.recv()
                if message[0] == "started":
                    return message[1]
                self.exit_codes[message[1]] = message[2]

    def update(self) -> None:
        with self._lock:
            while self._statuses.poll():
                message = self._statuses.recv()
                if message[0] == "exited":
                    self.exit_codes[message[1]] = message[2]


class ForkedRank:
    """A rank forked by the rank server, with the ``Popen`` methods Lightning's launcher uses."""

    def __init__(self, server: _RankServer, pid: int, args: list[str]) -> None:
        self._server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._server.update()
            self.returncode = self._server.exit_codes.get(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _popen(command: Any, *args: Any, env: dict[str, str] | None = None, cwd: str | None = None, **kwargs: Any):
    """``subprocess.Popen`` for Lightning's script launcher (module docstring: which commands are forked)."""
    command = list(command) if isinstance(command, (list, tuple)) else command
    forkable = (_server is not None and not args and not kwargs and isinstance(command, list) and len(command) >= 2
                and command[0] == sys.executable and os.path.isfile(command[1]))
    if not forkable:
        return subprocess.Popen(command, *args, env=env, cwd=cwd, **kwargs)
    pid = _server.start(command, dict(os.environ if env is None else env), cwd or os.getcwd())
    return ForkedRank(_server, pid, command)


def install() -> None:
    """Fork the rank server (call while single-threaded, before the script runs) and redirect Lightning's script
    launcher to it."""
    global _server
    if threading.active_count() != 1:
        raise RuntimeError(f"forked_ranks.install: {threading.active_count()} threads; fork only a single-threaded "
                           "process")
    from lightning.pytorch.strategies.launchers import subprocess_script

    _server = _RankServer()
    subprocess_script.subprocess = types.SimpleNamespace(**{**vars(subprocess), "Popen": _popen})
