"""The node's face to its supervisor: health state, HTTP probes and metrics, systemd notify."""
