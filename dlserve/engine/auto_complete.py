"""A model's ``auto_complete_config``, run at its load in a throwaway worker."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from dlserve.engine import config as cfg
from dlserve.engine import config_forms
from dlserve.engine.backends import code_paths
from dlserve.engine.model import EngineResources, ModelVersion
from dlserve.engine.proto import model_config_pb2 as mc
from dlserve.errors import InternalError, TritonError
from dlserve.ipc.channel import WorkerGoneError
from dlserve.ipc.protocol import Kind
from dlserve.ipc.supervisor import WorkerProcess


async def run_auto_complete(
    resources: EngineResources,
    starting: set[ModelVersion | WorkerProcess],
    name: str,
    config: mc.ModelConfig,
    model_path: Path,
    code_file: Path,
) -> mc.ModelConfig:
    """Run ``auto_complete_config`` of ``code_file`` (the model's own ``model_path``,
    or its Python-based backend's file) in a throwaway worker, as Triton does; the
    worker is in ``starting`` (what the loads are starting) while it runs."""
    environment = await resources.environments.for_model(
        *cfg.environment_parameters(config), model_path.parent.parent, name
    )
    worker = WorkerProcess(
        instance_name=f"{name}_auto_complete",
        segment_prefix=f"{resources.segment_prefix}_a{resources.next_serial()}",
        arena_bytes=1 << 16,
        space=resources.space,
        arena=resources.arena,
        on_message=lambda message: None,
        on_exit=lambda description: None,
        environment=environment,
    )
    await worker.start()
    starting.add(worker)
    try:
        result = await asyncio.wait_for(
            worker.request(
                Kind.AUTO_COMPLETE,
                {
                    **code_paths(code_file, model_path),
                    "config": json.dumps(config_forms.to_json(config)),
                },
            ),
            resources.load_timeout or None,
        )
    except asyncio.TimeoutError:
        code_dirs = [str(model_path.parent.parent), str(code_file.parent)]
        what = f"auto_complete_config of model '{name}'"
        raise await worker.end_stuck(what, resources.load_timeout, code_dirs) from None
    except WorkerGoneError:  # it died before it could answer: how, and its last output
        reason = await worker.death_reason()
        raise InternalError(f"auto_complete_config of model '{name}' failed: {reason}") from None
    except TritonError as exc:
        raise type(exc)(f"auto_complete_config of model '{name}' failed: {exc.message}") from None
    finally:
        starting.discard(worker)
        await worker.stop(time.monotonic() + 5.0, finalize=False)
    return config_forms.parse_json(result, name, source="invalid config from auto_complete_config")
