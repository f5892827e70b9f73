"""The dynamic batcher: batches form, ordering, priorities, queue limits, timeouts,
and the join/split helper models use to batch their own work."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import numpy as np
import pytest

import dlserve
from dlserve import ModelControlMode
from dlserve.engine.request import Request, Response

from ..conftest import serve, wait_until

BASE = {
    "backend": "python",
    "max_batch_size": 8,
    "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
    "output": [
        {"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]},
        {"name": "BATCH", "data_type": "TYPE_INT64", "dims": [2]},
        {"name": "ORDER", "data_type": "TYPE_INT64", "dims": [1]},
        {"name": "ZERO_COPY", "data_type": "TYPE_BOOL", "dims": [1]},
    ],
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve(tmp_path_factory, ["batcher"], model_control_mode=ModelControlMode.EXPLICIT)


def load(server: dlserve.Server, **config: Any) -> None:
    server.load("batcher", {"config": json.dumps({**BASE, **config})})


def rows(n: int = 1, width: int = 4, value: float = 1.0) -> np.ndarray:
    return np.full((n, width), value, dtype=np.float32)


async def infer(server: dlserve.Server, x: np.ndarray, **kwargs: Any) -> dlserve.InferenceResponse:
    async for response in server.model("batcher").async_infer(inputs={"INPUT0": x}, raise_on_error=False, **kwargs):
        return response
    raise AssertionError("no response")


async def hold_then(server: dlserve.Server, hold_s: float, coroutines: list[Any]) -> tuple[Any, list[Any]]:
    """Keep the (single) instance busy for ``hold_s`` while ``coroutines`` queue up."""
    holder = asyncio.ensure_future(infer(server, rows(), parameters={"sleep": hold_s}))
    await asyncio.sleep(0.1)  # the holder is executing now
    results = await asyncio.gather(*coroutines)
    return await holder, results


def batch_of(response: dlserve.InferenceResponse) -> tuple[int, int]:
    requests, rows_in_call = response.outputs["BATCH"].as_numpy()[0]
    return int(requests), int(rows_in_call)


def order_of(response: dlserve.InferenceResponse) -> int:
    return int(response.outputs["ORDER"].as_numpy()[0, 0])


def test_requests_are_batched_into_one_execute(server):
    load(server, dynamic_batching={})
    before = server.model("batcher").statistics()["model_stats"][0]
    _, responses = asyncio.run(
        hold_then(server, 0.4, [infer(server, rows(value=i)) for i in range(10)])
    )
    for i, response in enumerate(responses):
        assert response.error is None
        np.testing.assert_array_equal(response.outputs["OUTPUT0"].as_numpy(), rows(value=i) * 2)
    sizes = sorted(batch_of(r)[0] for r in responses)
    assert sizes == [2, 2] + [8] * 8  # 8 (max_batch_size), then the remaining 2
    stats = server.model("batcher").statistics()["model_stats"][0]
    assert stats["inference_count"] - before["inference_count"] == 11
    assert stats["execution_count"] - before["execution_count"] == 3
    batch_sizes = {row["batch_size"] for row in stats["batch_stats"]}
    assert {1, 2, 8} <= batch_sizes


def test_max_batch_size_counts_rows_not_requests(server):
    load(server, dynamic_batching={})
    _, responses = asyncio.run(hold_then(server, 0.3, [infer(server, rows(3)) for _ in range(4)]))
    assert all(batch_of(r) == (2, 6) for r in responses)  # 3 + 3 fits 8; a third would not


def test_small_batches_are_joined_without_a_copy(server):
    load(server, dynamic_batching={})
    _, responses = asyncio.run(hold_then(server, 0.3, [infer(server, rows(1, 4)) for _ in range(5)]))
    assert all(batch_of(r)[0] == 5 for r in responses)
    assert all(bool(r.outputs["ZERO_COPY"].as_numpy()[0, 0]) for r in responses)


def test_preferred_batch_size_goes_before_the_delay(server):
    load(server, dynamic_batching={"preferred_batch_size": [4], "max_queue_delay_microseconds": 3_000_000})

    async def run() -> tuple[float, list[Any]]:
        started = time.monotonic()
        responses = await asyncio.gather(*(infer(server, rows()) for _ in range(4)))
        return time.monotonic() - started, responses

    elapsed, responses = asyncio.run(run())
    assert all(batch_of(r) == (4, 4) for r in responses)
    assert elapsed < 2.5  # sent on reaching the preferred size, not after the 3 s delay


@pytest.mark.parametrize(
    ("first", "second"), [(rows(1, 3), rows(1, 5)), (rows(5), rows(5))], ids=["another shape", "too many rows"]
)
def test_a_batch_the_next_request_cannot_join_goes_before_the_delay(server, first, second):
    """As Triton: once the request behind it cannot join, waiting cannot grow the batch."""
    load(server, dynamic_batching={"max_queue_delay_microseconds": 3_000_000})

    async def timed(x: np.ndarray) -> tuple[float, Any]:
        started = time.monotonic()
        response = await infer(server, x)
        return time.monotonic() - started, response

    async def run() -> list[tuple[float, Any]]:
        return await asyncio.gather(timed(first), timed(second))

    (took_first, response_first), (took_second, response_second) = asyncio.run(run())
    assert batch_of(response_first)[0] == batch_of(response_second)[0] == 1
    assert took_first < 2.0  # it went when the second came, not after the 3 s delay
    assert took_second >= 2.5  # the second did wait: nothing came to close its batch


def test_a_batch_that_would_pass_the_largest_preferred_size_goes_before_the_delay(server):
    """As Triton: 3 rows then 2 with preferred size 4 — the 3 go at once, alone, as the 2
    would take the batch past every preferred size; the 2 wait out the delay."""
    load(server, dynamic_batching={"preferred_batch_size": [4], "max_queue_delay_microseconds": 3_000_000})

    async def timed(x: np.ndarray) -> tuple[float, Any]:
        started = time.monotonic()
        response = await infer(server, x)
        return time.monotonic() - started, response

    async def run() -> list[tuple[float, Any]]:
        first = asyncio.ensure_future(timed(rows(3)))
        await asyncio.sleep(0.2)  # the 3 rows are queued, waiting for company
        return await asyncio.gather(first, timed(rows(2)))

    (took_first, response_first), (took_second, response_second) = asyncio.run(run())
    assert batch_of(response_first) == (1, 3) and batch_of(response_second) == (1, 2)
    assert took_first < 2.0
    assert took_second >= 2.5


@pytest.mark.parametrize(
    ("delay_us", "expected"), [(0, [4] * 8), (200_000, [8] * 8)], ids=["within the delay", "delay passed"]
)
def test_queued_requests_go_in_preferred_batches_until_the_delay_passes(server, delay_us, expected):
    """As Triton: with a preferred size below max_batch_size a full queue goes in batches
    of the preferred size; once the oldest has waited the delay, all that fits goes."""
    load(server, dynamic_batching={"preferred_batch_size": [4], "max_queue_delay_microseconds": delay_us})

    async def run() -> list[Any]:
        holder = asyncio.ensure_future(infer(server, rows(), parameters={"sleep": 1.0}))
        await asyncio.sleep(0.4)  # the holder waited out the delay alone and is executing
        responses = await asyncio.gather(*(infer(server, rows()) for _ in range(8)))
        assert batch_of(await holder)[0] == 1
        return responses

    assert sorted(batch_of(r)[0] for r in asyncio.run(run())) == expected


def test_tritons_delay_scheduler_hook_holds_the_first_batch_until_that_many_are_queued(server, monkeypatch):
    """Triton's test hook, which its upstream batcher tests set: TRITONSERVER_DELAY_SCHEDULER."""
    monkeypatch.setenv("TRITONSERVER_DELAY_SCHEDULER", "4")
    load(server, dynamic_batching={})  # (read when the model's batcher is made)
    monkeypatch.delenv("TRITONSERVER_DELAY_SCHEDULER")

    async def run() -> list[Any]:
        first = [asyncio.ensure_future(infer(server, rows())) for _ in range(3)]
        await asyncio.sleep(0.3)
        assert not any(f.done() for f in first)  # held back: three of four are queued
        last = await infer(server, rows())
        return [await f for f in first] + [last]

    assert [batch_of(r)[0] for r in asyncio.run(run())] == [4] * 4
    _, responses = asyncio.run(hold_then(server, 0.2, [infer(server, rows())]))
    assert responses[0].error is None  # only the first batch was held


def test_max_queue_delay_waits_for_more_requests(server):
    load(server, dynamic_batching={"preferred_batch_size": [8], "max_queue_delay_microseconds": 500_000})

    async def run() -> tuple[float, Any]:
        started = time.monotonic()
        response = await infer(server, rows())
        return time.monotonic() - started, response

    elapsed, response = asyncio.run(run())
    assert batch_of(response) == (1, 1)
    assert elapsed >= 0.45  # it waited for company until the delay ran out


def test_requests_of_different_shapes_are_not_batched_together(server):
    """A batch is the longest run of queued requests with one shape (as in Triton,
    requests are not reordered to fill it)."""
    load(server, dynamic_batching={})
    _, responses = asyncio.run(
        hold_then(server, 0.3, [infer(server, rows(1, 3)), infer(server, rows(1, 3)), infer(server, rows(1, 5))])
    )
    by_width = {r.outputs["OUTPUT0"].shape[1]: batch_of(r)[0] for r in responses}
    assert by_width == {3: 2, 5: 1}


def test_ragged_inputs_batch_when_allowed_and_pad(server):
    ragged_input = [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1], "allow_ragged_batch": True}]
    load(server, dynamic_batching={}, input=ragged_input)
    _, responses = asyncio.run(
        hold_then(
            server,
            0.3,
            [infer(server, rows(1, 3, 1.0), parameters={"ragged": "pad"}), infer(server, rows(1, 5, 2.0))],
        )
    )
    assert all(batch_of(r)[0] == 2 for r in responses)
    np.testing.assert_array_equal(responses[0].outputs["OUTPUT0"].as_numpy(), [[2, 2, 2, 0, 0]])
    np.testing.assert_array_equal(responses[1].outputs["OUTPUT0"].as_numpy(), [[4] * 5])


def test_full_queue_rejects(server):
    load(server, max_batch_size=1, dynamic_batching={"default_queue_policy": {"max_queue_size": 2}})
    before = server.model("batcher").statistics()["model_stats"][0]["inference_stats"]["fail"]["count"]
    _, responses = asyncio.run(hold_then(server, 0.4, [infer(server, rows()) for _ in range(5)]))
    errors = [r.error for r in responses if r.error is not None]
    assert len(errors) == 3
    assert all(isinstance(e, dlserve.UnavailableError) and "Exceeds maximum queue size" in str(e) for e in errors)
    assert all(str(e).startswith("[request id: <id_unknown>] Exceeds") for e in errors)  # as Triton 2.51
    after = server.model("batcher").statistics()["model_stats"][0]["inference_stats"]["fail"]["count"]
    assert after - before == 3
    failures = server.engine.model("batcher").stats.failures
    assert failures["REJECTED"] >= 3


def test_delayed_requests_count_toward_the_queue_size(server):
    """As Triton's queue: requests a DELAY timeout moved aside still take room in their
    level (the level held more than max_queue_size before)."""
    policy = {"timeout_action": "DELAY", "default_timeout_microseconds": 10_000_000,
              "allow_timeout_override": True, "max_queue_size": 2}
    load(server, max_batch_size=1, dynamic_batching={"default_queue_policy": policy})

    async def run() -> list[Any]:
        holder = asyncio.ensure_future(infer(server, rows(), parameters={"sleep": 0.5}))
        await asyncio.sleep(0.1)
        delayed = asyncio.ensure_future(infer(server, rows(), timeout=100_000))  # times out queued
        slow = asyncio.ensure_future(infer(server, rows(), parameters={"sleep": 0.5}))
        await holder  # then ``slow`` runs; ``delayed`` waits aside
        await asyncio.sleep(0.1)
        late = [asyncio.ensure_future(infer(server, rows())) for _ in range(2)]
        return [await f for f in (delayed, slow, *late)]

    delayed, slow, accepted, refused = asyncio.run(run())
    assert delayed.error is None and slow.error is None and accepted.error is None
    assert isinstance(refused.error, dlserve.UnavailableError) and "Exceeds maximum queue size" in str(refused.error)


def test_queued_requests_time_out(server):
    load(server, max_batch_size=1, dynamic_batching={"default_queue_policy": {"default_timeout_microseconds": 100_000}})
    _, responses = asyncio.run(hold_then(server, 0.5, [infer(server, rows()) for _ in range(2)]))
    assert all(isinstance(r.error, dlserve.UnavailableError) for r in responses)
    assert all("Request timeout expired" in str(r.error) for r in responses)


def test_queued_requests_time_out_while_every_instance_is_busy(server):
    """As Triton 2.51 (measured with its QA identity_fp32_timeout): a queued request's
    timeout answers it when it passes, not once the busy instance frees up."""
    load(server, max_batch_size=1, dynamic_batching={"default_queue_policy": {"default_timeout_microseconds": 200_000}})

    async def timed() -> tuple[float, Any]:
        started = time.monotonic()
        response = await infer(server, rows())
        return time.monotonic() - started, response

    _, answers = asyncio.run(hold_then(server, 3.0, [timed(), timed()]))
    for took, response in answers:
        assert "Request timeout expired" in str(response.error)
        assert took < 2.0  # (0.2 s in the queue; the instance stayed busy for 3 s)


def test_request_timeout_overrides_the_default_when_allowed(server):
    policy = {"default_timeout_microseconds": 60_000_000, "allow_timeout_override": True}
    load(server, max_batch_size=1, dynamic_batching={"default_queue_policy": policy})
    _, (short, default) = asyncio.run(
        hold_then(server, 0.5, [infer(server, rows(), timeout=100_000), infer(server, rows())])
    )
    assert "Request timeout expired" in str(short.error)
    assert default.error is None


def test_a_request_timeout_cannot_lengthen_the_default(server):
    """Triton's rule (allow_timeout_override): a request may only shorten the model's
    timeout, so no client keeps requests queued longer than the model allows."""
    policy = {"default_timeout_microseconds": 100_000, "allow_timeout_override": True}
    load(server, max_batch_size=1, dynamic_batching={"default_queue_policy": policy})
    _, (longer,) = asyncio.run(hold_then(server, 0.5, [infer(server, rows(), timeout=10_000_000)]))
    assert "Request timeout expired" in str(longer.error)


def test_delay_action_moves_timed_out_requests_behind_the_others(server):
    policy = {"default_timeout_microseconds": 10_000_000, "timeout_action": "DELAY", "allow_timeout_override": True}
    load(server, max_batch_size=1, dynamic_batching={"default_queue_policy": policy})

    async def run() -> list[Any]:
        holder = asyncio.ensure_future(infer(server, rows(), parameters={"sleep": 0.5}))
        await asyncio.sleep(0.1)
        early = asyncio.ensure_future(infer(server, rows(value=1), timeout=100_000))  # times out queued
        await asyncio.sleep(0.25)
        late = [asyncio.ensure_future(infer(server, rows(value=2))) for _ in range(2)]
        await holder
        return [await early, *[await f for f in late]]

    early, *late = asyncio.run(run())
    assert early.error is None and all(r.error is None for r in late)
    assert order_of(early) > max(order_of(r) for r in late)


def test_priorities(server):
    load(server, max_batch_size=1, dynamic_batching={"priority_levels": 2, "default_priority_level": 2})

    async def run() -> tuple[list[Any], Any]:
        holder = asyncio.ensure_future(infer(server, rows(), parameters={"sleep": 0.4}))
        await asyncio.sleep(0.1)
        low = [asyncio.ensure_future(infer(server, rows())) for _ in range(3)]
        await asyncio.sleep(0.05)
        high = asyncio.ensure_future(infer(server, rows(), priority=1))
        await holder
        return [await f for f in low], await high

    low, high = asyncio.run(run())
    assert order_of(high) < min(order_of(r) for r in low)


def test_a_priority_above_the_levels_means_the_default_level(server):
    """As Triton 2.51 (side by side): priority 5 of 3 levels waits at the default level 2,
    ahead of priority 3 (it used to go to the lowest level, behind it)."""
    load(server, max_batch_size=1, dynamic_batching={"priority_levels": 3, "default_priority_level": 2})

    async def run() -> list[Any]:
        holder = asyncio.ensure_future(infer(server, rows(), parameters={"sleep": 0.4}))
        await asyncio.sleep(0.1)
        queued = []
        for priority in (3, 5, 2):
            queued.append(asyncio.ensure_future(infer(server, rows(), priority=priority)))
            await asyncio.sleep(0.03)
        await holder
        return [await f for f in queued]

    third, fifth, second = asyncio.run(run())
    assert order_of(fifth) < order_of(second) < order_of(third)


def test_delayed_requests_keep_their_priority_level(server):
    """As Triton 2.51 (side by side): a level-1 request delayed by its timeout runs after
    level 1's others but still before level 2's (it used to go behind every level)."""
    level_1 = {"timeout_action": "DELAY", "default_timeout_microseconds": 600_000}
    load(server, max_batch_size=1, dynamic_batching={
        "priority_levels": 2, "default_priority_level": 2, "priority_queue_policy": {"1": level_1},
    })

    async def run() -> list[Any]:
        holder = asyncio.ensure_future(infer(server, rows(), parameters={"sleep": 1.0}))
        await asyncio.sleep(0.1)
        delayed = asyncio.ensure_future(infer(server, rows(), priority=1))  # times out queued
        await asyncio.sleep(0.05)
        low = asyncio.ensure_future(infer(server, rows(), priority=2))
        await asyncio.sleep(0.5)
        fresh = asyncio.ensure_future(infer(server, rows(), priority=1))  # within its timeout
        await holder
        return [await delayed, await low, await fresh]

    delayed, low, fresh = asyncio.run(run())
    assert all(r.error is None for r in (delayed, low, fresh))
    assert order_of(fresh) < order_of(delayed) < order_of(low)


def test_a_request_timeout_sets_none_where_the_level_has_none(server):
    """Triton's rule (allow_timeout_override): a request may shorten the level's timeout;
    where the level has none (0), the request's is ignored (it used to apply)."""
    load(server, max_batch_size=1, dynamic_batching={"default_queue_policy": {"allow_timeout_override": True}})
    _, (patient,) = asyncio.run(hold_then(server, 0.5, [infer(server, rows(), timeout=100_000)]))
    assert patient.error is None


def test_preserve_ordering_across_instances(server):
    group = [{"count": 2, "kind": "KIND_CPU"}]

    async def completion_order(preserve: bool) -> list[int]:
        done: list[int] = []

        async def one(index: int, sleep: float) -> None:
            await infer(server, rows(value=index), parameters={"sleep": sleep})
            done.append(index)

        await asyncio.gather(one(0, 0.6), asyncio.sleep(0.1), one(1, 0.0))
        return done

    load(server, max_batch_size=1, instance_group=group, dynamic_batching={"preserve_ordering": False})
    assert asyncio.run(completion_order(False)) == [1, 0]  # the fast one finishes first
    load(server, max_batch_size=1, instance_group=group, dynamic_batching={"preserve_ordering": True})
    assert asyncio.run(completion_order(True)) == [0, 1]  # delivered in arrival order


def test_preserve_ordering_still_answers_a_cancelled_request_at_once(server):
    """Request 1 waits behind request 0 for its turn; cancelled meanwhile, it is answered
    CANCELLED now (not after request 0, and not with the model's late answer), and its
    empty place does not hold up the requests after it."""
    group = [{"count": 3, "kind": "KIND_CPU"}]
    load(server, max_batch_size=1, instance_group=group, dynamic_batching={"preserve_ordering": True})

    async def run() -> tuple[list[tuple[int, str]], float]:
        done: list[tuple[int, str]] = []
        start = time.monotonic()

        async def one(index: int, sleep: float, cancel_after: float | None = None) -> None:
            iterator = server.model("batcher").async_infer(
                inputs={"INPUT0": rows(value=index)}, parameters={"sleep": sleep}, raise_on_error=False
            )
            if cancel_after is not None:
                asyncio.get_running_loop().call_later(cancel_after, iterator.cancel)
            async for response in iterator:
                code = response.error.code.name if response.error is not None else "OK"
                done.append((index, code))
                if index == 1:
                    cancelled_at.append(time.monotonic() - start)

        cancelled_at: list[float] = []
        await asyncio.gather(one(0, 0.8), one(1, 0.8, cancel_after=0.2), one(2, 0.0))
        return done, cancelled_at[0]

    done, cancelled_after = asyncio.run(run())
    assert done == [(1, "CANCELLED"), (0, "OK"), (2, "OK")]
    assert cancelled_after < 0.6  # answered when cancelled, not when request 0 finished


def test_batch_config_is_rendered_with_tritons_defaults(server):
    load(server, dynamic_batching={"max_queue_delay_microseconds": 100})
    config = server.model("batcher").config()["dynamic_batching"]
    assert config["preferred_batch_size"] == [8]
    assert config["max_queue_delay_microseconds"] == 100


def test_the_next_batch_goes_to_the_worker_before_the_last_ones_responses(server):
    """The worker's reply frees its instance at once: the queued batch is sent to the
    worker before the finished batch's responses are read and delivered, rather than
    after (the worker would sit idle meanwhile)."""
    load(server, dynamic_batching={})
    engine = server.engine
    instance = engine.model("batcher").instances[0]
    x = engine.share(dlserve.Tensor.from_object(rows()))
    seen: list[tuple[int, bool]] = []

    async def run() -> tuple[Response, Response]:
        loop = asyncio.get_running_loop()
        first, second = loop.create_future(), loop.create_future()

        def on_first(response: Response) -> None:
            seen.append((instance.in_flight, second.done()))
            first.set_result(response)

        busy = {"sleep": 0.2}  # the second request queues behind the first's execute
        engine.submit(Request("batcher", {"INPUT0": x}, on_first, parameters=busy))
        engine.submit(Request("batcher", {"INPUT0": x}, second.set_result))
        return await first, await second

    a, b = asyncio.run_coroutine_threadsafe(run(), server.loop).result(20)
    assert a.error is None and b.error is None
    assert seen == [(1, False)]  # while the first's answer is delivered, the second executes
    order = [int(r.outputs["ORDER"].as_numpy()[0, 0]) for r in (a, b)]
    assert order[1] == order[0] + 1  # two executes, one after the other


DOUBLE_ANSWER_MODEL = '''
import numpy as np
import c_python_backend_utils as c_utils
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        if pb_utils.get_input_tensor_by_name(requests[0], "X").as_numpy()[0, 0] == 9:
            free = np.array([[c_utils.shared_memory.free_memory()]], np.int64)
            return [pb_utils.InferenceResponse([pb_utils.Tensor("FREE", free)])]
        responses = [
            pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.ones((1, 1 << 20), np.uint8))])
            for _ in requests
        ]
        requests[-1].get_response_sender().send(responses[-1])  # a bug: answered twice
        return responses
'''


def test_a_batch_whose_reply_fails_partway_gives_back_the_memory_of_those_made(servers, make_repo):
    """The first response of the batch is made (its 1 MiB output leased to the server),
    then the last one fails the call: the lease is dropped with the reply. The worker's
    free shared memory fell by 1 MiB with every such batch, for good."""
    config = (
        'backend: "python"\nmax_batch_size: 4\n'
        "dynamic_batching { max_queue_delay_microseconds: 300000 }\n"
        'input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        'output [ { name: "OUT" data_type: TYPE_UINT8 dims: [ -1 ] },'
        ' { name: "FREE" data_type: TYPE_INT64 dims: [ 1 ] } ]\n'
    )
    repo = make_repo(extra={"double": {"config.pbtxt": config, "1/model.py": DOUBLE_ANSWER_MODEL}})
    server = servers.start(repo)
    model = server.model("double")

    def free() -> int:
        (answer,) = model.infer(inputs={"X": np.array([[9]], np.int32)}, requested_output_names=["FREE"])
        return int(answer.outputs["FREE"].as_numpy()[0, 0])

    def fail_in_pairs() -> None:
        failed = []

        def ask() -> None:
            failed.extend(model.infer(inputs={"X": np.array([[0]], np.int32)}, raise_on_error=False))

        pair = [threading.Thread(target=ask) for _ in range(2)]
        for thread in pair:
            thread.start()
        for thread in pair:
            thread.join(30)
        # (the one answered twice has its sender's answer; the call's error is the other's)
        assert len(failed) == 2 and [r.error is None for r in failed].count(False) == 1

    def executions() -> int:
        return model.statistics()["model_stats"][0]["execution_count"]

    before, start = free(), executions()
    for _ in range(4):
        fail_in_pairs()
    assert executions() - start < 8, "the requests were batched in pairs"  # (else this checks nothing)
    wait_until(lambda: free() == before, timeout=5)


PRESERVED_CONFIG = """
backend: "python"
max_batch_size: 8
model_transaction_policy { decoupled: true }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 2 } ]
dynamic_batching { preserve_ordering: true }
"""
PRESERVED_MODEL = '''
import json, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            time.sleep(float(json.loads(request.parameters()).get("sleep", 0)))
            tag = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0, 0])
            for step in (1, 2, 3):
                out = np.array([[tag * 10 + step]], np.int32)
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''


def test_preserve_ordering_holds_every_response_of_a_decoupled_request(make_repo, servers):
    """Each of a later request's responses waits for the earlier request's final one
    (only its first did, and the others went ahead or were lost)."""
    repo = make_repo(extra={"po": {"config.pbtxt": PRESERVED_CONFIG, "1/model.py": PRESERVED_MODEL}})
    server = servers.start(repo)
    model = server.model("po")
    arrivals: list[int] = []

    async def stream(tag: int, **kwargs: Any) -> list[int]:
        got = []
        async for response in model.async_infer(inputs={"IN": np.array([[tag]], np.int32)}, **kwargs):
            if "OUT" in response.outputs:
                got.append(int(np.from_dlpack(response.outputs["OUT"])[0, 0]))
                arrivals.append(got[-1])
        return got

    async def both() -> list[list[int]]:
        first = asyncio.ensure_future(stream(1, parameters={"sleep": 1.0}))
        await asyncio.sleep(0.2)  # the first executes on one instance; the second takes the other
        return await asyncio.gather(first, stream(2))

    assert asyncio.run(both()) == [[11, 12, 13], [21, 22, 23]]
    assert arrivals == [11, 12, 13, 21, 22, 23]


SLEEPER_CONFIG = """
backend: "python"
input [ { name: "MS" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "PID" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 2 } ]
"""
SLEEPER = '''
import os, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            time.sleep(int(pb_utils.get_input_tensor_by_name(request, "MS").as_numpy()[0]) / 1000)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("PID", np.array([os.getpid()], np.int32))]))
        return out
'''


def test_no_request_waits_behind_a_slow_one_while_another_instance_is_free(make_repo, servers):
    """Default scheduler, two instances: quick requests that come while one instance
    runs a slow request all run on the other, as in Triton (one of them was sent into
    the busy worker's pipeline and waited for the slow one)."""
    server = servers.start(make_repo(extra={"sleeper": {"config.pbtxt": SLEEPER_CONFIG, "1/model.py": SLEEPER}}))
    model = server.model("sleeper")

    async def one(ms: int) -> int:
        async for response in model.async_infer(inputs={"MS": np.array([ms], np.int32)}):
            return int(np.from_dlpack(response.outputs["PID"])[0])
        raise AssertionError("no response")

    async def run() -> tuple[int, list[int]]:
        slow = asyncio.ensure_future(one(2000))
        await asyncio.sleep(0.3)  # the slow one runs on one instance
        quick = await asyncio.gather(*(one(10) for _ in range(6)))
        return await slow, quick

    slow_pid, quick_pids = asyncio.run(run())
    assert slow_pid not in quick_pids
