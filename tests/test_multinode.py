"""DeepSpeed's multi-node runner for real: two host names for this machine (a private sshd on 127.0.0.1),
pdsh over ssh, one rank per "node"; the record must equal a one-node run's. Skipped, with the reason,
where ssh, sshd or pdsh are missing (CI installs them: .ci/run)."""

from __future__ import annotations

import pytest

from helpers.tools import multinode

#: Not in the README's test command: `python3 -m helpers.course test --system` (and .ci/run) runs it.
pytestmark = pytest.mark.system

REASON = multinode.missing()


@pytest.mark.skipif(REASON is not None, reason=f"no local multi-node run here: {REASON}")
def test_two_hosts_write_the_same_record_as_one_host():
    result = multinode.compare_with_single_node("zero2", "mlp", steps=3)
    assert result.equal, result.table()
    command = (result.multi.out / "command.txt").read_text()
    assert "deepspeed.launcher.runner" in command and "--hostfile" in command and "--launcher pdsh" in command
    assert result.multi["world_size"] == 2
    assert [len(r) for r in result.multi.summary["losses_per_rank"]] == [3, 3]


def test_missing_says_what_to_install(monkeypatch):
    monkeypatch.setattr(multinode.shutil, "which", lambda name: None)
    assert "apt-get install openssh-server pdsh" in multinode.missing()
