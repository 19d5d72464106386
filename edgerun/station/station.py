"""The ground station: the fleet model fed from MQTT, the canary watch, rollout actions, and the page's data.

One asyncio loop runs it all: the subscriber drains messages into the model,
a tick every ``tick_s`` turns what changed into one delta for every open page
(so a node updates a page at most 1/tick_s times a second whatever its frame
rate), and once a second the canary watch judges every rollout in progress.
Rollout actions (promote, halt) need the release signing key; without it the
station is read-only and says so.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import json
import logging
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from edgerun import wire
from edgerun.errors import EXIT_NEEDS_OPERATOR, ConfigError, EdgerunError
from edgerun.fleet.rollout import RolloutControl, RolloutRefused, phase_for
from edgerun.fleet.trusted_release import CheckedRelease, ReleaseVerifier, check_payload_on_broker
from edgerun.ota.errors import Rejected
from edgerun.ota.manifest import cohort_position
from edgerun.ota.minisign import PublicKey, SecretKey
from edgerun.station.canary import CanaryPolicy, judge
from edgerun.station.model import NODE_ID_RE, OBJECT_ID_RE, FleetModel, NodeView, image_url, payload_key
from edgerun.station.store import DEFAULT_MAX_AGE_S, DEFAULT_MAX_BYTES, StationStore
from edgerun.station.subscriber import FleetSubscriber
from edgerun.station.webhook import AlertWebhook, alert_body

log = logging.getLogger(__name__)

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class StationError(EdgerunError):
    """A station option or action is wrong; the message says which."""


class StationConfigError(StationError, ConfigError):
    """A station option a person must fix (exit 2)."""


class ActionRefused(StationError):
    """A rollout action the station will not take (read-only, unknown release, bad percent)."""

    status = 403


class UnknownAlert(ActionRefused):
    """An acknowledgement of an object that raised no alert here."""

    status = 404


class ReleaseConflict(ActionRefused):
    """An action on a release that is forged, replayed or halted: refused (HTTP 409, exit 2)."""

    status = 409
    exit_code = EXIT_NEEDS_OPERATOR


@dataclass
class StationOptions:
    mqtt_host: str = "127.0.0.1"
    mqtt_port: int = 1883
    mqtt_cfg: Any = None  # credentials and TLS (a MqttSinkConfig) for a broker with access control
    bind_host: str = "127.0.0.1"
    bind_port: int = 8080
    ground: Path | None = None
    ground_extent: tuple[float, float, float, float] = (0.0, 0.0, 40.0, 40.0)  # west, south, east, north (m)
    tiles: Path | None = None  # the offline basemap: a {z}/{x}/{y}.png directory or an .mbtiles file
    truth: list[dict[str, Any]] = field(default_factory=list)
    signing_key: SecretKey | None = None
    # Root public keys, as a node holds them: every retained release is verified against them before it is
    # shown as a release or signed again (edgerun.fleet.trusted_release). Required with signing_key.
    root_keys: list[PublicKey] = field(default_factory=list)
    root_threshold: int = 1
    state_dir: Path | None = None  # keeps the rollout step ledger across restarts (a halt stays known)
    node_http: dict[str, str] = field(default_factory=dict)  # node id -> host:port of its HTTP service
    stale_s: float = 15.0
    tick_s: float = 0.25
    auto_halt: bool = True
    policy: CanaryPolicy = field(default_factory=CanaryPolicy)
    # The page's doors (see edgerun/station/server.py): who may reach it, who may act, where it may fetch from.
    allowed_hosts: list[str] = field(default_factory=list)  # Host names the page answers besides its bind address
    users_file: Path | None = None  # operator accounts (edgerun station passwd); None: no login
    public_view: bool = False  # read-only viewing without login (actions still need one)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    node_nets: list[IPNetwork] = field(default_factory=list)  # where an advertised node address may point
    snapshot_token: str | None = None  # presented as "Authorization: Bearer" to a node's /snapshot.jpg
    # The mission's store (edgerun/station/store.py): a SQLite path or a postgresql:// URL; None: memory only.
    db: str | None = None
    db_max_age_s: float = DEFAULT_MAX_AGE_S
    db_max_bytes: int = DEFAULT_MAX_BYTES
    flush_s: float = 0.5  # how often what changed goes to the store's writer thread
    # With a store, the broker keeps the station's session this long while it is down (MQTT 5 session expiry),
    # under a client id that stays the same for this host, store and page address; 0: a fresh session each start.
    session_expiry_s: int = 3600
    # Alerts (edgerun/station/alerts.py): the labels that alert (empty: every label), where to POST each new one,
    # and the page's URL as the webhook's receiver reaches it ("": the bind address).
    alert_labels: list[str] = field(default_factory=list)
    alert_webhook: str | None = None
    page_url: str = ""
    # A webhook post waits this long for its find's picture (then goes without it, saying so); pending posts
    # older than alert_max_age_s are given up (counted).
    alert_image_wait_s: float = 3.0
    alert_max_age_s: float = 3600.0
    # The broker forgets an ack mark after this long (MQTT 5 message expiry): three days, longer than a node
    # keeps its objects retained (a day by default), so a station started while the find is retained sees the ack.
    ack_expiry_s: int = 3 * 86400


def station_client_id(options: StationOptions) -> str:
    """The same id each time this station (host, store, page address) starts, so the broker's session resumes;
    two stations differ in at least one of the three."""
    seed = f"{socket.gethostname()}|{options.db}|{options.bind_host}:{options.bind_port}"
    return "edgerun-station-" + hashlib.sha256(seed.encode()).hexdigest()[:12]


class Station:
    def __init__(self, options: StationOptions) -> None:
        self.options = options
        self.origin = f"station-{uuid.uuid4().hex[:12]}"
        self.model = FleetModel(
            stale_s=options.stale_s,
            origin=self.origin,
            journal=options.db is not None,
            alert_labels=frozenset(options.alert_labels) if options.alert_labels else None,
        )
        self.store = (
            StationStore(options.db, max_age_s=options.db_max_age_s, max_bytes=options.db_max_bytes)
            if options.db is not None
            else None
        )
        # Pending posts live in the store (they survive a restart; stations sharing it post each alert once).
        self.webhook = (
            AlertWebhook(
                options.alert_webhook,
                engine=self.store.engine if self.store is not None else None,
                claimer=station_client_id(options),
                image_url_of=self._image_url_of,
                image_wait_s=options.alert_image_wait_s,
                max_age_s=options.alert_max_age_s,
            )
            if options.alert_webhook
            else None
        )
        resume = options.db is not None and options.session_expiry_s > 0
        self.subscriber = FleetSubscriber(
            options.mqtt_host,
            options.mqtt_port,
            self._on_message,
            self._on_broker,
            cfg=options.mqtt_cfg,
            client_id=station_client_id(options) if resume else "",
            session_expiry_s=options.session_expiry_s if resume else 0,
        )
        self.clients: set[asyncio.Queue[str]] = set()
        self.rollouts: dict[str, dict[str, Any]] = {}
        self._rollouts_json = ""
        self._tasks: list[asyncio.Task[None]] = []
        self._halting: set[tuple[str, int]] = set()
        self._restored = False
        key = options.signing_key
        if key is not None and not options.root_keys:
            # Without roots the station could not tell a forged release from a real one, and would sign it.
            raise StationConfigError(
                "--signing-key needs --root-key (the fleet's root public keys, as the nodes "
                "have them): the station signs only releases it verified"
            )
        steps = options.state_dir / "rollout-steps.json" if options.state_dir else None
        try:
            self.verifier = ReleaseVerifier(options.root_keys, options.root_threshold, steps)
        except Rejected as err:
            raise StationConfigError(f"--root-key: {err}") from None
        self.control = RolloutControl(options.mqtt_host, options.mqtt_port, key, cfg=options.mqtt_cfg) if key else None

    @property
    def read_only(self) -> bool:
        return self.control is None

    # -- lifecycle ----------------------------------------------------------------------

    async def restore(self) -> None:
        """Open the store and rebuild the fleet view from it (before the page answers: never an empty page)."""
        if self.store is not None and not self._restored:
            self._restored = True
            store = self.store
            await asyncio.to_thread(store.open)
            restored = await asyncio.to_thread(
                store.load,
                max_objects=self.model.max_objects,
                max_events=self.model.max_events,
                max_nodes=self.model.max_nodes,
            )
            self.model.restore(restored)
            log.info(
                "station: restored %d objects, %d nodes, %d events from %s",
                len(restored.objects),
                len(restored.nodes),
                len(restored.events),
                store.redacted,
            )

    async def start(self) -> None:
        await self.restore()
        self.subscriber.start()
        self._tasks = [
            asyncio.create_task(self._tick_loop(), name="station-tick"),
            asyncio.create_task(self._canary_loop(), name="station-canary"),
        ]
        if self.store is not None:
            self._tasks.append(asyncio.create_task(self._store_loop(), name="station-store"))
        if self.webhook is not None:
            self._tasks.append(asyncio.create_task(self.webhook.run(), name="station-webhook"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        await self.subscriber.stop()
        if self.store is not None:
            self.persist()
            store = self.store
            await asyncio.to_thread(store.flush)
            await asyncio.to_thread(store.close)

    def persist(self) -> None:
        """Hand what the model journalled to the store's writer thread (never blocks)."""
        batch = self.model.take_journal()
        if batch is not None and self.store is not None:
            self.store.submit(batch)

    async def _store_loop(self) -> None:
        while True:
            await asyncio.sleep(self.options.flush_s)
            try:
                self.persist()
            except Exception:  # a bug here must not stop the page
                log.exception("station: handing a batch to the store failed")

    # -- input --------------------------------------------------------------------------

    def _on_message(self, topic: str, payload: bytes, retained: bool, props: dict[str, str]) -> None:
        self.model.ingest(topic, payload, time.time(), retained=retained, props=props)

    def _on_broker(self, connected: bool, reason: str) -> None:
        self.model.set_broker(connected, reason, time.time())

    # -- output to pages ----------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        snap = self.model.snapshot(time.time())
        snap["dropped"]["backlog"] = self.subscriber.dropped_backlog
        if self.store is not None and self.store.dropped_batches:
            snap["dropped"]["store_batches"] = self.store.dropped_batches  # the database could not keep up or failed
        snap.update(
            rollouts=self.rollouts,
            read_only=self.read_only,
            mqtt=f"{self.options.mqtt_host}:{self.options.mqtt_port}",
            ground={"url": "/ground", "extent": self.options.ground_extent} if self.options.ground else None,
            truth=self.options.truth,
            alert_counts=dict(self.model.alerts.counts),
            webhook=self.webhook.stats() if self.webhook is not None else None,
        )
        return snap

    def broadcast(self, kind: str, data: dict[str, Any]) -> None:
        message = f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"
        for queue in list(self.clients):
            try:
                queue.put_nowait(message)
            except asyncio.QueueFull:
                # A page that cannot keep up is cut off; EventSource reconnects and starts from a snapshot.
                self.clients.discard(queue)

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.options.tick_s)
            try:
                delta = self.model.take_delta(time.time())
                if delta is not None and self.clients:
                    self.broadcast("delta", delta)
                raised = self.model.alerts.take_raised()
                if self.webhook is not None:
                    page = self.options.page_url or self.page_url()
                    for alert in raised:
                        self.webhook.submit(alert_body(alert, page))
                while self.model.came_back:
                    # Cleared, so a station started later does not retire it again from the old mark.
                    self.subscriber.publish_retained(wire.retired_topic(self.model.came_back.pop()), b"")
                while self.model.forgotten_acks:
                    # The object is gone from the fleet view: its mark would only hold a broker slot.
                    self.subscriber.publish_retained(wire.ack_topic(self.model.forgotten_acks.pop()), b"")
            except Exception:  # a bug here must not freeze every page
                log.exception("station: building a delta failed")

    # -- rollouts -----------------------------------------------------------------------

    def check_release(self, model: str, now: float | None = None) -> CheckedRelease | None:
        """The retained release of ``model`` verified as a node would (None when the broker holds none)."""
        payload = self.model.releases.get(model)
        if payload is None:
            return None
        return self.verifier.check(model, payload, self.model.rollouts.get(model), now)

    def rollout_view(self, model: str, now: float) -> dict[str, Any] | None:
        checked = self.check_release(model, now)
        if checked is None:
            return None
        manifest = checked.manifest
        if manifest is None:  # an untrusted retained message: shown as broken, never raised
            return {"model": model, "error": checked.reason, "trust": checked.trust}
        view: dict[str, Any] = {
            "model": model,
            "version": manifest.version,
            "percent": manifest.rollout.percent,
            "salt": manifest.rollout.salt,
            "created": manifest.created,
            "expires": manifest.expires,
            "step": manifest.rollout.step,
            "phase": "canary" if 0 < manifest.rollout.percent < 100 else phase_for(manifest.rollout.percent),
            "reason": "",
            "by": "",
            # "verified", or why not ("forged", "replayed", "unverified": no --root-key): the page shows it and
            # offers no action on anything but a verified release.
            "trust": checked.trust,
            "trust_code": checked.code,
            "trust_reason": checked.reason,
            "verified": checked.verified,
        }
        signed = checked.state
        if signed is not None and signed.state.version == manifest.version:
            st = signed.state
            view.update(
                phase=st.phase,
                reason=st.reason,
                by=st.by,
                base_version=st.base_version,
                state_ts=st.ts,
                signed_by=signed.key_id,
            )
        elif checked.state_error:
            view["state_error"] = checked.state_error
        nodes = [n for n in self.model.nodes.values() if n.model == model]
        view["nodes_on_version"] = sum(1 for n in nodes if n.model_version == manifest.version)
        view["nodes"] = len(nodes)
        verdict = judge(model, manifest.version, nodes, now, self.options.stale_s, self.options.policy)
        view["verdict"] = {"halt": verdict.halt, "reason": verdict.reason, "figures": verdict.figures}
        # A release that did not verify moves no node: it has no cohort.
        view["cohort"] = (
            {n.id: cohort_position(manifest.rollout.salt, n.id) < manifest.rollout.percent for n in nodes}
            if checked.verified
            else {}
        )
        view["progress"] = rollout_progress(
            model, view["phase"], manifest.rollout.percent, view["nodes_on_version"], len(nodes), view["cohort"]
        )
        return view

    async def _canary_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                await self._watch_rollouts()
            except Exception:  # a bug here must not end the watch
                log.exception("station: judging the rollouts failed")

    async def _watch_rollouts(self) -> None:
        now = time.time()
        views = {}
        for model in list(self.model.releases):
            view = self.rollout_view(model, now)
            if view is not None:
                views[model] = view
                await self._maybe_auto_halt(view)
        self.rollouts = views
        text = json.dumps(views, sort_keys=True, default=str)
        if text != self._rollouts_json:
            self._rollouts_json = text
            self.broadcast("rollouts", {"rollouts": views, "read_only": self.read_only})

    async def _maybe_auto_halt(self, view: dict[str, Any]) -> None:
        if view.get("phase") == "halted":
            self._halting.discard((view["model"], view["version"]))  # judged again if it is promoted again
        if not self.options.auto_halt or view.get("phase") not in ("canary", "promoted") or "error" in view:
            return
        if not view.get("verified"):
            return  # nothing to halt: the nodes refuse it, and the station never signs what it did not verify
        verdict = view["verdict"]
        key = (view["model"], view["version"])
        if not verdict["halt"] or key in self._halting:
            return
        self._halting.add(key)
        reason = f"auto-halt: {verdict['reason']}"
        if self.control is None:
            self._event(
                "rollout",
                f"{view['model']} v{view['version']}: {reason} (read-only station: halt it with "
                f"`edgerun fleet halt` or start the station with --signing-key)",
                "error",
            )
            return
        try:
            await self.act(view["model"], "halt", 0.0, reason=reason, by="auto")
        except EdgerunError as err:
            self._event("rollout", f"{view['model']} v{view['version']}: auto-halt failed: {err}", "error")
            self._halting.discard(key)

    def _event(self, kind: str, text: str, level: str = "info") -> None:
        self.model.add_event(time.time(), "station", kind, text, level)
        log.log(logging.INFO if level == "info" else logging.WARNING, "station: %s", text)
        payload = wire.event_payload("station", kind, {"text": text, "level": level, "origin": self.origin})
        self.subscriber.publish_event(json.dumps(payload).encode())

    async def act(
        self, model: str, action: str, percent: float, reason: str = "", by: str = "operator"
    ) -> dict[str, Any]:
        """Promote to ``percent`` or halt the rollout of ``model``; refused when the station is read-only."""
        if self.control is None:
            raise ActionRefused("the station is read-only: start it with --signing-key RELEASE.key to act on rollouts")
        checked = self.check_release(model)
        if checked is None:
            raise ActionRefused(f"no release of {model!r} is retained on the broker")
        if not checked.verified:
            raise ReleaseConflict(
                f"the release of {model!r} on the broker is {checked.trust} "
                f"({checked.reason}); the station signs only releases it verified"
            )
        if action == "halt":
            percent, phase = 0.0, "halted"
            reason = reason or "halted by the operator"
        elif action == "promote":
            if not 0.0 < percent <= 100.0:
                raise ActionRefused(f"promote: percent must be within (0, 100], got {percent:g}")
            phase = phase_for(percent)
        else:
            raise ActionRefused(f"unknown action {action!r} (promote, halt)")
        if action == "promote":
            try:
                note = await check_payload_on_broker(
                    checked, self.options.mqtt_host, self.options.mqtt_port, self.options.mqtt_cfg
                )
            except RolloutRefused as err:
                raise ReleaseConflict(str(err)) from None
            log.info("station: %s", note)
        base = checked.state.state.base_version if checked.state is not None else None
        try:
            state = await asyncio.to_thread(self.control.step, checked, percent, phase, reason, by, base)
        except RolloutRefused as err:
            raise ReleaseConflict(str(err)) from None
        self._event(
            "rollout",
            f"{model} v{state.version}: {phase} at {percent:g}% by {by}" + (f": {reason}" if reason else ""),
            "error" if phase == "halted" else "info",
        )
        return state.to_json()

    # -- retiring a node ---------------------------------------------------------------------

    def retire(self, node_id: str, by: str = "operator", reason: str = "") -> bool:
        """Take ``node_id`` off the fleet view here and, through a retained mark on the broker, on every station
        (stored as an operator action); it comes back when it speaks again. False: it was retired already."""
        if not NODE_ID_RE.match(node_id) or node_id in wire.RESERVED_NODE_IDS:
            raise ActionRefused(f"retire: {node_id[:80]!r} is not a node id")
        if node_id not in self.model.nodes and node_id not in self.model.retired:
            raise ActionRefused(f"retire: no node {node_id!r} in the fleet view")
        mark = wire.RetireNode(node=node_id, ts=time.time(), by=by[:128], reason=reason[:500])
        payload = msgspec.json.encode(mark)
        if not self.subscriber.publish_retained(wire.retired_topic(node_id), payload):
            log.warning("station: retiring %s: not connected to the broker; other stations will not know", node_id)
        return self.model.retire(node_id, mark.ts, mark.by, mark.reason, key=payload_key(payload))

    # -- alerts --------------------------------------------------------------------------------

    def ack(self, object_id: str, by: str = "operator") -> dict[str, Any]:
        """Acknowledge the alert of ``object_id`` here and, through a retained mark on the broker, on every station
        (stored as an operator action). Acknowledged already: the first acknowledgement stands and is returned."""
        if not OBJECT_ID_RE.match(object_id):
            raise ActionRefused(f"ack: {object_id[:80]!r} is not an object id")
        alert = self.model.alerts.alerts.get(object_id)
        if alert is None:
            raise UnknownAlert(f"ack: no alert for object {object_id!r}")
        if alert["acked_by"] is None:
            mark = wire.AlertAck(object=object_id, ts=time.time(), by=by[:128])
            payload = msgspec.json.encode(mark)
            expiry = self.options.ack_expiry_s
            if not self.subscriber.publish_retained(wire.ack_topic(object_id), payload, expiry_s=expiry):
                log.warning("station: ack of %s: not connected to the broker; other stations will not know", object_id)
            self.model.ack(object_id, mark.by, mark.ts, key=payload_key(payload))
        return {"object": object_id, "acked_by": alert["acked_by"], "acked_ts": alert["acked_ts"]}

    def _image_url_of(self, object_id: str) -> str | None:
        """The absolute URL of a find's picture on this station's page, once the station has it."""
        if object_id not in self.model.images:
            return None
        return (self.options.page_url or self.page_url()).rstrip("/") + image_url(object_id)

    def page_url(self) -> str:
        host = self.options.bind_host
        if host in ("", "0.0.0.0", "::"):
            host = socket.gethostname()
        host = f"[{host}]" if ":" in host else host
        scheme = "https" if self.options.tls_cert else "http"
        return f"{scheme}://{host}:{self.options.bind_port}"

    # -- snapshots of one node ----------------------------------------------------------

    def node_http(self, node: NodeView) -> str:
        """Where to fetch the node's snapshot: the operator's --node-http, or its advertised address when that is
        an IP literal inside a --node-net (a planted address must not point the station at anything else)."""
        given = self.options.node_http.get(node.id)
        if given:
            return given
        if not node.http or not self.options.node_nets:
            return ""
        host = node.http.rpartition(":")[0].strip("[]")
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return ""  # a name could resolve anywhere
        if any(ip.version == net.version and ip in net for net in self.options.node_nets):
            return node.http
        return ""


def rollout_progress(
    model: str, phase: str, percent: float, on_version: int, nodes: int, cohort: dict[str, bool]
) -> str:
    """How far a rollout got, in words that never call an empty fleet "complete"."""
    if nodes == 0:
        return f"no node runs {model}: nobody has taken this release"
    if phase in ("canary", "promoted") and cohort and not any(cohort.values()) and on_version == 0:
        return f"no node in the canary: none of the {nodes} nodes running {model} falls in its {percent:g}%"
    if on_version == 0:
        return f"nobody has taken it yet: 0 of {nodes} nodes on it"
    if phase == "complete" and on_version < nodes:
        return f"released to all, {on_version} of {nodes} nodes on it so far"
    return f"{on_version} of {nodes} nodes on it"


def render_boxes_jpeg(node: NodeView) -> bytes:
    """The node's last detection boxes on a blank frame, for when its own /snapshot.jpg cannot be reached."""
    import cv2
    import numpy as np

    width, height = node.frame if node.frame[0] and node.frame[1] else (640, 480)
    width, height = min(width, 4096), min(height, 4096)
    image = np.full((height, width, 3), 40, np.uint8)
    for det in node.boxes:
        x1, y1, x2, y2 = (int(round(v)) for v in det["box"])
        cv2.rectangle(image, (x1, y1), (x2, y2), (80, 220, 80), 2)
        cv2.putText(
            image,
            f"{det['label']} {det['score']:.2f}",
            (x1, max(12, y1 - 4)),
            cv2.FONT_HERSHEY_SIMPLEX,
            0.5,
            (80, 220, 80),
            1,
            cv2.LINE_AA,
        )
    when = time.strftime("%H:%M:%S", time.localtime(node.boxes_ts)) if node.boxes_ts else "never"
    cv2.putText(
        image,
        f"{node.id}: last boxes at {when} (no live snapshot)",
        (8, height - 10),
        cv2.FONT_HERSHEY_SIMPLEX,
        0.5,
        (200, 200, 200),
        1,
        cv2.LINE_AA,
    )
    ok, data = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, 85])
    if not ok:
        raise StationError("could not encode the snapshot")
    return data.tobytes()
