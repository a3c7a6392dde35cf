"""fairseq-train's ``--save-dir``: writable, and written by one run at a time.

- A read-only ``--save-dir`` (a read-only mount, a directory without
  permission to write) reached fairseq's probe of it, which logged "Unable
  to access checkpoint save directory" and raised ``OSError: [Errno 30]
  Read-only file system`` as a traceback; :func:`check_writable` refuses it
  in one line before anything runs.
- Two fairseq-train runs given one ``--save-dir`` both ran, the second
  resuming from the first's saves, and each saved over the other's:
  :func:`one_run_at_a_time` takes an advisory lock on the directory
  (``fcntl.flock`` of the directory itself; where the file system cannot
  lock a directory, as NFS, whose ``flock`` takes a write lock on a file
  open for writing, of ``<save-dir>/.fairseq_megatron.lock``, a file that
  is created and never written) for as long as the run lasts, and a second
  run stops with one line. The kernel releases the lock when the process
  ends however it ends, ``kill -9`` included, so a killed run never leaves
  it held. Rank 0 of the run holds it; the other ranks learn the outcome
  from it. Readers (fairseq-eval-lm and the other tools that only read a
  checkpoint) take no lock: they write nothing.
"""

import contextlib
import errno
import fcntl
import os
from typing import List, Optional

import torch.distributed as dist

from fairseq_megatron.errors import UsageError

LOCK_FILE = ".fairseq_megatron.lock"


def check_writable(save_dir: str) -> None:
    """Raise UsageError where ``save_dir``, or the nearest directory above
    it that exists (where it would be made), cannot be written.

    Raises:
        UsageError: "--save-dir X: cannot write in D: <reason>", the reason
            being a read-only file system or a missing permission.
    """
    existing = os.path.abspath(save_dir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if os.path.isdir(existing) and not os.access(existing, os.W_OK | os.X_OK):
        read_only = os.statvfs(existing).f_flag & os.ST_RDONLY
        reason = os.strerror(errno.EROFS if read_only else errno.EACCES)
        raise UsageError(f"--save-dir {save_dir}: cannot write in {existing}: {reason}")


def _take(save_dir: str) -> (Optional[int], Optional[str]):
    """The lock of ``save_dir`` (made if missing): (the descriptor that
    holds it, None), or (None, why not)."""
    os.makedirs(save_dir, exist_ok=True)
    fd = os.open(save_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None, _in_use(save_dir)
    except OSError:  # no locks on directories here: a file in it
        os.close(fd)
        fd = os.open(os.path.join(save_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if isinstance(e, BlockingIOError):
                return None, _in_use(save_dir)
            raise
    return fd, None


def _in_use(save_dir: str) -> str:
    return (f"--save-dir {save_dir} is in use: another fairseq-train run holds its lock; one run writes a save dir "
            f"at a time: wait for that run to end, or pass another --save-dir")


@contextlib.contextmanager
def one_run_at_a_time(save_dir: str, master: bool, made: List[str]):
    """Hold the lock of ``save_dir`` while the block runs (``master``: this
    is the run's rank 0, which takes it). ``made``: the directories this run
    made for ``save_dir`` (deepest first); where the block fails, the lock
    file goes with them if nothing else is there.

    Raises:
        UsageError: on every rank, another run holds the lock, or rank 0
            could not take it (the file system's error).
    """
    fd, refused = None, None
    if master:
        try:
            fd, refused = _take(save_dir)
        except OSError as e:
            refused = f"--save-dir {save_dir}: cannot take its lock: {e}"
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        said = [None] * dist.get_world_size()
        dist.all_gather_object(said, refused)
        refused = next((s for s in said if s is not None), None)
    if refused is not None:
        raise UsageError(refused)
    try:
        yield
    except BaseException:
        if fd is not None and made and os.listdir(save_dir) == [LOCK_FILE]:
            os.remove(os.path.join(save_dir, LOCK_FILE))  # the run made the directory and left nothing else in it
        raise
    finally:
        if fd is not None:
            os.close(fd)


@contextlib.contextmanager
def one_writer(directory: str, flag: str):
    """Hold the lock of ``directory`` (made if missing), the lock a
    fairseq-train run holds on its save dir, while the block runs: one
    process in one process's tool (``flag``: how messages name the
    directory) writes into it at a time.

    Raises:
        UsageError: another run or import holds the lock, or the directory
            cannot be made or locked (the file system's reason).
    """
    try:
        fd, refused = _take(directory)
    except OSError as e:
        raise UsageError(f"{flag}: cannot write in {directory}: {e.strerror or e}") from None
    if refused is not None:
        raise UsageError(f"{flag}: {directory} is in use: another fairseq-train run or import holds its lock; one "
                         f"writes a directory at a time: wait for it to end, or choose another directory")
    try:
        yield
    finally:
        os.close(fd)
