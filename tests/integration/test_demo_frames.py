"""The demo's pictures: the frame with the most detections (not the last one) and a contact sheet."""

from __future__ import annotations

import asyncio
import json

import cv2
import numpy as np
from brokers import make_batch

from edgerun.demo import FrameChooser, demo_config, run_demo
from edgerun.service.snapshot import BOX_COLOUR


def test_the_chooser_keeps_the_most_detections_and_a_bounded_spread():
    chooser = FrameChooser(capacity=8)
    counts = [0, 2, 5, 5, 1] + [1] * 95
    for seq, n in enumerate(counts):
        batch = make_batch(seq, n=n)
        chooser(batch)
        batch.detections.boxes[...] = -1.0  # a decoder reusing its buffers must not change what was kept
    # Of the two frames with 5 detections, the more confident one.
    sums = {seq: float(make_batch(seq, n=5).detections.scores.sum()) for seq in (2, 3)}
    assert chooser.best is not None and chooser.best.meta.seq == max(sums, key=sums.__getitem__)
    assert chooser.best.detections.boxes.min() >= 0.0
    assert len(chooser.spread) < 8
    sheet = chooser.sheet_batches(4)
    seqs = [b.meta.seq for b in sheet]
    assert len(sheet) == 4 and seqs == sorted(seqs) and seqs[0] == 0 and seqs[-1] >= 80  # across the flight


def test_demo_saves_the_busiest_frame_and_a_contact_sheet(tmp_path, blazeface_bundle):
    out = tmp_path / "demo"
    out.mkdir()
    cfg = demo_config(out, model=str(blazeface_bundle.root), fps=15.0)
    summary = asyncio.run(run_demo(cfg, 4.0, out, live=False))
    batches = [json.loads(line) for line in (out / "detections.jsonl").read_text().splitlines()]
    batches = [b for b in batches if b["schema"] == "edgerun.detections/1"]
    most = max(len(b["detections"]) for b in batches)
    assert most > 0
    chosen = summary["snapshot_frame"]
    assert chosen["detections"] == most
    assert len(next(b for b in batches if b["seq"] == chosen["seq"])["detections"]) == most
    snapshot = cv2.imread(str(out / "snapshot.png"))
    assert snapshot.shape == (480, 640, 3)
    assert np.all(snapshot == BOX_COLOUR, axis=2).sum() > 0  # its detections are drawn
    sheet = cv2.imread(str(out / "contact_sheet.png"))
    assert sheet.shape == (2 * 240, 3 * 320, 3)  # six frames from across the flight, 3 per row
