"""`tandem deploy k8s`: the rendered kustomize base validates against the Kubernetes OpenAPI
schemas (kubernetes-validate, strict: an unknown field is an error) and wires the run."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
import yaml
from click.testing import CliRunner

from tandem.common.config import RunConfig, validate
from tandem.master.cli import tandem
from tandem.master.deploy import K8sOptions, render_k8s

from deploy_config import CLIENT_SECRET, SERVER_SECRET, run_config

K8S_VERSION = "1.30.0"


def render(**sections) -> dict[str, str]:
    config = validate(RunConfig, run_config(**sections))
    return render_k8s(config, K8sOptions(image="registry.example/tandem:1"))


def objects(files: dict[str, str]) -> list[dict]:
    return [doc for name, text in files.items() if name.endswith(".yaml")
            and name != "kustomization.yaml" for doc in yaml.safe_load_all(text)]


def by_kind(files: dict[str, str], kind: str, name: str) -> dict:
    found = [o for o in objects(files) if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def check_schema(obj: dict) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("sections", [
    {},
    {"weights": {"transport": "shared_fs"}, "reward": {"service": False}},
    {"sync": {"preset": "one_step_off_policy"}, "explorers": [{"name": "solo"}],
     "transport": {}},
])
def test_every_object_is_valid_kubernetes(sections):
    files = render(**sections)
    for obj in objects(files):
        check_schema(obj)
    kustomization = yaml.safe_load(files["kustomization.yaml"])
    assert kustomization["kind"] == "Kustomization"
    assert sorted(kustomization["resources"]) == sorted(
        n for n in files if n.endswith(".yaml") and n != "kustomization.yaml")


def test_the_validator_rejects_what_kubernetes_would():
    # the schema check above can fail: a misspelt field and a wrong type are both caught
    deployment = by_kind(render(), "Deployment", "demo-master")
    typo = copy.deepcopy(deployment)
    typo["spec"]["replica"] = typo["spec"].pop("replicas")
    with pytest.raises(kubernetes_validate.ValidationError):
        check_schema(typo)
    wrong = copy.deepcopy(deployment)
    wrong["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "5550"
    with pytest.raises(kubernetes_validate.ValidationError):
        check_schema(wrong)


def test_components_are_placed_as_documented():
    files = render()
    for role in ("master", "buffer", "reward"):
        deployment = by_kind(files, "Deployment", f"demo-{role}")
        assert deployment["spec"]["replicas"] == 1
        assert deployment["spec"]["strategy"]["type"] == "Recreate"
        by_kind(files, "Service", f"demo-{role}")
    explorers = by_kind(files, "StatefulSet", "demo-explorer")
    assert explorers["spec"]["replicas"] == 2
    script = explorers["spec"]["template"]["spec"]["containers"][0]["command"][2]
    assert "set -- explorer-0 explorer-1" in script
    job = by_kind(files, "Job", "demo-trainer")
    assert job["spec"]["completionMode"] == "Indexed"
    launch = job["spec"]["template"]["spec"]["containers"][0]["command"][2]
    assert "torchrun" in launch and "tandem-trainer" in launch and "--resume" in launch
    # explorers reach the trainer's weight server through a Service on pod 0
    trainer = by_kind(files, "Service", "demo-trainer")
    assert trainer["spec"]["selector"]["batch.kubernetes.io/job-completion-index"] == "0"
    assert [p["port"] for p in trainer["spec"]["ports"]] == [5580]


def test_the_configmap_wires_clients_to_services_and_servers_bind_all():
    files = render()
    cm = by_kind(files, "ConfigMap", "demo-config")
    data = yaml.safe_load(cm["data"]["run.yaml"])
    assert data["master"]["address"] == "tcp://demo-master:5550"
    assert data["buffer"]["address"] == "tcp://demo-buffer:5560"
    assert data["weights"]["fetch_address"] == "tcp://demo-trainer:5580"
    validate(RunConfig, copy.deepcopy(data) | {"transport": {}})  # a config the CLIs accept
    master = by_kind(files, "Deployment", "demo-master")
    command = master["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "master.address=tcp://0.0.0.0:5550" in command


def test_secrets_are_referenced_never_written():
    files = render()
    text = "".join(files.values())
    assert SERVER_SECRET not in text and CLIENT_SECRET not in text
    data = yaml.safe_load(by_kind(files, "ConfigMap", "demo-config")["data"]["run.yaml"])
    assert data["transport"]["curve"]["server_secret"] == "${env:TANDEM_CURVE_SERVER_SECRET}"
    for obj in objects(files):
        if obj["kind"] in ("Deployment", "StatefulSet", "Job"):
            env = obj["spec"]["template"]["spec"]["containers"][0]["env"]
            refs = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in env
                    if "secretKeyRef" in e.get("valueFrom", {})}
            assert refs == {"TANDEM_CURVE_SERVER_SECRET": "demo-curve",
                            "TANDEM_CURVE_CLIENT_SECRET": "demo-curve"}
    assert not [o for o in objects(files) if o["kind"] == "Secret"]


def test_volumes_follow_the_weight_transport():
    fetch = render()
    assert {o["metadata"]["name"] for o in objects(fetch)
            if o["kind"] == "PersistentVolumeClaim"} == {
        "demo-master-data", "demo-buffer-data", "demo-trainer-data"}
    explorer = by_kind(fetch, "StatefulSet", "demo-explorer")
    assert explorer["spec"]["template"]["spec"]["volumes"][1] == {"name": "run", "emptyDir": {}}
    shared = render(weights={"transport": "shared_fs"})
    claims = [o for o in objects(shared) if o["kind"] == "PersistentVolumeClaim"]
    assert [c["spec"]["accessModes"] for c in claims] == [["ReadWriteMany"]]
    # nothing to serve from the trainer: no trainer Service
    assert not [o for o in objects(shared) if o["metadata"]["name"] == "demo-trainer"
                and o["kind"] == "Service"]


def test_cli_writes_the_base(tmp_path, write_config):
    out = tmp_path / "k8s"
    result = CliRunner().invoke(tandem, ["deploy", "k8s", str(write_config()), "-o", str(out),
                                         "--image", "reg/tandem:1", "--namespace", "rl"])
    assert result.exit_code == 0, result.output
    assert (out / "kustomization.yaml").exists()
    assert yaml.safe_load((out / "kustomization.yaml").read_text())["namespace"] == "rl"
    assert "kubectl create secret generic demo-curve" in (out / "README.md").read_text()


def test_cli_names_the_bad_address(tmp_path, write_config):
    path = write_config(buffer={"address": "ipc:///tmp/buffer"})
    result = CliRunner().invoke(tandem, ["deploy", "k8s", str(path), "-o", str(tmp_path / "o"),
                                         "--image", "x"])
    assert result.exit_code == 2
    assert "buffer.address" in result.output and "tcp://HOST:PORT" in result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize("bound, expected", [
    ("tcp://0.0.0.0:5551", ""), ("tcp://*:5551", ""), ("tcp://[::]:5551", ""),
    ("tcp://10.1.2.3:5551", "tcp://10.1.2.3:5551"), (None, ""),
])
def test_servers_bound_to_every_interface_let_clients_use_their_own_address(bound, expected):
    # the rendered servers bind 0.0.0.0: the master must not hand that to clients on other
    # hosts as the place to subscribe (they would connect to their own host)
    from tandem.master.service import connectable

    assert connectable(bound) == expected
