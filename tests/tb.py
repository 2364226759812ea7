"""Read TensorBoard event files back with TensorBoard's own reader."""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def load(run_dir: Path) -> EventAccumulator:
    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value}, for every scalar tag in the run."""
    events = load(run_dir)
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def texts(run_dir: Path) -> dict[str, str]:
    """tag -> text, for the text summaries (written as tensors)."""
    events = load(run_dir)
    found = {}
    for tag in events.Tags()["tensors"]:
        if tag.endswith("/text_summary"):
            found[tag.removesuffix("/text_summary")] = events.Tensors(tag)[0].tensor_proto.string_val[0].decode()
    return found


def layout(run_dir: Path) -> dict[str, dict[str, list[str]]]:
    """The run's custom-scalars layout: category -> chart title -> tag regexes, in the order written."""
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata

    proto = layout_pb2.Layout()
    proto.ParseFromString(load(run_dir).Tensors(metadata.CONFIG_SUMMARY_TAG)[0].tensor_proto.string_val[0])
    return {c.title: {chart.title: list(chart.multiline.tag) for chart in c.chart} for c in proto.category}


def raw_points(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of every point of a scalar tag in the run's own event files, in the order written, as a reader
    that honours no purge step sees them (TensorBoard 2.21's server)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    points = []
    # By the time each was written: files named in one second by one process (a run and its resume in a test's
    # process) sort by a counter as text, ".10" before ".9".
    for path in sorted(run_dir.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.tag == tag:
                    scalar = (
                        value.simple_value
                        if value.HasField("simple_value")
                        else tensor_util.make_ndarray(value.tensor).item()
                    )
                    points.append((event.wall_time, event.step, scalar))
    return [(step, scalar) for _, step, scalar in sorted(points, key=lambda point: point[0])]


def hparams_rows(run_dir: Path) -> list[dict]:
    """The HPARAMS rows (each session's hparams: name -> value) in the run's own event files, in the order written:
    TensorBoard's server shows the first."""
    from google.protobuf import json_format
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams import plugin_data_pb2

    rows = []
    for path in sorted(run_dir.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.tag == "_hparams_/session_start_info":
                    data = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
                    hparams = data.session_start_info.hparams
                    rows.append((event.wall_time, {name: json_format.MessageToDict(hparams[name]) for name in hparams}))
    return [row for _, row in sorted(rows, key=lambda timed: timed[0])]
