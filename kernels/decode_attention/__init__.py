"""Split-K decode attention (FlashDecoding++): the async kernel with a unified max φ and its exact
fallback, the synchronized (online softmax) kernel, and their split combine; the last two on
Pallas-Triton or Mosaic GPU (`backend=`).

  attention.py  kernel bodies, pallas_call wrapper, the jitted ops and the jnp reference
  combine.py    the synchronized kernel's split combine: kernel body, wrapper, op, jnp reference
  mosaic.py     Mosaic GPU bodies and plgpu.kernel wrappers of the synchronized kernel and the combine
  layout.py     BlockSizes (the tunables), the cache's split layout, q as the kernels' rows

The ops and their tunables are re-exported here: `from kernels import decode_attention` then
`decode_attention.decode_attention_sync(...)`, `decode_attention.BlockSizes`, ...
"""

from kernels.decode_attention.attention import (
    AsyncInfo,
    SoftmaxWindow,
    calibrate_phi,
    decode_attention_async,
    decode_attention_reference,
    decode_attention_sync,
    decode_attention_sync_rows,
)
from kernels.decode_attention.combine import combine_rows, combine_splits
from kernels.decode_attention.layout import BlockSizes, query_rows
from kernels.decode_attention.mosaic import fits as mosaic_fits

__all__ = [
    "AsyncInfo",
    "BlockSizes",
    "SoftmaxWindow",
    "calibrate_phi",
    "combine_rows",
    "combine_splits",
    "decode_attention_async",
    "decode_attention_reference",
    "decode_attention_sync",
    "decode_attention_sync_rows",
    "mosaic_fits",
    "query_rows",
]
