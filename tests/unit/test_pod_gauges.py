"""What the gateway reads from a pod's /metrics: queue gauges and the prefix cache's size."""

from gateway.pods import parse_engine_load


def _info(engine: int, blocks: str, label: str = "num_gpu_blocks") -> str:
    """A vllm:cache_config_info line as vLLM 0.32 writes it: the size is a label."""
    return (
        f'vllm:cache_config_info{{block_size="16",cache_dtype="auto",engine="{engine}",'
        f'{label}="{blocks}",prefix_caching_hash_algo="sha256"}} 1.0'
    )


# Two data-parallel engines of one pod.
TWO_ENGINES = "\n".join([
    "# HELP vllm:num_requests_running Number of requests in model execution batches.",
    "# TYPE vllm:num_requests_running gauge",
    'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
    'vllm:num_requests_running{engine="1",model_name="m"} 1.0',
    'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0',
    'vllm:num_requests_waiting{engine="1",model_name="m"} 0.0',
    'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
    'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5',
    "# TYPE vllm:cache_config_info gauge",
    _info(0, "32768"),
    _info(1, "32768"),
    'vllm:num_preemptions_total{engine="0",model_name="m"} 7.0',
])  # fmt: skip


def test_gauges_and_the_cache_size_are_summed_over_a_pods_engines():
    load = parse_engine_load(TWO_ENGINES)
    assert load == {"running": 4.0, "waiting": 2.0, "kv_usage": 0.75, "kv_blocks": 65536}


def test_a_cache_size_not_yet_known_or_under_another_label_is_left_out():
    # num_gpu_blocks is "None" until the engine has profiled its memory
    text = "\n".join([
        _info(0, "None"),
        _info(1, "99", label="num_gpu_blocks_override"),
        'vllm:num_requests_running{engine="0"} 1.0',
    ])  # fmt: skip
    assert parse_engine_load(text) == {"running": 1.0}
