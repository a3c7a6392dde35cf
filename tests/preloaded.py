"""A process that has imported torch and fairseq, and forks one process per
command (or per rank of a command) for the end-to-end tests.

Each fairseq command the tests run starts fresh interpreters (torchrun's and
one per rank) that import torch and fairseq: seconds of CPU each before
any work, most of the suite's time on 2 cores. A process forked from
this one starts with those imports done (and the parts of torch that a run
imports lazily, ``LAZY_TORCH_MODULES``) and nothing else: the command's
module (``fairseq_cli.train``, ``fairseq_megatron.cli...``) runs as
``python -m`` runs it (``runpy``'s function for that, ``sys.argv`` and the
current directory set, atexit handlers at its end), imports the plugin
itself through ``--user-dir``, and reads its environment, standard input and
output from the request. The technique is multiprocessing's forkserver
with a preload list, which ``tests.helpers.run_distributed`` uses for the
distributed tests.

Protocol, one JSON object per line on standard input::

    {"module": ..., "argv": [...], "env": {...}, "cwd": ..., "stdin": path or null,
     "output": path, "status": path, "read_only": [directory, ...]}

``read_only`` (optional): directories the process sees mounted read-only
(a mount namespace of its own, where each is bind-mounted read-only over
itself: a read-only file system for that process alone, as a shared model
directory or a read-only bind mount is). Where that cannot be done (no
``CAP_SYS_ADMIN``), the process writes ``READ_ONLY_UNAVAILABLE`` and the
reason to its output and exits with status 77.

answered by the forked process's id on standard output. The process appends
its standard output and error to ``output`` (several ranks share one file,
as they share torchrun's stream) and at its end writes its exit status to
``status``, then exits with it; no status file means it was killed. The
server reaps its children itself (SIGCHLD ignored) and ends when its
standard input closes.

Not for what a fresh interpreter must show: the environment variables read
at import time (``PYTHON*``, ``OMP_*``, ``MKL_*``, ``TORCH*``, ``CUDA*``)
are the server's, which ``tests.helpers`` starts with the environment it
gives every command (``ENV``), and tests of start-up itself (torchrun,
fairseq's own spawn, SLURM, the import guard) run real interpreters.
"""

import atexit
import importlib
import json
import logging
import os
import runpy
import signal
import sys
import threading

import fairseq  # noqa: F401  (the imports the forked processes skip)
import torch  # noqa: F401

# The parts of torch that a run imports later, when it first needs them, not with ``import torch``:
# TorchDynamo (torch.optim imports it when the first optimizer is built), the device mesh, DTensor,
# FSDP2 and the pipelining package (this package imports them where a layout uses them): a second or
# more of CPU in every forked process that would import them (docs/testing.md).
# tests.helpers imports this module: the ranks of run_distributed's fork server start with them too.
LAZY_TORCH_MODULES = ("torch._dynamo", "torch.distributed.device_mesh", "torch.distributed.tensor",
                      "torch.distributed.fsdp", "torch.distributed.pipelining")
for _name in LAZY_TORCH_MODULES:
    importlib.import_module(_name)

# Importing fairseq configures the root logger (``logging.basicConfig(level=DEBUG)`` in
# fairseq/models/wav2vec/wav2vec2_classification.py; the later calls do nothing). fairseq's tools
# that import fairseq before configuring logging run with that; every other module starts with the
# root logger of a fresh interpreter: fairseq_cli.train configures it first, and this package
# imports fairseq holding the configuration off.
IMPORT_FAIRSEQ_FIRST = {"fairseq_cli.eval_lm", "fairseq_cli.generate", "fairseq_cli.interactive",
                        "fairseq_cli.validate", "fairseq_cli.preprocess"}


READ_ONLY_UNAVAILABLE = "read-only mounts unavailable here:"


def _mount_read_only(directories):
    """Give this process a mount namespace of its own in which each of
    ``directories`` is bind-mounted read-only over itself (what ``unshare -m``
    and ``mount -o remount,ro,bind`` do), its mounts private so that nothing
    reaches the other processes.

    Raises:
        OSError: a system call was refused.
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    clone_newns, ms_rdonly, ms_remount, ms_bind, ms_rec, ms_private = 0x20000, 0x1, 0x20, 0x1000, 0x4000, 0x40000

    def call(rc, what):
        if rc != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")

    call(libc.unshare(clone_newns), "unshare(CLONE_NEWNS)")
    call(libc.mount(b"none", b"/", None, ms_rec | ms_private, None), "mount --make-rprivate /")
    for directory in directories:
        path = os.fsencode(directory)
        call(libc.mount(path, path, None, ms_bind | ms_rec, None), f"mount --bind {directory}")
        call(libc.mount(b"none", path, None, ms_remount | ms_bind | ms_rdonly, None), f"remount {directory} ro")


def _run(request):
    """In the forked process: run the requested module as ``python -m``; never returns."""
    code = 1
    try:
        os.setsid()  # its own process group: a timeout kills it with what it started
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        stdin = os.open(request["stdin"] or os.devnull, os.O_RDONLY)
        output = os.open(request["output"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(stdin, 0)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.close(stdin)
        os.close(output)
        # new file objects: the server's stdin buffers later requests
        sys.stdin = open(0, "r", closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        if request.get("read_only"):
            try:
                _mount_read_only(request["read_only"])
            except OSError as e:
                print(f"{READ_ONLY_UNAVAILABLE} {e}", file=sys.stderr)
                code = 77
                raise SystemExit(77)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sys.path[0] = os.getcwd()  # as `python -m` puts it
        if request["module"] not in IMPORT_FAIRSEQ_FIRST:
            root = logging.getLogger()
            for handler in list(root.handlers):
                root.removeHandler(handler)
            root.setLevel(logging.WARNING)
        sys.argv = ["-m", *request["argv"]]
        try:
            runpy._run_module_as_main(request["module"])  # what `python -m` calls; __main__ stays the module
            code = 0
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            sys.excepthook(*sys.exc_info())  # as the interpreter reports what nothing caught
            code = 1
        threading._shutdown()  # what the interpreter does at its end: join the threads left, then atexit
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            tmp = request["status"] + ".tmp"
            with open(tmp, "w") as f:
                f.write(str(code))
            os.rename(tmp, request["status"])
        finally:
            os._exit(code)


def serve():
    assert threading.active_count() == 1, "a process with threads must not fork"
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _run(request)
        sys.stdout.write(f"{pid}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
