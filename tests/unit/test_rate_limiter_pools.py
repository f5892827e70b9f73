"""How big the rate limiter's pools are, from --rate-limit-resource entries (Triton's
rules): a device's pool is the larger of its own entry and the one for every device; a
global pool, the largest entry of any device; with no entry at all, the most any
instance asks for; once any entry is given, a resource it does not name has none."""

from __future__ import annotations

import dataclasses

import pytest

from dlserve.engine.proto import model_config_pb2 as mc
from dlserve.engine.rate_limiter import GLOBAL, RateLimiter, RateLimiterResource
from dlserve.errors import InvalidArgumentError


@dataclasses.dataclass(eq=False)
class Instance:
    """What the limiter reads of a model instance: its name (and identity)."""

    name: str


def needs(name: str, count: int, is_global: bool = False) -> mc.ModelRateLimiter:
    limiter = mc.ModelRateLimiter()
    resource = limiter.resources.add(name=name, count=count)
    setattr(resource, "global", is_global)
    return limiter


def pools(entries: list[RateLimiterResource], *instances: tuple[mc.ModelRateLimiter, int]) -> dict:
    limiter = RateLimiter(entries)
    for index, (config, device) in enumerate(instances):
        limiter.register(Instance(f"i{index}"), config, device)  # type: ignore[arg-type]
    return limiter.pool_sizes()


def test_without_entries_a_pool_holds_what_the_hungriest_instance_asks():
    assert pools([], (needs("R", 2), 0), (needs("R", 3), 0)) == {("R", 0): 3}


def test_a_device_takes_the_larger_of_its_own_entry_and_the_one_for_all():
    entries = [RateLimiterResource("R", 4), RateLimiterResource("R", 2, 0), RateLimiterResource("R", 6, 1)]
    assert pools(entries, (needs("R", 1), 0), (needs("R", 1), 1)) == {("R", 0): 4, ("R", 1): 6}


def test_a_global_pool_takes_the_largest_entry_of_any_device():
    entries = [RateLimiterResource("G", 4, 0), RateLimiterResource("G", 1, 1)]
    assert pools(entries, (needs("G", 2, is_global=True), 0)) == {("G", GLOBAL): 4}


def test_a_resource_no_entry_names_has_none_once_entries_are_given():
    with pytest.raises(InvalidArgumentError, match='Resource count for "U" is limited to 0'):
        pools([RateLimiterResource("R", 2)], (needs("U", 1), 0))
