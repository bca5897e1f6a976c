"""The gateway settles its heap (``gateway.heap``) once started and after each reload:
garbage cycles from before are collected then, and what is alive is frozen."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from tests.inproc.harness import FAST, file_configured_gateway, inproc_gateway
from tests.unit.test_heap import Node


@pytest.fixture
def collector_off() -> Iterator[None]:
    """Only the gateway's own collection frees a cycle while the test runs."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def test_start_up_collects_cycles_and_freezes_the_gateway(pod_a, collector_off):
    garbage = Node()
    ref = weakref.ref(garbage)
    del garbage

    async with inproc_gateway(pod_a) as g:
        assert ref() is None
        frozen = {id(o) for o in gc.get_objects()}  # what the collector still walks
        assert id(g.gw) not in frozen and id(g.gw.router) not in frozen
        assert (await g.chat()).status_code == 200


async def test_a_reload_that_changes_settings_collects_the_cycles_dropped_before_it(
    tmp_path, pod_a, collector_off
):
    config = tmp_path / "kvgate.yaml"
    settings = f"pods: [{{name: {pod_a.name}, url: '{pod_a.url}'}}]\nhealth: {FAST['health']}\n"
    config.write_text(settings)
    async with file_configured_gateway(config) as g:
        garbage = Node()
        ref = weakref.ref(garbage)
        del garbage

        config.write_text(settings + "strategy: least-loaded\n")
        r = await g.admin.post("/admin/reload")
        assert r.json()["changed"] == ["strategy"]
        assert ref() is None
