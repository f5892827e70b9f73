"""Triton's rate limiter (``--rate-limit=execution_count``): model instances execute only
when the resources their instance group's ``rate_limiter`` lists are free, across every
model, so models that would overload the machine together take turns.

Resources are counted per device (an instance draws on its own device's copies) unless a
model marks one ``global``. How many copies exist: ``--rate-limit-resource
NAME:COUNT[:DEVICE]`` (without a device: every device's; a device's pool is the larger of
its own entry and that one, a global pool the largest entry of any device); with no
such flag at all, the most any loaded instance asks for, so every instance can run alone;
once any is given, none of a resource it does not name (as in Triton, whose instances
needing it then fail to load). An execute takes its
instance's resources when it starts and gives them back when its worker answers; an
instance with resources runs one execute at a time (a second one queued in its worker
would hold resources while it waits). When resources come back and instances wait for
them, nobody takes them until the waiters have been offered them, the one with the
fewest grants weighted by its ``priority`` first: an instance of priority 2 gets half
the turns of one of priority 1 (stride scheduling, as Triton's documentation describes
the weighting). A waiter offered the turn that takes nothing (it has nothing queued, or
is down) passes it on and stops waiting. Instances without resources are never held
back. Not done: an instance that needs more than is free waits while smaller ones that
fit go ahead, so under steady load it may wait long (Triton's documentation promises no
more); warmup executes do not take resources.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING, Protocol

from dlserve.engine.proto import model_config_pb2 as mc
from dlserve.errors import InvalidArgumentError

if TYPE_CHECKING:
    from dlserve.engine.instance import ModelInstance

log = logging.getLogger(__name__)
GLOBAL = -1  # the device of a global resource's pool


def _checking_order(need: tuple[tuple[str, int], int]) -> tuple[int, str]:
    """Sorts ``((name, device), count)`` as Triton checks them: by device, the global
    pool's first (GLOBAL sorts lowest), then by name."""
    (name, device), _ = need
    return device, name


@dataclasses.dataclass(frozen=True)
class RateLimiterResource:
    """A pool size from the command line / ``Options.rate_limiter_resources``, as
    ``tritonserver.RateLimiterResource``; ``device`` None: every device's pool (or the
    global one, for a resource a model marks global)."""

    name: str
    count: int
    device: int | None = None


def parse_resource(text: str) -> RateLimiterResource:
    """``NAME:COUNT[:DEVICE]`` (tritonserver's --rate-limit-resource)."""
    parts = text.split(":")
    try:
        if len(parts) not in (2, 3) or not parts[0]:
            raise ValueError
        count = int(parts[1])
        device = int(parts[2]) if len(parts) == 3 else None
    except ValueError:
        raise InvalidArgumentError(
            f"rate limit resource '{text}' must look like NAME:COUNT[:DEVICE]"
        ) from None
    if count < 0 or (device is not None and device < 0):
        raise InvalidArgumentError(f"rate limit resource '{text}': count and device must be >= 0")
    return RateLimiterResource(parts[0], count, device)


class Waiter(Protocol):
    """A scheduler with work held back by the limiter."""

    def dispatch(self) -> None: ...


@dataclasses.dataclass(eq=False)
class _Client:
    needs: dict[tuple[str, int], int]  # (resource, device or GLOBAL) -> copies
    priority: int
    turns: float = 0.0  # grants so far, weighted by priority (its stride)


class RateLimiter:
    """The server's resource pools and who holds them; on the event loop only."""

    def __init__(self, explicit: list[RateLimiterResource]) -> None:
        for given in explicit:
            if not given.name or given.count < 0 or (given.device is not None and given.device < 0):
                raise InvalidArgumentError(f"rate limit resource {given}: a name, count and device >= 0")
        self._explicit = list(explicit)
        self._clients: dict[ModelInstance, _Client] = {}
        self._pools: dict[tuple[str, int], int] = {}
        self._in_use: dict[tuple[str, int], int] = {}
        self._waiting: dict[ModelInstance, Waiter] = {}
        self._wake_due = False  # resources came back: the waiters are offered them first
        self._offered: ModelInstance | None = None  # the waiter being offered them now

    # -- instances come and go -------------------------------------------------------------
    def register(self, instance: ModelInstance, config: mc.ModelRateLimiter, device: int) -> None:
        """Add an instance with its group's ``rate_limiter`` (raises if it could never run)."""
        # One count per resource: a name listed twice takes its last count, and a resource
        # may go without a name, as in Triton 2.51 (measured).
        needs = {
            (resource.name, GLOBAL if getattr(resource, "global") else device): int(resource.count)
            for resource in config.resources
        }
        self._check_scope(instance, needs)
        # A newcomer starts level with the least served, not ahead of everyone.
        turns = min((c.turns for c in self._clients.values()), default=0.0)
        self._clients[instance] = _Client(needs, max(int(config.priority), 1), turns)
        try:
            self._resize()
        except InvalidArgumentError:
            self.unregister(instance)
            raise

    def unregister(self, instance: ModelInstance) -> None:
        self._clients.pop(instance, None)
        self._waiting.pop(instance, None)
        self._resize()
        self._wake_soon()  # pools may have changed size

    def _check_scope(self, instance: ModelInstance, needs: dict[tuple[str, int], int]) -> None:
        scopes: dict[str, set[bool]] = {}
        for client in [*self._clients.values(), _Client(needs, 1)]:
            for name, device in client.needs:
                scopes.setdefault(name, set()).add(device == GLOBAL)
        for name, kinds in scopes.items():
            if len(kinds) > 1:  # (Triton's words, which its QA greps)
                raise InvalidArgumentError(
                    f'Resource "{name}" is present as both global and device-specific resource '
                    "in the model configuration."
                )

    def _resize(self) -> None:
        """Pool sizes: the explicit ones, else (none given at all) the most any instance asks for."""
        pools: dict[tuple[str, int], int] = {}
        for client in self._clients.values():
            for key, count in client.needs.items():
                pools[key] = 0 if self._explicit else max(pools.get(key, 0), count)
        for key in pools:
            name, device = key
            # As Triton sizes them: a device's pool, the larger of its own entry and the
            # one for every device; a global pool, the largest entry of any device.
            counts = [
                g.count for g in self._explicit
                if g.name == name and (device == GLOBAL or g.device in (None, device))
            ]
            if counts:
                pools[key] = max(counts)
        for instance, client in self._clients.items():
            # in Triton's order: global resources, then by device, each by name
            for key, count in sorted(client.needs.items(), key=_checking_order):
                if count > pools[key]:
                    name, device = key
                    where = "globally" if device == GLOBAL else f"on device {device}"
                    raise InvalidArgumentError(  # (Triton's words, then which instance and where)
                        f'Resource count for "{name}" is limited to {pools[key]} which will prevent '
                        "scheduling of one or more model instances, the minimum required count is "
                        f"{count} (instance '{instance.name}' {where}; --rate-limit-resource)"
                    )
        self._pools = pools
        if log.isEnabledFor(logging.DEBUG):  # (Triton's verbose line, which its QA greps)
            lines = ["", "Max Resource Map===>"]
            for device in sorted({device for _, device in pools}):
                lines.append(f"\tDevice: {device}")
                lines += [f"\t\tResource: {n}\t Count: {pools[n, d]}" for n, d in sorted(pools) if d == device]
            log.debug("%s\n", "\n".join(lines))

    # -- executes ---------------------------------------------------------------------------
    def admits(self, instance: ModelInstance, waiter: Waiter) -> bool:
        """Whether ``instance`` may start an execute now; if not, and only for want of
        resources, ``waiter`` is asked to dispatch again when they come back."""
        client = self._clients.get(instance)
        if client is None or not client.needs:
            return True
        if instance.in_flight and not instance.concurrency:
            return False  # one at a time: its next dispatch comes when this one is done
        if self._offered is instance or (not self._wake_due and self._offered is None and self._fits(client)):
            return self._fits(client)
        self._waiting[instance] = waiter
        return False

    def _fits(self, client: _Client) -> bool:
        return all(self._in_use.get(k, 0) + n <= self._pools.get(k, 0) for k, n in client.needs.items())

    def fits_beside(self, instance: ModelInstance, holder: ModelInstance) -> bool:
        """Whether ``instance`` could ever run while ``holder`` keeps what it holds (a
        model's call into another that would otherwise wait on itself)."""
        client, held = self._clients.get(instance), self._clients.get(holder)
        if client is None or held is None:
            return True
        return all(held.needs.get(k, 0) + n <= self._pools.get(k, 0) for k, n in client.needs.items())

    def acquire(self, instance: ModelInstance) -> dict[tuple[str, int], int]:
        """Take ``instance``'s resources for one execute; what it took goes back to
        :meth:`release` (even if the instance is gone by then)."""
        client = self._clients.get(instance)
        if client is None or not client.needs:
            return {}
        for key, count in client.needs.items():
            self._in_use[key] = self._in_use.get(key, 0) + count
        client.turns += client.priority
        return client.needs

    def release(self, taken: dict[tuple[str, int], int]) -> None:
        if not taken:
            return
        for key, count in taken.items():
            self._in_use[key] = max(0, self._in_use.get(key, 0) - count)
        self._wake_soon()

    def _wake_soon(self) -> None:
        if self._waiting and not self._wake_due:
            # On the next loop turn: the releasing scheduler finishes its bookkeeping first,
            # and wanting the resources again, waits its turn with the others.
            self._wake_due = True
            asyncio.get_running_loop().call_soon(self._wake)

    def _wake(self) -> None:
        """Offer the resources to the waiters, the least served first; each either takes
        what it needs or passes (and waits again only if it asks again)."""
        self._wake_due = False
        order = sorted(self._waiting, key=lambda i: self._clients[i].turns if i in self._clients else 0.0)
        for instance in order:
            waiter = self._waiting.pop(instance, None)
            client = self._clients.get(instance)
            if waiter is None or client is None or not self._fits(client):
                if waiter is not None and client is not None:
                    self._waiting[instance] = waiter  # still too big for what is free
                continue
            self._offered = instance
            try:
                waiter.dispatch()
            finally:
                self._offered = None
        # Waiters that came while it ran (not offered yet) get their turn next.
        if any(self._fits(self._clients[i]) for i in self._waiting if i in self._clients):
            self._wake_soon()

    def in_use(self) -> dict[tuple[str, int], int]:
        return {key: count for key, count in self._in_use.items() if count}

    def pool_sizes(self) -> dict[tuple[str, int], int]:
        """How many copies of each resource exist: (name, device or GLOBAL) -> count."""
        return dict(self._pools)
