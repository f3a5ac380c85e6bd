"""Slower networks on one machine, for real: the links a run's collectives travel, and how to constrain them.

Two ways, both confined to this machine and undone when their ``with`` block ends:

- :func:`rate_limited_link` (CPU ranks, gloo): every rank in a network namespace of its own, the
  namespaces joined by virtual Ethernet (``veth``) cables to one bridge, each rank's cable limited to a
  rate by a token-bucket filter (``tc ... tbf``), like a node's network card. Only addresses inside
  these namespaces are used; nothing reaches the host's own network. Needs root (``CAP_NET_ADMIN`` and
  ``CAP_SYS_ADMIN``) and ``ip``/``tc`` (iproute2); :func:`link_support` says whether, and why not.
- :func:`nccl_over_sockets` (GPU ranks, NCCL): NCCL kept off NVLink/PCIe peer-to-peer and shared
  memory, so its traffic goes through TCP sockets on the loopback interface; the environment is
  restored afterwards.

What DeepSpeed does on CPU, for the record (0.19.8, ``deepspeed/comm/torch.py`` and
``csrc/cpu/comm/shm_interface.cpp``): training collectives (``deepspeed.comm.all_reduce``,
``all_gather_into_tensor``, ...) always go to ``torch.distributed``, i.e. gloo over TCP sockets, even
between two processes on one machine. DeepSpeed's shared-memory kernel serves only
``deepspeed.comm.inference_all_reduce``; it is set up when the ``LOCAL_SIZE`` variable that DeepSpeed's
launcher gives each rank equals the world size, and used when the ``deepspeed_shm_comm`` op loaded
(``torch.ops.deepspeed.inference_all_reduce_`` exists) and the processor has the kernel's instructions.
:mod:`helpers.collectives` measures both paths and, inside these namespaces, the bytes each puts on
the wire.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

#: Names of the course's namespaces: ``crs<pid>h`` (the bridge) and ``crs<pid>r<rank>``.
PREFIX = "crs"
_NAME = re.compile(rf"^{PREFIX}(\d+)(h|r\d+)$")
#: The namespaces' private subnet (only ever configured inside them).
SUBNET = "10.213.0"
INTERFACE = "eth0"  # each rank's cable, inside its namespace
MAX_RANKS = 200

#: NCCL's settings that keep it off NVLink, PCIe peer-to-peer, shared memory and InfiniBand.
NCCL_SOCKETS = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket",
                "NCCL_SOCKET_IFNAME": "lo"}
#: NCCL says which transport each channel uses at this log level (``... via P2P/IPC``, ``via NET/Socket/0``).
NCCL_SHOW_TRANSPORT = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT"}


class NotPermitted(RuntimeError):
    """This machine does not let the course build namespaces or shape traffic (the message says why)."""


def _run(argv: list[str]) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if result.returncode:
        raise NotPermitted(f"`{' '.join(argv)}` failed: {(result.stderr or result.stdout).strip()}")
    return result.stdout


#: Set to 1 to keep the course from building namespaces even where it could (the slow-link parts skip).
OFF_SWITCH = "COURSE_NO_NAMESPACES"


def link_support() -> tuple[bool, str]:
    """Whether :func:`rate_limited_link` can run here, and why not: the off switch, tools, privileges, and a
    test namespace with a bridge and a rate limit, created and deleted."""
    if os.environ.get(OFF_SWITCH) == "1":
        return False, f"turned off by {OFF_SWITCH}=1"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) is not installed"
    if os.geteuid() != 0:
        return False, "network namespaces and traffic shaping need root (CAP_NET_ADMIN, CAP_SYS_ADMIN)"
    probe = f"{PREFIX}{os.getpid()}h"
    try:
        _run(["ip", "netns", "add", probe])
        _run(["ip", "-n", probe, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "br0", "root", "tbf", "rate", "1mbit",
              "burst", "32kb", "latency", "50ms"])
    except NotPermitted as refused:
        return False, str(refused)
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return True, "root, iproute2, namespaces, bridges and tbf all work here"


def remove_stale_namespaces() -> list[str]:
    """Delete the course's namespaces whose creating process is gone (a killed kernel), and name them."""
    try:
        listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    stale = []
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NAME.match(name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
            stale.append(name)
    return stale


@dataclasses.dataclass(frozen=True)
class Link:
    """A rate-limited network between ranks, each in its own namespace (see :func:`rate_limited_link`)."""

    prefix: str  # rank r lives in namespace f"{prefix}r{r}"
    world_size: int
    rate_mbit: float | None  # per rank and direction; None: the virtual cable's own speed

    @property
    def master_addr(self) -> str:
        """Rank 0's address: where the others find its TCP store."""
        return f"{SUBNET}.1"

    def namespace(self, rank: int) -> str:
        return f"{self.prefix}r{rank}"

    @property
    def rank_prefix(self) -> list[str]:
        """The command DeepSpeed's launcher starts each rank through: it enters the namespace of rank
        ``$LOCAL_RANK`` and tells gloo and NCCL to use the rank's cable (``helpers.launch`` appends the
        rank's own command)."""
        script = ('ns="$0r$LOCAL_RANK"; exec ip netns exec "$ns" env COURSE_NETNS="$ns" '
                  f'GLOO_SOCKET_IFNAME={INTERFACE} NCCL_SOCKET_IFNAME={INTERFACE} "$@"')
        return ["sh", "-c", script, self.prefix]

    def describe(self) -> str:
        rate = f"{self.rate_mbit:g} Mbit/s" if self.rate_mbit else "unlimited"
        return (f"{self.world_size} ranks, one network namespace each ({self.prefix}r0..r{self.world_size - 1}), "
                f"veth cables to a bridge, {rate} per rank and direction")


#: Token-bucket size: one 64 KiB segment, the largest the kernel hands a virtual cable at once (GSO).
#: A larger bucket lets whole small messages pass at the cable's own speed (measured: a 256 KiB
#: all-reduce at 2.5x the set rate with a 500 KB bucket); a smaller one stalls on those segments.
BURST_BYTES = 64 * 1024


def shaping_command(rate_mbit: float | None) -> list[str]:
    """``tc`` arguments after ``tc qdisc replace dev IF root``: a token-bucket filter of ``rate_mbit`` with a
    bucket of :data:`BURST_BYTES` and a queue of at most 200 ms (nothing for ``None``: no limit)."""
    if rate_mbit is None:
        return []
    return ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(BURST_BYTES), "latency", "200ms"]


def _check_rate(rate_mbit: float | None) -> None:
    if rate_mbit is not None and (isinstance(rate_mbit, bool) or not isinstance(rate_mbit, (int, float))
                                  or not 0.1 <= rate_mbit <= 100_000):
        raise ValueError(f"rate_mbit={rate_mbit!r}: give a rate between 0.1 and 100000 Mbit/s, or None for no limit")


@contextlib.contextmanager
def rate_limited_link(world_size: int, rate_mbit: float | None) -> Iterator[Link]:
    """Namespaces for ``world_size`` ranks joined through a bridge, each rank's cable shaped to ``rate_mbit``
    (its sending side: like a network card); all of it deleted when the block ends, whatever happens.

    Raises :class:`NotPermitted` (with the reason) where the machine does not allow it, before creating
    anything, and ValueError for a bad rate. Pass ``link.rank_prefix`` and ``link.master_addr`` to
    :func:`helpers.launch.sweep`.
    """
    if not isinstance(world_size, int) or not 2 <= world_size <= MAX_RANKS:
        raise ValueError(f"world_size={world_size!r}: a link joins 2 to {MAX_RANKS} ranks")
    _check_rate(rate_mbit)
    ok, why = link_support()
    if not ok:
        raise NotPermitted(why)
    remove_stale_namespaces()
    link = Link(f"{PREFIX}{os.getpid()}", world_size, rate_mbit)
    hub = f"{link.prefix}h"
    created = []
    try:
        _run(["ip", "netns", "add", hub])
        created.append(hub)
        _run(["ip", "-n", hub, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", hub, "link", "set", "br0", "up"])
        for rank in range(world_size):
            ns = link.namespace(rank)
            _run(["ip", "netns", "add", ns])
            created.append(ns)
            _run(["ip", "-n", hub, "link", "add", f"p{rank}", "type", "veth", "peer", "name", INTERFACE, "netns", ns])
            _run(["ip", "-n", hub, "link", "set", f"p{rank}", "master", "br0"])
            _run(["ip", "-n", hub, "link", "set", f"p{rank}", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{SUBNET}.{rank + 1}/24", "dev", INTERFACE])
            _run(["ip", "-n", ns, "link", "set", INTERFACE, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            shaping = shaping_command(rate_mbit)
            if shaping:
                _run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", INTERFACE, "root", *shaping])
        yield link
    finally:
        for ns in reversed(created):  # a namespace takes its cables and their shaping with it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def set_rate(run: dict, position: int, count: int, born: float) -> None:
    """Rank-side task (``RunSpec(task="helpers.network:set_rate")``): reshape this rank's own cable to the
    plan's ``link.rate_mbit`` between two runs of one launch, then publish what
    ``tc`` now says. Only inside a course namespace (``COURSE_NETNS``); refused elsewhere."""
    import json

    namespace = os.environ.get("COURSE_NETNS", "")
    if not _NAME.match(namespace):
        raise RuntimeError("set_rate runs only in ranks placed in a course namespace (network.rate_limited_link)")
    import deepspeed.comm as dist
    import torch.distributed

    from helpers.train import publish

    with open(run["config"]) as f:
        wanted = json.load(f)["link"]
    shaping = shaping_command(wanted.get("rate_mbit"))
    if shaping:
        _run(["tc", "qdisc", "replace", "dev", INTERFACE, "root", *shaping])
    else:
        subprocess.run(["tc", "qdisc", "del", "dev", INTERFACE, "root"], capture_output=True, timeout=30)
    shown = _run(["tc", "qdisc", "show", "dev", INTERFACE]).strip()
    torch.distributed.barrier()
    if dist.get_rank() == 0:
        publish(run, position, {"name": run["name"], "task": "set_rate", "namespace": namespace, "tc": shown,
                                **wanted})


def set_rate_spec(name: str, rate_mbit: float | None):
    """A :class:`helpers.launch.RunSpec` for :func:`set_rate` (checked before anything starts)."""
    from helpers import launch

    _check_rate(rate_mbit)
    return launch.RunSpec(config={"link": {"rate_mbit": rate_mbit}}, name=name, steps=1, probes=(), check=False,
                          task="helpers.network:set_rate", out=launch.RUNS_DIR / name)


@contextlib.contextmanager
def nccl_over_sockets(show_transport: bool = True) -> Iterator[dict[str, str]]:
    """Within the block, runs started by :mod:`helpers.launch` keep NCCL off NVLink, peer-to-peer and shared
    memory (:data:`NCCL_SOCKETS`), so collectives go through TCP sockets on this machine's loopback; with
    ``show_transport`` NCCL also logs the transport of each channel (see :func:`nccl_transports`).
    The previous environment is restored when the block ends."""
    settings = {**NCCL_SOCKETS, **(NCCL_SHOW_TRANSPORT if show_transport else {})}
    with environment_set(settings):
        yield settings


@contextlib.contextmanager
def environment_set(settings: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the block (runs launched inside inherit them), then restore them."""
    before = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


_TRANSPORT = re.compile(r"via (\S+)")


def nccl_transports(launch_log: str | Path) -> dict[str, int]:
    """Transport -> channels, from NCCL's ``Channel xx/yy : a[a] -> b[b] via P2P/CUMEM`` lines in a launch's log
    (written when ``NCCL_DEBUG=INFO``): what NCCL really used."""
    found: dict[str, int] = {}
    for line in Path(launch_log).read_text(errors="replace").splitlines():
        if "Channel" in line and " via " in line:
            match = _TRANSPORT.search(line)
            if match:
                found[match.group(1)] = found.get(match.group(1), 0) + 1
    return found
