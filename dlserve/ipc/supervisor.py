"""Starting, watching and stopping one worker process, from the server's event loop.

A :class:`WorkerProcess` spawns the stub (``python -m dlserve.ipc.stub``, in the server's
Python or the model's execution environment: :mod:`dlserve.ipc.environments`) with one end
of a socket pair, wraps the other in a :class:`ServerChannel`, and learns of the
worker's death two ways at once: end of file on the channel (in-flight requests
fail immediately) and a pidfd that becomes readable when the process exits (for
its exit status). When it is gone, every segment it owned is unlinked — a worker
killed with SIGKILL cannot clean up after itself.

The worker's stderr passes through the server (:class:`WorkerOutput`), which keeps its
last lines: a worker that dies in ``initialize`` (a segfault in an extension, an
import that kills the process) fails the load with what it last printed, faulthandler's
Python traceback included, instead of only "killed by SIGSEGV".
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import logging
import os
import select
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

from dlserve.errors import InternalError, TritonError
from dlserve.ipc.channel import ReplyCallback, ServerChannel, WorkerGoneError
from dlserve.ipc.environments import SERVER_PYTHON, ExecutionEnvironment
from dlserve.ipc.polling import PollerBoard, loop_poller
from dlserve.ipc.protocol import STACKS_SIGNAL, Kind, Message
from dlserve.ipc.stacks import DUMP_END, THREADS_LEFT_OUT, model_frames
from dlserve.ipc.tensors import Peer
from dlserve.memory.arena import Arena, MemorySpace
from dlserve.memory.cuda_regions import IpcTable
from dlserve.memory.shm import SHM_DIR

log = logging.getLogger("dlserve.worker")

EXIT_GRACE_S = 2.0
# A worker that closed its channel has this long to exit before it is ended (one that
# died is reaped well within it).
_LINGER_AFTER_EOF = 0.5


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "is still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


def unlink_segments(prefix: str) -> None:
    """Remove every /dev/shm segment whose name starts with ``prefix``."""
    for path in glob.glob(os.path.join(SHM_DIR, glob.escape(prefix)) + "*"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class WorkerOutput:
    """A worker's stderr, copied to the server's as it comes, its last few KiB kept.

    The copying runs on a thread of its own, so a model that prints a lot costs the
    event loop nothing. It ends at the pipe's end, or once the worker is gone
    (:meth:`close`) with what was already written copied: a process the model started
    may hold the pipe open long after.
    """

    KEEP_BYTES = 16384  # (room for a stack dump: end_stuck)
    LINES = 30

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._wake_read, self._wake = os.pipe()  # written by close()
        self._tail = bytearray()
        self.received = 0  # bytes copied so far
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._copy, name="worker-stderr", daemon=True)
        try:
            self._thread.start()
        except BaseException:
            os.close(self._wake_read)
            os.close(self._wake)
            raise

    def _copy(self) -> None:
        closing = False
        # poll, not select: a busy server's descriptors pass select's limit of 1024.
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        poller.register(self._wake_read, select.POLLIN)
        try:
            while True:
                ready = {fd for fd, _ in poller.poll(0 if closing else None)}
                if self._wake_read in ready:
                    closing = True
                if self._fd not in ready:  # (readable, or at its end: the read says which)
                    if closing:
                        return  # all that was written is copied
                    continue
                chunk = os.read(self._fd, 1 << 16)
                if not chunk:
                    return
                with self._lock:
                    self._tail += chunk
                    del self._tail[: -self.KEEP_BYTES]
                    self.received += len(chunk)
                view = memoryview(chunk)
                with contextlib.suppress(OSError):  # the server's own stderr may be gone
                    while view:
                        view = view[os.write(2, view) :]
        except OSError:
            pass
        finally:
            os.close(self._fd)
            os.close(self._wake_read)

    def close(self, wait: float = 0.0) -> None:
        """Stop copying once what is there now is copied; wait up to ``wait`` seconds."""
        if self._wake >= 0:
            with contextlib.suppress(OSError):
                os.write(self._wake, b"x")
            os.close(self._wake)
            self._wake = -1
        self._thread.join(wait)

    def last_lines(self) -> str:
        """The last lines the worker wrote (call after :meth:`close`)."""
        with self._lock:
            text = self._tail.decode(errors="replace")
        return "\n".join(text.strip().splitlines()[-self.LINES :])

    def since(self, mark: int) -> str:
        """What the worker wrote after :attr:`received` was ``mark`` (of it, what is kept)."""
        with self._lock:
            kept = min(self.received - mark, len(self._tail))
            return self._tail[len(self._tail) - kept :].decode(errors="replace")


class WorkerProcess:
    """One running worker; ``on_exit(description)`` fires once when it dies unexpectedly,
    ``on_end()`` once when it has ended, for whatever reason."""

    def __init__(
        self,
        *,
        instance_name: str,
        segment_prefix: str,
        arena_bytes: int,
        space: MemorySpace,
        arena: Arena,
        on_message: Callable[[Message], None],
        cuda: IpcTable | None = None,
        on_exit: Callable[[str], None],
        environment: ExecutionEnvironment | None = None,
        poll_us: int = 0,
        arena_growth_bytes: int | None = None,
        on_segments_gone: Callable[[list[str]], None] = lambda names: None,
        on_end: Callable[[], None] = lambda: None,
    ) -> None:
        """``on_segments_gone(names)``: segments of the worker's that it unlinked (or
        that went with it), which other processes may have mapped."""
        self.instance_name = instance_name
        self.segment_prefix = segment_prefix
        self._arena_bytes = arena_bytes
        self._arena_growth_bytes = arena_growth_bytes or arena_bytes
        self._space = space
        self._arena = arena
        self._cuda = cuda
        self._on_message = on_message
        self._on_exit = on_exit
        self._on_segments_gone = on_segments_gone
        self._on_end = on_end
        self._environment = environment
        self._poll_us = poll_us  # the most either end polls before it sleeps (ipc.polling)
        self._board: PollerBoard | None = None  # the server loop's (ipc.polling)
        self._board_slot: int | None = None  # the worker's on it
        self.process: subprocess.Popen[bytes] | None = None
        self.channel: ServerChannel | None = None
        self.peer: Peer | None = None
        self._stopping = False
        self._exited = asyncio.Event()
        self._output: WorkerOutput | None = None
        self.exit_description = ""
        self.last_output = ""  # what it last wrote to stderr, once it died

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def alive(self) -> bool:
        return self.channel is not None and self.channel.connected and not self._exited.is_set()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        python, env = (self._environment or SERVER_PYTHON).launch(dict(os.environ))
        # The worker marks when it polls on the board of the loop it talks to.
        board = self._board = loop_poller(loop).board
        self._board_slot = board.claim() if self._poll_us else None
        polling, fds = [], [theirs.fileno()]
        if self._board_slot is not None:
            polling = ["--poll-board", str(board.fileno()), "--poll-slot", str(self._board_slot)]
            fds.append(board.fileno())
        output, stderr = os.pipe()
        # Blocked until the worker has its handler (dump_stacks): a worker asked for its
        # stacks as it starts would otherwise die of the signal's default action.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {STACKS_SIGNAL})
        try:
            self.process = subprocess.Popen(
                [
                    *python,
                    "--fd",
                    str(theirs.fileno()),
                    "--segment-prefix",
                    self.segment_prefix,
                    "--arena-bytes",
                    str(self._arena_bytes),
                    "--arena-growth-bytes",
                    str(self._arena_growth_bytes),
                    "--instance-name",
                    self.instance_name,
                    "--poll-us",
                    str(self._poll_us),
                    *polling,
                ],
                pass_fds=fds,
                env=env,
                close_fds=True,
                stderr=stderr,
            )
        except BaseException:
            self._free_board_slot()
            os.close(output)
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            theirs.close()
            os.close(stderr)
        try:
            self._output = WorkerOutput(output)
        except BaseException:  # (no thread to be had): a worker nobody can watch goes at once
            os.close(output)
            ours.close()
            self.kill()
            raise
        # Reaped from now on, whatever happens next: stop() and kill() wait for it.
        try:
            pidfd = os.pidfd_open(self.process.pid)
        except OSError:  # (out of descriptors): a worker nobody can watch goes at once
            ours.close()
            self.kill()
            raise
        loop.add_reader(pidfd, self._reaped, pidfd)
        try:
            _, channel = await loop.create_unix_connection(
                lambda: ServerChannel(self._on_message, self._lost, self._poll_us / 1e6), sock=ours
            )
        except BaseException:  # cancelled, or no channel: a worker nobody can talk to goes
            ours.close()
            self._stopping = True
            self.process.kill()
            raise
        self.channel = channel
        self.peer = Peer(
            self._space, self._arena, channel.queue_releases, cuda=self._cuda, settle_device=True
        )
        channel.on_release = self.peer.release
        channel.on_retire = self._retired

    def _retired(self, names: list[str]) -> None:
        for name in names:
            self._space.forget_segment(name)
        self._on_segments_gone(names)

    def _lost(self) -> None:
        """Channel EOF: the worker died or closed its end. One that closed it and lives
        on (its serve loop ended, a thread of the model's holding the process) serves
        nothing more: it is ended, so that it is reaped and restarted as a dead one is."""
        if self.peer is not None:
            self.peer.close()
        if not self._stopping:
            asyncio.get_running_loop().call_later(_LINGER_AFTER_EOF, self._end_if_alive)

    def _end_if_alive(self) -> None:
        if self._stopping or self.process is None or self.process.poll() is not None:
            return
        log.warning(
            "model instance '%s': its worker closed its channel but did not exit; ending it",
            self.instance_name,
        )
        self.process.kill()

    def _reaped(self, pidfd: int) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(pidfd)
        os.close(pidfd)
        assert self.process is not None
        self.process.wait()
        # (Triton's words first, which log scrapers and its QA tests look for, then how)
        self.exit_description = (
            f"Stub process '{self.instance_name}' is not healthy: its worker process "
            f"{describe_exit(self.process.returncode)}"
        )
        if self._output is not None:
            # The pipe is drained at once (the process is gone): a short wait at most.
            self._output.close(wait=0.0 if self._stopping else 0.2)
            if not self._stopping:
                self.last_output = self._output.last_lines()
        if self.channel is not None:
            self.channel.close()
        if self.peer is not None:
            self.peer.close()
        gone = self._space.forget_segments(self.segment_prefix)
        unlink_segments(self.segment_prefix)
        if gone:
            self._on_segments_gone(gone)
        self._free_board_slot()
        self._exited.set()
        self._on_end()
        if not self._stopping:
            log.error("%s%s", self.exit_description, self.last_words())
            self._on_exit(self.exit_description)

    def last_words(self) -> str:
        """``"; its last output: ..."`` for a worker that died having written something."""
        return f"; its last output:\n{self.last_output}" if self.last_output else ""

    def call(self, kind: int, body: Any, on_reply: ReplyCallback) -> None:
        """Send a request; ``on_reply`` gets the reply (or the worker's error) as it is
        read (ServerChannel.call). Raises WorkerGoneError at once for a worker not running."""
        self._channel_or_gone().call(kind, body, on_reply)

    async def request(self, kind: int, body: Any) -> Any:
        return await self._channel_or_gone().request(kind, body)

    def _channel_or_gone(self) -> ServerChannel:
        if self.channel is None or not self.alive:
            # (its end seen before its exit: no exit status yet)
            unhealthy = f"Stub process '{self.instance_name}' is not healthy"
            raise WorkerGoneError(
                self.exit_description or f"{unhealthy}: its worker process is not running"
            )
        return self.channel

    async def wait_exited(self) -> None:
        await self._exited.wait()

    async def death_reason(self) -> str:
        """Why a worker that dropped its channel is gone: its exit status and its last
        output (an import that failed before it could answer, say), once it is reaped."""
        await self.wait_exited()
        return self.exit_description + self.last_words()

    async def stop(self, deadline: float, finalize: bool = True) -> bool:
        """Ask the model to finalize, then make sure the process is gone, all by
        ``deadline`` (``time.monotonic()``); a worker still busy then is killed. Whether
        it ended by itself (False: killed)."""
        self._stopping = True
        if self.process is None:
            return True
        finalized = not finalize
        if finalize and self.alive:
            try:
                await asyncio.wait_for(self.request(Kind.FINALIZE, None), _left(deadline))
                finalized = True
            except WorkerGoneError:
                pass  # (its end is told where it is noticed)
            except TritonError as exc:  # the model's finalize() raised; it exits all the same
                log.error("model instance '%s': finalize() failed: %s", self.instance_name, exc.message)
            except Exception:  # noqa: BLE001 - still busy at the deadline (or going away): killed below
                pass
        if self.channel is not None:
            self.channel.close()
        # A finalized worker is just exiting: give it a moment even past the deadline.
        grace = max(_left(deadline), EXIT_GRACE_S) if finalized else _left(deadline)
        try:
            await asyncio.wait_for(self._exited.wait(), grace)
            return True
        except asyncio.TimeoutError:
            log.warning("worker '%s' still running at shutdown; killing it", self.instance_name)
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            await self._exited.wait()
            return False

    async def dump_stacks(self) -> str:
        """Have the worker write every Python thread's stack to its stderr (which the
        server's passes on); returns the dump once it is written ("" from a worker gone)."""
        output, process = self._output, self.process
        if output is None or process is None or process.poll() is not None:
            return ""
        mark = output.received
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, STACKS_SIGNAL)
        # Written at once from a signal handler, copied by the output's thread, ended by
        # the main thread's outermost frame (a worker stuck too deep to dump: 1 s).
        deadline = time.monotonic() + 1.0
        while not DUMP_END.search(output.since(mark)) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return output.since(mark)

    async def end_stuck(self, what: str, timeout: float, code_dirs: list[str]) -> InternalError:
        """End a worker that did not finish ``what`` within ``timeout`` seconds; the error
        says where the model's code (under ``code_dirs``) was, from the worker's dump of
        every thread (:meth:`dump_stacks`). A worker that died meanwhile: how it died."""
        if self.process is not None and self.process.poll() is not None:
            return InternalError(await self.death_reason())
        try:
            dump = await self.dump_stacks()
        finally:  # (cancelled too: a stuck worker is not left running)
            self._stopping = True
            if self.process is not None:
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
        await self._exited.wait()
        message = (
            f"{what} did not finish within {timeout:g} s (the model load timeout), so its "
            "worker was ended; "
        )
        frames = model_frames(dump, code_dirs)
        if THREADS_LEFT_OUT.search(dump):  # (what is there may be a thread of the model's)
            message += "it has over 100 threads, and its stacks in the log leave out the oldest"
        elif frames:
            message += "it was at (most recent call first):\n" + "\n".join(frames)
        elif dump.strip():  # (an async hook awaiting something is on no thread's stack)
            message += "no thread was in the model's code (every thread's stack is in the log)"
        else:
            message += "it wrote no stacks (its Python still starting, or stuck below it)"
        return InternalError(message)

    def kill(self) -> None:
        """Hard stop (used when the event loop is going away)."""
        self._stopping = True
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        unlink_segments(self.segment_prefix)
        self._free_board_slot()
        if self._output is not None:
            self._output.close()
        self._exited.set()

    def _free_board_slot(self) -> None:
        if self._board is not None:
            self._board.free(self._board_slot)
        self._board_slot = None
