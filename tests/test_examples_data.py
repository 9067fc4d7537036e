"""The data-source examples, run as their READMEs say at a tiny size on the local cluster `run.py` starts:
a Hugging Face text classifier on a `datasets` folder (examples/hf_text), and a Dataset of PNGs decoded
and augmented per sample (examples/image_folder). Each commits every step of its schedule, every batch id
once, and its loss falls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run_example(folder: Path, make: list[str], data: Path, tmp_path: Path, epochs: int) -> dict:
    made = subprocess.run(
        [sys.executable, *make, "--out", str(data)], cwd=folder, capture_output=True, text=True, timeout=120
    )
    assert made.returncode == 0, made.stdout + made.stderr
    summary = tmp_path / "run.json"
    output = tmp_path / "model.pt"
    trained = subprocess.run(
        [sys.executable, "run.py", "--data", str(data), "--epochs", str(epochs), "--summary", str(summary),
         "--output", str(output)],
        cwd=folder, capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    assert output.stat().st_size > 0
    result = json.loads(summary.read_text())
    assert result["steps"] == result["total_steps"] > 0, result["steps"]
    assert result["batch_ids"] == list(range(result["total_batches"]))  # every batch id, once
    history = result["history"]
    third = max(1, len(history) // 3)
    first, last = sum(history[:third]) / third, sum(history[-third:]) / third
    assert last < 0.7 * first, (first, last)
    return result


def test_hf_text_example(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("datasets")
    result = run_example(EXAMPLES / "hf_text", ["make_data.py"], tmp_path / "text", tmp_path, epochs=2)
    assert result["total_steps"] == 2 * 512 // (16 * 2)


def test_image_folder_example(tmp_path: Path) -> None:
    pytest.importorskip("PIL")
    result = run_example(EXAMPLES / "image_folder", ["make_images.py"], tmp_path / "images", tmp_path, 3)
    assert result["total_steps"] == 3 * 256 // (16 * 2)
