"""What overlapping bucket communication with backward would expose on a given link.

A model, not a measurement: one link serves one collective at a time; bucket i can start
when its gradients are final (its measured launch time, relative to the start of
the backward) and when bucket i-1 is done; a ring all-reduce of n bytes over world size w
moves ``2 (w - 1) / w * n`` bytes per rank, plus a fixed latency per collective. The exposed
communication is what remains after the backward's compute ends. The alternative, one
all-reduce of the whole buffer after backward, exposes all of its time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class OverlapEstimate:
    bucketed_exposed_ms: float
    one_shot_exposed_ms: float


def allreduce_ms(num_bytes: float, world_size: int, bandwidth_gbs: float, latency_us: float) -> float:
    """Ring all-reduce time of `num_bytes` per rank on a link of `bandwidth_gbs` GB/s."""
    moved = 2 * (world_size - 1) / world_size * num_bytes
    return latency_us * 1e-3 + moved / (bandwidth_gbs * 1e9) * 1e3


def exposed_communication(
    launch_ms: Sequence[float],
    bucket_bytes: Sequence[int],
    backward_ms: float,
    world_size: int,
    bandwidth_gbs: float,
    latency_us: float = 20.0,
) -> OverlapEstimate:
    """Exposed communication (ms after the backward's compute ends) of the bucketed engine
    and of one all-reduce after backward, for buckets ready at `launch_ms`."""
    if len(launch_ms) != len(bucket_bytes):
        raise ValueError(
            "launch_ms and bucket_bytes must have equal lengths, "
            f"got {len(launch_ms)} and {len(bucket_bytes)}"
        )
    done = 0.0
    for ready, size in zip(launch_ms, bucket_bytes):
        done = max(done, ready) + allreduce_ms(size, world_size, bandwidth_gbs, latency_us)
    one_shot = allreduce_ms(sum(bucket_bytes), world_size, bandwidth_gbs, latency_us)
    return OverlapEstimate(max(0.0, done - backward_ms), one_shot)
