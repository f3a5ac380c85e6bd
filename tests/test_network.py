"""helpers.topics.bandwidth's links and the launcher's rank placement, without launching (the launches are in test_bandwidth_runs.py)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from helpers.core import launch
from helpers.topics import bandwidth


def test_shaping_is_a_token_bucket_of_one_segment_or_nothing():
    assert bandwidth.shaping_command(None) == []
    assert bandwidth.shaping_command(400) == ["tbf", "rate", "400mbit", "burst", str(64 * 1024), "latency", "200ms"]


@pytest.mark.parametrize("rate", [0, -5, 0.01, 200_000, "fast", True])
def test_bad_rates_are_refused_before_anything_is_created(rate, monkeypatch):
    monkeypatch.setattr(bandwidth, "_run", lambda argv: pytest.fail(f"ran {argv}"))
    with pytest.raises(ValueError, match="rate_mbit"):
        with bandwidth.rate_limited_link(2, rate):
            pass
    with pytest.raises(ValueError, match="rate_mbit"):
        bandwidth.set_rate_spec("r", rate)


@pytest.mark.parametrize("world", [1, 0, 201, 2.5])
def test_a_link_needs_two_to_two_hundred_ranks(world, monkeypatch):
    monkeypatch.setattr(bandwidth, "_run", lambda argv: pytest.fail(f"ran {argv}"))
    with pytest.raises(ValueError, match="world_size"):
        with bandwidth.rate_limited_link(world, 100):
            pass


def test_where_namespaces_are_not_allowed_the_link_says_why(monkeypatch):
    monkeypatch.setattr(bandwidth, "link_support", lambda: (False, "network namespaces need root"))
    with pytest.raises(bandwidth.NotPermitted, match="need root"):
        with bandwidth.rate_limited_link(2, 100):
            pass


def test_the_rank_prefix_enters_the_ranks_namespace_and_names_its_cable(tmp_path):
    # a stand-in for iproute2's `ip` that prints what it was asked to run
    fake = tmp_path / "ip"
    fake.write_text('#!/bin/sh\necho "$@"\n')
    fake.chmod(0o755)
    link = bandwidth.Link("crs123", 2, 400)
    env = {**os.environ, "LOCAL_RANK": "1", "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    out = subprocess.run([*link.rank_prefix, "python", "-c", "pass"], capture_output=True, text=True, env=env,
                         check=True).stdout.split()
    assert out == ["netns", "exec", "crs123r1", "env", "COURSE_NETNS=crs123r1", "GLOO_SOCKET_IFNAME=eth0",
                   "NCCL_SOCKET_IFNAME=eth0", "python", "-c", "pass"]
    assert link.master_addr == f"{bandwidth.SUBNET}.1"
    assert "400 Mbit/s" in link.describe()


def test_the_launcher_starts_ranks_through_the_prefix_and_finds_rank_0_at_its_address(tmp_path):
    plain = launch.command(tmp_path / "plan.json", 2, 29500)
    placed = launch.command(tmp_path / "plan.json", 2, 29500, rank_prefix=["sh", "-c", "exec \"$@\"", "x"],
                            master_addr="10.213.0.1")
    assert "--master_addr=127.0.0.1" in plain and "--module" in plain
    assert "--master_addr=10.213.0.1" in placed and "--module" not in placed
    tail = placed[placed.index("--no_local_rank") + 1:]
    assert tail[:4] == ["sh", "-c", "exec \"$@\"", "x"]
    assert tail[4:] == [plain[0], "-u", "-m", "helpers.core.train", "--plan", str(tmp_path / "plan.json")]
    # the deepspeed command keeps its old arguments unless an address is given
    assert "--master_addr" not in launch.command(tmp_path / "p.json", 2, 29500, "deepspeed")


def test_nccl_over_sockets_sets_then_restores_the_environment(monkeypatch):
    monkeypatch.setenv("NCCL_P2P_DISABLE", "0")
    monkeypatch.delenv("NCCL_SHM_DISABLE", raising=False)
    with bandwidth.nccl_over_sockets() as settings:
        assert os.environ["NCCL_P2P_DISABLE"] == "1" and os.environ["NCCL_SHM_DISABLE"] == "1"
        assert settings["NCCL_NET"] == "Socket" and settings["NCCL_DEBUG"] == "INFO"
    assert os.environ["NCCL_P2P_DISABLE"] == "0"
    assert "NCCL_SHM_DISABLE" not in os.environ


def test_nccl_transports_are_read_from_nccls_own_log(tmp_path):
    log = tmp_path / "launch.log"
    log.write_text("\n".join([
        "gpu0:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM",
        "gpu0:1:1 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/CUMEM",
        "gpu1:2:2 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] [send] via NET/Socket/0",
        "unrelated line via nothing",
    ]))
    assert bandwidth.nccl_transports(log) == {"P2P/CUMEM": 2, "NET/Socket/0": 1}


def test_stale_namespaces_of_dead_processes_are_removed_and_live_ones_kept(monkeypatch):
    deleted = []
    listing = f"crs{os.getpid()}r0 (id: 3)\ncrs999999999r1\nsomeone-else\n"

    def fake_run(argv, **kwargs):
        if argv[:3] == ["ip", "netns", "list"]:
            return subprocess.CompletedProcess(argv, 0, listing, "")
        deleted.append(argv[-1])
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(bandwidth.subprocess, "run", fake_run)
    assert bandwidth.remove_stale_namespaces() == ["crs999999999r1"]
    assert deleted == ["crs999999999r1"]


def test_set_rate_refuses_to_run_outside_a_course_namespace(monkeypatch, tmp_path):
    config = tmp_path / "c.json"
    config.write_text('{"link": {"rate_mbit": 100}}')
    monkeypatch.delenv("COURSE_NETNS", raising=False)
    with pytest.raises(RuntimeError, match="course namespace"):
        bandwidth.set_rate({"config": str(config), "name": "r", "out": str(tmp_path)}, 0, 1, 0.0)


def test_link_support_answers_with_a_reason():
    ok, why = bandwidth.link_support()
    assert isinstance(ok, bool) and why
    assert not any(Path("/var/run/netns").glob(f"{bandwidth.PREFIX}{os.getpid()}*"))  # its probe is gone


def test_the_off_switch_keeps_namespaces_away(monkeypatch):
    monkeypatch.setenv(bandwidth.OFF_SWITCH, "1")
    monkeypatch.setattr(bandwidth, "_run", lambda argv: pytest.fail(f"ran {argv}"))
    assert bandwidth.link_support() == (False, f"turned off by {bandwidth.OFF_SWITCH}=1")
