"""`draftwire serve --ray`: join or start Ray, launch the replicas, serve the front until a signal."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from cluster.config import PoolConfig
from cluster.front import Front
from cluster.pool import Pool
from draftwire import ports
from verifier_service.grpc_kit import StopSignal, run_until_signal

ray_log = logging.getLogger("cluster.ray")


@dataclass(frozen=True)
class RayConfig:
    # host:port of a running cluster's GCS, "auto" for the one `ray start` left on this machine, or
    # "local" to start a private one for this process (no dashboard; Ray's logs under /tmp/ray).
    address: str = "local"


def run(config: PoolConfig, ray_config: RayConfig) -> None:
    """Blocks until SIGINT or SIGTERM; then stops the front and kills the replicas.

    Raises ConnectionError when no Ray cluster answers at the address, and what a replica's start
    raises (a bad model directory, say).
    """
    import ray

    # A busy port is refused before Ray starts (the front checks again when it binds).
    ports.check_free(config.front.host, config.front.port)
    if config.front.metrics_port:
        ports.check_free(config.front.metrics_host or "0.0.0.0", config.front.metrics_port)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # Replica output stays in Ray's log files (`ray logs`, the dashboard), not on this process's stdout.
    extra = {}
    if ray_config.address == "local":
        extra = {"include_dashboard": False}
        _loopback_only()
    _ray_errors_to_log()
    ray.init(address=ray_config.address, log_to_driver=False, **extra)
    try:
        run_until_signal(lambda stop: _serve(config, stop))
    finally:
        ray.shutdown()


def _ray_errors_to_log() -> None:
    """Ray's driver prints every error its cluster publishes (a replica's death, `actor is restarting`)
    to stdout as coloured `(raylet)` lines of many lines each, whatever log_to_driver says. The pool
    says what it does about them in one line each (`replica ... process died`, `... serving at`): Ray's
    own go to the `cluster.ray` log at DEBUG. Ray's listener looks its printer up at each message."""
    import ray._private.worker as ray_worker

    def to_log(data: dict, ignore_prefix: bool = False) -> None:
        for line in data.get("lines", ()):
            ray_log.debug("%s", line)

    ray_worker.print_to_stdstream = to_log


def _loopback_only() -> None:
    """A private cluster (address "local") on loopback alone, as `serve` without Ray binds: its node
    address is 127.0.0.1, which Ray's own ports (GCS, raylet, workers, agents) and the replicas (their
    ServerConfig host "" binds the node's) bind. Ray on Linux replaces a loopback node address with the
    machine's reachable one unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER is off: off in the environment its
    processes inherit, and in this driver, which read it when it imported ray. A cluster joined by
    address keeps the node address `ray start` gave it (--node-ip-address), so that nodes reach each
    other."""
    import ray._private.ray_constants as ray_constants

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


async def _serve(config: PoolConfig, stop: StopSignal) -> None:
    pool = Pool(config)
    front = Front(pool, config.front)
    try:
        # The front listens before the replicas serve (health NOT_SERVING meanwhile): an edge resuming
        # against a restarted `serve --ray` waits for a replica (up to open_timeout_s) instead of being
        # refused while the target loads.
        port = await front.start()
        await pool.start()
        target_id = next(iter(pool.info.values())).target_id
        print(f"draftwire: serving {target_id} on {config.front.host}:{port}", flush=True)
        if front.metrics_port is not None:
            front_metrics = f"http://{config.front.metrics_host}:{front.metrics_port}/metrics"
            print(f"draftwire: metrics on {front_metrics}", flush=True)
        await stop.wait()
    finally:
        await front.stop(grace=2.0)
        await pool.close()
