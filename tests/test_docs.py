"""Every Python block of the README and of docs/ runs, on 2 gloo ranks, so no snippet rots.

The blocks run verbatim in one torchrun job (``tests/_doc_runner.py`` gives each the names its
text refers to); the Trainer, accelerate, Lightning and Fabric snippets are run end to end by
their own tests."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_every_python_block_runs(tmp_path: Path):
    blocks = sum(len(re.findall(r"```python\n", f.read_text())) for f in FILES)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(REPO / "tests" / "_doc_runner.py"),
            str(tmp_path),
            *map(str, FILES),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = (tmp_path / "result_0.txt").read_text() if (tmp_path / "result_0.txt").exists() else ""
    assert proc.returncode == 0, report + proc.stdout[-3000:] + proc.stderr[-3000:]
    ran = int(report.split()[1])
    # All but the four framework snippets (Trainer, accelerate, Lightning, Fabric) ran verbatim.
    assert ran == blocks - 4, report
