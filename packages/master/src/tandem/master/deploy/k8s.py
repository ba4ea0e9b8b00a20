"""`tandem deploy k8s`: a kustomize base for one run, rendered from its run config.

What it places where, and why:

- master, buffer and (when `reward.service`) reward: a Deployment of one replica each, with a
  Service that gives clients a stable name. The master's journal and the buffer's SQLite file
  are the run's durable state, so each sits on its own PersistentVolumeClaim and its Deployment
  uses the Recreate strategy (two pods never open the same SQLite file).
- explorers: one StatefulSet with `replicas` = the number of `explorers` in the config. A
  StatefulSet rather than a Deployment because an explorer's name is its identity (its
  registration, its experience ids, its weight-group membership) and a Deployment's pods have
  none; pod k runs `explorers[k]`, told by the pod-index label (Kubernetes >= 1.28).
- trainer: an indexed Job of `trainer_nodes` pods running torchrun (static rendezvous on pod 0
  through a headless Service), restarted with `--resume` on failure; a Job, so a finished run
  stays finished. A Service selects pod 0 for what explorers reach: the weight server
  (`weights.transport: fetch`) and the broadcast rendezvous (`sync.method: nccl`).
- the run config: a ConfigMap, mounted read-only. Curve secret keys never appear in it: the
  config names `${env:TANDEM_CURVE_*_SECRET}` and every container reads those from the Secret
  `<name>-curve`, which the operator creates (README.md in the output says how).
- run_dir: with `weights.transport: shared_fs` one ReadWriteMany claim mounted by every pod
  (explorers read the trainer's weights from it); with `fetch` each stateful component has its
  own claim and explorers a pod-local emptyDir, because nothing needs to be shared.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tandem.common.plugins import outside_tandem
from tandem.common.config import RunConfig

from .common import (CURVE_SECRET_ENV, TORCHRUN_PORT, bind_overrides, component_config, dns_name,
                     reward_service, server_ports)

CONFIG_DIR = "/etc/tandem"
CONFIG_PATH = f"{CONFIG_DIR}/run.yaml"
RUN_DIR = "/var/lib/tandem/run"


@dataclass(frozen=True)
class K8sOptions:
    """What the run config does not say about a cluster."""

    image: str
    name: str | None = None
    namespace: str | None = None
    storage_class: str | None = None
    storage_size: str = "20Gi"
    trainer_nodes: int = 1
    gpus_per_node: int = 0
    explorer_gpus: int = 0
    image_pull_policy: str = "IfNotPresent"


def render_k8s(config: RunConfig, options: K8sOptions) -> dict[str, str]:
    """File name -> text of the kustomize base (`kustomization.yaml` lists the resources)."""
    return _Renderer(config, options).files()


def write_k8s(config: RunConfig, options: K8sOptions, out: str | Path) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_k8s(config, options).items():
        path = out / name
        path.write_text(text)
        written.append(path)
    return written


class _Renderer:
    def __init__(self, config: RunConfig, options: K8sOptions):
        if options.trainer_nodes < 1:
            raise ValueError("--trainer-nodes must be at least 1")
        self.config = config
        self.opt = options
        self.name = dns_name(options.name or config.name, "name")
        self.ports = server_ports(config)
        self.shared = config.weights.transport == "shared_fs"
        self.reward = reward_service(config)
        self.hosts = {"master": f"{self.name}-master", "buffer": f"{self.name}-buffer",
                      "reward": f"{self.name}-reward", "trainer": f"{self.name}-trainer"}

    # -- documents ----------------------------------------------------------------------------

    def files(self) -> dict[str, str]:
        docs: dict[str, list[dict]] = {
            "configmap.yaml": [self.configmap()],
            "pvc.yaml": self.claims(),
            "master.yaml": [self.server_deployment("master", ["master", "master-pub"]),
                            self.service("master", ["master", "master-pub"])],
            "buffer.yaml": [self.server_deployment("buffer", ["buffer"]),
                            self.service("buffer", ["buffer"])],
            "trainer.yaml": [self.trainer_job(), self.trainer_hosts_service()],
            "explorers.yaml": [self.explorers(), self.headless("explorer")],
        }
        if self.trainer_ports():
            # what explorers reach on the trainer is served by rank 0, on pod 0
            docs["trainer.yaml"].append(self.service(
                "trainer", self.trainer_ports(), {"batch.kubernetes.io/job-completion-index": "0"}))
        if self.reward:
            docs["reward.yaml"] = [self.server_deployment("reward", ["reward"]),
                                   self.service("reward", ["reward"])]
        files = {name: yaml.safe_dump_all(d, sort_keys=False) for name, d in docs.items()}
        kustomization: dict[str, Any] = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "labels": [{"pairs": {"app.kubernetes.io/instance": self.name},
                        "includeSelectors": False}],
            "resources": list(docs)}
        if self.opt.namespace:
            kustomization["namespace"] = self.opt.namespace
        files["kustomization.yaml"] = yaml.safe_dump(kustomization, sort_keys=False)
        files["README.md"] = self.readme()
        return files

    def configmap(self) -> dict:
        data = component_config(self.config, run_dir=RUN_DIR, hosts=self.hosts)
        return {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": self.meta("config", "config"),
                "data": {"run.yaml": yaml.safe_dump(data, sort_keys=False)}}

    def claims(self) -> list[dict]:
        if self.shared:
            return [self.claim("run", "ReadWriteMany")]
        claims = [self.claim("master", "ReadWriteOnce"), self.claim("buffer", "ReadWriteOnce")]
        claims.append(self.claim("trainer", "ReadWriteOnce" if self.opt.trainer_nodes == 1
                                 else "ReadWriteMany"))
        return claims

    def claim(self, what: str, mode: str) -> dict:
        spec: dict[str, Any] = {"accessModes": [mode],
                                "resources": {"requests": {"storage": self.opt.storage_size}}}
        if self.opt.storage_class:
            spec["storageClassName"] = self.opt.storage_class
        return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                "metadata": self.meta(f"{what}-data", what), "spec": spec}

    def server_deployment(self, role: str, ports: list[str]) -> dict:
        command = [f"tandem-{role}", "--config", CONFIG_PATH]
        for override in bind_overrides(self.config, role):
            command += ["--set", override]
        container = self.container(role, command, ports=ports)
        container["readinessProbe"] = {"tcpSocket": {"port": ports[0]},
                                       "periodSeconds": 5}
        volume = self.run_volume(role) if role != "reward" else {"name": "run", "emptyDir": {}}
        return {"apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": self.meta(role, role),
                "spec": {"replicas": 1, "strategy": {"type": "Recreate"},
                         "selector": {"matchLabels": self.selector(role)},
                         "template": {"metadata": {"labels": self.labels(role)},
                                      "spec": self.pod_spec([container], volume, 30)}}}

    def trainer_job(self) -> dict:
        nodes = self.opt.trainer_nodes
        per_node = max(self.opt.gpus_per_node, 1)
        trainer = ["tandem-trainer", "--config", CONFIG_PATH, "--resume"]
        for override in bind_overrides(self.config, "trainer"):
            trainer += ["--set", override]
        if self.opt.gpus_per_node > 0:
            trainer += ["--set", "trainer.device=cuda"]
        # every rank runs the same tandem-trainer; static rendezvous on pod 0
        launch = ("exec tandem-torchrun"
                  f" --nnodes={nodes} --nproc-per-node={per_node}"
                  " --node-rank=\"$JOB_COMPLETION_INDEX\""
                  f" --master-addr={self.name}-trainer-0.{self.name}-trainer-hosts"
                  f" --master-port={TORCHRUN_PORT}"
                  " --no-python " + " ".join(shlex.quote(a) for a in trainer))
        container = self.container("trainer", ["/bin/sh", "-c", launch],
                                   ports=self.trainer_ports() + ["torchrun"],
                                   gpus=self.opt.gpus_per_node)
        pod = self.pod_spec([container], self.run_volume("trainer"), 60)
        pod["restartPolicy"] = "OnFailure"
        pod["subdomain"] = f"{self.name}-trainer-hosts"
        return {"apiVersion": "batch/v1", "kind": "Job",
                "metadata": self.meta("trainer", "trainer"),
                "spec": {"completionMode": "Indexed", "completions": nodes,
                         "parallelism": nodes, "backoffLimit": 6 * nodes,
                         "template": {"metadata": {"labels": self.labels("trainer")},
                                      "spec": pod}}}

    def trainer_ports(self) -> list[str]:
        ports = []
        if self.config.weights.transport == "fetch":
            ports.append("fetch")
        if self.config.sync.method == "nccl":
            ports.append("rendezvous")
        return ports

    def trainer_hosts_service(self) -> dict:
        return {"apiVersion": "v1", "kind": "Service",
                "metadata": self.meta("trainer-hosts", "trainer"),
                "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                         "selector": self.selector("trainer"),
                         "ports": [self.service_port("torchrun")]}}

    def explorers(self) -> dict:
        names = " ".join(shlex.quote(e.name) for e in self.config.explorers)
        script = (f"set -- {names}\n"
                  "shift \"$POD_INDEX\"\n"
                  f"exec tandem-explorer --config {CONFIG_PATH} --name \"$1\"\n")
        container = self.container("explorer", ["/bin/sh", "-c", script], ports=[],
                                   gpus=self.opt.explorer_gpus)
        container["env"].insert(0, {"name": "POD_INDEX", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}})
        volume = self.run_volume("explorer")
        grace = int(max(e.drain_seconds for e in self.config.explorers)) + 15
        return {"apiVersion": "apps/v1", "kind": "StatefulSet",
                "metadata": self.meta("explorer", "explorer"),
                "spec": {"replicas": len(self.config.explorers),
                         "serviceName": f"{self.name}-explorer",
                         "podManagementPolicy": "Parallel",
                         "selector": {"matchLabels": self.selector("explorer")},
                         "template": {"metadata": {"labels": self.labels("explorer")},
                                      "spec": self.pod_spec([container], volume, grace)}}}

    def headless(self, role: str) -> dict:
        return {"apiVersion": "v1", "kind": "Service", "metadata": self.meta(role, role),
                "spec": {"clusterIP": "None", "selector": self.selector(role)}}

    def service(self, role: str, ports: list[str], extra: dict[str, str] | None = None) -> dict:
        return {"apiVersion": "v1", "kind": "Service", "metadata": self.meta(role, role),
                "spec": {"selector": {**self.selector(role), **(extra or {})},
                         "ports": [self.service_port(p) for p in ports]}}

    # -- pieces -------------------------------------------------------------------------------

    def port(self, name: str) -> int:
        return TORCHRUN_PORT if name == "torchrun" else self.ports[name]

    def service_port(self, name: str) -> dict:
        return {"name": name, "port": self.port(name), "targetPort": name, "protocol": "TCP"}

    def container(self, role: str, command: list[str], *, ports: list[str],
                  gpus: int = 0) -> dict:
        env: list[dict] = []
        if self.config.transport.curve is not None:
            for key, var in CURVE_SECRET_ENV.items():
                env.append({"name": var, "valueFrom": {"secretKeyRef": {
                    "name": f"{self.name}-curve", "key": key.replace("_", "-")}}})
        container: dict[str, Any] = {
            "name": role, "image": self.opt.image, "imagePullPolicy": self.opt.image_pull_policy,
            "command": command, "env": env,
            "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                             {"name": "run", "mountPath": RUN_DIR}]}
        if ports:
            container["ports"] = [{"name": p, "containerPort": self.port(p), "protocol": "TCP"}
                                  for p in ports]
        if gpus:
            container["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
        return container

    def run_volume(self, role: str) -> dict:
        if self.shared:
            return {"name": "run", "persistentVolumeClaim": {"claimName": f"{self.name}-run-data"}}
        if role in ("master", "buffer", "trainer"):
            return {"name": "run",
                    "persistentVolumeClaim": {"claimName": f"{self.name}-{role}-data"}}
        return {"name": "run", "emptyDir": {}}

    def pod_spec(self, containers: list[dict], run_volume: dict, grace: int) -> dict:
        return {"containers": containers,
                "terminationGracePeriodSeconds": grace,
                "volumes": [{"name": "config", "configMap": {"name": f"{self.name}-config"}},
                            run_volume]}

    def meta(self, suffix: str, component: str) -> dict:
        return {"name": f"{self.name}-{suffix}", "labels": self.labels(component)}

    def labels(self, component: str) -> dict[str, str]:
        return {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": self.name,
                "app.kubernetes.io/component": component}

    def selector(self, component: str) -> dict[str, str]:
        return {"app.kubernetes.io/instance": self.name,
                "app.kubernetes.io/component": component}

    def readme(self) -> str:
        lines = [f"# tandem run `{self.name}` on Kubernetes", "",
                 "Rendered by `tandem deploy k8s`; apply with `kubectl apply -k .`.", ""]
        if self.config.transport.curve is not None:
            lines += ["The run uses CurveZMQ. Create its secret keys first (never commit them):",
                      "", "```sh",
                      f"kubectl create secret generic {self.name}-curve \\",
                      "  --from-literal=server-secret=\"$SERVER_SECRET\" \\",
                      "  --from-literal=client-secret=\"$CLIENT_SECRET\"", "```", ""]
        lines += [f"The image `{self.opt.image}` must hold tandem, the model at "
                  f"`{self.config.model.path or '(model.path)'}` and the taskset at "
                  f"`{self.config.master.taskset.path or '(master.taskset.path)'}`, or mount "
                  "them there.", ""]
        needed = outside_tandem(self.config.plugins)
        if needed:
            lines += ["It must also hold what the run's plugins need (docs/extending.md), "
                      "installed where every component imports it:", ""]
            lines += [f"- {item}" for item in needed] + [""]
        return "\n".join(lines)
