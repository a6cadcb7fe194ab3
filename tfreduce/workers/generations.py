"""What an elastic launcher and its workers share: generations, commits and host updates.

An elastic job (``tfreduce-launch --workers MIN:MAX``) runs as a sequence of
generations. Each generation is one cluster of a fixed size; when a worker
is lost, or slots are added or removed, the launcher stops the generation
and starts the next at the new size. The survivors keep their identity: a
worker's id (``TFREDUCE_WORKER_ID``) stays across generations, and its
rank is its age among the members (the oldest worker is rank 0).

What survives a generation is each worker's last commit: the state its
``hvd.elastic`` State saved (``tfreduce.tensorflow.elastic``), written
here as one file per worker id in the job's directory
(``TFREDUCE_ELASTIC_DIR``, in memory under /dev/shm where it exists). A
commit is written to a temporary name and renamed over the last one, so a
worker killed while it writes leaves its previous commit whole. In the
next generation each survivor reads its own commit back, and rank 0's is
broadcast to every worker, new ones included.

Host updates: the launcher bumps a counter in the directory's
``hosts-updated`` file when it has slots to add, and gives each generation
the count it started with (``TFREDUCE_HOSTS_UPDATES``). A worker reads the
file at each commit; the workers agree on the largest count they read (one small
all-reduce), so all of them see the update at the same commit and leave
with ``RESHAPE_CODE``, which asks the launcher to start the next
generation.

Sizes: the launcher tells each worker the sizes the job may form
(``TFREDUCE_WORKER_COUNTS``), so a script that can run at some sizes only
(``ReplicatedTrainer(deterministic=True)``) finds out at the start. A
worker that finds the job cannot go on at any size writes why to the
directory (``give_up``) before it fails; the launcher then ends the job
with that message instead of re-forming it.

Standard library only (the launcher imports it).
"""

import os
import sys
import tempfile

__all__ = ["COUNTS_ENV", "DIR_ENV", "GENERATION_ENV", "ID_ENV", "RESHAPE_CODE", "UPDATES_ENV",
           "ElasticWorker", "elastic_worker", "has_commits", "hosts_updates", "leave", "lost_peer",
           "make_directory", "read_commit", "read_fatal", "trainer_folder", "trainer_folders",
           "write_commit", "write_fatal", "write_hosts_updates"]

#: The directory of the job's commits and host updates.
DIR_ENV = "TFREDUCE_ELASTIC_DIR"
#: This worker's id, the same in every generation it is part of.
ID_ENV = "TFREDUCE_WORKER_ID"
#: The generation: 0 at the job's start, then one more at every re-forming.
GENERATION_ENV = "TFREDUCE_GENERATION"
#: The count of host updates when this generation started (updates after it re-form it).
UPDATES_ENV = "TFREDUCE_HOSTS_UPDATES"
#: The sizes (worker counts) the job may form, comma-separated ("2,3,4").
COUNTS_ENV = "TFREDUCE_WORKER_COUNTS"
#: The exit code of a worker that leaves so the job re-forms (its commit is written).
RESHAPE_CODE = 76

_HOSTS_FILE = "hosts-updated"
_FATAL_FILE = "fatal"


class ElasticWorker:
    """This process's place in an elastic job (``elastic_worker()``).

    Attributes:
      directory: str, the job's directory.
      worker_id: int, this worker's id across generations.
      generation: int, 0 at the first start.
      updates_at_start: int, the host updates the launcher had written when
        this generation started: a count above it is an update for this one.
      sizes: tuple of ints, the worker counts the job may form (ascending),
        or None when the launcher did not say.
    """

    def __init__(self, directory, worker_id, generation, updates_at_start=0, sizes=None):
        self.directory, self.worker_id, self.generation = directory, worker_id, generation
        self.updates_at_start, self.sizes = updates_at_start, sizes

    def read_commit(self):
        """This worker's last commit (bytes), or None when it has none."""
        return read_commit(self.directory, self.worker_id)

    def write_commit(self, payload):
        """Replaces this worker's commit by `payload` (bytes), atomically."""
        write_commit(self.directory, self.worker_id, payload)

    def hosts_updates(self):
        """The launcher's count of host updates so far (int)."""
        return hosts_updates(self.directory)

    def give_up(self, message):
        """Tells the launcher the job cannot go on at any size (str `message`, why)."""
        write_fatal(self.directory, f"worker {self.worker_id}: {message}")


def elastic_worker(environ=None):
    """This process's ElasticWorker when an elastic launcher started it, else None.

    Raises:
      ValueError: the environment has the directory but a bad id or generation.
    """
    environ = os.environ if environ is None else environ
    directory = environ.get(DIR_ENV)
    if not directory:
        return None
    try:
        sizes = environ.get(COUNTS_ENV)
        sizes = tuple(int(n) for n in sizes.split(",")) if sizes else None
        return ElasticWorker(directory, int(environ[ID_ENV]), int(environ[GENERATION_ENV]),
                             int(environ.get(UPDATES_ENV, 0)), sizes)
    except (KeyError, ValueError) as error:
        raise ValueError(f"{DIR_ENV} is set, but {ID_ENV}={environ.get(ID_ENV)!r} and "
                         f"{GENERATION_ENV}={environ.get(GENERATION_ENV)!r} must be ints: "
                         f"the elastic launcher sets all three") from error


def make_directory(parent=None):
    """A new job directory: under /dev/shm (memory) where it exists, else the temp dir."""
    if parent is None and os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        parent = "/dev/shm"
    return tempfile.mkdtemp(prefix="tfreduce-elastic-", dir=parent)


def _commit_path(directory, worker_id):
    return os.path.join(directory, f"worker-{worker_id}.commit")


def trainer_folder(directory, worker_id):
    """The folder of worker `worker_id`'s ``ReplicatedTrainer`` commits (checkpoints)."""
    return os.path.join(directory, f"trainer-{worker_id}")


def trainer_folders(directory):
    """The trainer commit folders in the job's directory, by name."""
    return [os.path.join(directory, name) for name in sorted(os.listdir(directory))
            if name.startswith("trainer-") and os.path.isdir(os.path.join(directory, name))]


def has_commits(directory):
    """True when some worker wrote a commit (``hvd.elastic``'s or a trainer's) in `directory`."""
    return bool(trainer_folders(directory)) or any(
        name.startswith("worker-") and name.endswith(".commit") for name in os.listdir(directory))


def _replace(path, data):
    """Writes `data` (bytes or str) to a temporary file, then renames it over `path`."""
    with open(f"{path}.partial", "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
    os.replace(f"{path}.partial", path)


def _read(path, mode="r"):
    """The contents of `path`, or None when it does not exist."""
    try:
        with open(path, mode) as f:
            return f.read()
    except FileNotFoundError:
        return None


def write_commit(directory, worker_id, payload):
    """Writes worker `worker_id`'s commit (bytes): to a temporary file, renamed over the last."""
    _replace(_commit_path(directory, worker_id), payload)


def read_commit(directory, worker_id):
    """Worker `worker_id`'s last commit (bytes), or None."""
    return _read(_commit_path(directory, worker_id), "rb")


def write_hosts_updates(directory, count):
    """The launcher's side: `count` host updates so far (int), written atomically."""
    _replace(os.path.join(directory, _HOSTS_FILE), str(count))


def hosts_updates(directory):
    """The count of host updates the launcher wrote (0 before any)."""
    return int(_read(os.path.join(directory, _HOSTS_FILE)) or 0)


def write_fatal(directory, message):
    """Says why the job cannot go on (str), for the launcher to end it with."""
    _replace(os.path.join(directory, _FATAL_FILE), message)


def read_fatal(directory):
    """The message a worker gave up with (``write_fatal``), or None."""
    return _read(os.path.join(directory, _FATAL_FILE))


def lost_peer(error, worker):
    """Why a worker leaves after exception `error` of a lost peer (one line, str)."""
    text = str(error).strip()
    first = text.splitlines()[0][:200] if text else ""
    return (f"a peer was lost ({type(error).__name__}: {first}): the job re-forms from the last "
            f"commit (worker {worker.worker_id}, generation {worker.generation})")


def leave(why):
    """Ends this worker with RESHAPE_CODE, saying `why` on stderr: the job re-forms."""
    print(f"tfreduce elastic: {why}", file=sys.stderr, flush=True)
    raise SystemExit(RESHAPE_CODE)
