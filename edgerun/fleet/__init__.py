"""The node's side of the swarm: ground claims from detections, fleet objects, member metadata, rollouts."""
