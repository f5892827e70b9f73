"""The sequence batcher: sequences stay on one instance, in order; control inputs;
idle release; batching across sequences; iterative rescheduling; lost sequences;
sequence parameters over HTTP and gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import dlserve
from dlserve import ModelControlMode

from ..conftest import MODELS, serve

START, END = 1, 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    names = ["accumulate", "iterative", "iterative_sender"]
    yield from serve(tmp_path_factory, names, model_control_mode=ModelControlMode.EXPLICIT, startup_models=names)


def value(x: int) -> np.ndarray:
    return np.array([[x]], dtype=np.int32)


async def step(model: dlserve.Model, key: int | str, flags: int, x: int = 1, **kwargs: Any) -> Any:
    """One request of sequence ``key`` (INPUT ``x``); its response, errors included."""
    async for response in model.async_infer(
        inputs={"INPUT": value(x)}, correlation_id=key, flags=flags, raise_on_error=False, **kwargs
    ):
        return response
    raise AssertionError("no response")


async def send(server: dlserve.Server, key: int | str, x: int, flags: int = 0, **kwargs: Any) -> Any:
    return await step(server.model("accumulate"), key, flags, x, **kwargs)


def total(response: Any) -> int:
    assert response.error is None, response.error
    return int(response.outputs["OUTPUT"].as_numpy()[0, 0])


def instance(response: Any) -> str:
    return response.outputs["INSTANCE"].to_bytes_array()[0, 0].decode()


async def run_sequence(server: dlserve.Server, key: int | str, values: list[int]) -> list[Any]:
    responses = []
    for i, x in enumerate(values):
        flags = (START if i == 0 else 0) | (END if i == len(values) - 1 else 0)
        responses.append(await send(server, key, x, flags))
    return responses


def test_sequences_keep_their_state_and_instance(server):
    async def run() -> list[list[Any]]:
        return await asyncio.gather(*(run_sequence(server, 100 + k, [1, 2, 3, 4, 5]) for k in range(4)))

    for responses in asyncio.run(run()):
        assert [total(r) for r in responses] == [1, 3, 6, 10, 15]
        assert len({instance(r) for r in responses}) == 1
    used = {instance(rs[0]) for rs in asyncio.run(run())}
    assert used == {"accumulate_0_0", "accumulate_0_1"}  # sequences were spread over both


def test_sequences_one_at_a_time_take_turns_on_the_instances(server):
    """As in Triton: a free slot ties across instances, so the least recently used wins."""
    used = [instance(asyncio.run(run_sequence(server, 300 + k, [1, 1]))[0]) for k in range(4)]
    assert used[0] != used[1] and used[:2] == used[2:]


def test_requests_sent_together_run_in_order(server):
    async def run() -> list[Any]:
        flags = [START, 0, 0, 0, END]
        return await asyncio.gather(*(send(server, 7, x, f) for x, f in zip([1, 2, 3, 4, 5], flags)))

    assert [total(r) for r in asyncio.run(run())] == [1, 3, 6, 10, 15]


def test_control_inputs_reach_the_model(server):
    responses = asyncio.run(run_sequence(server, 4242, [1, 1, 1]))
    controls = [r.outputs["CONTROLS"].as_numpy()[0].tolist() for r in responses]
    assert controls == [[1, 0, 1, 4242], [0, 0, 1, 4242], [0, 1, 1, 4242]]


def test_string_correlation_ids_and_numeric_corrid_control(server):
    response = asyncio.run(send(server, "session-a", 1, START))
    assert isinstance(response.error, dlserve.InvalidArgumentError)
    assert "CORRID control input is numeric" in str(response.error)


def test_requests_must_name_a_started_sequence(server):
    response = asyncio.run(send(server, 0, 1, START))
    assert "must specify a non-zero or non-empty correlation ID" in str(response.error)
    response = asyncio.run(send(server, 555, 1))
    assert "must specify the START flag on the first request of the sequence" in str(response.error)
    response = asyncio.run(run_sequence(server, 556, [1, 2]))[-1]
    late = asyncio.run(send(server, 556, 1))
    assert total(response) == 3 and "START flag" in str(late.error)  # ended sequences are gone


def test_a_sequence_request_carries_one_batch_row(server):
    async def run() -> Any:
        async for response in server.model("accumulate").async_infer(
            inputs={"INPUT": np.array([[1], [2]], dtype=np.int32)}, correlation_id=31, flags=START,
            raise_on_error=False,
        ):
            return response

    response = asyncio.run(run())
    assert isinstance(response.error, dlserve.InvalidArgumentError)
    assert "must specify batch-size 1 due to requirements of sequence batcher" in str(response.error)
    assert total(asyncio.run(send(server, 31, 4, START | END))) == 4  # the sequence was never started


@contextlib.contextmanager
def one_slot(server: dlserve.Server, idle_us: int) -> Iterator[dlserve.Model]:
    """accumulate with one instance of one slot (max_batch_size 1), loaded for a test."""
    config = {
        "backend": "python", "max_batch_size": 1,
        "input": [{"name": "INPUT", "data_type": "TYPE_INT32", "dims": [1]}],
        "output": [{"name": "OUTPUT", "data_type": "TYPE_INT32", "dims": [1]}],
        "sequence_batching": {"max_sequence_idle_microseconds": idle_us, "control_input": [
            {"name": name, "control": [{"kind": f"CONTROL_SEQUENCE_{kind}", **spec}]}
            for name, kind, spec in [
                ("START", "START", {"int32_false_true": [0, 1]}), ("END", "END", {"int32_false_true": [0, 1]}),
                ("READY", "READY", {"int32_false_true": [0, 1]}), ("CORRID", "CORRID", {"data_type": "TYPE_UINT64"}),
            ]
        ]},
        "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
    }
    source = (MODELS / "accumulate" / "1" / "model.py").read_bytes()
    server.load("one_slot", {"config": json.dumps(config), "file:1/model.py": source})
    try:
        yield server.model("one_slot")
    finally:
        server.unload("one_slot")


def test_a_sequence_whose_start_is_cancelled_before_it_runs_is_forgotten(server):
    """One slot: B's START waits behind A and is cancelled. As in Triton 2.51 (upstream
    L0_request_cancellation, side by side), that cancels B: its request queued behind the
    START is answered CANCELLED, it holds no slot once A ends (C runs at once, not after
    B's 5 s idle time) and its next request needs a START again."""
    with one_slot(server, idle_us=5_000_000) as model:
        async def run() -> tuple[Any, float, Any]:
            await step(model, 1, START)  # A takes the slot
            waiting = model.async_infer(inputs={"INPUT": value(1)}, correlation_id=2, flags=START)
            behind = asyncio.ensure_future(step(model, 2, 0))  # queued after B's START
            await asyncio.sleep(0.1)
            waiting.cancel()
            orphan = await behind
            await step(model, 1, END)  # A ends
            started = time.monotonic()
            third = await asyncio.wait_for(step(model, 3, START | END), timeout=10)
            return orphan, time.monotonic() - started, third

        orphan, took, third = asyncio.run(run())
        assert total(third) == 1 and took < 2.0
        assert isinstance(orphan.error, dlserve.CancelledError)
        late = asyncio.run(step(model, 2, 0))
        assert isinstance(late.error, dlserve.InvalidArgumentError) and "START flag" in str(late.error)


def test_cancelling_a_queued_request_of_a_running_sequence_cancels_the_sequence(server):
    """As Triton 2.51 (upstream scheduler_test, direct and oldest): A's START runs, two more
    of A wait; cancelling the first answers both CANCELLED, the running one finishes, and
    A is over (its next request needs a START)."""
    with one_slot(server, idle_us=5_000_000) as model:
        scheduler = server.engine.model("one_slot").scheduler

        def queued() -> int:
            while True:
                try:
                    return scheduler.pending
                except RuntimeError:  # (its sequences changed meanwhile on the server's thread)
                    continue

        async def run() -> tuple[Any, Any]:
            running = asyncio.ensure_future(step(model, 1, START, x=5, parameters={"sleep": 1.0}))
            while not scheduler.unfinished or queued():  # (until A's START runs)
                await asyncio.sleep(0.01)
            cancelled = model.async_infer(inputs={"INPUT": value(2)}, correlation_id=1, flags=0)
            sibling = asyncio.ensure_future(step(model, 1, 0, x=3))
            while queued() < 2:
                await asyncio.sleep(0.01)
            cancelled.cancel()
            return await running, await sibling

        first, sibling = asyncio.run(run())
        assert total(first) == 5
        assert isinstance(sibling.error, dlserve.CancelledError), sibling.error
        late = asyncio.run(step(model, 1, 0))
        assert isinstance(late.error, dlserve.InvalidArgumentError) and "START flag" in str(late.error)


def test_waiting_sequences_get_the_slot_in_the_order_they_came(server):
    """One slot held by A; B, C and D start behind it. Each gets the slot in turn, first
    come first served, as in Triton (a release used to send the second in line to the back)."""
    with one_slot(server, idle_us=5_000_000) as model:
        async def run() -> list[int]:
            await step(model, 1, START)
            finished: list[int] = []

            async def single(key: int) -> None:
                assert total(await step(model, key, START | END, x=key)) == key
                finished.append(key)

            waiting = []
            for key in (2, 3, 4, 5):
                waiting.append(asyncio.ensure_future(single(key)))
                await asyncio.sleep(0.05)
            await step(model, 1, END)
            await asyncio.gather(*waiting)
            return finished

        assert asyncio.run(run()) == [2, 3, 4, 5]


def test_a_request_refused_for_want_of_a_start_is_counted_nowhere(server):
    """As in Triton, whose statistics leave such client mistakes out."""
    def counts() -> tuple[int, int, str]:
        stats = server.model("accumulate").statistics()["model_stats"][0]["inference_stats"]
        rejected = [line for line in server.metrics().splitlines()
                    if line.startswith('nv_inference_request_failure{model="accumulate",reason="REJECTED"')]
        return stats["fail"]["count"], stats["success"]["count"], rejected[0]

    before = counts()
    response = asyncio.run(send(server, 7777, 1))  # no sequence 7777 was started
    assert isinstance(response.error, dlserve.InvalidArgumentError)
    assert counts() == before


SEQUENCE_CALLER = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "VALUES").as_numpy().reshape(-1).tolist()
            key = request.correlation_id() or 4040
            totals = []
            for i, x in enumerate(values):
                flags = (pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START if i == 0 else 0) | (
                    pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END if i == len(values) - 1 else 0)
                call = pb_utils.InferenceRequest(
                    model_name="accumulate", inputs=[pb_utils.Tensor("INPUT", np.array([[x]], np.int32))],
                    requested_output_names=["OUTPUT"], correlation_id=key, flags=flags)
                answer = call.exec()
                if answer.has_error():
                    raise pb_utils.TritonModelException(answer.error().message())
                totals.append(int(pb_utils.get_output_tensor_by_name(answer, "OUTPUT").as_numpy()[0, 0]))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("TOTALS", np.array(totals, np.int32))]))
        return responses
"""


def test_a_bls_call_runs_a_sequence_on_a_sequence_model(server):
    """"Using BLS with stateful models" (Triton's README): the caller names the sequence
    and its START/END flags on each pb_utils.InferenceRequest."""
    config = {
        "backend": "python",
        "input": [{"name": "VALUES", "data_type": "TYPE_INT32", "dims": [-1]}],
        "output": [{"name": "TOTALS", "data_type": "TYPE_INT32", "dims": [-1]}],
    }
    server.load("sequence_caller", {"config": json.dumps(config), "file:1/model.py": SEQUENCE_CALLER.encode()})
    try:
        (response,) = server.model("sequence_caller").infer(inputs={"VALUES": np.array([1, 2, 3, 4], np.int32)})
        assert response.outputs["TOTALS"].as_numpy().tolist() == [1, 3, 6, 10]
        # the sequence ended with its END: the same ID starts afresh
        (again,) = server.model("sequence_caller").infer(inputs={"VALUES": np.array([5, 5], np.int32)})
        assert again.outputs["TOTALS"].as_numpy().tolist() == [5, 10]
    finally:
        server.unload("sequence_caller")


def test_idle_sequences_are_released(server):
    assert total(asyncio.run(send(server, 77, 5, START))) == 5
    time.sleep(0.8)  # max_sequence_idle_microseconds is 0.5 s
    late = asyncio.run(send(server, 77, 1))
    assert isinstance(late.error, dlserve.InvalidArgumentError) and "START flag" in str(late.error)


def test_a_sequence_id_is_free_again_once_its_end_is_queued(server):
    """As Triton: the END forgets the correlation ID when it is queued, so a START with
    the same ID begins a new sequence behind it, and a request without START is refused."""

    async def run() -> list[Any]:
        first = asyncio.ensure_future(send(server, 880, 1, START, parameters={"sleep": 0.3}))
        await asyncio.sleep(0.1)  # it runs; what follows queues behind it
        ending = asyncio.ensure_future(send(server, 880, 2, END))
        await asyncio.sleep(0.02)
        orphan = asyncio.ensure_future(send(server, 880, 7))
        again = [asyncio.ensure_future(send(server, 880, 10, START))]
        await asyncio.sleep(0.02)
        again.append(asyncio.ensure_future(send(server, 880, 5, END)))
        return [await f for f in (first, ending, orphan, *again)]

    first, ending, orphan, *again = asyncio.run(run())
    assert [total(first), total(ending)] == [1, 3]
    assert isinstance(orphan.error, dlserve.InvalidArgumentError)
    assert "must specify the START flag on the first request of the sequence" in str(orphan.error)
    assert [total(r) for r in again] == [10, 15]


def test_batches_hold_requests_of_several_sequences(server):
    async def run() -> list[Any]:
        # one instance is busy with a slow request while four sequences queue behind it
        first = [asyncio.ensure_future(send(server, 900 + k, 1, START, parameters={"sleep": 0.3})) for k in range(2)]
        await asyncio.sleep(0.1)
        queued = [asyncio.ensure_future(send(server, 900 + k, 1, END)) for k in range(2)]
        queued += [asyncio.ensure_future(send(server, 950 + k, 1, START | END)) for k in range(4)]
        return [await f for f in first + queued]

    responses = asyncio.run(run())
    assert all(r.error is None for r in responses)
    assert max(int(r.outputs["BATCH"].as_numpy()[0, 0]) for r in responses) > 1


def test_iterative_sequence_reschedules(server):
    async def run() -> Any:
        async for response in server.model("iterative").async_infer(
            inputs={"STEPS": value(4)}, correlation_id=31, flags=START | END
        ):
            return response

    response = asyncio.run(run())
    assert int(response.outputs["RUNS"].as_numpy()[0, 0]) == 4
    stats = server.model("iterative").statistics()["model_stats"][0]
    assert stats["execution_count"] >= 4


def test_iterative_sequences_are_tritons_sequences_of_one_request(server):
    """As Triton 2.51 (measured): a request without a correlation ID is a sequence of its
    own (the model sees an ID the server picked, and START), and an iterative sequence
    ends once its request is done, so what follows needs a START again."""
    model = server.model("iterative")

    async def run() -> Any:
        standalone = [await anext(aiter(model.async_infer(inputs={"STEPS": value(n)}))) for n in (3, 2)]
        started = await anext(aiter(model.async_infer(inputs={"STEPS": value(1)}, correlation_id=41, flags=START)))
        then = await anext(aiter(model.async_infer(
            inputs={"STEPS": value(1)}, correlation_id=41, raise_on_error=False,
        )))
        return standalone, started, then

    standalone, started, then = asyncio.run(run())
    assert [int(r.outputs["RUNS"].as_numpy()[0, 0]) for r in standalone] == [3, 2]
    assert started.error is None
    assert isinstance(then.error, dlserve.InvalidArgumentError)
    assert "must specify the START flag on the first request of the sequence" in then.error.message


@pytest.mark.parametrize("delay_ms", [0, 300])
def test_a_response_sender_outlives_its_requests_reschedule(server, delay_ms):
    """As in Triton (its QA request_rescheduling case 1): a decoupled model that handed
    its request's sender to a thread and rescheduled the request still answers through
    that sender, whether the thread sends before or after the next execute, which sends
    nothing. The next execute dropping its own view of the request is no abandonment."""
    model = server.model("iterative_sender")

    async def run() -> list[Any]:
        return [r async for r in model.async_infer(inputs={"DELAY_MS": value(delay_ms)}, raise_on_error=False)]

    responses = asyncio.run(run())
    assert [r.error for r in responses] == [None] * len(responses)
    assert [int(r.outputs["OUT"].as_numpy()[0, 0]) for r in responses if r.outputs] == [1, 0]
    assert responses[-1].final and len(responses) == 3


ASYNC_ITERATIVE = """
import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.runs = {}
        self.ticker = None

    async def tick(self):
        while True:
            await asyncio.sleep(0.01)

    async def execute(self, requests):
        if self.ticker is None:  # a task of its own, left running (as the issue's model)
            self.ticker = asyncio.get_running_loop().create_task(self.tick())
        await asyncio.sleep(0)
        for request in requests:
            key = request.correlation_id()
            self.runs[key] = self.runs.get(key, 0) + 1
            steps = int(pb_utils.get_input_tensor_by_name(request, "STEPS").as_numpy()[0, 0])
            sender = request.get_response_sender()
            runs = np.array([[self.runs[key]]], np.int32)
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("RUNS", runs)]))
            if self.runs[key] < steps:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
            else:
                del self.runs[key]
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def test_an_async_decoupled_model_runs_an_iterative_sequence_to_its_end(servers, make_repo):
    """Triton's issue 8843: an iterative sequence whose model's execute is ``async def``
    (decoupled, a task of its own running) was force-ended after its first step; here it
    runs every step, one response each, then the final."""
    config = (MODELS / "iterative" / "config.pbtxt").read_text()
    config += "model_transaction_policy { decoupled: true }\n"
    model = {"config.pbtxt": config, "1/model.py": ASYNC_ITERATIVE}
    repo = make_repo(extra={"async_iterative": model})
    server = servers.start(repo)
    responses = list(server.model("async_iterative").infer(inputs={"STEPS": value(4)}))
    assert [int(r.outputs["RUNS"].as_numpy()[0, 0]) for r in responses if r.outputs] == [1, 2, 3, 4]
    assert responses[-1].final and len(responses) == 5


def test_a_rescheduled_request_answered_all_the_same_fails_as_in_triton(server):
    (response,) = server.model("iterative").infer(inputs={"STEPS": value(-1)}, raise_on_error=False)
    assert isinstance(response.error, dlserve.InternalError)
    assert "Expected a None object in the execute function return list for reschduled request" in response.error.message


def test_a_dead_instance_loses_its_sequences(server):
    responses = asyncio.run(run_sequence(server, 3131, [1]))  # no END: the sequence stays open
    first = asyncio.run(send(server, 3132, 1, START))
    name = instance(first)
    victim = next(i for i in server.engine.model("accumulate").instances if i.name == name)
    restarts = victim.restarts
    os.kill(victim.pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while victim.restarts == restarts or not victim.ready:  # died, and came back
        assert time.monotonic() < deadline
        time.sleep(0.05)
    late = asyncio.run(send(server, 3132, 1))  # its next step is told why it was refused
    assert isinstance(late.error, dlserve.UnavailableError)
    assert str(late.error).startswith("sequence 3132 of model 'accumulate' was lost: ")
    assert "killed by SIGKILL" in str(late.error) and str(late.error).endswith("; start it again")
    assert total(asyncio.run(send(server, 3132, 2, START))) == 2  # it can start again
    del responses


def test_sequence_parameters_over_http_and_grpc(server):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    from dlserve.frontends import KServeGrpc, KServeHttp

    http = KServeHttp(server, KServeHttp.Options(address="127.0.0.1", port=0))
    grpc = KServeGrpc(server, KServeGrpc.Options(address="127.0.0.1", port=0))
    with http, grpc:
        for module, url in ((httpclient, f"127.0.0.1:{http.port}"), (grpcclient, f"127.0.0.1:{grpc.port}")):
            client = module.InferenceServerClient(url)
            totals = []
            for i, x in enumerate([2, 3, 4]):
                tensor = module.InferInput("INPUT", [1, 1], "INT32")
                tensor.set_data_from_numpy(value(x))
                result = client.infer(
                    "accumulate",
                    [tensor],
                    sequence_id=61 if module is httpclient else 62,
                    sequence_start=i == 0,
                    sequence_end=i == 2,
                )
                totals.append(int(result.as_numpy("OUTPUT")[0, 0]))
            assert totals == [2, 5, 9]
            client.close()
        # A uint64 ID above 2**63 comes over gRPC as a negative int64_param (as C++ clients
        # send it): it is that uint64, as Triton reads it; it failed and kept a slot.
        with grpcclient.InferenceServerClient(f"127.0.0.1:{grpc.port}") as client:
            for _ in range(3):  # more than the instances' slots, had any been kept
                tensor = grpcclient.InferInput("INPUT", [1, 1], "INT32")
                tensor.set_data_from_numpy(value(1))
                result = client.infer("accumulate", [tensor], sequence_id=-1, sequence_start=True, sequence_end=True)
                assert result.as_numpy("CONTROLS")[0].tolist() == [1, 1, 1, -1]  # (uint64 max as INT64)


@pytest.mark.parametrize(
    "strategy,together",
    [
        ("direct { max_queue_delay_microseconds: 2000000 minimum_slot_utilization: 1.0 }", 4),
        ("oldest { max_candidate_sequences: 4 preferred_batch_size: [ 3 ] max_queue_delay_microseconds: 2000000 }", 3),
    ],
)
def test_a_batching_delay_gathers_sequences_into_one_batch(servers, make_repo, strategy, together):
    """As Triton's: with max_queue_delay_microseconds the batch waits for its slots to fill
    (direct: minimum_slot_utilization of them) or for a preferred size (oldest), and
    goes when the delay is over if they do not. (Without the wait the first request ran
    alone at once.)"""
    repo = make_repo("accumulate")
    config = repo / "accumulate" / "config.pbtxt"
    text = config.read_text().replace("count: 2", "count: 1")
    config.write_text(text.replace("sequence_batching {", f"sequence_batching {{\n  {strategy}", 1))
    server = servers.start(repo)

    async def run(keys: range) -> list[Any]:
        return await asyncio.gather(*(send(server, key, 1, START | END) for key in keys))

    assert [int(r.outputs["BATCH"].as_numpy()[0, 0]) for r in asyncio.run(run(range(1, together + 1)))] == [together] * together
    (alone,) = asyncio.run(run(range(100, 101)))  # nothing more comes: it goes after the delay
    assert total(alone) == 1 and int(alone.outputs["BATCH"].as_numpy()[0, 0]) == 1


# -- implicit state (sequence_batching.state) ---------------------------------------------------
async def send_state(server: dlserve.Server, key: int, x: int, flags: int = 0, **kwargs: Any) -> Any:
    return await step(server.model("state_accumulate"), key, flags, x, **kwargs)


def test_implicit_state_carries_from_request_to_request(servers, make_repo):
    """Triton's implicit state management (which its Python backend lacks): each request
    gets the state output of the one before; the first, the initial state from its file
    (10). The model keeps nothing, and a client that does not ask sees no state output."""
    server = servers.start(make_repo("state_accumulate"))

    async def run() -> list[list[Any]]:
        async def sequence(key: int, values: list[int]) -> list[Any]:
            out = []
            for i, x in enumerate(values):
                flags = (START if i == 0 else 0) | (END if i == len(values) - 1 else 0)
                out.append(await send_state(server, key, x, flags, requested_output_names=["OUTPUT"]))
            return out

        return await asyncio.gather(sequence(1, [1, 2, 3]), sequence(2, [5, 5]))

    first, second = asyncio.run(run())
    assert [total(r) for r in first] == [11, 13, 16]
    assert [total(r) for r in second] == [15, 20]
    assert all(set(r.outputs) == {"OUTPUT"} for r in first + second)
    # started again: the initial state, not what the sequence left
    again = asyncio.run(send_state(server, 1, 1, START))
    assert total(again) == 11
    # the config lists the state output, so a client may ask for it (Triton's debugging aid)
    shown = asyncio.run(send_state(server, 1, 4, END))
    assert int(shown.outputs["OUTPUT_STATE"].as_numpy()[0, 0]) == 15


@pytest.mark.parametrize(
    "state,message",
    [
        ('input_name: "INPUT" output_name: "S" data_type: TYPE_INT32 dims: [ 1 ]', "the state input is also a model input"),
        ('input_name: "S_IN" output_name: "S" data_type: TYPE_STRING dims: [ 1 ]', "needs a numeric data_type"),
        (
            'input_name: "S_IN" output_name: "S" data_type: TYPE_INT32 dims: [ 1 ] '
            'initial_state: { data_type: TYPE_INT32 dims: [ 3 ] data_file: "start" }',
            "holds 1 values, dims [3] need 3",
        ),
        (
            'input_name: "S_IN" output_name: "S" data_type: TYPE_INT32 dims: [ 1 ] '
            'initial_state: { data_type: TYPE_INT32 dims: [ 1 ] data_file: "missing" }',
            "cannot read initial state file",
        ),
    ],
)
def test_bad_implicit_state_fails_the_load(servers, make_repo, state, message):
    repo = make_repo("state_accumulate")
    config = repo / "state_accumulate" / "config.pbtxt"
    text = config.read_text()
    start, end = text.index("state ["), text.index("instance_group")
    config.write_text(text[:start] + f"state [ {{ {state} }} ]\n}}\n" + text[end:])
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    with pytest.raises(dlserve.InvalidArgumentError, match=message.replace("[", r"\[").replace("]", r"\]")):
        server.load("state_accumulate")

