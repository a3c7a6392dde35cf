"""Shared test helpers: small models, and N CPU processes with gloo."""

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from argparse import Namespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fairseq.data import Dictionary

import fairseq_megatron  # noqa: F401  (registers archs, installs the mpu module)
from fairseq_megatron.models.model_parallel_transformer_lm import (
    ModelParallelTransformerLanguageModel,
    transformer_lm_megatron_11b,
)
from fairseq_megatron.parallel import parallel_state
from fairseq_megatron.parallel.rng_tracker import get_rng_tracker
from fairseq_megatron.training.parallelize import parallelize
from tests.preloaded import READ_ONLY_UNAVAILABLE

# Small dims that still exercise every split: 8 heads and FFN 128 divide by 1, 2 and 4.
DIMS = dict(
    decoder_layers=2,
    decoder_embed_dim=32,
    decoder_ffn_embed_dim=128,
    decoder_attention_heads=8,
)
# 4 specials + 60 words = 64 symbols, a multiple of 8 * 4: the padded
# vocabulary is the same at model-parallel sizes 1, 2 and 4.
VOCAB_WORDS = 60
SEQ_LEN = 16


class LMTask:
    """The two attributes build_model reads from a fairseq task."""

    def __init__(self, dictionary):
        self.source_dictionary = dictionary
        self.target_dictionary = dictionary


def make_dictionary(num_words: int = VOCAB_WORDS) -> Dictionary:
    d = Dictionary()
    for i in range(num_words):
        d.add_symbol(f"w{i}")
    return d


def model_args(model_parallel_size: int, **overrides) -> Namespace:
    args = Namespace(
        **DIMS,
        share_decoder_input_output_embed=True,
        dropout=0.0,
        attention_dropout=0.0,
        model_parallel_size=model_parallel_size,
        tokens_per_sample=SEQ_LEN,
        max_target_positions=SEQ_LEN,
    )
    for k, v in overrides.items():
        setattr(args, k, v)
    transformer_lm_megatron_11b(args)
    return args


def parallelized(model, args):
    """:func:`~fairseq_megatron.training.parallelize.parallelize` of ``model``
    for this process's groups, with the model options ``args`` and fairseq's
    default data parallelism (what ``MegatronTrainer`` applies, without a trainer)."""
    return parallelize(model, parallel_state.get_process_groups(), Namespace(model=args, distributed_training=None))


def build_model(model_parallel_size: int, seed: int = 0, **overrides):
    """Our model at the current group's size, initialised from ``seed``,
    with what training applies to it from outside (``MegatronTrainer`` does
    the same: :func:`fairseq_megatron.training.parallelize.parallelize`):
    activation checkpointing, compilation and autocast where the overrides
    ask for them."""
    torch.manual_seed(seed)
    dictionary = make_dictionary()
    args = model_args(model_parallel_size, **overrides)
    model = ModelParallelTransformerLanguageModel.build_model(args, LMTask(dictionary))
    parallelized(model, args)
    return model, dictionary


def make_batch(dictionary: Dictionary, batch: int = 3, seq_len: int = SEQ_LEN, seed: int = 1, pad_tail: int = 3):
    """Random tokens ``(B, T)`` and next-token targets; the last row ends in
    ``pad_tail`` padding positions (right padding, as fairseq's LM batches)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(dictionary.nspecial, len(dictionary), (batch, seq_len + 1), generator=g)
    if pad_tail:
        tokens[-1, -pad_tail:] = dictionary.pad()
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


# ---------------------------------------------------------------- processes


def _entry(rank, world_size, init_file, out_dir, worker, args, environ):
    os.environ.clear()  # the test process's environment now, as a spawned process would have it
    os.environ.update(environ)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        result = worker(rank, world_size, *args)
        result = {"rank": rank, "world_size": dist.get_world_size(), "result": result}
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        result = {"rank": rank, "error": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_distributed(worker, world_size: int, tmp_path, *args):
    """Run ``worker(rank, world_size, *args)`` in ``world_size`` CPU processes.

    Returns the per-rank return values (rank order) after checking that
    every rank ran inside a torch.distributed world of exactly that size.

    On a machine without a GPU the processes are forked from a fork server
    that imported this module (torch, fairseq and the plugin) once per
    pytest worker and did nothing else: as fresh as spawned processes,
    without each paying the seconds of those imports (the suite is
    CPU-bound on 2 cores). With a GPU they are
    spawned, as before: CUDA must not have been touched in a process that
    is forked, and importing fairseq may touch it. Each process takes the
    caller's environment as it is now.
    """
    init_file = os.path.join(str(tmp_path), "dist_init")
    out_dir = os.path.join(str(tmp_path), "results")
    os.makedirs(out_dir, exist_ok=True)
    if torch.cuda.is_available():
        start_method = "spawn"
    else:
        start_method = "forkserver"
        mp.set_forkserver_preload([__name__])  # read when the server starts, at the first call
    mp.start_processes(_entry, args=(world_size, init_file, out_dir, worker, args, dict(os.environ)),
                       nprocs=world_size, join=True, start_method=start_method)
    outcomes = []
    for rank in range(world_size):
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
            outcomes.append(pickle.load(f))
    # every failed rank's traceback: the first is often a peer's lost connection
    failed = [f"rank {r['rank']} failed:\n{r['error']}" for r in outcomes if "error" in r]
    assert not failed, "\n".join(failed)
    for rank, r in enumerate(outcomes):
        assert r["world_size"] == world_size, f"rank {rank} ran in a world of {r['world_size']}"
    return [r["result"] for r in outcomes]


def init_model_parallel(model_parallel_size: int, seed: int = 0):
    parallel_state.initialize_model_parallel(model_parallel_size)
    from fairseq_megatron.parallel.rng_tracker import model_parallel_manual_seed

    model_parallel_manual_seed(seed)
    assert parallel_state.get_tensor_model_parallel_world_size() == model_parallel_size
    return get_rng_tracker()


# ---------------------------------------------------------------- command lines

ENV = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")


def fairseq(tool, args, nproc=None, check=True, timeout=300, stdin=None, cwd=None, preloaded=True, read_only=()):
    """Run ``fairseq_cli.<tool>`` (or the module ``tool`` when its name has a
    dot) as ``nproc`` ranks (or one process without ranks), ``stdin`` as its
    standard input, in directory ``cwd``; return (rc, output), the ranks'
    outputs in one stream as torchrun gives them. With ``check`` the run must
    succeed; without, every rank runs until it exits by itself (torchrun
    stops the others at the first one's error exit, and the tests that check
    each rank's own error line raced it: on 2 cores one rank can lag another
    by seconds).

    ``preloaded``: the processes are forked from :mod:`tests.preloaded`
    (torch and fairseq imported once per pytest worker) with the
    environment torchrun gives its ranks; otherwise they are fresh
    interpreters, under torchrun when ``check``.

    ``read_only``: directories the processes see on a read-only file system
    (:mod:`tests.preloaded`); the test is skipped where this machine cannot
    mount them so."""
    module = tool if "." in tool else f"fairseq_cli.{tool}"
    if read_only and not (preloaded and _Preloaded.usable()):
        import pytest

        pytest.skip("read-only mounts are made by the preloaded processes, not used here")
    if preloaded and _Preloaded.usable():
        return _Preloaded.run(module, args, nproc, check, timeout, stdin, cwd, [os.fspath(d) for d in read_only])
    cmd = [sys.executable]
    module = ["-m", module] + args
    if nproc and not check:
        return _ranks_to_their_end(cmd + module, nproc, timeout, stdin, cwd)
    if nproc:
        cmd += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    cmd += module
    proc = subprocess.run(cmd, input=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
                          timeout=timeout, cwd=cwd)
    if check:
        assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.returncode, proc.stdout


def free_port() -> int:
    """A TCP port on this machine that no process listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_environments(nproc):
    """What torchrun puts in each of ``nproc`` ranks' environment (and fairseq and the plugin read to join them)."""
    env = dict(ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc),
               LOCAL_WORLD_SIZE=str(nproc))
    return [dict(env, RANK=str(rank), LOCAL_RANK=str(rank)) for rank in range(nproc)]


def _ranks_to_their_end(cmd, nproc, timeout, stdin, cwd):
    """``cmd`` as ``nproc`` fresh ranks, each run until it exits by itself:
    (the first non-zero exit status or 0, the ranks' outputs one after the
    other). Error lines carry torch's ``[rankN]:`` prefix as under
    torchrun (its excepthook, installed with the process group)."""
    # Outputs to files, not pipes: a rank blocked on a full pipe that nobody
    # reads yet would stall the collectives of the others.
    outputs = [tempfile.TemporaryFile("w+") for _ in range(nproc)]
    procs = []
    try:
        for env, output in zip(_rank_environments(nproc), outputs):
            procs.append(subprocess.Popen(
                cmd, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL, stdout=output,
                stderr=subprocess.STDOUT, text=True, cwd=cwd, env=env))
            if stdin is not None:
                procs[-1].stdin.write(stdin)
                procs[-1].stdin.close()
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = []
    for output in outputs:
        output.seek(0)
        text.append(output.read())
        output.close()
    rc = next((proc.returncode for proc in procs if proc.returncode != 0), 0)
    return rc, "".join(text)


class _Preloaded:
    """This pytest worker's :mod:`tests.preloaded` server, started at the first use."""

    server = None

    @staticmethod
    def usable():
        return not torch.cuda.is_available()  # with a GPU, processes that may use it are not forked

    @classmethod
    def _fork(cls, request):
        if cls.server is None or cls.server.poll() is not None:
            cls.server = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "preloaded.py")],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                          text=True, env=ENV)
        cls.server.stdin.write(json.dumps(request) + "\n")
        cls.server.stdin.flush()
        return int(cls.server.stdout.readline())

    @classmethod
    def run(cls, module, args, nproc, check, timeout, stdin, cwd, read_only=()):
        with tempfile.TemporaryDirectory() as tmp:
            stdin_path = None
            if stdin is not None:
                stdin_path = os.path.join(tmp, "stdin")
                with open(stdin_path, "w") as f:
                    f.write(stdin)
            outputs = [os.path.join(tmp, f"output{r}") for r in range(nproc or 1)]
            if check:  # one stream, as torchrun's
                outputs = [outputs[0]] * len(outputs)
            envs = _rank_environments(nproc) if nproc else [ENV]
            tasks = []
            for rank, (env, output) in enumerate(zip(envs, outputs)):
                status = os.path.join(tmp, f"status{rank}")
                pid = cls._fork({"module": module, "argv": [os.fspath(a) for a in args], "env": env,
                                 "cwd": os.fspath(cwd or os.getcwd()), "stdin": stdin_path, "output": output,
                                 "status": status, "read_only": list(read_only)})
                tasks.append((pid, status))
            codes = cls._wait(tasks, timeout, stop_at_failure=check)
            text = []
            for output in dict.fromkeys(outputs):
                with open(output) as f:
                    text.append(f.read())
        text = "".join(text)
        rc = next((code for code in codes if code != 0), 0)
        if rc == 77 and READ_ONLY_UNAVAILABLE in text:
            import pytest

            pytest.skip(text[text.index(READ_ONLY_UNAVAILABLE):].splitlines()[0])
        if check:
            assert rc == 0, text[-4000:]
        return rc, text

    @staticmethod
    def _wait(tasks, timeout, stop_at_failure):
        """Each task's exit status (-9 where it was killed): at the deadline, or (``stop_at_failure``,
        as torchrun does) once one has failed, the others are killed with what they started."""
        deadline = time.monotonic() + timeout
        codes = [None] * len(tasks)
        while None in codes:
            for i, (pid, status) in enumerate(tasks):
                if codes[i] is None:
                    codes[i] = _exit_status(pid, status)
            stop = time.monotonic() > deadline or (stop_at_failure and any(codes))
            if stop and None in codes:
                for i, (pid, _) in enumerate(tasks):
                    if codes[i] is None:
                        _kill_group(pid)
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(str(tasks), timeout)
            time.sleep(0.02)
        return codes


def _exit_status(pid, status):
    """The exit status a process of the server wrote, -9 if it ended without writing one, None while it runs."""
    try:
        os.kill(pid, 0)
        running = True
    except ProcessLookupError:
        running = False
    try:
        with open(status) as f:  # renamed into place whole, before the process exits
            return int(f.read())
    except FileNotFoundError:
        return None if running else -9


def _kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------- fairseq's trainer


def build_trainer(save_dir, fused: bool, model_parallel_size: int = 1, extra_args=(), cpu: bool = True):
    """The trainer fairseq-train builds (our ``MegatronTrainer``, at any
    model-parallel size; the caller has started torch.distributed) for a
    2 x 32 ``transformer_lm_megatron_11b`` with ``--bf16-autocast`` on
    fairseq's dummy_lm task, and its batch iterator. ``fused`` puts our
    FusedAdamW inside fairseq's Adam on CPU, where the trainer keeps
    fairseq's own (on a GPU it builds the fused one for the fp32 weights)."""
    import fairseq_cli.train
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from fairseq_megatron.training.fused_adam import FairseqFusedAdam

    os.makedirs(save_dir, exist_ok=True)  # fairseq-train creates it; crash.pt goes there
    init_model_parallel(model_parallel_size, seed=3)
    args = options.parse_args_and_arch(options.get_training_parser(), input_args=[
        "--task", "dummy_lm", "--tokens-per-sample", "16", "--dict-size", "60", "--batch-size", "2",
        "--arch", "transformer_lm_megatron_11b", "--decoder-layers", "2", "--decoder-embed-dim", "32",
        "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "4", "--bf16-autocast",
        "--criterion", "vocab_parallel_cross_entropy", "--optimizer", "adam", "--lr", "1e-3",
        "--clip-norm", "1.0", "--seed", "3", "--save-dir", str(save_dir),
        "--model-parallel-size", str(model_parallel_size), *(["--cpu"] if cpu else []), *extra_args])
    cfg = convert_namespace_to_omegaconf(args)
    if model_parallel_size > 1:  # what fairseq's distributed_init adds
        cfg.checkpoint.checkpoint_suffix = f"-model_part-{dist.get_rank()}"
    task = tasks.setup_task(cfg.task)
    # fairseq_cli/train.py's choice: Trainer at size 1, MegatronTrainer above (both our factory)
    trainer_cls = fairseq_cli.train.Trainer if model_parallel_size == 1 else fairseq_cli.train.MegatronTrainer
    trainer = trainer_cls(cfg, task, task.build_model(cfg.model), task.build_criterion(cfg.criterion))
    wrapper = trainer.optimizer  # fairseq's FairseqAdam
    if fused and cpu:
        trainer._optimizer = FairseqFusedAdam(wrapper)
        trainer._lr_scheduler.optimizer = trainer._optimizer
    task.load_dataset("train")
    batches = trainer.get_train_iterator(epoch=1).next_epoch_itr(shuffle=False)
    return trainer, batches
