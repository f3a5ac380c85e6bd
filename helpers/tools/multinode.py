"""Several machines through DeepSpeed's own multi-node runner, proved on one machine.

:func:`helpers.core.launch.run` with :class:`helpers.core.launch.Hosts` hands a DeepSpeed hostfile (and
``--include``/``--exclude``) to ``deepspeed.launcher.runner``, which starts one
``deepspeed.launcher.launch`` per host over pdsh and ssh. To check that path without a cluster,
:class:`LocalCluster` gives this machine two host names (``course-node-a``, ``course-node-b``) in a private
ssh config, served by a private sshd that listens on 127.0.0.1 only and lets the current user in with a
key made for it; nothing outside ``runs/multinode/`` is touched (no ``/etc/hosts``, no ``~/.ssh``).
:func:`compare_with_single_node` then trains the same run on 2 "nodes" x 1 rank and on 1 node x 2 ranks
and compares the records: losses, model-state bytes per rank, collective counts and bytes.

Needs ``ssh``, ``sshd`` and ``pdsh`` (Debian: ``apt-get install openssh-server pdsh``), and, for sshd's
privilege separation, root (:func:`missing`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from helpers.core import launch, records

HOST_NAMES = ("course-node-a", "course-node-b")
SSHD = "/usr/sbin/sshd"


def missing() -> str | None:
    """Why a local multi-node run cannot be made here, or None when it can."""
    for tool in ("ssh", "ssh-keygen", "pdsh"):
        if not shutil.which(tool):
            return f"{tool} is not installed (Debian: apt-get install openssh-server pdsh)"
    if not Path(SSHD).exists():
        return f"{SSHD} is not installed (Debian: apt-get install openssh-server)"
    if os.geteuid() != 0:
        return "sshd's privilege separation needs root to start a private sshd"
    return None


def _free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalCluster:
    """Two host names for this machine, reachable by ssh through a private sshd on 127.0.0.1.

    Use as a context manager: inside it, ``ssh course-node-a`` works for this process and the processes
    it starts (a wrapper ``ssh`` that reads the private config comes first on ``PATH``), and
    :attr:`hosts` is the :class:`helpers.core.launch.Hosts` to hand to :func:`helpers.core.launch.run`.
    """

    def __init__(self, folder: Path | None = None, slots: int = 1):
        self.folder = Path(folder or launch.RUNS_DIR / "multinode" / "cluster").resolve()
        self.slots = slots
        self.port = 0
        self.sshd: subprocess.Popen | None = None
        self._old_path: str | None = None

    @property
    def hosts(self) -> launch.Hosts:
        return launch.Hosts(hostfile=self.folder / "hostfile", master_addr="127.0.0.1")

    def _write_files(self) -> None:
        f = self.folder
        if f.exists():
            shutil.rmtree(f)
        (f / "bin").mkdir(parents=True)
        for key in ("host_key", "user_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"course {key}", "-f", str(f / key)],
                           check=True)
        (f / "authorized_keys").write_text((f / "user_key.pub").read_text())
        (f / "sshd_config").write_text("\n".join([
            f"ListenAddress 127.0.0.1:{self.port}", f"HostKey {f / 'host_key'}",
            f"AuthorizedKeysFile {f / 'authorized_keys'}", f"PidFile {f / 'sshd.pid'}",
            "PasswordAuthentication no", "KbdInteractiveAuthentication no", "PubkeyAuthentication yes",
            "PermitRootLogin prohibit-password", "UsePAM no", "StrictModes no", "PrintMotd no",
            "AcceptEnv no", "LogLevel ERROR", ""]))
        hosts = " ".join(HOST_NAMES)
        (f / "ssh_config").write_text("\n".join([
            f"Host {hosts}", "  HostName 127.0.0.1", f"  Port {self.port}", f"  IdentityFile {f / 'user_key'}",
            "  IdentitiesOnly yes", "  StrictHostKeyChecking no", "  UserKnownHostsFile /dev/null",
            "  BatchMode yes", "  LogLevel ERROR", ""]))
        wrapper = f / "bin" / "ssh"
        wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {f / "ssh_config"} "$@"\n')
        wrapper.chmod(0o755)
        (f / "hostfile").write_text("".join(f"{h} slots={self.slots}\n" for h in HOST_NAMES))
        for path in f.iterdir():
            if path.is_file() and path.suffix != ".pub" and path.name != "ssh":
                path.chmod(0o600)

    def __enter__(self) -> "LocalCluster":
        reason = missing()
        if reason:
            raise RuntimeError(f"no local multi-node cluster here: {reason}")
        self.port = _free_loopback_port()
        self._write_files()
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        self.sshd = subprocess.Popen([SSHD, "-D", "-e", "-f", str(self.folder / "sshd_config")],
                                     stdout=subprocess.DEVNULL, stderr=open(self.folder / "sshd.log", "w"))
        self._old_path = os.environ.get("PATH", "")
        os.environ["PATH"] = f"{self.folder / 'bin'}{os.pathsep}{self._old_path}"
        deadline = time.monotonic() + 20
        while True:  # wait until both names answer
            checks = [subprocess.run(["ssh", h, "true"], capture_output=True, timeout=20) for h in HOST_NAMES]
            if all(c.returncode == 0 for c in checks):
                break
            if self.sshd.poll() is not None or time.monotonic() > deadline:
                self.__exit__(None, None, None)
                log = (self.folder / "sshd.log").read_text()[-2000:]
                raise RuntimeError(f"the private sshd did not let ssh in: {checks[-1].stderr.decode()[-500:]} {log}")
            time.sleep(0.2)
        return self

    def __exit__(self, *exc) -> None:
        if self._old_path is not None:
            os.environ["PATH"] = self._old_path
            self._old_path = None
        if self.sshd is not None:
            self.sshd.terminate()
            try:
                self.sshd.wait(10)
            except subprocess.TimeoutExpired:
                self.sshd.kill()
            self.sshd = None


@dataclasses.dataclass
class Comparison:
    """A multi-node run against the same run on one node, figure by figure."""

    multi: records.Record
    single: records.Record
    rows: list[tuple[str, str, str, bool]]  # what, multi-node, single-node, equal

    @property
    def equal(self) -> bool:
        return all(row[3] for row in self.rows)

    def table(self) -> str:
        return records.format_table([[w, m, s, "yes" if e else "NO"] for w, m, s, e in self.rows],
                                    ["figure", "2 hosts x 1 rank", "1 host x 2 ranks", "same"])


def compare(multi: records.Record, single: records.Record) -> Comparison:
    """Losses (within the precision's tolerance), model-state bytes of each rank, and each collective's
    count and bytes per step of two records."""
    rows = [("ranks", str(multi["world_size"]), str(single["world_size"]), multi["world_size"] == single["world_size"]),
            ("losses", records.loss_agreement(multi.losses, single.losses, multi["precision"]), "",
             records.loss_agreement(multi.losses, single.losses, multi["precision"]).startswith("within"))]
    for rank in range(multi["world_size"]):
        a, b = multi.states(rank), single.states(rank)
        rows.append((f"model-state bytes, rank {rank}", f"{sum(a.values()):,}", f"{sum(b.values()):,}", a == b))
    ops_a, ops_b = multi.comm_ops(), single.comm_ops()
    for op in sorted(set(ops_a) | set(ops_b)):
        a, b = ops_a.get(op, {"count": 0, "bytes": 0}), ops_b.get(op, {"count": 0, "bytes": 0})
        rows.append((f"{op} per step", f"{a['count']:g} calls, {a['bytes']:,.0f} B",
                     f"{b['count']:g} calls, {b['bytes']:,.0f} B", a == b))
    return Comparison(multi, single, rows)


def compare_with_single_node(config: str = "zero2", model: str = "mlp", steps: int = 3,
                             timeout: float = 300) -> Comparison:
    """Train ``config`` on 2 local "hosts" x 1 rank through DeepSpeed's pdsh runner, then on 1 host x 2
    ranks (the course's usual launch), and compare the two records; both are kept under
    ``runs/multinode/`` and the comparison in ``runs/multinode/comparison.json``."""
    probes = ("model_states", "comm", "timing")
    folder = launch.RUNS_DIR / "multinode"
    with LocalCluster(folder / "cluster") as cluster:
        multi = launch.run(config, model=model, steps=steps, name="two-hosts", out=folder / "two-hosts",
                           probes=probes, hosts=cluster.hosts, timeout=timeout, progress=False)
    single = launch.run(config, model=model, steps=steps, world_size=multi["world_size"], name="one-host",
                        out=folder / "one-host", probes=probes, timeout=timeout, progress=False)
    result = compare(multi, single)
    (folder / "comparison.json").write_text(json.dumps({
        "equal": result.equal, "rows": result.rows, "command": (folder / "two-hosts" / "command.txt").read_text(),
        "hostfile": (folder / "cluster" / "hostfile").read_text()}, indent=1))
    return result
