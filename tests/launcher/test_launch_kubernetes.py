"""examples/cluster/kubernetes.yaml, run as local processes.

Each pod of the Indexed Job is a process that runs exactly the container's
command and arguments, with the container's environment plus the
`JOB_COMPLETION_INDEX` Kubernetes gives pod i, in the repository root (the
image's working directory). What a single machine cannot have is the
cluster's DNS: the headless Service's name of pod 0 is replaced by the
address it resolves to here, 127.0.0.1 (and, if another program holds the
manifest's ports on this shared machine, the port by a free one). Anything
else in the manifest that this test cannot reproduce fails it, so the
manifest cannot drift from the launcher.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from _cluster import REPO_DIR, cluster_env
from keras_comm import launch

yaml = pytest.importorskip("yaml", reason="PyYAML (installed with the test extra's mkdocs)")

pytestmark = pytest.mark.multiprocess

MANIFEST = REPO_DIR / "examples" / "cluster" / "kubernetes.yaml"


def _manifest():
    docs = list(yaml.safe_load_all(MANIFEST.read_text()))
    by_kind = {d["kind"]: d for d in docs}
    assert sorted(by_kind) == ["Job", "Service"], by_kind.keys()
    return by_kind["Service"], by_kind["Job"]


def _option(args, name):
    return args[args.index(name) + 1]


def test_manifest_is_an_indexed_job_behind_a_headless_service():
    service, job = _manifest()
    spec = job["spec"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]

    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == int(_option(args, "--nnodes"))
    assert pod["subdomain"] == service["metadata"]["name"]
    # Pod 0 of the job, under the Service: <job>-0.<service>.
    assert _option(args, "--master-addr") == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert "--node-rank" not in args  # the launcher reads JOB_COMPLETION_INDEX
    assert container["command"] == ["keras-comm-run"]
    assert container["ports"][0]["containerPort"] == int(_option(args, "--master-port"))


def _pod_commands():
    """(argv, env) of every pod, as Kubernetes would start them here."""
    service, job = _manifest()
    (container,) = job["spec"]["template"]["spec"]["containers"]
    args = [str(a) for a in container["args"]]
    master = _option(args, "--master-addr")
    port = int(_option(args, "--master-port"))
    nnodes = int(_option(args, "--nnodes"))
    workers = int(_option(args, "-n"))
    try:
        launch.pick_ports(1 + nnodes * workers, base_port=port)
    except ValueError:
        port = launch.pick_ports(1)[0]
    args = ["127.0.0.1" if a == master else a for a in args]
    args[args.index("--master-port") + 1] = str(port)
    env = {}
    for item in container.get("env", []):
        assert set(item) == {"name", "value"}, f"the test cannot reproduce {item}"
        env[item["name"]] = str(item["value"])
    executable = Path(sys.executable).with_name(container["command"][0])
    if not executable.exists():
        pytest.skip(f"{executable.name} is not installed (pip install -e .)")
    return [
        ([str(executable), *container["command"][1:], *args],
         {**env, "JOB_COMPLETION_INDEX": str(index)})
        for index in range(job["spec"]["completions"])
    ]


def test_the_manifests_pods_train_as_local_processes(tmp_path):
    pods = []
    try:
        for argv, env in _pod_commands():
            pods.append(subprocess.Popen(
                argv, env=cluster_env(tmp_path, env),
                cwd=REPO_DIR, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            ))
        outputs = [pod.communicate(timeout=600) for pod in pods]
    finally:
        for pod in pods:
            if pod.poll() is None:
                pod.kill()
                pod.communicate()
    for index, (out, err) in enumerate(outputs):
        print(f"--- pod {index} ---\n{out[-1500:]}\n{err[-1500:]}")

    assert [p.returncode for p in pods] == [0, 0], [e[-3000:] for _, e in outputs]
    # Pod 0 runs the chief: its console shows the comparison; pod 1's shows no rank.
    match = re.search(r"\[rank 0\] test accuracy, 2 workers: .* max relative weight "
                      r"difference: ([0-9.e+-]+)", outputs[0][0])
    assert match, outputs[0][0][-3000:]
    assert float(match.group(1)) < 1e-4  # the 2-pod fit equals one process
    assert "[rank" not in outputs[1][0]


def _docs_block(lang, first_line):
    text = (REPO_DIR / "docs" / "cluster.md").read_text()
    start = text.index(f"```{lang}\n{first_line}") + len(f"```{lang}\n")
    return text[start:text.index("```", start)]


def test_the_docs_show_the_manifest_and_the_sbatch_script_as_they_are():
    assert list(yaml.safe_load_all(_docs_block("yaml", "apiVersion"))) == list(
        yaml.safe_load_all(MANIFEST.read_text()))
    script = (REPO_DIR / "examples" / "cluster" / "slurm.sbatch").read_text().splitlines()
    # The file's comment lines (not its #! and #SBATCH lines) are left out of the page.
    kept = [line for line in script
            if not (line.startswith("#") and not line.startswith(("#!", "#SBATCH")))]
    assert _docs_block("bash", "#!/bin/bash").splitlines() == kept
