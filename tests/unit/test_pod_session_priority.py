"""The real pods' session priority (``bench.vllm_pods.set_session_niceness``).

With the kernel's autogroups each new session is a scheduling group, and between groups
only the group's nice counts: a pod started under ``nice -n 10`` in a session of its own
still starved a gateway beside it for seconds. These tests start a real process in a
new session, as ``VllmServer.start`` does, and read back what the kernel holds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.vllm_pods import set_session_niceness

AUTOGROUP = Path("/proc/self/autogroup")


def autogroup_name(autogroup_file: Path) -> str:
    """The group a process is in, e.g. ``/autogroup-42``. The kernel prints nothing for
    a process in init's default group (one that never started a session of its own,
    as a CI runner may be), so that group gets a name here."""
    fields = autogroup_file.read_text().split()
    return fields[0] if fields else "(the default group)"


@pytest.fixture
def session_leader():
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not AUTOGROUP.exists(),
                    reason=f"this kernel has no scheduler autogroups ({sys.platform}; no "
                    f"{AUTOGROUP}): `nice -n` alone ranks the pods")  # fmt: skip
def test_a_new_sessions_autogroup_takes_the_pods_niceness(session_leader):
    before = Path(f"/proc/{session_leader}/autogroup").read_text()
    assert before.rstrip().endswith("nice 0"), before  # a new group starts at 0

    assert set_session_niceness(session_leader, 10) is True
    after = Path(f"/proc/{session_leader}/autogroup").read_text()
    assert after.rstrip().endswith("nice 10"), after
    # the group is the new session's own, not the test runner's
    assert autogroup_name(Path(f"/proc/{session_leader}/autogroup")) != autogroup_name(AUTOGROUP)


def test_no_autogroup_to_set_is_reported_not_raised():
    assert set_session_niceness(2**22 + 12345, 10) is False  # no such process
