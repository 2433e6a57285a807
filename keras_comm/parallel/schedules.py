"""Pipeline schedules as data: one instruction list per stage (pure Python).

A schedule says, for each of `p` stages and `m` micro-batches, what the stage
does and in which order. `keras_comm.parallel.Pipeline` has one executor that
runs any such list, so GPipe and 1F1B differ only in the tables built here
(as DeepSpeed's ``TrainSchedule`` and torch.distributed.pipelining's
``ScheduleGPipe`` / ``Schedule1F1B`` are tables over one runner).

Instructions (`Op`), each for one micro-batch:

* ``recv_act``: receive the micro-batch's activation from stage s-1;
* ``forward``: run the stage on it (the last stage also computes the loss
  there when the executor is given one);
* ``send_act``: send the stage's output to stage s+1;
* ``recv_grad``: receive the gradient of that output from stage s+1;
* ``backward``: backpropagate the micro-batch through the stage;
* ``send_grad``: send the gradient of the stage's input to stage s-1.

Transfers are blocking rendezvous (a send completes with its receive), and
every transfer of one device runs in program order, so a table must be
deadlock-free under that rule: `simulate` checks it, and `tests/parallel/test_schedules.py`
runs it for many (p, m).

GPipe: all forwards, then all backwards (in micro-batch order); up to `m`
micro-batches' activations alive on a stage.
1F1B (PipeDream-flush, Megatron's non-interleaved schedule): stage s runs
``min(p - s - 1, m)`` warm-up forwards, then alternates one forward and one
backward, then drains the remaining backwards; at most ``p - s`` micro-batches
are in flight on stage s (``p`` on stage 0), independently of `m`.

This module imports nothing but the standard library.
"""

import collections

RECV_ACT = "recv_act"
FORWARD = "forward"
SEND_ACT = "send_act"
RECV_GRAD = "recv_grad"
BACKWARD = "backward"
SEND_GRAD = "send_grad"

KINDS = (RECV_ACT, FORWARD, SEND_ACT, RECV_GRAD, BACKWARD, SEND_GRAD)
FORWARD_KINDS = (RECV_ACT, FORWARD, SEND_ACT)
BACKWARD_KINDS = (RECV_GRAD, BACKWARD, SEND_GRAD)

SCHEDULES = ("gpipe", "1f1b")

Op = collections.namedtuple("Op", "kind micro_batch")
"""One instruction: `kind` (one of `KINDS`) for micro-batch `micro_batch`."""


def _check(num_stages, num_micro_batches):
    for name, value, low in (("num_stages", num_stages, 1), ("num_micro_batches", num_micro_batches, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"`{name}` must be an int >= {low}. Received: {name}={value!r}")


def check_schedule(schedule):
    """Returns `schedule` lower-cased, or raises ValueError if unknown."""
    if not isinstance(schedule, str) or schedule.lower() not in SCHEDULES:
        raise ValueError(
            f"`schedule` must be one of {list(SCHEDULES)}. Received: schedule={schedule!r}"
        )
    return schedule.lower()


def _forward_ops(stage, num_stages, i):
    ops = []
    if stage > 0:
        ops.append(Op(RECV_ACT, i))
    ops.append(Op(FORWARD, i))
    if stage < num_stages - 1:
        ops.append(Op(SEND_ACT, i))
    return ops


def _backward_ops(stage, num_stages, i):
    ops = []
    if stage < num_stages - 1:
        ops.append(Op(RECV_GRAD, i))
    ops.append(Op(BACKWARD, i))
    if stage > 0:
        ops.append(Op(SEND_GRAD, i))
    return ops


def gpipe(stage, num_stages, num_micro_batches):
    """GPipe's instruction list for `stage`: every forward, then every backward."""
    _check(num_stages, num_micro_batches)
    ops = []
    for i in range(num_micro_batches):
        ops += _forward_ops(stage, num_stages, i)
    for i in range(num_micro_batches):
        ops += _backward_ops(stage, num_stages, i)
    return ops


def one_f_one_b(stage, num_stages, num_micro_batches):
    """1F1B's instruction list for `stage`: warm-up, one-forward-one-backward, drain."""
    _check(num_stages, num_micro_batches)
    m = num_micro_batches
    warmup = min(num_stages - stage - 1, m)
    ops = []
    for i in range(warmup):
        ops += _forward_ops(stage, num_stages, i)
    last = stage == num_stages - 1
    for k in range(m - warmup):
        i = warmup + k
        # Forward i, backward k. Transfers are blocking and in program order:
        # the stage receives gradient k before it sends activation i, and
        # stage s+1 sends gradient k before it receives activation i, so
        # neighbours never both wait in a send (Megatron pairs these as
        # send_forward_recv_backward).
        fwd = _forward_ops(stage, num_stages, i)
        bwd = _backward_ops(stage, num_stages, k)
        if last:
            ops += fwd + bwd
        else:
            ops += [op for op in fwd if op.kind != SEND_ACT]
            ops.append(bwd[0])  # recv_grad k
            ops.append(Op(SEND_ACT, i))
            ops += bwd[1:]
    for k in range(m - warmup, m):
        ops += _backward_ops(stage, num_stages, k)
    return ops


_BUILDERS = {"gpipe": gpipe, "1f1b": one_f_one_b}


def train_schedule(schedule, num_stages, num_micro_batches):
    """Every stage's training instruction list: ``[ops of stage 0, ...]``."""
    build = _BUILDERS[check_schedule(schedule)]
    _check(num_stages, num_micro_batches)
    return [build(s, num_stages, num_micro_batches) for s in range(num_stages)]


def forward_only(ops):
    """The forward instructions of `ops`, in order (inference, and the forward
    half of a schedule run as a layer with a separate backward pass)."""
    return [op for op in ops if op.kind in FORWARD_KINDS]


def backward_only(ops):
    """The backward instructions of `ops`, in order."""
    return [op for op in ops if op.kind in BACKWARD_KINDS]


def max_in_flight(ops):
    """The most micro-batches whose forward ran and backward has not: the
    number of micro-batches' activations a stage keeps alive at once."""
    alive = best = 0
    for op in ops:
        if op.kind == FORWARD:
            alive += 1
            best = max(best, alive)
        elif op.kind == BACKWARD:
            alive -= 1
    return best


_PEER = {SEND_ACT: (1, RECV_ACT), RECV_ACT: (-1, SEND_ACT), SEND_GRAD: (-1, RECV_GRAD), RECV_GRAD: (1, SEND_GRAD)}


def simulate(stage_ops, forward_time=1.0, backward_time=2.0):
    """Runs the per-stage lists under blocking rendezvous transfers.

    Each stage executes its instructions in order. ``forward``/``backward``
    take `forward_time`/`backward_time`; a transfer completes when both its
    send and the matching receive (same micro-batch, the neighbouring stage)
    are at the head of their lists, at the later of the two arrival times,
    and takes no time. Checks the data flow: a forward needs its activation
    received (stage > 0), a backward needs its forward done and its gradient
    received (stage < p - 1), a send needs what it sends computed.

    Args:
        stage_ops: ``[ops of stage 0, ops of stage 1, ...]``.
        forward_time, backward_time: durations of one micro-batch.

    Returns:
        A dict: ``makespan``; ``timeline``, per stage a list of
        ``(start, end, op)`` for its compute instructions; ``busy`` per stage;
        ``bubble`` = 1 - sum(busy) / (p * makespan).

    Raises:
        RuntimeError: on a deadlock (no head can proceed) or an instruction
            whose input is missing.
    """
    p = len(stage_ops)
    queues = [list(ops) for ops in stage_ops]
    clock = [0.0] * p
    have = [set() for _ in range(p)]  # (kind, micro_batch) done per stage
    timeline = [[] for _ in range(p)]

    def need(stage, op, kind):
        if (kind, op.micro_batch) not in have[stage]:
            raise RuntimeError(f"stage {stage}: {op} runs before {kind} {op.micro_batch}")

    while any(queues):
        progressed = False
        for s in range(p):
            while queues[s] and queues[s][0].kind in (FORWARD, BACKWARD):
                op = queues[s].pop(0)
                if op.kind == FORWARD:
                    if s > 0:
                        need(s, op, RECV_ACT)
                    start, clock[s] = clock[s], clock[s] + forward_time
                else:
                    need(s, op, FORWARD)
                    if s < p - 1:
                        need(s, op, RECV_GRAD)
                    start, clock[s] = clock[s], clock[s] + backward_time
                have[s].add((op.kind, op.micro_batch))
                timeline[s].append((start, clock[s], op))
                progressed = True
            if not queues[s]:
                continue
            op = queues[s][0]
            step, partner_kind = _PEER[op.kind]
            t = s + step
            if not 0 <= t < p:
                raise RuntimeError(f"stage {s}: {op} has no neighbouring stage")
            if not queues[t] or queues[t][0] != Op(partner_kind, op.micro_batch):
                continue
            if op.kind == SEND_ACT:
                need(s, op, FORWARD)
            elif op.kind == SEND_GRAD:
                need(s, op, BACKWARD)
            other = queues[t].pop(0)
            queues[s].pop(0)
            clock[s] = clock[t] = max(clock[s], clock[t])
            have[s].add((op.kind, op.micro_batch))
            have[t].add((other.kind, other.micro_batch))
            progressed = True
        if not progressed:
            heads = {s: q[0] for s, q in enumerate(queues) if q}
            raise RuntimeError(f"deadlock: the stages wait at {heads}")
    makespan = max(clock) if clock else 0.0
    busy = [sum(end - start for start, end, _ in tl) for tl in timeline]
    bubble = 1.0 - sum(busy) / (p * makespan) if makespan else 0.0
    return {"makespan": makespan, "timeline": timeline, "busy": busy, "bubble": bubble}


def ideal_bubble(num_stages, num_micro_batches):
    """The textbook bubble fraction ``(p - 1) / (m + p - 1)``."""
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)


def diagram(stage_ops, forward_time=1, backward_time=2):
    """A text chart of the simulated schedule: one row per stage, one column
    per time unit; ``F3`` / ``B3`` mark micro-batch 3's forward / backward
    (a backward is `backward_time` units wide), ``.`` is idle (the bubble).

    Returns:
        The chart as a string (generated from the schedule, for the docs).
    """
    sim = simulate(stage_ops, forward_time, backward_time)
    width = int(round(sim["makespan"]))
    last = max((op.micro_batch for ops in stage_ops for op in ops), default=0)
    cell = len(str(last)) + 1
    rows = []
    for s, tl in enumerate(sim["timeline"]):
        cells = ["." * cell] * width
        for start, end, op in tl:
            label = ("F" if op.kind == FORWARD else "B") + str(op.micro_batch)
            for u in range(int(round(start)), int(round(end))):
                cells[u] = label.ljust(cell)
        rows.append(f"stage {s} | " + " ".join(cells))
    return "\n".join(rows)
