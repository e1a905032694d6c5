"""Only the repeats of a failed checkpoint write are dropped from the logs: asyncio's
'Task exception was never retrieved' records of orbax's write tasks (the run reports the
failed save in its one error line, whenever the tasks happen to be garbage-collected)."""

import logging

from grpo_runner_gsm8k.checkpoint import drop_unretrieved_save_tasks

ORBAX_TASK = ("Task exception was never retrieved\nfuture: <Task finished name='Task-1201' coro=<async_serialize_"
              "from_host.<locals>.write_fragment() done, defined at .../orbax/checkpoint/_src/serialization/"
              "serialization.py:188> exception=ValueError('OUT_OF_RANGE: ... File too large')>")


def test_orbax_write_task_records_are_dropped_and_others_kept(caplog):
    drop_unretrieved_save_tasks()
    drop_unretrieved_save_tasks()  # idempotent: one filter
    logger = logging.getLogger("asyncio")
    assert sum(type(f).__name__ == "_UnretrievedSaveTasks" for f in logger.filters) == 1
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        logger.error(ORBAX_TASK)
        logger.error("Task exception was never retrieved\nfuture: <Task finished coro=<my_own_task()>>")
        logger.error("Unclosed client session")
    assert [r.getMessage().splitlines()[-1] for r in caplog.records] == [
        "future: <Task finished coro=<my_own_task()>>", "Unclosed client session"]
