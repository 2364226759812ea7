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
