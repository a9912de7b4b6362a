"""Stage 4 of the pipeline, what an engine keeps for its lifetime: attention groups, the block
pool, the block zeroer and the ``KVCache`` facade that wires them from one negotiation."""
