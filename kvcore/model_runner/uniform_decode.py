"""The seed's uniform-decode batch checks, for an engine's model runner (kvcore itself uses neither).

SPEC §3 exports them from ``kvcore``: whether a batch's shape is uniform, and
the tokens per request of a uniform decode batch (a CUDA-graph candidate).
"""

from __future__ import annotations


def is_uniform_query_len(num_reqs: int, num_tokens: int, max_query_len: int) -> bool:
    """Whether the batch's shape says every request has ``max_query_len`` tokens.

    Only the shape is tested: a prompt chunk may look like a decode batch, so
    classify scheduled batches with :func:`get_uniform_decode_token_count`.
    """
    return num_reqs > 0 and num_tokens == num_reqs * max_query_len


def get_uniform_decode_token_count(
    num_reqs: int, num_tokens: int, max_query_len: int, decode_graph_eligible: bool
) -> int | None:
    """Tokens per request of a uniform decode batch; None for any other batch."""
    if decode_graph_eligible and is_uniform_query_len(num_reqs, num_tokens, max_query_len):
        return max_query_len
    return None
