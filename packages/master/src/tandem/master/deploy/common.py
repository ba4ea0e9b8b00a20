"""What both renderers need: the run config as a component reads it, and the ports it binds.

A renderer writes the resolved config (like `tandem up`), with the Curve secret keys replaced by
`${env:...}` references, so nothing it writes holds a secret: the secret reaches the process
through its environment (a Kubernetes Secret, or a file the Slurm script reads).
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

from tandem.common.config import RunConfig
from tandem.common.errors import ConfigError

CURVE_SECRET_ENV = {"server_secret": "TANDEM_CURVE_SERVER_SECRET",
                    "client_secret": "TANDEM_CURVE_CLIENT_SECRET"}
TORCHRUN_PORT = 29500
RENDEZVOUS_PORT = 29400


def tcp_port(address: str, key: str) -> int:
    """The port of a `tcp://host:port` address; a one-line error naming `key` otherwise."""
    parts = urlsplit(address)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or port is None or port == 0:
        raise ConfigError([f"{key}: {address!r} must be tcp://HOST:PORT with a fixed port to "
                           "run across machines"])
    return port


def component_config(config: RunConfig, *, run_dir: str, hosts: dict[str, str]) -> dict[str, Any]:
    """The config every component of a multi-host run reads: clients' addresses point at
    `hosts` (master, buffer, reward, trainer), secrets are env references."""
    data = config.model_dump(mode="json")
    data["run_dir"] = run_dir
    ports = server_ports(config)
    data["master"]["address"] = f"tcp://{hosts['master']}:{ports['master']}"
    data["master"]["publish_address"] = f"tcp://{hosts['master']}:{ports['master-pub']}"
    data["buffer"]["address"] = f"tcp://{hosts['buffer']}:{ports['buffer']}"
    data["reward"]["address"] = f"tcp://{hosts['reward']}:{ports['reward']}"
    weights = data["weights"]
    weights["rendezvous_host"] = hosts["trainer"]
    weights["rendezvous_port"] = ports["rendezvous"]
    weights["fetch_address"] = f"tcp://{hosts['trainer']}:{ports['fetch']}"
    curve = data["transport"].get("curve")
    if curve:
        for key, env in CURVE_SECRET_ENV.items():
            curve[key] = "${env:" + env + "}"
    return data


def server_ports(config: RunConfig) -> dict[str, int]:
    """Every port a component of this run binds, read from the config's addresses."""
    ports = {"master": tcp_port(config.master.address, "master.address"),
             "master-pub": tcp_port(config.master.publish_address, "master.publish_address"),
             "buffer": tcp_port(config.buffer.address, "buffer.address"),
             "reward": tcp_port(config.reward.address, "reward.address"),
             "rendezvous": config.weights.rendezvous_port or RENDEZVOUS_PORT,
             "fetch": (tcp_port(config.weights.fetch_address, "weights.fetch_address")
                       if config.weights.transport == "fetch" else 5580)}
    return ports


def bind_overrides(config: RunConfig, role: str) -> list[str]:
    """`--set` overrides that make a server bind every interface of its own host."""
    ports = server_ports(config)
    if role == "master":
        return [f"master.address=tcp://0.0.0.0:{ports['master']}",
                f"master.publish_address=tcp://0.0.0.0:{ports['master-pub']}"]
    if role == "buffer":
        return [f"buffer.address=tcp://0.0.0.0:{ports['buffer']}"]
    if role == "reward":
        return [f"reward.address=tcp://0.0.0.0:{ports['reward']}"]
    if role == "trainer" and config.weights.transport == "fetch":
        return [f"weights.fetch_address=tcp://0.0.0.0:{ports['fetch']}"]
    return []


def reward_service(config: RunConfig) -> bool:
    """A reward service process runs when `up.reward_service` (default: `reward.service`) says."""
    wanted = config.up.reward_service
    return wanted if wanted is not None else config.reward.service


def dns_name(name: str, what: str = "name") -> str:
    """`name` as a DNS-1035 label (lowercase letters, digits, '-'; a letter first; <= 40 chars
    so suffixes such as '-trainer-hosts' still fit in 63)."""
    label = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    if label and not label[0].isalpha():
        label = "t-" + label
    if not label or len(label) > 40:
        raise ConfigError([f"{what}: {name!r} cannot name Kubernetes objects (need 1-40 "
                           "letters, digits or '-'); set it or pass --name"])
    return label
