"""The station's operator accounts and doors, piece by piece: password file, sessions, throttle, Host names, policy."""

from __future__ import annotations

import ipaddress
import stat
import subprocess
import sys

import pytest

from edgerun.errors import ConfigError
from edgerun.station.auth import (
    LoginThrottle,
    Sessions,
    UserFile,
    csrf_ok,
    parse_users,
    read_users,
    set_password,
    verify_password,
)
from edgerun.station.model import NodeView
from edgerun.station.server import check_bind_policy, host_name, parse_node_nets, read_snapshot_token
from edgerun.station.station import Station, StationOptions


def test_password_file_round_trip(tmp_path):
    path = tmp_path / "users"
    assert set_password(path, "alice", "correct horse") is True
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    users = read_users(path)
    assert users["alice"].startswith("$argon2id$v=19$")
    assert "correct horse" not in path.read_text()
    assert verify_password(users["alice"], "correct horse")
    assert not verify_password(users["alice"], "correct horsf")
    assert not verify_password(users["alice"], "")
    assert not verify_password("$argon2id$garbage", "correct horse")

    assert set_password(path, "bob", "battery staple") is True
    assert set_password(path, "alice", "another password") is False  # changed, not added
    users = read_users(path)
    assert set(users) == {"alice", "bob"}
    assert verify_password(users["alice"], "another password")
    assert not verify_password(users["alice"], "correct horse")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_password_rules_and_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="at least 8 characters"):
        set_password(tmp_path / "u", "alice", "short")
    with pytest.raises(ConfigError, match="user 'al ice'"):
        set_password(tmp_path / "u", "al ice", "long enough")
    with pytest.raises(ConfigError, match=r"users:2: expected USER:\$argon2id\$"):
        parse_users("# operators\nalice:plaintext\n", "users")
    with pytest.raises(ConfigError, match="missing: No such file"):
        UserFile(tmp_path / "missing")
    (tmp_path / "empty").write_text("# nobody yet\n")
    with pytest.raises(ConfigError, match="no operator in it"):
        UserFile(tmp_path / "empty")


def test_user_file_is_reread_when_it_changes(tmp_path):
    path = tmp_path / "users"
    set_password(path, "alice", "correct horse")
    users = UserFile(path)
    assert users.lookup("bob") is None
    set_password(path, "bob", "battery staple")
    hashed = users.lookup("bob")
    assert hashed is not None and verify_password(hashed, "battery staple")


def test_passwd_command_reads_stdin_and_refuses_a_short_password(tmp_path):
    path = tmp_path / "station-users"
    cmd = [sys.executable, "-m", "edgerun", "station", "passwd", "alice", "--file", str(path), "--password-stdin"]
    done = subprocess.run(cmd, input="correct horse\n", capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"added operator alice in {path}" in done.stdout
    assert verify_password(read_users(path)["alice"], "correct horse")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    short = subprocess.run(cmd, input="short\n", capture_output=True, text=True, timeout=60)
    assert short.returncode == 2 and short.stderr == "edgerun: error: password: at least 8 characters\n"
    assert verify_password(read_users(path)["alice"], "correct horse")  # unchanged


def test_sessions_expire_and_are_dropped():
    sessions = Sessions(ttl_s=100.0, idle_s=30.0)
    token, session = sessions.create("alice", now=1000.0)
    assert len(token) >= 43 and len(session.csrf) >= 43  # 32 random bytes, base64url
    assert sessions.get(token, now=1010.0) is session
    assert sessions.get(token + "x", now=1010.0) is None
    assert sessions.get(token, now=1045.0) is None  # idle too long
    token, session = sessions.create("alice", now=2000.0)
    for t in range(2020, 2100, 20):
        assert sessions.get(token, now=float(t)) is session
    assert sessions.get(token, now=2101.0) is None  # past its lifetime however busy
    token, _ = sessions.create("bob", now=3000.0)
    sessions.drop(token)
    assert sessions.get(token, now=3000.0) is None
    assert csrf_ok(session, session.csrf) and not csrf_ok(session, None) and not csrf_ok(session, "x")


def test_login_throttle_per_address():
    throttle = LoginThrottle(attempts=3, window_s=60.0)
    assert all(throttle.allow("10.0.0.1", now=100.0 + i) for i in range(3))
    assert not throttle.allow("10.0.0.1", now=104.0)
    assert throttle.allow("10.0.0.2", now=104.0)  # another address has its own budget
    assert throttle.allow("10.0.0.1", now=161.0)  # the first attempt left the window


def test_host_names_and_bind_policy():
    assert host_name("Station.Local:8080") == "station.local"
    assert host_name("[::1]:8080") == "::1"
    assert host_name("localhost.") == "localhost"
    assert host_name("127.0.0.1") == "127.0.0.1"
    check_bind_policy("127.0.0.1", users=False, public_view=False)
    check_bind_policy("::1", users=False, public_view=False)
    check_bind_policy("::", users=True, public_view=False)
    check_bind_policy("::", users=False, public_view=True)
    with pytest.raises(
        ConfigError,
        match=r"^binding :: needs --users FILE \(edgerun station passwd\) or "
        r"--public-view for a read-only page$",
    ):
        check_bind_policy("::", users=False, public_view=False)


def test_node_nets_and_snapshot_token_file(tmp_path):
    assert parse_node_nets(["10.42.0.0/16", "fd00::/8"]) == [
        ipaddress.ip_network("10.42.0.0/16"),
        ipaddress.ip_network("fd00::/8"),
    ]
    with pytest.raises(ConfigError, match="--node-net: expected an address range"):
        parse_node_nets(["drones"])
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    assert read_snapshot_token(str(token)) == "s3cret-token"
    token.write_text("two words\n")
    with pytest.raises(ConfigError, match="expected one token on one line"):
        read_snapshot_token(str(token))


def test_an_advertised_address_is_used_only_inside_an_allowed_net():
    def where(advertised: str, nets: list[str], given: dict[str, str] | None = None) -> str:
        options = StationOptions(node_nets=parse_node_nets(nets), node_http=given or {})
        station = Station(options)
        node = NodeView(id="n1")
        node.http = advertised
        return station.node_http(node)

    assert where("10.42.0.7:8081", []) == ""  # nothing allowed: only --node-http
    assert where("10.42.0.7:8081", ["10.42.0.0/16"]) == "10.42.0.7:8081"
    assert where("10.43.0.7:8081", ["10.42.0.0/16"]) == ""
    assert where("169.254.169.254:80", ["10.42.0.0/16"]) == ""
    assert where("internal.example:80", ["::/0"]) == ""  # a name could resolve anywhere
    assert where("[fd00::7]:8081", ["fd00::/8"]) == "[fd00::7]:8081"
    assert where("10.43.0.7:8081", ["10.42.0.0/16"], {"n1": "10.43.0.7:8081"}) == "10.43.0.7:8081"
