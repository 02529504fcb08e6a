"""A PNG of `hybridrl watch RUN_DIR --once` without a terminal: the same frame recorded by rich's console, exported
as SVG and rasterised by cairosvg (`pip install cairosvg`; not a hybridrl dependency). Made docs/images/watch.png.

    python examples/watch_screenshot.py runs/python_grpo docs/images/watch.png
"""

from __future__ import annotations

import argparse
import os

from rich.console import Console

from hybridrl.metrics.watch import render

MONOSPACE = "DejaVu Sans Mono"
"""rich's SVG asks for Fira Code, which a headless machine rarely has; its fallback there is a proportional font."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("png")
    parser.add_argument("--columns", type=int, default=132)
    args = parser.parse_args()
    import cairosvg

    console = Console(record=True, width=args.columns, force_terminal=True, file=open(os.devnull, "w"))
    console.print(render(args.run_dir))
    svg = console.export_svg(title=f"hybridrl watch {args.run_dir} --once")
    svg = svg.replace("font-family: Fira Code, monospace;", f"font-family: {MONOSPACE}, monospace;")
    cairosvg.svg2png(bytestring=svg.encode(), write_to=args.png, output_width=args.columns * 13)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
