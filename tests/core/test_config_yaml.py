"""Config YAML: anchors and merge keys work, and aliases that would expand without bound are refused."""

import pytest

from grpo_core.config_io import apply_override, load_config
from grpo_core.config_yaml import MAX_EXPANDED_NODES, MAX_NESTING, parse_yaml
from grpo_core.errors import ConfigError


def laughs(levels: int, width: int = 9) -> str:
    """`levels` of aliases, each a list of `width` aliases of the one before: width**levels leaves."""
    lines = ["model:", "  architecture:", "    l0: &l0 [" + ", ".join(["lol"] * width) + "]"]
    lines += [f"    l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_anchors_and_merge_keys_still_work(tmp_path):
    path = tmp_path / "shared.yaml"
    path.write_text("eval: &shared\n  n: 2\n  max_new_tokens: 8\n  greedy: false\n"
                    "rollout:\n  <<: *shared\n  n: 4\n"
                    "model:\n  tokenizer: char\n  architecture: {model_type: qwen2, dims: &dims [64, 64], copy: *dims}\n")
    cfg = load_config(path)
    assert (cfg.rollout.n, cfg.rollout.max_new_tokens, cfg.rollout.greedy) == (4, 8, False)
    assert (cfg.eval.n, cfg.eval.max_new_tokens) == (2, 8)
    assert cfg.model.architecture["copy"] == [64, 64]


def test_aliases_within_the_bound_are_read_in_full():
    tree = parse_yaml(laughs(4))  # 9**3 = 729 leaves in the last list
    assert len(tree["model"]["architecture"]["l3"]) == 9
    assert tree["model"]["architecture"]["l3"][8][8][8] == ["lol"] * 9


def test_billion_laughs_is_refused_naming_the_bound(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(laughs(9))
    assert len(path.read_bytes()) < 700
    with pytest.raises(ConfigError, match="MAX_EXPANDED_NODES") as error:
        load_config(path)
    assert f"{MAX_EXPANDED_NODES:,}" in str(error.value) and "write the repeated values out" in str(error.value)


def test_an_override_is_bounded_too():
    tree: dict = {}
    levels = ", ".join(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 9))
    with pytest.raises(ConfigError, match="MAX_EXPANDED_NODES"):
        apply_override(tree, f"model.architecture={{l0: &l0 [a, a, a, a, a, a, a, a, a], {levels}}}")


def test_an_alias_of_itself_and_deep_nesting_are_refused():
    with pytest.raises(ConfigError, match="refers to a node that contains it"):
        parse_yaml("model:\n  architecture:\n    a: &a [*a]\n")
    with pytest.raises(ConfigError, match="MAX_NESTING"):
        parse_yaml("a: " + "[" * 5000 + "]" * 5000)
    with pytest.raises(ConfigError, match="MAX_NESTING"):
        parse_yaml("a: " + "[" * (MAX_NESTING + 1) + "]" * (MAX_NESTING + 1))
    assert parse_yaml("a: " + "[" * 20 + "]" * 20)["a"] is not None
