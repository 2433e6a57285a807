"""Cluster configuration: addresses, ports, TF_CONFIG and each worker's environment.

Pure functions over the standard library only, shared by the launcher and by
`keras_comm.topology` (which validates TF_CONFIG with `validate_tf_config`).

Ports. On one node the ports are chosen below the kernel's ephemeral range
(`/proc/sys/net/ipv4/ip_local_port_range`), so neither a `bind(port=0)` nor
an outgoing connection (the workers' own gRPC clients among them) can be
handed a port between the moment the launcher checks it and the moment
TensorFlow binds it; a clash with another program that binds a fixed port in
that window is still possible and is retried by the supervisor. With several
nodes, or with `base_port`, the ports are fixed: the worker of global rank
`g` listens on `base + g`, where base is `master_port + 1` for several nodes.
"""

import ipaddress
import json
import os
import random
import socket

# TensorFlow's gRPC server listens on every interface whatever TF_CONFIG says,
# so ports are probed on the wildcard address of the host's family.
_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_DEFAULT_EPHEMERAL_LOW = 32768
_LOWEST_PICKED_PORT = 10000

# Variables that list the GPUs a process may use (a test supplies its own).
VISIBLE_DEVICES_VAR = "CUDA_VISIBLE_DEVICES"

# TensorFlow's intra-op thread count: by default one thread per core in every
# process, so N workers on one node run N threads per core, and an op split
# over threads waits for whichever thread the kernel left without a core.
INTRAOP_THREADS_VAR = "TF_NUM_INTRAOP_THREADS"


def available_cpus():
    """The CPUs this process may run on (its affinity mask, where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def intraop_threads(cpus, local_world_size):
    """Each worker's share of this node's CPUs: `cpus // local_world_size`, at least 1."""
    return max(1, cpus // max(1, local_world_size))


class LaunchError(ValueError):
    """Launcher input that cannot be run (bad host, busy port, ...)."""


class UnresolvedHost(LaunchError):
    """A host name that does not resolve (yet)."""


# ---------------------------------------------------------------------------
# Addresses.
# ---------------------------------------------------------------------------


def resolve_host(host, name="host"):
    """Returns the IP addresses `host` resolves to, or raises LaunchError."""
    if not isinstance(host, str) or not host or host != host.strip():
        raise LaunchError(
            f"`{name}` must be a non-empty IP address or host name. Received: {name}={host!r}"
        )
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise UnresolvedHost(
            f"`{name}` must be an IP address or a resolvable host name "
            f"({e}). Received: {name}={host!r}"
        ) from None
    return sorted({info[4][0] for info in infos})


def is_loopback(addresses):
    return all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def check_host(host, allow_non_loopback, name="host"):
    """Resolves `host`; refuses a non-loopback one unless allowed."""
    addresses = resolve_host(host, name)
    if not allow_non_loopback and not is_loopback(addresses):
        raise LaunchError(
            f"refusing to run the TensorFlow cluster on the non-loopback "
            f"address {host!r} ({', '.join(addresses)}): its gRPC server is "
            f"unauthenticated and runs any graph it is sent, so anyone who can "
            f"reach the port can run code as you. Use --allow-non-loopback "
            f"(allow_non_loopback=True) only on an isolated network. "
            f"Received: {name}={host!r}"
        )
    return addresses


def address(host, port):
    """`host:port`, with IPv6 literals bracketed as gRPC expects."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def socket_family(host):
    """AF_INET6 for an IPv6 literal or a name resolving only to IPv6."""
    try:
        families = {info[0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except (socket.gaierror, UnicodeError):
        families = set()
    if ":" in host or families == {socket.AF_INET6}:
        return socket.AF_INET6
    return socket.AF_INET


# ---------------------------------------------------------------------------
# Ports.
# ---------------------------------------------------------------------------


def _ephemeral_low():
    try:
        with open(_EPHEMERAL_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_LOW


def _bindable(family, port):
    """None if TensorFlow could listen on `port`, else the OSError of the bind."""
    wildcard = "::" if family == socket.AF_INET6 else "0.0.0.0"
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # gRPC binds with SO_REUSEADDR: a port whose last connections wait in
        # TIME_WAIT (a job just stopped) is usable, one with a live socket not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((wildcard, port))
        except OSError as e:
            return e
    return None


def check_ports(ports, host="127.0.0.1", received=None):
    """Raises LaunchError naming the first of `ports` that cannot be bound.

    `received` ends the message (default `base_port=<first port>`).
    """
    family = socket_family(host)
    wildcard = "::" if family == socket.AF_INET6 else "0.0.0.0"
    for port in ports:
        error = _bindable(family, port)
        if error is not None:
            raise LaunchError(
                f"cannot use port {port} ({error.strerror or error}); TensorFlow "
                f"listens on {address(wildcard, port)}. "
                f"Received: {received or f'base_port={ports[0]}'}"
            )


def pick_ports(num_workers, host="127.0.0.1", base_port=0):
    """Returns `num_workers` distinct TCP ports that TensorFlow can listen on.

    With `base_port=0`, free ports are drawn at random below the kernel's
    ephemeral range (see the module docstring); with a `base_port`, the
    ports are `base_port .. base_port + num_workers - 1`, each checked free.

    Raises:
        LaunchError: if a requested port is in use or cannot be bound.
    """
    if base_port:
        ports = list(range(base_port, base_port + num_workers))
        check_ports(ports, host)
        return ports
    family = socket_family(host)
    high = max(_ephemeral_low() - 1, _LOWEST_PICKED_PORT + 4 * num_workers)
    rng = random.SystemRandom()
    ports = []
    tries = 0
    while len(ports) < num_workers:
        tries += 1
        if tries > 200 * num_workers:
            raise LaunchError(
                f"found no {num_workers} free ports in {_LOWEST_PICKED_PORT}..{high}; "
                f"give --base-port. Received: num_workers={num_workers}"
            )
        port = rng.randint(_LOWEST_PICKED_PORT, high)
        if port not in ports and _bindable(family, port) is None:
            ports.append(port)
    return ports


def node_ports(master_port, first_rank, num_workers):
    """Fixed ports of a node's workers: global rank g listens on master_port + 1 + g."""
    return [master_port + 1 + first_rank + i for i in range(num_workers)]


# ---------------------------------------------------------------------------
# TF_CONFIG.
# ---------------------------------------------------------------------------


def tf_config(addresses, rank):
    """The TF_CONFIG dict for worker `rank` of the cluster `addresses`."""
    return {
        "cluster": {"worker": list(addresses)},
        "task": {"type": "worker", "index": rank},
    }


def validate_tf_config(text):
    """Parses a TF_CONFIG string and checks it; returns the dict.

    Checks what tf.distribute otherwise reports late or obscurely: valid
    JSON, a "cluster" mapping job names to non-empty lists of "host:port"
    strings, and a "task" whose "type" is one of those jobs and whose int
    "index" is inside that job's list.

    Raises:
        ValueError: naming the problem and ending with the received value.
    """
    shown = text if len(str(text)) <= 200 else str(text)[:200] + "..."
    received = f"Received: TF_CONFIG={shown!r}"
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"TF_CONFIG must be a non-empty JSON string. {received}")
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"TF_CONFIG is not valid JSON ({e}). {received}") from None
    if not isinstance(config, dict):
        raise ValueError(f"TF_CONFIG must be a JSON object. {received}")
    cluster = config.get("cluster")
    if not isinstance(cluster, dict) or not cluster:
        raise ValueError(
            'TF_CONFIG needs "cluster": {"worker": ["host:port", ...]}. ' + received
        )
    for job, addresses in cluster.items():
        if (
            not isinstance(addresses, list)
            or not addresses
            or not all(isinstance(a, str) and a.rpartition(":")[2].isdigit() for a in addresses)
        ):
            raise ValueError(
                f'TF_CONFIG "cluster"["{job}"] must be a non-empty list of '
                f'"host:port" strings. {received}'
            )
    task = config.get("task")
    if not isinstance(task, dict):
        raise ValueError(
            'TF_CONFIG needs "task": {"type": "worker", "index": i}. ' + received
        )
    job, index = task.get("type"), task.get("index")
    if job not in cluster:
        raise ValueError(
            f'TF_CONFIG "task"["type"] must be one of {sorted(cluster)}. {received}'
        )
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(cluster[job]):
        raise ValueError(
            f'TF_CONFIG "task"["index"] must be an int in 0..{len(cluster[job]) - 1} '
            f'(the "{job}" list has {len(cluster[job])} entries). {received}'
        )
    return config


# ---------------------------------------------------------------------------
# GPUs.
# ---------------------------------------------------------------------------


def visible_gpus(env):
    """The GPU ids this machine offers its workers, from `env`.

    `CUDA_VISIBLE_DEVICES` if set (an empty value means none); otherwise the
    NVIDIA device files `/dev/nvidia<k>`. Returns a list of id strings.
    """
    if VISIBLE_DEVICES_VAR in env:
        return [d.strip() for d in env[VISIBLE_DEVICES_VAR].split(",") if d.strip()]
    try:
        names = os.listdir("/dev")
    except OSError:
        return []
    ids = sorted(int(n[len("nvidia"):]) for n in names if n.startswith("nvidia") and n[6:].isdigit())
    return [str(i) for i in ids]


def assign_gpus(gpus, num_workers, gpus_per_worker):
    """Splits `gpus` into `num_workers` consecutive slices of `gpus_per_worker`.

    Returns a list with one comma-joined id string per local worker, or None
    when no pinning applies (`gpus_per_worker == 0`, or no GPUs with the
    default `gpus_per_worker=None`).

    Raises:
        LaunchError: if the workers need more GPUs than there are.
    """
    if gpus_per_worker is None:
        if not gpus:
            return None
        gpus_per_worker = 1
    if gpus_per_worker == 0:
        return None
    needed = num_workers * gpus_per_worker
    if needed > len(gpus):
        raise LaunchError(
            f"{num_workers} worker(s) x {gpus_per_worker} GPU(s) need {needed} GPUs but "
            f"{len(gpus)} are visible ({','.join(gpus) or 'none'}); lower -n or "
            f"--gpus-per-worker (0 disables pinning). Received: gpus_per_worker={gpus_per_worker}"
        )
    return [
        ",".join(gpus[i * gpus_per_worker : (i + 1) * gpus_per_worker]) for i in range(num_workers)
    ]


# ---------------------------------------------------------------------------
# Each worker's environment.
# ---------------------------------------------------------------------------


def worker_env(
    base_env,
    addresses,
    rank,
    *,
    local_rank=None,
    local_world_size=None,
    node_rank=0,
    attempt=0,
    gpus=None,
    cpus=None,
):
    """A copy of `base_env` with the variables worker `rank` needs.

    Args:
        base_env: the environment to extend (not modified).
        addresses: every worker's "host:port", indexed by global rank.
        rank: this worker's global rank (TF_CONFIG's task index).
        local_rank: its index among this node's workers (default `rank`).
        local_world_size: this node's worker count (default: all of them).
        node_rank: this node's index.
        attempt: the restart attempt, 0 for the first run.
        gpus: comma-joined GPU ids for CUDA_VISIBLE_DEVICES, or None to
            leave it as inherited.
        cpus: this node's CPU count (default: `available_cpus()`); unless
            `base_env` sets TF_NUM_INTRAOP_THREADS, each worker gets
            `intraop_threads(cpus, local_world_size)` (torchrun's
            OMP_NUM_THREADS=1, by share).
    """
    env = dict(base_env)
    world = len(addresses)
    local_rank = rank if local_rank is None else local_rank
    local_world_size = world if local_world_size is None else local_world_size
    env["TF_CONFIG"] = json.dumps(tf_config(addresses, rank))
    names = {
        "RANK": rank,
        "WORLD_SIZE": world,
        "LOCAL_RANK": local_rank,
        "LOCAL_WORLD_SIZE": local_world_size,
    }
    for name, value in names.items():
        env[name] = str(value)
        env[f"KERAS_COMM_{name}"] = str(value)
    env["KERAS_COMM_NODE_RANK"] = str(node_rank)
    env["KERAS_COMM_RESTART_ATTEMPT"] = str(attempt)
    if gpus is not None:
        env[VISIBLE_DEVICES_VAR] = gpus
    if INTRAOP_THREADS_VAR not in env:
        cpus = available_cpus() if cpus is None else cpus
        env[INTRAOP_THREADS_VAR] = str(intraop_threads(cpus, local_world_size))
    env["PYTHONUNBUFFERED"] = "1"
    return env
