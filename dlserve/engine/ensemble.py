"""Ensembles (``platform: "ensemble"``): a request flows through other models' steps.

Each step names a model and maps the model's inputs from ensemble tensors and its outputs
to ensemble tensors (``input_map`` / ``output_map``, as in Triton's config). A step runs as
soon as every tensor it reads exists, so independent steps run at once; the ensemble
answers when every step is done. Steps that make none of the outputs a request asks for
(directly or through what they feed) do not run for it. Tensors move between steps by
reference: a step's output, still in the worker memory that produced it, is the next
step's input, with no copy.

Composing models are ordinary models: their own schedulers (batching included) and
statistics apply to the requests an ensemble sends them. A decoupled step (a model that
streams) makes the ensemble decoupled (Triton's rule, set at load): each of its responses
flows on through the steps that read it and becomes one response of the ensemble; the
last one is final (or, when the stream's end comes after it, a flag-only final follows),
as Triton does. As in Triton, no step (nor the ensemble's outputs) may read tensors from
two decoupled steps' responses, or from one and from elsewhere (check_origins).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import TYPE_CHECKING, Any

from dlserve.engine.proto import model_config_pb2 as mc
from dlserve.engine.request import SEQUENCE_END, SEQUENCE_START, Request, Response
from dlserve.engine.scheduler import Scheduler
from dlserve.errors import InvalidArgumentError, TritonError, UnsupportedError
from dlserve.memory.tensor import Tensor

if TYPE_CHECKING:
    from dlserve.engine.model import ModelVersion

# A branch's tensors by ensemble name; None for one a step maps but did not return.
Tensors = dict[str, "Tensor | None"]


@dataclasses.dataclass(frozen=True)
class Step:
    model: str
    version: int  # -1: the latest
    inputs: dict[str, str]  # the model's input -> the ensemble tensor it reads
    outputs: dict[str, str]  # the model's output -> the ensemble tensor it makes
    namespace: str = ""  # where the model was found, with model namespacing (set at load)


def steps_of(config: mc.ModelConfig) -> list[Step]:
    return [
        Step(s.model_name, int(s.model_version), dict(s.input_map), dict(s.output_map), s.model_namespace)
        for s in config.ensemble_scheduling.step
    ]


def validate(config: mc.ModelConfig, model_name: str) -> None:
    """What Triton checks of an ensemble's steps: every tensor a step reads exists (an
    ensemble input or another step's output), each tensor is made once, every ensemble
    output is made, every ensemble input and step output is used, and the steps form no
    cycle."""
    where = f"ensemble '{model_name}'"
    steps = steps_of(config)
    if not steps:
        raise InvalidArgumentError(f"{where}: ensemble_scheduling must have at least one step")
    if config.ensemble_scheduling.max_inflight_requests:  # (refused rather than ignored)
        raise InvalidArgumentError(
            f"{where}: ensemble_scheduling.max_inflight_requests is not supported: dlserve does not "
            "hold back a step's requests (Triton 2.51 does not know the field either); leave it out"
        )
    made: dict[str, str] = {t.name: "the ensemble's inputs" for t in config.input}
    for index, step in enumerate(steps):
        if not step.model:
            raise InvalidArgumentError(f"{where}: step {index} names no model")
        if step.model == model_name:
            raise InvalidArgumentError(f"{where}: step {index} calls the ensemble itself")
        for field, mapping in (("input_map", step.inputs), ("output_map", step.outputs)):
            if not mapping:  # (Triton's words)
                raise InvalidArgumentError(
                    f"must specify '{field}' in step {index} of ensemble '{model_name}'"
                )
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
    # Unused tensors are mistakes Triton refuses (in its words, its stray quote included).
    read = {t for step in steps for t in step.inputs.values()} | {t.name for t in config.output}
    for tensor in config.input:
        if tensor.name not in read:
            raise InvalidArgumentError(
                f"ensemble input '{tensor.name}' for ensemble {model_name}' is not used"
            )
    for step in steps:
        for tensor in step.outputs.values():
            if tensor not in read:
                raise InvalidArgumentError(
                    f"ensemble tensor '{tensor}' is unused in ensemble '{model_name}'"
                )
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


def check_step(config: mc.ModelConfig, model_name: str, step: Step, step_config: mc.ModelConfig) -> None:
    """What Triton checks of an ensemble against the config of a step's loaded model (in
    its words): the maps name the model's own inputs and outputs, and the ensemble's
    batches fit the model's."""
    inputs = {t.name for t in step_config.input}
    for own, tensor in step.inputs.items():
        if own not in inputs:
            raise InvalidArgumentError(
                f"in ensemble {model_name}, ensemble tensor {tensor} is mapping to non-existing "
                f"input {own} in model {step.model}"
            )
    outputs = {t.name for t in step_config.output}
    for own, tensor in step.outputs.items():
        if own not in outputs:
            raise InvalidArgumentError(
                f"in ensemble {model_name}, ensemble tensor {tensor} is mapped from non-existing "
                f"output {own} in model {step.model}"
            )
    if config.max_batch_size > step_config.max_batch_size:
        raise InvalidArgumentError(
            f"ensemble {model_name} allows maximum batch size {config.max_batch_size}, but it "
            f"contains model {step.model} which only allows maximum batch size to be "
            f"{step_config.max_batch_size}"
        )
    # An ensemble input or output the step reads or makes must agree with the step's.
    for declared_tensors, mapping, own_tensors in (
        (config.input, step.inputs, {t.name: t for t in step_config.input}),
        (config.output, step.outputs, {t.name: t for t in step_config.output}),
    ):
        for declared in declared_tensors:
            for own, tensor in mapping.items():
                if tensor == declared.name:
                    _agree(model_name, config, declared, step.model, step_config, own_tensors[own])


def check_origins(config: mc.ModelConfig, model_name: str, decoupled: set[int]) -> None:
    """Triton 2.51's rule for the decoupled steps (the indices in ``decoupled``), measured
    side by side: what a step reads, and the ensemble's outputs, come from one decoupled
    step's responses (directly or through plain steps) or from none; the ensemble's
    inputs count as none. Each response runs the steps after it on its own, with nothing
    to pair it with from elsewhere (a step reading two streams, or a stream and a plain
    step's output, waited forever). Triton's words, which name the ensemble."""
    origin: dict[str, int | None] = {t.name: None for t in config.input}

    def one_origin(tensors: list[str]) -> int | None:
        found = {origin[t] for t in tensors}
        if len(found) > 1:
            raise InvalidArgumentError(
                f"in ensemble {model_name}, step of model '{model_name}' receives inputs "
                "originated from different decoupled models"
            )
        return found.pop()

    steps = steps_of(config)
    left = list(range(len(steps)))
    while runnable := [i for i in left if set(steps[i].inputs.values()) <= origin.keys()]:
        for i in runnable:
            made = i if i in decoupled else one_origin(list(steps[i].inputs.values()))
            origin.update(dict.fromkeys(steps[i].outputs.values(), made))
            left.remove(i)
    one_origin([t.name for t in config.output])


def _agree(
    name: str, config: mc.ModelConfig, declared: Any, step_model: str, step_config: mc.ModelConfig, own: Any
) -> None:
    """The ensemble's tensor and the step's have one data type and compatible shapes
    (batch dimension included, -1 matching any size); Triton's words otherwise."""
    where = f"in ensemble {name}, ensemble tensor {declared.name}"
    if declared.data_type != own.data_type:
        raise InvalidArgumentError(
            f"{where}: inconsistent data type: {mc.DataType.Name(declared.data_type)} is inferred from "
            f"model {name} while {mc.DataType.Name(own.data_type)} is inferred from model {step_model}"
        )
    ours = ([-1] if config.max_batch_size > 0 else []) + list(declared.dims)
    theirs = ([-1] if step_config.max_batch_size > 0 else []) + list(own.dims)
    if len(ours) != len(theirs) or any(a != b and -1 not in (a, b) for a, b in zip(ours, theirs)):
        raise InvalidArgumentError(
            f"{where}: inconsistent shape: [{','.join(map(str, ours))}] is inferred from model {name} "
            f"while [{','.join(map(str, theirs))}] is inferred from model {step_model}"
        )


def needed_steps(steps: list[Step], wanted: list[str] | None) -> list[int]:
    """The steps that make the ensemble outputs a request asks for, directly or through
    the tensors they read: only these run, as in Triton (which skips the others). All of
    them when the request names no outputs (it gets every output)."""
    if not wanted:
        return list(range(len(steps)))
    needed = set(wanted)
    chosen: set[int] = set()
    grew = True
    while grew:
        grew = False
        for index, step in enumerate(steps):
            if index not in chosen and needed & set(step.outputs.values()):
                chosen.add(index)
                needed.update(step.inputs.values())
                grew = True
    return sorted(chosen)


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
            _Run(self, request).root.advance()


class _Branch:
    """Steps run on one set of tensors. A request starts as one branch; each response of
    a decoupled step starts another, holding that response's tensors, for the steps that
    read them (so a streaming step streams through the steps after it)."""

    def __init__(self, run: _Run, tensors: Tensors, waiting: list[int]) -> None:
        self.run = run
        self.tensors = tensors
        self.waiting = waiting
        self.running: dict[int, Request] = {}
        # decoupled steps started here -> the steps after them, run per response instead
        self.downstream: dict[int, list[int]] = {}

    def advance(self) -> None:
        """Start every step whose inputs all exist (or are optional inputs the request
        left out); end the branch when none is left."""
        steps, absent = self.run.steps, self.run.absent
        # A step may answer inside start (a response-cache hit), which advances this
        # branch again from within: look for the next step afresh after each start.
        while not self.run.request.finished and self in self.run.branches:
            have = self.tensors.keys() | absent
            ready = [i for i in self.waiting if have >= set(steps[i].inputs.values())]
            if not ready:
                break
            self.waiting.remove(ready[0])
            self.run.start(self, ready[0])
        if (
            not self.waiting
            and not self.running
            and not self.run.request.finished
            and self in self.run.branches
        ):
            self.run.branch_done(self)

    def fork(self, index: int) -> None:
        """A decoupled step starts: the steps reading what it makes (directly or not)
        leave this branch, to run once per response in branches of their own."""
        steps = self.run.steps
        made = set(steps[index].outputs.values())
        downstream: list[int] = []
        changed = True
        while changed:
            changed = False
            for i in self.waiting:
                if i not in downstream and made & set(steps[i].inputs.values()):
                    downstream.append(i)
                    made |= set(steps[i].outputs.values())
                    changed = True
        self.waiting = [i for i in self.waiting if i not in downstream]
        self.downstream[index] = sorted(downstream)


class _Run:
    """One request on its way through the steps, in one or more branches."""

    def __init__(self, scheduler: EnsembleScheduler, request: Request) -> None:
        self.scheduler = scheduler
        self.steps = scheduler.steps
        self.request = request
        self.started_ns = time.monotonic_ns()
        self.compute_ns = [0, 0, 0]  # the finished steps' compute input, infer, output
        self.branches: list[_Branch] = []
        # Optional ensemble inputs the request left out: the steps reading them run without.
        self.absent = {t.name for t in scheduler.model.config.input if t.optional} - request.inputs.keys()
        request.cancel_hook = self.cancel
        needed = needed_steps(self.steps, request.requested_outputs)
        self.held = self._hold(needed)
        self.root = self._branch(dict(request.inputs), needed)

    def _hold(self, needed: list[int]) -> dict[int, ModelVersion]:
        """The versions serving the steps now, kept until the request is answered (as
        Triton's ensembles keep theirs): unloading a step, or reloading it, while the
        request runs does not fail its later steps. A step that does not resolve now
        resolves when it starts (and fails there, if it still does not)."""
        host = self.scheduler.model.resources.host
        held: dict[int, ModelVersion] = {}
        for index in needed:
            step = self.steps[index]
            try:
                held[index] = host.model(step.model, step.version, step.namespace)
            except TritonError:
                continue
            held[index].scheduler.keep_for_ensemble()
        return held

    def _let_go(self) -> None:
        held, self.held = self.held, {}
        for version in held.values():
            version.scheduler.release_for_ensemble()

    def _branch(self, tensors: Tensors, waiting: list[int]) -> _Branch:
        branch = _Branch(self, tensors, waiting)
        self.branches.append(branch)
        return branch

    def start(self, branch: _Branch, index: int) -> None:
        step = self.steps[index]
        request = self.request
        call = Request(
            model_name=step.model,
            inputs={
                name: made for name, tensor in step.inputs.items() if (made := branch.tensors.get(tensor)) is not None
            },
            on_response=functools.partial(self._answered, branch, index),
            model_version=step.version,
            request_id=request.request_id,
            correlation_id=request.correlation_id,
            flags=request.flags,
            priority=request.priority,
            timeout_us=request.timeout_us,
            parameters=request.parameters,
            requested_outputs=list(step.outputs),
        )
        model = self.scheduler.model
        try:
            target = self.held.get(index)
            if target is None or target.state not in ("READY", "UNLOADING"):  # (gone regardless)
                target = model.resources.host.model(step.model, step.version, step.namespace)
            else:
                call.to_kept_version = True
            if target.decoupled:
                if not model.decoupled:
                    raise UnsupportedError(
                        f"model '{step.model}' is decoupled, so the ensemble must be too "
                        "(model_transaction_policy { decoupled: true })"
                    )
                branch.fork(index)
            branch.running[index] = call
            if request.trace is not None:  # made last: submit discards it if it refuses
                call.trace = request.trace.child(step.model, request.request_id)
            model.resources.host.submit(call, sample=False, model=target)
        except TritonError as exc:
            branch.running.pop(index, None)
            self.fail(exc)

    def _answered(self, branch: _Branch, index: int, response: Response) -> None:
        if self.request.finished or index not in branch.running:
            return  # the ensemble request is answered already, or cancelled its steps
        step = self.steps[index]
        if response.error is not None:
            self.fail(response.error)
            return
        downstream = branch.downstream.get(index)
        if downstream is not None:  # a decoupled step: each response starts a branch
            child = None
            if response.outputs:
                tensors = dict(branch.tensors)
                self._take(step, response, tensors)
                child = self._branch(tensors, list(downstream))
            if response.final:  # (ended first: a last response answers as the final one)
                self._step_done(branch, index)
            if child is not None:
                child.advance()
            return
        if response.final:
            self._take(step, response, branch.tensors)
            self._step_done(branch, index)

    def _step_done(self, branch: _Branch, index: int) -> None:
        call = branch.running.pop(index)
        compute = self.compute_ns
        compute[0] += call.compute_input_ns
        compute[1] += call.compute_infer_ns
        compute[2] += call.compute_output_ns
        branch.advance()

    @staticmethod
    def _take(step: Step, response: Response, tensors: Tensors) -> None:
        """The step's outputs into ``tensors`` under their ensemble names. One the step
        did not return is there as None, as Triton's empty placeholder: the steps that
        read it run without it (their own input check says if they need it), and an
        ensemble output it is goes missing from the answer."""
        for name, mapped in step.outputs.items():
            tensors[mapped] = response.outputs.get(name)

    def branch_done(self, branch: _Branch) -> None:
        """A branch ran its last step: it answers (unless a decoupled step's responses
        answer for it), and the answer is final when no branch is left."""
        self.branches.remove(branch)
        final = not self.branches
        if not branch.downstream:
            self._answer(branch.tensors, final)
        elif final:  # the last answer went out before the stream's end was known
            ensemble = self.scheduler.model
            response = Response(ensemble.name, ensemble.version, self.request.request_id, flags_only=True)
            self._deliver(response)

    def fail(self, error: TritonError) -> None:
        """A step failed: the ensemble request fails with its error; the other steps
        still running are cancelled."""
        ensemble = self.scheduler.model
        message = f"in ensemble '{ensemble.name}', {error.message}"  # Triton 2.51's words
        self.cancel()
        error = TritonError.from_code(error.code, message)
        response = Response(ensemble.name, ensemble.version, self.request.request_id, error=error)
        self.scheduler._deliver(self.request, response, "OTHER")  # (Triton's label for an ensemble's)

    def cancel(self, answered: bool = True) -> None:
        """Cancel the steps running. ``answered``: the ensemble's request is answered
        now, so nothing runs on; else the steps' own answers go on through the steps."""
        if not answered:  # (a queued step is answered at once: its branch may change)
            for branch in list(self.branches):
                for call in list(branch.running.values()):
                    if call.owner is not None:
                        call.owner.cancel(call, answer=False)
            return
        self._let_go()
        branches, self.branches = self.branches, []
        for branch in branches:
            running, branch.running = branch.running, {}
            branch.waiting = []
            for call in running.values():
                if call.owner is not None:
                    call.owner.cancel(call)

    def _answer(self, tensors: Tensors, final: bool) -> None:
        ensemble = self.scheduler.model
        request = self.request
        wanted = request.requested_outputs
        names = wanted if wanted is not None else [t.name for t in ensemble.config.output]
        response = Response(ensemble.name, ensemble.version, request.request_id)
        response.outputs = {name: made for name in names if (made := tensors.get(name)) is not None}
        # As Triton's ensembles answer (measured on 2.51, HTTP and gRPC): the request's
        # sequence fields, whatever the steps answered.
        response.parameters = {
            "sequence_id": request.correlation_id or 0,
            "sequence_start": bool(request.flags & SEQUENCE_START),
            "sequence_end": bool(request.flags & SEQUENCE_END),
        }
        response.final = final
        self._deliver(response)

    def _deliver(self, response: Response) -> None:
        request = self.request
        if response.final:
            self._let_go()
            self._record(request)
        self.scheduler._deliver(request, response, None)

    def _record(self, request: Request) -> None:
        """One execution per request, as Triton counts an ensemble's: its queue time is
        its own (until the steps start), its compute times the sums of its steps' (a
        decoupled step whose execute returns after its final response adds nothing)."""
        request.compute_input_ns, request.compute_infer_ns, request.compute_output_ns = (
            self.compute_ns
        )
        ensemble = self.scheduler.model
        ensemble.stats.record_execution(
            batch_size=ensemble.batch_size_of(request),
            request_count=1,
            queue_ns=[self.started_ns - request.arrival_ns],
            input_ns=request.compute_input_ns,
            infer_ns=request.compute_infer_ns,
            output_ns=request.compute_output_ns,
        )
