"""Stage 4 of the pipeline: what an engine keeps for its lifetime.

Attention groups (``attn_group``, ``group_builder``), the block pool
(``block_pool``), the block zeroer (``zeroer``) and the ``KVCache`` facade
(``kv_cache``) that wires them from one negotiation.
"""
