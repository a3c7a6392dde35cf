"""The ``vocab_parallel_cross_entropy`` criterion: fairseq's cross_entropy on sharded logits."""

from fairseq.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig

from fairseq_megatron.modules.vocab_parallel_cross_entropy import vocab_parallel_cross_entropy
from fairseq_megatron.models.registry import take_over_criterion


@take_over_criterion("vocab_parallel_cross_entropy", CrossEntropyCriterionConfig)
class VocabParallelCrossEntropyCriterion(CrossEntropyCriterion):
    """Summed token cross entropy (nats), computed from each rank's
    ``(B, T, V / N)`` logits without gathering the vocabulary.

    Same loss, ``sample_size`` (tokens, or sentences with ``--sentence-avg``),
    logging outputs and base-2 metrics as fairseq's ``cross_entropy``
    (``fairseq/criterions/cross_entropy.py``), which it subclasses. Padding
    targets are ignored. Mirrors fairseq's
    ``model_parallel/criterions/vocab_parallel_cross_entropy.py``.
    Works with any model whose forward accepts ``gather_logits=False``
    (``model_parallel_transformer_lm``). Sentences are counted from the
    sample's ``nsentences`` (fairseq's criterion counts the target's rows):
    under context parallelism the ranks of a sequence share its rows, and
    their trainer counts each row on one of them.
    """

    def compute_loss(self, model, net_output, sample, reduce=True):
        target = model.get_targets(sample, net_output)
        decoder = model.decoder
        loss = vocab_parallel_cross_entropy(
            net_output[0], target, ignore_index=self.padding_idx, group=decoder.tensor_parallel,
            compiled=getattr(decoder, "compile_layers", False) and model.training,
        )
        loss = loss.sum() if reduce else loss.view(-1)
        return loss, loss

    def forward(self, model, sample, reduce=True):
        net_output = model(**sample["net_input"], gather_logits=False)
        loss, _ = self.compute_loss(model, net_output, sample, reduce=reduce)
        sentences = sample.get("nsentences", sample["target"].size(0))
        sample_size = sentences if self.sentence_avg else sample["ntokens"]
        logging_output = {
            "loss": loss.data,
            "ntokens": sample["ntokens"],
            "nsentences": sentences,
            "sample_size": sample_size,
        }
        return loss, sample_size, logging_output
