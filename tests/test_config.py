"""EngineConfig: one validation, errors that name the field and the allowed range."""

import pytest

from pagedserve.backend.config import EngineConfig
from pagedserve.backend.errors import ConfigError


def test_defaults_are_valid():
    config = EngineConfig()
    assert config.block_size == 16 and config.enable_prefix_caching


def test_strings_from_config_pbtxt_are_cast():
    config = EngineConfig.from_strings(
        {"block_size": "32", "enable_prefix_caching": "false", "gpu_memory_utilization": "0.5", "dtype": "bfloat16"}
    )
    assert (config.block_size, config.enable_prefix_caching, config.gpu_memory_utilization) == (32, False, 0.5)


@pytest.mark.parametrize(
    "values,field,hint",
    [
        ({"block_size": "12"}, "block_size", "one of 8, 16"),
        ({"max_num_seqs": "0"}, "max_num_seqs", ">= 1"),
        ({"dtype": "fp64"}, "dtype", "float32"),
        ({"gpu_memory_utilization": "1.5"}, "gpu_memory_utilization", "[0.05, 0.99]"),
        ({"enable_prefix_caching": "maybe"}, "enable_prefix_caching", "expected bool"),
        ({"max_queue_size": "ten"}, "max_queue_size", "expected int"),
        ({"stream_interval": "0"}, "stream_interval", ">= 1"),
        ({"model": "/no/such/model"}, "model", "does not exist"),
        ({"scheduling_policy": "fifo"}, "scheduling_policy", "inflight"),
    ],
)
def test_invalid_values_name_field_and_range(values, field, hint):
    with pytest.raises(ConfigError, match=hint) as info:
        EngineConfig.from_strings(values)
    assert info.value.field == field and f"'{field}'" in str(info.value)


def test_unknown_parameters_are_named():
    with pytest.raises(ConfigError, match="max_batch_tokens"):
        EngineConfig.from_strings({"max_batch_tokens": "10"})
