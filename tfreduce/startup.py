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
own switch: no C++ INFO or WARNING lines; children inherit it), and while
TensorFlow is imported and its devices listed -- when absl writes before that
switch is read -- it captures file descriptor 2 and writes back every line
that is not start-up noise (``is_startup_noise``), so a real error still
shows. ``--verbose`` on each command, or ``TFREDUCE_VERBOSE=1`` in the
environment (the launcher passes it to its workers), shows everything. The
captured lines are written back when the import returns or raises; if
TensorFlow kills the process while importing (e.g. a CPU without the
instructions it was built for), they are lost, and ``--verbose`` shows them.

Standard library only: the commands parse their arguments before they call
this, so ``--help`` never waits for TensorFlow.
"""

import argparse
import contextlib
import os
import re
import sys
import tempfile

__all__ = ["ArgumentParser", "VERBOSE_ENV", "import_tensorflow", "is_startup_noise",
           "is_verbose"]

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
    r"|To enable the following instructions: .* rebuild TensorFlow)")


def is_startup_noise(line):
    """True if one line of stderr is TensorFlow start-up noise (see the module docstring)."""
    return bool(_NOISE.match(line))


def is_verbose(verbose=False):
    """True if verbose is set, or TFREDUCE_VERBOSE is set to anything but "" or "0"."""
    return bool(verbose) or os.environ.get(VERBOSE_ENV, "") not in ("", "0")


@contextlib.contextmanager
def _filtered_stderr():
    """Captures file descriptor 2 (C++ and Python writes) and writes back all but the noise."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            text = capture.read().decode("utf-8", errors="replace")
            kept = [line for line in text.splitlines(True) if not is_startup_noise(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def import_tensorflow(verbose=False):
    """Imports TensorFlow and lists its GPUs, without the start-up noise unless verbose.

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
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with _filtered_stderr():
        import tensorflow as tf
        # The CUDA platform is probed here: its "failed call to cuInit" on a
        # machine without a GPU driver lands inside the filter.
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
