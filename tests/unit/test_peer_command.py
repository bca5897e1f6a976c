"""The peer routers' command lines (bench/peers.py): each policy gets only the flags the
peer accepts with it."""

from pathlib import Path

import pytest

from bench.peers import PodEndpoint, peer_command

PODS = [PodEndpoint("http://127.0.0.1:9001", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"),
        PodEndpoint("http://127.0.0.1:9002", "tcp://127.0.0.1:5559")]  # fmt: skip


def command(name: str, policy: str | None) -> list[str]:
    return peer_command(name, Path("/bin"), 8100, PODS, "m", 32, policy)


def test_vllm_router_kv_aware_follows_every_pods_events_and_replay():
    cmd = command("vllm-router", "kv_aware")
    sources = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--kv-event-source"]
    replays = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--kv-event-replay-source"]
    assert sources == [f"{p.url}={p.events}" for p in PODS]
    assert replays == [f"{PODS[0].url}={PODS[0].replay}"]
    assert cmd[cmd.index("--kv-event-block-size") + 1] == "32"


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin"])
def test_other_vllm_router_policies_get_no_event_flags_which_it_refuses(policy):
    # vllm-router 0.1.17 exits with "--kv-event-source requires the kv_aware policy".
    cmd = command("vllm-router", policy)
    assert cmd[cmd.index("--policy") + 1] == policy
    assert not [a for a in cmd if a.startswith("--kv-event")]


def test_sglang_router_gets_its_policy_and_the_pods():
    cmd = command("sglang-router", None)
    assert cmd[cmd.index("--policy") + 1] == "cache_aware"
    assert cmd[cmd.index("--worker-urls") + 1 : cmd.index("--worker-urls") + 3] == [
        p.url for p in PODS
    ]


def test_a_peers_url_is_a_plain_string_that_carries_its_process_id() -> None:
    from bench.peers import PeerURL

    url = PeerURL("http://127.0.0.1:8000", 4242)

    assert (url, url.pid, f"{url}/v1") == (
        "http://127.0.0.1:8000",
        4242,
        "http://127.0.0.1:8000/v1",
    )
