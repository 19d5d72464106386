"""``edgerun bench``: pipeline (``pipeline``), sinks (``sinks``), failover (``failover``), OTA (``ota``).

Every figure that matters is a ratio of measurements taken side by side in one run,
so results compare across noisy, shared machines.
"""
