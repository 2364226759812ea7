"""The Custom Scalars layout (app/telemetry/layout.py): written into every run, charting only tags the run writes, and
merged by the real TensorBoard server over a logdir with an fp16 run, an fp32 run and their comparison (one run per
precision under cmp/, as compare_amp.py writes it)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from app.telemetry import layout, tags
from tests import tb
from tests.conftest import ROOT, clean_env, data_flags, free_port, run_app

spec = importlib.util.spec_from_file_location("compare_amp", ROOT / "scripts" / "compare_amp.py")
compare_amp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_amp)

CATEGORIES = ["AMP health", "Learning", "Speed", "Memory"]  # the names other checks rely on, in this order


@pytest.fixture(scope="module")
def logdir(tmp_path_factory, tiny_model_dir, review_files) -> Path:
    """runs/fp16 and runs/fp32 (4 steps, logged every 2), and their comparison as compare_amp.py writes it (cmp/)."""
    root = tmp_path_factory.mktemp("layout")
    for name, precision in (("fp16", "fp16"), ("fp32", "no")):
        args = [*data_flags(tiny_model_dir, review_files), "--mixed_precision", precision, "--run_name", name]
        args += ["--output_dir", root / name, "--logdir", root / "runs", "--max_steps", "4", "--logging_steps", "2"]
        assert run_app([*args, "--per_device_train_batch_size", "8", "--max_length", "64", "--disable_tqdm"]) == 0
    runs = {label: compare_amp.read_run(root / "runs" / label)["curves"] for label in ("fp32", "fp16")}
    layout.write_comparison(runs, root / "runs" / "cmp")  # as compare_amp.py does
    return root / "runs"


def charted(run_layout: dict[str, dict[str, list[str]]]) -> list[str]:
    return [regex for charts in run_layout.values() for regexes in charts.values() for regex in regexes]


@pytest.mark.parametrize("run", ["fp16", "fp32", "cmp/fp16", "cmp/fp32"])
def test_each_run_writes_the_four_categories_with_charts_of_its_own_tags_only(logdir, run):
    written, logged = tb.layout(logdir / run), tb.scalars(logdir / run).keys()
    assert list(written) == CATEGORIES and all(written.values()), written
    for regex in charted(written):
        assert any(re.match(regex, tag) for tag in logged), f"{run}: the chart {regex} has no data in this run"
    scaler_charts = {regex for regex in charted(written) if regex.startswith("^amp/")}
    expected = {f"^{tag}$" for tag in (*tags.SCALER_TAGS, tags.AMP_HEADROOM_BITS) if tag != tags.AMP_APPLIED_UPDATES}
    assert scaler_charts == (expected if run == "fp16" else set()), scaler_charts


def test_the_gpu_layout_charts_the_allocator_and_mfu():  # no GPU here: the layout a CUDA run would write
    def regexes(device_type: str, mfu: bool) -> list[str]:  # as written: chart title -> ["Multiline", [regex, ...]]
        written = layout.run_layout(True, True, device_type, mfu, eval_metrics=(tags.EVAL_LOSS, tags.EVAL_ACCURACY))
        return [regex for charts in written.values() for _, found in charts.values() for regex in found]

    gpu, cpu = regexes("cuda", mfu=True), regexes("cpu", mfu=False)
    gpu_only = {tags.MEMORY_PEAK_RESERVED_PCT, tags.MEMORY_OOMS, tags.MEMORY_ALLOC_RETRIES, tags.PERF_MFU_PCT}
    assert all(any(re.match(regex, tag) for regex in gpu) for tag in gpu_only)
    assert not any(re.match(regex, tag) for regex in cpu for tag in gpu_only)
    assert "^memory/rss_gib$" in cpu and "^memory/rss_gib$" not in gpu


@contextlib.contextmanager
def tensorboard_server(logdir: Path, tmp_path: Path, runs: int):
    """The real `tensorboard --logdir` on loopback; yields a function that GETs JSON from its HTTP API."""
    port = free_port()
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1"]
    server = subprocess.Popen(
        [*command, "--port", str(port)], env=clean_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )

    def get(path: str, **query):
        url = f"http://127.0.0.1:{port}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        return json.load(urllib.request.urlopen(url, timeout=10))

    try:
        for _ in range(240):  # the server takes a few seconds to come up and load the events
            with contextlib.suppress(OSError):
                if len(get("/data/runs")) == runs:
                    break
            time.sleep(0.25)
        yield get
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_the_real_tensorboard_server_merges_the_layout_and_every_chart_has_data(logdir, tmp_path):
    with tensorboard_server(logdir, tmp_path, runs=4) as get:
        assert sorted(get("/data/runs")) == ["cmp/fp16", "cmp/fp32", "fp16", "fp32"]
        merged = get("/data/plugin/custom_scalars/layout")
        listed = get("/data/plugin/scalars/tags")  # run -> tag -> description
        assert [category["title"] for category in merged["category"]] == CATEGORIES
        for category in merged["category"]:
            for chart in category["chart"]:
                for regex in chart["multiline"]["tag"]:
                    matched = [(run, tag) for run in listed for tag in listed[run] if re.match(regex, tag)]
                    assert matched, f"{category['title']} / {chart['title']}: {regex} matches no run's data"
                    run, tag = matched[0]
                    assert get("/data/plugin/scalars/scalars", run=run, tag=tag), (run, tag)
        learning = next(category for category in merged["category"] if category["title"] == "Learning")
        overlay = next(chart for chart in learning["chart"] if chart["title"] == "train loss by precision")
        # The chart's regex as the Custom Scalars tab asks for it, run by run: one line for each compared precision.
        regex = overlay["multiline"]["tag"][0]
        lines = {run: get("/data/plugin/custom_scalars/scalars", run=run, tag=regex)["tag_to_events"] for run in listed}
        assert {run for run, found in lines.items() if found} == {"cmp/fp16", "cmp/fp32"}
        assert [len(lines["cmp/fp16"][tags.COMPARE_TRAIN_LOSS])] == [2], "train/loss at steps 2 and 4"
        assert not listed["fp32"].keys() & set(tags.SCALER_TAGS), "the fp32 run has no scaler tags"
        assert set(tags.SCALER_TAGS) | {tags.AMP_HEADROOM_BITS} <= listed["fp16"].keys()
