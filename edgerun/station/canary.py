"""Whether a canary should be halted: its rollback and failure rate, and its fps and detection rate against the rest.

Pure: it reads node views and returns a verdict with the figures behind it,
so the station, ``edgerun fleet status`` and the tests judge alike. The
canary is every node that took the new version (running it, or rolled it
back, or failed to install it); the baseline is every live node of the same
model that never took it. Performance is only compared when both sides have
measured rates, and detections only when the baseline sees enough to compare.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from edgerun.station.model import NodeView

LIVE_STATES = ("running", "degraded", "online", "starting", "unknown")


@dataclass(frozen=True)
class CanaryPolicy:
    max_failure_rate: float = 0.34  # rolled back or refused as broken / canary nodes that tried
    min_fps_ratio: float = 0.7  # canary median fps / baseline median fps
    min_detection_ratio: float = 0.5  # canary median detections per frame / baseline's
    min_baseline_detection_rate: float = 0.05  # below this the baseline sees too little to compare with
    min_attempts: int = 1


@dataclass(frozen=True)
class Verdict:
    halt: bool
    reason: str = ""
    figures: dict[str, Any] = field(default_factory=dict)


def judge(
    model: str, version: int, nodes: Iterable[NodeView], now: float, stale_s: float, policy: CanaryPolicy | None = None
) -> Verdict:
    policy = policy or CanaryPolicy()
    attempted = failed = 0
    canary_fps: list[float] = []
    canary_det: list[float] = []
    base_fps: list[float] = []
    base_det: list[float] = []
    for node in nodes:
        if node.model != model:
            continue
        outcome = node.ota_outcomes.get(version)
        live = node.state(now, stale_s) in LIVE_STATES
        took = node.model_version == version or outcome is not None
        if took:
            attempted += 1
            failed += outcome is not None and outcome != "committed"
            if live and node.model_version == version:
                if node.fps is not None:
                    canary_fps.append(node.fps)
                if node.detection_rate is not None:
                    canary_det.append(node.detection_rate)
        elif live and node.model_version is not None and node.model_version < version:
            if node.fps is not None:
                base_fps.append(node.fps)
            if node.detection_rate is not None:
                base_det.append(node.detection_rate)
    figures: dict[str, Any] = {
        "attempted": attempted,
        "failed": failed,
        "canary_nodes": len(canary_fps),
        "baseline_nodes": len(base_fps),
    }
    if attempted >= policy.min_attempts and attempted:
        rate = failed / attempted
        figures["failure_rate"] = round(rate, 3)
        if rate > policy.max_failure_rate:
            return Verdict(
                True,
                f"{failed} of {attempted} canary nodes rolled back or could not run v{version} "
                f"({rate:.0%} > {policy.max_failure_rate:.0%})",
                figures,
            )
    if canary_fps and base_fps:
        c, b = statistics.median(canary_fps), statistics.median(base_fps)
        figures.update(canary_fps=round(c, 2), baseline_fps=round(b, 2))
        if b > 0 and c / b < policy.min_fps_ratio:
            return Verdict(
                True,
                f"fps {c:.1f} on v{version} against {b:.1f} on the nodes not updated "
                f"({c / b:.2f}x < {policy.min_fps_ratio:.2f}x)",
                figures,
            )
    if canary_det and base_det:
        c, b = statistics.median(canary_det), statistics.median(base_det)
        figures.update(canary_detection_rate=round(c, 3), baseline_detection_rate=round(b, 3))
        if b >= policy.min_baseline_detection_rate and c / b < policy.min_detection_ratio:
            return Verdict(
                True,
                f"{c:.2f} detections per frame on v{version} against {b:.2f} on the nodes not "
                f"updated ({c / b:.2f}x < {policy.min_detection_ratio:.2f}x)",
                figures,
            )
    return Verdict(False, "", figures)
