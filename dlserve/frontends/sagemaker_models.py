"""Amazon SageMaker multi-model endpoints over the engine, as Triton 2.51's SageMaker
frontend serves them (measured): SageMaker unpacks each model's archive under
``/opt/ml/models/<hash>/model`` and then drives the container through ``/models``.

- ``POST /models`` with ``{"model_name": NAME, "url": PATH}`` loads a model. PATH is a
  model folder (it holds ``config.pbtxt``), registered through its parent folder, or a
  folder of model folders, registered itself, of which the ensemble (or the only
  folder) is the one served. The model is served as the target model
  (``X-Amzn-SageMaker-Target-Model``, else NAME): its repository is registered with
  that folder renamed, then the model is loaded. 200 (empty); 409 when the repository
  or the name is taken, or when a model of the archive has the name of another
  archive's target or the reverse (archives may share step names, not the names they
  are served by); 400 with ``{"error": ...}`` otherwise, or 507 where the error reads
  as running out of memory (SageMaker then unloads models to make room).
- ``GET /models`` lists the ready ones as ``{"models": [{"modelName", "modelUrl"}]}``
  (modelUrl: the repository registered); ``GET /models/NAME`` one of them, else 404.
- ``POST /models/NAME/invoke`` runs an inference request, as ``/invocations`` does, on
  the target model; 404 when NAME was not loaded here. Errors are 400 (507: memory).
- ``DELETE /models/NAME`` unloads the model (an ensemble's steps too) and unregisters
  its repository; 404 when NAME was not loaded here.

Registering repositories needs model control mode EXPLICIT, which is how SageMaker
images run Triton (and dlserve, deploy/sagemaker/serve) with
``SAGEMAKER_MULTI_MODEL=true``; both also turn model namespacing on, so that each
archive's ensemble runs its own step models when two archives hold models of the same
names (without it, the second such archive is refused with a 400).

Where dlserve differs from Triton 2.51: a body that is not a JSON object with string
``model_name`` and ``url`` is a 400 (Triton's server crashed); a model not ready is
left out of the list (Triton lists it as ``{}``); invoke and unload without the target
header use the target the model was loaded as (Triton uses NAME, which then is not a
model); a folder of several models none of which is an ensemble is refused (Triton
serves whichever folder it read last); a url under /dev, /proc or /sys is refused with
a message (newer Triton refuses it with an empty 400; 2.51 tried to load it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
from collections.abc import Awaitable, Callable
from pathlib import Path

import orjson

from dlserve.engine.core import Engine
from dlserve.errors import AlreadyExistsError, InvalidArgumentError, TritonError
from dlserve.frontends.http_api import empty, json_object, json_response
from dlserve.frontends.http_server import HttpRequest, HttpResponse

ROUTE = re.compile(r"/models/?([^/]+)?(/invoke)?")
TARGET_HEADER = "x-amzn-sagemaker-target-model"
_SYSTEM_FOLDERS = ("/dev/", "/proc/", "/sys/")
_ENSEMBLE = re.compile(r'platform:\s*"ensemble"')
# What Triton takes for running out of memory in a load or inference error (507).
_OUT_OF_MEMORY = (
    "CUDA out of memory", "CUDA_OUT_OF_MEMORY", "Out of memory", "Out Of Memory", "out of memory",
    "MemoryError", "OutOfMemory", "OOM", "Dst tensor is not initialized",
    "Src tensor is not initialized", "CNMEM_STATUS_OUT_OF_MEMORY", "CUDNN_STATUS_NOT_INITIALIZED",
    "CUBLAS_STATUS_ALLOC_FAILED", "CUBLAS_STATUS_NOT_INITIALIZED", "Failed to allocate memory",
    "failed to allocate memory", "No space left on device",
)

Infer = Callable[[HttpRequest, str], Awaitable[HttpResponse]]


@dataclasses.dataclass(frozen=True)
class _Loaded:
    target: str  # the model it is served as
    repository: str  # the repository registered for it
    others: frozenset[str] = frozenset()  # the names of the archive's other models (its steps)

    def clashes_with(self, other: _Loaded) -> str:
        """Why the two archives cannot be served side by side, or "": a model of one named
        as the other's target would make that target's name mean two models."""
        for one, two in ((self, other), (other, self)):
            if one.target in two.others | {two.target}:
                return (
                    f"model '{one.target}' cannot be served: the archive at '{two.repository}' "
                    "already has a model of that name"
                )
        return ""


def _failure(message: str) -> HttpResponse:
    """400, or 507 where the message reads as running out of memory."""
    status = 507 if any(marker in message for marker in _OUT_OF_MEMORY) else 400
    return json_response({"error": message}, status)


def archive_models(repository: str, folder: str) -> frozenset[str]:
    """The model folders of an archive's repository other than the one it serves."""
    try:
        return frozenset(entry.name for entry in os.scandir(repository) if entry.is_dir() and entry.name != folder)
    except OSError:
        return frozenset()


def archive_layout(url: str) -> tuple[str, str]:
    """(repository to register, model folder in it to serve) for a load's url."""
    path = Path(os.path.abspath(os.path.normpath(url)))
    if str(path).startswith(_SYSTEM_FOLDERS) or str(path) in ("/dev", "/proc", "/sys"):
        raise InvalidArgumentError(f"url '{url}' cannot be under /dev, /proc or /sys")
    if (path / "config.pbtxt").is_file():
        return str(path.parent), path.name
    try:
        folders = sorted(entry for entry in path.iterdir() if entry.is_dir())
    except OSError:
        raise InvalidArgumentError(f"failed to register '{url}', repository not found") from None
    ensembles = [f for f in folders if _is_ensemble(f / "config.pbtxt")]
    if len(ensembles) == 1:
        return str(path), ensembles[0].name
    if len(folders) == 1:
        return str(path), folders[0].name
    raise InvalidArgumentError(
        f"url '{url}' holds {len(folders)} model folders and "
        f"{'several ensembles' if ensembles else 'no ensemble'}: cannot tell which model to serve"
    )


def _is_ensemble(config: Path) -> bool:
    try:
        return bool(_ENSEMBLE.search(config.read_text(errors="replace")))
    except OSError:
        return False


class MultiModelEndpoint:
    """The ``/models`` routes of one SageMaker service."""

    def __init__(self, engine: Engine, infer: Infer) -> None:
        self.engine = engine
        self._infer = infer
        self._loaded: dict[str, _Loaded] = {}
        # Names being loaded (with what they load) or unloaded (None). Their work runs
        # shielded from the request's cancellation (a client that hangs up must not
        # leave a repository registered and nothing recorded); other names' loads go on
        # meanwhile.
        self._busy: dict[str, _Loaded | None] = {}

    async def __call__(self, request: HttpRequest, name: str, invoke: bool) -> HttpResponse:
        if request.method == "GET":
            return await (self._get(name) if name else self._list())
        if request.method == "POST":
            return await (self._invoke(request, name) if invoke else self._load(request))
        if request.method == "DELETE":
            return await self._unload(request, name)
        return empty(400)

    def _target(self, request: HttpRequest, loaded: _Loaded) -> str:
        return request.header(TARGET_HEADER) or loaded.target

    async def _ready(self) -> dict[str, _Loaded]:
        return {
            name: loaded
            for name, loaded in list(self._loaded.items())
            if await self.engine.model_ready(loaded.target)
        }

    async def _list(self) -> HttpResponse:
        models = [{"modelName": n, "modelUrl": l.repository} for n, l in (await self._ready()).items()]
        return json_response({"models": models})

    async def _get(self, name: str) -> HttpResponse:
        loaded = self._loaded.get(name)
        if loaded is None:
            return empty(404)
        return json_response({"modelName": name, "modelUrl": loaded.repository})

    async def _invoke(self, request: HttpRequest, name: str) -> HttpResponse:
        loaded = self._loaded.get(name)
        if loaded is None:
            return empty(404)
        response = await self._infer(request, self._target(request, loaded))
        if response.status < 400:
            return response
        return _failure(orjson.loads(b"".join(bytes(part) for part in response.body))["error"])

    async def _load(self, request: HttpRequest) -> HttpResponse:
        try:
            body = json_object(request)
            name, url = body.get("model_name"), body.get("url")
            if not isinstance(name, str) or not name or not isinstance(url, str) or not url:
                raise InvalidArgumentError("load model: 'model_name' and 'url' must be non-empty strings")
            target = request.header(TARGET_HEADER) or name
            repository, folder = archive_layout(url)
        except TritonError as exc:
            return _failure(exc.message)
        if name in self._loaded:
            return json_response({"error": f"model '{name}' is already loaded"}, 409)
        if name in self._busy:
            return json_response({"error": f"model '{name}' is being loaded or unloaded"}, 409)
        loading = _Loaded(target, repository, archive_models(repository, folder))
        # With model namespacing archives may share step names, but a target must stay
        # the one model of its name: it is loaded, invoked and unloaded by name.
        for other in [*self._loaded.values(), *self._busy.values()]:
            clash = other.clashes_with(loading) if other is not None else ""
            if clash:
                return json_response({"error": clash}, 409)
        self._busy[name] = loading
        return await asyncio.shield(self._load_archive(name, loading, folder))

    async def _load_archive(self, name: str, loading: _Loaded, folder: str) -> HttpResponse:
        target, repository = loading.target, loading.repository
        try:
            try:
                await self.engine.register_repository(repository, {folder: target})
            except AlreadyExistsError as exc:
                return json_response({"error": exc.message}, 409)
            except TritonError as exc:
                return _failure(exc.message)
            try:
                await self.engine.load(target)
            except BaseException as exc:
                self.engine.unregister_repository(repository)
                if isinstance(exc, TritonError):
                    return _failure(exc.message)
                raise
            self._loaded[name] = loading
            return empty(200)
        finally:
            self._busy.pop(name, None)

    async def _unload(self, request: HttpRequest, name: str) -> HttpResponse:
        loaded = self._loaded.get(name)
        if loaded is None:
            return empty(404)
        if name in self._busy:
            return json_response({"error": f"model '{name}' is being unloaded"}, 409)
        self._busy[name] = None
        return await asyncio.shield(self._unload_archive(name, self._target(request, loaded), loaded))

    async def _unload_archive(self, name: str, target: str, loaded: _Loaded) -> HttpResponse:
        try:
            await self.engine.unload(target, unload_dependents=True)
            del self._loaded[name]
            self.engine.unregister_repository(loaded.repository)
            return empty(200)
        except TritonError as exc:
            return json_response({"error": exc.message}, 400)
        finally:
            self._busy.pop(name, None)
