"""Offload: a node sends frames to a neighbour that serves the same model and gets detections back.

``protocol`` (the wire), ``codec`` (the image on it), ``client`` (the origin's side), ``server`` (the helper's
listener), ``model_server`` (the helper's model), ``capabilities`` (what a node advertises in the swarm),
``chooser`` (which helper), ``lane`` (which frames go, and what a failure costs); docs/offload.md.
"""
