"""Where and how a run happened: date, device, driver, library versions and the exact command."""

from __future__ import annotations

import re
import shlex
import subprocess
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata

import torch

VERSIONED = {"torch": "torch", "triton": "triton", "helion": "helion", "cutlass": "nvidia-cutlass-dsl"}
_VENDOR_WORDS = {"nvidia", "geforce", "tesla", "quadro"}


@dataclass(frozen=True)
class Environment:
    date: str
    gpu: str  # full device name, "cpu" without a GPU
    gpu_short: str  # file stem of the results: "h200", "cpu"
    driver: str
    versions: dict[str, str]  # VERSIONED key -> version or "absent"
    command: str

    def columns(self) -> dict[str, str]:
        return {"date": self.date, "gpu": self.gpu, "driver": self.driver, **self.versions, "command": self.command}


def version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "absent"


def short_gpu_name(name: str) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA A100-SXM4-80GB' -> 'a100', 'NVIDIA GeForce RTX 4090' -> 'rtx4090'."""
    words = [w for w in re.split(r"[\s\-_]+", name.lower()) if w and w not in _VENDOR_WORDS]
    picked = []
    for word in words:
        picked.append(word)
        if any(ch.isdigit() for ch in word):
            break
    return re.sub(r"[^a-z0-9]", "", "".join(picked)) or "gpu"


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        return out.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def collect(device: torch.device, argv: list[str]) -> Environment:
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = " ".join(["python -m benchmarks.run", *map(shlex.quote, argv)])
    versions = {key: version(dist) for key, dist in VERSIONED.items()}
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return Environment(date, name, short_gpu_name(name), _driver(), versions, command)
    return Environment(date, "cpu", "cpu", "-", versions, command)
