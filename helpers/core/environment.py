"""What this machine offers the course: CPU ranks over gloo, or NVIDIA GPUs over NCCL.

Everything a run needs to know about the hardware comes from :func:`detect`, and every
environment variable the ranks get comes from :func:`child_env`, which also says what it
changed and why (known traps, fixed before any process starts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import os
import re
import sys
from pathlib import Path
from typing import Sequence

from helpers.core import ds

#: Repository root (the folder holding ``helpers/``, ``notebooks/``, ``ds_configs/``).
REPO_ROOT = Path(__file__).resolve().parents[2]

#: Environment variable a learner or instructor sets to choose the number of ranks.
WORLD_SIZE_VARIABLE = "COURSE_WORLD_SIZE"

#: ``COURSE_DEVICE=cpu``: the ranks on the CPU (gloo) on a machine with GPUs. :func:`detect` sets it for its own
#: process (a chapter's kernel) when the chapter needs more ranks than the machine has GPUs, so every later run
#: of that chapter takes the same CPU ranks.
DEVICE_VARIABLE = ds.DEVICE_VARIABLE

#: DS_ACCELERATOR as this process found it, before :func:`detect` set it for a CPU-only machine.
_ORIGINAL_DS_ACCELERATOR = os.environ.get("DS_ACCELERATOR")


def shown_path(path: str | Path) -> Path:
    """``path`` as a learner should read it: relative to the course's folder when inside it (the same on
    every machine), else as it is."""
    path = Path(path)
    return path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path


def own_ninja_first(path: str) -> str:
    """``path`` (a PATH value) with this Python's own ``bin`` folder first when it holds ``ninja``.

    DeepSpeed JIT-builds its ops with whichever ``ninja`` PATH finds first. pip installs one into the
    environment (a dependency of deepspeed, 1.13 here) and many systems have another (Debian's 1.11): the two
    keep build logs in different formats, so each switch between them (an activated shell, then a Jupyter
    kernel that is not) rebuilds every op, about 40 s each on 2 cores. The course always uses the
    environment's own.
    """
    own = Path(sys.executable).parent
    if not (own / "ninja").exists():
        return path
    parts = [p for p in path.split(os.pathsep) if p and Path(p) != own]
    return os.pathsep.join([str(own), *parts])


def extensions_dir() -> Path | None:
    """Where DeepSpeed's JIT-built ops go: inside the course's virtual environment (None outside one:
    torch's default, ``~/.cache/torch_extensions``). Two clones share torch's default folder, and each
    build there records its own clone's source paths, so switching between clones rebuilt every op."""
    return Path(sys.prefix) / "torch_extensions" if sys.prefix != sys.base_prefix else None


# This process (a notebook's kernel, a command) and every rank it starts: the same ninja, always, and the
# ops of this environment.
os.environ["PATH"] = own_ninja_first(os.environ.get("PATH", ""))
if extensions_dir() is not None:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))

#: Ranks used on a machine without GPUs: two is the smallest world where ZeRO partitions anything.
CPU_DEFAULT_RANKS = 2

#: Environment variable a learner sets to choose GPUs on a shared box: GPU numbers as ``nvidia-smi``
#: lists them, e.g. ``COURSE_GPUS=2,3``. Passed to DeepSpeed's launcher as it expects (``--include
#: localhost:2,3``, which sets ``CUDA_VISIBLE_DEVICES`` for each rank); ``CUDA_VISIBLE_DEVICES`` set by
#: hand is honoured the same way, as DeepSpeed's own ``deepspeed`` command does.
GPUS_VARIABLE = "COURSE_GPUS"


@dataclasses.dataclass(frozen=True)
class Environment:
    """The hardware a run will use, as seen from this process."""

    device: str  # "cpu" or "cuda"
    device_name: str  # e.g. "CPU (2 cores)" or "NVIDIA H100 80GB HBM3"
    gpu_count: int
    cpu_cores: int
    backend: str  # "gloo" or "nccl"
    default_world_size: int
    world_size_source: str  # why default_world_size has its value
    precisions: tuple[str, ...]  # subset of ("fp32", "bf16", "fp16") that DeepSpeed accepts here
    torch_version: str
    deepspeed_version: str
    gpu_ids: tuple[int, ...] = ()  # GPU numbers (as nvidia-smi lists them) the ranks use
    gpu_source: str = ""  # why these GPUs

    @property
    def is_gpu(self) -> bool:
        return self.device == "cuda"

    def supports(self, precision: str) -> bool:
        """True when DeepSpeed trains in ``precision`` ("fp32", "bf16" or "fp16") on this device."""
        return precision in self.precisions

    def report(self) -> str:
        """A short, learner-facing description of what the course will use and why."""
        lines = [
            f"device           : {self.device_name}",
            f"backend          : {self.backend}",
            f"ranks by default : {self.default_world_size} ({self.world_size_source})",
            f"precisions       : {', '.join(self.precisions)}"
            + ("" if "fp16" in self.precisions else "  (fp16: DeepSpeed refuses it on this device)"),
            f"torch / deepspeed: {self.torch_version} / {self.deepspeed_version}",
        ]
        if self.gpu_ids:
            lines.insert(1, f"GPUs             : {','.join(map(str, self.gpu_ids))} ({self.gpu_source})")
        return "\n".join(lines)


def _cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _cpu_precisions() -> tuple[str, ...]:
    """Ask DeepSpeed's own CPU accelerator which half precisions it accepts."""
    CPU_Accelerator = ds.load("deepspeed.accelerator.cpu_accelerator").CPU_Accelerator

    accelerator = CPU_Accelerator()
    found = ["fp32"]
    if accelerator.is_bf16_supported():
        found.append("bf16")
    if accelerator.is_fp16_supported():
        found.append("fp16")
    return tuple(found)


def _gpu_numbers(value: str, variable: str) -> list[int]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items or not all(v.isdigit() for v in items):
        raise ValueError(f"${variable}={value!r}: give GPU numbers as nvidia-smi lists them, comma-separated "
                         f"(e.g. {variable}=0,1); DeepSpeed's launcher takes no GPU names or UUIDs")
    if len(set(items)) != len(items):
        raise ValueError(f"${variable}={value!r}: a GPU is listed twice")
    return [int(v) for v in items]


def select_gpus(visible: int, course_gpus: str | None = None,
                cuda_visible: str | None = None) -> tuple[tuple[int, ...], tuple[int, ...], str]:
    """Which GPUs the ranks use: (GPU numbers for DeepSpeed's launcher, their indices in this process's
    torch, why).

    ``visible`` is ``torch.cuda.device_count()`` here; ``course_gpus`` is :data:`GPUS_VARIABLE`'s value,
    ``cuda_visible`` ``CUDA_VISIBLE_DEVICES``'s. DeepSpeed's launcher numbers GPUs as the machine does and
    sets ``CUDA_VISIBLE_DEVICES`` for each rank itself, so a hand-set ``CUDA_VISIBLE_DEVICES=2,3`` becomes
    GPUs 2 and 3 (as the ``deepspeed`` command turns it into ``--include localhost:2,3``).
    """
    chosen = _gpu_numbers(course_gpus, GPUS_VARIABLE) if course_gpus is not None and course_gpus.strip() else None
    if visible < 1:
        return (), (), "no GPU"
    if cuda_visible is not None and cuda_visible.strip():
        machine = _gpu_numbers(cuda_visible, "CUDA_VISIBLE_DEVICES")[:visible]
        source = f"CUDA_VISIBLE_DEVICES={cuda_visible}"
    else:
        machine, source = list(range(visible)), "every GPU"
    if chosen is not None:
        missing = [g for g in chosen if g not in machine]
        if missing:
            raise ValueError(f"${GPUS_VARIABLE}={course_gpus}: GPU {', '.join(map(str, missing))} is not among this "
                             f"machine's visible GPUs {','.join(map(str, machine))} ({source}); choose from those")
        source = f"set by ${GPUS_VARIABLE}"
    else:
        chosen = machine
    return tuple(chosen), tuple(machine.index(g) for g in chosen), source


def detect(world_size: int | None = None, min_ranks: int = 1) -> Environment:
    """Detect CPU or GPUs and choose the number of ranks.

    ``world_size`` overrides the default; otherwise ``$COURSE_WORLD_SIZE`` does; otherwise the
    course uses every GPU, or 2 ranks on a machine without GPUs. ``min_ranks`` is what the caller's lesson
    needs (ZeRO partitions nothing on one rank): where fewer GPUs than that were chosen and nobody set the
    number of ranks, the ranks run on the CPU instead, and this process remembers it (:data:`DEVICE_VARIABLE`).
    """
    import torch  # deferred: the commands that run before torch is installed must not import it

    cores = _cpu_cores()
    device_choice = os.environ.get(DEVICE_VARIABLE, "").strip().lower()
    if device_choice not in ("", "cpu"):
        raise ValueError(f"${DEVICE_VARIABLE}={device_choice!r}: set it to 'cpu' (CPU ranks on a machine with GPUs), "
                         "or unset it")
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu_ids, indices, gpu_source = select_gpus(visible, os.environ.get(GPUS_VARIABLE),
                                               os.environ.get("CUDA_VISIBLE_DEVICES"))
    gpus = len(gpu_ids)
    cpu_source = "no GPU: 2 CPU ranks"
    if gpus and device_choice == "cpu":
        gpus, gpu_ids, cpu_source = 0, (), f"${DEVICE_VARIABLE}=cpu: 2 CPU ranks, the GPUs unused"
    elif (gpus and gpus < min_ranks and world_size is None and not os.environ.get(WORLD_SIZE_VARIABLE)):
        os.environ[DEVICE_VARIABLE] = "cpu"  # the chapter's later runs in this process take the CPU too
        cpu_source = (f"this chapter needs {min_ranks} ranks and {gpus} GPU was chosen: {min_ranks} CPU ranks "
                      f"instead (${DEVICE_VARIABLE}=cpu)")
        print(f"Note: {cpu_source}.", file=sys.stderr)  # once per process: later calls find the variable set
        gpus, gpu_ids = 0, ()
    deepspeed = ds.load()
    if gpus:
        device, backend = "cuda", "nccl"
        name = f"{gpus} x {torch.cuda.get_device_name(indices[0])}"
        accelerator = deepspeed.get_accelerator()  # DeepSpeed's own rule: fp16 from compute capability 7.0, bf16 8.0
        precisions = ("fp32",) + (("bf16",) if accelerator.is_bf16_supported() else ()) \
            + (("fp16",) if accelerator.is_fp16_supported() else ())
        default, source = gpus, "one rank per GPU"
    else:
        device, backend = "cpu", "gloo"
        name = f"CPU ({cores} cores)"
        precisions = _cpu_precisions()
        default, source = max(CPU_DEFAULT_RANKS, min_ranks), cpu_source

    if world_size is None and os.environ.get(WORLD_SIZE_VARIABLE):
        value = os.environ[WORLD_SIZE_VARIABLE]
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"${WORLD_SIZE_VARIABLE}={value!r}: set it to a positive whole number of ranks, or unset it")
        world_size, source = int(value), f"set by ${WORLD_SIZE_VARIABLE}"
    elif world_size is not None:
        source = "chosen by the caller"
    if world_size is not None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size}: a run needs at least one rank")
        if gpus and world_size > gpus:
            raise ValueError(f"world_size={world_size}: this machine has {gpus} GPU(s); use at most {gpus}")
        default = world_size

    return Environment(
        device=device,
        device_name=name,
        gpu_count=gpus,
        cpu_cores=cores,
        backend=backend,
        default_world_size=default,
        world_size_source=source,
        precisions=precisions,
        torch_version=torch.__version__,
        deepspeed_version=deepspeed.__version__,
        gpu_ids=gpu_ids,
        gpu_source=gpu_source,
    )


@contextlib.contextmanager
def _quiet_fds():
    """Send this process's stdout and stderr file descriptors (and its children's) to /dev/null for a while."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


@functools.lru_cache(maxsize=1)
def nvme_offload_support() -> tuple[bool, str]:
    """Whether DeepSpeed's async_io op (NVMe offload) can be built here, and if not, why.

    Asks DeepSpeed's own op builder, which looks for libaio (the library and its headers).
    """
    get_accelerator = ds.load("deepspeed.accelerator").get_accelerator

    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    if builder is None:
        return False, f"DeepSpeed's {get_accelerator().device_name()} accelerator has no async_io op"
    with _quiet_fds():  # the probe compiles a test program; its linker errors are not the learner's business
        usable = builder.is_compatible(verbose=False)
    if usable:
        return True, "libaio found"
    return False, "libaio and its headers were not found (Debian/Ubuntu: apt-get install libaio-dev)"


_ARCH_SUFFIX = re.compile(r"^(\d+\.\d+)[a-z]+$")


def _fixed_arch_list(value: str) -> str:
    """``"9.0a"`` -> ``"9.0"``: DeepSpeed's FusedAdam build parses each entry as ``int(minor)``."""
    entries = re.split(r"[;\s]+", value.strip())
    fixed = []
    for entry in entries:
        suffix = "+PTX" if entry.endswith("+PTX") else ""
        core = entry[: -len(suffix)] if suffix else entry
        match = _ARCH_SUFFIX.match(core)
        fixed.append((match.group(1) if match else core) + suffix)
    return ";".join(dict.fromkeys(e for e in fixed if e))


def child_env(env: Environment, world_size: int, base: dict[str, str] | None = None) -> tuple[dict[str, str], list[str]]:
    """The environment for the launcher and its ranks, and a list of what was changed and why.

    Keeps everything the caller has (``NCCL_*`` included) and only neutralizes known traps.
    """
    child = dict(os.environ if base is None else base)
    changes: list[str] = []

    # The ranks import ``helpers``: make the repository importable wherever the kernel started.
    paths = [p for p in child.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO_ROOT) not in paths:
        child["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *paths])

    arch = child.get("TORCH_CUDA_ARCH_LIST")
    if arch:
        fixed = _fixed_arch_list(arch)
        if fixed != arch:
            child["TORCH_CUDA_ARCH_LIST"] = fixed
            changes.append(
                f"TORCH_CUDA_ARCH_LIST {arch!r} -> {fixed!r}: DeepSpeed's FusedAdam build cannot parse "
                "an architecture suffix such as 'a'"
            )

    if env.is_gpu and child.get("CUDA_VISIBLE_DEVICES"):
        # DeepSpeed's launcher sets it for each rank from the GPU numbers it is given (env.gpu_ids)
        value = child.pop("CUDA_VISIBLE_DEVICES")
        changes.append(f"CUDA_VISIBLE_DEVICES={value} -> GPUs {','.join(map(str, env.gpu_ids))} for DeepSpeed's "
                       "launcher, which sets CUDA_VISIBLE_DEVICES for each rank itself")

    if not env.is_gpu and child.get(DEVICE_VARIABLE) == "cpu":
        # CPU ranks on a machine with GPUs: hide the GPUs from them, and keep their ops (built for the CPU
        # accelerator, with the same names as the GPU's) apart from the GPU's
        from torch.utils.cpp_extension import get_default_build_root  # deferred, as torch is

        child["CUDA_VISIBLE_DEVICES"] = ""
        ops = child.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
        if Path(ops).name != "cpu-ranks":
            child["TORCH_EXTENSIONS_DIR"] = str(Path(ops) / "cpu-ranks")
        changes.append(f"CUDA_VISIBLE_DEVICES='': ${DEVICE_VARIABLE}=cpu, the ranks run on the CPU")
    if not env.is_gpu:
        if _ORIGINAL_DS_ACCELERATOR != "cpu":
            child["DS_ACCELERATOR"] = "cpu"
            changes.append("DS_ACCELERATOR=cpu: no GPU here; saying so silences DeepSpeed's accelerator warning")
        threads = max(1, env.cpu_cores // max(1, world_size))
        if child.get("OMP_NUM_THREADS") != str(threads):
            child["OMP_NUM_THREADS"] = str(threads)
            changes.append(
                f"OMP_NUM_THREADS={threads}: {env.cpu_cores} cores shared by {world_size} ranks "
                "(more threads than cores makes every rank slower)"
            )
    child["PATH"] = own_ninja_first(child.get("PATH", ""))
    child.setdefault("PYTHONUNBUFFERED", "1")
    return child, changes


def software() -> dict[str, str]:
    """Versions that measured a result: torch, DeepSpeed, CUDA, NCCL, and the GPU driver (where there is one)."""
    import subprocess  # deferred: only this function needs it

    import torch  # deferred: the commands that run before torch is installed must not import it

    deepspeed = ds.load()

    found = {"torch": torch.__version__, "deepspeed": deepspeed.__version__, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        found["cuda"] = str(torch.version.cuda)
        found["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        try:
            found["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                             capture_output=True, text=True, timeout=30).stdout.split()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            pass
    return found


def _command_output(argv: list[str]) -> str | None:
    import subprocess  # deferred: only this function needs it

    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def hardware(env: Environment | None = None) -> dict:
    """What measured a result, beside :func:`software`: the GPUs (names, count, the numbers the ranks
    used), how they are joined (``nvidia-smi topo -m``: NV18 = 18 NVLinks, PIX/PHB/SYS = PCIe paths),
    the processor and its cores, and the date. On a CPU machine, the processor alone."""
    import datetime  # deferred: only this function needs it
    import platform

    env = env or detect()
    found: dict = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                   "device": env.device_name, "cpu_cores": env.cpu_cores, "machine": platform.machine()}
    try:
        with open("/proc/cpuinfo") as f:
            found["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        found["cpu"] = platform.processor() or "unknown"
    if env.is_gpu:
        found["gpu_count"] = env.gpu_count
        found["gpu_ids"] = list(env.gpu_ids)
        names = _command_output(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version",
                                 "--format=csv,noheader"])
        found["gpus"] = names.splitlines() if names else None
        found["interconnect"] = _command_output(["nvidia-smi", "topo", "-m"])
    return found


def python_executable() -> str:
    """The Python that runs the course (the kernel's own, so ranks see the same packages)."""
    return sys.executable


def build_ops(env: Environment | None = None, only: list[str] | None = None) -> list[tuple[str, float]]:
    """Compile (or load from cache) the DeepSpeed C++/CUDA ops the course uses, one by one, visibly.

    DeepSpeed builds these just in time on first use; building them here, once, keeps the first
    notebook cell from stalling for minutes with no word to the learner. Returns (op, seconds).
    """
    import time  # deferred: only this function needs it

    env = env or detect()
    child, changes = child_env(env, env.default_world_size)
    for change in changes:
        print(f"  environment: {change}")
    os.environ.update({k: v for k, v in child.items() if k in ("DS_ACCELERATOR", "TORCH_CUDA_ARCH_LIST")})
    get_accelerator = ds.load("deepspeed.accelerator").get_accelerator

    names = ["FusedAdamBuilder", "CPUAdamBuilder"]
    if not env.is_gpu:
        names.insert(0, "ShareMemCommBuilder")
    else:
        names.append("QuantizerBuilder")  # ZeRO++'s quantized weights and gradients (chapter 13)
    usable, reason = nvme_offload_support()
    if usable:  # NVMe offload (chapter 06): several minutes to build on 2 cores, so here rather than in a cell
        names.append("AsyncIOBuilder")
    else:
        print(f"  AsyncIOBuilder (NVMe offload): skipped, {reason}")
    if only:  # e.g. ["FusedAdamBuilder"]: what a GPU-only benchmark needs, not CPU Adam for offload
        names = [n for n in names if n in only]
    done = []
    for name in names:
        builder = get_accelerator().create_op_builder(name)
        if builder is None:
            print(f"  {name}: not available on this accelerator, skipped")
            continue
        print(f"  {name} ({builder.name}): building or loading from cache ...", flush=True)
        start = time.perf_counter()
        builder.load(verbose=False)
        seconds = time.perf_counter() - start
        print(f"  {name}: ready in {seconds:.1f} s", flush=True)
        done.append((name, seconds))
    return done


def deepspeed_source(relative: str, patterns: Sequence[str], context: int = 0) -> str:
    """Lines of DeepSpeed's installed source ``relative`` (e.g. ``runtime/zero/stage3.py``) that match any
    of ``patterns`` (regular expressions), with ``context`` lines after each, numbered as in the file."""
    deepspeed = ds.load()

    path = Path(deepspeed.__file__).parent / relative
    lines = path.read_text().splitlines()
    shown: dict[int, str] = {}
    for i, line in enumerate(lines):
        if any(re.search(p, line) for p in patterns):
            for j in range(i, min(len(lines), i + 1 + context)):
                shown[j] = lines[j]
    body = "\n".join(f"{j + 1:5d}  {text}" for j, text in sorted(shown.items()))
    return f"deepspeed/{relative} (deepspeed {deepspeed.__version__}):\n{body}"


def importable_repository() -> None:
    """Make the repository's root importable in this process, as the ranks have it on their PYTHONPATH: a
    chapter's own module (``runs.<chapter>.<module>``, written by its notebook) is then found here too, though a
    kernel starts in ``notebooks/``; a module written since an earlier import is found as well."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.append(str(REPO_ROOT))
    importlib.invalidate_caches()
