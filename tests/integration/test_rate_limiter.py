"""The rate limiter (``--rate-limit=execution_count`` + instance groups' ``rate_limiter``):
instances that need the same resources take turns across models, pool sizes from the
command line, priorities, and configs that could never run."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

import dlserve

# Records when each execute ran (monotonic seconds) into <repository>/runs.jsonl.
SLEEPER = """
import json, os, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_name"]
        self.log = os.path.join(os.path.dirname(args["model_repository"]), "runs.jsonl")

    def execute(self, requests):
        start = time.monotonic()
        time.sleep(0.15)
        with open(self.log, "a") as f:
            f.write(json.dumps({"model": self.name, "start": start, "end": time.monotonic()}) + "\\n")
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.zeros(1, np.float32))]) for _ in requests]
"""


def config(resources: str, priority: int = 1) -> str:
    return f"""
backend: "python"
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 1 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU rate_limiter {{ resources [ {resources} ] priority: {priority} }} }} ]
"""


def repo_of(make_repo, **models: str):
    return make_repo(extra={name: {"config.pbtxt": text, "1/model.py": SLEEPER} for name, text in models.items()})


def run_together(server: dlserve.Server, calls: list[str]) -> list[dict]:
    """Send one request per name in ``calls`` at once; the executes, in start order."""

    def call(name: str) -> None:
        list(server.model(name).infer(inputs={"X": np.zeros(1, np.float32)}))

    threads = [threading.Thread(target=call, args=(name,)) for name in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return runs(server)


def runs(server: dlserve.Server) -> list[dict]:
    log = Path(str(server.options.model_repository)) / "runs.jsonl"
    return sorted((json.loads(line) for line in log.read_text().splitlines()), key=lambda r: r["start"])


def overlaps(records: list[dict]) -> bool:
    return any(b["start"] < a["end"] for a, b in zip(records, records[1:]))


R1 = '{ name: "R1" count: 1 }'


def test_instances_sharing_a_resource_take_turns(servers, make_repo):
    repo = repo_of(make_repo, a=config(R1), b=config(R1))
    limited = servers.start(repo, rate_limiter_mode=dlserve.RateLimitMode.EXEC_COUNT)
    records = run_together(limited, ["a", "b", "a", "b"])
    assert len(records) == 4 and not overlaps(records), records


def test_without_rate_limiting_the_resources_are_ignored(servers, make_repo):
    repo = repo_of(make_repo, a=config(R1), b=config(R1))
    free = servers.start(repo)
    records = run_together(free, ["a", "b"])
    assert overlaps(records), records  # both models ran at once


def test_a_pool_size_from_the_options_lets_more_run(servers, make_repo):
    repo = repo_of(make_repo, a=config(R1), b=config(R1))
    wide = servers.start(repo, rate_limiter_mode=dlserve.RateLimitMode.EXEC_COUNT, rate_limiter_resources=["R1:2"])
    assert overlaps(run_together(wide, ["a", "b"]))


def test_other_resources_do_not_hold_each_other_back(servers, make_repo):
    repo = repo_of(make_repo, a=config(R1), b=config('{ name: "R2" count: 3 }'))
    server = servers.start(repo, rate_limiter_mode=dlserve.RateLimitMode.EXEC_COUNT)
    assert overlaps(run_together(server, ["a", "b"]))


def test_priority_weights_the_turns(servers, make_repo):
    repo = repo_of(make_repo, a=config(R1, priority=1), b=config(R1, priority=2))
    server = servers.start(repo, rate_limiter_mode=dlserve.RateLimitMode.EXEC_COUNT)
    records = run_together(server, ["a"] * 6 + ["b"] * 6)
    assert not overlaps(records)
    first = [r["model"] for r in records[:9]]
    # Priority 2 gets half the turns of priority 1 while both wait: about 6 a's to 3 b's.
    assert first.count("a") >= 6 and first.count("b") >= 2, first  # equal priorities: 5 and 4


@pytest.mark.parametrize(
    ("models", "pools", "message"),
    [
        ({"a": config('{ name: "R1" count: 3 }')}, ["R1:2"],
         'Resource count for "R1" is limited to 2 which will prevent scheduling of one or more model '
         "instances, the minimum required count is 3 (instance 'a_0_0' on device 0"),
        # Once any pool is given, one not given has none (Triton's rule).
        ({"a": config('{ name: "U" count: 2 }'), "b": config('{ name: "R1" count: 1 }')}, ["R1:2"],
         'Resource count for "U" is limited to 0 which will prevent scheduling'),
        # (Triton's words, side by side)
        ({"a": config(R1), "b": config('{ name: "R1" global: true count: 1 }')}, [],
         'Resource "R1" is present as both global and device-specific resource in the model '
         "configuration."),
        # A model short of several: the global one is named first, as Triton names it
        ({"a": config('{ name: "R1" count: 2 }, { name: "R2" global: true count: 2 }'),
          "b": config('{ name: "R1" count: 1 }')}, ["R1:1"],
         'Resource count for "R2" is limited to 0 which will prevent scheduling'),
    ],
)
def test_configs_that_could_never_run_fail_their_load(servers, make_repo, models, pools, message):
    repo = repo_of(make_repo, **models)
    server = servers.start(
        repo, rate_limiter_mode=dlserve.RateLimitMode.EXEC_COUNT, rate_limiter_resources=pools, exit_on_error=False
    )
    reasons = [m.reason for m in server.models().values() if m.state == "UNAVAILABLE"]
    assert any(message in (reason or "") for reason in reasons), reasons
    ready = [name for (name, _), m in server.models().items() if m.state == "READY"]
    assert len(ready) == len(models) - 1  # the other model loaded


def test_a_resource_listed_twice_takes_its_last_count_and_a_name_may_be_empty(servers, make_repo):
    """As Triton 2.51 (measured): with one copy of R1, "2 then 1" loads and "1 then 2"
    does not; a nameless resource is a resource like the others."""
    twice = '{ name: "R1" count: %d }, { name: "R1" count: %d }'
    repo = repo_of(make_repo, fits=config(twice % (2, 1)), too_big=config(twice % (1, 2)))
    server = servers.start(
        repo, rate_limiter_mode=dlserve.RateLimitMode.EXEC_COUNT, rate_limiter_resources=["R1:1"], exit_on_error=False
    )
    states = {name: m.state for (name, _), m in server.models().items()}
    assert states == {"fits": "READY", "too_big": "UNAVAILABLE"}, states
    nameless = servers.start(repo_of(make_repo, a=config("{ count: 1 }"), b=config("{ count: 1 }")),
                             rate_limiter_mode=dlserve.RateLimitMode.EXEC_COUNT)
    records = run_together(nameless, ["a", "b"])
    assert len(records) == 2 and not overlaps(records), records  # one copy of "", taken in turn


@pytest.mark.parametrize("text", ["R1", "R1:x", "R1:2:y", ":2", "R1:-1", "R1:1:2:3"])
def test_bad_pool_sizes_are_refused(make_repo, text):
    options = dlserve.Options(model_repository=str(make_repo()), rate_limiter_mode=dlserve.RateLimitMode.EXEC_COUNT,
                              rate_limiter_resources=[text])
    with pytest.raises(dlserve.InvalidArgumentError, match="rate limit resource"):
        dlserve.Server(options).start()


CRASHES_ON_ONE = """
import os, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.2)
        if pb_utils.get_input_tensor_by_name(requests[0], "X").as_numpy()[0] == 1:
            os._exit(3)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.zeros(1, np.float32))]) for _ in requests]
"""


def test_an_instance_that_died_waiting_holds_nobody_back(servers, make_repo):
    repo = make_repo(extra={"a": {"config.pbtxt": config(R1), "1/model.py": SLEEPER},
                            "c": {"config.pbtxt": config(R1), "1/model.py": CRASHES_ON_ONE}})
    server = servers.start(repo, rate_limiter_mode=dlserve.RateLimitMode.EXEC_COUNT)

    def send(name: str, x: float) -> None:
        list(server.model(name).infer(inputs={"X": np.array([x], np.float32)}, raise_on_error=False))

    crash = threading.Thread(target=send, args=("c", 1.0))
    crash.start()
    queued = threading.Thread(target=send, args=("c", 0.0))  # waits behind it, then its worker is gone
    queued.start()
    crash.join(30)
    queued.join(30)
    answered = threading.Thread(target=send, args=("a", 0.0))
    answered.start()
    answered.join(30)
    assert not answered.is_alive(), "a's request was held back by c's dead waiter"
    assert server.engine.rate_limiter.in_use() == {}


def test_an_instance_runs_one_execute_at_a_time_so_others_get_the_free_copies(servers, make_repo):
    repo = repo_of(make_repo, a=config(R1), b=config(R1))
    server = servers.start(repo, rate_limiter_mode=dlserve.RateLimitMode.EXEC_COUNT, rate_limiter_resources=["R1:2"])
    records = run_together(server, ["a", "a", "b"])
    first_b = next(r for r in records if r["model"] == "b")
    first_a = records[0] if records[0]["model"] == "a" else records[1]
    assert first_b["start"] < first_a["end"], records  # b used the second copy at once


SELF_CALLER = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "X").as_numpy()
        if x[0] == 1:
            call = pb_utils.InferenceRequest(model_name="selfcall", inputs=[pb_utils.Tensor("X", x * 0)],
                                             requested_output_names=["Y"])
            answer = call.exec()
            if answer.has_error():
                return [pb_utils.InferenceResponse(error=answer.error())]
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.zeros(1, np.float32))])]
"""


def test_a_self_call_that_could_never_get_the_resources_is_refused(servers, make_repo):
    text = config(R1).replace("count: 1 kind", "count: 2 kind")  # a free instance, but one R1
    repo = make_repo(extra={"selfcall": {"config.pbtxt": text, "1/model.py": SELF_CALLER}})
    server = servers.start(repo, rate_limiter_mode=dlserve.RateLimitMode.EXEC_COUNT)
    (response,) = server.model("selfcall").infer(inputs={"X": np.ones(1, np.float32)}, raise_on_error=False)
    assert response.error is not None and "rate limiter's resources the caller holds" in response.error.message
    free = servers.start(repo)  # without the limiter the other instance takes the call
    (response,) = free.model("selfcall").infer(inputs={"X": np.ones(1, np.float32)}, raise_on_error=False)
    assert response.error is None


CALLS_B = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        call = pb_utils.InferenceRequest(model_name="b", inputs=[pb_utils.Tensor("X", np.zeros(1, np.float32))],
                                         requested_output_names=["Y"])
        answer = call.exec()
        if answer.has_error():
            return [pb_utils.InferenceResponse(error=answer.error())]
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.zeros(1, np.float32))])]
"""


def test_a_call_into_a_model_that_needs_what_the_caller_holds_is_refused(servers, make_repo):
    repo = make_repo(extra={"a": {"config.pbtxt": config(R1), "1/model.py": CALLS_B},
                            "b": {"config.pbtxt": config(R1), "1/model.py": SLEEPER}})
    server = servers.start(repo, rate_limiter_mode=dlserve.RateLimitMode.EXEC_COUNT)
    (response,) = server.model("a").infer(inputs={"X": np.zeros(1, np.float32)}, raise_on_error=False)
    assert response.error is not None
    assert "needs rate limiter resources that the calling instance 'a_0_0' holds" in response.error.message
    wide = servers.start(repo, rate_limiter_mode=dlserve.RateLimitMode.EXEC_COUNT, rate_limiter_resources=["R1:2"])
    (response,) = wide.model("a").infer(inputs={"X": np.zeros(1, np.float32)}, raise_on_error=False)
    assert response.error is None  # two copies: b runs beside a


def test_the_pools_are_logged_at_verbose_level_in_triton_s_words(servers, make_repo, caplog):
    """Upstream instance_update_test greps this line for a pool that shrinks with the
    instance that needed most (R1 4 -> 3 when no explicit count is given)."""
    repo = repo_of(make_repo, a=config('{ name: "R1" count: 4 }'))
    server = servers.start(
        repo, rate_limiter_mode=dlserve.RateLimitMode.EXEC_COUNT,
        model_control_mode=dlserve.ModelControlMode.EXPLICIT, startup_models=["a"],
    )
    with caplog.at_level("DEBUG", logger="dlserve.engine.rate_limiter"):
        server.load("a", {"config": json.dumps({
            "backend": "python",
            "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [1]}],
            "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [1]}],
            "instance_group": [{"count": 1, "kind": "KIND_CPU",
                                "rate_limiter": {"resources": [{"name": "R1", "count": 3}]}}],
        })})
    logged = [r.getMessage() for r in caplog.records if r.name == "dlserve.engine.rate_limiter"]
    assert "\nMax Resource Map===>\n\tDevice: 0\n\t\tResource: R1\t Count: 3\n" in logged, logged
