"""``--processes N``: the load spread over N worker processes, windows merged.

With one process the :class:`LoadGenerator` runs on the coordinator's own loop. With N,
each worker process (spawned: no inherited gRPC or event-loop state) runs its own
generator on its own uvloop and obeys commands on a pipe; the coordinator splits the
concurrency (or the rate) between them, and at each window boundary asks every worker
for its window and merges them.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import signal
from typing import Any

from dlserve.perf.answers import Validator, decoder
from dlserve.perf.clients import ControlClient, control_client, data_plane
from dlserve.perf.load import LoadGenerator
from dlserve.perf.measure import ClientWindow
from dlserve.perf.periodic import PeriodicLoad
from dlserve.perf.sequences import SequenceMaker


def split(total: float, parts: int, integer: bool) -> list[float]:
    """``total`` over ``parts`` workers (integers: the remainder to the first ones)."""
    if integer:
        base, extra = divmod(int(total), parts)
        return [base + (1 if i < extra else 0) for i in range(parts)]
    return [total / parts] * parts


def make_generator(settings: Any, info: Any, requests: list, control: ControlClient,
                   streams: list[int] | None, part: int, parts: int,
                   expected: list[dict[str, bytes]] | None = None) -> LoadGenerator:
    """Process ``part`` of ``parts``'s generator (its own sequence IDs, its share of
    --num-of-sequences); ``expected``: validation_data's outputs, per request."""
    maker = SequenceMaker(settings, streams, part, parts, seed=part) if info.sequence else None
    plane = data_plane(settings, info, requests, control)
    validator = None
    if expected is not None:
        plane.separate_outputs = True
        validator = Validator(expected, decoder(settings.protocol, settings.streaming), plane)
    return LoadGenerator(
        plane, settings.max_threads, maker,
        int(split(settings.num_sequences, parts, integer=True)[part]), settings.serial_sequences,
        settings.request_intervals_us, log=settings.profile_export_file is not None,
        validator=validator,
    )


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LocalLoad:
    """The generator on this loop."""

    def __init__(self, generator: LoadGenerator) -> None:
        self.generator = generator

    @property
    def error(self) -> str | None:
        return self.generator.error

    async def start(self) -> None:
        await self.generator.start()

    async def set_level(self, mode: str, value: float, distribution: str,
                        budget: int | None) -> None:
        self.generator.budget = budget
        if mode == "concurrency":
            await self.generator.set_concurrency(int(value))
        else:
            await self.generator.set_rate(value, distribution)

    async def warmup(self, requests: int, concurrency: int) -> None:
        await self.generator.warmup(requests, concurrency)

    async def collect(self) -> ClientWindow:
        return self.generator.collect()

    async def ended(self) -> int:
        return self.generator.ended

    async def stop(self) -> None:
        await self.generator.stop()


class RemoteLoad:
    """A worker process running a :class:`LoadGenerator`; commands over a pipe."""

    def __init__(self, settings: Any, info: Any, requests: list, streams: list[int] | None, part: int,
                 expected: list[dict[str, bytes]] | None) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=worker_main, args=(child, settings, info, requests, streams, part, expected),
            daemon=True, name="dlserve-perf-worker",
        )
        self.process.start()
        child.close()
        self.error: str | None = None
        self._lock = asyncio.Lock()

    async def _ask(self, command: str, argument: Any = None, timeout: float = 120) -> Any:
        async with self._lock:
            self.conn.send((command, argument))
            ready = await asyncio.to_thread(self.conn.poll, timeout)
            if not ready:
                raise RuntimeError(f"worker process {self.process.pid} did not answer '{command}'")
            try:
                status, value, error = self.conn.recv()
            except EOFError:
                raise RuntimeError(f"worker process {self.process.pid} exited") from None
        if error and self.error is None:
            self.error = error
        if status != "ok":
            raise RuntimeError(value)
        return value

    async def start(self) -> None:
        await self._ask("start")

    async def set_level(self, mode: str, value: float, distribution: str,
                        budget: int | None) -> None:
        await self._ask("level", (mode, value, distribution, budget))

    async def warmup(self, requests: int, concurrency: int) -> None:
        await self._ask("warmup", (requests, concurrency), timeout=600)

    async def collect(self) -> ClientWindow:
        return await self._ask("collect")

    async def ended(self) -> int:
        return int(await self._ask("ended"))

    async def stop(self) -> None:
        if self.process.is_alive():
            try:
                await self._ask("stop", timeout=30)
            except (RuntimeError, OSError, EOFError):
                pass
        await asyncio.to_thread(self.process.join, 10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


def worker_main(conn: Any, settings: Any, info: Any, requests: list, streams: list[int] | None, part: int,
                expected: list[dict[str, bytes]] | None) -> None:
    """Entry point of a worker process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the coordinator decides when to stop
    loop = new_event_loop()
    try:
        loop.run_until_complete(_serve(conn, settings, info, requests, streams, part, expected))
    finally:
        loop.close()
        conn.close()


async def _serve(conn: Any, settings: Any, info: Any, requests: list, streams: list[int] | None, part: int,
                 expected: list[dict[str, bytes]] | None) -> None:
    control = control_client(settings)
    generator = make_generator(settings, info, requests, control, streams, part, settings.processes,
                               expected)
    loop = asyncio.get_running_loop()
    commands: asyncio.Queue[Any] = asyncio.Queue()

    def readable() -> None:
        try:
            commands.put_nowait(conn.recv())
        except (EOFError, OSError):
            loop.remove_reader(conn.fileno())
            commands.put_nowait(("stop", None))

    loop.add_reader(conn.fileno(), readable)
    started = False
    try:
        while True:
            command, argument = await commands.get()
            try:
                value: Any = None
                if command == "start":
                    await generator.start()
                    started = True
                elif command == "level":
                    mode, level, distribution, generator.budget = argument
                    if mode == "concurrency":
                        await generator.set_concurrency(int(level))
                    else:
                        await generator.set_rate(level, distribution)
                elif command == "warmup":
                    await generator.warmup(*argument)
                elif command == "collect":
                    value = generator.collect()
                elif command == "ended":
                    value = generator.ended
                elif command == "stop":
                    break
                reply = ("ok", value, generator.error)
            except Exception as exc:  # noqa: BLE001 - reported to the coordinator
                reply = ("error", f"{type(exc).__name__}: {exc}" if not str(exc) else str(exc), generator.error)
            try:
                conn.send(reply)
            except (OSError, EOFError):
                break
    finally:
        loop.remove_reader(conn.fileno())
        if started:
            await generator.stop()
        else:
            await generator.plane.close()
        control.close()
        try:
            conn.send(("ok", None, generator.error))
        except (OSError, EOFError):
            pass


class LoadGroup:
    """The loads of this run (one local, or N remote), driven together."""

    def __init__(self, settings: Any, info: Any, requests: list, control: ControlClient,
                 streams: list[int] | None = None,
                 expected: list[dict[str, bytes]] | None = None) -> None:
        self.settings = settings
        if settings.processes == 1:
            self.loads: list[Any] = [
                LocalLoad(
                    make_generator(settings, info, requests, control, streams, 0, 1, expected)
                )
            ]
        else:
            self.loads = [
                RemoteLoad(settings, info, requests, streams, k, expected)
                for k in range(settings.processes)
            ]

    @property
    def error(self) -> str | None:
        for load in self.loads:
            if load.error:
                return load.error
        return None

    async def start(self) -> None:
        await asyncio.gather(*(load.start() for load in self.loads))

    async def set_level(self, mode: str, value: float) -> None:
        shares = split(value, len(self.loads), integer=mode == "concurrency")
        budgets: list[int | None] = [None] * len(shares)
        total = self.settings.request_count
        if total:  # (in proportion to each load's share; the remainder to the first, the largest)
            budgets = [int(total * share // sum(shares)) for share in shares]
            budgets[0] += total - sum(budgets)
        await asyncio.gather(*(
            load.set_level(mode, share, self.settings.distribution, budget)
            for load, share, budget in zip(self.loads, shares, budgets)
        ))

    async def warmup(self, requests: int, concurrency: int) -> None:
        counts = split(requests, len(self.loads), integer=True)
        shares = split(max(concurrency, len(self.loads)), len(self.loads), integer=True)
        await asyncio.gather(*(
            load.warmup(int(count), int(share)) for load, count, share in zip(self.loads, counts, shares)
        ))

    async def periodic(self) -> ClientWindow:
        """--periodic-concurrency-range's run (in this process: --processes is 1 there)."""
        (load,) = self.loads
        return await PeriodicLoad(load.generator, self.settings.periodic_range, self.settings.request_period).run()

    async def ended(self) -> int:
        """Requests that ended in the window so far (count_windows mode)."""
        return sum(await asyncio.gather(*(load.ended() for load in self.loads)))

    async def collect(self) -> ClientWindow:
        parts = await asyncio.gather(*(load.collect() for load in self.loads))
        if len(parts) == 1:
            return parts[0]
        duration = int(sum(p.duration_ns for p in parts) / len(parts))
        return ClientWindow.merge_processes(list(parts), duration)

    async def stop(self) -> None:
        await asyncio.gather(*(load.stop() for load in self.loads), return_exceptions=True)
