"""CPU CI runs Triton kernels in the interpreter; a machine with a GPU compiles them.

Triton reads TRITON_INTERPRET when a kernel is decorated, so this must run before anything
imports triton (conftest.py is imported before the test modules).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
