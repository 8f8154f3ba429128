"""One process of the two-process loopback test (tests/sharding/test_multihost.py).

    python -m tests.support.multihost_worker PORT PROCESS_ID OUT_DIR

Joins a 2-process job on 127.0.0.1:PORT with 4 fake CPU devices per process,
builds a data=1,tensor=4,expert=2 mesh over all 8 devices (tensor-parallel
attention inside each process, expert all-to-all across the two), and
  1. runs tiny-moe's prefill and decode steps: process 0 writes the logits;
  2. serves a greedy completion of tiny-llama through the engine in lockstep:
     process 0 runs the engine loop, process 1 follows; process 0 writes the ids.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"


def main(port: int, pid: int, out_dir: str) -> None:
    import jax
    import numpy as np
    from flax import nnx

    from sharding.multihost import Lockstep, ProcessConfig, initialize

    initialize(ProcessConfig(f"127.0.0.1:{port}", 2, pid), timeout_s=60)
    jax.config.update("jax_default_matmul_precision", "highest")
    assert jax.device_count() == 8 and jax.local_device_count() == 4

    from model.config import ModelConfig
    from model.factory import build_model
    from serving.config.engine_config import EngineConfig
    from serving.engine.engine import Engine
    from serving.loading.model_registry import known_models
    from sharding.mesh import MeshConfig, build_mesh
    from tests.support.sharded_forward import run_steps

    mesh = build_mesh(MeshConfig(1, 4, 2))
    cfg = ModelConfig.from_dict(known_models()["tiny-moe"]["config"])
    logits = run_steps(build_model(cfg, rngs=nnx.Rngs(0)), mesh, rows=2)
    if pid == 0:
        np.save(os.path.join(out_dir, "logits.npy"), logits)

    cfg = ModelConfig.from_dict(known_models()["tiny-llama"]["config"])
    engine = Engine(build_model(cfg, rngs=nnx.Rngs(0)),
                    EngineConfig(max_slots=2, num_pages=32, max_model_len=128, prefill_chunk=16,
                                 min_decode_batch=1), mesh=mesh, lockstep=Lockstep())
    if pid == 0:
        from serving.runtime.engine_loop import EngineLoop
        from tests.support.engine_helpers import generate, request

        loop = EngineLoop(engine)
        loop.start(warmup=False)
        try:
            ids = generate(loop, [request(list(range(5, 25)), max_tokens=8, ignore_eos=True)])[0]
        finally:
            loop.stop()
            engine.lockstep.stop()
        with open(os.path.join(out_dir, "ids.json"), "w") as f:
            json.dump(ids, f)
    else:
        steps = engine.lockstep.follow(engine.run_published)
        print(f"process 1 followed {steps} steps", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
