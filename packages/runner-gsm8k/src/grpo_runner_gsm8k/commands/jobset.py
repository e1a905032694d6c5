"""`grpo-run launch --jobset` / `--xpk`: the run as a JobSet on GKE TPU node pools.

One replicated job per TPU slice (as many as the run's `mesh.slices`), each an Indexed Job of
one pod per TPU host. Pod i of slice j is process j x hosts + i; pod 0 of slice 0 is the
coordinator, reached through the JobSet's headless service at
`<jobset>-slice-0-0.<jobset>:8476`. Across slices, libtpu joins the slices over DCN from the
MEGASCALE_* variables (the coordinator pod, the slice count and this pod's slice). The run
directory lies on a bucket (Cloud Storage FUSE) or a volume claim shared by the pods; a JobSet
restart (`failurePolicy.maxRestarts`) starts every pod again in the same directory, where
grpo-run continues from the newest checkpoint (checkpoint.resume: auto).
"""

from __future__ import annotations

import math
import re
import shlex

import yaml
from grpo_core.errors import UserError

API_VERSION = "jobset.x-k8s.io/v1alpha2"
REPLICATED_JOB = "slice"
COORDINATOR_PORT = 8476
MEGASCALE_PORT = 8080  # libtpu's DCN coordinator port
DATA_MOUNT = "/data"
# Set by the Job controller on every pod of an Indexed Job, and by JobSet on every pod of its jobs.
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
JOB_INDEX = "metadata.annotations['jobset.sigs.k8s.io/job-index']"
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
TOPOLOGY = re.compile(r"^\d+(x\d+){1,2}$")


def add_arguments(parser) -> None:
    group = parser.add_argument_group("--jobset / --xpk (GKE)")
    group.add_argument("--image", help="container image with grpo-jax installed")
    group.add_argument("--accelerator", help="--jobset: GKE TPU accelerator, e.g. tpu-v6e-slice")
    group.add_argument("--topology", help="--jobset: TPU slice topology, e.g. 4x4")
    group.add_argument("--chips-per-host", type=int, default=4, help="--jobset: TPU chips per host (default 4)")
    group.add_argument("--storage", help="run directory storage: gs://BUCKET (Cloud Storage FUSE) or pvc:CLAIM, "
                       f"mounted at {DATA_MOUNT}")
    group.add_argument("--run-dir", help="--jobset: run directory (logging.dir) under the storage, default: the "
                       "job name; --xpk: logging.dir itself, on storage the cluster mounts")
    group.add_argument("--max-restarts", type=int, default=3,
                       help="restarts of the whole job after a failure, each resuming from the last checkpoint")
    group.add_argument("--cluster", help="--xpk: GKE cluster name")
    group.add_argument("--tpu-type", help="--xpk: TPU type, e.g. v6e-16")
    group.add_argument("--submit", action="store_true", help="--xpk: run the xpk command instead of printing it")


# ---- checks ------------------------------------------------------------------------------------
def check_gke_args(args) -> None:
    name = args.jobset or args.xpk
    if not DNS_LABEL.match(name) or len(name) > 40:
        raise UserError(f"job name {name!r} must be a DNS label: lower-case letters, digits and '-', starting "
                        "with a letter, at most 40 characters (pod host names add to it), e.g. grpo-gsm8k")
    needed = (["--image", "--storage", "--accelerator", "--topology", "--num-workers"] if args.jobset
              else ["--image", "--cluster", "--tpu-type", "--num-workers", "--run-dir"])
    missing = [flag for flag in needed if getattr(args, flag[2:].replace("-", "_")) is None]
    if missing:
        raise UserError(f"{'--jobset' if args.jobset else '--xpk'} {name} also needs {' and '.join(missing)}; "
                        "see grpo-run launch --help and docs/multihost.md")
    if args.num_workers < 1:
        raise UserError(f"--num-workers {args.num_workers}: a slice has at least 1 host; give its host count")
    if args.max_restarts < 0:
        raise UserError(f"--max-restarts {args.max_restarts} is negative; give 0 or more (default 3)")
    if args.jobset:
        storage_volume(args.storage)
        check_topology(args.topology, args.num_workers, args.chips_per_host)


def check_topology(topology: str, num_workers: int, chips_per_host: int) -> None:
    if not TOPOLOGY.match(topology):
        raise UserError(f"--topology {topology!r} is not a TPU topology; give e.g. 2x4, 4x4 or 2x2x4")
    chips = math.prod(int(side) for side in topology.split("x"))
    if num_workers < 1 or chips != num_workers * chips_per_host:
        raise UserError(f"--topology {topology} has {chips} chips but --num-workers {num_workers} x "
                        f"--chips-per-host {chips_per_host} is {num_workers * chips_per_host}; give the slice's "
                        f"host count ({chips // chips_per_host} with {chips_per_host} chips per host)")


def storage_volume(storage: str) -> dict:
    """The pod volume of `--storage` (gs://BUCKET or pvc:CLAIM)."""
    if storage.startswith("gs://") and storage[5:].strip("/"):
        return {"name": "run-data", "csi": {"driver": "gcsfuse.csi.storage.gke.io",
                                            "volumeAttributes": {"bucketName": storage[5:].strip("/")}}}
    if storage.startswith("pvc:") and storage[4:]:
        return {"name": "run-data", "persistentVolumeClaim": {"claimName": storage[4:]}}
    raise UserError(f"--storage {storage!r}: give gs://BUCKET (mounted with Cloud Storage FUSE) or pvc:CLAIM "
                    "(a ReadWriteMany volume claim), where the run directory and its checkpoints live")


# ---- what the pods run -------------------------------------------------------------------------
def run_dir(args) -> str:
    return f"{DATA_MOUNT}/{(args.run_dir or args.jobset or args.xpk).strip('/')}"


def coordinator(name: str) -> str:
    """Pod 0 of slice 0 by JobSet's host name <jobset>-<replicated job>-<job>-<pod>.<subdomain>."""
    return f"{name}-{REPLICATED_JOB}-0-0.{name}:{COORDINATOR_PORT}"


def jobset_overrides(args, process_id: str) -> list[str]:
    """The launcher's overrides for one pod; `process_id` is an expression the pod expands
    (process_id_expression) in the manifest and a number when the config is checked here."""
    count = args.num_workers * args.slices
    return ["mesh.distributed=on", f"mesh.coordinator_address={coordinator(args.jobset)}",
            f"mesh.num_processes={count}", f"mesh.process_id={process_id}",
            f"mesh.require_process_count={count}", f"logging.dir={run_dir(args)}"]


def process_id_expression(args) -> str:
    """One slice: the pod's completion index, which Kubernetes expands in the container's arguments.
    Several: slice index x hosts + completion index, which needs the arithmetic of a shell."""
    if args.slices == 1:
        return "$(JOB_COMPLETION_INDEX)"
    return f"$((JOB_INDEX * {args.num_workers} + JOB_COMPLETION_INDEX))"


def xpk_overrides(args) -> list[str]:
    # xpk's pods carry GKE's TPU variables, from which JAX finds the coordinator and process ids
    return [f"mesh.require_process_count={args.num_workers * args.slices}", f"logging.dir={args.run_dir}"]


# ---- the manifest ------------------------------------------------------------------------------
def jobset_manifest(args, program: list[str], train_argv: list[str]) -> dict:
    name = args.jobset
    job = {"parallelism": args.num_workers, "completions": args.num_workers, "completionMode": "Indexed",
           "backoffLimit": 0,  # a failed pod fails its job, and the JobSet restarts every job
           "template": {"metadata": {"annotations": {"gke-gcsfuse/volumes": "true"}}
                        if args.storage.startswith("gs://") else {},
                        "spec": pod_spec(args, program, train_argv)}}
    return {"apiVersion": API_VERSION, "kind": "JobSet",
            "metadata": {"name": name,
                         "annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}},
            "spec": {"failurePolicy": {"maxRestarts": args.max_restarts},
                     "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
                     "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": args.slices,
                                         "template": {"spec": job}}]}}


def pod_spec(args, program: list[str], train_argv: list[str]) -> dict:
    chips = {"google.com/tpu": str(args.chips_per_host)}  # a resource quantity
    container = {"name": "grpo", "image": args.image, **pod_command(args, program, train_argv),
                 "env": pod_env(args),
                 "ports": [{"name": "coordinator", "containerPort": COORDINATOR_PORT}],
                 "resources": {"requests": dict(chips), "limits": dict(chips)},
                 "volumeMounts": [{"name": "run-data", "mountPath": DATA_MOUNT}]}
    if args.workdir:
        container["workingDir"] = args.workdir
    return {"restartPolicy": "Never", "containers": [container], "volumes": [storage_volume(args.storage)],
            "nodeSelector": {"cloud.google.com/gke-tpu-accelerator": args.accelerator,
                             "cloud.google.com/gke-tpu-topology": args.topology}}


def pod_command(args, program: list[str], train_argv: list[str]) -> dict:
    """The container's command and arguments; across slices, one shell line that computes the process id."""
    expression = process_id_expression(args)
    argv = [*train_argv, *jobset_overrides(args, expression)]
    if args.slices == 1:
        return {"command": program, "args": argv}
    unquoted = f"mesh.process_id={expression}"  # the one argument the shell expands
    line = " ".join(arg if arg == unquoted else shlex.quote(arg) for arg in [*program, *argv])
    return {"command": ["/bin/sh", "-c"], "args": [f"exec {line}"]}


def pod_env(args) -> list[dict]:
    """The pod's indices from its annotations; across slices, libtpu's DCN variables too."""
    env = [{"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}}]
    if args.slices == 1:
        return env
    megascale = {"MEGASCALE_COORDINATOR_ADDRESS": coordinator(args.jobset).rsplit(":", 1)[0],
                 "MEGASCALE_NUM_SLICES": str(args.slices), "MEGASCALE_PORT": str(MEGASCALE_PORT)}
    return [*env, {"name": "JOB_INDEX", "valueFrom": {"fieldRef": {"fieldPath": JOB_INDEX}}},
            {"name": "MEGASCALE_SLICE_ID", "value": "$(JOB_INDEX)"},
            *({"name": name, "value": value} for name, value in megascale.items())]


def manifest_yaml(manifest: dict) -> str:
    return yaml.safe_dump(manifest, sort_keys=False, default_flow_style=False)


def xpk_command(args, train_argv: list[str]) -> list[str]:
    run = shlex.join([*shlex.split(args.program), *train_argv, *xpk_overrides(args)])
    command = f"cd {shlex.quote(args.workdir)} && {run}" if args.workdir else run
    zone = ["--zone", args.zone] if args.zone else []
    return ["xpk", "workload", "create", "--cluster", args.cluster, *zone, "--workload", args.xpk,
            "--tpu-type", args.tpu_type, "--num-slices", str(args.slices), "--docker-image", args.image,
            "--max-restarts", str(args.max_restarts), "--command", command]
