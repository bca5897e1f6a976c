"""The shared L2 directory: presence on disk, atomic files, LRU capacity."""

import os
import time

from bench.sim.l2dir import DirL2


def test_a_second_instance_finds_blocks_the_first_wrote(tmp_path):
    writer, reader = DirL2(tmp_path, 100), DirL2(tmp_path, 100)
    result = writer.put([b"\x01", b"\x02"], "pod-a")
    assert (result.stored, result.evicted) == ([b"\x01", b"\x02"], [])
    assert reader.held([b"\x01", b"\x02", b"\x03"], 0) == 2
    assert reader.held([b"\x01", b"\x02"], 1) == 1
    assert reader.writers([b"\x01", b"\x09"]) == ["pod-a", ""]
    assert sorted(os.listdir(tmp_path)) == ["01", "02"]  # no temp files left behind


def test_present_blocks_are_touched_not_rewritten(tmp_path):
    l2 = DirL2(tmp_path, 100)
    l2.put([b"\xaa"], "pod-a")
    assert l2.put([b"\xaa"], "pod-b").stored == []
    assert (tmp_path / "aa").read_text() == "pod-a"


def test_over_capacity_the_least_recently_used_files_go_down_to_90_percent(tmp_path):
    l2 = DirL2(tmp_path, 10)
    keys = [bytes([i]) for i in range(10)]
    for i, key in enumerate(keys):
        l2.put([key], "p")
        os.utime(tmp_path / key.hex(), (time.time() - 100 + i,) * 2)
    l2.touch([keys[0]])  # a hit keeps block 0 warm
    result = l2.put([b"\x63"], "p")
    assert sorted(result.evicted) == [b"\x01", b"\x02"]
    assert len(l2) == 9 and l2.held([keys[0]], 0) == 1


def test_a_sweep_also_notices_files_other_writers_added(tmp_path):
    mine, other = DirL2(tmp_path, 4, sweep_every=1), DirL2(tmp_path, 100)
    other.put([bytes([i]) for i in range(6)], "other")
    assert len(mine.put([b"\x10"], "me").evicted) == 4
    assert len(mine) == 3
