"""An embedded Ray listens on loopback only.

A Ray node binds each of its servers (the GCS, the raylet's node and object managers, every
worker's gRPC server, the dashboard and runtime-env agents, the metrics exporters, the autoscaler
monitor) to the node's IP, the gRPC ones to all interfaces, unless that IP is loopback: then every
one binds 127.0.0.1 (measured on Ray 2.60, kept true by tests/core/compute/test_ray_loopback.py). Without
this, a `prx-corpus build` on a shared host offered its GCS and raylet (which run any task they are
sent, behind nothing but Ray's token) to the whole network.

`ray.init` turns a loopback node IP (given or detected) into the host's routable address
(`services.resolve_ip_for_localhost`, `get_node_ip_address`) except in Ray's single-machine mode,
`ray_constants.ENABLE_RAY_CLUSTER` false: the macOS and Windows default, set on Linux by
`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, which Ray reads once, when it is imported. So an embedded
start switches that mode on around its own `ray.init`, and so does a driver joining such a Ray by
its loopback address. Connections to a cluster, and starts whose options name a routable
`_node_ip_address` (an operator's explicit choice), are left alone.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

LOOPBACK = "127.0.0.1"
NODE_IP_OPTION = "_node_ip_address"  # ray.init's keyword for the node's IP
# vLLM compares its own idea of this host's IP with Ray's node IPs (placement groups pinned to
# `node:<ip>`, one IP per node): on a loopback node both must say 127.0.0.1.
VLLM_HOST_IP = "VLLM_HOST_IP"


def is_loopback(host: str) -> bool:
    """True for `localhost` and any loopback address (127.0.0.0/8, ::1, ::ffff:127.x)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip().strip("[]"))
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return bool(address.is_loopback or (mapped is not None and mapped.is_loopback))


def wants_loopback(options: Mapping[str, Any]) -> bool:
    """An embedded start stays on loopback unless its options name a routable node IP."""
    node_ip = options.get(NODE_IP_OPTION)
    return node_ip is None or is_loopback(str(node_ip))


def joins_loopback(address: str) -> bool:
    """A driver joining a Ray by a loopback GCS address (`127.0.0.1:6379`, what an embedded Ray
    reports) must connect in the same mode: `ray.init` would rewrite that host to the routable
    address, where the embedded GCS does not listen. Ray Client (`ray://`) addresses are not rewritten."""
    if "://" in address:
        return False
    host = address.rsplit(":", 1)[0] if address.count(":") == 1 or address.startswith("[") else address
    return is_loopback(host)


@contextmanager
def loopback_node(enabled: bool = True) -> Iterator[None]:
    """Around the `ray.init` that starts an embedded Ray: its node IP is 127.0.0.1, so every Ray
    server binds loopback. The processes Ray starts inside inherit `VLLM_HOST_IP=127.0.0.1` (unless
    set); this process gets its own settings back afterwards."""
    if not enabled:
        yield
        return
    from ray._private import ray_constants

    mode = ray_constants.ENABLE_RAY_CLUSTER
    vllm_host = os.environ.get(VLLM_HOST_IP)
    ray_constants.ENABLE_RAY_CLUSTER = False
    if vllm_host is None:
        os.environ[VLLM_HOST_IP] = LOOPBACK
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = mode
        if vllm_host is None:
            os.environ.pop(VLLM_HOST_IP, None)
