"""rollout.partial.kv_cache resolved against the rollout backend: auto keeps caches where the
backend can, an explicit kept mode on a backend that cannot is refused in one line."""

from types import SimpleNamespace

import pytest

from grpo_core.errors import UserError
from grpo_rollout import JaxRollout
from grpo_runner_gsm8k.samplers.partial import kv_cache_mode


class ReprefillOnly:
    """A backend with generate() but no rounds on a kept cache."""

    def generate(self, *args, **kwargs):
        raise NotImplementedError


def cfg(mode: str, multi_turn: bool = False):
    """The rollout section, as much of it as the mode reads."""
    return SimpleNamespace(backend="third_party", partial=SimpleNamespace(kv_cache=mode),
                           multi_turn=SimpleNamespace(enabled=multi_turn))


@pytest.mark.parametrize("mode", ["reprefill", "within_step", "across_steps"])
def test_an_explicit_mode_stands_on_the_builtin_backend(mode):
    assert kv_cache_mode(cfg(mode), JaxRollout()) == mode


def test_auto_keeps_caches_within_a_step_where_the_backend_can_and_reprefills_where_not():
    assert kv_cache_mode(cfg("auto"), JaxRollout()) == "within_step"
    assert kv_cache_mode(cfg("auto"), ReprefillOnly()) == "reprefill"


def test_a_kept_mode_on_a_backend_without_kept_rounds_is_refused():
    with pytest.raises(UserError, match="backend 'third_party' has no generate_round.*kv_cache=reprefill"):
        kv_cache_mode(cfg("across_steps"), ReprefillOnly())


def test_multi_turn_rows_always_reprefill():
    """(explicit kept modes with multi-turn rows are refused at load: tests/e2e/test_bad_inputs.py)"""
    assert kv_cache_mode(cfg("auto", multi_turn=True), JaxRollout()) == "reprefill"
