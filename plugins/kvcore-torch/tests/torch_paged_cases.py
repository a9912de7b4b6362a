"""Test helpers: kvcore's conformance kit (kvcore.testing), with caches on the CPU."""

import functools

from kvcore import testing
from kvcore.testing import LAYOUTS, SPLITTABLE, PagedBatch, dense_reference, make_batch

build_cache = functools.partial(testing.build_cache, device="cpu")

__all__ = ["LAYOUTS", "SPLITTABLE", "PagedBatch", "build_cache", "dense_reference", "make_batch"]
