"""The models a manager knows, and which one a name means.

A model is known by its key, ``(namespace, name)``; the namespace is "" unless model
namespacing is on, when it is the repository the model came from. A request, a BLS
call or an API call names a model without a namespace: with namespacing, that name
means the one model of that name that is loaded, and is an error (Triton's words) when
several are. An ensemble's step also names its namespace, resolved when the ensemble
loaded.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from dlserve.engine.model import ModelVersion
from dlserve.engine.repository import ModelKey
from dlserve.errors import InvalidArgumentError, NotFoundError, UnavailableError


@dataclasses.dataclass
class ModelEntry:
    name: str
    namespace: str = ""  # its repository as given, with model namespacing on
    versions: dict[int, ModelVersion] = dataclasses.field(default_factory=dict)
    error: str = ""  # why the model (as a whole) is not loaded
    tried: list[int] = dataclasses.field(default_factory=list)  # the versions its last load tried
    failed: dict[int, str] = dataclasses.field(default_factory=dict)  # those that failed, and why
    loading: bool = False
    # Versions it served and serves no more (unloaded, replaced by a reload, or stopped
    # again because another version failed to load): listed as unloaded, as in Triton.
    unloaded: list[int] = dataclasses.field(default_factory=list)
    # Versions a reload replaced that still finish their requests (listed UNLOADING).
    draining: dict[int, ModelVersion] = dataclasses.field(default_factory=dict)
    fingerprint: Any = None
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    # Loaded only because an ensemble needs it (not asked for by name): unloading that
    # ensemble with unload_dependents takes it too, as in Triton.
    as_step: bool = False
    # An ensemble unloaded because these step models were: it loads again once they have.
    waits_for: set[ModelKey] = dataclasses.field(default_factory=set)
    # An unload the API returned from before it ended: a load of the model waits for it.
    unloading: asyncio.Task[None] | None = None

    def unchanged(self, fingerprint: Any) -> bool:
        """Loaded from these very files, as they are, and every version serving: a load
        of it again changes nothing (as in Triton)."""
        return (
            bool(self.versions) and self.fingerprint == fingerprint
            and all(v.state == "READY" for v in self.versions.values())
        )

    @property
    def key(self) -> ModelKey:
        return (self.namespace, self.name)

    def states(self) -> dict[int, tuple[str, str]]:
        """Each version's state and reason, by version, as the index lists them: Triton
        keeps every version it knew (unloaded, draining, failed, loading or serving)."""
        states = {version: ("UNAVAILABLE", "unloaded") for version in self.unloaded}
        states |= {version: (model.state, model.reason) for version, model in self.draining.items()}
        states |= {version: ("UNAVAILABLE", reason) for version, reason in self.failed.items()}
        if self.loading:  # (a version that serves while its successor loads stays as it is)
            states |= {version: ("LOADING", "") for version in self.tried if version not in self.versions}
        for version, model in self.versions.items():
            state, reason = model.state, model.reason
            if state == "READY" and not model.ready:
                state, reason = "UNAVAILABLE", model.unready_reason()
            states[version] = (state, reason)
        return dict(sorted(states.items()))

    def latest_loaded(self) -> ModelVersion | None:
        """The highest loaded version, even if its instances are restarting right now."""
        latest = None
        for model in self.versions.values():  # (every request looks: no list, no key function)
            if model.state == "READY" and (latest is None or model.version > latest.version):
                latest = model
        return latest


class ModelTable(dict[ModelKey, ModelEntry]):
    """Every model ever loaded or tried (an unloaded one keeps its entry), by key; add
    them with :meth:`entry` only, so that they are found by name too."""

    def __init__(self, namespacing: bool) -> None:
        super().__init__()
        self.namespacing = namespacing
        self._named: dict[str, list[ModelEntry]] = {}  # name -> its entries, in every namespace

    def entry(self, key: ModelKey) -> ModelEntry:
        """The model's entry, made if it has none yet."""
        entry = self.get(key)
        if entry is None:
            entry = self[key] = ModelEntry(key[1], namespace=key[0])
            self._named.setdefault(entry.name, []).append(entry)
        return entry

    def forget(self, key: ModelKey) -> None:
        """Drop a model's entry (it left the repository, in poll mode)."""
        entry = self.pop(key, None)
        if entry is not None:
            same = [e for e in self._named.get(entry.name, []) if e is not entry]
            if same:
                self._named[entry.name] = same
            else:
                self._named.pop(entry.name, None)

    def knows(self, name: str) -> bool:
        return name in self._named

    def named(self, name: str) -> list[ModelEntry]:
        """The models of this name, in every namespace."""
        return list(self._named.get(name, ()))

    def find(self, name: str, namespace: str | None = None) -> ModelEntry | None:
        """The model a name means: the one in ``namespace`` if there is one there (an
        ensemble's step), else the one loaded, else the one known. Raises when the name
        is ambiguous: loaded from several repositories (with model namespacing)."""
        if not self.namespacing:
            return self.get(("", name))
        if namespace is not None:
            entry = self.get((namespace, name))
            if entry is not None:
                return entry
        entries = self._named.get(name)
        if not entries:
            return None
        if len(entries) == 1:
            return entries[0]
        # (one that is unloading is no longer a meaning of the name, as in Triton 2.51)
        loaded = [entry for entry in entries if entry.latest_loaded() is not None]
        if len(loaded) > 1:
            raise InvalidArgumentError(
                f"There are {len(loaded)} identifiers of model '{name}' in global map, model "
                "namespace must be provided to resolve ambiguity."
            )
        return loaded[0] if loaded else entries[0]

    def version(self, name: str, version: int = -1, namespace: str | None = None) -> ModelVersion:
        """The version that serves requests for ``(name, version)``; -1 = latest ready.
        ``namespace``: where an ensemble's step was resolved (model namespacing)."""
        entry = self.find(name, namespace)
        if entry is None or (not entry.versions and entry.error and not entry.tried):
            raise NotFoundError(f"Request for unknown model: '{name}' is not found")
        if version is None or version < 0:
            found = entry.latest_loaded()
            if found is None:
                raise NotFoundError(f"Request for unknown model: '{name}' has no available versions")
            return found
        model = entry.versions.get(version)
        if model is None:
            if version in entry.states():  # one it knew, not serving (Triton's words and code)
                raise UnavailableError(
                    f"Request for unknown model: '{name}' version {version} is not at ready state"
                )
            raise NotFoundError(f"Request for unknown model: '{name}' version {version} is not found")
        return model

    def ready_versions(self, name: str) -> list[int]:
        entry = self.find(name)
        return sorted(v.version for v in entry.versions.values() if v.ready) if entry else []

    def all_ready(self) -> bool:
        """Every model asked for serves (a first load still going is not serving yet;
        a reload is: its old versions serve until the new ones replace them, but one
        that adds versions is not until they serve, as Triton sees it). A model that
        failed before it had versions (its config did not parse, say) does not count:
        Triton has no versions of it to be unready (side by side: one bad load request
        in explicit mode left a dlserve server unready until that model loaded)."""
        return all(
            entry.versions
            and all(v.ready for v in entry.versions.values())
            and not (entry.loading and set(entry.tried) - entry.versions.keys())
            for entry in self.values()
            if entry.versions or (entry.error and entry.tried) or entry.loading
        )
