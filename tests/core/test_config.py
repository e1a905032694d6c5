"""Strict config loading: keys, types, ranges, overrides, plugin options."""

import dataclasses
import os
import typing
from dataclasses import dataclass

import pytest
import yaml

from grpo_core import LossSpec, hookimpl
from grpo_core.config import RunConfig
from grpo_core.config_io import apply_override, config_to_yaml, load_config
from grpo_core.errors import ConfigError
from grpo_core.testing import registry_with


def test_defaults_are_valid_and_round_trip_through_yaml(tmp_path):
    cfg = load_config()
    path = tmp_path / "resolved.yaml"
    path.write_text(config_to_yaml(cfg))
    assert load_config(path) == cfg


def test_every_field_is_documented():
    for section in dataclasses.fields(RunConfig):
        for f in dataclasses.fields(typing.get_type_hints(RunConfig)[section.name]):
            assert f.metadata.get("doc"), f"{section.name}.{f.name} has no doc"


def test_overrides_parse_yaml_scalars(tmp_path):
    cfg = load_config(None, ["train.lr=1e-6", "rollout.n=4", "loss.epsilon_c=null", "model.remat=full",
                             "rollout.greedy=true", "task.options.digits=2"])
    assert cfg.train.lr == 1e-6 and isinstance(cfg.train.lr, float)
    assert cfg.rollout.n == 4 and cfg.loss.epsilon_c is None and cfg.model.remat == "full"
    assert cfg.rollout.greedy is True and cfg.task.options == {"digits": 2}


def test_int_is_accepted_for_float_but_not_bool_for_int():
    assert load_config(None, ["train.lr=1"]).train.lr == 1.0
    with pytest.raises(ConfigError, match="train.steps = True has the wrong type: expected an integer"):
        load_config(None, ["train.steps=true"])


def test_override_into_a_value_is_an_error():
    with pytest.raises(ConfigError, match="train.lr is a value"):
        apply_override({"train": {"lr": 1.0}}, "train.lr.x=1")


def test_yaml_file_with_unknown_nested_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"rollout": {"temprature": 0.7}}))
    with pytest.raises(ConfigError, match=r"unknown config key rollout.temprature; did you mean rollout.temperature\?"):
        load_config(path)


@dataclass(frozen=True)
class BlockOptions:
    block_size: int = 128


class BlockLoss:
    @hookimpl
    def grpo_losses(self):
        return [LossSpec("blocky", lambda o: o, BlockOptions, "test loss")]


@dataclass(frozen=True)
class _Any:
    pass


def test_plugin_options_are_validated_by_the_plugin_dataclass():
    registry = registry_with(BlockLoss(), entry_points=False)

    class OnlyLoss:
        def get(self, kind, name):
            return registry.get("loss", name) if kind == "loss" else LossSpec(name, lambda o, **_: o, _Any, "")

        def entries(self, kind):
            return registry.entries(kind)

    cfg = load_config(None, ["loss.impl=blocky", "loss.options.block_size=256"], registry=OnlyLoss())
    assert cfg.loss.options == {"block_size": 256}
    with pytest.raises(ConfigError, match=r"unknown config key loss.options.blok_size; did you mean loss.options.block_size"):
        load_config(None, ["loss.impl=blocky", "loss.options.blok_size=256"], registry=OnlyLoss())
    with pytest.raises(ConfigError, match=r"loss.options.block_size = 'big' has the wrong type"):
        load_config(None, ["loss.impl=blocky", "loss.options.block_size=big"], registry=OnlyLoss())
    with pytest.raises(ConfigError, match=r"loss.impl: unknown loss 'blockyy'.*Did you mean 'blocky'"):
        load_config(None, ["loss.impl=blockyy"], registry=OnlyLoss())


def test_float32_masters_are_the_default_and_bfloat16_weights_need_bfloat16_compute():
    cfg = load_config(None, ["model.dtype=bfloat16"])
    assert (cfg.model.dtype, cfg.model.param_dtype, cfg.train.moment_dtype) == ("bfloat16", "float32", "float32")
    assert load_config(None, ["model.dtype=bfloat16", "model.param_dtype=bfloat16"]).model.param_dtype == "bfloat16"
    with pytest.raises(ConfigError, match=r"model.param_dtype = bfloat16 with model.dtype = float32.*"
                                          r"set model.param_dtype=float32"):
        load_config(None, ["model.param_dtype=bfloat16"])
    with pytest.raises(ConfigError, match=r"train.moment_dtype"):
        load_config(None, ["train.moment_dtype=float16"])


def test_same_as_defaults_are_filled_in_at_load():
    """A null "same as X" setting is X in the loaded config (what --print-config shows)."""
    cfg = load_config(None, ["model.path=/models/q", "model.dtype=bfloat16", "model.param_dtype=bfloat16",
                             "rollout.max_new_tokens=24"])
    assert (cfg.model.tokenizer, cfg.train.moment_dtype) == ("/models/q", "bfloat16")
    assert (cfg.loss.max_completion_length, cfg.eval.max_new_tokens) == (24, 24)
    given = load_config(None, ["model.tokenizer=char", "train.moment_dtype=float32", "loss.aggregation=fixed_length_norm",
                               "loss.max_completion_length=7",
                               "eval.max_new_tokens=5"])
    assert (given.model.tokenizer, given.train.moment_dtype, given.loss.max_completion_length,
            given.eval.max_new_tokens) == ("char", "float32", 7, 5)


def test_lora_moments_default_to_the_adapters_float32_and_its_init_from_expands_home():
    """A LoRA run trains float32 adapters on a bfloat16 base: their moments are float32 by default."""
    cfg = load_config(None, ["model.dtype=bfloat16", "model.param_dtype=bfloat16", "model.lora.rank=4",
                             "model.lora.init_from=~/adapter"])
    assert cfg.train.moment_dtype == "float32"
    assert cfg.model.lora.init_from == os.path.join(os.path.expanduser("~"), "adapter")
