"""Ensembles (``platform: "ensemble"``): a request flows through other models' steps.

Each step names a model and maps the model's inputs from ensemble tensors and its outputs
to ensemble tensors (``input_map`` / ``output_map``, as in Triton's config). A step runs as
soon as every tensor it reads exists, so independent steps run at once; the ensemble
answers when every step is done. Tensors move between steps by reference: a step's output,
still in the worker memory that produced it, is the next step's input, with no copy.

Composing models are ordinary models: their own schedulers (batching included) and
statistics apply to the requests an ensemble sends them. Decoupled composing models (many
responses per step) are refused with a clear error.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import TYPE_CHECKING

from dlserve.engine.proto import model_config_pb2 as mc
from dlserve.engine.request import Request, Response
from dlserve.engine.scheduler import Scheduler
from dlserve.errors import InvalidArgumentError, TritonError, UnsupportedError
from dlserve.memory.tensor import Tensor

if TYPE_CHECKING:
    from dlserve.engine.model import ModelVersion

PLATFORM = "ensemble"


@dataclasses.dataclass(frozen=True)
class Step:
    model: str
    version: int  # -1: the latest
    inputs: dict[str, str]  # the model's input -> the ensemble tensor it reads
    outputs: dict[str, str]  # the model's output -> the ensemble tensor it makes


def steps_of(config: mc.ModelConfig) -> list[Step]:
    return [
        Step(s.model_name, int(s.model_version), dict(s.input_map), dict(s.output_map))
        for s in config.ensemble_scheduling.step
    ]


def validate(config: mc.ModelConfig, model_name: str) -> None:
    """What Triton checks of an ensemble's steps: every tensor a step reads exists (an
    ensemble input or another step's output), each tensor is made once, every ensemble
    output is made, and the steps form no cycle."""
    where = f"ensemble '{model_name}'"
    steps = steps_of(config)
    if not steps:
        raise InvalidArgumentError(f"{where}: ensemble_scheduling must have at least one step")
    made: dict[str, str] = {t.name: "the ensemble's inputs" for t in config.input}
    for index, step in enumerate(steps):
        if not step.model:
            raise InvalidArgumentError(f"{where}: step {index} names no model")
        if step.model == model_name:
            raise InvalidArgumentError(f"{where}: step {index} calls the ensemble itself")
        for tensor in step.outputs.values():
            if tensor in made:
                raise InvalidArgumentError(
                    f"{where}: tensor '{tensor}' is made twice (by step {index}, model "
                    f"'{step.model}', and by {made[tensor]})"
                )
            made[tensor] = f"step {index}, model '{step.model}'"
    for index, step in enumerate(steps):
        missing = sorted(t for t in step.inputs.values() if t not in made)
        if missing:
            raise InvalidArgumentError(
                f"{where}: step {index} (model '{step.model}') reads {missing}, which no step "
                "makes and the ensemble has no input of that name"
            )
    for output in config.output:
        if output.name not in made:
            raise InvalidArgumentError(f"{where}: no step makes the ensemble output '{output.name}'")
    # A cycle leaves steps that never become runnable from the ensemble's inputs.
    available = {t.name for t in config.input}
    left = list(range(len(steps)))
    while left:
        runnable = [i for i in left if set(steps[i].inputs.values()) <= available]
        if not runnable:
            raise InvalidArgumentError(
                f"{where}: steps {left} wait on each other's outputs (a cycle)"
            )
        for i in runnable:
            available.update(steps[i].outputs.values())
            left.remove(i)


class EnsembleScheduler(Scheduler):
    """Runs each request through the steps; nothing queues here (the steps' models queue)."""

    def __init__(self, model: ModelVersion) -> None:
        super().__init__(model)
        self.steps = steps_of(model.config)

    @property
    def pending(self) -> int:
        return 0

    def _remove(self, request: Request) -> bool:
        return False

    def _take_all(self) -> list[Request]:
        return []

    def submit(self, request: Request) -> None:
        if self._accept(request):
            _Run(self, request).advance()


class _Run:
    """One request on its way through the steps."""

    def __init__(self, scheduler: EnsembleScheduler, request: Request) -> None:
        self.scheduler = scheduler
        self.request = request
        self.tensors: dict[str, Tensor] = dict(request.inputs)
        self.waiting = list(range(len(scheduler.steps)))
        self.running: dict[int, Request] = {}
        request.cancel_hook = self.cancel

    def advance(self) -> None:
        """Start every step whose inputs all exist; answer when no step is left."""
        steps = self.scheduler.steps
        for index in [i for i in self.waiting if set(steps[i].inputs.values()) <= self.tensors.keys()]:
            self.waiting.remove(index)
            self._start(index, steps[index])
            if self.request.finished:
                return
        if not self.waiting and not self.running and not self.request.finished:
            self._answer()

    def _start(self, index: int, step: Step) -> None:
        request = self.request
        call = Request(
            model_name=step.model,
            inputs={name: self.tensors[tensor] for name, tensor in step.inputs.items()},
            on_response=functools.partial(self._answered, index, step),
            model_version=step.version,
            request_id=request.request_id,
            correlation_id=request.correlation_id,
            flags=request.flags,
            timeout_us=request.timeout_us,
            parameters=request.parameters,
            requested_outputs=list(step.outputs),
        )
        model = self.scheduler.model
        try:
            target = model.resources.host.model(step.model, step.version)
            if target.decoupled:
                raise UnsupportedError(
                    f"model '{step.model}' is decoupled: decoupled models in ensembles are "
                    "not supported"
                )
            self.running[index] = call
            model.resources.host.submit(call)
        except TritonError as exc:
            self.running.pop(index, None)
            self._fail(step, exc)

    def _answered(self, index: int, step: Step, response: Response) -> None:
        if self.request.finished or index not in self.running:
            return  # the ensemble request is answered already, or cancelled its steps
        if response.error is not None:
            self._fail(step, response.error)
            return
        if not response.final:
            return
        self.running.pop(index, None)
        for name, tensor in response.outputs.items():
            self.tensors[step.outputs[name]] = tensor
        missing = sorted(set(step.outputs) - response.outputs.keys())
        if missing:
            self._fail(step, InvalidArgumentError(f"it did not return {missing}"))
            return
        self.advance()

    def _fail(self, step: Step, error: TritonError) -> None:
        """A step failed: the ensemble request fails with its error; the other steps
        still running are cancelled."""
        ensemble = self.scheduler.model
        message = f"in ensemble '{ensemble.name}', step '{step.model}': {error.message}"
        self.cancel()
        error = TritonError.from_code(error.code, message)
        response = Response(ensemble.name, ensemble.version, self.request.request_id, error=error)
        self.scheduler._deliver(self.request, response, "BACKEND")

    def cancel(self) -> None:
        running, self.running = self.running, {}
        self.waiting = []
        for call in running.values():
            if call.owner is not None:
                call.owner.cancel(call)

    def _answer(self) -> None:
        ensemble = self.scheduler.model
        request = self.request
        wanted = request.requested_outputs
        names = wanted if wanted is not None else [t.name for t in ensemble.config.output]
        response = Response(ensemble.name, ensemble.version, request.request_id)
        response.outputs = {name: self.tensors[name] for name in names}
        # One execution per request, as Triton counts an ensemble's. Triton adds up the
        # steps' own times; here the steps' wall time counts as compute, and each step's
        # model has the exact breakdown in its own statistics.
        ensemble.stats.record_execution(
            batch_size=ensemble.batch_size_of(request),
            request_count=1,
            queue_ns=[0],
            input_ns=0,
            infer_ns=time.monotonic_ns() - request.arrival_ns,
            output_ns=0,
        )
        self.scheduler._deliver(request, response, None)
