"""A private Ray cluster on this machine for a test: token authentication off (a loopback cluster that
only this process uses; docs/cluster.md), started again once if its raylet misses Ray's 30 s startup
deadline, which a loaded 2-core machine can (a fresh-clone CI run failed so, in ray.init)."""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def local_ray(num_cpus: int, num_gpus: int = 0):
    """`num_gpus`: GPUs the cluster declares whether or not the machine has them (Ray then places
    replicas on them and sets each one's CUDA_VISIBLE_DEVICES; torch on a CPU sees none)."""
    import ray

    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # this process and the cluster it starts
    try:
        for attempt in (1, 2):
            try:
                ray.init(
                    address="local",
                    num_cpus=num_cpus,
                    num_gpus=num_gpus,
                    include_dashboard=False,
                    log_to_driver=False,
                )
                break
            except Exception as e:  # Ray raises a bare Exception for it
                if attempt == 2 or "timed out during startup" not in str(e):
                    raise
                ray.shutdown()
        yield
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved


@contextlib.asynccontextmanager
async def running_pool(config):
    """A verifier pool (cluster.pool.Pool) and its front started from `config` (a PoolConfig) inside a
    running local_ray; yields (pool, the front's address); stops both on the way out."""
    from cluster.front import Front
    from cluster.pool import Pool

    pool = Pool(config)
    await pool.start()
    front = Front(pool, config.front)
    try:
        yield pool, f"127.0.0.1:{await front.start()}"
    finally:
        await front.stop(0)
        await pool.close()
