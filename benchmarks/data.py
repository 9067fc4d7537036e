"""The data users have, against the plain loops they would write, side by side in one run (docs/benchmarks.md,
"Data"):

- `images`: an image folder of PNGs decoded with Pillow, a random resized crop and a flip drawn from torch's
  generator (as torchvision's transforms draw), transformers' ResNet-18, one compute worker (its batches made
  by its own batch maker, the default for a Dataset factory) against a plain loop with
  `DataLoader(num_workers=k)` on the same Dataset;
- `text`: token ids in a Hugging Face `datasets` folder, dict batches (`input_ids`, `attention_mask`,
  `label`), transformers' GPT-2 classifier computing its own loss (`loss="model"`), one worker against a plain
  loop over `load_from_disk(...).with_format("torch")`;
- `scaling`: the image job on 2 compute workers against 1, with where a step's time goes (the wait for
  batches is the loop's `batches` phase), the batches made by the workers (the default) and by the data
  servers;
- `s3`: Parquet on a local S3 server (moto) 8 times larger than each static worker's memory limit (Dask's
  `memory_limit`): the data servers' peak RSS over the limit, and samples/s against the same Parquet in
  memory (on tmpfs).

    python -m benchmarks.data [--figures images,text,scaling,s3] [--pairs 3] [--folder DIR] [--json OUT]
        [--s3-multiple 8]

Both sides of a pair train with one torch thread, SGD with momentum, the same batch. A warm-up pair is not
counted, then `--pairs` alternating pairs; the median ratio is reported. The plain loops run in a process
of their own (`--plain FIGURE`). transformers, pyarrow, datasets and Pillow come with the `bench`, `data`
and `image` extras; the S3 figure needs moto's server and s3fs (the dev extra).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from prefect_elastic import ElasticJob, train
from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.training import TrainResult

from . import elastic
from .workloads import LR, MOMENTUM

REPOSITORY = Path(__file__).resolve().parent.parent
FIGURES = ("images", "text", "scaling", "s3")
FOLDER_VARIABLE = "PREFECT_ELASTIC_BENCH_DATA"  # where the factories find the data, on every process
SIDE, CROP, CLASSES = 40, 32, 10
IMAGES, IMAGE_BATCH = 1024, 32
TOKENS, SEQUENCE, TEXT_BATCH = 2048, 32, 16
LOADER_WORKERS = (
    1  # the plain loop's DataLoader(num_workers=k): a core beside the step, as the engine's maker
)


# ---- the image folder ------------------------------------------------------------------------------------


def write_pngs(folder: Path, count: int = IMAGES) -> Path:
    """`count` PNGs of SIDE x SIDE in one subfolder per class (as torchvision's ImageFolder reads them)."""
    from PIL import Image

    if (folder / "done").exists():
        return folder
    rng = np.random.default_rng(0)
    for k in range(count):
        label = k % CLASSES
        (folder / f"class{label}").mkdir(parents=True, exist_ok=True)
        pattern = np.zeros((SIDE, SIDE, 3), dtype=np.float32)
        pattern[:, :, label % 3] = 0.2 + 0.06 * label
        noisy = np.clip(pattern + rng.normal(0, 0.2, size=pattern.shape), 0, 1)
        Image.fromarray((noisy * 255).astype(np.uint8)).save(folder / f"class{label}" / f"{k:05d}.png")
    (folder / "done").write_text("")
    return folder


class PngFolder(Dataset[tuple[torch.Tensor, int]]):
    """A user's Dataset: PNGs decoded with Pillow, a random resized crop (scale 0.5-1, aspect 3/4-4/3, resized
    bilinearly to CROP) and a horizontal flip, drawn from torch's global generator as torchvision's
    RandomResizedCrop and RandomHorizontalFlip draw, then normalised."""

    def __init__(self, root: Path) -> None:
        self.files = sorted(root.glob("*/*.png"))
        self.classes = sorted({f.parent.name for f in self.files})

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        path = self.files[index]
        with Image.open(path) as image:
            pixels = torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0).permute(
                2, 0, 1
            )
        scale = float(torch.empty(()).uniform_(0.5, 1.0))
        aspect = float(torch.empty(()).uniform_(np.log(3 / 4), np.log(4 / 3)).exp())
        h = min(SIDE, max(8, round((scale * SIDE * SIDE / aspect) ** 0.5)))
        w = min(SIDE, max(8, round((scale * SIDE * SIDE * aspect) ** 0.5)))
        top = int(torch.randint(0, SIDE - h + 1, ()))
        left = int(torch.randint(0, SIDE - w + 1, ()))
        crop = pixels[:, top : top + h, left : left + w].unsqueeze(0)
        crop = nn.functional.interpolate(crop, size=(CROP, CROP), mode="bilinear", align_corners=False)[0]
        if torch.rand(()) < 0.5:
            crop = crop.flip(-1)
        return ((crop - 0.5) / 0.25).contiguous(), self.classes.index(path.parent.name)


def png_folder() -> PngFolder:
    """The job's `dataset` factory (`benchmarks.data:png_folder`)."""
    return PngFolder(Path(os.environ[FOLDER_VARIABLE]) / "images")


def resnet18() -> nn.Module:
    from .workloads import resnet18 as built

    return built()


# ---- the text folder -------------------------------------------------------------------------------------


def write_tokens(folder: Path, count: int = TOKENS) -> Path:
    """Token ids, their attention mask and a label, as `datasets.Dataset.save_to_disk` writes them."""
    import datasets

    from .text_model import synthetic_tokens

    if (folder / "dataset_info.json").exists():
        return folder
    ids, labels = synthetic_tokens(count)
    rows = {"input_ids": ids.tolist(), "attention_mask": np.ones_like(ids).tolist(), "label": labels.tolist()}
    datasets.Dataset.from_dict(rows).save_to_disk(str(folder))
    return folder


def gpt2_text() -> nn.Module:
    """transformers' GPT-2 classifier of `text_model` (50,257 tokens, 2 layers of 256), as users call it:
    `input_ids` and `attention_mask` as keywords, its own loss from `labels`."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from .text_model import CLASSES as TEXT_CLASSES
    from .text_model import VOCAB

    config = GPT2Config(
        vocab_size=VOCAB, n_embd=256, n_layer=2, n_head=4, n_positions=SEQUENCE, pad_token_id=VOCAB - 1
    )  # fmt: skip
    config.num_labels = TEXT_CLASSES
    torch.manual_seed(0)
    return GPT2ForSequenceClassification(config)


# ---- the plain loops -------------------------------------------------------------------------------------


def _timed(steps: Any, warmup: int = 5) -> dict[str, float]:
    """Runs the steps of the iterator `steps` (each yields its batch size); samples/s after `warmup`."""
    times, sizes = [], []
    for size in steps:
        times.append(time.perf_counter())
        sizes.append(size)
    if len(times) <= warmup + 1:
        raise ValueError(f"{len(times)} steps: too few for a rate after {warmup} of warm-up")
    elapsed = times[-1] - times[warmup]
    return {
        "samples_per_s": sum(sizes[warmup + 1 :]) / elapsed,
        "step_ms": 1000 * elapsed / (len(times) - 1 - warmup),
    }


def plain_images(folder: Path) -> dict[str, float]:
    torch.set_num_threads(1)
    net = resnet18()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    loader = DataLoader(
        PngFolder(folder / "images"), batch_size=IMAGE_BATCH, shuffle=True, drop_last=True,
        num_workers=LOADER_WORKERS, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip

    def steps() -> Any:
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(net(x), y).backward()
            optimizer.step()
            yield len(y)

    return _timed(steps())


def plain_text(folder: Path) -> dict[str, float]:
    import datasets

    torch.set_num_threads(1)
    net = gpt2_text()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    data = datasets.load_from_disk(str(folder / "text")).with_format("torch")
    loader = DataLoader(
        data, batch_size=TEXT_BATCH, shuffle=True, drop_last=True, num_workers=LOADER_WORKERS,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip

    def steps() -> Any:
        for batch in loader:
            optimizer.zero_grad(set_to_none=True)
            out = net(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["label"]
            )
            out.loss.backward()
            optimizer.step()
            yield len(batch["label"])

    return _timed(steps())


def _plain(figure: str, folder: Path) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.data", "--plain", figure, "--folder", str(folder)],
        capture_output=True, text=True, check=False, cwd=REPOSITORY,
        env={**os.environ, FOLDER_VARIABLE: str(folder)},
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the plain {figure} loop exited {done.returncode}: {done.stderr[-3000:]}")
    measured: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return measured


# ---- the engine's side -----------------------------------------------------------------------------------


def job_for(figure: str, name: str, **overrides: Any) -> ElasticJob:
    common: dict[str, Any] = {
        "job_id": name, "optimizer": {"name": "sgd", "lr": LR, "momentum": MOMENTUM}, "micro_batches": 1,
        "epochs": 1, "data_servers": 2, "liveness_interval": 1.0, "threads_per_worker": 1, "min_workers": 1,
    }  # fmt: skip
    if figure in ("images", "scaling"):
        fields = {"model": "benchmarks.data:resnet18", "dataset": "benchmarks.data:png_folder"}
        return ElasticJob(**common, **fields, batch_size=IMAGE_BATCH, **overrides)
    folder = os.environ[FOLDER_VARIABLE]
    return ElasticJob(
        **common, model="benchmarks.data:gpt2_text", dataset=f"{folder}/text", batch_size=TEXT_BATCH,
        inputs=["input_ids", "attention_mask"], target="label", loss="model", **overrides,
    )  # fmt: skip


def measured(result: TrainResult) -> dict[str, Any]:
    cost = elastic.fixed_cost(result)
    return {
        "samples_per_s": elastic.steady_throughput(result),
        "step_ms": cost["step_ms"],
        "phase_ms": {k: round(v, 2) for k, v in cost["phase_ms"].items()},
    }


def resize(cluster: LocalElasticCluster, workers: int) -> None:
    """Exactly `workers` compute workers."""
    cluster.wait_for_pending()
    have = cluster.elastic_addresses()
    for address in have[workers:]:
        cluster.kill_worker(address)
    names = [cluster.add_worker(wait=False) for _ in range(workers - len(have))]
    cluster.wait_for_workers(names)
    while len(cluster.elastic_addresses()) != workers:
        time.sleep(0.2)


def pairs_of(figure: str, cluster: LocalElasticCluster, folder: Path, pairs: int) -> dict[str, Any]:
    """The engine's one worker against the plain loop, alternating, pair 0 a warm-up."""
    resize(cluster, 1)
    ratios: list[float] = []
    rows = []
    for i in range(pairs + 1):
        got: dict[str, dict[str, Any]] = {}
        for side in ("plain", "elastic") if i % 2 else ("elastic", "plain"):
            if side == "plain":
                got["plain"] = _plain(figure, folder)
            else:
                got["elastic"] = measured(train(job_for(figure, f"data-{figure}-{i}"), cluster=cluster))
        ratio = got["elastic"]["samples_per_s"] / got["plain"]["samples_per_s"]
        print(
            f"{figure} pair {i}{' (warm-up)' if i == 0 else ''}: plain {got['plain']['samples_per_s']:.1f} "
            f"samples/s (step {got['plain']['step_ms']:.1f} ms), prefect-elastic "
            f"{got['elastic']['samples_per_s']:.1f} (step {got['elastic']['step_ms']:.1f} ms, phases "
            f"{got['elastic']['phase_ms']}): {ratio:.3f}",
            flush=True,
        )
        if i:
            ratios.append(ratio)
            rows.append(got)
    return {"ratio": statistics.median(ratios), "pairs": ratios, "runs": rows}


def scaling(cluster: LocalElasticCluster, pairs: int) -> dict[str, Any]:
    """The image job on 2 compute workers against 1, with each pipeline, alternating."""
    out: dict[str, Any] = {}
    for pipeline in ("compute_workers", "data_servers"):
        ratios, runs = [], []
        for i in range(pairs):
            got: dict[int, dict[str, Any]] = {}
            for workers in (1, 2) if i % 2 == 0 else (2, 1):
                resize(cluster, workers)
                job = job_for("scaling", f"data-scaling-{pipeline}-{workers}-{i}", data_pipeline=pipeline)
                got[workers] = measured(train(job, cluster=cluster))
            ratio = got[2]["samples_per_s"] / got[1]["samples_per_s"]
            print(
                f"scaling {pipeline} {i}: 1 worker {got[1]['samples_per_s']:.1f} samples/s "
                f"{got[1]['phase_ms']}, 2 workers {got[2]['samples_per_s']:.1f} {got[2]['phase_ms']}: "
                f"{ratio:.3f}",
                flush=True,
            )
            ratios.append(ratio)
            runs.append(got)
        out[pipeline] = {"ratio": statistics.median(ratios), "pairs": ratios, "runs": runs}
    return out


# ---- Parquet on S3, larger than the static workers' memory -----------------------------------------------

# Each worker's memory limit: a `dask worker` with the engine loaded and a data server started holds about
# 410 MiB here and peaks near 740 MiB while it trains (shared-memory inboxes, the cache, batches ahead).
S3_LIMIT = 2**30
S3_WIDTH = 4096  # float32 features a sample: 16 KiB
S3_BATCH = 128


def write_wide_parquet(folder: Path, total_bytes: int, files: int = 16, row_group: int = 256) -> int:
    """`total_bytes` of rows (x: S3_WIDTH float32, y: an int64 label of 10) in `files` Parquet files of row
    groups of `row_group` rows; the number of rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = total_bytes // (4 * S3_WIDTH)
    per_file = rows // files
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for f in range(files):
        y = rng.integers(0, 10, size=per_file).astype(np.int64)
        x = rng.standard_normal((per_file, S3_WIDTH), dtype=np.float32) + y[:, None].astype(np.float32) * 0.05
        column = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), S3_WIDTH)
        pq.write_table(
            pa.table({"x": column, "y": y}), folder / f"part-{f:03d}.parquet", row_group_size=row_group
        )
    return per_file * files


def wide_mlp() -> nn.Module:
    """An MLP over the wide rows: S3_WIDTH -> 512 -> 10, a step of some tens of ms at batch 128."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(S3_WIDTH, 512), nn.ReLU(), nn.Linear(512, 10))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def s3_figure(folder: Path, ratio_to_limit: int = 8) -> dict[str, Any]:
    """The same Parquet on S3 and on tmpfs, one compute worker each, every worker under S3_LIMIT."""
    import fsspec

    moto = Path(sys.executable).with_name("moto_server")
    if not moto.exists():
        raise SystemExit(f"{moto} is missing: pip install 'moto[server]' s3fs (the dev extra)")
    local = Path(tempfile.mkdtemp(prefix="prefect-elastic-bench-parquet-", dir="/dev/shm"))
    port = _free_port()
    server = subprocess.Popen(
        [str(moto), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        started = time.time()
        rows = write_wide_parquet(local, ratio_to_limit * S3_LIMIT)
        print(
            f"s3: {rows} rows, {ratio_to_limit * S3_LIMIT / 2**30:.1f} GiB written in "
            f"{time.time() - started:.0f} s"
        )
        options = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "bench", "secret": "bench"}
        for _ in range(100):
            try:
                fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
                fs.mkdir("bench-parquet")
                break
            except OSError:
                time.sleep(0.2)
        started = time.time()
        fs.put(f"{local}/", "bench-parquet/wide/", recursive=True)
        print(f"s3: uploaded in {time.time() - started:.0f} s", flush=True)
        out: dict[str, Any] = {"rows": rows, "dataset_bytes": ratio_to_limit * S3_LIMIT, "limit": S3_LIMIT}
        common: dict[str, Any] = {
            "model": "benchmarks.data:wide_mlp",
            "optimizer": {"name": "sgd", "lr": LR, "momentum": MOMENTUM}, "batch_size": S3_BATCH,
            "micro_batches": 1, "epochs": 1, "data_servers": 2, "threads_per_worker": 1, "min_workers": 1,
            "data_cache_bytes": 96 * 2**20,  # (24 row groups of 4 MiB: two shuffle windows of 8, and some)
        }  # fmt: skip
        sources: dict[str, dict[str, Any]] = {
            "s3": {"dataset": "s3://bench-parquet/wide", "storage_options": {"s3": options}},
            # (The same rows shuffled by blocks as on S3, so that only where they are read from differs.)
            "memory": {"dataset": f"file://{local}", "shuffle": "blocks"},
        }
        with LocalElasticCluster(
            static_workers=2, elastic_workers=1, memory_limit=f"{S3_LIMIT // 2**20}MiB"
        ) as cluster:
            for name, source in sources.items():
                result = train(ElasticJob(job_id=f"data-s3-{name}", **common, **source), cluster=cluster)
                peaks = cluster.client().run(_peak_rss, workers=cluster.static_addresses())
                out[name] = {**measured(result), "static_peak_rss": sorted(peaks.values())}
                print(f"s3: {name}: {out[name]}", flush=True)
        out["ratio"] = out["s3"]["samples_per_s"] / out["memory"]["samples_per_s"]
        out["peak_over_limit"] = max(out["s3"]["static_peak_rss"]) / S3_LIMIT
        return out
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(local, ignore_errors=True)


def _peak_rss() -> int:
    """This process's peak resident set, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- the command -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.data", description=__doc__.split("\n\n")[0])
    parser.add_argument("--figures", default=",".join(FIGURES), help=f"of {', '.join(FIGURES)}")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--folder", type=Path, help="where the image and text data are written (kept)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument(
        "--s3-multiple", type=int, default=8, help="the Parquet on S3 is this many times a worker's limit"
    )
    parser.add_argument(
        "--plain", choices=("images", "text"), help=argparse.SUPPRESS
    )  # (a plain loop's process)
    args = parser.parse_args(argv)
    figures = [f for f in args.figures.split(",") if f]
    unknown = sorted(set(figures) - set(FIGURES))
    if unknown:
        parser.error(f"--figures {args.figures}: unknown {unknown}; give some of {', '.join(FIGURES)}")
    if args.pairs < 1:
        parser.error(f"--pairs {args.pairs}: give 1 or more")
    folder = (args.folder or Path(tempfile.gettempdir()) / "prefect-elastic-bench-data").resolve()
    if args.plain:
        loop = plain_images if args.plain == "images" else plain_text
        print(json.dumps(loop(folder)))
        return 0
    write_pngs(folder / "images")
    write_tokens(folder / "text")
    os.environ[FOLDER_VARIABLE] = str(folder)
    out: dict[str, Any] = {}
    needs_cluster = [f for f in figures if f != "s3"]
    if needs_cluster:
        env = {FOLDER_VARIABLE: str(folder)}
        with LocalElasticCluster(static_workers=2, elastic_workers=1, env=env) as cluster:
            for figure in needs_cluster:
                if figure == "scaling":
                    out[figure] = scaling(cluster, args.pairs)
                else:
                    out[figure] = pairs_of(figure, cluster, folder, args.pairs)
    if "s3" in figures:
        out["s3"] = s3_figure(folder, args.s3_multiple)
    for figure, got in out.items():
        if figure == "scaling":
            for pipeline, row in got.items():
                print(f"scaling ({pipeline}): 2 workers over 1: {row['ratio']:.3f} (pairs {row['pairs']})")
        elif figure == "s3":
            print(
                f"s3: {got['ratio']:.3f} of in-memory samples/s; the data servers' peak RSS "
                f"{got['peak_over_limit']:.2f} of their limit"
            )
        else:
            print(
                f"{figure}: {got['ratio']:.3f} of plain (pairs {', '.join(f'{r:.3f}' for r in got['pairs'])})"
            )
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
