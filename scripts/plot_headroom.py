"""Plot a run's fp16 headroom (amp/headroom_bits) above its loss scale and skipped steps, from its event file.

    python scripts/plot_headroom.py runs/20261130-101500-fp16 --out headroom.png

A step whose activations overflowed (inf or NaN) has no headroom and logs -1; here such steps are marked at the
bottom of the headroom panel, and the curve joins the steps that had headroom. The modules that set the headroom
(text amp/headroom_module, from the step where each took over) are named in the title, and the step of the loss-scale
alarm (text amp/overflow_report) is a dashed line.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from app.telemetry import tags  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="one run's folder: <logdir>/<run_name>")
    parser.add_argument("--out", type=Path, default=Path("headroom.png"))
    args = parser.parse_args()
    events = EventAccumulator(str(args.run_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    curves = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    if not curves.get(tags.AMP_HEADROOM_BITS):
        print(f"error: {args.run_dir} has no {tags.AMP_HEADROOM_BITS} (an fp16 run logs it)", file=sys.stderr)
        return 2
    texts = {tag.removesuffix("/text_summary"): events.Tensors(tag) for tag in events.Tags()["tensors"]}
    setters = [  # "`module` sets the fp16 headroom: ..."
        f"{text.tensor_proto.string_val[0].decode().split('`')[1]} from step {text.step}"
        for text in texts.get(tags.AMP_HEADROOM_MODULE, [])
    ]
    alarm = texts[tags.AMP_OVERFLOW_REPORT][0].step if tags.AMP_OVERFLOW_REPORT in texts else None

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    headroom = curves[tags.AMP_HEADROOM_BITS]
    # Below 0 only without headroom: -1 (NO_HEADROOM), or -inf and NaN in runs logged before it was.
    overflowed = [step for step, bits in headroom.items() if not bits >= 0]
    finite = {step: bits for step, bits in headroom.items() if bits >= 0 and math.isfinite(bits)}
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(7, 4.6), height_ratios=(3, 2))
    top.plot(list(finite), list(finite.values()), marker="o", color="tab:blue", label=tags.AMP_HEADROOM_BITS)
    floor = min([0.0, *finite.values()]) - 0.5
    top.scatter(
        overflowed, [floor] * len(overflowed), marker="v", color="tab:red", label="overflow (inf or NaN)", zorder=3
    )
    top.axhline(0, color="gray", linewidth=0.8)
    top.set(ylabel="headroom (bits)", ylim=(floor - 0.4, max(finite.values(), default=1) + 0.5))
    top.set_title(f"{args.run_dir.name}: fp16 headroom, set by\n" + "; ".join(setters), fontsize=8)
    top.legend(fontsize=8, loc="lower left")
    skipped = curves.get(tags.AMP_SKIPPED_STEPS, {})
    bottom.step(list(skipped), list(skipped.values()), where="post", color="tab:red", label=tags.AMP_SKIPPED_STEPS)
    bottom.set(xlabel="optimizer step", ylabel="skipped steps")
    scale = curves.get(tags.AMP_LOSS_SCALE, {})
    if scale:
        twin = bottom.twinx()
        twin.plot(list(scale), list(scale.values()), color="tab:green", marker=".", label=tags.AMP_LOSS_SCALE)
        twin.set(yscale="log", ylabel="loss scale")
        twin.legend(fontsize=8, loc="lower left")
    bottom.legend(fontsize=8, loc="upper left")
    if alarm is not None:
        for axes in (top, bottom):
            axes.axvline(alarm, color="black", linestyle="--", linewidth=0.9)
        top.annotate(
            "loss-scale alarm",
            (alarm, 1),
            xycoords=("data", "axes fraction"),
            xytext=(-4, -4),
            textcoords="offset points",
            ha="right",
            va="top",
            fontsize=8,
        )
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
