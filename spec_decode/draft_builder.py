"""The DraftBuilder protocol (ROCm/ATOM#631).

A draft with its own KV layout contributes it to the pool through the same three hooks the
target's attention builder implements: `compute_block_bytes()`, `allocate_kv_cache_tensors(num_blocks)`
(namespaced keys such as `eagle3_kv_cache`) and `build_kv_cache_tensor(module)` (None for modules
it does not own). The runner sizes, allocates and binds the pool only through builders, so its
KV code knows no draft layout; draft and target share block size, block ids and block tables, and a block costs the sum of all
builders' per-block bytes. The protocol is defined once, beside its paged implementation in
model_ops; this is its name on the speculative-decoding side.
"""
from model_ops.attention.kv_builder import KVCacheBuilder as DraftBuilder
from model_ops.attention.kv_builder import PagedKVCacheBuilder

__all__ = ["DraftBuilder", "PagedKVCacheBuilder"]
