"""``edgerun bench --ota``: what a signed model update costs, measured side by side in one run.

* delta size / full size for a model whose output heads alone changed (a) and one whose every weight
  changed slightly (b), both derived from the real BlazeFace weights; time to make and apply each
* apply time (verify delta hash + patch + verify target hash) for a 5 MB model (the pose detector,
  2.96 MB, padded to 5 MB with unused bytes: the interpreter ignores them, the patcher does not)
* peak RSS while patching, measured in a fresh process (VmHWM reset just before the patch)
* verify throughput: SHA-256 of payloads, and Ed25519 manifest checks per second
* swap gap: a real node takes a real update from a release directory; the longest interval between two
  published batches from the start of the update to its commit, against the normal interval before it
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from edgerun.models.demo import ensure_demo_bundle
from edgerun.ota.delta import apply_delta, make_delta
from edgerun.ota.payload import pack_bundle, sha256_bytes
from edgerun.ota.variants import derive_bundle, is_head, perturb_weights

MODEL_5MB = 5 * 1000 * 1000
PATCH_CHILD = r"""
import sys, time, json, hashlib
from edgerun.ota.delta import apply_delta
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith(("VmHWM", "VmRSS")):
            yield line.split()[0][:-1], int(line.split()[1]) / 1024
old = open(sys.argv[1], "rb").read(); patch = open(sys.argv[2], "rb").read()
size, algorithm, target = int(sys.argv[3]), sys.argv[4], sys.argv[5]
open("/proc/self/clear_refs", "w").write("5")  # reset the peak to the current RSS
before = dict(hwm())["VmRSS"]
t0 = time.perf_counter()
assert hashlib.sha256(old).hexdigest()
new = apply_delta(old, patch, algorithm, size)
assert hashlib.sha256(new).hexdigest() == target
seconds = time.perf_counter() - t0
print(json.dumps({"rss_before_mb": before, "peak_rss_mb": dict(hwm())["VmHWM"], "seconds": seconds}))
"""


def _variant_payloads(tmp: Path, base_name: str, pad_to: int = 0) -> dict[str, Any]:
    """(base payload, {case: new payload}) for the head-only and dense fine-tune cases."""
    bundle = ensure_demo_bundle(base_name)
    tflite = bundle.variant_path("tflite")
    assert tflite is not None  # the demo bundles all have one
    raw = tflite.read_bytes()
    filler = (raw * (1 + pad_to // max(1, len(raw))))[: max(0, pad_to - len(raw))]
    base = derive_bundle(bundle, tmp / f"{base_name}-v1", 1, raw + filler)
    cases = {
        "head_only": perturb_weights(raw, is_head, 1e-2, seed=1)[0],
        "all_weights_1e-3": perturb_weights(raw, lambda name: True, 1e-3, seed=2)[0],
        "all_weights_1e-2": perturb_weights(raw, lambda name: True, 1e-2, seed=3)[0],
    }
    out: dict[str, Any] = {"base": pack_bundle(base.root), "model_bytes": len(raw) + len(filler), "cases": {}}
    for case, data in cases.items():
        new = derive_bundle(bundle, tmp / f"{base_name}-{case}", 2, data + filler)
        out["cases"][case] = pack_bundle(new.root)
    return out


def _patch_in_child(tmp: Path, old: bytes, patch: bytes, algorithm: str, new: bytes) -> dict[str, float]:
    (tmp / "old.bin").write_bytes(old)
    (tmp / "patch.bin").write_bytes(patch)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            PATCH_CHILD,
            str(tmp / "old.bin"),
            str(tmp / "patch.bin"),
            str(len(new)),
            algorithm,
            sha256_bytes(new),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"patch child failed: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout)


def bench_deltas(tmp: Path, base_name: str, pad_to: int = 0) -> dict[str, Any]:
    data = _variant_payloads(tmp, base_name, pad_to)
    old = data["base"]
    result: dict[str, Any] = {"model": base_name, "model_bytes": data["model_bytes"], "payload_bytes": len(old)}
    for case, new in data["cases"].items():
        row: dict[str, Any] = {"full_bytes": len(new)}
        for algorithm in ("bsdiff4", "zstd"):
            t0 = time.perf_counter()
            patch = make_delta(old, new, algorithm)
            made = time.perf_counter() - t0
            t0 = time.perf_counter()
            assert sha256_bytes(patch)
            out = apply_delta(old, patch, algorithm, len(new))
            ok = sha256_bytes(out) == sha256_bytes(new)
            applied = time.perf_counter() - t0
            child = _patch_in_child(tmp, old, patch, algorithm, new)
            row[algorithm] = {
                "delta_bytes": len(patch),
                "ratio": round(len(patch) / len(new), 4),
                "make_s": round(made, 3),
                "apply_s": round(applied, 3),  # verify delta + patch + verify target, in this process
                "apply_ok": ok,
                "patch_peak_rss_mb": round(child["peak_rss_mb"], 1),
                "patch_rss_increase_mb": round(child["peak_rss_mb"] - child["rss_before_mb"], 1),
            }
        best = min(("bsdiff4", "zstd"), key=lambda a: row[a]["delta_bytes"])
        row["best"] = best if row[best]["delta_bytes"] < len(new) else "full"
        row["best_ratio"] = row[best]["ratio"]
        result[case] = row
    return result


def bench_verify(payload: bytes) -> dict[str, float]:
    from edgerun.ota.minisign import SecretKey

    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < 1.0:
        sha256_bytes(payload)
        n += 1
    mb_s = n * len(payload) / (time.perf_counter() - t0) / 1e6
    key = SecretKey.generate()
    manifest = b'{"name":"m","version":2}' * 20
    sig = key.sign(manifest, "name:m\tversion:2")
    t0 = time.perf_counter()
    checks = 0
    while time.perf_counter() - t0 < 0.5:
        sig.verify(manifest, key.public_key)
        checks += 1
    return {"sha256_mb_s": round(mb_s, 1), "manifest_verifies_per_s": round(checks / (time.perf_counter() - t0), 1)}


def bench_swap_gap(tmp: Path, fps: float, health_window_s: float = 2.0) -> dict[str, Any]:
    """A real node (replay source at ``fps``) takes a real delta update; inter-batch intervals around it."""
    from edgerun.config import parse_config
    from edgerun.node import Node
    from edgerun.ota.minisign import SecretKey
    from edgerun.ota.release import ReleaseSpec, build_release
    from edgerun.ota.trust import keys_trusted_comment, make_key_list

    bundle = ensure_demo_bundle("blazeface_short")
    tflite = bundle.variant_path("tflite")
    assert tflite is not None  # the demo bundles all have one
    raw = tflite.read_bytes()
    v2 = derive_bundle(bundle, tmp / "swap-v2", 2, perturb_weights(raw, is_head, 1e-2, seed=5)[0])
    root, release = SecretKey.generate(), SecretKey.generate()
    rel_dir = tmp / "swap-releases"
    rel_dir.mkdir()
    (tmp / "root.pub").write_text(root.public_key.to_text())
    keys = make_key_list([release.public_key], 1, 30)
    (rel_dir / "keys.json").write_bytes(keys)
    (rel_dir / "keys.json.minisig").write_text(root.sign(keys, keys_trusted_comment(1, int(time.time()))).to_text())
    cfg = parse_config(
        {
            "node": {"id": "bench-ota", "log_level": "warning"},
            "source": {"kind": "replay", "fps": fps},
            "sinks": {"jsonl": {"path": str(tmp / "swap.jsonl")}},
            "service": {"http_enabled": False},
            "ota": {
                "enabled": True,
                "state_dir": str(tmp / "swap-state"),
                "root_keys": [str(tmp / "root.pub")],
                "watch_dir": str(rel_dir),
                "poll_interval_s": 0.1,
                "health_window_s": health_window_s,
                "latency_factor": 20.0,
            },
        }
    )
    stamps: list[tuple[float, int]] = []
    node = Node(cfg, observers=[lambda b: stamps.append((time.monotonic(), b.model_version))])
    marks: dict[str, float] = {}

    # Built beforehand and moved into place: making the delta in this process would steal the CPU being measured.
    build_release(v2.root, tmp / "swap-prepared", ReleaseSpec(), base_path=bundle.root, key=release)

    def publish_later() -> None:
        time.sleep(4.5)
        marks["publish"] = time.monotonic()
        os.replace(tmp / "swap-prepared" / bundle.name, rel_dir / bundle.name)

    def run_node() -> None:
        asyncio.run(node.run(seconds=8.0 + health_window_s, install_signals=False))

    publisher = threading.Thread(target=publish_later)
    publisher.start()
    run_node()
    publisher.join()
    t_pub = marks["publish"]
    before = [b - a for (a, _), (b, _) in zip(stamps, stamps[1:]) if b < t_pub and a > t_pub - 2.5]
    first_v2 = next((t for t, v in stamps if v == 2), None)
    if first_v2 is None:
        raise RuntimeError("the node never served v2 during the swap benchmark")
    t_end = first_v2 + 1.0
    window = [b - a for (a, _), (b, _) in zip(stamps, stamps[1:]) if t_pub <= b <= t_end]
    # The same length of time just before the update: how long the longest interval is anyway on this machine.
    quiet = [b - a for (a, _), (b, _) in zip(stamps, stamps[1:]) if t_pub - (t_end - t_pub) <= b < t_pub]
    normal = statistics.median(before)
    gap = max(window)
    return {
        "source_fps": fps,
        "normal_interval_ms": round(normal * 1000, 1),
        "swap_gap_ms": round(gap * 1000, 1),
        "swap_gap_vs_normal": round(gap / normal, 2),
        "longest_interval_without_update_ms": round(max(quiet) * 1000, 1) if quiet else None,
        "update_to_new_model_s": round(first_v2 - t_pub, 3),
        "batches": len(stamps),
        "final_version": stamps[-1][1],
    }


def run_ota_bench(quick: bool = False) -> dict[str, Any]:
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="edgerun-bench-ota-") as tmpdir:
        tmp = Path(tmpdir)
        result["blazeface"] = bench_deltas(_mk(tmp / "bf"), "blazeface_short")
        result["model_5mb"] = bench_deltas(_mk(tmp / "p5"), "pose_detector", pad_to=MODEL_5MB)
        payload = (tmp / "p5" / "pose_detector-v1" / "model.tflite").read_bytes()
        result["verify"] = bench_verify(payload)
        result["swap_30fps"] = bench_swap_gap(_mk(tmp / "s30"), 30.0)
        if not quick:
            result["swap_unpaced"] = bench_swap_gap(_mk(tmp / "s0"), 0.0)
    a = result["blazeface"]["head_only"]
    big = result["model_5mb"]["head_only"]
    best_big = big[big["best"]] if big["best"] != "full" else big["bsdiff4"]
    model_mb = result["model_5mb"]["model_bytes"] / 1e6
    result["targets"] = {
        "a_delta_le_15pct": a["best_ratio"] <= 0.15,
        "apply_5mb_le_1s": best_big["apply_s"] <= 1.0,
        "swap_gap_le_2x": result["swap_30fps"]["swap_gap_vs_normal"] <= 2.0,
        "patch_rss_increase_le_2x_model_plus_64mb": best_big["patch_rss_increase_mb"] <= 2 * model_mb + 64,
    }
    return result


def _mk(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_ota_bench_command(args: argparse.Namespace) -> int:
    result = run_ota_bench(quick=getattr(args, "seconds", 8.0) < 2.0)
    from edgerun.bench.pipeline import emit_result

    emit_result(result, args)
    return 0
