"""Calling an op: through its torch custom op when torch is tracing, directly otherwise.

torch.library custom ops make Tilecraft's ops work under torch.compile(fullgraph=True), fake
tensors and export, but their eager dispatch costs tens of microseconds per call, which would
dominate a decode step. Eager calls (CUDA-graph capture included) go straight to the
implementation; anything that traces goes through the custom op and its fake implementation.
"""

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode


def call(custom_op, impl, *args):
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return custom_op(*args)
    for a in args:
        if isinstance(a, torch.Tensor) and type(a) is not torch.Tensor:  # FakeTensor, subclasses
            return custom_op(*args)
    return impl(*args)
