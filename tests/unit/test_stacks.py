"""Reading a worker's faulthandler dump: where the model's code is."""

from __future__ import annotations

from dlserve.ipc.stacks import DUMP_END, SHOWN_FRAMES, THREADS_LEFT_OUT, model_frames

MODEL = "/repo/m"


def frame(path: str, line: int, function: str) -> str:
    return f'  File "{path}", line {line} in {function}'


WORKER_MAIN = [
    frame("/site/dlserve/ipc/stub.py", 257, "_initialize"),
    frame("/site/dlserve/ipc/stub.py", 190, "serve"),
    frame("<frozen runpy>", 198, "_run_module_as_main"),
]


def dump(*threads: list[str]) -> str:
    """A dump as faulthandler writes it: the newest thread first, the current one marked."""
    blocks = []
    for index, frames in enumerate(threads):
        header = "Current thread" if index == len(threads) - 1 else "Thread"
        title = f"{header} 0x00007f{index:010x} (most recent call first):"
        blocks.append(title + "\n" + "\n".join(frames))
    return "\n\n".join(blocks) + "\n"


def test_the_oldest_thread_in_the_model_s_code_down_to_the_model_s_outermost_frame():
    helper = [frame(f"{MODEL}/1/model.py", 30, "background"), frame("/py/threading.py", 982, "run")]
    main = [
        frame("/py/time.py", 1, "sleep"),
        frame(f"{MODEL}/1/weights.py", 8, "fetch"),
        frame(f"{MODEL}/1/model.py", 5, "initialize"),
        *WORKER_MAIN,
    ]
    assert model_frames(dump(helper, main), [MODEL]) == main[:3]


def test_an_async_model_s_hook_is_found_on_its_loop_s_thread():
    loop_thread = [
        frame(f"{MODEL}/1/model.py", 9, "initialize"),
        frame("/py/asyncio/events.py", 80, "_run"),
        frame("/py/threading.py", 982, "run"),
    ]
    main = [frame("/py/concurrent/futures/_base.py", 451, "result"), *WORKER_MAIN]
    assert model_frames(dump(loop_thread, main), [MODEL]) == loop_thread[:1]


def test_no_thread_in_the_model_s_code_gives_nothing():
    main = [frame("/py/concurrent/futures/_base.py", 451, "result"), *WORKER_MAIN]
    assert model_frames(dump(main), [MODEL]) == []
    assert model_frames("", [MODEL]) == []


def test_a_python_based_backend_s_code_counts_and_a_sibling_folder_does_not():
    main = [frame("/backends/mine/model.py", 3, "initialize"), *WORKER_MAIN]
    assert model_frames(dump(main), [MODEL, "/backends/mine"]) == main[:1]
    assert model_frames(dump(main), [MODEL, "/backends/min"]) == []


def test_a_deep_stack_shows_its_innermost_and_outermost_frames():
    deep = [frame(f"{MODEL}/1/model.py", i, f"level{i}") for i in range(50)]
    shown = model_frames(dump([*deep, *WORKER_MAIN]), [MODEL])
    half = SHOWN_FRAMES // 2
    assert shown == [*deep[:half], "  ...", *deep[-half:]]


def test_what_the_model_printed_and_a_front_cut_off_do_not_confuse_it():
    main = [frame(f"{MODEL}/1/model.py", 5, "initialize"), *WORKER_MAIN]
    text = "printing\n\n\nmore\n" + dump(main)
    assert model_frames(text, [MODEL]) == main[:1]
    # A dump longer than what was kept: its front (the main thread's header here) is gone.
    cut = "\n".join(main) + "\n"
    assert model_frames(cut, [MODEL]) == main[:1]


def test_a_model_under_a_non_ascii_path_is_found_as_faulthandler_writes_its_path():
    folder = "/repö/m€"
    escaped = "/rep\\xf6/m\\u20ac"  # (faulthandler's ASCII)
    main = [frame(f"{escaped}/1/model.py", 5, "initialize"), *WORKER_MAIN]
    assert model_frames(dump(main), [folder]) == main[:1]


def test_a_header_with_the_thread_s_name_still_splits_the_threads():
    helper = frame(f"{MODEL}/1/model.py", 30, "background")
    main = frame(f"{MODEL}/1/model.py", 5, "initialize")
    text = (
        f"Thread 0x00007f0000000001 [helper] (most recent call first):\n{helper}\n\n"
        f"Current thread 0x00007f0000000002 [MainThread] (most recent call first):\n{main}\n"
        + "\n".join(WORKER_MAIN)
    )
    assert model_frames(text, [MODEL]) == [main]


def test_the_end_of_a_dump_and_threads_left_out_are_seen():
    whole = dump([frame(f"{MODEL}/1/model.py", 5, "initialize"), *WORKER_MAIN])
    assert DUMP_END.search(whole) and not THREADS_LEFT_OUT.search(whole)
    # A worker of an execution environment starts from a -c bootstrap.
    bootstrap = dump(
        [frame("/site/dlserve/ipc/stub.py", 190, "serve"), frame("<string>", 4, "<module>")]
    )
    assert DUMP_END.search(bootstrap)
    assert not DUMP_END.search(whole.split("<frozen runpy>")[0])  # (cut before its end)
    cut = dump(*[[frame("/py/threading.py", 331, "wait")]] * 3) + "...\n"
    assert THREADS_LEFT_OUT.search(cut) and not DUMP_END.search(cut)
