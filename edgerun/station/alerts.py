"""Alerts: a new fleet object (a person some drone found) alerts every open page until an operator acknowledges it.

Sans-I/O, like the fleet model that owns it: ``observe(obj, now)`` for each object version the model shows,
``ack(object_id, by, ts)`` for an acknowledgement (this station's page, another station's retained mark, or the
store at a restart), ``take_changed()`` for the page's delta and ``take_raised()`` for the webhook. An object the
store already knew at a restart is not news: it alerts again only if nobody acknowledged it, and no webhook goes
out for it a second time. Bounded: at most ``max_alerts`` alerts (acknowledged ones are forgotten first) and as
many remembered acknowledgements.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

# What an alert carries of its object (the picture, the position, who found it) besides its own state.
ALERT_FIELDS = ("label", "score", "lat", "lon", "east_m", "north_m", "owner", "image_url")


class AlertBook:
    def __init__(self, labels: frozenset[str] | None = None, max_alerts: int = 5000, max_raised: int = 256) -> None:
        """``labels``: the object labels that alert (None: every label)."""
        self.labels = labels
        self.max_alerts, self.max_raised = max_alerts, max_raised
        self.alerts: dict[str, dict[str, Any]] = {}  # object id -> the alert, as the page shows it
        self.acks: dict[str, dict[str, Any]] = {}  # object id -> {"by", "ts"}, also for objects not seen yet
        self.counts: Counter[str] = Counter()  # raised, acked, raised_dropped (the webhook's list was full)
        self._changed: set[str] = set()
        self._raised: list[str] = []  # object ids raised since take_raised

    def wants(self, label: str) -> bool:
        return self.labels is None or label in self.labels

    def observe(self, obj: dict[str, Any], now: float, *, restored: bool = False) -> bool:
        """A version of a fleet object the model shows; True when it raised a new alert (its first version)."""
        object_id = obj["id"]
        alert = self.alerts.get(object_id)
        if alert is not None:
            update = {k: obj.get(k) for k in ALERT_FIELDS if obj.get(k) is not None and obj.get(k) != alert.get(k)}
            if update:
                alert.update(update)
                self._changed.add(object_id)
            return False
        if not self.wants(str(obj.get("label", ""))):
            return False
        if len(self.alerts) >= self.max_alerts:
            self._forget_one()
        ack = self.acks.get(object_id)
        alert = {
            "id": object_id,
            **{k: obj.get(k) for k in ALERT_FIELDS},
            "found": obj.get("first_seen") or obj.get("received") or now,
            "raised": now,
            "acked_by": ack["by"] if ack else None,
            "acked_ts": ack["ts"] if ack else None,
        }
        self.alerts[object_id] = alert
        self._changed.add(object_id)
        if restored or ack is not None:
            return False
        self.counts["raised"] += 1
        if len(self._raised) >= self.max_raised:
            self.counts["raised_dropped"] += 1
            del self._raised[0]
        self._raised.append(object_id)
        return True

    def ack(self, object_id: str, by: str, ts: float) -> bool:
        """An operator acknowledged ``object_id``; False when it was acknowledged already (the first one stands)."""
        if object_id in self.acks:
            return False
        if len(self.acks) >= self.max_alerts:
            del self.acks[next(iter(self.acks))]
        self.acks[object_id] = {"by": by, "ts": ts}
        self.counts["acked"] += 1
        alert = self.alerts.get(object_id)
        if alert is not None:
            alert["acked_by"], alert["acked_ts"] = by, ts
            self._changed.add(object_id)
        return True

    def forget(self, object_id: str) -> None:
        """The model forgot the object (its bound): the alert goes too, the acknowledgement stays remembered."""
        if self.alerts.pop(object_id, None) is not None:
            self._changed.discard(object_id)

    def _forget_one(self) -> None:
        acked = [k for k, a in self.alerts.items() if a["acked_by"] is not None]
        victim = min(acked or self.alerts, key=lambda k: self.alerts[k]["raised"])
        self.forget(victim)

    def unacknowledged(self) -> list[dict[str, Any]]:
        return [a for a in self.alerts.values() if a["acked_by"] is None]

    def to_json(self) -> list[dict[str, Any]]:
        return list(self.alerts.values())

    @property
    def changed(self) -> bool:
        return bool(self._changed)

    def take_changed(self) -> list[dict[str, Any]]:
        changed = [self.alerts[k] for k in self._changed if k in self.alerts]
        self._changed = set()
        return changed

    def take_raised(self) -> list[dict[str, Any]]:
        """The alerts raised since the last call (for the webhook), oldest first, with what came since (a picture)."""
        raised, self._raised = self._raised, []
        # Acknowledged in the meantime (a retained mark right behind its object at a start without a store): no page.
        return [dict(self.alerts[k]) for k in raised if k in self.alerts and self.alerts[k]["acked_by"] is None]
