"""``kvgate sim`` flags map onto SimConfig the way vLLM's flags would."""

import argparse

from bench.sim.cli import add_arguments, config_from_args, parse_kv_events
from bench.sim.config import KVEventsSettings


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_vllm_kv_events_config_json_is_honoured():
    raw = (
        '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557",'
        '"replay_endpoint":"tcp://*:5558","topic":"kv-events","buffer_steps":50}'
    )
    assert parse_kv_events(raw, old_shape=False, bytes_hashes=True) == KVEventsSettings(
        endpoint="tcp://*:5557",
        replay_endpoint="tcp://*:5558",
        topic="kv-events",
        buffer_steps=50,
        bytes_hashes=True,
    )


def test_disabled_or_null_publisher_means_no_events():
    assert parse_kv_events(None, False, False) is None
    assert parse_kv_events('{"enable_kv_cache_events":false}', False, False) is None
    raw = '{"enable_kv_cache_events":true,"publisher":"null"}'
    assert parse_kv_events(raw, False, False) is None


def test_flags_set_timing_in_milliseconds_and_vllm_named_fields():
    cfg = parse(
        "--served-model-name", "m", "--block-size", "16", "--max-num-seqs", "4",
        "--overhead-ms", "5", "--itl-ms", "20", "--l0-capacity-blocks", "9",
        "--hash-seed", "vllm-none-hash",
    )  # fmt: skip
    assert (cfg.model, cfg.block_size, cfg.max_num_seqs) == ("m", 16, 4)
    assert (cfg.overhead_s, cfg.itl_s, cfg.l0_capacity_blocks) == (0.005, 0.02, 9)
    assert (cfg.hash_seed, cfg.kv_events) == ("vllm-none-hash", None)


def test_hash_seed_is_random_per_process_by_default():
    assert parse().hash_seed != parse().hash_seed
