"""Inference back ends, found by key (see ``base.ENGINE_MODULES``)."""
