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

A node that cannot start (bad input found before its workers start: a node
rank out of range, too small an allocation) still reports to node 0, with
`"error"` in its line; node 0 then answers every node with that error, so
each launcher of the job stops with the same message within the rendezvous
timeout instead of waiting out the timeout for a node that never comes. A
node 0 that cannot start answers every node with its own error
(`refuse`).

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


def _serve(master_addr, master_port, nnodes, num_workers, deadline, interrupted, timeout):
    """Node 0: collects every node's report and answers with the node list."""
    family = socket_family(master_addr)
    with socket.socket(family, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        _bind(server, master_addr, master_port)
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
                        f"rendezvous: timed out after {timeout:g} s (--rendezvous-timeout) "
                        f"waiting for node(s) {missing} to report to {master_addr}:{master_port}; "
                        f"every node must run with --nnodes {nnodes} and reach --master-addr "
                        f"{master_addr} --master-port {master_port}"
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
                problem, fatal = _check_report(report, nnodes, nodes)
                if fatal:
                    # The job cannot run as configured: stop every node, now.
                    message = f"node {report.get('node_rank')} ({peer[0]}) cannot start: {problem}"
                    told = {report.get("node_rank")}
                    _send_quietly(conn, {"error": message})
                    conn.close()
                    for k, other in peers:
                        _send_quietly(other, {"error": message})
                        told.add(k)
                    _answer_all(server, nnodes, {"error": message}, told, deadline, interrupted)
                    raise LaunchError(message)
                if problem:  # a stray client, or a second node claiming a rank
                    _send_quietly(conn, {"error": problem})
                    conn.close()
                    continue
                nodes[report["node_rank"]] = {"host": peer[0], "num_workers": report["num_workers"]}
                peers.append((report["node_rank"], conn))
            answer = {"nodes": [nodes[k] for k in range(nnodes)]}
            for _, conn in peers:
                try:
                    _send(conn, answer)
                except OSError:
                    pass
            return answer["nodes"]
        finally:
            for _, conn in peers:
                conn.close()


def _bind(server, master_addr, master_port):
    try:
        server.bind((master_addr, master_port))
    except OSError as e:
        raise LaunchError(
            f"cannot listen for the rendezvous on {master_addr}:{master_port} "
            f"({e.strerror or e}): --master-addr must be an address of node 0 and "
            f"--master-port a free port there. "
            f"Received: master_addr={master_addr!r}, master_port={master_port}"
        ) from None


def _send_quietly(conn, obj):
    try:
        _send(conn, obj)
    except OSError:
        pass


def _answer_all(server, nnodes, answer, told, deadline, interrupted):
    """Answers each node that connects with `answer` until nnodes - 1 other
    nodes (by the rank they report, valid or not) have had it, or the deadline."""
    while len(told - {0}) < nnodes - 1 and time.monotonic() < deadline and not interrupted():
        try:
            conn, _ = server.accept()
        except socket.timeout:
            continue
        with conn:
            try:
                report = _receive(conn, min(deadline, time.monotonic() + 10))
            except LaunchError:
                continue
            _send_quietly(conn, answer)
            if isinstance(report, dict):
                told.add(report.get("node_rank"))


def refuse(master_addr, master_port, nnodes, message, timeout, interrupted=None):
    """Node 0 cannot start: tells every other node `message` (at most `timeout` s)."""
    interrupted = interrupted or (lambda: False)
    deadline = time.monotonic() + timeout
    family = socket_family(master_addr)
    with socket.socket(family, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            _bind(server, master_addr, master_port)
        except LaunchError:
            return
        server.listen(nnodes)
        server.settimeout(_POLL_SECONDS)
        _answer_all(server, nnodes, {"error": f"node 0 cannot start: {message}"}, {0},
                    deadline, interrupted)


def report_failure(master_addr, master_port, nnodes, node_rank, message, timeout,
                   interrupted=None):
    """Another node cannot start: tells node 0, which tells every node.

    Best effort, at most `timeout` s: the caller raises its own error anyway.
    """
    interrupted = interrupted or (lambda: False)
    deadline = time.monotonic() + timeout
    try:
        sock = _connect(master_addr, master_port, deadline, interrupted)
    except LaunchError:
        return
    with sock:
        _send_quietly(sock, {"node_rank": node_rank, "nnodes": nnodes, "error": message})
        try:
            _receive(sock, min(deadline, time.monotonic() + 10))
        except LaunchError:
            pass


def _check_report(report, nnodes, nodes):
    """(problem or None, whether it stops the whole job)."""
    if not isinstance(report, dict):
        return "malformed report", False
    if "error" in report:
        return str(report["error"]), True
    k, n, workers = report.get("node_rank"), report.get("nnodes"), report.get("num_workers")
    if n != nnodes:
        return f"--nnodes differs: node 0 has {nnodes}. Received: nnodes={n}", True
    if not isinstance(k, int) or isinstance(k, bool) or not 0 < k < nnodes:
        return (f"--node-rank must be in 1..{nnodes - 1} on the other nodes. "
                f"Received: node_rank={k}"), True
    if k in nodes:
        return f"two nodes claim --node-rank {k}", False
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        return f"-n must be >= 1. Received: num_workers={workers}", True
    return None, False


def _join(master_addr, master_port, nnodes, node_rank, num_workers, deadline, interrupted):
    """Another node: reports to node 0 (retrying until it listens); returns the node list."""
    sock = _connect(master_addr, master_port, deadline, interrupted)
    with sock:
        _send(sock, {"node_rank": node_rank, "nnodes": nnodes, "num_workers": num_workers})
        answer = _receive(sock, deadline)
    if "error" in answer:
        raise LaunchError(f"rendezvous refused by node 0: {answer['error']}")
    return answer["nodes"]


def _connect(master_addr, master_port, deadline, interrupted):
    """A connection to node 0's rendezvous, retried until it listens or the deadline."""
    family = socket_family(master_addr)
    start = time.monotonic()
    while True:
        if interrupted():
            raise LaunchError("rendezvous: interrupted")
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.settimeout(_POLL_SECONDS * 5)
        try:
            sock.connect((master_addr, master_port))
            return sock
        except OSError as e:
            sock.close()
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"rendezvous: cannot reach node 0 at {master_addr}:{master_port} "
                    f"({e.strerror or e}) after {time.monotonic() - start:.0f} s "
                    f"(--rendezvous-timeout): start node 0, or fix --master-addr/--master-port. "
                    f"Received: master_addr={master_addr!r}, master_port={master_port}"
                ) from None
            time.sleep(_POLL_SECONDS)


def rendezvous(master_addr, master_port, nnodes, node_rank, num_workers, timeout, interrupted=None):
    """Returns every node's `{"host", "num_workers"}`, in node-rank order.

    Raises:
        LaunchError: on timeout, a refused report or an unusable port.
    """
    interrupted = interrupted or (lambda: False)
    deadline = time.monotonic() + timeout
    if node_rank == 0:
        return _serve(master_addr, master_port, nnodes, num_workers, deadline, interrupted, timeout)
    return _join(master_addr, master_port, nnodes, node_rank, num_workers, deadline, interrupted)
