"""An engine's settings, worked out in one place: the model's directory, config and tokenizer,
the device and dtype, and the KV page size. `Engine` (the forward passes) and `EngineProcess`
(the kernel's view of them) each hold an `EngineSettings`, and show its fields as their own
through `HasSettings`."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

import torch

from kvfs.pool import PageShape, pages_for_fraction
from symphony.engine.config import ModelConfig
from symphony.engine.errors import ModelError
from symphony.engine.tokenizer import Tokenizer

PAGE_SIZE = 16  # entries of a KV page, when none is given
KV_MEMORY_FRACTION = 0.25  # of free memory the KV pool takes, when no page count is given


def require_cuda() -> None:
    """ModelError, in a line, where this machine has no CUDA (torch's own error was an
    assertion's traceback, or an AttributeError on _cuda_setDevice)."""
    if not torch.cuda.is_available():
        raise ModelError(f"--device cuda: no CUDA on this node (host {socket.gethostname()}): "
                         "use --device cpu, or a node with a GPU")


@dataclass(frozen=True)
class EngineSettings:
    model_dir: Path
    config: ModelConfig
    tokenizer: Tokenizer | None
    device: torch.device
    dtype: torch.dtype
    page_size: int

    @classmethod
    def resolve(
        cls,
        model_dir: str | Path | None = None,
        *,
        device: str | None = None,
        dtype: torch.dtype | None = None,
        page_size: int = PAGE_SIZE,
    ) -> EngineSettings:
        """The defaults filled in: the default model (engine.default_model_dir), CUDA where
        there is one, bf16 on CUDA and fp32 on the CPU."""
        from symphony.engine.engine import default_model_dir  # it imports this module

        model_dir = Path(model_dir) if model_dir else default_model_dir()
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dev.type == "cuda":
            require_cuda()
        return cls(
            model_dir,
            ModelConfig.from_file(model_dir / "config.json"),
            Tokenizer.from_dir(model_dir),
            dev,
            dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32),
            page_size,
        )

    def eos_ids(self) -> tuple[int, ...]:
        return self.tokenizer.eos_ids if self.tokenizer else self.config.eos_token_ids

    @property
    def page_shape(self) -> PageShape:
        """The KV pool's page: every layer's KV heads, `page_size` entries of them."""
        cfg = self.config
        return PageShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.page_size, self.dtype)

    def kv_pages(self, fraction: float = KV_MEMORY_FRACTION) -> int:
        """How many pages fit in `fraction` of the device's free memory."""
        return pages_for_fraction(self.page_shape, self.device, fraction)


class HasSettings:
    """The fields of `self.settings` as attributes of the holder's own."""

    settings: EngineSettings

    @property
    def model_dir(self) -> Path:
        return self.settings.model_dir

    @property
    def config(self) -> ModelConfig:
        return self.settings.config

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.settings.tokenizer

    @property
    def device(self) -> torch.device:
        return self.settings.device

    @property
    def dtype(self) -> torch.dtype:
        return self.settings.dtype

    @property
    def page_size(self) -> int:
        return self.settings.page_size

    def eos_ids(self) -> tuple[int, ...]:
        return self.settings.eos_ids()
