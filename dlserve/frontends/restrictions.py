"""Restricted APIs: API categories that need a header (Triton's ``--http-restricted-api``
and ``--grpc-restricted-protocol``), shared by both frontends.

``<category,...>:<header>=<value>``: a call in one of the categories must carry
``header`` with exactly ``value``. HTTP answers 403 "This API is restricted,
expecting header '<header>'"; gRPC wants the header under Triton's
``triton-grpc-protocol-`` prefix and answers UNAVAILABLE "This protocol is
restricted, expecting header 'triton-grpc-protocol-<header>'", as Triton 2.51.
"""

from __future__ import annotations

import dataclasses

from dlserve.errors import InvalidArgumentError

CATEGORIES = (
    "health",
    "metadata",
    "inference",
    "shared-memory",
    "model-config",
    "model-repository",
    "statistics",
    "trace",
    "logging",
)


@dataclasses.dataclass(frozen=True)
class Restriction:
    categories: frozenset[str]
    header: str  # lower-cased
    value: str

    @staticmethod
    def parse(text: str, kind: str = "api") -> Restriction:
        """One ``<category,...>:<header>=<value>``; ``kind`` names them in errors, as Triton
        does: "api" for HTTP's, "protocol" for gRPC's."""
        try:
            categories, pair = text.split(":", 1)
            header, value = pair.split("=", 1)
        except (AttributeError, ValueError):
            raise InvalidArgumentError(
                f"restriction '{text}' must look like <category,...>:<header>=<value>"
            ) from None
        names = frozenset(c.strip() for c in categories.split(",") if c.strip())
        unknown = sorted(names - set(CATEGORIES))
        if unknown:  # (Triton's words, then the ones it knows)
            raise InvalidArgumentError(f"unknown restricted {kind} '{unknown[0]}' (known: {', '.join(CATEGORIES)})")
        header = header.strip().lower()
        if not names or not header:
            raise InvalidArgumentError(f"restriction '{text}' names no category or no header")
        return Restriction(names, header, value)

    @staticmethod
    def parse_all(texts: list[str], kind: str = "api") -> list[Restriction]:
        """Each category in one group at most, as Triton requires."""
        restrictions = [Restriction.parse(text, kind) for text in texts]
        seen: set[str] = set()
        for restriction in restrictions:
            again = sorted(restriction.categories & seen)
            if again:  # (Triton's words)
                raise InvalidArgumentError(
                    f"restricted {kind} '{again[0]}' can not be specified in multiple config groups"
                )
            seen |= restriction.categories
        return restrictions


def rules_by_category(restrictions: list[Restriction]) -> dict[str, list[Restriction]]:
    return {c: [r for r in restrictions if c in r.categories] for c in CATEGORIES}
