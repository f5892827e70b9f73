"""The sequence batcher's direct strategy, as Triton 2.51's shows it to a Python model
(observed side by side): a sequence keeps one batch slot (free again once its END is
in a batch), its requests always take that place in the batch, and the places below
the highest slot with a request that have none get fillers (READY false, correlation
ID 0, zeros shaped like the batch's), whose answers reach nobody and which statistics
count in batch sizes only. Also the oldest strategy's one shape per batch."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from typing import Any

import numpy as np
import pytest

import dlserve

START, END = 1, 2
FILLER = {"corrid": 0, "id": "", "controls": [0, 0, 0, 0]}


@pytest.fixture
def slots(servers, make_repo) -> dlserve.Model:
    return servers.start(make_repo("slots")).model("slots")


async def step(model: dlserve.Model, key: int, flags: int, size: int = 2, **parameters: Any) -> Any:
    """One request of sequence ``key``: INPUT [1, size] of ``key``s; its response."""
    inputs = {"INPUT": np.full((1, size), key, dtype=np.float32)}
    async for response in model.async_infer(
        inputs=inputs, correlation_id=key, flags=flags, request_id=f"r{key}",
        parameters=parameters, raise_on_error=False,
    ):
        assert response.error is None, response.error
        assert response.outputs["OUTPUT"].as_numpy().tolist() == inputs["INPUT"].tolist()
        return response
    raise AssertionError("no response")


def batch(response: Any) -> list[dict[str, Any]]:
    """What the model saw of the batch, place by place."""
    return json.loads(response.outputs["BATCH_VIEW"].to_bytes_array()[0, 0])


def real(key: int, flags: int, size: int = 2) -> dict[str, Any]:
    return {
        "corrid": key, "id": f"r{key}", "controls": [flags & START, (flags & END) >> 1, 1, key],
        "shape": [1, size], "sum": float(key * size),
    }


def filler(size: int = 2) -> dict[str, Any]:
    return {**FILLER, "shape": [1, size], "sum": 0.0}


def slots_model(servers, make_repo, max_batch_size: int, strategy: str = "direct { }") -> dlserve.Model:
    """The slots model with ``max_batch_size`` (with either strategy, by default its
    sequences per instance) and ``strategy``."""
    repo = make_repo("slots")
    config = repo / "slots" / "config.pbtxt"
    config.write_text(
        config.read_text()
        .replace("max_batch_size: 4", f"max_batch_size: {max_batch_size}")
        .replace("direct { }", strategy)
    )
    return servers.start(repo).model("slots")


async def third_waits_for_a_slot(model: dlserve.Model, first: int, second: int, third: int) -> Any:
    """Two sequences hold both slots; a third starts, waits, and runs once the first ends."""
    await step(model, first, START)
    await step(model, second, START)
    waiting = asyncio.ensure_future(step(model, third, START))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    await step(model, first, END)
    return await waiting


def test_each_sequence_keeps_its_slot_and_gaps_get_fillers(slots):
    async def run() -> list[list[dict[str, Any]]]:
        seen = [batch(await step(slots, key, START)) for key in (11, 12, 13)]  # slots 0, 1, 2
        seen.append(batch(await step(slots, 13, 0, size=3)))  # only slot 2 has a request
        seen.append(batch(await step(slots, 11, END)))  # slot 0 is free again after this
        seen.append(batch(await step(slots, 14, START)))  # the lowest free slot: 0
        seen.append(batch(await step(slots, 12, END)))
        return seen

    assert asyncio.run(run()) == [
        [real(11, START)],
        [filler(), real(12, START)],
        [filler(), filler(), real(13, START)],
        [filler(3), filler(3), real(13, 0, size=3)],
        [real(11, END)],
        [real(14, START)],
        [filler(), real(12, END)],
    ]
    # Fillers count in the batch's size, not as inferences; their error answers reach
    # nobody and fail nothing.
    stats = slots.statistics()["model_stats"][0]
    assert stats["inference_count"] == 7 and stats["execution_count"] == 7
    assert stats["inference_stats"]["success"]["count"] == 7
    assert stats["inference_stats"]["fail"]["count"] == 0
    assert {row["batch_size"]: row["compute_infer"]["count"] for row in stats["batch_stats"]} == {1: 3, 2: 2, 3: 2}


def test_requests_of_another_shape_wait_for_a_batch_of_their_own(slots):
    """The lowest slot with a request sets the batch's shapes; a slot whose request
    differs gets a filler of those shapes and runs in the next batch, as in Triton."""
    async def run() -> tuple[Any, Any]:
        await step(slots, 21, START)
        await step(slots, 22, START)
        busy = asyncio.ensure_future(step(slots, 23, START | END, sleep=0.5))  # slot 2 holds the instance
        await asyncio.sleep(0.2)
        first = asyncio.ensure_future(step(slots, 21, END, size=3))
        second = asyncio.ensure_future(step(slots, 22, END, size=5))
        await busy
        return await first, await second

    first, second = asyncio.run(run())
    assert batch(first) == [real(21, END, size=3), filler(3)]
    assert batch(second) == [filler(5), real(22, END, size=5)]


def test_a_waiting_sequence_takes_the_slot_that_frees(servers, make_repo):
    """Two slots (max_batch_size 2), both held: a third sequence waits, then takes the
    freed slot 0, and with it place 0 in every batch, whatever the arrival order."""
    model = slots_model(servers, make_repo, max_batch_size=2)

    async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        started = batch(await third_waits_for_a_slot(model, 31, 32, 33))
        busy = asyncio.ensure_future(step(model, 32, 0, sleep=0.5))
        await asyncio.sleep(0.2)
        later = asyncio.ensure_future(step(model, 32, 0))  # queued first...
        await asyncio.sleep(0.05)
        last = await step(model, 33, END)  # ...but placed second
        await busy
        await later
        return started, batch(last)

    started, together = asyncio.run(run())
    assert started == [real(33, START)]
    assert together == [real(33, END), real(32, 0)]


def test_oldest_times_a_sequences_next_request_from_when_the_one_before_it_finished(servers, make_repo):
    """As Triton's oldest strategy, which hands a sequence's next request to its batcher
    only once the one before it is done: queued meanwhile, it still waits the whole
    max_queue_delay after that, so a sequence that starts within it joins its batch
    (dlserve timed the delay from its arrival and sent it alone)."""
    strategy = "oldest { max_candidate_sequences: 2 max_queue_delay_microseconds: 500000 }"
    model = slots_model(servers, make_repo, max_batch_size=2, strategy=strategy)

    async def run() -> tuple[Any, Any]:
        first = asyncio.ensure_future(step(model, 41, START, sleep=0.4))  # waits 0.5 s, runs until ~0.9 s
        await asyncio.sleep(0.6)
        second = asyncio.ensure_future(step(model, 41, 0))  # queued while the first runs
        await asyncio.sleep(0.65)  # ~1.25 s: within 0.5 s of the first's end, past 0.5 s of its arrival
        other = await step(model, 42, START)
        await first
        return batch(await second), batch(other)

    second, other = asyncio.run(run())
    assert second == other == [real(41, 0), real(42, START)]


def test_oldest_without_max_candidate_sequences_holds_max_batch_size_sequences(servers, make_repo):
    """As Triton: the oldest strategy's candidate sequences per instance default to
    max_batch_size (dlserve took any number), so a third sequence waits for a free one."""
    model = slots_model(servers, make_repo, max_batch_size=2, strategy="oldest { }")
    assert batch(asyncio.run(third_waits_for_a_slot(model, 71, 72, 73))) == [real(73, START)]


def test_a_sequence_waiting_for_a_slot_fails_when_its_timeout_runs_out(servers, make_repo, caplog):
    """As Triton: a sequence in the backlog fails with its requests' timeout, and a START
    for a sequence still going is logged as a conflict (and continues it)."""
    model = slots_model(servers, make_repo, max_batch_size=1)

    async def waiting(key: int, **kwargs: Any) -> Any:
        inputs = {"INPUT": np.full((1, 2), key, dtype=np.float32)}
        async for response in model.async_infer(
            inputs=inputs, correlation_id=key, flags=START, raise_on_error=False, **kwargs
        ):
            return response
        raise AssertionError("no response")

    async def run() -> tuple[Any, Any]:
        await step(model, 81, START)  # the only slot
        timed_out = await waiting(82, timeout=100_000)
        with caplog.at_level(logging.WARNING, logger="dlserve"):
            await step(model, 81, START)
        untimed = asyncio.ensure_future(waiting(83))
        await asyncio.sleep(0.3)
        assert not untimed.done()  # no timeout: it waits for the slot
        await step(model, 81, END)
        return timed_out, await untimed

    timed_out, untimed = asyncio.run(run())
    assert isinstance(timed_out.error, dlserve.UnavailableError)
    assert str(timed_out.error) == "timeout of the corresponding sequence has been expired"
    assert untimed.error is None
    assert any(
        "sequence 81 for model 'slots' has a conflict. The previous sequence did not end before this "
        "sequence start. Previous sequence will be terminated early." == r.getMessage() for r in caplog.records
    )


def test_tritons_delay_scheduler_hooks_hold_the_first_batch(servers, make_repo, monkeypatch):
    """Triton's test hooks, which its upstream sequence batcher tests set: no batch until
    TRITONSERVER_DELAY_SCHEDULER requests are queued in slots and
    TRITONSERVER_BACKLOG_DELAY_SCHEDULER in the backlog."""
    monkeypatch.setenv("TRITONSERVER_DELAY_SCHEDULER", "2")
    monkeypatch.setenv("TRITONSERVER_BACKLOG_DELAY_SCHEDULER", "1")
    model = slots_model(servers, make_repo, max_batch_size=2)

    async def run() -> list[Any]:
        first = [asyncio.ensure_future(step(model, key, START | END)) for key in (91, 92)]
        await asyncio.sleep(0.3)
        assert not any(f.done() for f in first)  # two in slots, none in the backlog yet
        last = asyncio.ensure_future(step(model, 93, START | END))  # waits for a slot
        return [batch(await f) for f in (*first, last)]

    first, second, last = asyncio.run(run())
    assert first == second == [real(91, START | END), real(92, START | END)]
    assert last == [real(93, START | END)]


def test_a_sequence_frees_its_slot_when_its_end_goes_into_a_batch(slots):
    """As in Triton: the slot is free once the END request is in a batch, not when that
    batch is done, so sequences starting meanwhile take the lowest slots (0 and 1 here,
    with no filler before them)."""
    async def run() -> list[dict[str, Any]]:
        ending = asyncio.ensure_future(step(slots, 51, START | END, sleep=0.5))  # slot 0, executing
        await asyncio.sleep(0.2)
        second = asyncio.ensure_future(step(slots, 52, START))
        await asyncio.sleep(0.05)
        third = asyncio.ensure_future(step(slots, 53, START))
        await ending
        await second
        return batch(await third)

    assert asyncio.run(run()) == [real(52, START), real(53, START)]


def test_oldest_batches_only_requests_of_the_oldest_ones_shapes(servers, make_repo):
    """The oldest strategy, as Triton's: a batch holds the oldest request and those with
    its input shapes; others wait for a batch of their own (they used to join it)."""
    model = slots_model(servers, make_repo, max_batch_size=4, strategy="oldest { max_candidate_sequences: 4 }")

    async def run() -> tuple[Any, Any, Any]:
        busy = asyncio.ensure_future(step(model, 60, START | END, sleep=0.5))
        await asyncio.sleep(0.2)
        queued = []
        for key, size in ((61, 2), (62, 3), (63, 2)):
            queued.append(asyncio.ensure_future(step(model, key, START | END, size=size)))
            await asyncio.sleep(0.03)
        await busy
        return tuple([await f for f in queued])

    first, other, third = asyncio.run(run())
    assert batch(first) == batch(third) == [real(61, START | END), real(63, START | END)]
    assert batch(other) == [real(62, START | END, size=3)]


def test_oldest_sends_its_largest_preferred_batch_at_once(servers, make_repo):
    """As Triton 2.51 side by side: with three sequences ready and preferred_batch_size
    [2], the oldest strategy sends the two oldest, then the third (dlserve sent all
    three, which fit max_batch_size)."""
    strategy = "oldest { max_candidate_sequences: 4 preferred_batch_size: [ 2 ] }"
    model = slots_model(servers, make_repo, max_batch_size=4, strategy=strategy)

    async def run() -> list[Any]:
        busy = asyncio.ensure_future(step(model, 70, START | END, sleep=0.5))
        await asyncio.sleep(0.2)
        queued = []
        for key in (71, 72, 73):
            queued.append(asyncio.ensure_future(step(model, key, START | END)))
            await asyncio.sleep(0.03)
        await busy
        return [batch(await f) for f in queued]

    first, second, third = asyncio.run(run())
    assert first == second == [real(71, START | END), real(72, START | END)]
    assert third == [real(73, START | END)]


STREAMING_SLOTS = '''
import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    """Decoupled: each request gets its INPUT back and a final through its sender; a
    filler's sender gets an answer too, and every other one is never closed."""

    def initialize(self, args):
        self.open = []  # fillers' senders left open

    def execute(self, requests):
        for place, request in enumerate(requests):
            sender = request.get_response_sender()
            data = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            ready = pb_utils.get_input_tensor_by_name(request, "READY").as_numpy().item()
            sender.send(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT", data),
                pb_utils.Tensor("BATCH_VIEW", np.array([[str(len(requests)).encode()]], dtype=np.object_)),
            ]))
            if ready or place % 2 == 0:
                sender.send(flags=FINAL)
            else:
                self.open.append(sender)
        return None
'''


def test_a_decoupled_models_answers_to_fillers_reach_nobody(servers, make_repo):
    """A decoupled sequence model answering its fillers (closing some senders, not
    others): each real request gets its own answer and final only, nothing hangs, and
    nothing leaks (the harness checks workers, shared memory and descriptors)."""
    repo = make_repo("slots")
    config = repo / "slots" / "config.pbtxt"
    config.write_text(config.read_text() + "model_transaction_policy { decoupled: true }\n")
    (repo / "slots" / "1" / "model.py").write_text(STREAMING_SLOTS)
    model = servers.start(repo).model("slots")

    async def answers(key: int, flags: int) -> list[Any]:
        inputs = {"INPUT": np.full((1, 2), key, dtype=np.float32)}
        return [r async for r in model.async_infer(inputs=inputs, correlation_id=key, flags=flags)]

    async def run() -> list[list[Any]]:
        opened = [await answers(key, START) for key in (71, 72, 73)]  # slots 0, 1, 2
        later = await asyncio.gather(answers(73, 0), answers(72, END))  # fillers at 0 (and 1)
        return [*opened, *later]

    streams = asyncio.run(run())
    for stream, key in zip(streams, (71, 72, 73, 73, 72)):
        data = [r for r in stream if r.outputs]
        assert len(data) == 1 and data[0].outputs["OUTPUT"].as_numpy().tolist() == [[key, key]]
        assert stream[-1].final
    third_start = [r for r in streams[2] if r.outputs][0]
    assert third_start.outputs["BATCH_VIEW"].to_bytes_array()[0, 0] == b"3"  # with two fillers


ASYNC_SLOTS = '''
import asyncio
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Async execute (several at once per instance): records which sequence holds each
    place while it runs; an answer lists the places it found taken by another one."""

    def initialize(self, args):
        self.busy = {}

    async def execute(self, requests):
        clashes = []
        for place, request in enumerate(requests):
            if pb_utils.get_input_tensor_by_name(request, "READY").as_numpy().item():
                if place in self.busy:
                    clashes.append([place, self.busy[place], request.correlation_id()])
                self.busy[place] = request.correlation_id()
        await asyncio.sleep(max(float(json.loads(r.parameters()).get("sleep", 0)) for r in requests))
        for place, request in enumerate(requests):
            if self.busy.get(place) == request.correlation_id():
                del self.busy[place]
        view = np.array([[json.dumps(clashes).encode()]], dtype=np.object_)
        return [
            pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT", pb_utils.get_input_tensor_by_name(r, "INPUT").as_numpy()),
                pb_utils.Tensor("BATCH_VIEW", view),
            ])
            for r in requests
        ]
'''


def test_an_async_models_slot_is_free_only_once_its_end_is_done(servers, make_repo):
    """An async model runs several executes at once: its slot cannot be given away while
    the END that held it still runs there, or two sequences would share a place."""
    repo = make_repo("slots")
    (repo / "slots" / "1" / "model.py").write_text(ASYNC_SLOTS)
    model = servers.start(repo).model("slots")

    async def run() -> list[Any]:
        await step(model, 81, START)
        ending = asyncio.ensure_future(step(model, 81, END, sleep=0.6))
        await asyncio.sleep(0.2)
        starting = await step(model, 82, START)
        await ending
        return batch(starting)

    assert asyncio.run(run()) == []  # no place was found taken


def test_a_waiting_sequence_takes_the_slot_of_an_instance_that_came_back(servers, make_repo):
    """Two instances of one slot each, both held, a third sequence waiting: when one
    instance's worker dies (its sequence is lost) and comes back, the waiting sequence
    takes its slot (it used to wait until another sequence ended)."""
    repo = make_repo("slots")
    config = repo / "slots" / "config.pbtxt"
    text = config.read_text().replace("max_batch_size: 4", "max_batch_size: 1").replace("count: 1", "count: 2")
    config.write_text(text.replace("5000000", "120000000"))  # (no slot frees by idling meanwhile)
    server = servers.start(repo)
    model = server.model("slots")

    async def run() -> Any:
        await step(model, 91, START)
        await step(model, 92, START)
        waiting = asyncio.ensure_future(step(model, 93, START | END))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        scheduler = server.engine.model("slots").scheduler
        os.kill(scheduler.sequences[91].instance.pid, signal.SIGKILL)
        return await asyncio.wait_for(waiting, timeout=30)

    assert batch(asyncio.run(run())) == [real(93, START | END)]
