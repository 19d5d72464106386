"""Offload: a node sends frames to a neighbour that serves the same model and gets detections back.

``protocol`` (the wire), ``codec`` (the image on it), ``client`` (the origin's side), ``server`` (the helper's);
docs/offload.md says how a node chooses a helper and falls back.
"""
