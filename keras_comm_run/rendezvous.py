"""Several nodes: agree on one cluster through node 0's launcher.

Node 0's launcher listens on `master_addr:master_port`. Every other node's
launcher connects (retrying until node 0 is up), sends one JSON line
`{"node_rank": k, "nnodes": N, "num_workers": n}`, and reads one JSON line
back: `{"nodes": [{"host": ..., "num_workers": ...}, ...]}` in node-rank
order, or `{"error": ...}`. A node's host is the address node 0 sees its
connection come from, so nothing needs configuring per node; node 0's is
`master_addr`. From the node list every launcher derives the same cluster:
global ranks are numbered node by node, and the worker of global rank `g`
listens on `master_port + 1 + g` (see `cluster.node_ports`).

The rendezvous port is unauthenticated, like TensorFlow's gRPC port: anyone
who reaches it first can take a node's place. Use an isolated network.
"""

import json
import socket
import time

from keras_comm_run.cluster import LaunchError, socket_family

_POLL_SECONDS = 0.2
_MAX_MESSAGE_BYTES = 1 << 16


def _send(sock, obj):
    sock.sendall(json.dumps(obj).encode() + b"\n")


def _receive(sock, deadline):
    data = b""
    while not data.endswith(b"\n"):
        sock.settimeout(max(0.01, min(_POLL_SECONDS, deadline - time.monotonic())))
        try:
            chunk = sock.recv(4096)
        except socket.timeout:
            if time.monotonic() > deadline:
                raise LaunchError("rendezvous: timed out waiting for a reply") from None
            continue
        if not chunk:
            raise LaunchError("rendezvous: the connection closed before a reply")
        data += chunk
        if len(data) > _MAX_MESSAGE_BYTES:
            raise LaunchError("rendezvous: reply too long")
    try:
        return json.loads(data)
    except json.JSONDecodeError as e:
        raise LaunchError(f"rendezvous: malformed message ({e})") from None


def _serve(master_addr, master_port, nnodes, num_workers, deadline, interrupted):
    """Node 0: collects every node's report and answers with the node list."""
    family = socket_family(master_addr)
    with socket.socket(family, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            server.bind((master_addr, master_port))
        except OSError as e:
            raise LaunchError(
                f"cannot listen for the rendezvous on {master_addr}:{master_port} "
                f"({e.strerror or e}). Received: master_port={master_port}"
            ) from None
        server.listen(nnodes)
        server.settimeout(_POLL_SECONDS)
        nodes = {0: {"host": master_addr, "num_workers": num_workers}}
        peers = []
        try:
            while len(nodes) < nnodes:
                if interrupted():
                    raise LaunchError("rendezvous: interrupted")
                if time.monotonic() > deadline:
                    missing = sorted(set(range(nnodes)) - set(nodes))
                    raise LaunchError(
                        f"rendezvous: timed out waiting for node(s) {missing} on "
                        f"{master_addr}:{master_port}"
                    )
                try:
                    conn, peer = server.accept()
                except socket.timeout:
                    continue
                try:
                    report = _receive(conn, min(deadline, time.monotonic() + 10))
                except LaunchError:
                    conn.close()
                    continue
                problem = _check_report(report, nnodes, nodes)
                if problem:
                    _send(conn, {"error": problem})
                    conn.close()
                    continue
                nodes[report["node_rank"]] = {"host": peer[0], "num_workers": report["num_workers"]}
                peers.append(conn)
            answer = {"nodes": [nodes[k] for k in range(nnodes)]}
            for conn in peers:
                try:
                    _send(conn, answer)
                except OSError:
                    pass
            return answer["nodes"]
        finally:
            for conn in peers:
                conn.close()


def _check_report(report, nnodes, nodes):
    if not isinstance(report, dict):
        return "malformed report"
    k, n, workers = report.get("node_rank"), report.get("nnodes"), report.get("num_workers")
    if n != nnodes:
        return f"--nnodes differs: node 0 has {nnodes}, this node {n}"
    if not isinstance(k, int) or isinstance(k, bool) or not 0 < k < nnodes:
        return f"--node-rank must be in 1..{nnodes - 1} on the other nodes; got {k}"
    if k in nodes:
        return f"two nodes claim --node-rank {k}"
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        return f"-n must be >= 1; got {workers}"
    return None


def _join(master_addr, master_port, nnodes, node_rank, num_workers, deadline, interrupted):
    """Another node: reports to node 0 (retrying until it listens); returns the node list."""
    family = socket_family(master_addr)
    while True:
        if interrupted():
            raise LaunchError("rendezvous: interrupted")
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.settimeout(_POLL_SECONDS * 5)
        try:
            sock.connect((master_addr, master_port))
            break
        except OSError:
            sock.close()
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"rendezvous: node 0 never listened on {master_addr}:{master_port}"
                ) from None
            time.sleep(_POLL_SECONDS)
    with sock:
        _send(sock, {"node_rank": node_rank, "nnodes": nnodes, "num_workers": num_workers})
        answer = _receive(sock, deadline)
    if "error" in answer:
        raise LaunchError(f"rendezvous refused by node 0: {answer['error']}")
    return answer["nodes"]


def rendezvous(master_addr, master_port, nnodes, node_rank, num_workers, timeout, interrupted=None):
    """Returns every node's `{"host", "num_workers"}`, in node-rank order.

    Raises:
        LaunchError: on timeout, a refused report or an unusable port.
    """
    interrupted = interrupted or (lambda: False)
    deadline = time.monotonic() + timeout
    if node_rank == 0:
        return _serve(master_addr, master_port, nnodes, num_workers, deadline, interrupted)
    return _join(master_addr, master_port, nnodes, node_rank, num_workers, deadline, interrupted)
