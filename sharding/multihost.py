"""Multi-host start-up and lockstep steps (JAX's multi-controller runtime).

Every process runs the same program over one global mesh (``jax.devices()``
lists all processes' devices after :func:`initialize`). Only process 0 runs
the HTTP gateway, the scheduler and the engine loop; it decides each step.
The other processes run :meth:`Lockstep.follow`: before each step process 0
broadcasts the step's batch as its kind and pytree leaves
(``multihost_utils.broadcast_one_to_all``: a small header with the kind and
each leaf's dtype and shape, then the leaves), and every process dispatches
the same jitted step with the same inputs, so all of them join every
collective in the same order. The step's structure is the engine's business:
this module moves a kind and a list of arrays. The cost is two small broadcasts
per step; a production version would send the scheduler's plan once over
DCN and overlap it with the previous step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Callable, Sequence

import jax
import numpy as np

log = logging.getLogger(__name__)

_HEADER = 2 + 4 * 32  # kind, count, then (dtype, ndim, dim0, dim1) for up to 32 leaves
_KINDS = {"stop": 0, "prefill": 1, "decode": 2}
_DTYPES = [np.dtype(np.int32), np.dtype(np.float32), np.dtype(np.uint32)]


@dataclasses.dataclass(frozen=True)
class ProcessConfig:
    """Where this process sits in a multi-process job.

    Attributes:
      coordinator_address: "host:port" of process 0's coordinator service.
      num_processes: processes in the job.
      process_id: this process, 0..num_processes-1.
    """

    coordinator_address: str
    num_processes: int
    process_id: int

    @classmethod
    def resolve(cls, coordinator_address: str | None = None, num_processes: int | None = None,
                process_id: int | None = None) -> "ProcessConfig | None":
        """From the arguments, else ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``,
        ``JAX_PROCESS_ID``; None when no coordinator is named (a single process).

        Raises:
          ValueError: a coordinator without the process count or index, or an index out of range.
        """
        env = os.environ
        addr = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS")
        if not addr:
            return None
        n = num_processes if num_processes is not None else env.get("JAX_NUM_PROCESSES")
        pid = process_id if process_id is not None else env.get("JAX_PROCESS_ID")
        if n is None or pid is None:
            raise ValueError("multi-host: a coordinator address needs num_processes and process_id "
                             "(or JAX_NUM_PROCESSES and JAX_PROCESS_ID)")
        n, pid = int(n), int(pid)
        if not 0 <= pid < n:
            raise ValueError(f"multi-host: process_id {pid} is not in 0..{n - 1}")
        return cls(addr, n, pid)


def initialize(pc: ProcessConfig | None, timeout_s: int = 120) -> bool:
    """``jax.distributed.initialize`` for ``pc`` (before any other JAX call). Returns
    True for a multi-process job. CPU processes use gloo for cross-process collectives."""
    if pc is None:
        return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(pc.coordinator_address, pc.num_processes, pc.process_id,
                               initialization_timeout=timeout_s)
    log.info("process %d of %d joined %s: %d global devices, %d local", pc.process_id,
             pc.num_processes, pc.coordinator_address, jax.device_count(), jax.local_device_count())
    return True


class Lockstep:
    """Process 0 publishes each engine step's batch; the others run the same step.

    Used by ``serving.engine.engine.Engine`` (``lockstep=``): ``Engine.run`` calls
    :meth:`publish` on process 0; followers call :meth:`follow` with the
    engine's ``run_published``.
    """

    def __init__(self):
        from jax.experimental import multihost_utils

        self._broadcast = multihost_utils.broadcast_one_to_all
        self.is_leader = jax.process_index() == 0

    def publish(self, kind: str, leaves: Sequence[np.ndarray]) -> None:
        """Leader only: sends a step (its kind and its batch's leaves, at most 2-D each,
        int32, float32 or uint32) to the followers.

        Raises:
          ValueError: an unknown kind, too many leaves, or a leaf of another dtype or rank.
        """
        if not self.is_leader:
            return
        leaves = [np.asarray(x) for x in leaves]
        if kind not in _KINDS or 2 + 4 * len(leaves) > _HEADER:
            raise ValueError(f"lockstep: cannot send a {kind!r} step of {len(leaves)} arrays")
        header = np.zeros(_HEADER, np.int32)
        header[0], header[1] = _KINDS[kind], len(leaves)
        for i, x in enumerate(leaves):
            if x.dtype not in _DTYPES or x.ndim > 2:
                raise ValueError(f"lockstep: leaf {i} is {x.dtype} with {x.ndim} dims")
            header[2 + 4 * i: 6 + 4 * i] = [_DTYPES.index(x.dtype), x.ndim, *(list(x.shape) + [0, 0])[:2]]
        self._broadcast(header)
        if leaves:
            self._broadcast(leaves)

    def stop(self) -> None:
        """Leader only: tells the followers to return from :meth:`follow`."""
        self.publish("stop", ())

    def follow(self, run_step: Callable[[str, list[np.ndarray]], None]) -> int:
        """Follower loop: calls ``run_step(kind, leaves)`` for each of the leader's steps
        until :meth:`stop`. Returns the number of steps run."""
        names = {v: k for k, v in _KINDS.items()}
        steps = 0
        while True:
            header = np.asarray(self._broadcast(np.zeros(_HEADER, np.int32)))
            kind = names[int(header[0])]
            if kind == "stop":
                return steps
            zeros = []
            for i in range(int(header[1])):
                code, ndim, d0, d1 = header[2 + 4 * i: 6 + 4 * i]
                zeros.append(np.zeros((int(d0), int(d1))[:int(ndim)], _DTYPES[int(code)]))
            run_step(kind, [np.asarray(x) for x in self._broadcast(zeros)])
            steps += 1


def global_inputs(host, mesh):
    """Host arrays (the same on every process) as replicated global arrays on ``mesh``:
    what a jitted step over a mesh spanning several processes takes."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rep = NamedSharding(mesh, P())
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(rep, np.asarray(x)), host)
