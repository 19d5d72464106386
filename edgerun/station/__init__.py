"""``edgerun station``: the fleet on one page (map, nodes, objects, events) and rollout control, fed from MQTT."""
