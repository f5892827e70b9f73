"""The benchmark: read the model, make the requests, sweep the levels, report.

Per level (a concurrency or a request rate): set the load, discard what ended before,
then measure windows of ``--measurement-interval`` ms -- each with the server's
statistics read at its end, so the window's server numbers are the delta -- until the
last 3 are stable or ``--max-trials`` windows have passed. Like perf_analyzer, the sweep
ends at a level that never became stable or whose latency passed
``--latency-threshold``; that level is shown but left out of the summary and the CSV
(exit status 2 when it was the first level: nothing was measured). With
``--binary-search`` such a level instead sends the search lower (:func:`binary_levels`).
``--periodic-concurrency-range`` makes one run of its own instead (:mod:`dlserve.perf.periodic`),
reported by the profile export alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Generator, Iterator
from typing import Any

from dlserve.errors import TritonError
from dlserve.perf import report
from dlserve.perf.cli import Settings
from dlserve.perf.clients import ControlClient, RequestError, ServerError, control_client
from dlserve.perf.export import ProfileExport
from dlserve.perf.flags import FAILED, UNSTABLE, UsageError
from dlserve.perf.gpu_metrics import MetricsCollector, http_fetcher
from dlserve.perf.inputs import ModelInfo, expected_outputs, make_requests
from dlserve.perf.measure import LevelResult, ServerStats, Window, is_stable, summarize
from dlserve.perf.sequences import check_id_range, stream_lengths
from dlserve.perf.workers import LoadGroup, new_event_loop, split


class Failed(Exception):
    """The benchmark could not go on (exit status 99)."""


def _levels(settings: Settings) -> Iterator[float]:
    if settings.sweep_unbounded:
        start = settings.levels[0]
        return (start + i * settings.sweep_step for i in itertools.count())
    return iter(settings.levels)


def binary_levels(settings: Settings) -> Generator[float, bool, None]:
    """perf_analyzer's --binary-search: START (the search ends if it misses), END (it
    ends if END makes it), then the middle of what is left, moving up from a level that
    made it and down from one that missed, until the range is no wider than STEP. Sent
    whether each level made it (stable, within --latency-threshold)."""
    low, high = settings.levels[0], settings.levels[-1]
    if not (yield low) or (yield high):
        return
    integer = settings.mode == "concurrency"
    while high - low > settings.sweep_step:
        middle = (low + high) // 2 if integer else (low + high) / 2
        if (yield middle):
            low = middle
        else:
            high = middle


class Profiler:
    def __init__(self, settings: Settings, info: ModelInfo, requests: list, control: ControlClient,
                 server_stats: bool, streams: list[int] | None = None, export: ProfileExport | None = None,
                 metrics: MetricsCollector | None = None,
                 expected: list[dict[str, bytes]] | None = None) -> None:
        self.settings = settings
        self.expected = expected  # validation_data's outputs, per request (None: not checked)
        self.metrics = metrics  # --collect-metrics': its reads go to the window they fall in
        self.export = export  # --profile-export-file's: every level's windows go there
        self.info = info
        self.requests = requests
        self.streams = streams
        self.control = control
        self.server_stats = server_stats
        self.progress = report.Progress(settings.progress)
        self.results: list[LevelResult] = []  # the levels measured stable and within the latency limit
        self.unstable = False

    async def _stats(self) -> ServerStats | None:
        if not self.server_stats:
            return None
        try:
            return await asyncio.to_thread(read_statistics, self.control, self.settings)
        except ServerError as exc:
            self.server_stats = False
            print(f"dlserve perf: server statistics stopped working ({exc}); going on without them",
                  file=sys.stderr)
            return None

    def _check(self, group: LoadGroup) -> None:
        if group.error:
            raise Failed(f"a request failed: {group.error}")

    async def run(self) -> list[LevelResult]:
        settings = self.settings
        group = LoadGroup(settings, self.info, self.requests, self.control, self.streams,
                          self.expected)
        try:
            self.progress.update("dlserve perf: connecting and encoding requests", force=True)
            try:
                await group.start()
            except (RequestError, ServerError, RuntimeError) as exc:
                raise Failed(str(exc)) from None
            if settings.warmup_request_count:
                self.progress.update(f"dlserve perf: {settings.warmup_request_count} warm-up requests", force=True)
                concurrency = int(settings.levels[0]) if settings.mode == "concurrency" else 1
                await group.warmup(settings.warmup_request_count, concurrency)
                self._check(group)
            if settings.periodic_range:
                await self._periodic(group)
            elif settings.binary_search:
                search = binary_levels(settings)
                value = next(search)
                try:
                    while True:
                        value = search.send(await self._measured(group, value))
                except StopIteration:
                    pass
            else:  # every level, up to the first that misses
                for value in _levels(settings):
                    if not await self._measured(group, value):
                        break
        finally:
            self.progress.clear()
            await group.stop()
        return self.results

    async def _periodic(self, group: LoadGroup) -> None:
        """The periodic run: its requests go to the export as one experiment, as
        perf_analyzer's do (mode concurrency, value 1: its --concurrency-range default)."""
        start, end, step = self.settings.periodic_range
        self.progress.update(f"dlserve perf: periodic concurrency {start}:{end}:{step}", force=True)
        try:
            window = await group.periodic()
        except RequestError as exc:
            raise Failed(f"a request failed: {exc}") from None
        if self.export is not None:
            self.export.add(self.settings.mode, self.settings.levels[0], [window.logs])
        report.print_out(report.periodic_text(window, self.settings.profile_export_file) + "\n", self.progress)

    async def _measured(self, group: LoadGroup, value: float) -> bool:
        """Measure and report one level; whether it made it (stable, within the latency
        limit), kept for the summary if it did."""
        settings = self.settings
        result = await self._level(group, value)
        report.print_out(report.level_text(result, settings.protocol, header=False) + "\n", self.progress)
        warning = report.delayed_warning(result)
        if warning:
            print(warning, file=sys.stderr)
        if not result.stable:
            self.unstable = True
            return False
        threshold = settings.latency_threshold_ms
        if threshold and result.latency_us > threshold * 1000:
            report.print_out(f"Measured latency went over the set limit of {threshold} msec.\n", self.progress)
            return False
        self.results.append(result)
        return True

    async def _level(self, group: LoadGroup, value: float) -> LevelResult:
        settings = self.settings
        mode = settings.mode
        label = "concurrency" if mode == "concurrency" else "request rate"
        shown = report.level_label(mode, value)
        report.print_out(report.level_header(mode, value) + "\n", self.progress)
        counted = settings.request_count > 0  # (its one window holds every request: it opens first)
        if not counted:
            await group.set_level(mode, value)
            self._check(group)
        await group.collect()  # what ended before this level's load was set
        if self.metrics is not None:
            self.metrics.take()
        before = await self._stats()
        if counted:
            await group.set_level(mode, value)
            self._check(group)
        windows: list[Window] = []
        stable = False
        interval = settings.measurement_interval_ms / 1000
        for trial in range(1, settings.max_trials + 1):
            end = time.monotonic() + interval
            last = (
                f", last window {report.pa_number(windows[-1].throughput)} infer/sec"
                f" {int(windows[-1].latency_ns(settings.percentile) / 1000)} usec"
                if windows and self.progress.enabled else ""
            )
            if settings.count_windows:
                await self._count_window(group, settings.count_windows, f"{label} {shown}", trial, last)
            else:
                while True:
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    self._check(group)
                    self.progress.update(
                        f"dlserve perf: {label} {shown} | window {trial}/{settings.max_trials} "
                        f"| {interval - left:.1f}/{interval:.1f} s{last}"
                    )
                    await asyncio.sleep(min(left, 0.1) if self.progress.enabled else left)
            client = await group.collect()
            self._check(group)
            after = await self._stats()
            server = after - before if after is not None and before is not None else None
            before = after
            gpu = self.metrics.take() if self.metrics is not None else None
            window = Window(client, server, settings.batch_size, gpu)
            windows.append(window)
            if settings.verbose:
                latencies = client.latencies_ns
                avg, std = (latencies.mean() / 1000, latencies.std() / 1000) if client.count else (0, 0)
                report.print_out(report.pass_text(trial, window.throughput, avg, std) + "\n", self.progress)
            stable = counted or is_stable(windows, settings.stability_percentage,
                                          settings.percentile, settings.throughput_only)
            if stable:
                break
        if self.export is not None:
            self.export.add(mode, value, [window.client.logs for window in windows])
        if not stable:
            self.progress.clear()
            print(
                f"dlserve perf: failed to obtain stable measurement within {settings.max_trials} measurement "
                f"windows for {label} {shown}. Please try to increase the --measurement-interval.",
                file=sys.stderr,
            )
        return summarize(mode, value, windows, stable, settings.percentile, self.info.decoupled, self.info.sequence)


    async def _count_window(self, group: LoadGroup, requests: int, level: str, trial: int, last: str) -> None:
        """A count_windows window: until ``requests`` requests ended."""
        while (ended := await group.ended()) < requests:
            self._check(group)
            self.progress.update(
                f"dlserve perf: {level} | window {trial}/{self.settings.max_trials} | {ended}/{requests} requests{last}"
            )
            await asyncio.sleep(0.01)


def _for_sequences(settings: Settings) -> Settings:
    """The settings for a sequence model, checked: as in perf_analyzer, a level is stable
    when its throughput is unless --sync says otherwise."""
    if settings.sweep_unbounded:
        raise UsageError("--concurrency-range with end 0 cannot be used for a sequence model")
    if settings.periodic_range:
        raise UsageError("--periodic-concurrency-range cannot be used for a sequence model")
    if settings.mode == "concurrency":
        most = int(max(settings.levels))
    else:
        most = settings.num_sequences
        if most < settings.processes:
            raise UsageError(f"--num-of-sequences {most} is fewer than --processes {settings.processes}: "
                             "each process keeps sequences of its own going")
    check_id_range(settings, [int(n) for n in split(most, settings.processes, integer=True)])
    return dataclasses.replace(settings, throughput_only=settings.throughput_only or not settings.sync)


def read_statistics(control: ControlClient, settings: Settings) -> ServerStats | None:
    """The model's statistics now, with its composing models' (each asked for in turn);
    None when the server does not list the model."""
    stats = ServerStats.from_json(control.statistics(settings.model, settings.version), settings.model,
                                  settings.version)
    if stats is None:
        return None
    for name, version in settings.bls_composing_models:
        composing = ServerStats.from_json(control.statistics(name, version), name, version)
        if composing is None:
            raise ServerError(f"the server has no statistics for composing model '{name}'")
        stats.composing[(name, version)] = composing
    return stats


def _probe_statistics(control: ControlClient, settings: Settings) -> bool:
    try:
        return read_statistics(control, settings) is not None
    except ServerError as exc:
        if settings.bls_composing_models:  # (asked for by name: a mistake to say, not to hide)
            raise UsageError(f"--bls-composing-models: {exc}") from None
        return False


def benchmark(settings: Settings, server: Any = None,
              export: ProfileExport | None = None) -> tuple[list[LevelResult], bool, bool]:
    """Run the whole benchmark (prints the console report); the levels to report, whether
    the server's statistics were available, and whether the sweep ended on a level that
    never became stable. ``export`` gathers every request measured."""
    control = control_client(settings, server)
    metrics: MetricsCollector | None = None
    try:
        info = control.model_info(settings.model, settings.version)
        if info.decoupled and not settings.streaming:
            raise UsageError(
                f"model '{settings.model}' is decoupled: benchmark it with -i grpc --streaming"
            )
        requests = make_requests(
            info, settings.batch_size, settings.shapes, settings.input_data,
            settings.string_length, settings.string_data,
        )
        expected = expected_outputs(info, settings.batch_size, settings.input_data)
        if expected is not None and settings.shared_memory == "cuda":
            raise UsageError("validation_data cannot be checked with --shared-memory cuda "
                             "(the outputs stay on the device); use system or none")
        streams = None
        if info.sequence:
            settings, streams = _for_sequences(settings), stream_lengths(settings.input_data)
        server_stats = _probe_statistics(control, settings)
        report.print_out(report.settings_text(settings, server_stats) + "\n")
        if export is not None:
            export.model(info, requests)
        metrics = _metrics_collector(settings, server)
        profiler = Profiler(settings, info, requests, control, server_stats, streams, export, metrics,
                            expected)
        if metrics is not None:
            metrics.start()
        loop = new_event_loop()
        task = loop.create_task(profiler.run())

        def interrupted() -> None:
            """The first Ctrl-C: the run stops and cleans up (shm, workers), which waits on the
            server; a second ends the command at once, as perf_analyzer's does."""
            task.cancel()
            loop.remove_signal_handler(signal.SIGINT)
            signal.signal(signal.SIGINT, _exit_at_once)

        try:
            loop.add_signal_handler(signal.SIGINT, interrupted)
        except (NotImplementedError, RuntimeError, ValueError):
            pass
        try:
            results = loop.run_until_complete(task)
        except asyncio.CancelledError:
            raise KeyboardInterrupt from None
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
        return results, profiler.server_stats, profiler.unstable
    finally:
        if metrics is not None:
            metrics.stop()
        control.close()


def _exit_at_once(signum: int, frame: Any) -> None:
    print("dlserve perf: interrupted again: exiting without cleaning up", file=sys.stderr)
    sys.stderr.flush()
    sys.stdout.flush()
    for worker in multiprocessing.active_children():  # (--processes': they wait on the server too)
        worker.kill()
    inprocess = sys.modules.get("dlserve.engine.server")  # (loaded if -i inprocess runs one)
    if inprocess is not None:
        inprocess.kill_live_servers()  # its workers and segments (os._exit skips atexit)
    os._exit(130)  # (the resource tracker still unlinks the client's shm segments)


def _metrics_collector(settings: Settings, server: Any) -> MetricsCollector | None:
    """--collect-metrics' reader: of the in-process server's metrics, or over HTTP."""
    if not settings.collect_metrics:
        return None
    if server is not None:
        fetch, where = server.metrics, "(in-process)"
    else:
        fetch, where = http_fetcher(settings.metrics_url), settings.metrics_url
    return MetricsCollector(fetch, settings.metrics_interval_ms / 1000, where)


def main(settings: Settings) -> int:
    server = None
    export = ProfileExport(settings) if settings.profile_export_file else None
    try:
        if settings.protocol == "inprocess":
            from dlserve.perf.clients.inprocess import start_server

            # (the models it calls too, when it says which)
            server = start_server(
                settings.model_repository, [settings.model, *(name for name, _ in settings.bls_composing_models)]
            )
        results, server_stats, unstable = benchmark(settings, server, export)
    except UsageError as exc:
        print(f"dlserve perf: error: {exc}", file=sys.stderr)
        return FAILED
    except (Failed, ServerError, RequestError) as exc:
        print(f"dlserve perf: {exc}", file=sys.stderr)
        return FAILED
    except KeyboardInterrupt:
        print("dlserve perf: interrupted", file=sys.stderr)
        return 130
    finally:
        if server is not None:
            try:
                server.stop()
            except TritonError as exc:  # (requests still in flight at its exit timeout were dropped)
                print(f"dlserve perf: {exc}", file=sys.stderr)
    if unstable:
        print("Failed to obtain stable measurement.", file=sys.stderr)  # (perf_analyzer's words)
    if not results and unstable:
        return UNSTABLE  # nothing measured (no summary, no files): try again
    if not settings.periodic_range:  # (its one run has no levels to sum up)
        report.print_out(report.summary_text(results, settings.percentile))
    if settings.csv_file:
        report.write_csv(settings.csv_file, results, settings.mode, server_stats, settings.verbose_csv)
    if settings.json_file:
        report.write_json(settings.json_file, settings, results, server_stats)
    if settings.plot_file:
        report.write_plot(settings.plot_file, settings, results)
    if export is not None:
        export.write()
    return 0
