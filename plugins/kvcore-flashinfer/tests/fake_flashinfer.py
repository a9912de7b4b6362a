"""A stand-in for the ``flashinfer`` module on CPU: its paged wrappers' plan/run contract in plain torch.

``plan`` keeps copies of the page table (as FlashInfer copies it into its
buffers); ``run`` gathers each request's pages from the ``(k, v)`` views it
is given (NHD or HND, by their strides, as FlashInfer does) and attends
causally with ``window_left`` and ``sm_scale``. It lets the CPU tests check
what kvcore-flashinfer hands FlashInfer, not FlashInfer itself.
"""

from __future__ import annotations

import torch


class _Wrapper:
    def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False, **buffers):
        self.kv_layout, self.use_cuda_graph, self.buffers, self.plans = kv_layout, use_cuda_graph, buffers, 0

    def _plan(self, qo_indptr, indptr, indices, last, num_qo_heads, num_kv_heads, head_dim, page_size, *,
              window_left=-1, sm_scale=None, causal=True, **kwargs):
        if self.use_cuda_graph and len(last) != len(self.buffers["paged_kv_last_page_len_buffer"]):
            raise ValueError("The batch size should be fixed in cudagraph mode")
        self.plans += 1
        self.qo, self.indptr, self.indices, self.last = (t.clone() for t in (qo_indptr, indptr, indices, last))
        self.heads, self.page, self.window, self.scale = (num_qo_heads, num_kv_heads, head_dim), page_size, \
            window_left, sm_scale
        self.q_data_type, self.kv_data_type = kwargs.get("q_data_type"), kwargs.get("kv_data_type")

    def run(self, q, paged_kv_cache, out=None, k_scale=None, v_scale=None):
        if isinstance(paged_kv_cache, torch.Tensor):  # one [pages, 2, ...] tensor
            paged_kv_cache = (paged_kv_cache[:, 0], paged_kv_cache[:, 1])
        k_cache, v_cache = paged_kv_cache
        assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
        assert k_cache.dtype == (self.kv_data_type or k_cache.dtype)  # planned for what it reads
        if self.kv_layout == "HND":
            k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
        hq, hk, _ = self.heads
        out = torch.empty_like(q) if out is None else out
        for i in range(len(self.last)):
            pages = self.indices[self.indptr[i] : self.indptr[i + 1]].long()
            n = (len(pages) - 1) * self.page + int(self.last[i])
            keys = k_cache[pages].flatten(0, 1)[:n].double().repeat_interleave(hq // hk, 1) * (k_scale or 1.0)
            values = v_cache[pages].flatten(0, 1)[:n].double().repeat_interleave(hq // hk, 1) * (v_scale or 1.0)
            start, end = int(self.qo[i]), int(self.qo[i + 1])
            pos = torch.arange(n - (end - start), n)[:, None]
            k_pos = torch.arange(n)[None, :]
            visible = (k_pos <= pos) & ((k_pos >= pos - self.window) if self.window >= 0 else True)
            scores = torch.einsum("rhd,khd->rhk", q[start:end].double(), keys) * self.scale
            scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
            out[start:end] = torch.einsum("rhk,khd->rhd", scores.softmax(-1), values).to(out.dtype)
        return out


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kwargs):
        qo = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
        self._plan(qo, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kwargs)


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    def plan(self, qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             **kwargs):
        self._plan(qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                   **kwargs)
