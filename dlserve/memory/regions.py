"""Client-registered system shared-memory regions (Triton's system shared-memory extension).

A client creates a POSIX shared-memory object, registers ``(name, key, offset,
byte_size)``, and then points inputs and outputs at ``(region, offset, size)``.
The server maps the object once at registration; workers map it by key too, so a
model reads its inputs from, and writes its outputs into, the client's memory.

Every reference is checked: the region must fit the object, a reference must fit
the region, and — because a client can shrink its object after registering it,
which would turn a touch into SIGBUS — the object's current size is checked again
each time a region is used, and again when a worker's answer refers to it
(dlserve.ipc.tensors). A region means the object its key named when it was
registered, as in Triton: the server holds that object open
(:meth:`dlserve.memory.shm.Segment.pin`) and its workers open it through the server,
so a client may remove it once registered, or create another object under the same
key, and the region still means the first. Keys in dlserve's own namespace can never
be registered, with or without a leading ``/`` (the same POSIX object), and errors
never echo an internal segment name.

A region is in use while a request holds a view of it (:meth:`SystemRegions.view`:
each view is an anchor of its own that counts itself out when its last array dies).
As in Triton, a region in use cannot be unregistered: the request would fail, the
model's output would still land in memory the client was told it got back, and the
mapping would outlive the region.

Left: a client that shrinks its object in the microseconds between such a check and
the server's touch (writing a response that refers to the region) still crashes the
server; everywhere else a shrunk object fails only the requests that use it.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from dlserve.errors import AlreadyExistsError, InternalError, InvalidArgumentError, NotFoundError
from dlserve.memory.arena import Anchor, MemorySpace
from dlserve.memory.shm import Segment, shm_path


def check_reference(name: str, offset: int, byte_size: int, region_size: int) -> None:
    """Raise unless ``[offset, offset + byte_size)`` lies inside a region of ``region_size``
    bytes (an empty reference at its end too, as Triton refuses it)."""
    outside = offset < 0 or offset >= region_size
    if outside or byte_size < 0 or offset + byte_size > region_size:
        what = "offset" if outside else "offset + byte size"
        raise InvalidArgumentError(  # (Triton's words, then the numbers)
            f"Invalid {what} for shared memory region: '{name}': [{offset}, "
            f"{offset + byte_size}) is outside its {region_size} bytes"
        )


def refuse_busy(name: str | None, busy: list[str], kind: str) -> None:
    """Triton's error for an unregister of regions (``kind``: "system" or "cuda") that
    requests still use: ``name``'s, or each one's of an unregister-all (``name`` None)."""
    if busy and name is not None:
        raise InternalError(f"Cannot unregister shared memory region '{name}', it is currently in use.")
    if busy:
        raise InternalError(
            f"Failed to unregister the following {kind} shared memory regions: "
            + "".join(f"{n} ," for n in busy)
        )


def output_too_small(name: str, holds: int, needed: int) -> str:
    """Triton's words for an output bigger than the shared memory its request gave it."""
    return (
        f"shared memory size specified with the request for output '{name}' "
        f"({holds} bytes) should be at least {needed} bytes to hold the results"
    )


@dataclasses.dataclass
class Region:
    name: str
    key: str  # as registered (status echoes it), e.g. "/input" for the object "input"
    offset: int
    byte_size: int
    segment: Segment
    anchor: Anchor  # keeps the mapping alive while requests use the region
    users: int = 0  # views requests hold now

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}


class SystemRegions:
    """The registry of client system shared-memory regions of one server."""

    def __init__(
        self,
        space: MemorySpace,
        reserved_prefix: str,
        on_forget: Callable[[str], None] = lambda name: None,
    ) -> None:
        """``on_forget(segment name)`` is told when no region uses an object any more,
        so that workers drop their mapping of it too."""
        self._space = space
        self._reserved = reserved_prefix
        self._on_forget = on_forget
        # Re-entrant: a view's death (counted in _let_go) may come in the middle of a call.
        self._lock = threading.RLock()
        self._regions: dict[str, Region] = {}
        self._objects: dict[tuple[str, int], Segment] = {}  # (key, inode) -> its mapping

    def __contains__(self, name: object) -> bool:
        return name in self._regions

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        # A key that cannot be opened is Triton's INTERNAL, said before anything else (it
        # opens the key first; upstream L0_grpc registers ('', '', 0) and expects this).
        if not key.lstrip("/"):
            raise InternalError(f"Unable to open shared memory region: '{key}'")
        if not name:
            raise InvalidArgumentError("shared memory region name must not be empty")
        bare = key[1:] if key.startswith("/") else key
        if bare.startswith(self._reserved):
            raise InvalidArgumentError(
                f"shared memory key '{key}' is in a reserved namespace and cannot be registered"
            )
        if offset < 0 or byte_size <= 0:  # (Triton's words first, then which)
            raise InvalidArgumentError(
                f"failed to register shared memory region '{name}': invalid args: offset must "
                "be >= 0 and byte_size > 0"
            )
        with self._lock:
            if name in self._regions:
                raise AlreadyExistsError(
                    f"shared memory region '{name}' already in manager"
                )
            path = shm_path(key)  # validates the key's characters
            try:
                segment = self._mapping(bare, path)
            except FileNotFoundError:
                raise InternalError(f"Unable to open shared memory region: '{key}'") from None
            except PermissionError:
                raise InternalError(
                    f"Unable to open shared memory region: '{key}' (permission denied)"
                ) from None
            except OSError as exc:  # (a symbolic link, a directory: not a shared memory object)
                raise InternalError(
                    f"Unable to open shared memory region: '{key}' ({exc.strerror})"
                ) from None
            if offset + byte_size > segment.size:
                if not any(region.segment is segment for region in self._regions.values()):
                    self._forget(segment)  # let go of what no region holds
                raise InvalidArgumentError(
                    f"failed to register shared memory region '{name}': invalid args: "
                    f"[{offset}, {offset + byte_size}) is outside the {segment.size}-byte object '{key}'"
                )
            anchor = self._space.anchor(segment, offset, byte_size)
            self._regions[name] = Region(name, key, offset, byte_size, segment, anchor)

    def _mapping(self, key: str, path: str) -> Segment:
        """The mapping of the object ``key`` names now (shared by its regions)."""
        segment = self._objects.get((key, os.stat(path, follow_symlinks=False).st_ino))
        if segment is None:
            segment = Segment.pin(key)
            self._space.add_segment(segment)
            self._objects[(key, segment.inode)] = segment
        return segment

    def _forget(self, segment: Segment) -> None:
        self._objects = {k: s for k, s in self._objects.items() if s is not segment}
        self._space.forget_segment(segment.name)
        self._on_forget(segment.name)

    def unregister(self, name: str | None = None, force: bool = False) -> None:
        """Forget one region (``name``) or all. A region a request uses stays (Triton's
        words and status); with ``force`` (the server stops) every one goes."""
        if not force and any(region.users for region in list(self._regions.values())):
            gc.collect()  # a view only a reference cycle still holds is no use
        with self._lock:
            names = sorted(self._regions) if name is None else [name]  # (by name, as Triton)
            busy = [n for n in names if n in self._regions and self._regions[n].users and not force]
            removed = [self._regions.pop(n) for n in names if n in self._regions and n not in busy]
            in_use = {id(region.segment) for region in self._regions.values()}
            for segment in {id(r.segment): r.segment for r in removed if id(r.segment) not in in_use}.values():
                self._forget(segment)
        refuse_busy(name, busy, "system")

    def status(self, name: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            if name is None:  # by name, as Triton lists them
                return [self._regions[n].status() for n in sorted(self._regions)]
            region = self._regions.get(name)
        if region is None:
            raise NotFoundError(f"Unable to find system shared memory region: '{name}'")
        return [region.status()]

    def view(self, name: str, offset: int, byte_size: int) -> np.ndarray:
        """``byte_size`` bytes at ``offset`` inside region ``name``, as a uint8 view."""
        with self._lock:
            region = self._regions.get(name)
        if region is None:
            raise NotFoundError(f"Unable to find shared memory region: '{name}'")  # (Triton's 404)
        check_reference(name, offset, byte_size, region.byte_size)
        # Only the bytes this reference touches must still exist (Triton serves what lies
        # inside a shrunk object too); touching the rest would be a SIGBUS.
        if region.segment.current_size() < region.offset + offset + byte_size:
            raise InvalidArgumentError(
                f"shared memory region '{name}' was shrunk by its owner; register it again"
            )
        view = self._space.anchor(
            region.segment, region.offset + offset, byte_size, on_death=lambda: self._let_go(region)
        )
        with self._lock:
            region.users += 1
        return np.frombuffer(view, dtype=np.uint8)

    def _let_go(self, region: Region) -> None:
        with self._lock:
            region.users -= 1
