"""Whether a batch holds padding is answered on the host by our trainer
(fairseq_megatron.modules.padding), and the decoder takes that answer."""

import types

import torch

from fairseq_megatron.fairseq_integration.trainer import MegatronTrainer
from fairseq_megatron.modules.padding import has_padding, mark_padding
from tests.helpers import build_model, make_batch

PAD = 1


def _prepare(sample):
    """MegatronTrainer._prepare_sample on a CPU trainer: no device copy."""
    dictionary = types.SimpleNamespace(pad=lambda: PAD)
    trainer = types.SimpleNamespace(
        cfg=types.SimpleNamespace(common=types.SimpleNamespace(on_cpu_convert_precision=False)),
        cuda=False, tpu=False, _dummy_batch=None, _fp_convert_sample=lambda s: s, context_split=None,
        task=types.SimpleNamespace(source_dictionary=dictionary),
    )
    prepared, is_dummy = MegatronTrainer._prepare_sample(trainer, sample)
    assert not is_dummy
    return prepared["net_input"]["src_tokens"]


def test_mark_is_read_only_while_valid():
    tokens = torch.tensor([[5, 6, 7], [8, 9, 10]])
    mark_padding(tokens, PAD, True)  # deliberately wrong: shows the mark is what answers
    assert has_padding(tokens, PAD)
    assert not has_padding(tokens, padding_idx=0)  # another padding index: computed
    tokens[0, 0] = 11  # changed in place: the mark is stale, computed again
    assert not has_padding(tokens, PAD)
    tokens[1, 2] = PAD
    assert has_padding(tokens, PAD)
    assert has_padding(torch.tensor([[PAD]]), PAD) and not has_padding(torch.tensor([[2]]), PAD)  # no mark


def test_prepare_sample_marks_the_batch():
    padded = _prepare({"net_input": {"src_tokens": torch.tensor([[5, 6, 7], [8, PAD, PAD]])}})
    full = _prepare({"net_input": {"src_tokens": torch.tensor([[5, 6, 7], [8, 9, 10]])}})
    assert getattr(padded, "_fairseq_megatron_padding") == (PAD, padded._version, True)
    assert getattr(full, "_fairseq_megatron_padding") == (PAD, full._version, False)


def test_decoder_takes_the_mark():
    """A right-padded batch: marked correctly, the output equals the unmarked
    (computed) one; marked wrongly as holding no padding, the padding
    positions attend to each other (their outputs change) while the real
    tokens' outputs, which never see later positions, stay the same."""
    model, dictionary = build_model(1, seed=0)
    model.eval()
    tokens, _ = make_batch(dictionary, pad_tail=3)
    pad_rows = tokens.eq(dictionary.pad())
    assert pad_rows.any()
    with torch.no_grad():
        computed = model(tokens.clone())[0]
        marked = tokens.clone()
        mark_padding(marked, dictionary.pad(), True)
        same = model(marked)[0]
        wrong = tokens.clone()
        mark_padding(wrong, dictionary.pad(), False)
        unmasked = model(wrong)[0]
    torch.testing.assert_close(same, computed, rtol=0, atol=0)
    # 1e-6: with and without a mask attention may take different kernels,
    # which sum in different orders (fp32).
    torch.testing.assert_close(unmasked[~pad_rows], computed[~pad_rows], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(unmasked[pad_rows], computed[pad_rows], atol=1e-4)
