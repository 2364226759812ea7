"""Every shipped launch config: accelerate's own loader accepts it, its 'no'/'NO' are quoted, every key is explained."""

from __future__ import annotations

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file

from tests.conftest import ROOT

CONFIGS = sorted((ROOT / "accelerate_configs").glob("*.yaml"))
EXPECTED = {"cpu.yaml", "cpu_multi.yaml", "gpu.yaml", "multi_gpu.yaml", "fsdp.yaml", "multi_node.yaml"}


def test_the_expected_configs_ship():
    assert {path.name for path in CONFIGS} == EXPECTED


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_accelerate_loads_it(path):
    config = load_config_from_file(str(path))
    assert config.mixed_precision in ("no", "fp16", "bf16")
    assert config.num_processes >= 1


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_no_bare_no_and_every_key_commented(path):
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, _, rest = line.partition(":")
        value = rest.split("#")[0].strip()
        assert value not in ("no", "NO", "No"), f"{path.name}:{number}: quote it, YAML reads a bare {value} as false"
        if rest.strip() and key.strip() != "fsdp_config":
            assert "#" in rest, f"{path.name}:{number}: {key.strip()} has no comment"
    # YAML itself must agree: no key parsed into a boolean where accelerate expects a string.
    raw = yaml.safe_load(path.read_text())
    assert isinstance(raw["distributed_type"], str) and isinstance(raw["mixed_precision"], str)


def test_cpu_multi_starts_two_gloo_processes():
    raw = yaml.safe_load((ROOT / "accelerate_configs" / "cpu_multi.yaml").read_text())
    assert raw["distributed_type"] == "MULTI_GPU" and raw["use_cpu"] is True and raw["num_processes"] == 2
