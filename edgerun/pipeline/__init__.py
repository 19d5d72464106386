"""The bounded, zero-copy frame pipeline: pool, hand-offs, stage threads, statistics."""
