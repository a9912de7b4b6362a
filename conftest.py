"""Repository-wide pytest setup.

Without a CUDA device, Triton kernels run on CPU tensors through the Triton
interpreter, which must be switched on before triton is first imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
