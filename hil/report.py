"""``DIR/report.json`` and ``DIR/report.html``: one self-contained page (PNG plots inline, no network needed).

Plots (matplotlib, Agg): end-to-end latency CDF per node; fps over time per node with the faults marked;
the scene map with ground truth, fleet objects and duplicates; each node's membership view over time
(members it holds alive); the OTA model version per node over time.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import MaxNLocator

from hil.scenario import Scenario


def write_report(out: Path, scenario: Scenario, result: dict[str, Any]) -> Path:
    (out / "report.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    page = out / "report.html"
    page.write_text(render_html(scenario, result), encoding="utf-8")
    return page


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _mark_faults(ax: Any, faults: list[list[Any]]) -> None:
    for at, kind, node in faults:
        ax.axvline(at, color="0.5", ls="--", lw=0.8)
        ax.text(at, ax.get_ylim()[1], f" {kind} {node}", rotation=90, va="top", ha="right", fontsize=7, color="0.3")


def plot_latency_cdf(series: dict[str, Any]) -> str:
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, values in sorted(series["latency_ms"].items()):
        if values:
            v = np.sort(np.asarray(values))
            ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=name)
    ax.set_xscale("log")
    ax.set_xlabel("end-to-end latency (ms): capture to observer")
    ax.set_ylabel("share of batches")
    ax.set_title("Latency CDF per node")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _png(fig)


def plot_fps(series: dict[str, Any]) -> str:
    fig, ax = plt.subplots(figsize=(9, 3.6))
    for name, points in sorted(series["fps"].items()):
        if points:
            t, n = zip(*points)
            ax.plot(t, n, label=name, lw=1)
    ax.set_xlabel("scenario time (s)")
    ax.set_ylabel("batches received per second")
    ax.set_title("fps per node, faults marked")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    _mark_faults(ax, series["faults"])
    return _png(fig)


def plot_map(result: dict[str, Any], radius_m: float) -> str:
    fig, ax = plt.subplots(figsize=(6, 6))
    fleet, series = result["fleet"], result["series"]
    truth = np.asarray(fleet.get("truth_points") or [], float).reshape(-1, 2)
    seen = set(fleet.get("seen_truth") or [])
    if truth.size:
        idx = np.arange(len(truth))
        labels = fleet.get("truth_labels") or ["face"] * len(truth)
        target = np.array([label == "face" for label in labels], bool)
        in_view = np.array([i in seen for i in idx], bool)
        ax.scatter(truth[~target, 0], truth[~target, 1], s=18, marker="s", c="0.75", label="other scene object")
        ax.scatter(
            truth[target & ~in_view, 0],
            truth[target & ~in_view, 1],
            s=40,
            facecolors="none",
            edgecolors="tab:blue",
            label="target (never in view)",
        )
        ax.scatter(truth[in_view, 0], truth[in_view, 1], s=40, c="tab:blue", label="target (in view)")
        for x, y in truth[in_view]:
            ax.add_patch(plt.Circle((x, y), radius_m, fill=False, color="tab:blue", alpha=0.25))
    objs = series["objects"]
    if objs:
        pts = np.asarray([[o[0], o[1]] for o in objs], float)
        dup = np.zeros(len(pts), bool)
        if truth.size:
            claimed: set[int] = set()
            for i, (x, y) in enumerate(pts):
                d = np.hypot(truth[:, 0] - x, truth[:, 1] - y)
                j = int(np.argmin(d))
                if d[j] <= radius_m:
                    dup[i] = j in claimed
                    claimed.add(j)
        ax.scatter(pts[~dup, 0], pts[~dup, 1], marker="x", c="tab:green", s=50, label="fleet object")
        if dup.any():
            ax.scatter(pts[dup, 0], pts[dup, 1], marker="x", c="tab:red", s=70, label="duplicate report")
    ax.set_aspect("equal", adjustable="datalim")
    ax.set_xlabel("east (m)")
    ax.set_ylabel("north (m)")
    ax.set_title("Scene: ground truth, fleet objects, duplicates")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    return _png(fig)


def plot_membership(series: dict[str, Any]) -> str:
    fig, ax = plt.subplots(figsize=(9, 3.2))
    for name, points in sorted(series["alive_members"].items()):
        if points:
            t, n = zip(*points)
            ax.step(t, n, where="post", label=name, lw=1)
    ax.set_xlabel("scenario time (s)")
    ax.set_ylabel("members seen alive")
    ax.set_title("Membership view of each node")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    _mark_faults(ax, series["faults"])
    return _png(fig)


def plot_versions(series: dict[str, Any]) -> str:
    fig, ax = plt.subplots(figsize=(9, 2.8))
    names = sorted(series["version"])
    for k, name in enumerate(names):
        changes = series["version"][name]
        if changes:
            t, v = zip(*changes)
            ax.step([*t, max(t[-1], 1)], [*v, v[-1]], where="post", label=name, lw=1.5, alpha=0.8)
            ax.plot(t, np.asarray(v) + 0.02 * k, "o", ms=3)
    ax.set_xlabel("scenario time (s)")
    ax.set_ylabel("model version")
    ax.set_title("OTA: model version per node")
    locator = ax.yaxis.get_major_locator()
    if isinstance(locator, MaxNLocator):  # the default AutoLocator is one; the base Locator takes no integer=
        locator.set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    _mark_faults(ax, [f for f in series["faults"] if f[1].startswith("ota")])
    return _png(fig)


def _unreported(fleet: dict[str, Any]) -> str:
    """The faces in view that no fleet object reported, by cause: never detected (the detector's misses, with
    the frames and sizes they were in view at) and detected but not reported (dedup's losses: must be none)."""
    never = fleet.get("never_detected") or []
    lost = fleet.get("detected_not_reported") or []
    if not never and not lost:
        return "<p>None: every face some drone had in view was reported.</p>"
    rows = [
        [
            str(e["truth"]),
            "never detected",
            f"{e['frames_in_view']} frames in view, at most {_fmt(e['height_px_max'])} px tall: "
            + html.escape(", ".join(f"{f['drone']}#{f['seq']} ({f['height_px']:g} px)" for f in e["frames"]))
            + (" ..." if e["frames_in_view"] > len(e["frames"]) else ""),
        ]
        for e in never
    ]
    for e in lost:
        dedup = e.get("cause") == "dedup"
        cause = "<b class='bad'>detected, not reported</b>" if dedup else html.escape(f"detected; {e.get('cause')}")
        first = html.escape(f"{e['first'][0]}#{e['first'][1]}")
        rows.append([str(e["truth"]), cause, f"{e['detections']} detections by {html.escape(', '.join(e['by']))}, "
                     f"first {first}"])  # fmt: skip
    return _table(["face", "cause", "detail"], rows)


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:g}"
    return html.escape(str(value))


def render_html(scenario: Scenario, result: dict[str, Any]) -> str:
    series, verdict = result["series"], result["verdict"]
    ok = verdict["passed"]
    criteria = [
        [
            html.escape(c["name"]),
            _fmt(c["value"]),
            _fmt(c["limit"]),
            '<b class="ok">pass</b>' if c["passed"] else '<b class="bad">FAIL</b>',
            _fmt(c.get("missed_by")) if not c["passed"] else "",
            html.escape(c.get("detail", "")),
        ]
        for c in result["criteria"]
    ]
    nodes = [
        [
            html.escape(name),
            n["batches"],
            _fmt(n["fps"]),
            _fmt(n["latency_p50_ms"]),
            _fmt(n["latency_p99_ms"]),
            _fmt(n["max_outage_s"]),
            len(n["exits"]),
            n["unexpected_exits"],
            _fmt(n["final_version"]),
            _fmt((n.get("loss") or {}).get("missing")),
            _fmt((n.get("loss") or {}).get("counted_dropped")),
            _fmt(", ".join(f"{r['why']}: {r['restart_s']} s" for r in n["restarts"]) or ""),
        ]
        for name, n in result["per_node"].items()
    ]
    happened = {True: "yes", False: "<b class='bad'>no</b>", None: "n/a"}
    faults = [
        [
            f["index"],
            _fmt(f["at_s"]),
            html.escape(f["kind"]),
            html.escape(f.get("node") or ""),
            _fmt(f.get("duration_s")),
            happened[f.get("happened")] if f.get("injectable", True) else "not injectable",
            html.escape(f.get("detail") or f.get("why_not") or ""),
        ]
        for f in result["faults"]
    ]
    fleet = result["fleet"]
    ota = result["ota"]
    notes = [
        f"Rig: {html.escape(str(result['mode']))}"
        + (f" ({html.escape(result['mode_reason'])})" if result.get("mode_reason") else ""),
        f"Network impairment: {html.escape(str(result.get('impairment')))}; latency/jitter: "
        f"{html.escape(str(result.get('latency_jitter')))}",
    ]
    notes += [f"Not injectable: {html.escape(line)}" for line in result["not_injectable"]]
    if result["interrupted"]:
        notes.insert(0, "<b class='bad'>Interrupted: partial run</b>")
    images = [
        plot_fps(series),
        plot_latency_cdf(series),
        plot_map(result, scenario.swarm.radius_m),
        plot_membership(series),
        plot_versions(series),
    ]
    imgs = "".join(f'<img alt="plot" src="data:image/png;base64,{b64}">' for b64 in images)
    recall = fleet.get("object_recall")
    summary = (
        f"fleet objects {fleet.get('fleet_objects')}, object recall "
        f"{'n/a' if recall is None else f'{recall:.3f}'} ({fleet.get('objects_found')}/"
        f"{fleet.get('objects_seen')} targets seen of {fleet.get('targets_in_scene')} in the scene, "
        f"{fleet.get('targets_declared')} declared), duplicate "
        f"reports {fleet.get('duplicate_reports')}"
    )
    if ota is not None:
        summary += f"; OTA v{ota['version']} convergence {_fmt(ota['convergence_s'])} s"
    unreported = _unreported(fleet)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>HIL report: {html.escape(scenario.name)}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 1.2em 2em; color: #222; }}
.banner {{ padding: .6em 1em; border-radius: 6px; font-weight: 600; color: #fff;
  background: {"#2e7d32" if ok else "#c62828"}; }}
table {{ border-collapse: collapse; margin: .6em 0 1.2em; font-size: 13px; }}
td, th {{ border: 1px solid #ccc; padding: 3px 7px; text-align: left; vertical-align: top; }}
th {{ background: #f2f2f2; }}
.ok {{ color: #2e7d32; }} .bad {{ color: #c62828; }}
img {{ max-width: 100%; margin: .4em .6em .4em 0; border: 1px solid #eee; }}
.grid {{ display: flex; flex-wrap: wrap; align-items: flex-start; }}
</style></head><body>
<h1>HIL scenario <code>{html.escape(scenario.name)}</code></h1>
<p>{html.escape(scenario.description)}</p>
<div class="banner">{html.escape(verdict["line"])}</div>
<p>{len(result["per_node"])} nodes, {result["duration_s"]:g} s; {summary}.</p>
<ul>{"".join(f"<li>{n}</li>" for n in notes)}</ul>
<h2>Pass criteria</h2>
{_table(["criterion", "value", "limit", "result", "missed by", "detail"], criteria)}
<h2>Faces in view, never reported</h2>
{unreported}
<h2>Plots</h2><div class="grid">{imgs}</div>
<h2>Nodes</h2>
{
        _table(
            [
                "node",
                "batches",
                "fps",
                "p50 ms",
                "p99 ms",
                "max unexplained silence s",
                "exits",
                "unexpected",
                "final version",
                "lost",
                "counted dropped",
                "restarts",
            ],
            nodes,
        )
    }
<h2>Faults</h2>
{_table(["#", "at s", "kind", "node", "duration s", "happened", "detail"], faults)}
</body></html>
"""
