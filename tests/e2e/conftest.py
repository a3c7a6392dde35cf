"""The trained checkpoint the end-to-end tests share: one small run of
fairseq-train at model-parallel size 2 on text from the standard library's
docstrings, made once per pytest worker (session scope). Tests that change a
checkpoint copy it first."""

import pytest

from tests.e2e.common import binarized_corpus, train_args
from tests.helpers import fairseq


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    data, ckpt = binarized_corpus(root, max_bytes=300_000), str(root / "ckpt")
    _, log = fairseq("train", train_args(data, ckpt, max_update=4), nproc=2)
    return {"root": root, "data": data, "ckpt": ckpt, "first_log": log}
