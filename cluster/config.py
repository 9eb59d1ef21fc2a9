"""Typed configuration of the verifier pool, built once at the entry point and passed down by field."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from verifier_service.grpc_kit import ServerConfig


@dataclass(frozen=True)
class ReplicaConfig:
    target_dir: Path  # transformers model directory each replica loads (a path on every node)
    # The replica's own verifier server. Its port is always 0 (a free one); host "" binds the address
    # Ray reports for the replica's node, which the front can reach from another node.
    server: ServerConfig = ServerConfig(host="", port=0)
    num_cpus: float = 1.0  # Ray resources one replica holds (fractional values pack replicas)
    num_gpus: float | None = None  # None: 1 where the cluster has GPUs, 0 where it has none (placed)
    max_restarts: int = -1  # Ray restarts a dead replica process this often; -1 without end
    dtype: str = "auto"  # the target's dtype (TargetEngine.load)
    invariant: bool = True  # bit-exact kernels (TargetEngine.load)
    kernels: str = "auto"  # their backend: auto, onednn, portable (TargetEngine.load)
    # auto: a GPU where Ray gave the replica one (it sees only its own: CUDA_VISIBLE_DEVICES), else the CPU
    device: str = "auto"


@dataclass(frozen=True)
class ScalingConfig:
    # None: one replica per GPU the cluster has room for (GPUs / num_gpus; 1 without GPUs), up to
    # max_replicas where that is set (placed)
    min_replicas: int | None = 1
    max_replicas: int | None = 1  # equal to min_replicas (None: equal): a fixed pool, no autoscaling
    # Autoscaling aims at this many open sessions (streaming or waiting for a replica) per replica.
    target_sessions_per_replica: float = 8.0
    interval_s: float = 1.0  # how often the autoscaler and the health check look
    # Load must call for fewer replicas this long before one is drained: short dips do not flap.
    downscale_delay_s: float = 30.0
    # A draining replica is killed when its last session ends, or after this long (None: never early).
    drain_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if None in (self.min_replicas, self.max_replicas):
            return  # left to the cluster: `placed` resolves them, and checks the outcome
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"replicas: need 1 <= min <= max, got {self.min_replicas}, {self.max_replicas}")
        if self.target_sessions_per_replica <= 0:
            raise ValueError("target_sessions_per_replica must be positive")


@dataclass(frozen=True)
class PoolConfig:
    replica: ReplicaConfig
    scaling: ScalingConfig = ScalingConfig()
    # The front edges connect to: host, port, message size limit (its limits and batch fields are
    # the replicas' business and unused here).
    front: ServerConfig = field(default_factory=ServerConfig)
    # A new session waits this long for a live replica (all starting or restarting) before UNAVAILABLE.
    open_timeout_s: float = 60.0
    # Every unary call the front relays to a replica (model info, stats) has this deadline; a replica that
    # misses it is suspect, and the call goes to another one.
    call_timeout_s: float = 2.0
    # The front checks each replica's health this often, each check with this as its deadline. A replica
    # that misses a check is suspect: no new session goes there, and opens it has not answered go to
    # another replica; one that answers again is trusted again.
    health_interval_s: float = 1.0
    # A replica that misses this many checks in a row is frozen: its sessions end UNAVAILABLE, and their
    # edges resume elsewhere with their committed tokens (a stall of about this many intervals, not the
    # whole freeze).
    frozen_after_misses: int = 2


def placed(config: PoolConfig, cluster_gpus: float) -> PoolConfig:
    """The config with what it leaves to the cluster resolved, for a cluster with `cluster_gpus` GPUs
    (ray.cluster_resources()): each replica's GPUs (None: 1 where there are GPUs, else 0) and the
    replica counts (min None: one replica per GPU, GPUs / num_gpus of them, 1 without GPUs; max None:
    the min). Ray gives each replica GPUs of its own and shows it only those (CUDA_VISIBLE_DEVICES), so
    a replica of `--device auto` runs on its own GPU."""
    gpus = config.replica.num_gpus
    if gpus is None:
        gpus = 1.0 if cluster_gpus >= 1 else 0.0
    scaling = config.scaling
    room = max(1, int(cluster_gpus // gpus)) if gpus else 1
    low = scaling.min_replicas
    if low is None:
        low = min(room, scaling.max_replicas or room)
    high = scaling.max_replicas if scaling.max_replicas is not None else low
    return replace(
        config,
        replica=replace(config.replica, num_gpus=gpus),
        scaling=replace(scaling, min_replicas=low, max_replicas=high),
    )
