"""Each layout's per-update losses and gradient norms against the values
stored in ``tests/assets/losses/`` (tests/support/loss_baseline.py: the run,
the tolerance and its reason; ``scripts/loss_baseline.py --write``
regenerates the files, for a change meant to move the losses).

The parity tests show that a layout trains as size 1 does; this shows that
size 1 (and each layout) still trains as it did when the files were written,
so that a change moving every layout together fails here."""

import pytest
import torch

from tests.support import loss_baseline


@pytest.mark.parametrize("name", list(loss_baseline.LAYOUTS))
def test_losses_equal_the_stored_baseline(tmp_path, name):
    record = loss_baseline.run(name, tmp_path)
    want = loss_baseline.stored(name)
    layout = loss_baseline.LAYOUTS[name]
    assert record["world_size"] == want["world_size"] == layout.world_size
    # each rank at its own coordinates (tensor, data, stage): the layout ran as named
    assert sorted(record["ranks"]) == sorted((t, d, s) for t in range(layout.tensor) for d in range(layout.data)
                                             for s in range(layout.stages) for _ in range(layout.context))
    assert len(record["losses"]) == len(want["losses"]) == loss_baseline.UPDATES
    for key in ("losses", "norms"):
        torch.testing.assert_close(torch.tensor(record[key]), torch.tensor(want[key]), **loss_baseline.TOLERANCE,
                                   msg=lambda m, key=key: f"{name} {key} moved from the stored baseline: {m}")


def test_a_changed_initialisation_falls_outside_the_tolerance(tmp_path):
    """The check can fail: the embedding initialised at 1.25 times its
    standard deviation moves size 1's losses far beyond the tolerance."""
    record = loss_baseline.run("size1", tmp_path, embedding_std_factor=1.25)
    want = loss_baseline.stored("size1")
    moved = max(abs(a - b) / abs(b) for a, b in zip(record["losses"], want["losses"]))
    assert moved > 100 * loss_baseline.TOLERANCE["rtol"], moved
