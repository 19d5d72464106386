"""Fault injection for tests, the benchmarks and HIL rigs; never used by a production config."""
