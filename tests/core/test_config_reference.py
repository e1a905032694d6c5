"""The configuration reference page is generated from the config dataclasses: every key is in it,
with the type, default, range, doc and why that the code declares; plugin options likewise."""

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Literal, Optional

from grpo_core import RewardSpec, hookimpl
from grpo_core.config import RunConfig, setting
from grpo_core.config_reference import reference_markdown, reference_rows
from grpo_core.plugin_reference import plugin_reference_markdown
from grpo_core.testing import registry_with


def leaf_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of the config, found independently of the generator."""
    keys = []
    hints = typing.get_type_hints(cls)
    for config_field in dataclasses.fields(cls):
        key = prefix + config_field.name
        keys.append(key)
        if dataclasses.is_dataclass(hints[config_field.name]):
            keys += leaf_keys(hints[config_field.name], key + ".")
    return keys


def test_every_key_of_every_section_has_a_row_and_an_anchor():
    rows = {row.key: row for row in reference_rows()}
    sections = [key for key in leaf_keys(RunConfig) if "." not in key]
    assert set(rows) == set(leaf_keys(RunConfig)) - set(sections)
    page = reference_markdown()
    for key in rows:
        assert f'<a id="{key}"></a>' in page or f"](#{key})" in page, key
    for section in sections + ["model.lora", "rollout.partial"]:
        assert f"## `{section}` {{#{section}}}" in page


def test_rows_carry_type_default_range_doc_and_why():
    rows = {row.key: row for row in reference_rows()}
    lr = rows["train.lr"]
    assert (lr.type, lr.default, lr.range) == ("number", "0.001", "> 0.0")
    assert lr.doc == "Peak learning rate."
    dtype = rows["model.param_dtype"]
    assert dtype.type == "one of `float32`, `bfloat16`" and dtype.default == "float32"
    assert dtype.why.startswith("float32 masters keep updates of lr ~1e-6")
    assert rows["rollout.partial.budget"].type == "integer or null"
    assert rows["rollout.partial.budget"].default == "null"
    assert rows["rollout.partial.budget_quantile"].range == "> 0.0 and <= 1.0"
    assert rows["loss.mismatch_c_max"].why == "2.0: verl's rollout-correction default threshold."
    assert rows["task.rewards"].default == "{correctness: 1.0}"
    assert rows["model.lora"].type == "section"


@dataclass(frozen=True)
class ExtraSection:
    """A section added to the config."""

    # 3: the reason for this default.
    new_key: int = setting(3, "A key added to the config.", ge=1, lt=10)
    mode: Optional[Literal["a", "b"]] = setting(None, "A choice that may be null.")


@dataclass(frozen=True)
class ExtendedConfig(RunConfig):
    extra: ExtraSection = field(default_factory=ExtraSection)


def test_a_key_added_to_the_config_appears_in_the_reference():
    page = reference_markdown(ExtendedConfig)
    assert "## `extra` {#extra}" in page and "A section added to the config." in page
    assert ('| <a id="extra.new_key"></a>`new_key` | integer | `3` | `>= 1 and < 10` | '
            "A key added to the config. *Why:* 3: the reason for this default. |") in page
    assert '| <a id="extra.mode"></a>`mode` | one of `a`, `b` or null | `null` |' in page
    assert "extra.new_key" not in reference_markdown()


@dataclass(frozen=True)
class LengthOptions:
    """Options of the test reward."""

    limit: int = setting(200, "Characters a completion may have.", ge=1)
    scale: float = 0.5  # halves the reward: the test's own reason


class LengthPlugin:
    @hookimpl
    def grpo_rewards(self):
        return [RewardSpec("length_limit", lambda options: None, LengthOptions, "1 for short completions")]


def test_a_plugins_options_appear_in_the_plugin_reference():
    page = plugin_reference_markdown(registry_with(LengthPlugin(), entry_points=False))
    assert "### `length_limit` {#reward-length_limit}" in page
    assert "options under `task.reward_options.length_limit`" in page and "Options of the test reward." in page
    assert "| `limit` | integer | `200` | `>= 1` | Characters a completion may have. |" in page
    assert "| `scale` | number | `0.5` |  |  *Why:* halves the reward: the test's own reason |" in page
    assert "## loss plugins {#loss}" in page and "Selected by `loss.impl`." in page
