"""Triton's sequence batcher: ``sequence_batching`` in config.pbtxt.

A sequence is the stream of requests that share a correlation ID, from the one
flagged START to the one flagged END. Every request of a sequence runs on the
instance the sequence was given at its start, one at a time and in order, so a
model can keep per-sequence state. An instance takes at most ``max_batch_size``
sequences at once with the ``direct`` strategy (one batch slot each; further
sequences wait for a slot) and ``max_candidate_sequences`` with ``oldest`` (by default
``max_batch_size`` too, as in Triton); a new
sequence takes the lowest free slot (on the first instance with one that low), and
frees it when its END request goes into a batch (as Triton does: a sequence waiting
for a slot may run in the very next batch), or once that END is done where it must
be (an iterative sequence; an async model, which runs several batches at once).

With ``oldest``, each ``execute`` gets the next request of its sequences, oldest
first, those whose inputs have the oldest one's shapes (the others wait for a batch
of their own, as in Triton), as many as Triton's dynamic batcher would take
(:class:`~dlserve.engine.batcher.BatchRule`: the largest ``preferred_batch_size`` it
can reach goes at once). With ``direct``, as in Triton,
a request's place in the batch is its sequence's slot, so a model may keep per-slot
state by position:
the batch runs from slot 0 up to the highest slot with a request, and every slot
below with none (its sequence waits for its next step, or it is free) or with one
whose input shapes differ from the lowest slot's (it runs in a later batch) gets a
*filler*: a request with READY, START and END false, correlation ID 0, no request
ID and zeros shaped like the lowest slot's inputs. Nobody gets a filler's answers,
and statistics count fillers in the batch's size only (``batch_stats``), not in
``inference_count``.

With a ``max_queue_delay_microseconds``, a batch waits up to that long
after its oldest request came (with ``oldest``, or once the request before it in its
sequence finished, as in Triton) for more: until ``minimum_slot_utilization`` of the
instance's slots have a request (direct), or until it reaches a preferred size or
can grow no more (oldest: the next request would pass the largest preferred size or
``max_batch_size``), as Triton's does.

The model sees the control inputs the config declares (START, END, READY, CORRID)
as extra input tensors. A sequence that receives no request for
``max_sequence_idle_microseconds`` is released; a later request without START is
refused, as is one for a sequence whose instance died (its state is gone: its
requests are told it was lost and why, the queued ones and the next one to come).
A sequence waiting for a slot fails once a timeout of its requests runs out.
Iterative sequences (``iterative_sequence: true``) let a model reschedule a
request: it runs again, ahead of the sequence's later requests. As in Triton, such a
sequence ends once its request is done (rescheduled no more), and a request without a
correlation ID is a sequence of its own, under an ID the server picks.

Implicit state (``state [...]``, Triton's implicit state management, which its
Python backend lacks): each request of a sequence gets the state input its previous
request's state output left (the first: the ``initial_state``, zeros or a file under
``<model>/initial_state/``, or zeros shaped like ``dims`` with 1 for each -1), so the
model keeps no per-sequence state of its own. The state stays in shared memory where
the worker wrote it, passed back by reference; a client sees a state output only if
it asks for it and the config lists it among the outputs.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import math
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from dlserve.engine.batcher import BatchRule, batch_shapes
from dlserve.engine.proto import model_config_pb2 as mc
from dlserve.engine.request import SEQUENCE_END, SEQUENCE_START, Request, Response
from dlserve.engine.scheduler import Scheduler, delay_count
from dlserve.errors import CancelledError, InvalidArgumentError, UnavailableError
from dlserve.memory.dtypes import DataType
from dlserve.memory.tensor import Tensor

if TYPE_CHECKING:
    from dlserve.engine.instance import ModelInstance
    from dlserve.engine.model import ModelVersion

log = logging.getLogger("dlserve.engine")

DEFAULT_IDLE_US = 1_000_000
LOST_KEPT = 1024  # lost sequences whose keys are remembered (see SequenceBatcher._lost)
_Kind = mc.ModelSequenceBatching.Control
_FALSE_TRUE_FIELDS = (
    ("int32_false_true", DataType.INT32),
    ("fp32_false_true", DataType.FP32),
    ("bool_false_true", DataType.BOOL),
)
_CORRID_TYPES = (mc.TYPE_UINT64, mc.TYPE_INT64, mc.TYPE_UINT32, mc.TYPE_INT32, mc.TYPE_STRING)


@dataclasses.dataclass(eq=False)
class Sequence:
    key: int | str
    instance: ModelInstance | None = None
    slot: int = 0  # its place on its instance (with ``direct``, its place in every batch)
    queue: collections.deque[Request] = dataclasses.field(default_factory=collections.deque)
    running: bool = False
    started: bool = False  # a request of it ran (or runs)
    ending: bool = False
    idle: asyncio.TimerHandle | None = None
    # While it waits for a slot: when it fails for its requests' timeouts (monotonic ns;
    # the earliest of arrival + timeout over its requests, as Triton's backlog keeps it).
    expires_ns: int | None = None
    done_ns: int = 0  # when its latest request finished (monotonic ns)
    state: dict[str, Tensor] = dataclasses.field(default_factory=dict)  # input name -> state


@dataclasses.dataclass(frozen=True)
class ImplicitState:
    """One ``sequence_batching.state`` entry: which output feeds which input next time."""

    input_name: str
    output_name: str
    initial: np.ndarray  # the first request's state, without a batch dimension

    @staticmethod
    def parse(model: ModelVersion, spec: Any) -> ImplicitState:
        where = f"model '{model.name}', state '{spec.input_name}'"
        if not spec.input_name or not spec.output_name:
            raise InvalidArgumentError(f"{where}: a state needs input_name and output_name")
        if spec.input_name in model.signature.inputs:
            raise InvalidArgumentError(f"{where}: the state input is also a model input")
        if spec.data_type in (mc.TYPE_INVALID, mc.TYPE_STRING):
            raise InvalidArgumentError(f"{where}: implicit state needs a numeric data_type")
        dtype = DataType(spec.data_type).storage_dtype
        if not spec.initial_state:
            return ImplicitState(spec.input_name, spec.output_name, np.zeros([max(d, 1) for d in spec.dims], dtype))
        initial = spec.initial_state[0]
        shape = list(initial.dims)
        if any(d < 0 for d in shape) or initial.data_type != spec.data_type:
            raise InvalidArgumentError(
                f"{where}: initial_state needs fixed dims and the state's data_type"
            )
        if initial.WhichOneof("state_data") != "data_file":
            return ImplicitState(spec.input_name, spec.output_name, np.zeros(shape, dtype))
        path = model.model_dir / "initial_state" / initial.data_file
        try:
            data = np.fromfile(path, dtype=dtype)
        except OSError as exc:
            raise InvalidArgumentError(f"{where}: cannot read initial state file {path}: {exc}") from None
        if data.size != math.prod(shape):
            raise InvalidArgumentError(
                f"{where}: initial state file {path} holds {data.size} values, dims {shape} need "
                f"{math.prod(shape)}"
            )
        return ImplicitState(spec.input_name, spec.output_name, data.reshape(shape))

    def first(self, batching: bool) -> Tensor:
        data = self.initial.reshape((1, *self.initial.shape)) if batching else self.initial
        return Tensor.from_numpy(data)


@dataclasses.dataclass(frozen=True)
class ControlInput:
    """How one control signal reaches the model: input name, kind, type, values."""

    name: str
    kind: int
    data_type: DataType
    values: tuple[Any, Any]  # (for false, for true); unused for CORRID

    @staticmethod
    def parse(model: str, spec: Any) -> ControlInput | None:
        """The control input ``spec`` declares; None for one with no control (it gives the
        model nothing, as in Triton, which loads such a config). Errors in Triton 2.51's
        words where it has them."""
        if not spec.name:
            raise InvalidArgumentError(
                f"sequence batching control tensor must have a name for {model}"
            )
        if not spec.control:
            return None
        if len(spec.control) > 1:
            raise InvalidArgumentError(
                f"model '{model}', control input '{spec.name}': only one control is supported"
            )
        control = spec.control[0]
        if control.kind == _Kind.CONTROL_SEQUENCE_CORRID:
            if control.data_type == mc.TYPE_INVALID:
                raise InvalidArgumentError(f"model '{model}', control input '{spec.name}': CORRID needs data_type")
            if control.data_type not in _CORRID_TYPES:  # (Triton's words)
                raise InvalidArgumentError(
                    f"unexpected data type for control CONTROL_SEQUENCE_CORRID for {model}. Allowed "
                    "data types are TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32 and TYPE_STRING"
                )
            return ControlInput(spec.name, control.kind, DataType(control.data_type), (None, None))
        kind = f"{_Kind.Kind.Name(control.kind)} for {model}"
        given = [
            (field, data_type, list(getattr(control, field)))
            for field, data_type in _FALSE_TRUE_FIELDS
            if getattr(control, field)
        ]
        if not given:
            raise InvalidArgumentError(
                "sequence batching must specify either 'int32_false_true', 'fp32_false_true' "
                f"or 'bool_false_true' for {kind}"
            )
        if len(given) > 1:
            raise InvalidArgumentError(
                "sequence batching specifies more than one from 'int32_false_true', "
                f"'fp32_false_true' and 'bool_false_true' for {kind}"
            )
        ((field, data_type, values),) = given
        if len(values) != 2:
            raise InvalidArgumentError(
                f"sequence batching control '{field}' must have exactly 2 entries for {kind}"
            )
        return ControlInput(spec.name, control.kind, data_type, (values[0], values[1]))

    def tensor(self, request: Request, batching: bool) -> Tensor:
        shape = (1, 1) if batching else (1,)
        if self.kind == _Kind.CONTROL_SEQUENCE_CORRID:
            if self.data_type is DataType.BYTES:
                text = b"" if request.filler else str(request.correlation_id).encode()
                objects = np.array([text], dtype=np.object_)
                return Tensor(DataType.BYTES, shape, objects=objects.reshape(shape))
            # A correlation ID is a uint64; a narrower CORRID gets its low bits, as in Triton
            # (a value that did not fit failed in dispatch and kept its sequence's slot).
            value: Any = np.uint64(request.correlation_id % 2**64)
        elif self.kind == _Kind.CONTROL_SEQUENCE_START:
            value = self.values[bool(request.flags & SEQUENCE_START)]
        elif self.kind == _Kind.CONTROL_SEQUENCE_END:
            value = self.values[bool(request.flags & SEQUENCE_END)]
        else:  # READY: a request of a sequence is in this batch slot (not a filler)
            value = self.values[not request.filler]
        return Tensor(self.data_type, shape, data=np.full(shape, value, self.data_type.storage_dtype))


def _no_answer(response: Response) -> None:
    """Where a filler's answers go: nowhere."""


class SequenceBatcher(Scheduler):
    pipeline_depth = 1  # a sequence's next request waits for its previous one anyway

    def __init__(self, model: ModelVersion) -> None:
        super().__init__(model)
        config = model.config.sequence_batching
        self.idle_s = (config.max_sequence_idle_microseconds or DEFAULT_IDLE_US) / 1e6
        self.max_batch = max(model.config.max_batch_size, 1)
        self.batching = model.config.max_batch_size > 0
        strategy = config.WhichOneof("strategy_choice") or "direct"
        candidates = config.oldest.max_candidate_sequences if strategy == "oldest" else 0
        self.direct = strategy == "direct"
        self.slots = candidates or self.max_batch  # (max_batch_size by default, as in Triton)
        # direct: a batch of ``_enough`` requests need not wait for more; oldest batches
        # as Triton's dynamic batcher (config.normalize gives it a preferred size)
        self.delay_ns = config.direct.max_queue_delay_microseconds * 1000
        utilization = math.ceil(config.direct.minimum_slot_utilization * self.slots)
        self._enough = min(utilization, self.max_batch)
        oldest = config.oldest
        self.rule = BatchRule(
            oldest.preferred_batch_size, self.max_batch, oldest.max_queue_delay_microseconds
        )
        parsed = (ControlInput.parse(model.name, spec) for spec in config.control_input)
        self.controls = [control for control in parsed if control is not None]
        self.states = [ImplicitState.parse(model, spec) for spec in config.state]
        # Per request (by id) the state outputs asked of the worker that its client did not ask for.
        self._hidden: dict[int, set[str]] = {}
        self._numeric_corrid = any(
            c.kind == _Kind.CONTROL_SEQUENCE_CORRID and c.data_type is not DataType.BYTES
            for c in self.controls
        )
        self.iterative = config.iterative_sequence
        self._ragged = {t.name for t in model.config.input if t.allow_ragged_batch}
        self.sequences: dict[int | str, Sequence] = {}
        self._running: dict[int, Sequence] = {}  # id(request) -> its sequence, while it executes
        self.backlog: collections.deque[Sequence] = collections.deque()  # started, no slot yet
        # Why sequences whose instance died were lost, by key, the latest LOST_KEPT: a
        # request that continues one is told that rather than that it lacks a START.
        self._lost: collections.OrderedDict[int | str, str] = collections.OrderedDict()
        self._placements = itertools.count(1)
        self._standalone_ids = itertools.count(1)  # (iterative requests without a correlation ID)
        self._last_placed: dict[ModelInstance, int] = {}  # instance -> its latest placement
        # Triton's test hooks: no batch until this many requests are queued in slots and
        # in the backlog, once.
        self._held_until = (
            delay_count("TRITONSERVER_DELAY_SCHEDULER"),
            delay_count("TRITONSERVER_BACKLOG_DELAY_SCHEDULER"),
        )
        if any(self._held_until):
            log.info("Delaying scheduler for %s until %d queued and %d backlog queued requests",
                     model.name, *self._held_until)

    # -- queueing -----------------------------------------------------------------------
    def _enqueue(self, request: Request) -> None:
        key = request.correlation_id
        name = self.model.name
        if self.batching and any(t.shape[0] > 1 for t in request.inputs.values()):
            # A sequence's requests share one slot: one batch row each.
            raise InvalidArgumentError(
                f"inference request to model '{name}' must specify batch-size 1 due to "
                "requirements of sequence batcher"
            )
        if key in (0, "", None):
            if not self.iterative:
                raise InvalidArgumentError(
                    f"inference request to model '{name}' must specify a non-zero or non-empty "
                    "correlation ID"
                )
            # As Triton: a sequence of its own, under a correlation ID the server picks
            # (the model sees it, and START).
            key = request.correlation_id = self._unused_id()
            request.flags |= SEQUENCE_START
        if isinstance(key, str) and self._numeric_corrid:
            raise InvalidArgumentError(
                f"inference request to model '{name}': the CORRID control input is numeric, "
                f"but the correlation ID '{key}' is a string"
            )
        sequence = self.sequences.get(key)
        if sequence is not None and request.flags & SEQUENCE_START and not sequence.ending:
            log.warning(  # (Triton's words)
                "sequence %s for model '%s' has a conflict. The previous sequence did not end "
                "before this sequence start. Previous sequence will be terminated early.", key, name
            )
        if sequence is None:
            if not request.flags & SEQUENCE_START:
                lost = self._lost.get(key)
                raise UnavailableError(lost) if lost is not None else self._not_started(key)
            self._lost.pop(key, None)
            sequence = self.sequences[key] = Sequence(key)
            if not self._place(sequence):
                self.backlog.append(sequence)
        if sequence.ending:
            # As Triton: a queued END forgets the correlation ID, so only a START may
            # use it again; it begins a new sequence, on this one's slot after the END.
            if not request.flags & SEQUENCE_START:
                raise self._not_started(key)
            sequence.ending = False
        if sequence.idle is not None:
            sequence.idle.cancel()
            sequence.idle = None
        if request.flags & SEQUENCE_END:
            sequence.ending = True
        sequence.queue.append(request)
        if sequence.instance is None and request.timeout_us > 0:
            expires = request.arrival_ns + request.timeout_us * 1000
            sequence.expires_ns = min(expires, sequence.expires_ns or expires)
            self._arm(expires)

    def open_sequences(self) -> int:
        return len(self.sequences)

    def continues(self, request: Request) -> bool:
        return not request.flags & SEQUENCE_START and request.correlation_id in self.sequences

    def _unused_id(self) -> int:
        key = next(self._standalone_ids)
        while key in self.sequences:
            key = next(self._standalone_ids)
        return key

    def _not_started(self, key: int | str) -> InvalidArgumentError:
        return InvalidArgumentError(  # (Triton's words)
            f"inference request for sequence {key} to model '{self.model.name}' must specify the "
            "START flag on the first request of the sequence"
        )

    def _place(self, sequence: Sequence) -> bool:
        """Bind a sequence to the lowest free slot of the ready instances, as Triton picks
        one: on a tie, the instance given a sequence least recently, so sequences spread
        over instances even one at a time. False when no slot is free (it waits in the
        backlog, in the order sequences came)."""
        taken: dict[ModelInstance, set[int]] = collections.defaultdict(set)
        for other in self.sequences.values():
            if other.instance is not None:
                taken[other.instance].add(other.slot)
        best: tuple[int, int, ModelInstance] | None = None
        for instance in self.instances:
            used = taken[instance]
            if not instance.serves or len(used) >= self.slots:
                continue
            slot = next(i for i in range(len(used) + 1) if i not in used)
            rank = (slot, self._last_placed.get(instance, 0), instance)
            if best is None or rank[:2] < best[:2]:
                best = rank
        if best is None:
            return False
        sequence.slot, _, sequence.instance = best
        self._last_placed[sequence.instance] = next(self._placements)
        return True

    @property
    def pending(self) -> int:
        return sum(len(s.queue) for s in self.sequences.values())

    def cancel(self, request: Request, answer: bool = True) -> None:
        """A queued request's cancellation cancels its sequence, as in Triton 2.51 (upstream
        L0_request_cancellation, side by side): the sequence's other queued requests are
        answered CANCELLED too, and it ends (a request of it already running finishes)."""
        sequence = self.sequences.get(request.correlation_id)
        if sequence is None or request not in sequence.queue:
            super().cancel(request, answer)
            return
        siblings = [queued for queued in sequence.queue if queued is not request]
        sequence.queue.clear()
        sequence.queue.append(request)
        super().cancel(request, answer)
        for sibling in siblings:
            sibling.cancelled = True
            self._fail(sibling, CancelledError("request was cancelled"), "CANCELED")
        if self.sequences.get(sequence.key) is sequence:
            self._release(sequence)
            asyncio.get_running_loop().call_soon(self.dispatch)  # (its slot may serve a waiting one)

    def _remove(self, request: Request) -> bool:
        """Take a queued request back (its timeout passed, or cancelled: see cancel). A
        sequence whose START goes back before anything of it ran is forgotten (what came
        after the START fails as a request without one would); any other left with nothing
        to do idles out like any other: waiting for a slot with no request, it would
        otherwise take one for good."""
        sequence = self.sequences.get(request.correlation_id)
        if sequence is None:
            return False
        try:
            sequence.queue.remove(request)
        except ValueError:
            return False
        if request.flags & SEQUENCE_START and not sequence.started:
            orphans = list(sequence.queue)
            sequence.queue.clear()
            self._release(sequence)
            for orphan in orphans:
                self._fail(orphan, self._not_started(sequence.key))
            asyncio.get_running_loop().call_soon(self.dispatch)  # (its slot may serve a waiting one)
            return True
        if request.flags & SEQUENCE_END:
            sequence.ending = False  # (the client may send its END again)
        if not sequence.queue and not sequence.running:
            self._idle_out(sequence)
        return True

    def _idle_out(self, sequence: Sequence) -> None:
        """Start the sequence's idle time: it ends then unless a request comes."""
        if sequence.idle is None:
            sequence.idle = asyncio.get_running_loop().call_later(self.idle_s, self._expire, sequence)

    def _take_all(self) -> list[Request]:
        taken = [r for s in self.sequences.values() for r in s.queue]
        for sequence in list(self.sequences.values()):
            self._release(sequence)
        return taken

    # -- batches ------------------------------------------------------------------------
    def dispatch(self) -> None:
        """Work here belongs to instances: offer each free instance its sequences (those an
        instance_group update removed too, which run theirs to their end, as in Triton)."""
        self._expire_backlog()
        if any(self._held_until):
            backlog = sum(len(s.queue) for s in self.backlog)
            in_slots, in_backlog = self._held_until
            if self.pending - backlog < in_slots or backlog < in_backlog:
                return  # (each request queued dispatches again)
            self._held_until = (0, 0)
        for instance in self.model.all_instances:
            if self.has_room(instance):
                batch = self._next_batch(instance)
                if batch:
                    self._execute(instance, batch)

    def _next_batch(self, instance: ModelInstance) -> list[Request] | None:
        ready = [
            s for s in self.sequences.values()
            if s.instance is instance and s.queue and not s.running
        ]
        if not ready:
            return None
        ready.sort(key=self._waiting_since)
        if not self.direct:
            # The oldest request's shapes: the others wait for a batch of their own (Triton
            # 2.51 side by side: it does not close the batch at the first one, as its
            # dynamic batcher does).
            shapes = batch_shapes(ready[0].queue[0], self._ragged)
            ready = [s for s in ready if batch_shapes(s.queue[0], self._ragged) == shapes]
            count, wait_until = self.rule.take((1, shapes, self._waiting_since(s)) for s in ready)
            if wait_until:
                self._arm(wait_until)  # more may come for the batch meanwhile
            return [self._start(sequence) for sequence in ready[:count]] or None
        if self.delay_ns and min(len(ready), self.max_batch) < self._enough:
            due = self._waiting_since(ready[0]) + self.delay_ns
            if time.monotonic_ns() < due:
                self._arm(due)  # more may come for the batch meanwhile
                return None
        return self._slot_batch(ready)

    def _waiting_since(self, sequence: Sequence) -> int:
        """When the sequence's next request began to wait for a batch: its arrival, or
        with ``oldest``, as in Triton, once the request before it was done (Triton hands
        a sequence's next request to its batcher only then, and times the delay and the
        order of the batch from that)."""
        arrival = sequence.queue[0].arrival_ns
        return arrival if self.direct else max(arrival, sequence.done_ns)

    def _start(self, sequence: Sequence) -> Request:
        """Take the sequence's next request for a batch, with its control inputs and
        state. Its END frees the slot now (once it is done for an iterative sequence, or
        where the instance runs several executes at once: an async model's; and not while
        a new sequence of the same ID waits behind it)."""
        sequence.running = sequence.started = True
        request = sequence.queue.popleft()
        self._running[id(request)] = sequence
        self._add_controls(request)
        if self.states:
            self._with_state(sequence, request)
        concurrent = sequence.instance is not None and sequence.instance.concurrency
        ends = request.flags & SEQUENCE_END and not self.iterative and not concurrent
        if ends and not sequence.queue:
            self._release(sequence)
        return request

    def _add_controls(self, request: Request) -> None:
        for control in self.controls:
            request.inputs[control.name] = control.tensor(request, self.batching)

    def _slot_batch(self, ready: list[Sequence]) -> list[Request]:
        """The direct strategy's batch: place i holds slot i's request, from slot 0 up to
        the highest slot with one, fillers in the gaps (see the module docstring)."""
        by_slot = {s.slot: s for s in ready}
        lowest = by_slot[min(by_slot)].queue[0]
        shapes = batch_shapes(lowest, self._ragged)
        blank = {
            name: Tensor.zeros(tensor.data_type, tensor.shape)
            for name, tensor in lowest.inputs.items()
            if name in self.model.signature.inputs
        }
        outputs = lowest.requested_outputs
        batch = []
        for slot in range(max(by_slot) + 1):
            sequence = by_slot.get(slot)
            if sequence is not None and batch_shapes(sequence.queue[0], self._ragged) == shapes:
                batch.append(self._start(sequence))
            else:
                batch.append(self._filler(blank, outputs))
        return batch

    def _filler(self, blank: dict[str, Tensor], outputs: list[str] | None) -> Request:
        """A request for an empty slot: the ``blank`` inputs (zeros), READY false."""
        model = self.model
        filler = Request(
            model.name, dict(blank), _no_answer, model_version=model.version,
            requested_outputs=outputs, filler=True, finished=True, counted=True, owner=self,
        )
        self._add_controls(filler)
        for state in self.states:
            filler.inputs[state.input_name] = state.first(self.batching)
        return filler

    def _with_state(self, sequence: Sequence, request: Request) -> None:
        """Give the request its sequence's state and ask the worker for the next one."""
        if request.flags & SEQUENCE_START:
            sequence.state.clear()
        wanted = list(self.model.output_names if request.requested_outputs is None else request.requested_outputs)
        hidden = self._hidden.setdefault(id(request), set())
        for state in self.states:
            current = sequence.state.get(state.input_name)
            request.inputs[state.input_name] = current if current is not None else state.first(self.batching)
            if state.output_name not in wanted:
                wanted.append(state.output_name)
                hidden.add(state.output_name)
        request.requested_outputs = wanted

    def _deliver(self, request: Request, response: Response, failure: str | None) -> None:
        if self.states:
            hidden = self._hidden.pop(id(request), ()) if response.final else self._hidden.get(id(request), ())
            sequence = self._running.get(id(request)) or self.sequences.get(request.correlation_id)
            if request.flags & SEQUENCE_END:
                sequence = None  # (the sequence is over: its END's state goes nowhere)
            for state in self.states:
                tensor = response.outputs.get(state.output_name)
                if tensor is not None and sequence is not None:
                    sequence.state[state.input_name] = tensor
                if state.output_name in hidden:
                    response.outputs.pop(state.output_name, None)
        super()._deliver(request, response, failure)

    def _completed(self, batch: list[Request]) -> None:
        for request in batch:
            sequence = self._running.pop(id(request), None)
            if sequence is None:  # (a filler)
                continue
            sequence.running = False
            sequence.done_ns = time.monotonic_ns()
            if self.sequences.get(sequence.key) is not sequence:
                continue  # freed when its END went into the batch, or lost
            # (an iterative sequence ends once its request is done, rescheduled no more, as
            # in Triton: a later request of it needs a START again)
            if (request.flags & SEQUENCE_END or self.iterative) and not sequence.queue:
                self._release(sequence)
            elif not sequence.queue:
                self._idle_out(sequence)

    def _reschedule(self, request: Request) -> None:
        if not self.iterative:
            super()._reschedule(request)
            return
        sequence = self._running.get(id(request))
        if sequence is None or self.sequences.get(sequence.key) is not sequence:
            super()._reschedule(request)
            return
        for control in self.controls:
            request.inputs.pop(control.name, None)
        for state in self.states:
            request.inputs.pop(state.input_name, None)
        sequence.queue.appendleft(request)

    def _expire(self, sequence: Sequence) -> None:
        """No request for the idle time: the sequence is over."""
        sequence.idle = None
        if not sequence.queue and not sequence.running and self.sequences.get(sequence.key) is sequence:
            self._release(sequence)
            self.dispatch()

    def _release(self, sequence: Sequence) -> None:
        if sequence.idle is not None:
            sequence.idle.cancel()
            sequence.idle = None
        if self.sequences.get(sequence.key) is sequence:
            del self.sequences[sequence.key]
        if sequence in self.backlog:
            self.backlog.remove(sequence)
        self._place_waiting()  # a slot may be free for the oldest waiting

    def _place_waiting(self) -> None:
        """Give free slots to the sequences waiting for one, in the order they came."""
        while self.backlog and self._place(self.backlog[0]):
            self.backlog.popleft().expires_ns = None

    def _expire_backlog(self) -> None:
        """Fail the sequences whose requests' timeouts ran out while they waited for a
        slot, as Triton does (a sequence in a slot keeps its requests, timeouts or not)."""
        now = time.monotonic_ns()
        expired = [s for s in self.backlog if s.expires_ns is not None and s.expires_ns <= now]
        for sequence in expired:
            queued = list(sequence.queue)
            sequence.queue.clear()
            self._release(sequence)
            for request in queued:  # (Triton's words)
                error = UnavailableError("timeout of the corresponding sequence has been expired")
                self._fail(request, error, "REJECTED")

    def holds(self, instance: ModelInstance) -> bool:
        return any(s.instance is instance for s in self.sequences.values())

    def forget(self, instance: ModelInstance) -> None:
        self._last_placed.pop(instance, None)

    # -- instance health ----------------------------------------------------------------
    def instance_state_changed(self) -> None:
        """Sequences on an instance that died lost their state: fail and forget them."""
        for sequence in [s for s in self.sequences.values() if s.instance is not None and not s.instance.ready]:
            error = UnavailableError(
                f"sequence {sequence.key} of model '{self.model.name}' was lost: "
                f"{sequence.instance.last_error if sequence.instance else ''}; start it again"
            )
            queued = list(sequence.queue)
            sequence.queue.clear()
            self._release(sequence)
            self._lost[sequence.key] = error.message
            if len(self._lost) > LOST_KEPT:
                self._lost.popitem(last=False)
            for request in queued:
                self._fail(request, error)
        self._place_waiting()  # (an instance may be back)
        super().instance_state_changed()

    def close(self) -> None:
        super().close()
        for sequence in list(self.sequences.values()):
            if sequence.idle is not None:
                sequence.idle.cancel()
