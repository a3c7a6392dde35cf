"""fairseq's model-parallel names resolve to this package; the Megatron-11b
recipe parses with only --user-dir added; the arch dims are fairseq's."""




def test_importing_the_package_leaves_logging_and_warnings_alone():
    """In a fresh process (our command-line tools, a program using the hub)
    importing the package, and with it fairseq, leaves the root logger as
    Python starts it: fairseq's import set it to DEBUG with a handler (every
    library's debug messages then reached stderr), logged "Please install
    tensorboardX", and fairscale warned twice about torch.cuda.amp. In
    fairseq's own tools, which configure logging first, nothing changes."""
    import subprocess
    import sys

    probe = ("import logging, fairseq_megatron; root = logging.getLogger(); "
             "print(logging.getLevelName(root.level), len(root.handlers))")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert run.stdout == "WARNING 0\n", run.stdout
    for noise in ("tensorboardX", "torch.cuda.amp.custom_fwd"):
        assert noise not in run.stderr, run.stderr
    probe = ("import logging; logging.basicConfig(level=logging.INFO); import fairseq_megatron; "
             "root = logging.getLogger(); print(logging.getLevelName(root.level), len(root.handlers))")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert run.stdout == "INFO 1\n", (run.stdout, run.stderr)


def test_importing_the_package_does_not_import_torch_pipelining():
    """torch.distributed.pipelining is slow to import, and every
    process of every fairseq tool imports this package; only a pipelined
    training run needs it, and imports it when it builds its schedule."""
    import subprocess
    import sys

    probe = ("import sys, fairseq_megatron; from fairseq_megatron.fairseq_integration import trainer; "
             "print('torch.distributed.pipelining' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert run.stdout == "False\n", (run.stdout, run.stderr[-2000:])
