"""``dlserve perf`` measurement: stability over synthetic windows, percentiles, server
statistics deltas, merging the last 3 windows; and the load generator on a fake client."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from dlserve.perf.clients import DataPlane, RequestError, Slot
from dlserve.perf.load import LoadGenerator
from dlserve.perf.measure import ClientWindow, ServerStats, Window, is_stable, percentile_ns, summarize


def window(throughput: float, latency_us: float, seconds: float = 1.0, batch: int = 1,
           server: ServerStats | None = None) -> Window:
    count = int(round(throughput * seconds / batch))
    latencies = np.full(count, int(latency_us * 1000), dtype=np.int64)
    return Window(ClientWindow(int(seconds * 1e9), latencies, send_ns=count * 2000), server, batch)


# -- stability ------------------------------------------------------------------------------------
def test_needs_three_windows():
    assert not is_stable([window(100, 500)] * 2, 10)
    assert is_stable([window(100, 500)] * 3, 10)


def test_stability_on_the_last_three_only():
    windows = [window(50, 900), window(100, 500), window(105, 520), window(98, 510)]
    assert is_stable(windows, 10)
    assert not is_stable(windows[:3], 10)


def test_throughput_and_latency_must_both_agree():
    assert not is_stable([window(100, 500), window(100, 500), window(120, 500)], 10)  # 1.2 > 1.1
    assert not is_stable([window(100, 500), window(100, 560), window(100, 500)], 10)
    assert is_stable([window(100, 500), window(100, 560), window(100, 500)], 15)
    assert is_stable([window(100, 500), window(109, 500), window(100, 545)], 10)  # just inside


def test_empty_window_is_never_stable():
    assert not is_stable([window(100, 500), window(0, 0), window(100, 500)], 1000)


def test_percentile_stabilisation():
    def spread(p99_us: float) -> Window:
        lat = np.array([500_000] * 98 + [int(p99_us * 1000)] * 2, dtype=np.int64)
        return Window(ClientWindow(1_000_000_000, lat), None)

    windows = [spread(900), spread(2000), spread(900)]
    assert is_stable(windows, 10)  # the averages barely differ
    assert not is_stable(windows, 10, percentile=99)  # the p99s do


def test_percentile_index_is_perf_analyzers():
    values = np.arange(1, 101, dtype=np.int64)  # 1..100
    assert percentile_ns(values, 50) == 51  # int(0.5 * 99 + 0.5) = 50 -> value 51
    assert percentile_ns(values, 99) == 99
    assert percentile_ns(np.array([7], dtype=np.int64), 95) == 7
    assert percentile_ns(np.empty(0, dtype=np.int64), 50) == 0


# -- server statistics ------------------------------------------------------------------------------
def stats_json(count: int, queue_ns: int, infer_ns: int, as_strings: bool = False, version: str = "1") -> dict:
    v = (lambda x: str(x)) if as_strings else (lambda x: x)
    duration = lambda n: {"count": v(count), "ns": v(n)}  # noqa: E731
    return {"model_stats": [{
        "name": "m", "version": version, "inference_count": v(count), "execution_count": v(count),
        "inference_stats": {
            "success": duration(queue_ns + infer_ns + count * 10_000), "fail": {},
            "queue": duration(queue_ns), "compute_input": duration(count * 1000),
            "compute_infer": duration(infer_ns), "compute_output": duration(count * 2000),
        },
    }]}


def test_server_stats_delta_and_summary():
    before = ServerStats.from_json(stats_json(100, 1_000_000, 20_000_000), "m")
    after = ServerStats.from_json(stats_json(300, 5_000_000, 60_000_000, as_strings=True), "m")  # gRPC style
    delta = after - before
    summary = delta.summary()
    assert summary["success_count"] == 200 and summary["inference_count"] == 200
    assert summary["queue_us"] == pytest.approx(20.0)  # 4 ms over 200
    assert summary["compute_infer_us"] == pytest.approx(200.0)
    assert summary["compute_input_us"] == pytest.approx(1.0) and summary["compute_output_us"] == pytest.approx(2.0)
    # success = queue + infer + 10 µs each -> overhead 10 - input 1 - output 2 = 7 µs
    assert summary["overhead_us"] == pytest.approx(7.0)
    assert ServerStats.from_json(stats_json(1, 1, 1), "other") is None
    assert ServerStats.from_json(stats_json(1, 1, 1), "m", version="2") is None
    assert ServerStats.from_json({"model_stats": []}, "m") is None


def test_summarize_merges_the_last_three_windows():
    s = ServerStats.from_json(stats_json(100, 1_000_000, 10_000_000), "m")
    windows = [window(10, 9000), window(1000, 400, server=s), window(1000, 500, server=s),
               window(2000, 600, seconds=0.5, server=s)]
    result = summarize("concurrency", 4, windows, True)
    assert result.request_count == 3000 and result.duration_s == pytest.approx(2.5)
    assert result.throughput == pytest.approx(1200.0)
    assert result.avg_latency_us == pytest.approx((1000 * 400 + 1000 * 500 + 1000 * 600) / 3000)
    assert set(result.percentiles_us) == {50, 90, 95, 99}
    assert result.percentiles_us[50] == 500 and result.percentiles_us[99] == 600
    assert result.avg_send_us == pytest.approx(2.0)
    assert result.server["success_count"] == 300 and result.windows == 4 and result.stable
    assert result.latency_us == result.avg_latency_us


def test_summarize_with_extra_percentile_and_batches():
    result = summarize("request_rate", 50.0, [window(800, 300, batch=4)] * 3, False, percentile=75)
    assert set(result.percentiles_us) == {50, 75, 90, 95, 99}
    assert result.request_count == 600 and result.throughput == pytest.approx(800.0)
    assert result.latency_us == 300 and not result.stable and result.server is None


def test_merge_processes():
    a = ClientWindow(1_000_000_000, np.array([1, 2], dtype=np.int64), send_ns=5, delayed=1, sent=2)
    b = ClientWindow(1_000_000_000, np.array([3], dtype=np.int64), recv_ns=7, sent=1)
    merged = ClientWindow.merge_processes([a, b], 1_000_000_000)
    assert merged.count == 3 and merged.send_ns == 5 and merged.recv_ns == 7 and merged.delayed == 1
    assert merged.sent == 3


# -- the load generator on a fake client ------------------------------------------------------------
class FakeSlot(Slot):
    def __init__(self, plane: FakePlane) -> None:
        self.plane = plane

    async def infer(self, payload):
        self.plane.in_flight += 1
        self.plane.most = max(self.plane.most, self.plane.in_flight)
        self.plane.seen.append(payload)
        try:
            await asyncio.sleep(self.plane.delay)
        finally:
            self.plane.in_flight -= 1
        if payload == self.plane.fail_on:
            raise RequestError("boom")
        return 1000, 500


class FakePlane(DataPlane):
    def __init__(self, delay: float = 0.002, fail_on: object = None) -> None:
        self.payloads = ["a", "b", "c"]
        self.delay = delay
        self.fail_on = fail_on
        self.in_flight = self.most = 0
        self.seen: list = []
        self.closed = False

    async def setup(self) -> None:
        pass

    async def open_slot(self) -> Slot:
        return FakeSlot(self)

    async def close(self) -> None:
        self.closed = True


def run(coro):
    return asyncio.run(coro)


def test_closed_loop_keeps_n_in_flight():
    async def go():
        plane = FakePlane()
        load = LoadGenerator(plane)
        await load.start()
        await load.set_concurrency(4)
        await asyncio.sleep(0.2)
        first = load.collect()
        await load.set_concurrency(1)
        await asyncio.sleep(0.05)
        load.collect()
        plane.most = 0
        await asyncio.sleep(0.1)
        second = load.collect()
        await load.stop()
        return plane, first, second

    plane, first, second = run(go())
    assert plane.most == 1 and plane.closed
    assert first.count > 2 * second.count > 0
    assert first.send_ns == 1000 * first.count and first.recv_ns == 500 * first.count
    assert abs(first.duration_ns - 0.2e9) < 0.1e9
    assert set(plane.seen) == {"a", "b", "c"}  # requests cycle through the payloads


def test_request_rate_sends_at_the_rate():
    async def go():
        plane = FakePlane(delay=0.001)
        load = LoadGenerator(plane, max_threads=4)
        await load.start()
        await load.set_rate(200.0)
        await asyncio.sleep(0.05)
        load.collect()
        await asyncio.sleep(0.5)
        result = load.collect()
        await load.stop()
        return result

    result = run(go())
    assert 60 <= result.count <= 140, result.count  # ~100 at 200/s over 0.5 s
    # On time but for the odd send a busy 2-core machine holds up (the full suite
    # running beside it once delayed 5 of 101); a generator that cannot keep up
    # delays most of them.
    assert result.delayed <= result.sent // 10, (result.delayed, result.sent)


def test_request_rate_beyond_the_slots_counts_delays():
    async def go():
        plane = FakePlane(delay=0.05)
        load = LoadGenerator(plane, max_threads=2)
        await load.start()
        await load.set_rate(500.0, "poisson", seed=1)
        await asyncio.sleep(0.3)
        result = load.collect()
        await load.stop()
        return plane, result

    plane, result = run(go())
    assert plane.most <= 2 and result.delayed > 0


def test_failed_request_stops_the_load():
    async def go():
        plane = FakePlane(fail_on="b")
        load = LoadGenerator(plane)
        await load.start()
        await load.set_concurrency(2)
        await asyncio.sleep(0.1)
        error = load.error
        await load.stop()
        return error

    assert run(go()) == "boom"


def test_warmup_is_not_recorded():
    async def go():
        plane = FakePlane(delay=0)
        load = LoadGenerator(plane)
        await load.start()
        await load.warmup(10, 3)
        window = load.collect()
        await load.stop()
        return plane, window

    plane, window = run(go())
    assert len(plane.seen) == 10 and window.count == 0
