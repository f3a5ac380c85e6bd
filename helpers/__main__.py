"""Command line for instructors and scripts: the same code the notebooks call.

    python -m helpers env                          what the course uses on this machine, and why
    python -m helpers check CONFIG [--world-size N] [--client-optimizer] [--for deepspeed|trainer]
                          [--target cuda|cuda:7.0|cpu [--gpus N]]
    python -m helpers run CONFIG [--world-size N] [--steps S] [--model NAME] [--out DIR] [--gpus 0,1]
                          [--hostfile FILE [--include SPEC | --exclude SPEC] [--master-addr A]]
    python -m helpers multinode-check              2 local "hosts" through DeepSpeed's pdsh runner
    python -m helpers build-ops                    compile DeepSpeed's ops once, visibly
    python -m helpers bench-launch [--repeats R]   where a launch's seconds go
    python -m helpers reference NAME               GPU only: measure and save a chapter's GPU reference
                                                   (grad-accum-claim, bandwidth-nvlink, bandwidth-sockets)
    python -m helpers adopt-reference NAME LABEL=RUN_FOLDER ... --note N --conditions C --why W
                                                   keep GPU records that came back without their reference
"""

from __future__ import annotations

import argparse
import os
import sys

# Each command imports what it uses when it runs (each such import says "deferred"): `env` answers in a
# fraction of a second, without importing torch or DeepSpeed, and no command pays for another's imports.


def _env(args: argparse.Namespace) -> int:
    from helpers.core import environment  # deferred

    env = environment.detect(args.world_size)
    print(env.report())
    _, changes = environment.child_env(env, env.default_world_size)
    usable, reason = environment.nvme_offload_support()
    print(f"NVMe offload     : {'available' if usable else 'unavailable'} ({reason})"
          + ("" if usable else "; chapter 06 skips its NVMe run and says why"))
    print("changes for the ranks:" if changes else "changes for the ranks: none")
    for change in changes:
        print(f"  - {change}")
    return 0


def _check(args: argparse.Namespace) -> int:
    from helpers.core import configs, ds, environment  # deferred

    ds.choose_accelerator()  # this machine's accelerator named up front: no DeepSpeed notice in the report
    if args.target:
        env = configs.target(args.target, args.gpus or args.world_size)
        world = args.world_size or env.default_world_size
    else:
        if args.gpus:
            raise ValueError("--gpus needs --target (this machine's GPUs are counted, not given)")
        env = environment.detect()  # a config may be checked for more ranks than this machine has
        world = args.world_size or env.default_world_size
    starter = {"deepspeed": "plain deepspeed.initialize", "trainer": "Hugging Face's Trainer"}[args.starter]
    elsewhere = "" if args.target or env.is_gpu else " (for the GPUs a config is meant for: --target cuda --gpus N)"
    print(f"{configs.path_of(args.config).name} on {world} rank(s), device checks for {env.device_name}{elsewhere}"
          + (f", started by {starter}:" if args.starter != "deepspeed" else ":"))
    try:
        config = configs.load(args.config)
    except configs.ConfigError as error:  # read, but refused by DeepSpeed's parser (duplicate keys)
        for finding in error.findings:
            print(finding)
        print(f"{len(error.findings)} error(s), 0 warning(s)")
        return 1
    findings = configs.check(config, world, env, args.client_optimizer, args.starter)
    if args.starter == "trainer" and isinstance(config, dict):
        for fill in configs.trainer_fills(config, world)[1].values():
            shown = "from " + fill.source if fill.path in configs.LATE_FILLS else f"{fill.value!r} ({fill.source})"
            print(f"filled by the Trainer: {fill.path} \"auto\" -> {shown}")
    for finding in findings:
        print(finding)
    errors = sum(f.severity == "error" for f in findings)
    print(f"{errors} error(s), {len(findings) - errors} warning(s)")
    return 1 if errors else 0


def _run(args: argparse.Namespace) -> int:
    from helpers.core import configs, launch, records  # deferred

    hosts = None
    if args.hostfile:
        hosts = launch.Hosts(args.hostfile, include=args.include or "", exclude=args.exclude or "",
                             master_addr=args.master_addr, ssh_port=args.ssh_port)
    elif args.include and args.include.startswith("localhost:") and not args.exclude:
        args.gpus = args.include.split(":", 1)[1]  # DeepSpeed's spelling of "these GPUs of this machine"
    elif args.include or args.exclude:
        print("error: without --hostfile, --include takes only localhost:<GPUs> (e.g. localhost:0,1); "
              "--exclude needs a hostfile", file=sys.stderr)
        return 2
    if args.gpus:
        from helpers.core import environment  # deferred

        os.environ[environment.GPUS_VARIABLE] = args.gpus
    try:
        record = launch.run(args.config, world_size=args.world_size, steps=args.steps, model=args.model,
                            out=args.out, timeout=args.timeout, launcher=args.launcher, hosts=hosts)
    except configs.ConfigError as error:
        print(error, file=sys.stderr)
        return 1
    except launch.RunFailed as failure:
        print(failure.explain(traceback_lines=8), file=sys.stderr)
        return 1
    states = record.memory.model_states(0)
    print(f"record: {record.out / 'summary.json'}")
    print(f"{record.label}, {record.model_name} ({record.params:,} params), {record.world_size} x {record.device} "
          f"({record.summary['backend']})")
    print(f"losses (mean over ranks of each step's micro-batch losses): {', '.join(f'{x:.4f}' for x in record.losses)}")
    print(f"step time (median): {record.timing.median_s * 1000:.1f} ms, {record.timing.samples_per_s:.1f} samples/s")
    print("model states on rank 0: " + ", ".join(f"{k} {records.format_bytes(v)}" for k, v in states.as_dict().items() if v))
    if "placement" in record.probes:  # the config offloads: say which bytes live where
        where = record.memory.placement(0)
        for side in ("accelerator", "host"):
            kinds = getattr(where, side).as_dict()
            print(f"  on the {side} side: {records.format_bytes(sum(kinds.values()))} ("
                  + (", ".join(f"{k} {records.format_bytes(v)}" for k, v in kinds.items() if v) or "nothing") + ")")
    print(f"sent per rank per step (ring): {records.format_bytes(record.comm.wire_bytes_per_step)} measured, "
          f"paper {records.format_bytes(record.theory.comm_wire_bytes_per_step)} "
          f"({'3' if record.stage == 3 else '2'}Ψ x (n-1)/n)")
    return 0


def _multinode(args: argparse.Namespace) -> int:
    from helpers.tools import multinode  # deferred

    reason = multinode.missing()
    if reason:
        print(f"cannot run here: {reason}", file=sys.stderr)
        return 2
    result = multinode.compare_with_single_node(args.config, args.model, args.steps)
    print(f"DeepSpeed's runner: {(result.multi.out / 'command.txt').read_text().strip()}")
    print(result.table())
    print("same record as one host:" , "yes" if result.equal else "NO")
    return 0 if result.equal else 1


def _build_ops(args: argparse.Namespace) -> int:
    from helpers.core import cpu_info, environment  # deferred

    cpu_info.remember()  # each op asks py-cpuinfo about the processor: once for all of them, and for every rank later
    print("Building DeepSpeed's C++ ops once (a few minutes on a 2-core machine; cached afterwards):", flush=True)
    environment.build_ops(only=args.only.split(",") if args.only else None)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from helpers.tools import benchmarks  # deferred

    print(benchmarks.launch_overhead_report(benchmarks.launch_overhead(args.repeats, args.world_size)))
    return 0


#: GPU references a command can measure: name -> (module, function, arguments).
REFERENCES = {"grad-accum-claim": ("helpers.topics.accumulation:measure_claim", ()),
              "bandwidth-nvlink": ("helpers.topics.bandwidth:measure_gpu", ("nvlink",)),
              "bandwidth-sockets": ("helpers.topics.bandwidth:measure_gpu", ("sockets",))}


def _reference(args: argparse.Namespace) -> int:
    from helpers.core import launch, plan  # deferred

    function, arguments = REFERENCES[args.name]
    try:
        _, saved = plan.resolve(function)(*arguments)
    except launch.RunFailed as failure:
        print(failure.explain(traceback_lines=8), file=sys.stderr)
        return 1
    except RuntimeError as error:  # no GPU here
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"saved: {saved} (copy it to notebooks/reference/ to make it the course's GPU reference)")
    return 0


def _adopt(args: argparse.Namespace) -> int:
    from helpers.core import references  # deferred

    pairs = [a.partition("=") for a in args.runs]
    bad = [a for a, (label, eq, folder) in zip(args.runs, pairs) if not (label and eq and folder)]
    if bad:
        raise ValueError(f"{', '.join(bad)}: give each run as LABEL=RUN_FOLDER, e.g. 'time: ZeRO-3=runs/zeropp-time-0-llama-medium-2r'")
    path = references.adopt_records(args.name, {label: folder for label, _, folder in pairs}, args.note,
                                     args.conditions, args.why, args.machine)
    print(f"saved: {path} (copy it to notebooks/reference/ to make it the course's GPU reference)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m helpers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", required=True)

    env = verbs.add_parser("env", help="what the course will use on this machine and why")
    env.add_argument("--world-size", type=int)
    env.set_defaults(func=_env)

    check = verbs.add_parser("check", help="lint a DeepSpeed config (exit 1 on errors)")
    check.add_argument("config", help="name in ds_configs/ or path to a JSON file")
    check.add_argument("--world-size", type=int, help="ranks to check for (default: this machine's, or the target's)")
    check.add_argument("--client-optimizer", action="store_true",
                       help="the script passes its own optimizer to deepspeed.initialize")
    check.add_argument("--for", dest="starter", choices=("deepspeed", "trainer"), default="deepspeed",
                       help="what starts the config: deepspeed (default), plain deepspeed.initialize, which takes "
                       "\"auto\" as written; trainer: Hugging Face's Trainer, which fills each \"auto\" it knows "
                       "from its TrainingArguments and passes its own optimizer when the config has none (accelerate "
                       "alone fills the same batch, clipping and bucket keys from its own arguments)")
    check.add_argument("--target", help="check for another machine: cuda (compute capability 8.0 or above: "
                       "fp32, bf16, fp16), cuda:7.0 (e.g. V100: no bf16), or cpu; the device findings then "
                       "name the target (default: this machine)")
    check.add_argument("--gpus", type=int, help="with --target cuda: the target's GPU count (default: the "
                       "--world-size, else 1)")
    check.set_defaults(func=_check)

    run = verbs.add_parser("run", help="launch a real multi-rank run and write its summary.json")
    run.add_argument("config", help="name in ds_configs/ or path to a JSON file")
    run.add_argument("--world-size", type=int)
    run.add_argument("--steps", type=int, default=4)
    run.add_argument("--model", default="linear", help="linear, mlp or llama")
    run.add_argument("--out", help="output folder (default runs/<config>-<model>-<N>r)")
    run.add_argument("--timeout", type=float, default=600)
    run.add_argument("--launcher", default=None, choices=("launch", "deepspeed"),
                     help="default: launch (deepspeed with --hostfile)")
    run.add_argument("--gpus", help="GPU numbers of this machine, e.g. 0,1 (same as COURSE_GPUS=0,1)")
    run.add_argument("--hostfile", help="DeepSpeed hostfile ('<host> slots=<ranks>' lines): run on those hosts "
                     "through DeepSpeed's multi-node runner (pdsh over ssh)")
    run.add_argument("--include", help="DeepSpeed's --include, e.g. 'node-a:0,1@node-b'")
    run.add_argument("--exclude", help="DeepSpeed's --exclude, e.g. 'node-b:1'")
    run.add_argument("--master-addr", help="address of the first host (default: its 'hostname -I')")
    run.add_argument("--ssh-port", type=int)
    run.set_defaults(func=_run)

    multi = verbs.add_parser("multinode-check", help="2 local 'hosts' (private sshd on 127.0.0.1) through "
                             "DeepSpeed's pdsh runner, against the same run on 1 host")
    multi.add_argument("config", nargs="?", default="zero2")
    multi.add_argument("--model", default="mlp")
    multi.add_argument("--steps", type=int, default=3)
    multi.set_defaults(func=_multinode)

    build = verbs.add_parser("build-ops", help="compile DeepSpeed's JIT ops now, with progress")
    build.add_argument("--only", help="comma-separated builders, e.g. FusedAdamBuilder (default: all the course uses)")
    build.set_defaults(func=_build_ops)

    bench = verbs.add_parser("bench-launch", help="time 2-step launches: course launcher vs the deepspeed CLI")
    bench.add_argument("--repeats", type=int, default=5)
    bench.add_argument("--world-size", type=int)
    bench.set_defaults(func=_bench)

    reference = verbs.add_parser("reference", help="GPU only: measure a chapter's GPU reference into runs/reference/")
    reference.add_argument("name", choices=sorted(REFERENCES))
    reference.set_defaults(func=_reference)

    adopt = verbs.add_parser("adopt-reference", help="keep GPU run records that came back without their reference "
                             "file as a reference (software and hardware marked as not recorded)")
    adopt.add_argument("name", help="the reference's experiment name, e.g. zeropp")
    adopt.add_argument("runs", nargs="+", help="LABEL=RUN_FOLDER (a folder with the run's summary.json)")
    adopt.add_argument("--note", required=True)
    adopt.add_argument("--conditions", required=True, help="what else ran on the machine meanwhile")
    adopt.add_argument("--why", required=True, help="why the reference itself was not written there")
    adopt.add_argument("--machine", help="the device-environment.json written on the GPU machine (software, hardware)")
    adopt.set_defaults(func=_adopt)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as error:  # a file that cannot be read at all, a bad argument
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
