"""A save of model parts as a commit (fairseq_megatron/checkpoint/commit.py),
in a world of 2 ranks, with a fault injected at each step of a save: a
failed write on one rank, a failed manifest, a rank stopped before its
rename. Afterwards a reader (``open_save``, as every tool opens a
checkpoint) gets one whole save without writing anything: the previous one
where the fault came before the commit point, the new one after it (read
through the staged name a rank left); never a mix. The writer's next save
of the name leaves its own files and nothing else."""

import errno
import os

import pytest
import torch

from fairseq_megatron.checkpoint.part_files import check_complete, find_part_files, part_path, update_count
from fairseq_megatron.checkpoint.reading import open_save
from fairseq_megatron.checkpoint.names import staged_name
from tests.helpers import init_model_parallel, run_distributed
from tests.support.full_disk import FullDiskAt


class _Stopped(Exception):
    """The injected fault."""


def _commit_worker(rank, world_size, root, fault, then_save=False):
    from fairseq_megatron.checkpoint.layout import CheckpointError
    from fairseq_megatron.checkpoint import saving

    init_model_parallel(world_size)
    path = os.path.join(root, "checkpoint_last.pt")
    part = part_path(path, rank)

    def save(token, updates, write=torch.save):
        state = {"model": {"w": torch.full((2,), float(updates))}, "optimizer_history": [{"num_updates": updates}],
                 "extra_state": {"save": {"token": token, "updates": updates}}}
        saving.save_committed(lambda staged: write(state, staged[part]), [part], path, token, updates)

    save("a" * 32, 5)
    with open(staged_name(part, "d" * 32), "wb") as f:  # left by a save killed before its commit point
        f.write(b"PK\x03\x04 partial")

    write, real_replace = torch.save, os.replace
    if fault == "write" and rank == 1:
        write = FullDiskAt(torch.save, call=1)
    if fault == "manifest" and rank == 0:
        def no_space(*args):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        saving.write_manifest = no_space
    if fault == "rename" and rank == 1:
        def stopped_before_the_rename(src, dst):
            if src.startswith(part + ".staged-"):
                raise _Stopped()
            return real_replace(src, dst)
        os.replace = stopped_before_the_rename
    try:
        save("b" * 32, 8, write)
        said = None
    except (CheckpointError, OSError, _Stopped) as e:
        said = f"{type(e).__name__}: {e}"
    finally:
        os.replace = real_replace
    if then_save:  # the next save of the name (fairseq-train's next update)
        save("c" * 32, 9)
    return said


@pytest.mark.parametrize("fault", ["none", "write", "manifest", "rename"])
def test_a_save_of_model_parts_is_all_or_nothing(tmp_path, fault):
    root = str(tmp_path / "ckpt")
    os.makedirs(root)
    said = run_distributed(_commit_worker, 2, tmp_path, root, fault)
    path = os.path.join(root, "checkpoint_last.pt")
    stale = [staged_name(part_path(path, r), "d" * 32) for r in (0, 1)]
    if fault == "none":
        assert said == [None, None]
    elif fault == "write":  # before the commit point: both ranks stop, nothing of the new save is left
        assert said[1] == "OSError: [Errno 28] No space left on device", said
        assert said[0].startswith(f"CheckpointError: saving {path} failed on model-parallel rank 1: "), said
    elif fault == "manifest":
        assert said[0].startswith("OSError: [Errno 28]") and said[1].startswith(
            f"CheckpointError: committing the save of {path} failed on model-parallel rank 0: "), said
    else:  # after the commit point: rank 0 renamed its part, rank 1 was stopped before it
        assert said == [None, "_Stopped: "], said
    expected = 5 if fault in ("write", "manifest") else 8
    before = sorted(os.listdir(root))
    with open_save(path) as opened:  # reads the staged part a rank left, renames nothing
        assert [update_count(torch.load(opened.source(f), weights_only=False)) for f in opened.every_file] == \
            [expected, expected]
    assert sorted(os.listdir(root)) == before
    # what a kill after the commit point leaves staged stays until the next save: rank 1's part
    unfinished = [os.path.basename(staged_name(part_path(path, 1), "b" * 32))] if fault == "rename" else []
    assert [f for f in before if ".staged-" in f and os.path.join(root, f) not in stale] == unfinished, before
    # a killed save's staged files are removed by each rank that completes a later save of the name
    removed = {"none": [True, True], "write": [False, False], "manifest": [False, False], "rename": [True, False]}
    assert [not os.path.exists(f) for f in stale] == removed[fault]


def test_the_next_save_replaces_an_unfinished_one(tmp_path):
    """A save stopped after its commit point, before rank 1's rename, then
    the writer's next save of the name: its files under their final names,
    each of that save, and no staged file of either earlier save left."""
    root = str(tmp_path / "ckpt")
    os.makedirs(root)
    assert run_distributed(_commit_worker, 2, tmp_path, root, "rename", True) == [None, "_Stopped: "]
    path = os.path.join(root, "checkpoint_last.pt")
    assert sorted(os.listdir(root)) == ["checkpoint_last-model_part-0.pt", "checkpoint_last-model_part-1.pt",
                                        "checkpoint_last.pt.manifest.json"]
    files = find_part_files(path)
    check_complete(files)
    assert [update_count(torch.load(f, weights_only=False)) for f in files] == [9, 9]


def test_parts_that_are_not_the_save_their_manifest_records_are_refused(tmp_path):
    """Two parts of one update but from two runs (a part copied over from
    another run's save): equal update counts, and only the tokens the
    manifest records tell them apart."""
    from fairseq_megatron.checkpoint.commit import write_manifest
    from fairseq_megatron.checkpoint.layout import CheckpointError

    path = str(tmp_path / "checkpoint_last.pt")
    for rank, token in enumerate(("a" * 32, "c" * 32)):
        torch.save({"model": {}, "optimizer_history": [{"num_updates": 8}],
                    "extra_state": {"save": {"token": token, "updates": 8}}}, part_path(path, rank))
    write_manifest(path, "a" * 32, 8, [part_path(path, 0), part_path(path, 1)])
    with pytest.raises(CheckpointError) as raised:
        check_complete(find_part_files(path))
    assert str(raised.value) == (f"the model parts of {path} are not one save: checkpoint_last-model_part-1.pt not "
                                 f"of the save its manifest records (update 8)")
