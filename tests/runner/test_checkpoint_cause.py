"""The one-line cause of a failed save: the operating-system error wherever a wrapper put it."""

import errno

from grpo_runner_gsm8k.operations.checkpoint import cause_of


def chained(outer: Exception, inner: BaseException) -> Exception:
    try:
        try:
            raise inner
        except BaseException as exc:
            raise outer from exc
    except Exception as exc:  # noqa: BLE001
        return exc


def test_an_os_error_in_the_chain_is_the_cause():
    exc = chained(RuntimeError("save failed"), OSError(errno.EFBIG, "File too large"))
    assert cause_of(exc) == "OSError: File too large"


def test_the_os_error_text_is_found_in_a_reworded_message():
    message = ('OUT_OF_RANGE: Error opening "zarr" driver: Error writing "1.2.count/.zarray" in OCDBT database at '
               'local file "/x/checkpoints/3.orbax-checkpoint-tmp/params/": File too large')
    assert cause_of(ValueError(message)) == "OSError: File too large"
    assert cause_of(ValueError("[Errno 28] No space left on device: '/x'")) == "OSError: No space left on device"


def test_a_long_unknown_cause_keeps_its_start_and_its_end():
    message = "start " + "x" * 300 + " the end"
    cause = cause_of(ValueError(message))
    assert cause.startswith("ValueError: start ") and cause.endswith(" the end") and len(cause) < 230
