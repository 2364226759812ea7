"""Write configs/default.yaml from TrainConfig: every training flag at its default, with its help as a comment.

    python scripts/write_default_config.py          # after adding or changing a flag in app/config.py
    python scripts/write_default_config.py --check  # exit 1 if the file is not what this would write

tests/test_configs.py checks that the file is what this writes, so a flag added or changed without rerunning it fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402

from app.config import TrainConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HEADER = """\
# Every training flag at its default. Each key is a flag of `python app/train.py --help`:
#   python app/train.py --config configs/default.yaml --learning_rate 3e-5    # the command line wins over this file
# Copy it, keep the keys you change, delete the rest. Unknown keys and values of the wrong type are errors.
# Where (processes, machines, backend) is not here: that is accelerate launch's, see accelerate_configs/.
# Written by scripts/write_default_config.py from app/config.py.
"""


def render() -> str:
    """configs/default.yaml as it should be: every field of TrainConfig at its default, its help as a comment."""
    source = (ROOT / "app" / "config.py").read_text(encoding="utf-8")
    # The section rulers of the dataclass ("# ---- precision ----"), by the first field under each.
    sections = {m.group(2): m.group(1).strip() for m in re.finditer(r"# ---- ([^-]+?) -+\n\s+(\w+):", source)}
    lines, defaults = [HEADER], TrainConfig()
    for field in dataclasses.fields(TrainConfig):
        if field.name in sections:
            lines.append(f"# ---- {sections[field.name]} " + "-" * (100 - len(sections[field.name])))
        lines += ["# " + line for line in textwrap.wrap(field.metadata["help"].replace("%%", "%"), 116)]
        lines += [yaml.safe_dump({field.name: getattr(defaults, field.name)}).strip(), ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the file is out of date")
    args = parser.parse_args(argv)
    path = ROOT / "configs" / "default.yaml"
    if args.check:
        if not path.is_file() or path.read_text(encoding="utf-8") != render():
            state = "out of date" if path.is_file() else "missing"
            print(f"{path} is {state}: run python scripts/write_default_config.py", file=sys.stderr)
            return 1
        return 0
    path.write_text(render(), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
