"""vLLM's model-runner helpers, kept with their names: binding caches and KV sharing (``binding``), the
multimodal ones (``multimodal``, unused by kvcore itself) and here the uniform-decode checks."""


def is_uniform_query_len(num_reqs: int, num_tokens: int, max_query_len: int) -> bool:
    """Whether the batch's shape says every request has ``max_query_len`` tokens (shape only:
    a prompt chunk may look like a decode batch; see ``get_uniform_decode_token_count``)."""
    return num_reqs > 0 and num_tokens == num_reqs * max_query_len


def get_uniform_decode_token_count(
    num_reqs: int, num_tokens: int, max_query_len: int, decode_graph_eligible: bool
) -> int | None:
    """Tokens per request of a uniform decode batch (a CUDA-graph candidate), else None."""
    if decode_graph_eligible and is_uniform_query_len(num_reqs, num_tokens, max_query_len):
        return max_query_len
    return None
