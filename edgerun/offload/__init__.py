"""Offload: a node sends frames to a neighbour that serves the same model (issue #25, docs/offload.md)."""
