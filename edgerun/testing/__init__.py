"""Test and rig tooling: fault injection, test control, free ports, ground-truth scoring, JSON Lines reading.

Used by tests, the benchmarks, HIL rigs and the demos; never by a production config.
"""
