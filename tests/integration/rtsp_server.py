"""A real RTSP camera for the tests: GStreamer's RTSP server (Debian's gir1.2-gst-rtsp-server-1.0).

Run with the system python3 (the venv cannot import ``gi``), as its own process so a test can SIGKILL it:

    /usr/bin/python3 tests/integration/rtsp_server.py --port P --image face.png --user U --password W

It serves one still image as H.264 at ``--fps`` on rtsp://127.0.0.1:P/cam, over TCP or UDP as the client
asks, behind HTTP basic authentication when ``--user`` is given, and prints ``READY`` once it listens.
"""

from __future__ import annotations

import argparse
import sys

import gi

gi.require_version("Gst", "1.0")
gi.require_version("GstRtspServer", "1.0")
from gi.repository import GLib, Gst, GstRtspServer  # noqa: E402


def launch_line(image: str, fps: int, width: int, height: int) -> str:
    # imagefreeze repeats the picture; x264 with a key frame every second, so a reconnecting client decodes fast.
    return (
        f"( filesrc location={image} ! pngdec ! imagefreeze ! videoconvert ! videoscale "
        f"! video/x-raw,format=I420,width={width},height={height},framerate={fps}/1 "
        f"! x264enc tune=zerolatency speed-preset=ultrafast key-int-max={fps} bitrate=1000 "
        "! rtph264pay name=pay0 pt=96 config-interval=1 )"
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--image", required=True)
    parser.add_argument("--fps", type=int, default=15)
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--user", default="")
    parser.add_argument("--password", default="")
    args = parser.parse_args()

    Gst.init(None)
    server = GstRtspServer.RTSPServer()
    server.set_address("127.0.0.1")
    server.set_service(str(args.port))
    factory = GstRtspServer.RTSPMediaFactory()
    factory.set_launch(launch_line(args.image, args.fps, args.width, args.height))
    factory.set_shared(True)  # one encoder however many clients (the node, doctor's probe)
    if args.user:
        auth = GstRtspServer.RTSPAuth()
        token = GstRtspServer.RTSPToken()
        token.set_string(GstRtspServer.RTSP_TOKEN_MEDIA_FACTORY_ROLE, "camera-user")
        auth.add_basic(GstRtspServer.RTSPAuth.make_basic(args.user, args.password), token)
        server.set_auth(auth)
        factory.add_role_from_structure(
            Gst.Structure.new_from_string(
                "camera-user, media.factory.access=(boolean)true, media.factory.construct=(boolean)true"
            )
        )
    server.get_mount_points().add_factory("/cam", factory)
    if server.attach(None) == 0:
        print(f"cannot listen on 127.0.0.1:{args.port}", file=sys.stderr, flush=True)
        return 1
    print("READY", flush=True)
    GLib.MainLoop().run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
