"""Run the course on an offline GPU machine that has torch but not DeepSpeed, and bring the results back.

    python3 benchmarks/device_run.py [--budget 560] [--out DIR] TASK [ARGS ...]

TASK is one of
    check [--jobs N] [NOTEBOOK ...]   execute notebooks (python3 -m helpers.course check-gpu --no-setup)
    reference [ARGS ...]              benchmarks/reference.py (chapter references, then the capstone)
    capstone [ARGS ...]               benchmarks/capstone.py (the tuning ladder)
    jobs "GPUS:COMMAND" ...           several shell commands at once, each on its own GPUs (COURSE_GPUS),
                                      e.g. "0,1:python3 benchmarks/capstone.py" "2,3:python3 -m helpers ..."
    env                               only the set-up and what the machine is

Made for a machine with no package index: it installs the wheels of the git-ignored ``.whl/`` folder (made
here with ``python3 benchmarks/wheels.py``) into ``/tmp/site`` with ``pip --no-index --no-deps --target``, puts
``/tmp/site`` and this repository on ``PYTHONPATH``, checks every import the course needs, shows the GPUs
and their links, builds DeepSpeed's ops, then runs TASK with what is left of ``--budget`` seconds and packs
``runs/`` (references, capstone ladder, check report, executed notebooks, logs) into
``OUT/results.tar.gz`` with a ``summary.txt`` beside it. ``OUT`` defaults to ``$OUT``. It changes no
``NCCL_*`` or other variable the machine sets (NVLink multicast stays off where the machine says so).
Standard library only: it runs before anything is installed.

DeepSpeed's ops (``--ops``) take a minute or more to compile on every fresh machine. Where ``.whl/src/``
holds DeepSpeed's source (``wheels.py`` puts it there), they are compiled into a DeepSpeed wheel of their own
instead (DeepSpeed's ``DS_BUILD_<OP>=1``), installed, and left in ``OUT`` with a ``<wheel>-deepspeed-ops.json``
that says what it was built for; moved into ``.whl/prebuilt/`` here, both are carried next time and the wheel
is installed in place of compiling, on a machine with the same torch, CUDA and GPU architecture list.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl"
SITE = Path("/tmp/site")
#: DeepSpeed wheels with ops compiled in, each with the ``<wheel>-deepspeed-ops.json`` it came back with.
PREBUILT = WHEELS / "prebuilt"
#: DeepSpeed's source distribution, to compile ops into a wheel on the GPU machine.
SOURCES = WHEELS / "src"
OPS_RECORD = "deepspeed-ops.json"
#: Where this machine compiles that wheel (found again by a later call on the same machine).
BUILT = Path("/tmp/deepspeed-ops-wheel")
#: What the course imports on the GPU machine (module -> why).
IMPORTS = {"torch": "training", "deepspeed": "the engine", "hjson": "DeepSpeed's config reader",
           "pydantic": "DeepSpeed's config models", "transformers": "the LLaMA-style models", "tqdm": "progress",
           "psutil": "process times", "matplotlib": "figures", "nbformat": "notebooks", "nbclient": "executing them",
           "ipykernel": "their kernel", "jupyter_client": "talking to it", "nbval": "pytest --nbval"}
#: Variables the machine may set that must reach every rank unchanged.
KEPT = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "CUDA_VISIBLE_DEVICES")


def say(message: str) -> None:
    print(f"[device_run {time.strftime('%H:%M:%S')}] {message}", flush=True)


def install_wheels() -> None:
    wheels = sorted(WHEELS.glob("*.whl"))
    if not wheels:
        sys.exit(f"no wheels in {WHEELS}: make them with python3 benchmarks/wheels.py and carry .whl")
    digest = hashlib.sha256("".join(w.name for w in wheels).encode()).hexdigest()
    stamp = SITE / ".course-wheels"
    if stamp.exists() and stamp.read_text() == digest:
        say(f"{len(wheels)} wheels already installed in {SITE}")
        return
    say(f"installing {len(wheels)} wheels into {SITE}")
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(SITE), *map(str, wheels)], check=True)
    stamp.write_text(digest)
    say(f"installed in {time.monotonic() - started:.0f} s")


def environment() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(SITE), str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("JUPYTER_PLATFORM_DIRS", "1")  # jupyter_core's future default; silences its warning
    return env


def check_imports(env: dict[str, str]) -> None:
    code = ("import importlib, sys\n"
            f"for name in {list(IMPORTS)!r}:\n"
            "    try:\n"
            "        m = importlib.import_module(name)\n"
            "        print(f'  {name:<15} {getattr(m, \"__version__\", \"?\"):<14} {m.__file__}')\n"
            "    except Exception as e:\n"
            "        print(f'  {name:<15} MISSING: {type(e).__name__}: {e}'); sys.exit(1)\n")
    say("imports:")
    if subprocess.run([sys.executable, "-c", code], env=env).returncode:
        sys.exit("a module the course needs is missing: add its wheel to .whl (python3 benchmarks/wheels.py)")


def show_machine(env: dict[str, str]) -> None:
    for argv in (["nvidia-smi", "-L"], ["nvidia-smi", "topo", "-m"]):
        if shutil.which(argv[0]):
            subprocess.run(argv, env=env)
    for key in KEPT:
        say(f"{key}={env.get(key, '(unset)')}")
    subprocess.run([sys.executable, "-m", "helpers", "env"], env=env, cwd=ROOT)
    # the machine as a reference file records it, kept beside the results: records that come back without
    # their reference can be adopted with it (python -m helpers adopt-reference --machine ...)
    with open(ROOT / "runs" / "device-environment.json", "w") as out:
        subprocess.run([sys.executable, "-c", "import json; from helpers.core import environment as e; "
                        "print(json.dumps({'software': e.software(), 'hardware': e.hardware()}, indent=1))"],
                       env=env, cwd=ROOT, stdout=out)


def run_with_deadline(argv: list[str], env: dict[str, str], log: Path, seconds: float) -> int:
    """Run ``argv``, copying its output to stdout and ``log``; stop it and all it started after ``seconds``
    (exit code 124 then)."""
    import queue
    import threading

    process = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + seconds
    with open(log, "w") as f:
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                break
            sys.stdout.write(line)
            f.write(line)
            f.flush()
    try:
        return process.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        say("time budget spent: stopping the task and everything it started")
        for sig in (15, 9):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(5)
        return 124


def run_jobs(jobs: list[str], env: dict[str, str], logs: Path, seconds: float) -> int:
    """Run each ``"GPUS:COMMAND"`` at once (bash, ``COURSE_GPUS=GPUS``, its output in ``logs/job-N.log``),
    all stopped at the deadline; returns the largest exit code (124 if any was stopped)."""
    logs.mkdir(parents=True, exist_ok=True)
    started, processes = time.monotonic(), []
    for number, job in enumerate(jobs, 1):
        gpus, _, command = job.partition(":")
        log = open(logs / f"job-{number}.log", "w")
        say(f"job {number} on GPUs {gpus}: {command}")
        processes.append((number, log, subprocess.Popen(["bash", "-c", command], env={**env, "COURSE_GPUS": gpus},
                                                        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                                        start_new_session=True)))
    codes = []
    for number, log, process in processes:
        try:
            codes.append(process.wait(max(1.0, seconds - (time.monotonic() - started))))
        except subprocess.TimeoutExpired:
            say(f"job {number}: time budget spent, stopping it")
            for sig in (15, 9):
                try:
                    os.killpg(process.pid, sig)
                except ProcessLookupError:
                    break
                time.sleep(3)
            codes.append(124)
        log.close()
        say(f"job {number} ended with code {codes[-1]} after {time.monotonic() - started:.0f} s")
        sys.stdout.write("".join((logs / f"job-{number}.log").read_text().splitlines(True)[-25:]))
    return max(codes)


#: What comes back first when the archive must stay small: references, reports, logs, ladders, then records.
PACK_ORDER = ("reference/", "device-environment.json", "report.json", ".log", "ladder", "summary.json", ".json", ".txt", ".ipynb")
#: Never packed: checkpoints and tensors (chapter 14 writes hundreds of MB of them).
PACK_SKIPPED = (".pt", ".bin", ".safetensors", ".npy", ".pth")
#: The transfer back takes files of 16 MiB at most; stay well below it.
PACK_LIMIT = 14_000_000


def _pack_rank(path: Path) -> int:
    text = str(path)
    return next((i for i, key in enumerate(PACK_ORDER) if key in text), len(PACK_ORDER))


def pack(out: Path, task: str, code: int, seconds: float, log: Path) -> None:
    """``OUT/results.tar.gz`` of ``runs/`` below :data:`PACK_LIMIT` (compressed): references and reports
    first, executed notebooks last, no checkpoints; what did not fit is listed in ``summary.txt``."""
    out.mkdir(parents=True, exist_ok=True)
    runs = ROOT / "runs"
    archive = out / "results.tar.gz"
    # tensors are skipped by their suffix, not by a word in the path: chapters 10 and 14 are named for
    # checkpoints, and their reports and records must come back
    files = [p for p in (runs.rglob("*") if runs.exists() else [])
             if p.is_file() and p != log and p.suffix not in PACK_SKIPPED
             and "global_step" not in str(p) and p.stat().st_size < 4_000_000]
    files.sort(key=lambda p: (_pack_rank(p), str(p)))
    left_out: list[str] = []
    with open(archive, "wb") as raw, tarfile.open(fileobj=raw, mode="w:gz") as tar:
        tar.add(log, arcname="runs/device_run.log")
        for path in files:
            # a notebook's figures hardly compress: count them whole, text at a quarter
            cost = path.stat().st_size if path.suffix in (".ipynb", ".png") else path.stat().st_size // 4
            if raw.tell() + cost > PACK_LIMIT:  # compressed bytes so far (gzip buffers a little)
                left_out.append(str(path.relative_to(ROOT)))
                continue
            tar.add(path, arcname=str(path.relative_to(ROOT)))
    lines = [f"task: {task}", f"exit code: {code}", f"seconds: {seconds:.0f}",
             f"archive: results.tar.gz ({archive.stat().st_size / 1e6:.1f} MB; unpack in the repository root: "
             "tar xzf results.tar.gz)"]
    references = sorted((runs / "reference").glob("*.json")) if (runs / "reference").exists() else []
    lines.append("references: " + (", ".join(p.name for p in references) or "none"))
    lines.append(f"left out of the archive (size): {len(left_out)} file(s)" + "".join(f"\n  {p}" for p in left_out[:50]))
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    shutil.copy(log, out / "log.txt")
    say(f"packed into {archive} ({archive.stat().st_size / 1e6:.1f} MB, {len(left_out)} file(s) left out)")


def build_ops(ops: str, env: dict[str, str]) -> None:
    """Build the named DeepSpeed ops (comma-separated builder names; empty: all the course uses). Named ops
    build at once, each in a process of its own: a GPU machine has the cores (on a 2-core machine one build
    already keeps both busy, and ``python3 -m helpers.course setup`` builds them one after another)."""
    say("building DeepSpeed's ops" + (f" ({ops}), at once" if ops else ""))
    command = [sys.executable, "-m", "helpers", "build-ops"]
    if not ops:
        subprocess.run(command, env=env, cwd=ROOT)
        return
    builds = [subprocess.Popen([*command, "--only", op], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for op in ops.split(",")]
    for build in builds:
        print(build.communicate()[0], end="", flush=True)
    say("ops built")


def wheel_ops(wheel: Path) -> tuple[set[str], dict]:
    """The ops a DeepSpeed wheel holds compiled and the torch it was built against, as DeepSpeed's own
    ``git_version_info_installed.py`` in it records them (``installed_ops``, ``torch_info``)."""
    with zipfile.ZipFile(wheel) as z:
        tree = ast.parse(z.read("deepspeed/git_version_info_installed.py").decode())
    found = {target.id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
             for target in node.targets if isinstance(target, ast.Name)}
    return {op for op, built in found.get("installed_ops", {}).items() if built}, found.get("torch_info", {})


def usable_prebuilt(folder: Path, machine: dict) -> Path | None:
    """A wheel in ``folder`` whose ``<wheel>-deepspeed-ops.json`` names this machine's GPU architecture list and
    whose compiled ops (read from the wheel) include all of ``machine["ops"]``, built against its torch
    and CUDA (what DeepSpeed checks when it loads them); None when there is none."""
    for record_path in sorted(folder.glob(f"*{OPS_RECORD}")):
        record = json.loads(record_path.read_text())
        wheel = folder / record.get("wheel", "")
        if not wheel.is_file() or record.get("arch") != machine["arch"]:
            continue
        ops, torch_info = wheel_ops(wheel)
        if set(machine["ops"]) <= ops and torch_info.get("version") == machine["torch"] \
                and torch_info.get("cuda_version") == machine["cuda"]:
            return wheel
    return None


def build_env(machine: dict, env: dict[str, str]) -> dict[str, str]:
    """The environment that compiles exactly ``machine["ops"]`` into DeepSpeed's wheel (DeepSpeed's
    ``DS_BUILD_OPS=0`` and each builder's ``BUILD_VAR=1``), for the architecture list the course gives its
    ranks."""
    arch = {"TORCH_CUDA_ARCH_LIST": machine["arch"]} if machine["arch"] else {}
    return {**env, "DS_BUILD_OPS": "0", **arch, **{variable: "1" for variable in machine["build_vars"]}}


#: Asked of the machine once the plain wheels are in: torch and CUDA as DeepSpeed records them, the
#: architecture list the course hands its ranks, and the ops the builders named on the command line build.
MACHINE_QUERY = """
import json, sys, torch
from deepspeed.accelerator import get_accelerator
from helpers.core import environment
child, _ = environment.child_env(environment.detect(), 1)
print(json.dumps({"torch": ".".join(torch.__version__.split(".")[:2]),
                  "cuda": ".".join((torch.version.cuda or "0.0").split(".")[:2]),
                  "arch": child.get("TORCH_CUDA_ARCH_LIST", ""),
                  "ops": [get_accelerator().create_op_builder(n).name for n in sys.argv[1].split(",")],
                  "build_vars": [get_accelerator().create_op_builder(n).BUILD_VAR for n in sys.argv[1].split(",")]}))
"""


def install_ops_wheel(ops: str, env: dict[str, str], out: Path) -> None:
    """Install DeepSpeed with ``ops`` compiled in: a wheel of ``.whl/prebuilt/`` made for this machine, else
    one compiled now from ``.whl/src/`` (then copied to ``out`` with its ``<wheel>-deepspeed-ops.json``). Where
    neither works the ops are compiled just in time as before, and this says why."""
    query = subprocess.run([sys.executable, "-c", MACHINE_QUERY, ops], env=env, cwd=ROOT, capture_output=True,
                           text=True)
    if query.returncode:
        say(f"could not ask the machine which ops and torch it has, so the ops build just in time: "
            f"{query.stderr.strip().splitlines()[-1:]}")
        return
    machine = json.loads(query.stdout.strip().splitlines()[-1])
    wheel = next((found for folder in (PREBUILT, BUILT) if folder.is_dir()
                  and (found := usable_prebuilt(folder, machine)) is not None), None)
    if wheel is None:
        sources = sorted(SOURCES.glob("deepspeed-*.tar.gz")) if SOURCES.is_dir() else []
        if not sources:
            say(f"no DeepSpeed source in {SOURCES} (python3 benchmarks/wheels.py): the ops build just in time")
            return
        say(f"compiling {', '.join(machine['ops'])} into DeepSpeed's wheel (torch {machine['torch']}, CUDA "
            f"{machine['cuda']}, architectures {machine['arch']})")
        started = time.monotonic()
        shutil.rmtree(BUILT, ignore_errors=True)
        built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-index",
                                "--no-build-isolation", "-w", str(BUILT), str(sources[-1])],
                               env=build_env(machine, env), cwd="/tmp", capture_output=True, text=True)
        made = sorted(BUILT.glob("deepspeed-*.whl"))
        if built.returncode or not made:
            say(f"compiling them into a wheel failed, so they build just in time: {built.stderr[-2000:]}")
            return
        wheel, seconds = made[0], time.monotonic() - started
        if wheel.stat().st_size > 16 * 2**20:  # the transfer back takes files of 16 MiB at most
            say(f"{wheel.name} is {wheel.stat().st_size / 2**20:.0f} MiB: too large to come back from the machine")
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(wheel, out / wheel.name)
        record = out / f"{wheel.stem}-{OPS_RECORD}"
        record.write_text(json.dumps({"wheel": wheel.name, **machine, "seconds": round(seconds)}, indent=1))
        shutil.copy(record, BUILT / record.name)
        say(f"compiled in {seconds:.0f} s: {wheel.name} and {record.name} are in {out}; move both into {PREBUILT} "
            "here, and the next machine installs the wheel instead of compiling")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(SITE), str(wheel)], check=True)
    (SITE / ".course-wheels").unlink(missing_ok=True)  # /tmp/site no longer holds exactly .whl's wheels
    say(f"installed {wheel.name}, with {', '.join(machine['ops'])} compiled in")


#: Where each task's own options are told (``device_run.py TASK --help`` prints this).
TASK_HELP = {"check": "python3 -m helpers.course check-gpu --help",
             "reference": "python3 benchmarks/reference.py --help (on a machine with torch)",
             "capstone": "python3 benchmarks/capstone.py --help (on a machine with torch)",
             "jobs": 'none: each job is "GPUS:COMMAND", a shell command run with COURSE_GPUS=GPUS',
             "env": "none"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=float, default=560, help="seconds for everything (default 560)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "runs" / "device-out")))
    parser.add_argument("--no-install", action="store_true",
                        help="use the packages this Python already has (a machine set up otherwise)")
    parser.add_argument("task", choices=("check", "reference", "capstone", "jobs", "env"))
    parser.add_argument("--ops", default=None, help="DeepSpeed ops to build first, comma-separated builder names "
                        "(default: those the task needs)")
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if "-h" in args.rest or "--help" in args.rest:  # the task's help, before installing or building anything
        parser.print_help()
        print(f"\n{args.task}'s own options: {TASK_HELP[args.task]}")
        return 0
    started = time.monotonic()
    (ROOT / "runs").mkdir(exist_ok=True)
    log = ROOT / "runs" / "device_run.log"

    if not args.no_install:
        install_wheels()
    env = environment()
    ops = args.ops if args.ops is not None else ("FusedAdamBuilder" if args.task == "capstone" else "")
    if ops and not args.no_install:
        install_ops_wheel(ops, env, args.out)
    check_imports(env)
    show_machine(env)
    build_ops(ops, env)

    margin = 40  # for packing and the transfer back
    left = args.budget - (time.monotonic() - started) - margin
    if args.task == "check":
        argv_task = [sys.executable, "-m", "helpers.course", "check-gpu", "--no-setup", *args.rest]
    elif args.task == "reference":
        argv_task = [sys.executable, str(ROOT / "benchmarks" / "reference.py"), "--budget", str(int(left - 20)), *args.rest]
    elif args.task == "capstone":
        argv_task = [sys.executable, str(ROOT / "benchmarks" / "capstone.py"), "--budget", str(int(left - 20)), *args.rest]
    else:
        argv_task = [sys.executable, "-c", "print('set-up only')"]
    if args.task == "jobs":
        code = run_jobs(args.rest, env, ROOT / "runs" / "jobs", left)
        log.write_text("".join(f"job {n}: {job}\n" + (ROOT / "runs" / "jobs" / f"job-{n}.log").read_text()[-20_000:]
                               for n, job in enumerate(args.rest, 1)))
    else:
        say(f"running {' '.join(argv_task[1:])} ({left:.0f} s left)")
        code = run_with_deadline(argv_task, env, log, left)
    say(f"task ended with code {code} after {time.monotonic() - started:.0f} s")
    pack(args.out, args.task, code, time.monotonic() - started, log)
    return code


if __name__ == "__main__":
    sys.exit(main())
