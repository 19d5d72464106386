"""Hardware-in-the-loop rig: network namespaces with loss and partitions (netlab), benchmarks run across them."""

from __future__ import annotations
