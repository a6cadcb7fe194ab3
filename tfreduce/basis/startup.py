"""What every entry point shares (the example, tfreduce-bench, the launcher and its workers).

One quiet start-up, and usage errors of one line (``ArgumentParser``).

On a healthy machine without a GPU, importing TensorFlow 2.16+ and starting
its runtime prints lines that are not problems but read like them: absl's
"All log messages before absl::InitializeLog() is called are written to
STDERR" (twice), "Could not find cuda drivers", the CPU feature guard and
"failed call to cuInit: ... UNKNOWN ERROR (303)". Later, at run time, the
profiler and graph passes add INFO and WARNING lines ("GPU trace was not
collected.").

``import_tensorflow`` hides them: it sets ``TF_CPP_MIN_LOG_LEVEL=2`` (TF's
own switch: no C++ INFO or WARNING lines; children inherit it), and routes
file descriptor 2 through a filter process for the rest of the run: every
line that is not noise (``is_startup_noise``) is written on, so a real error
still shows. Start-up is one part of the noise: absl writes before it reads
the switch. The other part comes later, once per process, from ERROR lines
that are not errors. On a CPU without AVX-512 float16 support the first
float16 graph prints "oneDNN supports DT_HALF only on platforms with
AVX-512. Falling back to the default Eigen-based implementation" (the
fallback is the normal path there). The filter is a separate process that
reads until every writer has closed the pipe: lines written just before the
process is killed or aborts still reach the terminal. ``--verbose`` on each
command, or ``TFREDUCE_VERBOSE=1`` in the environment (the launcher passes
it to its workers), shows everything and starts no filter.

Standard library only: the commands parse their arguments before they call
this, so ``--help`` never waits for TensorFlow.
"""

import argparse
import atexit
import os
import re
import signal
import subprocess
import sys

__all__ = ["ArgumentParser", "VERBOSE_ENV", "after_fork", "import_tensorflow",
           "is_startup_noise", "is_verbose", "quiet_stderr"]

#: Set to 1 to show TensorFlow's start-up and C++ log lines in every command.
VERBOSE_ENV = "TFREDUCE_VERBOSE"

# What a healthy CPU-only start prints. C++ INFO and WARNING lines (I0000 /
# W0000) are what TF_CPP_MIN_LOG_LEVEL=2 hides once absl has read it; before
# that, absl prints them regardless. Of the ERROR lines only cuInit's is
# noise: it means "no GPU driver", which a CPU machine does not have.
_NOISE = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\) is called"
    r"|[IW]\d{4} [\d:.]+ +\d+ \S+:\d+\] "
    r"|E\d{4} [\d:.]+ +\d+ cuda_\w+\.cc:\d+\] failed call to cuInit"
    r"|E\d{4} [\d:.]+ +\d+ util\.cc:\d+\] oneDNN supports DT_HALF only on platforms with"
    r"|To enable the following instructions: .* rebuild TensorFlow)")


def is_startup_noise(line):
    """True if one line of stderr is TensorFlow start-up noise (see the module docstring)."""
    return bool(_NOISE.match(line))


def is_verbose(verbose=False):
    """True if verbose is set, or TFREDUCE_VERBOSE is set to anything but "" or "0"."""
    return bool(verbose) or os.environ.get(VERBOSE_ENV, "") not in ("", "0")


# The filter process, kept (never waited for: it ends after this process).
_FILTERS = []

# The first characters of every noise line: a partial line that starts
# otherwise (a progress bar's "\r") is written on at once.
_NOISE_FIRST = b"IWET"


def filter_stream(read_fd, write_fd):
    """Copies read_fd to write_fd until end of file, leaving out the noise lines.

    A partial line is held back only while it may still become a noise line
    (its first byte is one of _NOISE_FIRST); at end of file what is left is
    judged as a line.

    Args:
      read_fd, write_fd: int file descriptors.
    """
    pending, passing = b"", False
    while True:
        chunk = os.read(read_fd, 65536)
        if not chunk:
            if pending and not is_startup_noise(pending.decode("utf-8", "replace")):
                _write_all(write_fd, pending)
            return
        pending += chunk
        *lines, pending = pending.split(b"\n")
        out = []
        for line in lines:
            if passing or not is_startup_noise(line.decode("utf-8", "replace")):
                out.append(line + b"\n")
            passing = False
        if pending and (passing or pending[:1] not in _NOISE_FIRST):
            out.append(pending)
            pending, passing = b"", True
        if out:
            _write_all(write_fd, b"".join(out))


def _write_all(fd, data):
    while data:
        data = data[os.write(fd, data):]


def _drain_filter():
    # At exit: end the filter's input (this process's copy of it) and give
    # the filter a moment to write the last lines, so that whoever waits
    # for this process and then reads its stderr finds them there.
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    for child in _FILTERS:
        try:
            child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass  # another process still writes through it (a worker it started)


def _start_stderr_filter():
    """Routes file descriptor 2 through filter_stream in a child process, for good.

    The child runs this file as a script (standard library only, in
    isolated mode), ignores Ctrl-C (the parent decides what an interrupt
    does, and its last words must get through) and ends at end of file, when
    this process and every child that inherited its stderr have exited.
    """
    sys.stderr.flush()
    read_fd, write_fd = os.pipe()
    _FILTERS.append(subprocess.Popen(
        [sys.executable, "-I", os.path.abspath(__file__), "--filter-stderr"],
        stdin=read_fd, stdout=2, stderr=2, start_new_session=True))
    os.dup2(write_fd, 2)
    os.close(read_fd)
    os.close(write_fd)
    atexit.register(_drain_filter)


def quiet_stderr():
    """Sets TF_CPP_MIN_LOG_LEVEL=2 (unless set) and filters fd 2 for the rest of this process.

    What ``import_tensorflow`` does before it imports, for a process that
    imports TensorFlow otherwise (the launcher's ``--preload``). Once per
    process: a second call changes nothing.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if not _FILTERS:
        _start_stderr_filter()


def after_fork():
    """In a child forked from a process that filtered its stderr: a filter of its own.

    The child inherits its parent's record of the filter process and the
    exit hook that waits for it; both belong to the parent and are dropped.
    Then, unless TFREDUCE_VERBOSE is set, the child's fd 2 (which the
    caller has already pointed where the child's output goes) is filtered
    by a new filter process.
    """
    atexit.unregister(_drain_filter)
    del _FILTERS[:]
    if not is_verbose():
        quiet_stderr()


def import_tensorflow(verbose=False):
    """Imports TensorFlow and lists its GPUs; filters stderr for the run unless verbose.

    Call it first thing after argument parsing, before anything else imports
    TensorFlow (later imports are then free and quiet). Logical CPU devices
    can still be configured afterwards: listing physical devices does not
    start the runtime.

    Args:
      verbose: bool; True (or TFREDUCE_VERBOSE=1) imports with every line shown.

    Returns:
      The ``tensorflow`` module.
    """
    if is_verbose(verbose) or "tensorflow" in sys.modules:
        import tensorflow as tf
        return tf
    quiet_stderr()
    import tensorflow as tf
    tf.config.list_physical_devices("GPU")
    return tf


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one line: ``PROG: error: MESSAGE``.

    argparse prints the whole usage before the message, which for a command
    with many options pushes the one line that matters off the screen; here
    the message ends with a pointer to ``--help`` instead. Exits with 2, as
    argparse does.
    """

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


if __name__ == "__main__" and sys.argv[1:] == ["--filter-stderr"]:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    filter_stream(0, 1)
