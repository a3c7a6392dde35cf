"""A process that has imported torch and fairseq, and forks one process per
command (or per rank of a command) for the end-to-end tests.

Each fairseq command the tests run starts fresh interpreters (torchrun's and
one per rank) that import torch and fairseq: seconds of CPU each before
any work, most of the suite's time on 2 cores. A process forked from
this one starts with those two imports done and nothing else: the command's
module (``fairseq_cli.train``, ``fairseq_megatron.cli...``) runs as
``python -m`` runs it (``runpy``'s function for that, ``sys.argv`` and the
current directory set, atexit handlers at its end), imports the plugin
itself through ``--user-dir``, and reads its environment, standard input and
output from the request. The technique is multiprocessing's forkserver
with a preload list, which ``tests.helpers.run_distributed`` uses for the
distributed tests.

Protocol, one JSON object per line on standard input::

    {"module": ..., "argv": [...], "env": {...}, "cwd": ..., "stdin": path or null,
     "output": path, "status": path}

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
import json
import logging
import os
import runpy
import signal
import sys
import threading

import fairseq  # noqa: F401  (the imports the forked processes skip)
import torch  # noqa: F401

# Importing fairseq configures the root logger (``logging.basicConfig(level=DEBUG)`` in
# fairseq/models/wav2vec/wav2vec2_classification.py; the later calls do nothing). fairseq's tools
# that import fairseq before configuring logging run with that; every other module starts with the
# root logger of a fresh interpreter: fairseq_cli.train configures it first, and this package
# imports fairseq holding the configuration off.
IMPORT_FAIRSEQ_FIRST = {"fairseq_cli.eval_lm", "fairseq_cli.generate", "fairseq_cli.interactive",
                        "fairseq_cli.validate", "fairseq_cli.preprocess"}


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
