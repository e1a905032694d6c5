"""`grpo-run launch --jobset / --xpk`: the manifest's fields are those of the published APIs
(Kubernetes models for the Job and pod template, JobSet v1alpha2 below), the pods' commands
give a valid config, bad input, and xpk."""

import json
import os
import shlex
import stat

import kubernetes.client
import pytest
import yaml

from grpo_core.config_io import load_config
from grpo_core.registry import default_registry
from grpo_runner_gsm8k.cli import main

# The JobSet CRD's fields (sigs.k8s.io/jobset api/jobset/v1alpha2 jobset_types.go); "object" leaves a
# field unchecked. Types not listed here are the kubernetes client's models (V1JobTemplateSpec, ...).
JOBSET_V1ALPHA2 = {
    "JobSet": {"apiVersion": "str", "kind": "str", "metadata": "V1ObjectMeta", "spec": "JobSetSpec"},
    "JobSetSpec": {"replicatedJobs": "list[ReplicatedJob]", "network": "Network", "successPolicy": "object",
                   "failurePolicy": "FailurePolicy", "startupPolicy": "object", "suspend": "bool",
                   "coordinator": "object", "managedBy": "str", "ttlSecondsAfterFinished": "int"},
    "ReplicatedJob": {"name": "str", "groupName": "str", "template": "V1JobTemplateSpec", "replicas": "int",
                      "dependsOn": "object"},
    "Network": {"enableDNSHostnames": "bool", "subdomain": "str", "publishNotReadyAddresses": "bool"},
    "FailurePolicy": {"maxRestarts": "int", "restartStrategy": "str", "rules": "object"},
}
SCALARS = {"str": str, "int": int, "bool": bool}


def unknown_fields(value, type_name: str, where: str = "") -> list[str]:
    """Paths of the fields in `value` that `type_name` does not have (or of the wrong scalar type)."""
    if type_name == "object":
        return []
    if type_name.startswith(("list[", "List[")):
        return [bad for i, item in enumerate(value) for bad in unknown_fields(item, type_name[5:-1], f"{where}[{i}]")]
    if type_name.startswith("Dict["):
        inner = type_name[5:-1].split(", ", 1)[1]
        return [bad for key, item in value.items() for bad in unknown_fields(item, inner, f"{where}.{key}")]
    if type_name in SCALARS:
        return [] if isinstance(value, SCALARS[type_name]) else [f"{where} ({value!r} is not {type_name})"]
    fields = JOBSET_V1ALPHA2.get(type_name) or k8s_fields(type_name)
    found = []
    for key, item in value.items():
        found += unknown_fields(item, fields[key], f"{where}.{key}") if key in fields else [f"{where}.{key}"]
    return found


def k8s_fields(type_name: str) -> dict[str, str]:
    """JSON field name -> type of a kubernetes client model (V1PodSpec, ...)."""
    model = getattr(kubernetes.client, type_name)
    return {model.attribute_map[name]: kind for name, kind in model.openapi_types.items()}


def as_k8s_model(value: dict, type_name: str):
    return kubernetes.client.ApiClient().deserialize(json.dumps(value), type_name, "application/json")


GKE = ["--image", "us-docker.pkg.dev/p/r/grpo:1", "--accelerator", "tpu-v6e-slice", "--topology", "4x4",
       "--num-workers", "4"]


def manifest(capsys, tiny_config_path, *extra: str) -> dict:
    assert main(["launch", "--jobset", "grpo-gsm8k", *GKE, *extra, "--", "--config", tiny_config_path,
                 "train.steps=5"]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_jobset_manifest_has_only_published_fields(capsys, tiny_config_path):
    jobset = manifest(capsys, tiny_config_path, "--storage", "gs://my-bucket")
    assert unknown_fields(jobset, "JobSet") == []
    job = jobset["spec"]["replicatedJobs"][0]["template"]
    # the kubernetes models also check required fields (a container without a name fails here)
    assert as_k8s_model(job, "V1JobTemplateSpec").spec.template.spec.containers[0].name == "grpo"
    del job["spec"]["template"]["spec"]["containers"][0]["name"]
    with pytest.raises(ValueError, match="name"):
        as_k8s_model(job, "V1JobTemplateSpec")
    broken = yaml.safe_load(yaml.safe_dump(jobset))
    broken["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["nodeSelectors"] = {}
    broken["spec"]["failurePolicy"]["maxRestart"] = 1
    assert unknown_fields(broken, "JobSet") == [".spec.failurePolicy.maxRestart",
                                                ".spec.replicatedJobs[0].template.spec.template.spec.nodeSelectors"]


def test_jobset_pods_join_pod_0_and_resume_in_the_shared_run_dir(capsys, tiny_config_path):
    jobset = manifest(capsys, tiny_config_path, "--storage", "pvc:runs", "--max-restarts", "5",
                      "--run-dir", "gsm8k/a")
    assert (jobset["apiVersion"], jobset["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    assert jobset["spec"]["failurePolicy"] == {"maxRestarts": 5}
    assert jobset["spec"]["network"]["enableDNSHostnames"] is True
    replicated = jobset["spec"]["replicatedJobs"]
    assert [(r["name"], r["replicas"]) for r in replicated] == [("slice", 1)]
    job = replicated[0]["template"]["spec"]
    assert (job["parallelism"], job["completions"], job["completionMode"]) == (4, 4, "Indexed")
    pod = job["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
                                   "cloud.google.com/gke-tpu-topology": "4x4"}
    container = pod["containers"][0]
    assert container["resources"] == {"requests": {"google.com/tpu": "4"}, "limits": {"google.com/tpu": "4"}}
    assert pod["volumes"] == [{"name": "run-data", "persistentVolumeClaim": {"claimName": "runs"}}]
    assert container["volumeMounts"] == [{"name": "run-data", "mountPath": "/data"}]
    # $(JOB_COMPLETION_INDEX) is expanded by Kubernetes from a variable the container declares
    assert container["env"][0]["name"] == "JOB_COMPLETION_INDEX"
    args = [a.replace("$(JOB_COMPLETION_INDEX)", "3") for a in container["args"]]
    assert container["command"] == ["grpo-run"] and args[:2] == ["--config", tiny_config_path]
    cfg = load_config(args[1], args[2:], registry=default_registry())
    assert (cfg.train.steps, cfg.logging.dir, cfg.checkpoint.resume) == (5, "/data/gsm8k/a", "auto")
    # <jobset>-<replicated job>-<job index>-<pod index>.<subdomain, by default the jobset's name>
    assert cfg.mesh.coordinator_address == "grpo-gsm8k-slice-0-0.grpo-gsm8k:8476"
    assert (cfg.mesh.num_processes, cfg.mesh.process_id, cfg.mesh.require_process_count) == (4, 3, 4)


def test_xpk_prints_the_workload_command_and_submits_it_when_asked(capsys, tmp_path, monkeypatch, tiny_config_path):
    xpk = ["launch", "--xpk", "grpo-gsm8k", "--cluster", "c1", "--tpu-type", "v6e-16", "--num-workers", "4",
           "--image", "img:1", "--run-dir", "/gcs/b/run", "--max-restarts", "2", "--", "--config",
           tiny_config_path, "train.steps=5"]
    assert main(xpk) == 0
    printed = shlex.split(capsys.readouterr().out)
    assert printed[:3] == ["xpk", "workload", "create"]
    options = dict(zip(printed[3::2], printed[4::2]))
    assert {k: options[k] for k in ("--cluster", "--workload", "--tpu-type", "--num-slices", "--docker-image",
                                    "--max-restarts")} == {
        "--cluster": "c1", "--workload": "grpo-gsm8k", "--tpu-type": "v6e-16", "--num-slices": "1",
        "--docker-image": "img:1", "--max-restarts": "2"}
    program, *args = shlex.split(options["--command"])
    cfg = load_config(args[1], args[2:], registry=default_registry())
    assert program == "grpo-run" and cfg.mesh.require_process_count == 4 and cfg.logging.dir == "/gcs/b/run"
    fake = tmp_path / "xpk"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'called'}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert main([*xpk[:3], "--submit", *xpk[3:]]) == 0
    assert (tmp_path / "called").read_text().startswith("workload create --cluster c1 --workload grpo-gsm8k")


BAD_GKE = [
    (["--jobset", "Grpo_Run", *GKE, "--storage", "pvc:x"], "job name 'Grpo_Run' must be a DNS label"),
    (["--jobset", "run", "--image", "i", "--storage", "pvc:x"],
     "--jobset run also needs --accelerator and --topology and --num-workers"),
    (["--jobset", "run", *GKE[:-1], "3", "--storage", "pvc:x"],
     "--topology 4x4 has 16 chips but --num-workers 3 x --chips-per-host 4 is 12"),
    (["--jobset", "run", *GKE, "--storage", "s3://b"], "--storage 's3://b': give gs://BUCKET"),
    (["--jobset", "run", *GKE, "--storage", "pvc:x", "--coordinator-port", "1"], "--coordinator-port goes with"),
    (["--xpk", "run", "--cluster", "c", "--tpu-type", "v6e-16", "--num-workers", "4", "--image", "i"],
     "--xpk run also needs --run-dir"),
]


@pytest.mark.parametrize("launch_args,hint", BAD_GKE, ids=[h for _, h in BAD_GKE])
def test_bad_gke_arguments_exit_2_with_one_line(launch_args, hint, capsys, tiny_config_path):
    assert main(["launch", *launch_args, "--", "--config", tiny_config_path]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("grpo-run: error: ") and hint in err[0], err
    assert captured.out == ""


def test_jobset_refuses_a_run_dir_given_as_an_override(capsys, tiny_config_path):
    assert main(["launch", "--jobset", "run", *GKE, "--storage", "pvc:x", "--", "--config", tiny_config_path,
                 "logging.dir=/tmp/x"]) == 2
    assert "grpo-run launch sets" in capsys.readouterr().err


def test_a_run_of_two_slices_is_two_replicated_jobs_whose_pods_number_every_host(capsys, tiny_config_path):
    """mesh.slices=2: two jobs of 4 pods; the shell line of pod 3 of slice 1, run by sh with the indices
    the controllers set, starts process 7 of 8; libtpu's DCN variables name slice 0's pod 0 and the pod's slice."""
    import subprocess
    import sys

    echo = f"{sys.executable} -c 'import json, sys; print(json.dumps(sys.argv[1:]))'"
    assert main(["launch", "--jobset", "grpo-gsm8k", *GKE, "--storage", "pvc:runs", "--program", echo, "--",
                 "--config", tiny_config_path, "mesh.slices=2"]) == 0
    jobset = yaml.safe_load(capsys.readouterr().out)
    assert unknown_fields(jobset, "JobSet") == []
    replicated = jobset["spec"]["replicatedJobs"]
    assert [(r["name"], r["replicas"]) for r in replicated] == [("slice", 2)]
    container = replicated[0]["template"]["spec"]["template"]["spec"]["containers"][0]
    as_k8s_model(replicated[0]["template"], "V1JobTemplateSpec")
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["JOB_INDEX"] == {"fieldRef": {"fieldPath": "metadata.annotations['jobset.sigs.k8s.io/job-index']"}}
    assert {k: env[k] for k in ("MEGASCALE_COORDINATOR_ADDRESS", "MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID")} == {
        "MEGASCALE_COORDINATOR_ADDRESS": "grpo-gsm8k-slice-0-0.grpo-gsm8k", "MEGASCALE_NUM_SLICES": "2",
        "MEGASCALE_SLICE_ID": "$(JOB_INDEX)"}
    assert container["command"] == ["/bin/sh", "-c"]
    started = subprocess.run([*container["command"], *container["args"]], capture_output=True, text=True, check=True,
                             env={**os.environ, "JOB_INDEX": "1", "JOB_COMPLETION_INDEX": "3"})
    args = json.loads(started.stdout)
    cfg = load_config(args[1], args[2:], registry=default_registry())
    assert (cfg.mesh.slices, cfg.mesh.num_processes, cfg.mesh.process_id, cfg.mesh.require_process_count) == (2, 8, 7, 8)
    assert cfg.mesh.coordinator_address == "grpo-gsm8k-slice-0-0.grpo-gsm8k:8476"


def test_xpk_creates_as_many_slices_as_the_mesh_has(capsys, tiny_config_path):
    assert main(["launch", "--xpk", "grpo-gsm8k", "--cluster", "c1", "--tpu-type", "v6e-16", "--num-workers", "4",
                 "--image", "img:1", "--run-dir", "/gcs/b/run", "--", "--config", tiny_config_path,
                 "mesh.slices=2"]) == 0
    printed = shlex.split(capsys.readouterr().out)
    options = dict(zip(printed[3::2], printed[4::2]))
    assert options["--num-slices"] == "2"
    program, *args = shlex.split(options["--command"])
    assert load_config(args[1], args[2:], registry=default_registry()).mesh.require_process_count == 8
