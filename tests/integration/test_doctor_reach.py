"""``edgerun doctor``: the cameras this user can open, and whether a config's broker and camera answer.

Real parts: device nodes made with mknod and probed as another user (setpriv), a real mosquitto and a real RTSP
camera (tests/integration/rtsp_camera.py) each up and then down, a real mosquitto with TLS and a password file
that the node's login must pass, the real CLI as a subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import cv2
import pytest
import tomli_w

from edgerun.testing.ports import free_port
from tests.integration.brokers import BrokerTls, find_mosquitto, make_certs, make_other_ca, run_mosquitto
from tests.integration.rtsp_camera import RtspCamera, require_rtsp_server

REPO = Path(__file__).resolve().parents[2]
PASSWORD = "doctor-s3cret"
NOBODY = 65534


def probe_as(dev_dir: Path, *groups: int) -> list[dict]:
    """``probe_cameras(dev_dir)`` run by the user nobody, member of ``groups`` only."""
    group_opts = [f"--groups={','.join(map(str, groups))}"] if groups else ["--clear-groups"]
    code = (
        "import json, pathlib; from edgerun.doctor import probe_cameras; "
        f"print(json.dumps(probe_cameras(pathlib.Path({str(dev_dir)!r}))))"
    )
    done = subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", *group_opts, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        check=True,
    )
    return json.loads(done.stdout)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="mknod and setpriv need root")
def test_doctor_says_which_cameras_this_user_may_open_and_why_not():
    import grp

    video = grp.getgrnam("video").gr_gid
    with tempfile.TemporaryDirectory() as tmp:  # not pytest's tmp_path: nobody must be able to enter it
        dev = Path(tmp)
        dev.chmod(0o755)
        # Character devices 1:3 (null) stand in for V4L2 nodes: the kernel checks permissions on open the same way.
        for name, mode in (("video0", 0o660), ("video2", 0o666), ("video10", 0o600)):
            os.mknod(dev / name, stat.S_IFCHR | mode, os.makedev(1, 3))
            os.chown(dev / name, 0, video)
            (dev / name).chmod(mode)
        (dev / "video-meta").touch()  # not a videoN node: not listed

        outsider = probe_as(dev)
        assert [c["path"] for c in outsider] == [str(dev / n) for n in ("video0", "video2", "video10")]
        by_name = {Path(c["path"]).name: c for c in outsider}
        assert by_name["video2"]["ok"] and by_name["video2"]["group"] == "video"
        assert not by_name["video0"]["ok"]
        assert by_name["video0"]["why"] == (
            "permission denied: this user is not in group video (sudo usermod -aG video $USER, then log in again)"
        )
        member = {Path(c["path"]).name: c for c in probe_as(dev, video)}
        assert member["video0"]["ok"]  # the group is what it needed
        # Owner-only: being in the group does not help, and the reason does not pretend it would.
        assert not member["video10"]["ok"] and member["video10"]["why"] == "permission denied (0o600, group video)"


def doctor(config: Path) -> tuple[int, dict, str]:
    done = subprocess.run(
        [sys.executable, "-m", "edgerun", "doctor", "-c", str(config), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    return done.returncode, json.loads(done.stdout), done.stdout + done.stderr


def test_doctor_checks_the_configured_broker_and_rtsp_camera_up_and_down(tmp_path, astronaut_rgb):
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed: run .ci/install-system-deps")
    require_rtsp_server()
    image = tmp_path / "face.png"
    cv2.imwrite(str(image), cv2.cvtColor(astronaut_rgb, cv2.COLOR_RGB2BGR))
    camera = RtspCamera(free_port(), image, "viewer", PASSWORD)
    with run_mosquitto(workdir=tmp_path) as broker:
        config = tmp_path / "node.toml"
        config.write_text(
            f"""[source]
kind = "opencv"
uri = "{camera.url()}"
open_timeout_s = 3.0
[sinks.mqtt]
enabled = true
host = "127.0.0.1"
port = {broker.port}
"""
        )
        camera.start()
        try:
            code, report, text = doctor(config)
        finally:
            camera.kill()
        assert code == 0, text
        assert report["config"]["broker"] == {"address": f"127.0.0.1:{broker.port}", "ok": True, "state": "connected"}
        cam = report["config"]["camera"]
        assert cam["ok"] and cam["size"] == [640, 480], cam
        assert cam["source"] == f"stream 'rtsp://viewer:***@127.0.0.1:{camera.port}/cam' (ffmpeg)"
        assert PASSWORD not in text

        broker.stop()
        code, report, text = doctor(config)
    assert code == 1
    assert report["config"]["broker"] == {
        "address": f"127.0.0.1:{broker.port}",
        "ok": False,
        "state": "unreachable",
        "why": "connection refused",
    }
    assert report["config"]["camera"]["ok"] is False
    assert report["config"]["camera"]["why"] == (
        f"stream 'rtsp://viewer:***@127.0.0.1:{camera.port}/cam' (ffmpeg) could not be opened: connection refused"
    )
    assert PASSWORD not in text and "[tcp @" not in text


def test_doctor_text_names_the_unreachable_parts(tmp_path):
    config = tmp_path / "node.toml"
    port = free_port()  # nothing listens: both refused at once
    config.write_text(
        f"""[source]
kind = "opencv"
uri = "rtsp://viewer:{PASSWORD}@127.0.0.1:{port}/cam"
[sinks.mqtt]
enabled = true
port = {port}
"""
    )
    done = subprocess.run(
        [sys.executable, "-m", "edgerun", "doctor", "-c", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    assert f"  broker    no    127.0.0.1:{port} unreachable: connection refused" in lines
    assert any(line.startswith("  camera    no    stream 'rtsp://viewer:***@") for line in lines)
    assert any(line.startswith("  cameras   ") for line in lines)
    assert PASSWORD not in done.stdout + done.stderr


REFUSED_LOGIN = ("(Not authorized)", "(Bad user name or password)")  # mosquitto's answer depends on its version


def test_doctor_logs_in_to_the_broker_with_the_nodes_credentials_and_tls(tmp_path):
    """A TCP connect is not a login: doctor sends the node's own MQTT 5 CONNECT (username, password, TLS CA) and
    says "connected", "login refused (reason)" or "unreachable (why)". The broker listens with TLS and a
    password file, so a wrong password, a CA that did not sign the broker, and plain TCP to the TLS port all
    connect at the TCP level and must still be reported as failures."""
    if find_mosquitto() is None or shutil.which("mosquitto_passwd") is None or shutil.which("openssl") is None:
        pytest.skip("mosquitto or openssl is not installed: run .ci/install-system-deps")
    # Not under pytest's tmp_path (0700 root): a broker started as root reads its password file as mosquitto.
    with tempfile.TemporaryDirectory(prefix="edgerun-doctor-login-") as tmp:
        passwd = Path(tmp) / "passwd"
        subprocess.run(["mosquitto_passwd", "-b", "-c", str(passwd), "drone-7", PASSWORD], check=True,
                       capture_output=True, timeout=30)  # fmt: skip
        os.chmod(passwd, 0o644)
        certs = make_certs(tmp_path / "pki")
        other_ca = make_other_ca(tmp_path / "other")
        tls = BrokerTls(str(certs.ca), str(certs.server_cert), str(certs.server_key))
        with run_mosquitto(tls=tls, workdir=tmp, extra=[f"password_file {passwd}"]) as broker:

            def doctor_with(**mqtt: str) -> tuple[int, dict, str]:
                config = tmp_path / f"node{len(list(tmp_path.glob('node*.toml')))}.toml"
                settings = {"enabled": True, "host": "127.0.0.1", "port": broker.port, **mqtt}
                config.write_text(
                    tomli_w.dumps({"source": {"kind": "images", "path": "."}, "sinks": {"mqtt": settings}})
                )
                return doctor(config)

            address = f"127.0.0.1:{broker.port}"
            code, report, text = doctor_with(username="drone-7", password=PASSWORD, tls_ca=str(certs.ca))
            assert code == 0, text
            assert report["config"]["broker"] == {"address": address, "ok": True, "state": "connected"}

            code, report, text = doctor_with(username="drone-7", password="wrong", tls_ca=str(certs.ca))
            assert code == 1, text
            broker_said = report["config"]["broker"]
            assert broker_said["state"] == "login_refused" and not broker_said["ok"], broker_said
            assert broker_said["why"].startswith("refused the connection ") and broker_said["why"].endswith(
                REFUSED_LOGIN
            ), broker_said

            code, report, text = doctor_with(username="drone-7", password=PASSWORD, tls_ca=str(other_ca))
            broker_said = report["config"]["broker"]
            assert code == 1 and broker_said["state"] == "unreachable", text
            assert broker_said["why"].startswith("TLS: broker certificate not trusted"), broker_said

            code, report, text = doctor_with(username="drone-7", password=PASSWORD)  # plain MQTT to the TLS port
            broker_said = report["config"]["broker"]
            assert code == 1 and broker_said["state"] == "unreachable", text
            assert PASSWORD not in text

            missing = tmp_path / "no-such-ca.pem"
            code, report, text = doctor_with(username="drone-7", password=PASSWORD, tls_ca=str(missing))
            broker_said = report["config"]["broker"]
            assert code == 1 and broker_said["state"] == "config_error", text
            assert broker_said["why"].startswith(f"sinks.mqtt.tls_ca: cannot read {missing}"), broker_said

            config = tmp_path / "node1.toml"  # the wrong password again, for the text report
            done = subprocess.run(
                [sys.executable, "-m", "edgerun", "doctor", "-c", str(config)],
                capture_output=True,
                text=True,
                timeout=120,
                env=dict(os.environ, PYTHONPATH=str(REPO)),
            )
    assert done.returncode == 1
    line = next(line for line in done.stdout.splitlines() if line.startswith("  broker "))
    assert line.startswith(f"  broker    no    {address} login refused (") and line.endswith(REFUSED_LOGIN), line
