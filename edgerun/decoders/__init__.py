"""Model output decoders, found by key with ``decoder_class``."""
