"""Test helpers: kvcore's conformance kit (kvcore.testing).

On CPU the kernels run through the Triton interpreter; with CUDA the kit's
caches live on the GPU and the kernels compile for it.
"""

from kvcore.testing import DEVICE, LAYOUTS, SPLITTABLE, PagedBatch, build_cache, dense_reference, make_batch

__all__ = ["DEVICE", "LAYOUTS", "SPLITTABLE", "PagedBatch", "build_cache", "dense_reference", "make_batch"]
