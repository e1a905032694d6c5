"""Only the repeats of a failed checkpoint write are dropped from the logs: asyncio's
'Task exception was never retrieved' records of orbax's write tasks and the 'never awaited'
warnings of its write coroutines (the run reports the failed save in its one error line,
whenever the tasks happen to be garbage-collected)."""

import gc
import logging
import warnings

from grpo_runner_gsm8k.operations.orbax_noise import drop_unretrieved_save_tasks

ORBAX_TASK = ("Task exception was never retrieved\nfuture: <Task finished name='Task-1201' coro=<async_serialize_"
              "from_host.<locals>.write_fragment() done, defined at .../orbax/checkpoint/_src/serialization/"
              "serialization.py:188> exception=ValueError('OUT_OF_RANGE: ... File too large')>")


def test_orbax_write_task_records_are_dropped_and_others_kept(caplog):
    logger = logging.getLogger("asyncio")
    with warnings.catch_warnings():  # the warning filter it adds stays inside this test
        drop_unretrieved_save_tasks()
        filters = list(logger.filters)
        drop_unretrieved_save_tasks()  # idempotent: no second filter
    assert logger.filters == filters
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        logger.error(ORBAX_TASK)
        logger.error("Task exception was never retrieved\nfuture: <Task finished coro=<my_own_task()>>")
        logger.error("Unclosed client session")
    assert [r.getMessage().splitlines()[-1] for r in caplog.records] == [
        "future: <Task finished coro=<my_own_task()>>", "Unclosed client session"]


def async_serialize_from_host():
    async def write_fragment():
        pass

    return write_fragment()


def my_own_writer():
    async def write_fragment():
        pass

    return write_fragment()


def never_awaited(make_coroutine) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        drop_unretrieved_save_tasks()
        coroutine = make_coroutine()
        del coroutine
        gc.collect()
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_never_awaited_warnings_of_orbax_write_coroutines_are_dropped_and_others_kept():
    assert never_awaited(async_serialize_from_host) == []
    assert never_awaited(my_own_writer) == [
        "coroutine 'my_own_writer.<locals>.write_fragment' was never awaited"]
