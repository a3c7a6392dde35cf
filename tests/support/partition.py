"""The layout of fairseq's ModelParallelTransformerDecoder, by state-dict
name: the independent reference the tests hold the parameters' own
attributes (and what is computed from them) against.

======================================  =====================
key (under ``decoder.``)                split along
======================================  =====================
embed_tokens.weight                     dim 0 (vocabulary)
output_projection.weight                dim 0 (vocabulary)
layers.N.self_attn.{q,k,v}_proj.*       dim 0 (output)
layers.N.fc1.*                          dim 0 (output)
layers.N.self_attn.out_proj.weight      dim 1 (input)
layers.N.fc2.weight                     dim 1 (input)
everything else                         replicated
======================================  =====================
"""

import re
from typing import Dict, Optional

_VOCAB = re.compile(r"(^|\.)(embed_tokens|output_projection)\.weight$")
_COLUMN = re.compile(r"(^|\.)(self_attn\.[qkv]_proj|fc1)\.(weight|bias)$")
_ROW = re.compile(r"(^|\.)(self_attn\.out_proj|fc2)\.weight$")


def expected_partition_dim(key: str) -> Optional[int]:
    """The dimension along which model parts split tensor ``key``; None if replicated."""
    if _VOCAB.search(key) or _COLUMN.search(key):
        return 0
    if _ROW.search(key):
        return 1
    return None


def expected_partition_dims(state: Dict) -> Dict[str, Optional[int]]:
    """:func:`expected_partition_dim` of every key of ``state``."""
    return {key: expected_partition_dim(key) for key in state}
