"""Signed over-the-air model updates: keys, manifests, deltas, the A/B store and the updater.

Trust runs root keys (offline, provisioned on the node) -> a signed list of
release keys (``keys.json``) -> signed release manifests -> payload hashes.
Key and signature files are minisign's, so ``minisign -S``/``-V`` interoperate.
"""
