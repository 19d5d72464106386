"""Detection sinks, found by key with ``sink_class``."""
