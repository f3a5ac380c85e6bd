"""py-cpuinfo's answer about this processor, asked once per machine instead of twice per DeepSpeed op per rank.

Every time a process loads one of DeepSpeed's CPU ops (``fused_adam`` for a config's Adam on CPU ranks,
``cpu_adam`` for optimizer offload), the op builder asks ``cpuinfo.get_cpu_info()`` twice (``cpu_arch`` and
``simd_width``: ``-march`` and the SIMD width of its compile flags), even when the op is already built; each
``DeepSpeedCPUAdam`` asks once more (the processor's vendor). Each answer costs about a second and a half: py-cpuinfo starts a Python process that times the processor's clock
over a one-second sleep. A launch of two ranks paid that on every rank, in every launch.

:func:`remember` makes this process's ``cpuinfo.get_cpu_info`` read the answer from a small file beside
DeepSpeed's built ops, written by the first process that asked. The file is named after this processor (its
model and feature flags in ``/proc/cpuinfo``): a machine with another processor, sharing the folder, asks
py-cpuinfo itself. DeepSpeed then chooses exactly the flags it chose before, so no op is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Callable

from helpers.core import environment

#: What DeepSpeed reads from py-cpuinfo's answer: its op builders (``op_builder/builder.py``) the first two,
#: ``DeepSpeedCPUAdam`` and ``DeepSpeedCPULion`` the vendor.
KEYS = ("arch", "flags", "vendor_id_raw")


def processor_key(cpuinfo_text: str, machine: str) -> str | None:
    """A name for this processor: a hash of ``machine`` (``x86_64``) and the model name and feature flags of
    the first processor listed in ``cpuinfo_text`` (``/proc/cpuinfo``); None when the text lists no flags."""
    fields = {}
    for line in cpuinfo_text.splitlines():
        if not line.strip():
            break  # the first processor's block ends here
        name, _, value = line.partition(":")
        fields[name.strip()] = value.strip()
    flags = fields.get("flags") or fields.get("Features")  # x86 / ARM
    if not flags:
        return None
    return hashlib.sha256(f"{machine}\n{fields.get('model name', '')}\n{flags}".encode()).hexdigest()[:16]


def cache_file(folder: Path | None = None) -> Path | None:
    """Where this processor's answer is kept: ``cpu-info-<key>.json`` in ``folder`` (default: DeepSpeed's
    built ops, ``$TORCH_EXTENSIONS_DIR``); None where there is no such folder or no ``/proc/cpuinfo``."""
    if folder is None:
        chosen = os.environ.get("TORCH_EXTENSIONS_DIR")
        folder = Path(chosen) if chosen else environment.extensions_dir()
    try:
        key = processor_key(Path("/proc/cpuinfo").read_text(), platform.machine())
    except OSError:
        return None
    return folder / f"cpu-info-{key}.json" if folder is not None and key else None


def cached(ask: Callable[[], dict], path: Path) -> Callable[[], dict]:
    """A ``get_cpu_info`` that returns the ``KEYS`` of ``ask()``'s answer, read from ``path`` when it exists,
    else asked once and written there (atomically: ranks that ask together each write the same answer)."""
    answer: dict = {}

    def get_cpu_info() -> dict:
        if not answer:
            try:
                answer.update(json.loads(path.read_text()))
            except (OSError, ValueError):
                answer.update({k: v for k, v in ask().items() if k in KEYS})
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    partial = path.with_name(f"{path.name}.{os.getpid()}")
                    partial.write_text(json.dumps(answer))
                    partial.replace(path)
                except OSError:  # a read-only folder: this process keeps its answer in memory
                    pass
        return dict(answer)

    get_cpu_info.__wrapped__ = ask  # the original, for tests and for anyone who needs py-cpuinfo's full answer
    return get_cpu_info


def remember(folder: Path | None = None) -> bool:
    """Make ``cpuinfo.get_cpu_info`` answer from this processor's cache file (:func:`cache_file`), so DeepSpeed's
    op builders ask py-cpuinfo once per machine. Returns whether it did (not without py-cpuinfo or a cache
    folder). Call it before DeepSpeed loads an op; calling it again changes nothing."""
    try:
        import cpuinfo  # deferred: py-cpuinfo comes with DeepSpeed
    except ImportError:
        return False
    path = cache_file(folder)
    if path is None:
        return False
    if not hasattr(cpuinfo.get_cpu_info, "__wrapped__"):
        cpuinfo.get_cpu_info = cached(cpuinfo.get_cpu_info, path)
    return True
