"""Prometheus counts over reloads (dlserve.engine.statistics): every request any
generation of a model version answered counts, whether the replaced generations are
still finishing requests when later reloads come or have ended."""

from __future__ import annotations

from dlserve.engine.statistics import ModelStatistics


def serve(stats: ModelStatistics, requests: int) -> None:
    for _ in range(requests):
        stats.record_execution(
            batch_size=1, request_count=1, queue_ns=[5], input_ns=1, infer_ns=10, output_ns=1
        )
        stats.record_request(20)


def reloaded(previous: ModelStatistics) -> ModelStatistics:
    stats = ModelStatistics(previous.name, previous.version)
    stats.continues(previous)
    return stats


def counted(stats: ModelStatistics) -> tuple[int, int, int, int]:
    total = stats.lifetime()
    return (
        total.durations["success"].count,
        total.inference_count,
        total.execution_count,
        total.durations["success"].ns,
    )


def test_generations_still_draining_count_over_later_reloads():
    """Reloads in quick succession while the replaced generations still answer the
    requests they hold: what they answer after each reload counts too."""
    generations = [ModelStatistics("m", 1)]
    serve(generations[0], 2)
    for _ in range(3):
        generations.append(reloaded(generations[-1]))
        for stats in generations:
            serve(stats, 1)
    answered = 2 + 2 + 3 + 4
    assert counted(generations[-1]) == (answered, answered, answered, 20 * answered)
    assert generations[-1].as_dict()["inference_count"] == 1  # (the statistics API: its own)


def test_ended_generations_fold_into_one_and_keep_their_counts():
    stats = ModelStatistics("m", 1)
    for _ in range(5):
        serve(stats, 2)
        stats.ended = True  # (as its version's unload sets it)
        stats = reloaded(stats)
    serve(stats, 1)
    assert counted(stats) == (11, 11, 11, 220)
    assert len(stats.replaced) == 1


def test_an_ended_generation_folds_while_a_draining_one_stays_live():
    draining = ModelStatistics("m", 1)
    serve(draining, 1)
    middle = reloaded(draining)
    serve(middle, 1)
    middle.ended = True  # (it ended first: its requests were quicker)
    newest = reloaded(middle)
    serve(draining, 2)
    serve(newest, 1)
    assert counted(newest) == (5, 5, 5, 100)
    assert len(newest.replaced) == 2
