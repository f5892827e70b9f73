"""``dlserve perf``: a perf_analyzer-class benchmark for KServe v2 servers and dlserve in-process.

Modules (each small, each testable alone):

* :mod:`.parser`    -- the ``perf`` subcommand's flags (perf_analyzer's names) on argparse.
* :mod:`.cli`       -- the flags checked together into Settings; the command's entry point.
* :mod:`.flags`     -- the flags' value parsers, and UsageError for values that cannot work.
* :mod:`.sequences` -- sequence models: IDs, lengths and START/END of each request.
* :mod:`.inputs`    -- model metadata -> tensors: zero / random / perf_analyzer JSON data.
* :mod:`.input_dir` -- ``--input-data DIRECTORY``: perf_analyzer's data directory.
* :mod:`.payloads`  -- requests encoded once, up front: HTTP bytes, gRPC bytes, in-process.
* :mod:`.shm`       -- client shared memory (system; CUDA through cupy when present).
* :mod:`.clients`   -- control plane (metadata, statistics, shm registration) and the
  hot-path "slots" (one keep-alive HTTP connection, one gRPC call site or stream, ...);
  :mod:`.clients.h2` is the lean HTTP/2 transport for unary gRPC calls.
* :mod:`.load`      -- closed-loop concurrency and open-loop request rate on asyncio.
* :mod:`.periodic`  -- ``--periodic-concurrency-range``: one run stepping concurrency up.
* :mod:`.workers`   -- ``--processes N``: the same load in N processes, results merged.
* :mod:`.measure`   -- windows, stability, percentiles, server-statistics deltas.
* :mod:`.profile`   -- the sweep: levels, windows until stable, the result per level.
* :mod:`.report`    -- console report, CSV (perf_analyzer's columns), JSON, plot, progress.
* :mod:`.export`    -- ``--profile-export-file``: every measured request, perf_analyzer's format;
  :mod:`.answers` decodes the responses the clients kept for it.
"""

from __future__ import annotations

from dlserve.perf.cli import run
from dlserve.perf.parser import add_parser

__all__ = ["add_parser", "run"]
