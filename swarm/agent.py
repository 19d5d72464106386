"""SwarmAgent: drives a sans-I/O Membership over the real transport on the caller's asyncio loop (no thread).

After every input (a datagram, a stream request or reply, the timer) the agent drains what the protocol wants done:
datagrams to send, streams to open, events to hand to callbacks, and re-arms its one timer at ``get_timer()``.
The protocol never sees a socket or a clock; the agent passes ``loop.time()`` as ``now``.

``python -m swarm.agent --name N --bind 127.0.0.1:7946 --key FILE --seed HOST:PORT`` runs one standalone member and
prints JSON lines (``ready``, ``member`` events, ``broadcast``, ``stats``, ``stopped``); SIGTERM or Ctrl-C leave the
swarm gracefully, SIGUSR1 prints a stats line. swarm-bench and the process tests read these lines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from swarm.config import SwarmTiming
from swarm.keyring import OVERHEAD, Keyring, KeyringError
from swarm.membership import Member, MemberEvent, Membership, UserBroadcast
from swarm.transport import Address, SwarmTransport

log = logging.getLogger(__name__)

EventCallback = Callable[["MemberEvent | UserBroadcast"], None]


class SwarmAgent:
    """One swarm member on the running asyncio loop: ``await start()``, ``await stop()``."""

    def __init__(
        self,
        name: str,
        bind: Address,
        timing: SwarmTiming,
        keyring: Keyring,
        *,
        meta: bytes = b"",
        seeds: Sequence[Address] = (),
        advertise: Address | None = None,
        loss: float = 0.0,
        rng: random.Random | None = None,
    ) -> None:
        self.name = name
        self.timing = timing
        self._bind = bind
        self._advertise = advertise
        self._meta = meta
        self._seeds = list(seeds)
        self._rng = rng or random.Random()
        self.transport = SwarmTransport(
            name,
            keyring,
            max_packet_bytes=timing.max_packet_bytes,
            tcp_timeout_s=timing.tcp_timeout_s,
            loss=loss,
            rng=self._rng,
        )
        self.membership: Membership | None = None
        self.address: Address | None = None
        self._callbacks: list[EventCallback] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._streams: set[asyncio.Task[None]] = set()
        self._flushing = False
        self._flush_again = False
        self.late_timer_s = 0.0  # the latest any timer fired after its deadline: loop starvation, for the logs

    # -- lifecycle ---------------------------------------------------------------------------------------------

    async def start(self) -> Address:
        self._loop = asyncio.get_running_loop()
        self.transport.on_datagram = self._on_datagram
        self.transport.on_stream = self._on_stream
        bound = await self.transport.start(self._bind)
        self.address = self._advertise or bound
        if self._advertise is not None and self._advertise[1] == 0:
            self.address = (self._advertise[0], bound[1])
        self.membership = Membership(
            self.name,
            self.address,
            self.timing,
            now=self._loop.time(),
            meta=self._meta,
            rng=self._rng,
            packet_budget=self.timing.max_packet_bytes - OVERHEAD,
        )
        if self._seeds:
            self.membership.join(self._seeds, self._loop.time())
        self._flush()
        log.info("swarm agent %s listening on %s:%d", self.name, *self.address)
        return self.address

    async def stop(self, leave: bool = True) -> None:
        """Leaves gracefully (the LEFT update gets a few gossip rounds to spread), then closes the sockets."""
        if self.membership is None or self._loop is None:
            return
        if leave:
            self.membership.leave(self._loop.time())
            self._flush()
            await asyncio.sleep(3 * self.timing.gossip_interval_s)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for task in list(self._streams):
            task.cancel()
        if self._streams:
            await asyncio.gather(*self._streams, return_exceptions=True)
        await self.transport.close()
        self.membership = None

    # -- application interface ---------------------------------------------------------------------------------

    @property
    def keyring(self) -> Keyring:
        """The live keyring: ``install``/``use``/``remove`` on it rotate keys while the agent runs."""
        return self.transport.keyring

    def on_event(self, callback: EventCallback) -> None:
        self._callbacks.append(callback)

    def members(self) -> list[Member]:
        return [] if self.membership is None else self.membership.members()

    def rtt_ms(self, name: str) -> float | None:
        """The smoothed round trip to a member over direct probes (ms), None before one answered or once it died."""
        return None if self.membership is None else self.membership.rtt_ms(name)

    def set_meta(self, meta: bytes, *, broadcast: bool = True) -> None:
        """New metadata; ``broadcast=False``: a quiet update that spreads by push-pull only (Membership.set_meta)."""
        self._meta = meta
        if self.membership is not None and self._loop is not None:
            self.membership.set_meta(meta, self._loop.time(), broadcast=broadcast)
            self._flush()

    def queue_broadcast(self, key: bytes, payload: bytes) -> None:
        if self.membership is not None:
            self.membership.queue_broadcast(key, payload)
            self._flush()

    @property
    def stats(self) -> dict[str, Any]:
        """Membership counters plus the transport's: drops by reason (protocol, crypto, transport), bytes in/out."""
        protocol: dict[str, Any] = dict(self.membership.stats) if self.membership is not None else {}
        dropped = Counter(protocol.pop("dropped", {}) or {})
        dropped.update(self.transport.dropped)
        out = {**protocol, **self.transport.counters, "dropped": dict(dropped)}
        out["late_timer_s"] = round(self.late_timer_s, 4)
        out["unauth_buffered_peak"] = self.transport.unauth.peak  # the most unauthenticated peers held
        return out

    # -- inputs ------------------------------------------------------------------------------------------------

    def _now(self) -> float:
        assert self._loop is not None
        return self._loop.time()

    def _on_datagram(self, sender: str, data: bytes, addr: Address) -> None:
        if self.membership is None:
            return
        self.membership.receive_datagram(data, addr, self._now())
        self._flush()

    def _on_stream(self, sender: str, data: bytes, addr: Address) -> bytes | None:
        if self.membership is None:
            return None
        reply = self.membership.handle_stream(data, addr, self._now())
        self._flush()
        return reply

    async def _open_stream(self, token: int, addr: Address, request: bytes) -> None:
        reply = await self.transport.request(addr, request, self.timing.tcp_timeout_s)
        if self.membership is not None:
            self.membership.stream_result(token, reply, self._now())
            self._flush()

    def _on_timer(self) -> None:
        self._timer = None
        if self.membership is None:
            return
        now = self._now()
        if self._timer_at is not None:
            self.late_timer_s = max(self.late_timer_s, now - self._timer_at)
        self._timer_at = None
        self.membership.handle_timer(now)
        self._flush()

    # -- outputs -----------------------------------------------------------------------------------------------

    def _flush(self) -> None:
        if self._flushing:  # a callback fed the protocol: drain again once the current pass ends
            self._flush_again = True
            return
        self._flushing = True
        try:
            self._flush_again = True
            while self._flush_again and self.membership is not None:
                self._flush_again = False
                self._drain(self.membership)
        finally:
            self._flushing = False

    def _drain(self, membership: Membership) -> None:
        assert self._loop is not None
        for addr, data in membership.datagrams_to_send():
            self.transport.send_datagram(addr, data)
        for token, addr, request in membership.streams_to_open():
            task = self._loop.create_task(self._open_stream(token, addr, request))
            self._streams.add(task)
            task.add_done_callback(self._streams.discard)
        for event in membership.pop_events():
            for callback in self._callbacks:
                try:
                    callback(event)
                except Exception:
                    log.exception("swarm event callback failed")
        deadline = membership.get_timer()
        if deadline != self._timer_at or (deadline is not None and self._timer is None):
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._timer_at = deadline
            if deadline is not None:
                self._timer = self._loop.call_at(deadline, self._on_timer)


# -- standalone member process ---------------------------------------------------------------------------------


def parse_address(text: str) -> Address:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"address {text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def event_record(event: MemberEvent | UserBroadcast) -> dict[str, Any]:
    if isinstance(event, UserBroadcast):
        return {"ev": "broadcast", "sender": event.sender, "bytes": len(event.payload)}
    member = event.member
    return {
        "ev": "member",
        "kind": event.kind,
        "member": member.name,
        "state": member.state.name,
        "incarnation": member.incarnation,
        "addr": list(member.addr),
    }


def _emit(record: dict[str, Any]) -> None:
    record = {"t": round(time.time(), 6), **record}
    sys.stdout.write(json.dumps(record, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m swarm.agent", description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--bind", required=True, type=parse_address, help="HOST:PORT (port 0: any free port)")
    parser.add_argument("--advertise", type=parse_address, help="HOST:PORT peers reach this member at")
    parser.add_argument("--key", required=True, help="swarm key file: one base64 key per line, first is primary")
    parser.add_argument("--seed", action="append", default=[], type=parse_address, help="HOST:PORT, repeatable")
    parser.add_argument("--timing", default="{}", help='JSON overrides of SwarmTiming, e.g. {"probe_interval_s":0.2}')
    parser.add_argument("--meta", default="", help="member metadata (UTF-8)")
    parser.add_argument("--loss", type=float, default=0.0, help="share of received datagrams to drop (tests)")
    parser.add_argument("--stats-interval", type=float, default=0.0, help="print a stats line every S seconds")
    parser.add_argument("--log-level", default="WARNING")
    return parser


async def _run(args: argparse.Namespace, timing: SwarmTiming, keyring: Keyring) -> None:
    loop = asyncio.get_running_loop()
    agent = SwarmAgent(
        args.name,
        args.bind,
        timing,
        keyring,
        meta=args.meta.encode(),
        seeds=args.seed,
        advertise=args.advertise,
        loss=args.loss,
    )
    agent.on_event(lambda event: _emit(event_record(event)))
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, lambda: _emit({"ev": "stats", **agent.stats}))
    address = await agent.start()
    assert agent.membership is not None
    _emit({"ev": "ready", "name": args.name, "addr": list(address), "incarnation": agent.membership.incarnation})
    stats_task = None
    if args.stats_interval > 0:

        async def report() -> None:
            while True:
                await asyncio.sleep(args.stats_interval)
                _emit({"ev": "stats", **agent.stats})

        stats_task = loop.create_task(report())
    await stop.wait()
    if stats_task is not None:
        stats_task.cancel()
    final = agent.stats
    await agent.stop(leave=True)
    _emit({"ev": "stopped", **final})


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    try:
        timing = SwarmTiming(**json.loads(args.timing))
        keyring = Keyring.load(args.key)
    except (KeyringError, ValueError, TypeError) as exc:
        print(f"swarm.agent: {exc}", file=sys.stderr)
        return 2
    asyncio.run(_run(args, timing, keyring))
    return 0


if __name__ == "__main__":
    sys.exit(main())
