"""Model warmup (``model_warmup`` in config.pbtxt): sample requests each instance runs
after ``initialize`` and before its model version is ready, so the first client does
not pay for lazy initialisation (JIT compilation, caches, CUDA kernels).

As Triton 2.51 does it (measured on it): every instance runs every sample in the
config's order, ``count`` times (0 counts as once); a sample of ``batch_size`` B is
one ``execute`` of B requests, each with a batch dimension of 1 when the model
batches; a sample of batch size 0 is skipped. The requests have no id and ask for
every output; they go straight to the instance, past the batchers. Inputs are zeros
(``zero_data``; empty strings for BYTES), random bytes (``random_data``) or read from
``<model>/warmup/<file>`` (``input_data_file``; raw bytes, BYTES as length-prefixed
strings). Any error response or failed execute fails the load with
``failed to run warmup sample '<name>': <errors>``.

Where dlserve differs: samples are checked when the model loads, before any worker
starts (Triton checks them after ``initialize``), so a bad sample costs no model
start, and a BYTES input of ``random_data`` gets random lowercase text (Triton's is
empty); ``input_data_file`` must stay inside the model's warmup folder; a batch size
over ``max_batch_size`` is refused (Triton 2.51 often crashes on it); warmup
requests are not counted in the model's statistics (Triton counts them as
inferences).
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dlserve.engine.proto import model_config_pb2 as mc
from dlserve.engine.repository import WARMUP_FOLDER
from dlserve.engine.request import STREAMING, Request, Response, validate_request
from dlserve.errors import InternalError, InvalidArgumentError, TritonError
from dlserve.memory import bytes_codec
from dlserve.memory.dtypes import DataType
from dlserve.memory.tensor import Tensor

if TYPE_CHECKING:
    from dlserve.engine.instance import ModelInstance
    from dlserve.engine.model import ModelVersion

log = logging.getLogger("dlserve.engine")

_RANDOM_SEED = 0  # random_data is the same at every load, as Triton's is


@dataclasses.dataclass(frozen=True)
class Sample:
    """One ``model_warmup`` entry, its inputs made: what one request of it carries."""

    name: str
    batch_size: int
    count: int
    inputs: dict[str, Tensor]


def samples(model: ModelVersion) -> list[Sample]:
    """The model's warmup samples, checked and their inputs made (raises
    InvalidArgumentError naming the sample and input)."""
    config = model.config
    made = []
    for warmup in config.model_warmup:
        if warmup.batch_size == 0:  # as Triton: a sample without a batch size is skipped
            log.debug("Skipping batch 0 warmup sample '%s'", warmup.name)
            continue
        log.debug("Generating warmup sample data for '%s'", warmup.name)
        where = f"model '{model.name}', warmup sample '{warmup.name}'"
        batching = config.max_batch_size > 0
        if warmup.batch_size > max(config.max_batch_size, 1):
            raise InvalidArgumentError(
                f"{where}: batch_size {warmup.batch_size} is more than the model's "
                f"max_batch_size {config.max_batch_size}"
            )
        inputs = {
            name: _input(model.model_dir, where, name, spec, batching)
            for name, spec in sorted(warmup.inputs.items())
        }
        # Inputs the config declares are checked as a request's are; others reach the
        # model unchecked, as in Triton (its samples are input overrides: upstream's
        # bls_model_loading warms up with inputs its config does not list).
        declared = {name: t for name, t in inputs.items() if name in model.signature.inputs}
        probe = Request(model.name, declared, on_response=lambda _: None)
        try:
            validate_request(probe, model.signature)  # applies reshape to probe.inputs
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{where}: {exc.message}") from None
        undeclared = {name: t for name, t in inputs.items() if name not in declared}
        sample_inputs = {**probe.inputs, **undeclared}
        made.append(Sample(warmup.name, warmup.batch_size, max(warmup.count, 1), sample_inputs))
    return made


def _input(
    model_dir: Path, where: str, name: str, spec: mc.ModelWarmup.Input, batching: bool
) -> Tensor:
    where = f"{where}, input '{name}'"
    if spec.data_type == mc.TYPE_INVALID:
        raise InvalidArgumentError(f"{where}: data_type is not set")
    data_type = DataType(spec.data_type)
    dims = [int(d) for d in spec.dims]
    if any(d < 0 for d in dims):
        raise InvalidArgumentError(
            f"{where}: warmup needs every dimension given, got dims {dims} (no -1)"
        )
    shape = ([1] if batching else []) + dims
    count = int(np.prod(shape, dtype=np.int64))
    kind = spec.WhichOneof("input_data_type")
    if kind is None:
        raise InvalidArgumentError(f"{where}: set one of zero_data, random_data or input_data_file")
    if kind == "input_data_file":
        return _from_file(model_dir, where, spec.input_data_file, data_type, shape, count)
    if kind == "zero_data":
        return Tensor.zeros(data_type, shape)
    rng = np.random.default_rng(_RANDOM_SEED)
    if data_type is DataType.BYTES:
        strings = [bytes(rng.integers(ord("a"), ord("z") + 1, 8, dtype=np.uint8)) for _ in range(count)]
        return Tensor(data_type, shape, objects=np.array(strings, dtype=object).reshape(shape))
    storage = data_type.storage_dtype
    data = rng.integers(0, 256, count * storage.itemsize, dtype=np.uint8).view(storage).reshape(shape)
    return Tensor(data_type, shape, data=data)


def _from_file(
    model_dir: Path, where: str, file: str, data_type: DataType, shape: list[int], count: int
) -> Tensor:
    folder = (model_dir / WARMUP_FOLDER).resolve()
    path = (folder / file).resolve()
    if not path.is_relative_to(folder) or path == folder:
        raise InvalidArgumentError(f"{where}: input_data_file '{file}' is not in the model's warmup folder")
    needed = -1 if data_type is DataType.BYTES else count * data_type.itemsize  # BYTES: all of it
    try:
        if not path.exists():
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT))
        if not path.is_file():  # (not a FIFO or a device, which would block the load)
            raise FileNotFoundError(errno.ENOENT, "not a regular file")
        raw = np.fromfile(path, dtype=np.uint8, count=needed)
    except OSError as exc:
        raise InvalidArgumentError(f"{where}: cannot read input_data_file '{file}': {exc.strerror}") from None
    if data_type is DataType.BYTES:
        try:
            found = bytes_codec.count_elements(raw)
        except ValueError as exc:
            raise InvalidArgumentError(
                f"{where}: input_data_file '{file}' does not hold length-prefixed strings: {exc}"
            ) from None
        if found != count:
            raise InvalidArgumentError(
                f"{where}: input_data_file '{file}' holds {found} strings, the input needs {count}"
            )
        return Tensor(data_type, shape, data=raw)
    if raw.nbytes < needed:
        raise InvalidArgumentError(
            f"{where}: input_data_file '{file}' holds {raw.nbytes} bytes, the input needs {needed}"
        )
    return Tensor(data_type, shape, data=raw[:needed].view(data_type.storage_dtype).reshape(shape))


async def warm_up(instance: ModelInstance, warmups: list[Sample]) -> None:
    """Run every sample on ``instance``; raises InvalidArgumentError with Triton's
    message on the first that fails."""
    for sample in warmups:
        for iteration in range(1, sample.count + 1):
            log.debug(
                "model '%s' instance %s is running warmup sample '%s' for iteration %d",
                instance.model.name, instance.name, sample.name, iteration,
            )  # (Triton's words, which its QA greps)
            errors = await _run(instance, sample)
            if errors:
                log.debug(
                    "model '%s' instance %s failed to run warmup sample '%s'",
                    instance.model.name, instance.name, sample.name,
                )
                reasons = "".join(f"{error}; " for error in errors)
                raise InvalidArgumentError(f"failed to run warmup sample '{sample.name}': {reasons}")


class _Answers:
    """Stands in for a scheduler for one warmup execute: collects each request's
    final answer (see ``Request.owner``)."""

    def __init__(self, requests: list[Request]) -> None:
        self.open = set(map(id, requests))
        self.errors: list[str] = []
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not self.open:
            self.done.set_result(None)

    def stream_response(self, request: Request, response: Response) -> None:
        if response.error is not None:
            self.errors.append(response.error.message)
        if response.final:
            self._close(request)

    def fail(self, request: Request, error: TritonError) -> None:
        self.errors.append(error.message)
        self._close(request)

    def cancel(self, request: Request, answer: bool = True) -> None:
        self.fail(request, InternalError("warmup request cancelled"))

    def _close(self, request: Request) -> None:
        self.open.discard(id(request))
        if not self.open and not self.done.done():
            self.done.set_result(None)

    def executed(self, requests: list[Request], result: Any, _timings: Any) -> None:
        """The execute's own answer: an error for all, or per request a response,
        STREAMING (its answers come through stream_response) or None (rescheduled)."""
        if isinstance(result, TritonError):
            for request in requests:
                self.fail(request, result)
            return
        for request, response in zip(requests, result):
            if response is STREAMING:
                continue
            if response is not None and response.error is not None:
                self.errors.append(response.error.message)
            self._close(request)


async def _run(instance: ModelInstance, sample: Sample) -> list[str]:
    model = instance.model
    requests = [
        Request(model.name, dict(sample.inputs), on_response=lambda _: None, model_version=model.version)
        for _ in range(sample.batch_size)
    ]
    answers = _Answers(requests)
    for request in requests:
        request.owner = answers
    try:
        instance.execute(requests, lambda result, timings: answers.executed(requests, result, timings))
    except TritonError as exc:
        return [exc.message]
    await answers.done
    return answers.errors
