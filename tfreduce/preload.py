"""Workers forked from the launcher after it imported what they all need (``--preload``).

A worker started as a new Python imports TensorFlow itself: about 9 s of
CPU on a 2-core host (TF 2.21 imports Keras, and Keras scikit-learn, with
it), paid by each of the N workers and again at every restart. With

    python -m tfreduce.launch --workers 2 --preload tensorflow -- python train.py

the launcher imports the listed modules once, then forks each worker from
itself and runs the worker's program in the child as ``python`` would: the
same ``sys.argv``, ``sys.path[0]``, ``__main__`` module and environment
(the worker's own TF_CONFIG), its own session and stdio, atexit handlers
at the end, and the exit code or signal the launcher reports. Python's
``forkserver`` start method preloads modules the same way
(``multiprocessing.set_forkserver_preload``), and so does gunicorn's
``--preload``.

Only importing is shared. The launcher never starts TensorFlow's runtime:
it lists no device and initialises no CUDA, and its thread pools do not
exist yet; each worker starts them after the fork. (CUDA cannot be used
in a child forked after the parent called cuInit.)

The command must be this Python (``sys.executable``, or a name on PATH
that is the same file) followed by a script, ``-m MODULE`` or ``-c CODE``
and the program's arguments; ``program`` refuses anything else, Python's
own options (``-u``, ``-X``, ...) included.

Standard library only, like the launcher.
"""

import atexit
import builtins
import importlib
import io
import os
import runpy
import shutil
import signal
import sys
import threading
import traceback
import types

from tfreduce.basis import startup

__all__ = ["ForkedWorker", "preload", "program"]


def program(command):
    """The Python program a preloaded launcher runs in each forked worker.

    Args:
      command: list of str, the worker command, e.g. ``["python", "train.py",
        "--epochs", "2"]``.

    Returns:
      (kind, target, args): kind is "script", "-m" or "-c"; target the
      script's path, the module's name or the code (str); args the list of
      str after it (the program's sys.argv[1:]).

    Raises:
      ValueError: the command is not this Python running a script, a module
        or code, with a message that names what was given.
    """
    usage = (f"--preload forks the workers from this Python ({sys.executable}), so the "
             f"command must be 'python SCRIPT|-m MODULE|-c CODE [ARGS]' of it")
    if not command:
        raise ValueError(f"{usage}; got no command")
    found = shutil.which(command[0])
    if found is None or not os.path.samefile(found, sys.executable):
        raise ValueError(f"{usage}; got {command[0]!r}, which is "
                         f"{'not found' if found is None else found}")
    rest = command[1:]
    if rest[:1] in (["-m"], ["-c"]):
        if len(rest) < 2:
            raise ValueError(f"{usage}; {rest[0]} needs its argument")
        return rest[0], rest[1], rest[2:]
    if not rest or rest[0].startswith("-"):
        raise ValueError(f"{usage}; got {' '.join(command)!r}")
    return "script", rest[0], rest[1:]


def preload(modules, verbose=False):
    """Imports ``modules`` (list of str) in this process, quietly unless verbose.

    TensorFlow's start-up lines are filtered as ``startup.import_tensorflow``
    does, but no device is listed: the runtime must start after the fork.

    Raises:
      ImportError: a module cannot be imported (the error names it).
    """
    if not startup.is_verbose(verbose):
        startup.quiet_stderr()
    for name in modules:
        importlib.import_module(name)


class ForkedWorker:
    """One worker forked from this process: the part of ``subprocess.Popen`` the launcher uses.

    ``pid``; ``stdout`` and ``stderr``, binary pipes from the worker;
    ``poll()`` and ``wait()`` set and return ``returncode``, as Popen's
    (negative: the signal that killed it). The worker leads a session of its
    own (Popen's ``start_new_session``) and its stdin is /dev/null.

    Args:
      prog: (kind, target, args) from ``program``.
      env: dict of str, the worker's whole environment.
      others: the ForkedWorkers started before it in this start, whose pipe
        ends the child closes.
      cwd: str, the worker's working directory (None: this process's).
      close_fds: more int file descriptors of this process the child closes.

    Raises:
      OSError: the pipes or the fork cannot be made (too many processes or
        open files).
    """

    def __init__(self, prog, env, others=(), cwd=None, close_fds=()):
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        inherited = [out_r, err_r] + [w.stdout.fileno() for w in others if not w.stdout.closed]
        inherited += [w.stderr.fileno() for w in others if not w.stderr.closed]
        inherited += list(close_fds)
        pid = os.fork()
        if pid == 0:  # the child: it never returns from here
            _child(prog, env, out_w, err_w, inherited, cwd)
        os.close(out_w)
        os.close(err_w)
        self.pid = pid
        self.returncode = None
        self.stdout = os.fdopen(out_r, "rb")
        self.stderr = os.fdopen(err_r, "rb")

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self):
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def _text(fd, mode):
    """A fresh text stream on fd, unbuffered as under PYTHONUNBUFFERED.

    Fresh, so that no lock the parent's stream objects held at the fork
    (another thread writing) is ever waited for.
    """
    raw = io.FileIO(fd, mode, closefd=False)
    errors = "backslashreplace" if fd == 2 else "strict"
    return io.TextIOWrapper(raw, encoding="utf-8", errors=errors, line_buffering=True,
                            write_through=True)


def _child(prog, env, out_w, err_w, inherited, cwd):
    code = 1
    try:
        os.setsid()
        if cwd is not None:
            os.chdir(cwd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for fd in inherited:
            os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        for target, fd in ((0, devnull), (1, out_w), (2, err_w)):
            if fd != target:
                os.dup2(fd, target)
        for fd in {devnull, out_w, err_w} - {0, 1, 2}:
            os.close(fd)
        os.environ.clear()
        os.environ.update(env)
        sys.stdin = sys.__stdin__ = _text(0, "r")
        sys.stdout = sys.__stdout__ = _text(1, "w")
        sys.stderr = sys.__stderr__ = _text(2, "w")
        startup.after_fork()
        code = _run(prog)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _run(prog):
    """Runs the program as ``python`` would; returns its exit code (or dies of SIGINT)."""
    kind, target, args = prog
    interrupted = False
    try:
        if kind == "-c":
            sys.argv, sys.path[0] = ["-c", *args], ""
            main = types.ModuleType("__main__")
            main.__builtins__ = builtins
            sys.modules["__main__"] = main
            exec(compile(target, "<string>", "exec"), main.__dict__)
        elif kind == "-m":
            sys.argv, sys.path[0] = [target, *args], os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        elif not os.path.exists(target):
            print(f"{sys.executable}: can't open file {os.path.abspath(target)!r}: "
                  f"[Errno 2] No such file or directory", file=sys.stderr)
            return 2
        else:
            sys.argv = [target, *args]
            sys.path[0] = os.path.dirname(os.path.realpath(target))
            runpy.run_path(target, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt as e:
        _uncaught(e)
        code, interrupted = 1, True
    except BaseException as e:
        _uncaught(e)
        code = 1
    _finish()
    if interrupted:  # as Python does: die of the signal itself
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _uncaught(error):
    """What Python does with an uncaught exception: sys.last_* set, then sys.excepthook.

    The traceback starts at the program's code: the frames of this module
    and of runpy are left out. (Exit handlers read ``sys.last_value``: the
    watchdog's goodbye names the error to the peers.)
    """
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__):
        tb = tb.tb_next
    error.with_traceback(tb)  # what sys.excepthook prints
    sys.last_type, sys.last_value, sys.last_traceback = type(error), error, tb
    if hasattr(sys, "last_exc"):  # Python 3.12+
        sys.last_exc = error
    sys.excepthook(type(error), error, tb)


def _exit_code(value):
    """``sys.exit(value)``'s exit code, printing a non-int value as Python does."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def _finish():
    """What Python does at exit: wait for non-daemon threads, run atexit, flush."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
