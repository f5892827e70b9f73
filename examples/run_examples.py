"""Run every example client against one dlserve server on examples/models.

    python examples/run_examples.py        (or: make examples)

The server starts with ``exit_on_error=False``: a model whose framework (torch, jax,
tensorflow) is not installed fails to load with a clear reason, and its example is
reported as skipped while the others run. Prints one summary line per example
(ok / skipped: reason / FAILED: error) and exits 1 if any example failed.
"""

from __future__ import annotations

import importlib
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "clients"))

import dlserve  # noqa: E402
from _common import MODELS, Skipped  # noqa: E402

# One client module per example model, each with MODEL and run(server).
CLIENTS = [
    "add_sub_client",
    "identity_client",
    "string_upper_client",
    "auto_complete_client",
    "repeat_client",
    "square_client",
    "bls_sync_client",
    "bls_async_client",
    "bls_decoupled_client",
    "pipeline_client",
    "pytorch_add_sub_client",
    "jax_add_sub_client",
    "tensorflow_add_sub_client",
]


def run_all(server: dlserve.Server) -> list[tuple[str, str]]:
    """(example, outcome) for every client, in order."""
    results = []
    for module_name in CLIENTS:
        example = module_name.removesuffix("_client")
        print(f"--- {example}", flush=True)
        try:
            client = importlib.import_module(module_name)
            example = client.MODEL
            client.run(server)
        except Skipped as exc:
            outcome = f"skipped: {exc}"
        except Exception as exc:  # noqa: BLE001 - every failure is reported, the rest still run
            traceback.print_exc()
            first_line = (str(exc).splitlines() or [""])[0]
            outcome = f"FAILED: {type(exc).__name__}: {first_line}"
        else:
            outcome = "ok"
        results.append((example, outcome))
        print(flush=True)
    return results


def main() -> int:
    started = time.monotonic()
    options = dlserve.Options(model_repository=str(MODELS), exit_on_error=False)
    try:
        server = dlserve.Server(options).start()
    except dlserve.TritonError as exc:
        print(f"FAILED: the server did not start: {exc}")
        return 1
    print(f"server started on {MODELS} in {time.monotonic() - started:.1f}s\n", flush=True)
    try:
        results = run_all(server)
    finally:
        server.stop()

    width = max(len(example) for example, _ in results)
    print("=== summary")
    for example, outcome in results:
        print(f"{example:<{width}}  {outcome}")
    failed = [example for example, outcome in results if outcome.startswith("FAILED")]
    skipped = [example for example, outcome in results if outcome.startswith("skipped")]
    ok = len(results) - len(failed) - len(skipped)
    print(f"{ok} ok, {len(skipped)} skipped, {len(failed)} failed "
          f"({time.monotonic() - started:.1f}s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
