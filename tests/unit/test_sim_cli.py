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


def test_profile_sets_timing_and_single_flags_override_it():
    cfg = parse("--profile", "original", "--block-size", "32", "--itl-ms", "7")
    timing = cfg.timing()
    assert timing.kv_bytes_per_token == 57_344
    assert round(timing.prefill_tokens_per_s) == 3653
    assert round(cfg.l2_latency_s * 1000, 1) == 124.6
    assert cfg.l0_capacity_blocks == 110_000 // 32
    assert (cfg.itl_s, cfg.itl_per_seq_s) == (0.007, 0.0002)


def test_tier_flags_map_onto_l1_and_shared_l2_settings(tmp_path):
    cfg = parse(
        "--l1-capacity-blocks", "100", "--l1-policy", "evict", "--l1-gb-per-s", "8",
        "--l2-dir", str(tmp_path), "--l2-capacity-blocks", "50", "--l2-latency-ms", "3",
        "--l2-events", "none", "--l2-hash-seed", "fleet", "--port", "9001",
    )  # fmt: skip
    assert (cfg.l1_capacity_blocks, cfg.l1_policy, cfg.l1_bandwidth_bytes_per_s) == (
        100,
        "evict",
        8e9,
    )
    assert (cfg.l2_dir, cfg.l2_capacity_blocks, cfg.l2_latency_s) == (tmp_path, 50, 0.003)
    assert (cfg.l2_events, cfg.l2_hash_seed, cfg.pod_name) == ("none", "fleet", "127.0.0.1:9001")
