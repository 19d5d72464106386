"""Hardware-in-the-loop rig: network namespaces with loss and partitions (netlab), scenarios with faults, scoring and
reports (``python -m hil run``), and benchmarks run across them (``swarm-bench``)."""

from __future__ import annotations
