"""Triton's response cache: a request whose inputs were answered before is answered
from the cache, without running its model.

On when the server has a cache (``--cache-config local,size=<bytes>``) and a model
asks for it (``response_cache { enable: true }``). One cache of that many bytes
serves every model, least recently used entries evicted first; an entry bigger than
the whole cache is not kept. Decoupled and sequence models cannot use it (their
load fails, as in Triton).

Measured against Triton 2.51, and where dlserve differs on purpose:

* Triton's key is the model, its version and each input's name and bytes. dlserve's
  also holds each input's data type and shape and the outputs asked for: Triton
  answers a request for [2, 2] with the [1, 4] outputs of the same bytes, and a
  request for every output with the one output an earlier request asked for.
* Triton caches error responses (a later identical request gets an empty 200
  response); dlserve caches successful responses only.
* Triton's entries outlive the model: a model reloaded with new code answers with
  its old outputs. dlserve's belong to one load of the model, dropped at its unload.
* As in Triton, a hit counts as a success with its lookup in ``cache_hit`` and the
  time before it as queue time, but not as an inference or an execution; a miss
  adds its lookup and insertion to ``cache_miss``. Identical requests arriving
  together all run, but only the first response into the cache counts a miss (the
  others find their entry there: Triton counts them as neither, side by side). A
  hit's response has no parameters (Triton keeps none either).

Cached outputs are read-only copies that every hit shares: answering from the
cache copies nothing, except into a client's shared-memory region when the request
asked for its outputs there.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from dlserve.engine.request import Request, Response
from dlserve.errors import InvalidArgumentError
from dlserve.memory.dtypes import DataType
from dlserve.memory.tensor import Tensor

if TYPE_CHECKING:
    from dlserve.engine.model import ModelVersion

log = logging.getLogger(__name__)

CACHE_NAME = "local"  # the one cache implementation, as Triton's --cache-config names it


def cache_size(cache_config: dict[str, dict[str, object]]) -> int | None:
    """The cache's size in bytes from tritonserver's ``cache_config`` ({cache: {key:
    value}}), or None when no cache is configured."""
    if not cache_config:
        return None
    if len(cache_config) > 1:  # (Triton's words)
        raise InvalidArgumentError(
            "found multiple cache configurations, but only a single cache is currently supported"
        )
    unknown = set(cache_config) - {CACHE_NAME}
    if unknown:
        raise InvalidArgumentError(
            f"unknown response cache '{sorted(unknown)[0]}': dlserve has the '{CACHE_NAME}' cache only"
        )
    settings = cache_config[CACHE_NAME]
    if "size" not in settings:
        raise InvalidArgumentError("cache config 'local' needs a 'size' in bytes (local,size=<bytes>)")
    text = str(settings["size"]).strip()
    if not text.isdigit() or int(text) <= 0:
        raise InvalidArgumentError(f"cache config 'local' size must be a positive number of bytes, got '{text}'")
    extra = set(settings) - {"size"}
    if extra:
        raise InvalidArgumentError(f"cache config 'local' has no setting '{sorted(extra)[0]}' (only 'size')")
    return int(text)


class _HitTensor(Tensor):
    """An output answered from the cache: its memory is the entry's, which every hit
    shares, so a legacy DLPack capsule (which cannot say read-only) gets a copy."""

    __slots__ = ()
    shares_read_only = False


@dataclasses.dataclass(frozen=True)
class _Entry:
    outputs: tuple[tuple[str, DataType, tuple[int, ...], np.ndarray], ...]  # read-only storage
    nbytes: int
    generation: int  # the ModelVersion load it came from


def _entry_size(outputs: tuple[tuple[str, DataType, tuple[int, ...], np.ndarray], ...]) -> int:
    """An entry's bytes, counted as Triton's local cache does (header, names, types,
    shapes and data of each output)."""
    size = 4
    for name, data_type, shape, data in outputs:
        size += 8 + 4 + len(name) + 4 + len(data_type.wire_name) + 4 + 8 * len(shape) + 8 + data.nbytes
    return size


class ResponseCache:
    """The server's one cache: entries by request key, least recently used first.
    Used on the engine's event loop only."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._entries: collections.OrderedDict[bytes, _Entry] = collections.OrderedDict()
        self.hits = self.misses = self.lookups = self.evictions = 0
        self.lookup_ns = self.insertion_ns = 0  # totals

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def key(model: ModelVersion, request: Request) -> bytes:
        digest = hashlib.blake2b(digest_size=16)
        digest.update(f"{model.name}\0{model.version}\0{model.generation}\0".encode())
        for name in sorted(request.inputs):
            tensor = request.inputs[name]
            shape = ",".join(str(int(d)) for d in tensor.shape)
            digest.update(f"{name}\0{tensor.data_type.wire_name}\0{shape}\0".encode())
            data = tensor.storage()
            digest.update(data.nbytes.to_bytes(8, "little"))
            digest.update(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
        requested = "*" if request.requested_outputs is None else ",".join(sorted(request.requested_outputs))
        digest.update(requested.encode())
        return digest.digest()

    def get(self, key: bytes) -> _Entry | None:
        start = time.monotonic_ns()
        entry = self._entries.get(key)
        self.lookups += 1
        if entry is None:
            self.misses += 1
        else:
            self.hits += 1
            self._entries.move_to_end(key)
        self.lookup_ns += time.monotonic_ns() - start
        return entry

    def put(self, key: bytes, response: Response, generation: int) -> bool:
        """Keep a successful response's outputs (copied, read-only) under ``key``; False
        when an entry was there already (an identical request's, answered first)."""
        if key in self._entries:
            return False
        start = time.monotonic_ns()
        outputs = []
        for name, tensor in response.outputs.items():
            data = np.array(tensor.storage(), copy=True)
            data.flags.writeable = False
            outputs.append((name, tensor.data_type, tuple(int(d) for d in tensor.shape), data))
        frozen = tuple(outputs)
        entry = _Entry(frozen, _entry_size(frozen), generation)
        if entry.nbytes > self.capacity:  # (Triton's words, logged at each such miss)
            log.error(
                "Failed to insert key [%d] into response cache: Requested byte_size: %d is "
                "greater than total cache size: %d",
                int.from_bytes(key[:8], "little"),
                entry.nbytes,
                self.capacity,
            )
        else:
            while self.used + entry.nbytes > self.capacity:
                _, evicted = self._entries.popitem(last=False)
                self.used -= evicted.nbytes
                self.evictions += 1
            self._entries[key] = entry
            self.used += entry.nbytes
        self.insertion_ns += time.monotonic_ns() - start
        return True

    def forget(self, generation: int) -> None:
        """Drop the entries of one load of a model (it is unloaded)."""
        for key in [k for k, e in self._entries.items() if e.generation == generation]:
            self.used -= self._entries.pop(key).nbytes

    @property
    def utilization(self) -> float:
        return self.used / self.capacity


def answer(cache: ResponseCache, model: ModelVersion, request: Request) -> Response | None:
    """A hit's response for ``request`` (its statistics recorded), or None on a miss,
    after which the request's final response, if successful, goes into the cache."""
    start = time.monotonic_ns()
    key = cache.key(model, request)
    entry = cache.get(key)
    stats = model.stats.durations
    if entry is None:
        deliver = request.on_response

        def remember(response: Response) -> None:
            began = time.monotonic_ns()
            missed = True
            if response.final and response.error is None and not response.flags_only:
                missed = cache.put(key, response, model.generation)
            if missed:
                stats["cache_miss"].add(lookup_ns + time.monotonic_ns() - began)
            deliver(response)

        lookup_ns = time.monotonic_ns() - start
        request.on_response = remember
        return None
    response = Response(model.name, model.version, request.request_id)
    buffers = request.output_buffers or {}
    for name, data_type, shape, data in entry.outputs:
        if data_type is DataType.BYTES:
            tensor: Tensor = _HitTensor(data_type, shape, data=data)
        else:
            tensor = _HitTensor(data_type, shape, data=data.reshape(shape))
        buffer = buffers.get(name)
        if buffer is not None:
            try:
                tensor = tensor.write_into(buffer)
            except ValueError as exc:
                response.outputs.clear()
                response.error = InvalidArgumentError(
                    f"{request.label}output '{name}' does not fit its shared memory: {exc}"
                )
                break
        response.outputs[name] = tensor
    now = time.monotonic_ns()
    stats["queue"].add(start - request.arrival_ns)
    stats["cache_hit"].add(now - start)
    return response
