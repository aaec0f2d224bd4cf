"""Bounds on what the bridge takes from the engine (docs/SECURITY.md "KV bridge"): the engine
is trusted for the content of its KV events, not for their sizes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class IngestLimits:
    """CLI: ``--kv-max-batch-bytes``, ``--kv-engine-replay-max-batches``,
    ``--kv-engine-replay-max-bytes``, ``--kv-engine-replay-deadline``."""

    max_batch_bytes: int = 4 * 1024 * 1024
    """Largest engine batch: a ZMQ payload frame (libzmq ``MAXMSGSIZE``: a larger message
    disconnects the engine's socket, which reconnects; the batch is lost and resynced) or a
    ``SubscribeKvEvents`` message (checked from its length prefix, before it is read: the batch
    is skipped and resynced). 4 MiB: ~8 times a step storing a 128k-token prompt at once;
    betterproto2 needs 4-6 s of CPU for it (in a worker thread), 16 MiB took 16-25 s and
    still stalled relayed tokens by 0.5 s (docs/SECURITY.md "KV bridge")."""
    replay_max_batches: int = 100_000
    """Batches one engine replay may bring; past it the replay is abandoned (history lost)."""
    replay_max_bytes: int = 256 * 1024 * 1024
    """Payload bytes one engine replay may bring; past it the replay is abandoned."""
    replay_deadline: float = 60.0
    """Seconds one engine replay may take in all (each message must also come within the
    bridge's replay timeout); past it the replay is abandoned."""

    def problems(self) -> list[str]:
        """What is wrong with these values (empty: usable)."""
        out = []
        if self.max_batch_bytes < 1024:
            out.append("--kv-max-batch-bytes must be at least 1024")
        if self.replay_max_batches < 1:
            out.append("--kv-engine-replay-max-batches must be at least 1")
        if self.replay_max_bytes < 1024:
            out.append("--kv-engine-replay-max-bytes must be at least 1024")
        if not self.replay_deadline > 0:
            out.append("--kv-engine-replay-deadline must be positive")
        return out
