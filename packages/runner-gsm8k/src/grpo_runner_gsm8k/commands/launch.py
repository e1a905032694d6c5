"""`grpo-run launch`: start one run on every host of a multi-host job.

    grpo-run launch --hosts h1,h2 [--coordinator-port 8476] [--dry-run] -- --config X [overrides]
    grpo-run launch --tpu NAME --zone Z --num-workers N [--dry-run] -- --config X [overrides]
    grpo-run launch --jobset NAME --image I --accelerator A --topology T --num-workers N --storage S -- ...
    grpo-run launch --xpk NAME --cluster C --tpu-type T --num-workers N --image I --run-dir D [--submit] -- ...

With --hosts, host i runs `grpo-run ... mesh.process_id=i` over ssh, with the first host as
the jax.distributed coordinator; all hosts start at once (they must join each other), their
output is prefixed with the host name, and when one fails the others are stopped. With
--tpu, one `gcloud compute tpus tpu-vm ssh --worker=all` starts every worker, and JAX
detects the pod itself. Both set mesh.require_process_count, so a run that did not start on
every host exits at start-up instead of training on a subset.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import IO

from grpo_core.errors import UserError

from grpo_runner_gsm8k.cli import ArgumentParser, train_parser
from grpo_runner_gsm8k.commands import jobset

DEFAULT_PORT = 8476
HOST_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$")


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="grpo-run launch", description="Start a run on every host of a multi-host job.")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--hosts", help="comma-separated hosts reachable by ssh; the first is the coordinator")
    where.add_argument("--tpu", metavar="NAME", help="TPU VM (pod) name for gcloud compute tpus tpu-vm ssh")
    where.add_argument("--jobset", metavar="NAME", help="print a JobSet manifest (GKE) of this name")
    where.add_argument("--xpk", metavar="NAME", help="print (--submit: run) the xpk workload create command")
    parser.add_argument("--coordinator-port", type=int, help=f"--hosts: coordinator port (default {DEFAULT_PORT})")
    parser.add_argument("--zone", help="--tpu, --xpk: the TPU's (cluster's) zone")
    parser.add_argument("--num-workers", type=int, help="--tpu, --jobset, --xpk: worker (host) count of the slice")
    parser.add_argument("--workdir", help="directory to cd into on each host first, relative to the login "
                        "directory unless absolute (default: the login directory)")
    parser.add_argument("--program", default="grpo-run",
                        help="training command on the hosts (default grpo-run; e.g. 'uv run grpo-run')")
    parser.add_argument("--ssh", default="ssh -o BatchMode=yes -o ConnectTimeout=20",
                        help="--hosts: ssh command (default: %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands instead of running them")
    jobset.add_arguments(parser)
    return parser


# ---- arguments -------------------------------------------------------------------------------
def split_argv(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """(launcher arguments, training arguments or None), separated by the first `--`."""
    if "--" not in argv:
        return argv, None
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def parse_hosts(text: str) -> list[str]:
    hosts = [h.strip() for h in text.split(",")]
    for position, host in enumerate(hosts, 1):
        if not HOST_NAME.match(host):
            raise UserError(f"--hosts {text!r}: entry {position} ({host!r}) is not a host name; give "
                            "comma-separated names or IP addresses, e.g. --hosts node0,node1")
    duplicates = sorted({h for h in hosts if hosts.count(h) > 1})
    if duplicates:
        raise UserError(f"--hosts {text!r} names {', '.join(duplicates)} more than once; list every host once "
                        "(one process per host)")
    return hosts


def check_launch_args(args) -> None:
    if args.jobset is not None or args.xpk is not None:
        if args.coordinator_port is not None:
            raise UserError("--coordinator-port goes with --hosts; a JobSet's coordinator is its pod 0 on port "
                            f"{jobset.COORDINATOR_PORT}")
        jobset.check_gke_args(args)
    elif args.tpu is not None:
        missing = [flag for flag, value in (("--zone", args.zone), ("--num-workers", args.num_workers))
                   if value is None]
        if missing:
            raise UserError(f"--tpu {args.tpu} also needs {' and '.join(missing)}; "
                            "e.g. --tpu my-pod --zone us-east5-b --num-workers 4")
        if args.num_workers < 1:
            raise UserError(f"--num-workers {args.num_workers}: a pod slice has at least 1 worker; "
                            "give its host count")
        if args.coordinator_port is not None:
            raise UserError("--coordinator-port goes with --hosts; on a TPU pod JAX finds the coordinator itself")
    elif args.zone is not None or args.num_workers is not None:
        raise UserError("--zone and --num-workers go with --tpu, --jobset or --xpk; with --hosts the host list "
                        "gives the count")
    port = args.coordinator_port
    if port is not None and not 1 <= port <= 65535:
        raise UserError(f"--coordinator-port {port} is not a TCP port; use 1-65535 (default {DEFAULT_PORT})")


def check_training_args(train_argv: list[str], launch_overrides: list[str]) -> None:
    """The training arguments parse, leave the launcher's keys alone, and give a valid config
    with the launcher's overrides, here, before any host is contacted."""
    from grpo_core.config_io import load_config
    from grpo_core.registry import default_registry

    train_args = train_parser().parse_args(train_argv)
    owned = [o.partition("=")[0] for o in launch_overrides]
    taken = [o for o in train_args.overrides if o.partition("=")[0].strip() in owned]
    if taken:
        raise UserError(f"{', '.join(taken)}: grpo-run launch sets {', '.join(owned)} itself; "
                        "remove them from the training arguments")
    load_config(train_args.config, [*train_args.overrides, *launch_overrides], registry=default_registry())


def training_slices(train_argv: list[str]) -> int:
    """The run's `mesh.slices`, from its config file and overrides."""
    from grpo_core.config_io import load_config
    from grpo_core.registry import default_registry

    train_args = train_parser().parse_args(train_argv)
    return load_config(train_args.config, train_args.overrides, registry=default_registry()).mesh.slices


# ---- commands ----------------------------------------------------------------------------------
def host_overrides(process_id: int, num_processes: int, coordinator: str) -> list[str]:
    """What makes process `process_id` join the others through `coordinator` (host:port)."""
    return ["mesh.distributed=on", f"mesh.coordinator_address={coordinator}",
            f"mesh.num_processes={num_processes}", f"mesh.process_id={process_id}",
            f"mesh.require_process_count={num_processes}"]


def remote_command(program: str, train_argv: list[str], extra: list[str], workdir: str | None) -> str:
    """One shell command line for a host: cd, then the training command with its overrides."""
    run = " ".join([program, *(shlex.quote(a) for a in [*train_argv, *extra])])
    return f"cd {quote_dir(workdir)} && {run}" if workdir else run


def quote_dir(path: str) -> str:
    """Shell-quoted, but a leading `~/` stays unquoted so the host expands it to its own home."""
    if path == "~" or path.startswith("~/"):
        return "~/" + shlex.quote(path[2:]) if path[2:] else "~"
    return shlex.quote(path)


def overrides_per_host(args, hosts: list[str]) -> list[list[str]]:
    coordinator = f"{hosts[0]}:{args.coordinator_port or DEFAULT_PORT}"
    return [host_overrides(i, len(hosts), coordinator) for i in range(len(hosts))]


def ssh_commands(args, hosts: list[str], train_argv: list[str]) -> list[list[str]]:
    """The argv of each host's ssh command, in process-id order."""
    return [[*shlex.split(args.ssh), host, remote_command(args.program, train_argv, extra, args.workdir)]
            for host, extra in zip(hosts, overrides_per_host(args, hosts))]


def tpu_overrides(args) -> list[str]:
    return [f"mesh.require_process_count={args.num_workers}"]  # JAX finds the pod's coordinator itself


def tpu_command(args, train_argv: list[str]) -> list[str]:
    command = remote_command(args.program, train_argv, tpu_overrides(args), args.workdir)
    return ["gcloud", "compute", "tpus", "tpu-vm", "ssh", args.tpu, "--zone", args.zone, "--worker=all",
            "--command", command]


# ---- running -----------------------------------------------------------------------------------
@dataclass
class HostRun:
    host: str
    process: subprocess.Popen

    def forward_output(self, out: IO[str], lock: threading.Lock) -> None:
        for line in self.process.stdout:
            with lock:
                out.write(f"[{self.host}] {line}")
                out.flush()


def run_on_hosts(hosts: list[str], commands: list[list[str]], out: IO[str] | None = None) -> int:
    """Runs every host's command at once; the first failure stops the rest. Returns the exit code."""
    out = out or sys.stdout
    try:
        runs = [HostRun(host, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
                for host, cmd in zip(hosts, commands)]
    except FileNotFoundError as exc:
        raise UserError(f"cannot start {exc.filename!r}; install it or pass the ssh command with --ssh") from None
    lock = threading.Lock()
    readers = [threading.Thread(target=r.forward_output, args=(out, lock), daemon=True) for r in runs]
    for reader in readers:
        reader.start()
    code = wait_first_failure(runs, out, lock)
    for reader in readers:
        reader.join()
    return code


def wait_first_failure(runs: list[HostRun], out: IO[str], lock: threading.Lock) -> int:
    pending = list(runs)
    while pending:
        for run in list(pending):
            try:
                code = run.process.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                continue
            pending.remove(run)
            if code != 0:
                stop(pending, f"{run.host} exited with code {code}", out, lock)
                return code
    return 0


def stop(runs: list[HostRun], reason: str, out: IO[str], lock: threading.Lock) -> None:
    with lock:
        out.write(f"grpo-run launch: {reason}; stopping {', '.join(r.host for r in runs) or 'nothing'}\n")
    for run in runs:
        run.process.terminate()
    for run in runs:
        run.process.wait()


def run_tpu(command: list[str]) -> int:
    if shutil.which(command[0]) is None:
        raise UserError("gcloud is not on PATH; install the Google Cloud CLI, or use --dry-run to print the command")
    return subprocess.call(command)


def main(argv: list[str]) -> int:
    launch_argv, train_argv = split_argv(argv)
    args = _parser().parse_args(launch_argv)
    if train_argv is None:
        raise UserError("grpo-run launch needs the training arguments after '--', e.g. "
                        "grpo-run launch --hosts h1,h2 -- --config configs/x.yaml")
    check_launch_args(args)
    if args.jobset is not None or args.xpk is not None:
        return launch_on_gke(args, train_argv)
    if args.tpu is not None:
        return launch_on_tpu(args, train_argv)
    hosts = parse_hosts(args.hosts)
    check_training_args(train_argv, overrides_per_host(args, hosts)[0])
    commands = ssh_commands(args, hosts, train_argv)
    if args.dry_run:
        for command in commands:
            print(shlex.join(command))
        return 0
    return run_on_hosts(hosts, commands)


def launch_on_tpu(args, train_argv: list[str]) -> int:
    check_training_args(train_argv, tpu_overrides(args))
    command = tpu_command(args, train_argv)
    if args.dry_run:
        print(shlex.join(command))
        return 0
    return run_tpu(command)


def launch_on_gke(args, train_argv: list[str]) -> int:
    args.slices = training_slices(train_argv)  # one replicated job (xpk: one slice) per slice of the mesh
    if args.jobset is not None:
        check_training_args(train_argv, jobset.jobset_overrides(args, "0"))
        print(jobset.manifest_yaml(jobset.jobset_manifest(args, shlex.split(args.program), train_argv)), end="")
        return 0
    check_training_args(train_argv, jobset.xpk_overrides(args))
    command = jobset.xpk_command(args, train_argv)
    if not args.submit or args.dry_run:
        print(shlex.join(command))
        return 0
    if shutil.which("xpk") is None:
        raise UserError("xpk is not on PATH; install it (pip install xpk), or leave out --submit to print the command")
    return subprocess.call(command)
