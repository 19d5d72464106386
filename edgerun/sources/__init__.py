"""Frame sources, found by key with ``source_class``."""
