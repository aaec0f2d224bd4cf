"""LoRA adapter registry of a simulated engine (I/O-free apart from the path check).

Schema rules (the schema's api.md, "LoRA lifecycle"): ``lora_id`` > 0, non-empty name, absolute
``source_path`` (a directory the engine can see); the same (id, name, path) twice is
idempotent (``already_loaded``); any other overlap of id, name or path is
``ALREADY_EXISTS``; unknown → ``NOT_FOUND``; LoRA disabled → ``FAILED_PRECONDITION``.
Beyond ``max_loras`` resident adapters → ``RESOURCE_EXHAUSTED``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from sidecar.openengine import pb


class LoraError(Exception):
    """A LoRA call refused with gRPC status ``status`` (a status name)."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Adapter:
    lora_id: int
    name: str
    path: str

    def to_pb(self) -> pb.LoraAdapter:
        return pb.LoraAdapter(lora_id=self.lora_id, lora_name=self.name, source_path=self.path)


class LoraRegistry:
    """The resident adapters, in load order."""

    def __init__(
        self,
        *,
        enabled: bool,
        max_loras: int,
        check_path: bool = True,
        lenient: bool = False,
        idempotent: bool = True,
    ) -> None:
        self.enabled = enabled
        self.max_loras = max_loras
        self.check_path = check_path
        self.lenient = lenient  # fault lora-lenient: no argument checks
        self.idempotent = idempotent  # fault lora-not-idempotent: False
        self._by_name: dict[str, Adapter] = {}

    def _require_enabled(self) -> None:
        if not self.enabled:
            raise LoraError("FAILED_PRECONDITION", "LoRA is disabled on this engine")

    def get(self, name: str) -> Adapter | None:
        return self._by_name.get(name)

    def adapters(self) -> list[Adapter]:
        return list(self._by_name.values())

    def load(self, adapter: pb.LoraAdapter | None) -> tuple[Adapter, bool]:
        """Load (or confirm) an adapter; returns (adapter, already_loaded)."""
        self._require_enabled()
        if adapter is None:
            raise LoraError("INVALID_ARGUMENT", "adapter is required")
        path = adapter.source_path
        if not self.lenient:
            if adapter.lora_id <= 0:
                raise LoraError("INVALID_ARGUMENT", f"lora_id must be positive, got {adapter.lora_id}")
            if not adapter.lora_name:
                raise LoraError("INVALID_ARGUMENT", "lora_name must be non-empty")
            if not path or not os.path.isabs(path):
                raise LoraError("INVALID_ARGUMENT", f"source_path must be an absolute path, got {path!r}")
        new = Adapter(adapter.lora_id, adapter.lora_name, path)
        same = self._by_name.get(new.name)
        if same == new and self.idempotent:
            return same, True
        for old in self._by_name.values():
            if old.name == new.name or old.lora_id == new.lora_id or old.path == new.path:
                raise LoraError(
                    "ALREADY_EXISTS",
                    f"adapter (id={new.lora_id}, name={new.name!r}, path={new.path!r}) conflicts with "
                    f"loaded (id={old.lora_id}, name={old.name!r}, path={old.path!r})",
                )
        if self.check_path and not os.path.isdir(path):
            raise LoraError("NOT_FOUND", f"source_path {path!r} is not a directory visible to the engine")
        if len(self._by_name) >= self.max_loras:
            raise LoraError("RESOURCE_EXHAUSTED", f"{self.max_loras} adapters already resident (max_loras)")
        self._by_name[new.name] = new
        return new, False

    def unload(self, name: str) -> Adapter:
        self._require_enabled()
        if not name:
            raise LoraError("INVALID_ARGUMENT", "lora_name must be non-empty")
        adapter = self._by_name.pop(name, None)
        if adapter is None:
            raise LoraError("NOT_FOUND", f"no adapter named {name!r} is loaded")
        return adapter
