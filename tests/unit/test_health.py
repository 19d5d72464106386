"""Health: state derivation, listener delivery on the loop, and concurrent problem reports."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from edgerun.service.health import Health

# Fails any test here that leaves a thread running (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("no_thread_left_behind")


def test_starts_in_starting_and_not_ready() -> None:
    health = Health()
    assert health.state == "starting"
    assert not health.ready
    assert health.reasons == {}


def test_state_derivation_order() -> None:
    health = Health()
    health.set_problem("source", "camera /dev/video0 gone, reopening")
    assert health.state == "degraded"  # up and retrying, and saying why
    assert not health.ready  # but nothing inferred yet
    health.clear_problem("source")
    assert health.state == "starting"
    health.set_problem("source", "camera /dev/video0 gone, reopening")
    health.mark_running()
    assert health.state == "degraded"
    assert health.ready
    health.set_problem("sink.mqtt", "broker unreachable")
    health.clear_problem("source")
    assert health.state == "degraded"
    assert health.reasons == {"sink.mqtt": "broker unreachable"}
    health.clear_problem("sink.mqtt")
    assert health.state == "running"
    assert health.ready
    health.set_problem("engine", "tensorrt failed, on tflite")
    health.mark_stopping()
    assert health.state == "stopping"
    assert not health.ready
    health.mark_running()
    health.clear_problem("engine")
    assert health.state == "stopping"  # final


def test_reasons_is_a_copy() -> None:
    health = Health()
    health.set_problem("source", "gone")
    health.reasons["source"] = "mutated"
    assert health.reasons == {"source": "gone"}


def test_since_moves_only_when_the_state_changes() -> None:
    health = Health()
    first = health.since
    health.mark_running()
    running_since = health.since
    assert running_since >= first
    health.mark_running()
    assert health.since == running_since
    health.set_problem("source", "gone")
    degraded_since = health.since
    assert degraded_since >= running_since
    health.set_problem("sink.mqtt", "down")  # reasons change, state does not
    assert health.since == degraded_since


def test_to_json() -> None:
    health = Health()
    health.mark_running()
    health.set_problem("source", "gone")
    body = health.to_json()
    assert body["state"] == "degraded"
    assert body["ready"] is True
    assert body["reasons"] == {"source": "gone"}
    assert isinstance(body["since_s"], float) and body["since_s"] >= 0.0


def test_listener_called_on_change_only() -> None:
    health = Health()
    seen: list[tuple[str, dict[str, str]]] = []
    health.on_change.append(lambda state, reasons: seen.append((state, reasons)))
    health.mark_running()
    health.mark_running()  # no change
    health.set_problem("source", "gone")
    health.set_problem("source", "gone")  # no change
    health.set_problem("source", "gone, reopening")  # reason re-worded: a change
    health.clear_problem("nothing")  # unknown key: no change
    health.clear_problem("source")
    health.mark_stopping()
    assert seen == [
        ("running", {}),
        ("degraded", {"source": "gone"}),
        ("degraded", {"source": "gone, reopening"}),
        ("running", {}),
        ("stopping", {}),
    ]


def test_failing_listener_does_not_starve_others(caplog) -> None:
    health = Health()
    seen: list[str] = []

    def broken(state: str, reasons: dict[str, str]) -> None:
        raise RuntimeError("boom")

    health.on_change.append(broken)
    health.on_change.append(lambda state, reasons: seen.append(state))
    with caplog.at_level(logging.ERROR, logger="edgerun.service.health"):
        health.mark_running()
    assert seen == ["running"]
    assert any("health listener" in r.getMessage() for r in caplog.records)


def test_listeners_run_on_the_loop_via_notify() -> None:
    async def main() -> tuple[int, list[tuple[int, str, dict[str, str]]]]:
        loop = asyncio.get_running_loop()
        health = Health(notify=loop.call_soon_threadsafe)
        seen: list[tuple[int, str, dict[str, str]]] = []
        got = asyncio.Event()

        def listener(state: str, reasons: dict[str, str]) -> None:
            seen.append((threading.get_ident(), state, reasons))
            if state == "degraded":
                got.set()

        health.on_change.append(listener)

        def capture_thread() -> None:
            health.mark_running()
            health.set_problem("source", "camera /dev/video0 gone, reopening")

        worker = threading.Thread(target=capture_thread)
        worker.start()
        worker.join()
        assert seen == []  # nothing runs on the capture thread
        await asyncio.wait_for(got.wait(), 5.0)
        return threading.get_ident(), seen

    loop_thread, seen = asyncio.run(main())
    assert [(state, reasons) for _, state, reasons in seen] == [
        ("running", {}),
        ("degraded", {"source": "camera /dev/video0 gone, reopening"}),
    ]
    assert {ident for ident, _, _ in seen} == {loop_thread}


def test_notify_after_the_loop_closed_does_not_raise() -> None:
    loop = asyncio.new_event_loop()
    health = Health(notify=loop.call_soon_threadsafe)
    health.on_change.append(lambda state, reasons: None)
    loop.close()
    health.set_problem("source", "gone")  # the capture thread outliving the loop must not crash
    assert health.reasons == {"source": "gone"}


def test_concurrent_problem_reports_from_threads() -> None:
    threads, rounds = 8, 500

    async def main() -> tuple[Health, list[tuple[str, dict[str, str]]]]:
        loop = asyncio.get_running_loop()
        health = Health(notify=loop.call_soon_threadsafe)
        health.mark_running()
        seen: list[tuple[str, dict[str, str]]] = []
        health.on_change.append(lambda state, reasons: seen.append((state, reasons)))
        start = threading.Barrier(threads)

        def reporter(i: int) -> None:
            start.wait()
            for n in range(rounds):
                health.set_problem(f"part{i}", f"round {n}")
                if n % 2 == 0:
                    health.clear_problem(f"part{i}")
            if i % 2 == 0:
                health.clear_problem(f"part{i}")

        workers = [threading.Thread(target=reporter, args=(i,)) for i in range(threads)]
        for worker in workers:
            worker.start()
        await loop.run_in_executor(None, lambda: [worker.join() for worker in workers])
        await asyncio.sleep(0)  # deliveries were queued before the join's result; this is belt and braces
        return health, seen

    health, seen = asyncio.run(main())
    expected = {f"part{i}": f"round {rounds - 1}" for i in range(1, threads, 2)}
    assert health.reasons == expected
    assert health.state == "degraded"
    # Deliveries keep the order of the changes, so the last one the loop saw is the final state.
    assert seen[-1] == ("degraded", expected)
    # Every delivered event is consistent: degraded exactly when some part has a problem.
    assert all((state == "degraded") == bool(reasons) for state, reasons in seen)
