"""The station's alert route, beside the page's own (edgerun.station.server):

    POST /api/alerts/<object id>/ack    acknowledge the alert a new fleet object raised; needs the header
                                        X-Edgerun-Confirm: <object id> (a cross-site form cannot send it)

It sits behind the server's doors like every route: with --users it needs a login and the session's CSRF
token, and the acknowledgement is stored as that operator's. The page learns of every acknowledgement (its own,
another page's, another station's) from the stream's deltas, not from this answer.
"""

from __future__ import annotations

from typing import Callable

from aiohttp import web

from edgerun.station.auth import Session
from edgerun.station.station import ActionRefused, Station


class AlertRoutes:
    def __init__(self, station: Station, can_act: Callable[[Session | None], bool]) -> None:
        self.station = station
        self.can_act = can_act

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/api/alerts/{object_id}/ack", self._ack)

    async def _ack(self, request: web.Request) -> web.Response:
        object_id = request.match_info["object_id"]
        session: Session | None = request["session"]
        headers = {"Cache-Control": "no-store"}
        if not self.can_act(session):
            return web.json_response(
                {"error": "this page is read-only: acknowledge from a station with operator accounts"},
                status=403,
                headers=headers,
            )
        if request.headers.get("X-Edgerun-Confirm") != object_id:
            return web.json_response(
                {"error": f"confirm the action: send X-Edgerun-Confirm: {object_id[:128]}"}, status=400, headers=headers
            )
        by = f"operator:{session.user}" if session is not None else "operator"
        try:
            ack = self.station.ack(object_id, by=by)
        except ActionRefused as err:
            return web.json_response({"error": str(err)}, status=err.status, headers=headers)
        return web.json_response({"ok": True, **ack}, headers=headers)
