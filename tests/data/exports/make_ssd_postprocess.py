"""Remake ``ssd_postprocess_float32.tflite``: an SSD head ending in TFLite's ``TFLite_Detection_PostProcess``.

No PyPI wheel was found that ships an SSD MobileNet or EfficientDet-Lite
``.tflite`` (docs/own-model.md lists the ones searched), so this file is made
the way the TensorFlow Object Detection API makes them
(``object_detection/export_tflite_graph_lib_tf2.py``): the box encodings, the
class scores and the anchors go into a ``tf.function`` marked
``experimental_implements`` with the op's name and attributes, which
TensorFlow's own TFLite converter fuses into the ``TFLite_Detection_PostProcess``
custom operator (``allow_custom_ops``). The attributes are the Object Detection
API's defaults (10 detections, fast NMS, IoU 0.6, box scales 10/10/5/5); 3
classes plus background; input 128x128 NHWC float like the other exports here.

The network is UNTRAINED (seeded random convolutions, two feature maps of 16x16
and 8x8 cells, two anchors a cell: 640 anchors), so its boxes mean nothing; the
op's outputs are what matters: boxes ``[1, 10, 4]`` (ymin, xmin, ymax, xmax,
normalised), classes ``[1, 10]``, scores ``[1, 10]``, count ``[1]``, under
names (``PartitionedCall:N``) that do not say which is which.

Run from the repository root with TensorFlow (the venv of make_exports.py, its
docstring says how to make it; never a dependency of ``make test``):

    /work/exporters-venv/bin/python tests/data/exports/make_ssd_postprocess.py

Written with tensorflow 2.19.1 (tensorflow-cpu 2.19.0) on x86_64 Python 3.11.
The file is the same byte for byte on every run (fixed seed, no date stamped).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tensorflow as tf

OUT = Path(__file__).resolve().parent / "ssd_postprocess_float32.tflite"
SIZE = 128
CLASSES = 3
# Feature maps (cells a side) and the anchor sizes of each (square, relative to the input).
FEATURE_MAPS = ((16, (0.15, 0.25)), (8, (0.4, 0.6)))

# The Object Detection API's defaults for the op (export_tflite_graph_lib_tf2.py, ssd.proto box coder scales).
POSTPROCESS = " ".join(
    [
        'name: "TFLite_Detection_PostProcess"',
        'attr { key: "max_detections" value { i: 10 } }',
        'attr { key: "max_classes_per_detection" value { i: 1 } }',
        'attr { key: "use_regular_nms" value { b: false } }',
        'attr { key: "nms_score_threshold" value { f: 0.300000 } }',
        'attr { key: "nms_iou_threshold" value { f: 0.600000 } }',
        'attr { key: "y_scale" value { f: 10.000000 } }',
        'attr { key: "x_scale" value { f: 10.000000 } }',
        'attr { key: "h_scale" value { f: 5.000000 } }',
        'attr { key: "w_scale" value { f: 5.000000 } }',
        f'attr {{ key: "num_classes" value {{ i: {CLASSES} }} }}',
    ]
)


def anchors() -> np.ndarray:
    """(y_center, x_center, h, w) per anchor, normalised, in the order the heads emit boxes."""
    rows = []
    for cells, sizes in FEATURE_MAPS:
        for y in range(cells):
            for x in range(cells):
                for size in sizes:
                    rows.append([(y + 0.5) / cells, (x + 0.5) / cells, size, size])
    return np.array(rows, np.float32)


def main() -> None:
    rng = np.random.default_rng(0)

    def kernel(cin: int, cout: int) -> tf.Tensor:
        return tf.constant(rng.normal(0.0, np.sqrt(2.0 / (9 * cin)), (3, 3, cin, cout)).astype(np.float32))

    backbone = [kernel(3, 8), kernel(8, 16), kernel(16, 16), kernel(16, 16)]
    box_heads = [kernel(16, 2 * 4), kernel(16, 2 * 4)]
    class_heads = [kernel(16, 2 * (CLASSES + 1)), kernel(16, 2 * (CLASSES + 1))]
    anchor_table = tf.constant(anchors())

    @tf.function(experimental_implements=POSTPROCESS)
    def postprocess(box_encodings: tf.Tensor, class_predictions: tf.Tensor, anchors: tf.Tensor) -> tuple:
        # A stand-in body, as the Object Detection API writes it: the converter replaces the whole
        # function by the fused operator.
        boxes = tf.constant(0.0, tf.float32, name="boxes")
        scores = tf.constant(0.0, tf.float32, name="scores")
        classes = tf.constant(0.0, tf.float32, name="classes")
        count = tf.constant(0.0, tf.float32, name="num_detections")
        return boxes, classes, scores, count

    def conv(x: tf.Tensor, k: tf.Tensor, stride: int) -> tf.Tensor:
        return tf.nn.conv2d(x, k, stride, "SAME")

    @tf.function(input_signature=[tf.TensorSpec([1, SIZE, SIZE, 3], tf.float32)])
    def serve(images: tf.Tensor) -> tuple:
        x = tf.nn.relu(conv(images, backbone[0], 2))
        x = tf.nn.relu(conv(x, backbone[1], 2))
        f1 = tf.nn.relu(conv(x, backbone[2], 2))  # 16x16
        f2 = tf.nn.relu(conv(f1, backbone[3], 2))  # 8x8
        boxes = tf.concat([tf.reshape(conv(f, k, 1), [1, -1, 4]) for f, k in zip((f1, f2), box_heads)], axis=1)
        logits = [tf.reshape(conv(f, k, 1), [1, -1, CLASSES + 1]) for f, k in zip((f1, f2), class_heads)]
        return postprocess(boxes, tf.sigmoid(tf.concat(logits, axis=1)), anchor_table)

    module = tf.Module()
    module.serve = serve
    # With the module, the converter goes through a SavedModel and keeps the marked function to fuse.
    converter = tf.lite.TFLiteConverter.from_concrete_functions([serve.get_concrete_function()], module)
    converter.allow_custom_ops = True
    data = converter.convert()
    if b"TFLite_Detection_PostProcess" not in data:
        raise SystemExit("the converter did not fuse TFLite_Detection_PostProcess")
    OUT.write_bytes(data)
    print(f"{OUT.name}: {len(data)} bytes")


if __name__ == "__main__":
    main()
