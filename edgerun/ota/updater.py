"""The node's updater: a journalled state machine from a signed offer to a committed (or rolled back) model.

    check     keys.json signed by enough roots and not older than the trusted one; the manifest
              signed by enough release keys, none revoked; same model; version above the
              anti-rollback counter and never rolled back before; not expired (clock policy);
              this board and runtime; this node in the rollout cohort
    fetch     the delta when its base is the active slot's payload (hash checked), else the
              full payload; every download capped at its signed size and hashed
    patch     apply the delta to the active payload; the result must hash to the target
    begin     journal, then write the inactive slot (temp dir, fsync, rename)        -> staged
    warm up   open the new engine beside the running one; one inference on zeros must give
              finite outputs of the shapes the decoder expects                          -> warmed
    swap      journal, then serve the new runtime from the next frame                   -> trial
    watch     ``health_window_s``: no inference errors, p99 latency within ``latency_factor``
              of before, and frames from the new model at all
    commit    journal, installed.json, close the old engine                             -> done
    rollback  swap back to the old runtime (still open), never retry that version       -> done

Every step is reported on the sinks' ``events`` (kind ``ota``) and in ``status.json``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hashlib
import logging
import os
import platform
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

import msgspec
import numpy as np

from edgerun import __version__
from edgerun.errors import ConfigError, ModelError
from edgerun.models.bundle import ModelBundle, load_bundle
from edgerun.ota.clock import Clock, system_clock
from edgerun.ota.delta import apply_delta
from edgerun.ota.errors import OtaError, Rejected, SignatureError
from edgerun.ota.manifest import Manifest, format_time, in_rollout, version_tuple
from edgerun.ota.minisign import PublicKey
from edgerun.ota.payload import pack_bundle, sha256_bytes, sha256_file
from edgerun.ota.steps import StepLedger
from edgerun.ota.store import PAYLOAD, ModelStore, atomic_write, default_state_dir
from edgerun.ota.transport import Offer, RateLimiter, Transport, TransportError
from edgerun.ota.trust import Keyring, TrustStore
from edgerun.pipeline.serving import Served, ServingController

if TYPE_CHECKING:
    from edgerun.config import Config, OtaConfig
    from edgerun.types import DetectionBatch

log = logging.getLogger(__name__)


class UpdaterHost(Protocol):
    """What the updater needs of the node it updates (``edgerun.node.Node``), and nothing more.

    What serves is asked of ``serving`` (the node's ``ServingController``): the updater
    swaps a warmed model in, and back out on a rollback, through it alone.
    """

    node_id: str
    cfg: Config
    observers: list[Callable[[DetectionBatch], None]]
    serving: ServingController

    def open_model(self, bundle: ModelBundle) -> Served:
        """``bundle`` opened and warmed up on the node's engines beside the serving model (blocking)."""
        ...

    def publish_event(self, kind: str, data: dict[str, Any]) -> None: ...

    def inference_errors(self) -> int: ...


RETRY_MAX_S = 3600.0


def load_root_keys(entries: list[str]) -> list[PublicKey]:
    """Root keys from config: minisign public key files, or their base64 lines."""
    keys = []
    for entry in entries:
        if Path(entry).is_file() or not entry.startswith("RW"):
            keys.append(PublicKey.load(entry))
        else:
            keys.append(PublicKey.parse(entry, "ota.root_keys"))
    return keys


def make_transports(ota: OtaConfig, cfg: Config) -> list[Transport]:
    transports: list[Transport] = []
    if ota.watch_dir:
        from edgerun.ota.transport_dir import DirectoryTransport

        transports.append(DirectoryTransport(ota.watch_dir))
    if ota.http_url:
        from edgerun.ota.transport_http import HttpTransport

        transports.append(HttpTransport(ota.http_url))
    if ota.mqtt:
        from edgerun.ota.transport_mqtt import MqttTransport

        transports.append(MqttTransport.from_sink_config(cfg.sinks.mqtt, cfg.node_id))
    return transports


def judge_window(
    before: list[float], after: list[float], errors: int, max_errors: int, latency_factor: float
) -> str | None:
    """Why the new model failed its health window, or None if it passed (latencies in seconds)."""
    if errors > max_errors:
        return f"{errors} inference error(s) in the health window (allowed {max_errors})"
    if not after:
        return "the new model produced no batches in the health window"
    if before:
        p_before = float(np.percentile(before, 99))
        p_after = float(np.percentile(after, 99))
        if p_after > latency_factor * p_before:
            return (
                f"inference p99 {p_after * 1000:.1f} ms is above {latency_factor:g} x "
                f"the previous model's {p_before * 1000:.1f} ms"
            )
    return None


class BatchWatch:
    """Per-model-version inference latency of recent batches (a node observer, on the loop)."""

    def __init__(self, keep: int = 4096) -> None:
        self.samples: collections.deque[tuple[float, int, float]] = collections.deque(maxlen=keep)

    def observe(self, batch: DetectionBatch) -> None:
        stamps = batch.stamps
        latency = stamps.get("inferred", 0.0) - stamps.get("preprocessed", 0.0)
        self.samples.append((time.monotonic(), batch.model_version, latency))

    def latencies(self, version: int, since: float = 0.0, last: int = 0) -> list[float]:
        values = [lat for t, v, lat in self.samples if v == version and t >= since]
        return values[-last:] if last else values


class Updater:
    """Polls the configured sources and applies releases to the running node."""

    def __init__(self, node: UpdaterHost, cfg: OtaConfig, clock: Clock | None = None) -> None:
        self.node = node
        self.cfg = cfg
        # (now, trusted) for expiry checks; the system clock under ota.clock unless a test hands one in
        self.clock: Clock = clock or system_clock(lambda: self.cfg.clock)
        self.store = ModelStore(cfg.state_dir or default_state_dir(), max_unpacked_bytes=cfg.max_unpacked_bytes)
        try:
            self.trust = TrustStore(load_root_keys(cfg.root_keys), cfg.root_threshold)
        except (SignatureError, Rejected) as err:
            raise ConfigError(f"ota.root_keys: {err}") from None  # exit 2: a person must fix the key
        self.transports = make_transports(cfg, node.cfg)
        self.limiter = RateLimiter(cfg.max_rate_bps)
        self.steps = StepLedger(self.store.trust / "steps.json")
        self.board = cfg.board or platform.machine()
        self.watch = BatchWatch()
        node.observers.append(self.watch.observe)
        self.status: dict[str, Any] = {"state": "idle", "steps": []}
        self._judged: dict[str, tuple[bool, float, int]] = {}  # offer digest -> (final, retry at, tries)
        self._pending_events: list[dict[str, Any]] = []
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="edgerun-ota")
        # Journal writes get their own thread: a cancelled install must not queue them behind a slot write.
        self._io_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="edgerun-ota-io")
        self._txn: int | None = None

    # -- boot (before the pipeline starts) ----------------------------------------

    def boot_bundle(self, fallback: Callable[[], ModelBundle]) -> ModelBundle:
        """Recover the store, provision it on first start, and return the bundle of the active slot."""
        store = self.store
        try:
            store.ensure_dirs()
            return self._boot(fallback)
        except OSError as err:
            raise OtaError(f"ota.state_dir: {store.root}: {err.strerror or err}") from None

    def _boot(self, fallback: Callable[[], ModelBundle]) -> ModelBundle:
        store = self.store
        actions = store.recover()
        if store.installed() is None:
            bundle = fallback()
            store.provision(bundle, pack_bundle(bundle.root))
            actions.append(f"provisioned slot a with {bundle.name} v{bundle.version}")
        try:
            actions += store.ensure_bootable()
        except OtaError as err:
            bundle = fallback()
            log.error("ota: %s; re-provisioning from %s", err, bundle.root)
            inst = store.installed()
            assert inst is not None
            counter, rejected = inst.counter, inst.rejected
            inst = store.provision(bundle, pack_bundle(bundle.root))
            inst.counter, inst.rejected = max(counter, inst.counter), rejected
            store.write_installed(inst)
            actions.append(f"{err}; re-provisioned slot a with {bundle.name} v{bundle.version}")
        inst = store.installed()
        assert inst is not None
        for action in actions:
            log.warning("ota: recovery: %s", action)
            self._pending_events.append({"step": "recovered", "action": action})
        self.status.update(installed=self._installed_summary(), name=inst.name)
        self._write_status()
        return store.slot_bundle(inst.active)

    # -- lifecycle ----------------------------------------------------------------

    def start(self) -> None:
        for data in self._pending_events:
            self._publish(data)
        self._pending_events.clear()
        self._task = asyncio.create_task(self._run(), name="edgerun-ota")

    async def stop(self) -> None:
        self._stopping = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:
                log.exception("ota: updater failed while stopping")
        for transport in self.transports:
            try:
                await transport.close()
            except Exception:
                log.debug("ota: closing %s failed", transport.describe(), exc_info=True)
        self._executor.shutdown(wait=False)
        self._io_executor.shutdown(wait=True)

    async def _run(self) -> None:
        while not self._stopping:
            for transport in self.transports:
                try:
                    await self.poll_once(transport)
                except Exception:
                    # A bug here must not take the node down with it: it keeps serving the model it has.
                    log.exception("ota: polling %s failed", transport.describe())
            await asyncio.sleep(self.cfg.poll_interval_s)

    async def poll_once(self, transport: Transport) -> str | None:
        """Look at one source and apply what it offers; returns the outcome, or None if nothing new."""
        inst = self.store.installed()
        if inst is None:
            return None
        try:
            offer = await transport.poll(inst.name)
        except TransportError as err:
            self._set_source_problem(transport, str(err))
            return None
        self._set_source_problem(transport, "")
        if offer is None:
            return None
        digest = hashlib.sha256(offer.identity()).hexdigest()
        judged = self._judged.get(digest)
        if judged is not None and (judged[0] or time.monotonic() < judged[1]):
            return None
        try:
            outcome = await self.apply(transport, offer)
        except Rejected as err:
            tries = judged[2] + 1 if judged else 1
            delay = min(RETRY_MAX_S, self.cfg.poll_interval_s * 2**tries)
            self._judged[digest] = (err.final, time.monotonic() + delay, tries)
            self._report("rejected", code=err.code, reason=str(err), final=err.final)
            log.warning("ota: rejected release from %s: %s", offer.source, err)
            return f"rejected:{err.code}"
        except (TransportError, OtaError, OSError) as err:
            # Not the release's fault (a dropped link, a full disk): try again on a later poll.
            self._report("failed", reason=str(err))
            log.warning("ota: update from %s failed: %s", offer.source, err)
            return "failed"
        self._judged[digest] = (True, 0.0, 1)
        return outcome

    # -- the state machine ----------------------------------------------------------

    def _trusted_keyring(self, now: float) -> Keyring | None:
        raw = self.store.trust / "keys.json"
        sig = self.store.trust / "keys.json.minisig"
        if not raw.is_file() or not sig.is_file():
            return None
        try:
            # Expiry is checked when a release is judged; here only that the stored copy still verifies.
            return self.trust.verify_keys(raw.read_bytes(), sig.read_text(), 0.0, None)
        except Rejected as err:
            log.warning("ota: the stored keys.json no longer verifies (%s); ignoring it", err)
            return None

    def _keyring(self, offer: Offer, now: float) -> Keyring:
        trusted = self._trusted_keyring(now)
        keyring = self.trust.release_keyring(offer.keys, offer.keys_sig, now, trusted, offer.source)
        if trusted is None or keyring.version > trusted.version:
            # Trust metadata, kept as soon as it verifies so a replayed older keys.json is refused.
            atomic_write(self.store.trust / "keys.json.minisig", keyring.signatures.encode())
            atomic_write(self.store.trust / "keys.json", keyring.raw)
            log.info("ota: trusting keys.json version %d", keyring.version)
        return keyring

    def check(self, offer: Offer) -> Manifest:
        """Every check that needs no download; Rejected with the first that fails."""
        inst = self.store.installed()
        assert inst is not None
        now, clock_trusted = self.clock()
        self.status["clock"] = "trusted" if clock_trusted else "untrusted"
        if not clock_trusted:
            if self.cfg.untrusted_clock == "refuse":
                raise Rejected(
                    "clock_untrusted",
                    "the system clock is not synchronised, so expiry cannot be checked "
                    "(ota.untrusted_clock = 'refuse'); waiting",
                    final=False,
                )
            # No trusted clock: time is at least the newest signed time this node has seen.
            now = max(now, inst.time_floor)
        keyring = self._keyring(offer, now)
        manifest = self.trust.verify_manifest(offer.manifest, offer.manifest_sig, keyring)
        if manifest.name != inst.name:
            raise Rejected("wrong_model", f"manifest is for {manifest.name!r}, this node runs {inst.name!r}")
        if manifest.version in inst.rejected:
            raise Rejected(
                "rejected_before", f"{manifest.name} v{manifest.version} was rolled back before; never retried"
            )
        if manifest.version <= inst.counter:
            raise Rejected(
                "rollback",
                f"{manifest.name} v{manifest.version} is not above the installed v{inst.version} "
                f"(anti-rollback counter {inst.counter})",
            )
        self.steps.check(manifest)
        if manifest.rollout.percent <= 0.0:
            # A halt leaves no node in its cohort, so it is refused below, but it is kept first: it is sticky here.
            self.steps.record(manifest)
        if manifest.expires_ts <= now:
            clock = "" if clock_trusted else " (clock not synchronised: checked against the newest signed time seen)"
            raise Rejected("expired", f"manifest v{manifest.version} expired at {manifest.expires}{clock}")
        boards = manifest.compatibility.boards
        if boards and self.board not in boards:
            raise Rejected(
                "incompatible", f"v{manifest.version} is for boards {', '.join(boards)}; this is {self.board}"
            )
        if version_tuple(manifest.compatibility.min_runtime) > version_tuple(__version__):
            raise Rejected(
                "incompatible",
                f"v{manifest.version} needs edgerun >= {manifest.compatibility.min_runtime}, this is {__version__}",
            )
        if not in_rollout(manifest.rollout, self.node.node_id):
            raise Rejected(
                "not_in_rollout",
                f"node {self.node.node_id} is outside the {manifest.rollout.percent:g}% rollout of v{manifest.version}",
            )
        return manifest

    async def apply(self, transport: Transport, offer: Offer) -> str:
        """Take one offer through every step; returns 'committed' or 'rolled_back', raises Rejected."""
        self.status.pop("version", None)
        self.status.update(state="checking", source=offer.source, steps=[])
        self._report("check", source=offer.source)
        # Off the loop: signature checks are quick, but persisting a newer keys.json fsyncs.
        manifest = await self._in_executor(self.check, offer)
        self.status.update(version=manifest.version, name=manifest.name)
        self._report("accepted", version=manifest.version, expires=manifest.expires)
        payload = await self._fetch_payload(transport, manifest)
        await self._in_executor(self._validate_payload, manifest, payload)
        self._report("verified", sha256=manifest.target.sha256)
        # Kept once the release is known good, so a rejected one leaves the store as it was; an older step of
        # this version replayed later is refused.
        await self._in_executor(self.steps.record, manifest)
        return await self._install(manifest, payload)

    def _validate_payload(self, manifest: Manifest, payload: bytes) -> None:
        """Unpack the payload in staging (safe paths, no links, a valid bundle of this name and version)."""
        self.store.check_unpacked(payload)  # streamed first: a tar bomb never reaches staging
        check = self.store.staging / f"check-{manifest.target.sha256[:16]}"
        shutil.rmtree(check, ignore_errors=True)
        check.mkdir(parents=True)
        try:
            (check / PAYLOAD).write_bytes(payload)
            try:
                bundle = load_bundle(check / PAYLOAD, extract_dir=check)
            except ModelError as err:
                raise Rejected("bad_bundle", str(err).replace(str(check / PAYLOAD), "payload")) from None
            if bundle.name != manifest.name or bundle.version != manifest.version:
                raise Rejected(
                    "bad_bundle",
                    f"payload is {bundle.name} v{bundle.version}, the manifest {manifest.name} v{manifest.version}",
                )
        finally:
            shutil.rmtree(check, ignore_errors=True)

    async def _in_executor(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _io(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A journal or state write: fsync can stall for a while, so never on the loop that publishes batches.

        Once started it completes even if the updater is being stopped: a cancel is raised after it is on disk.
        """
        future = asyncio.get_running_loop().run_in_executor(self._io_executor, fn, *args)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            await asyncio.wait([future])
            raise

    async def _download(self, transport: Transport, manifest: Manifest, file: str, size: int, sha256: str) -> bytes:
        dest = self.store.staging / f"{sha256}.part"
        self._report("fetch", file=file, size=size)
        t0 = time.monotonic()
        try:
            await transport.fetch(manifest.name, file, size, dest, self.limiter)
        except Rejected:
            dest.unlink(missing_ok=True)
            raise
        got = await self._in_executor(sha256_file, dest)
        if got != sha256:
            dest.unlink(missing_ok=True)
            raise Rejected(
                "hash_mismatch", f"{file}: sha256 {got[:16]}... is not the signed {sha256[:16]}...", final=False
            )
        data = await self._in_executor(dest.read_bytes)
        dest.unlink(missing_ok=True)
        self._report("fetched", file=file, size=size, seconds=round(time.monotonic() - t0, 3))
        return data

    async def _fetch_payload(self, transport: Transport, manifest: Manifest) -> bytes:
        inst = self.store.installed()
        assert inst is not None
        delta, target = manifest.delta, manifest.target
        if delta is not None:
            active = self.store.slot_dir(inst.active) / PAYLOAD
            base = await self._in_executor(_read_if_hash, active, delta.base_sha256)
            if base is not None:
                try:
                    patch = await self._download(transport, manifest, delta.file, delta.size, delta.sha256)
                    self._report("patch", algorithm=delta.algorithm, base_version=delta.base_version)
                    new = await self._in_executor(apply_delta, base, patch, delta.algorithm, target.size)
                    if sha256_bytes(new) != target.sha256:
                        raise Rejected("hash_mismatch", f"{delta.file}: the patched payload is not the target")
                    self._report("patched", size=len(new))
                    return new
                except Rejected as err:
                    if not target.file:
                        raise
                    self._report("delta_failed", reason=str(err))
                    log.warning("ota: delta failed (%s); falling back to the full payload", err)
            elif not target.file:
                raise Rejected(
                    "base_mismatch",
                    f"the delta of v{manifest.version} applies to v{delta.base_version} ({delta.base_sha256[:12]}), "
                    f"this node has v{inst.version} ({inst.sha256[:12]}), and the release has no full payload",
                )
            else:
                self._report("delta_skipped", reason=f"base v{delta.base_version} is not the active payload")
        return await self._download(transport, manifest, target.file, target.size, target.sha256)

    async def _install(self, manifest: Manifest, payload: bytes) -> str:
        store = self.store
        try:
            txn, slot, begin = await self._io(
                store.begin, manifest.name, manifest.version, manifest.target.sha256, manifest.created_ts
            )
        except asyncio.CancelledError:
            records = store.open_transaction()
            if records:  # begun just as the node stopped: close it, the running model is untouched
                store.abort(records[0]["txn"], "the node stopped during the install")
            raise
        self._txn = txn
        self.status["state"] = "installing"
        self._report("begin", slot=slot, version=manifest.version)
        try:
            try:
                bundle = await self._in_executor(store.write_slot, slot, payload, manifest.target.sha256)
            except Rejected as err:
                await self._fail(txn, begin, str(err))
                raise
            await self._io(store.journal, txn, "staged")
            self._report("staged", slot=slot)
            try:
                serving = await self._in_executor(self._open_runtime, bundle)
            except Exception as err:
                reason = f"warm-up failed: {err}"
                await self._fail(txn, begin, reason)
                raise Rejected("warmup_failed", reason) from None
            try:
                await self._io(store.journal, txn, "warmed")
            except asyncio.CancelledError:
                await self._close(serving)  # warmed beside the running model, never served
                raise
        except asyncio.CancelledError:
            # Stopped before the swap: the running model is untouched; the release is tried again next
            # start. (A stop while "warmed" was being written lands here too, after it is on disk.)
            await self._io(store.abort, txn, "the node stopped during the install")
            raise
        self._report("warmed", engine=serving.runtime.engine.KEY)
        return await self._trial(txn, begin, manifest, serving)

    async def _fail(self, txn: int, begin: dict[str, Any], reason: str) -> None:
        await self._io(self.store.rollback, txn, begin, reason)
        self._txn = None
        self.status.update(installed=self._installed_summary())

    def _open_runtime(self, bundle: ModelBundle) -> Served:
        """Open the new model beside the running one and check one inference (executor thread)."""
        # The new model gets its own failover over engine.order (every candidate opened and warmed up).
        serving = self.node.open_model(bundle)
        runtime = serving.runtime
        engine = runtime.engine
        try:
            tensor = engine.allocate_input()
            tensor[...] = 0
            outputs = engine.infer(tensor, engine.allocate_outputs())
            for spec, out in zip(engine.output_specs, outputs):
                if tuple(out.shape) != tuple(spec.shape):
                    raise OtaError(f"output {spec.name} has shape {out.shape}, expected {spec.shape}")
                if np.issubdtype(out.dtype, np.floating) and not np.isfinite(out).all():
                    raise OtaError(f"output {spec.name} is not finite on a zero input")
            runtime.decoder.decode(outputs)  # the decoder accepts what the model gives
        except Exception:
            _close_serving(serving)
            raise
        return serving

    async def _trial(self, txn: int, begin: dict[str, Any], manifest: Manifest, new: Served) -> str:
        node, store, cfg = self.node, self.store, self.cfg
        serving = node.serving
        old = serving.current()
        before = self.watch.latencies(old.runtime.model.version, since=time.monotonic() - 60.0, last=500)
        errors_before = node.inference_errors()
        reason: str | None = None
        try:
            await self._io(store.journal, txn, "trial")
            await self._swap(new)  # the old failover stops re-probing, the new one takes charge
            t_swap = time.monotonic()
            self.status["state"] = "trial"
            self._report("swapped", version=manifest.version, window_s=cfg.health_window_s)
            end = t_swap + cfg.health_window_s
            while time.monotonic() < end:
                await asyncio.sleep(min(0.1, max(0.0, end - time.monotonic())))
                errors = node.inference_errors() - errors_before
                if errors > cfg.max_infer_errors:
                    break
            errors = node.inference_errors() - errors_before
            after = self.watch.latencies(manifest.version, since=t_swap)
            reason = judge_window(before, after, errors, cfg.max_infer_errors, cfg.latency_factor)
        except asyncio.CancelledError:
            # Shutting down mid-window says nothing about the model: leave the store as it was, try again later.
            await self._io(store.abort, txn, "the node stopped during the health window")
            # The node closes whatever it serves at exit; close the other one.
            await self._close(old if serving.runtime is new.runtime else new)
            raise
        if reason is None:
            await self._io(store.commit, txn, begin)
            self._txn = None
            await self._close(old)
            self.status.update(state="idle", installed=self._installed_summary())
            self._report("committed", version=manifest.version)
            log.info("ota: committed %s v%d", manifest.name, manifest.version)
            return "committed"
        log.warning("ota: v%d failed its health window: %s; rolling back", manifest.version, reason)
        await self._swap(old)
        await self._io(store.rollback, txn, begin, reason)
        self._txn = None
        await self._close(new)
        self.status.update(state="idle", installed=self._installed_summary())
        self._report("rolled_back", version=manifest.version, reason=reason)
        return "rolled_back"

    async def _swap(self, to: Served) -> None:
        """Serve ``to`` through the node's serving controller (retires what served; once begun, it completes)."""
        future = asyncio.get_running_loop().run_in_executor(self._executor, self.node.serving.swap, *to)
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            await asyncio.wait([future])
            raise

    async def _close(self, serving: Served) -> None:
        await self._in_executor(_close_serving, serving)

    # -- reporting ------------------------------------------------------------------

    def _installed_summary(self) -> dict[str, Any]:
        inst = self.store.installed()
        if inst is None:
            return {}
        return {
            "name": inst.name,
            "version": inst.version,
            "slot": inst.active,
            "counter": inst.counter,
            "rejected": inst.rejected,
            "previous": None if inst.previous is None else msgspec.to_builtins(inst.previous),
        }

    def _report(self, step: str, **data: Any) -> None:
        event = {"step": step, **data}
        if "version" not in event and "version" in self.status:
            event["version"] = self.status["version"]
        self.status["steps"] = [*self.status.get("steps", [])[-30:], {"t": format_time(time.time()), **event}]
        self.status["last"] = event
        if step in ("rejected", "committed", "rolled_back", "failed"):
            self.status["state"] = "idle"
        self._publish(event)
        self._write_status()

    def _publish(self, event: dict[str, Any]) -> None:
        payload = {"model": self.status.get("name", ""), **event}
        self.node.publish_event("ota", payload)

    def _write_status(self) -> None:
        try:
            tmp = self.store.status_path.with_name("status.json.tmp")
            tmp.write_bytes(msgspec.json.encode(self.status))
            os.replace(tmp, self.store.status_path)  # a report: renamed whole, no fsync needed
        except OSError as err:
            log.debug("ota: cannot write %s: %s", self.store.status_path, err)

    def _set_source_problem(self, transport: Transport, reason: str) -> None:
        sources = self.status.setdefault("sources", {})
        if sources.get(transport.describe()) != reason:
            sources[transport.describe()] = reason
            if reason:
                log.warning("ota: source %s: %s", transport.describe(), reason)


def _close_serving(serving: Served) -> None:
    owner: Any = serving.owner
    if owner is not None:
        owner.close()
    else:
        serving.runtime.engine.close()


def _read_if_hash(path: Path, sha256: str) -> bytes | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return data if sha256_bytes(data) == sha256 else None
