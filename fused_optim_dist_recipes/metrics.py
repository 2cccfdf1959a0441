"""What a run reports: a progress line, ``metrics.jsonl``, a loss-curve PNG, memory figures and
the machine the numbers were measured on.

Nothing here is collective: the caller creates these objects on rank 0 only.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import resource
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

import torch

__all__ = [
    "HELD_OUT_KEY",
    "METRIC_KEYS",
    "MetricsLog",
    "ProgressLine",
    "describe_machine",
    "format_bytes",
    "machine_summary",
    "memory_budget_bytes",
    "peak_memory_bytes",
    "plot_loss_curve",
    "read_metrics",
]

METRIC_KEYS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_bytes")
"""Keys every row of ``metrics.jsonl`` has."""
HELD_OUT_KEY = "heldout_loss"
"""The held-out loss, in the rows of the steps it was computed at only."""

KIB = 1024
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in _UNITS[:-1]:
        if abs(n) < KIB:
            return f"{n:.1f} {unit}"
        n /= KIB
    return f"{n:.1f} {_UNITS[-1]}"


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory so far: CUDA allocator peak on a GPU, peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    # Linux reports ru_maxrss in KiB.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB


def memory_budget_bytes(device: torch.device) -> int:
    """Total memory of the GPU, or of the host for CPU training."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_machine(device: str = "cpu") -> dict[str, Any]:
    """What the numbers are measured on, including how busy the machine is right now."""
    machine: dict[str, Any] = {
        "cpu": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": device,
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_average_1min_at_start": round(os.getloadavg()[0], 2),
    }
    if device == "cuda":
        machine["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return machine


def machine_summary(machine: dict[str, Any]) -> str:
    """One line of :func:`describe_machine`'s result, for the title of a results table."""
    gpus = f", {len(machine['gpus'])} x {machine['gpus'][0]}" if machine.get("gpus") else ""
    return f"{machine['cpu']}, {machine['logical_cores']} cores{gpus}, torch {machine['torch']}"


class ProgressLine:
    """One status line per step, rewritten in place with ``\\r`` on a terminal.

    When ``stream`` is not a terminal (a log file, a pipe), every ``every``-th step and the last
    one are printed on lines of their own instead. A row with a held-out loss is always printed,
    and on a terminal its line stays.
    """

    def __init__(self, total_steps: int, *, every: int = 10, stream: TextIO | None = None) -> None:
        self.total_steps = total_steps
        self.every = max(1, every)
        self.stream = stream if stream is not None else sys.stdout
        self.in_place = self.stream.isatty()
        self._width = 0

    def update(self, row: Mapping[str, Any]) -> None:
        step = row["step"]
        held_out = row.get(HELD_OUT_KEY)
        text = (
            f"step {step:>{len(str(self.total_steps))}}/{self.total_steps} "
            f"| loss {row['loss']:.4f} "
            + (f"| held-out {held_out:.4f} " if held_out is not None else "")
            + f"| lr {row['lr']:.2e} | grad norm {row['grad_norm']:.3f} "
            f"| {row['tokens_per_s']:,.0f} tok/s | peak mem {format_bytes(row['peak_mem_bytes'])}"
        )
        if self.in_place:
            # A held-out loss is rare and worth keeping on screen: it ends the in-place line.
            ends = held_out is not None
            self.stream.write("\r" + text.ljust(self._width) + ("\n" if ends else ""))
            self._width = 0 if ends else len(text)
        elif step % self.every == 0 or step == self.total_steps or held_out is not None:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the in-place line so that later output starts on a fresh line."""
        if self.in_place and self._width:
            self.stream.write("\n")
            self.stream.flush()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` file; an absent file has none."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsLog:
    """Appends one JSON object per step to ``path``.

    Rows after ``resume_step`` left by an earlier, interrupted run are dropped on opening, so a
    resumed run's file reads as one run. Each row is flushed as it is written.

    Raises:
        ValueError: if a row lacks one of :data:`METRIC_KEYS`.
    """

    def __init__(self, path: str | Path, *, resume_step: int = 0) -> None:
        self.path = Path(path)
        kept = [row for row in read_metrics(self.path) if row["step"] <= resume_step]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("w")
        for row in kept:
            self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def write(self, row: Mapping[str, Any]) -> None:
        missing = [key for key in METRIC_KEYS if key not in row]
        if missing:
            raise ValueError(f"metrics row for step {row.get('step')} lacks keys {missing}")
        self._file.write(json.dumps(dict(row)) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def plot_loss_curve(metrics_path: str | Path, png_path: str | Path, *, title: str = "") -> Path:
    """Plot training loss, held-out loss where computed, and learning rate (on a second axis)
    against step from ``metrics.jsonl``.

    Raises:
        ValueError: if the metrics file has no rows.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    if not rows:
        raise ValueError(f"{metrics_path} has no metrics rows to plot")
    steps = [row["step"] for row in rows]
    fig, loss_axis = plt.subplots(figsize=(7, 4), dpi=120)
    loss_axis.plot(steps, [row["loss"] for row in rows], color="tab:blue", label="train")
    held_out = [(row["step"], row[HELD_OUT_KEY]) for row in rows if HELD_OUT_KEY in row]
    if held_out:
        loss_axis.plot(*zip(*held_out, strict=True), "o-", color="tab:green", label="held-out")
        loss_axis.legend(loc="upper right")
    loss_axis.set_xlabel("step")
    loss_axis.set_ylabel("loss (nats/token)")
    lr_axis = loss_axis.twinx()
    lr_axis.plot(steps, [row["lr"] for row in rows], color="tab:orange", alpha=0.6)
    lr_axis.set_ylabel("learning rate", color="tab:orange")
    loss_axis.set_title(title or "training loss")
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path)
    plt.close(fig)
    return png_path
