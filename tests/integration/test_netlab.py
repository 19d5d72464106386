"""The namespace rig with real namespaces, veths, a bridge and nftables rules (needs root)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from hil import netlab
from hil.netlab import NetLab

REASON = netlab.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"netlab: {REASON}")


def _ours(prefix: str) -> list[str]:
    return [name for name in netlab.list_namespaces() if name.startswith(prefix)]


def test_bridge_loss_partition_heal_and_teardown():
    lab = NetLab()
    with lab:
        a, b, c = lab.add_node("a"), lab.add_node("b"), lab.add_node("c")
        assert len(_ours(lab.prefix)) == 4  # three nodes and the bridge
        assert lab.reachable(a, b) and lab.reachable(b, c)
        # A 100 % drop rule in b's namespace: nothing reaches b any more, a and c still talk.
        backend = lab.impair(b, loss_percent=100, backend="nftables")
        assert backend == "nftables"
        assert not lab.reachable(a, b, timeout_s=1.0)
        assert lab.reachable(a, c)
        lab.impair(b, loss_percent=0, backend="nftables")
        assert lab.reachable(a, b)
        lab.partition([a], [b, c])
        assert not lab.reachable(a, c, timeout_s=1.0)
        assert lab.reachable(b, c)
        lab.heal()
        assert lab.reachable(a, c)
        rx, tx = lab.link_bytes(a)
        assert rx > 0 and tx > 0
    assert _ours(lab.prefix) == []


def test_teardown_on_exception():
    lab = NetLab()
    with pytest.raises(RuntimeError, match="boom"):
        with lab:
            lab.add_node("a")
            raise RuntimeError("boom")
    assert _ours(lab.prefix) == []


_HOLDER = """
import sys, time
from hil.netlab import NetLab
with NetLab() as lab:
    lab.add_node("a"); lab.add_node("b")
    print(lab.prefix, flush=True)
    time.sleep(60)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_teardown_on_signal(sig):
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER], stdout=subprocess.PIPE, text=True)
    try:
        prefix = proc.stdout.readline().strip()
        assert prefix and len(_ours(prefix)) == 3
        proc.send_signal(sig)
        proc.wait(timeout=30)
        assert _ours(prefix) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sweep_removes_what_a_killed_run_left():
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER], stdout=subprocess.PIPE, text=True)
    prefix = proc.stdout.readline().strip()
    proc.kill()  # SIGKILL: no chance to clean up
    proc.wait()
    deadline = time.monotonic() + 5
    while not _ours(prefix) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_ours(prefix)) == 3
    removed = netlab.sweep()
    assert set(_ours(prefix)) == set() and all(name in removed for name in (f"{prefix}-0", f"{prefix}-br"))
