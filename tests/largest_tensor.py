"""A dispatch mode that records the most elements of any tensor an op returns on this rank (a
DTensor's local part): the chunked loss's tests check that the full logits never exist."""

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, DTensor):
                leaf = leaf._local_tensor
            if isinstance(leaf, torch.Tensor):
                self.numel = max(self.numel, leaf.numel())
        return out
