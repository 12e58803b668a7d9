"""Counting the aten ops a piece of code issues (an independent observer of how many copies and index
ops a move launches: every op torch dispatches passes through it, on any device)."""

from __future__ import annotations

import collections

from torch.utils._python_dispatch import TorchDispatchMode

# The ops that could move a tensor's bytes (rather than build ids or views)
DATA_OPS = frozenset({"index_select", "index_copy_", "index_copy", "index_put_", "index", "copy_", "_to_copy",
                      "gather", "scatter", "scatter_", "take", "put_"})


class AtenOps(TorchDispatchMode):
    """Counts, by name, the aten ops that run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def data_ops(self) -> dict[str, int]:
        """The counts of the ops that could move bytes."""
        return {name: count for name, count in self.counts.items() if name in DATA_OPS}
