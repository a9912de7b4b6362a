"""Repository-wide pytest setup.

Without a CUDA device, Triton kernels run on CPU tensors through the Triton
interpreter, which must be switched on before triton is first imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

#: This repository's plugins (entry point names). Tests whose answers depend on which backends
#: are installed load only these, so a third-party plugin in the environment changes nothing.
OWN_PLUGINS = "torch,triton,flashinfer"


@pytest.fixture
def own_plugins(monkeypatch):
    """Only this repository's plugins load (``KVCORE_PLUGINS``), in the default manager too;
    the value is a fresh manager of them."""
    from kvcore.plugins import get_plugin_manager, registry

    forget = registry.default_plugin_manager.cache_clear  # NOTE: a test may patch the function
    monkeypatch.setenv("KVCORE_PLUGINS", OWN_PLUGINS)
    forget()
    yield get_plugin_manager()
    forget()
