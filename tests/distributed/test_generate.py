"""fairseq-generate's output over data-parallel shards: scores merged, batches interleaved;
fairseq-interactive's input over data-parallel groups.

The end-to-end runs (tests/e2e/test_generate.py) compare whole outputs of
torchrun and spawned processes with one process; here each part is checked
against fairseq's own scorer run once over all sentences."""

import io

from fairseq_megatron.fairseq_integration.generate import BatchwiseOutput, RoundWriter
from tests.helpers import init_model_parallel, run_distributed


def _dealt_worker(rank, world_size, dealt):
    """Shard ``rank`` prints its batches ``dealt[rank]`` (None: an empty
    batch) through a BatchwiseOutput into a RoundWriter over the
    data-parallel group of ``world_size`` (model-parallel size 1); returns
    what rank 0 had written when its loop reached each batch, and at the end."""
    from fairseq_megatron.parallel import parallel_state

    init_model_parallel(1)
    assert parallel_state.get_data_parallel_world_size() == world_size
    out = io.StringIO() if rank == 0 else None
    output = BatchwiseOutput(RoundWriter(out, parallel_state.get_data_parallel_group()).piece)
    print(f"config of shard {rank}", file=output)
    written_before = []
    samples = [{"id": [b], "net_input": {}} if b is not None else {} for b in dealt[rank]]
    for sample in output.batches(samples):
        written_before.append(out.getvalue() if out is not None else None)
        if "net_input" in sample:
            print(f"H-{sample['id'][0]}", file=output)
    print("Generate test with beam=1: BLEU of this shard", file=output)
    return written_before, out.getvalue() if out is not None else None, output.rest(), output.sentences


def _interactive_worker(rank, world_size, path):
    import inspect

    from fairseq_cli import interactive

    from fairseq_megatron.parallel import parallel_state

    init_model_parallel(2)
    read = interactive.buffered_read  # the plugin's (installed on import), over fairseq's own
    assert inspect.unwrap(read) is not read
    return parallel_state.get_data_parallel_rank(), list(read(path, 2))


def test_batches_are_printed_in_the_order_they_were_dealt_while_generating(tmp_path):
    """5 batches over 2 shards (2 processes): shard 0 got 0, 2, 4 and shard
    1 got 1, 3 and an empty batch (fairseq's padding, no "net_input").
    Rank 0 writes what shard 0 printed before its batches, then each round
    of batches as soon as both shards finished it: when its loop reaches
    batch 2k, batches 0 .. 2k - 1 are written. The closing lines stay with
    each shard (merged by _closing_text at the end)."""
    results = run_distributed(_dealt_worker, 2, tmp_path, [[0, 2, 4], [1, 3, None]])
    written_before, written, closing, sentences = results[0]
    assert written_before == ["config of shard 0\n", "config of shard 0\nH-0\nH-1\n",
                              "config of shard 0\nH-0\nH-1\nH-2\nH-3\n"]
    assert written == "config of shard 0\nH-0\nH-1\nH-2\nH-3\nH-4\n"
    assert closing == "Generate test with beam=1: BLEU of this shard\n" and sentences == 3
    assert results[1][1] is None and results[1][3] == 2  # rank 1 writes nothing


def test_interactive_input_goes_to_data_parallel_group_0_only(tmp_path):
    """fairseq-interactive at model-parallel size 2 in a world of 4 (two
    groups): rank 0 reads the input and both ranks of its group get every
    buffer of lines; the other group's ranks get none (they computed the
    same answers, which only rank 0 prints) and still end with rank 0."""
    path = tmp_path / "prompts.txt"
    path.write_text("one\ntwo\nthree\n")
    results = run_distributed(_interactive_worker, 4, tmp_path, str(path))
    assert [group for group, _ in results] == [0, 0, 1, 1]
    assert [buffers for _, buffers in results] == [[["one", "two"], ["three"]]] * 2 + [[]] * 2
