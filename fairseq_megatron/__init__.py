"""fairseq_megatron: Megatron-style tensor-model-parallel language models for fairseq.

Load with ``--user-dir $(python -m fairseq_megatron.user_dir)``. Importing the
package makes fairseq's ``--model-parallel-size`` work (see
:mod:`fairseq_megatron.fairseq_integration`) and registers the
``model_parallel_transformer_lm`` model, the ``transformer_lm_megatron`` and
``transformer_lm_megatron_11b`` archs and the ``vocab_parallel_cross_entropy``
criterion.
"""

import os

from fairseq_megatron import fairseq_integration

fairseq_integration.install()

from fairseq_megatron import criterions, models  # noqa: E402,F401  (registers names)

USER_DIR = os.path.dirname(os.path.abspath(__file__))
"""The path to pass as fairseq's ``--user-dir``."""
