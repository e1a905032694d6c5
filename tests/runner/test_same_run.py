"""The hashes the processes of a run compare before the first step (the exchange itself is
tests/e2e/test_multihost_run.py::test_processes_started_with_different_configs_stop_before_loading_the_model)."""

from grpo_core.config_io import load_config
from grpo_core.registry import default_registry
from grpo_runner_gsm8k import multihost


def fingerprint(path: str, *overrides: str) -> str:
    return multihost.config_fingerprint(load_config(path, list(overrides), registry=default_registry()))


def test_config_hash_ignores_only_the_process_id(tiny_config_path):
    base = fingerprint(tiny_config_path, "mesh.process_id=0", "mesh.num_processes=2")
    assert fingerprint(tiny_config_path, "mesh.process_id=1", "mesh.num_processes=2") == base
    assert fingerprint(tiny_config_path, "mesh.process_id=0", "mesh.num_processes=2", "train.seed=7") != base
    assert fingerprint(tiny_config_path, "mesh.process_id=0", "mesh.num_processes=4") != base


def test_code_hash_follows_the_grpo_sources(tmp_path, monkeypatch):
    before = multihost.code_fingerprint()
    package = tmp_path / "grpo_extra"
    package.mkdir()
    (package / "__init__.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with_package = multihost.code_fingerprint()
    (package / "__init__.py").write_text("X = 2\n")
    assert len({before, with_package, multihost.code_fingerprint()}) == 3
