"""Redraws the pictures in docs/dashboards.md: every row of both dashboards as Grafana 12.4's code draws them.

    .venv/bin/python -m devtools.render_docs [--warm-up 240] [--range 5m]

Runs the demo exporter and a Prometheus (devtools/demo_prometheus.py) for --warm-up seconds, draws both
dashboards with `make dashboards-render` (the fleet at All, the target dashboard on the first target),
copies each row's PNG to docs/img/dashboards/<dashboard>/ and rewrites the section of docs/dashboards.md
between its markers: each row's picture, then one line per panel, the first sentence of its description.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from devtools import harness
from devtools.demo_prometheus import demo_stack, render

DOC = harness.REPO / "docs" / "dashboards.md"
IMAGES = harness.REPO / "docs" / "img" / "dashboards"
GENERATED = harness.REPO / "dashboards" / "generated"
START = "<!-- rendered rows: python -m devtools.render_docs writes this section -->"
END = "<!-- end of rendered rows -->"
# A sentence ends at . ! or ? followed by a capital (or the end), so "i.e. the" does not end one.
FIRST_SENTENCE = re.compile(r"(.+?[.!?])(?=\s+[A-Z(]|\s*$)", re.S)


def first_sentence(description: str) -> str:
    paragraph = description.split("\n\n")[0].strip()
    match = FIRST_SENTENCE.match(paragraph)
    return " ".join((match.group(1) if match else paragraph).split())


def section(rendered: dict[str, dict], range_text: str, warm_up: float) -> str:
    """The markdown between the markers, from each dashboard's JSON and what the renderer drew."""
    lines = [START, "",
             f"Drawn by `.venv/bin/python -m devtools.render_docs` from {warm_up / 60:g} minutes of "
             "`kvcache-exporter --demo` "
             f"(time range {range_text}, variables at All, the target dashboard on "
             f"`{rendered['kvcache-target']['variables'].get('target', '')}`), with Grafana 12.4's own panel code "
             "(`make dashboards-render`; state timelines and heatmaps are the renderer's own drawing of Grafana's "
             "colours). The panels' queries, units, bands and value mappings are those of the JSON in "
             "`dashboards/generated/`."]
    for path in sorted(GENERATED.glob("*.json")):
        dashboard = json.loads(path.read_text())
        displayed = rendered[dashboard["uid"]]
        panels = {panel["id"]: panel for top in dashboard["panels"]
                  for panel in [top, *top.get("panels", [])] if panel["type"] != "row"}
        lines += ["", f"### {dashboard['title']}"]
        for row in displayed["rows"]:
            image = f"img/dashboards/{dashboard['uid']}/{row['png']}"
            lines += ["", f"#### {row['title']}", "", f"![{row['title']} row of {dashboard['title']}]({image})", ""]
            lines += [f"- **{panels[pid]['title']}**: {first_sentence(panels[pid].get('description', ''))}"
                      for pid in row["panels"]]
    return "\n".join([*lines, "", END])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.render_docs", description=__doc__.splitlines()[0])
    parser.add_argument("--warm-up", type=float, default=240, help="seconds of demo data before drawing (%(default)s)")
    parser.add_argument("--range", default="5m", help="time range drawn (%(default)s)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvcache-render-docs-") as scratch:
        work = Path(scratch)
        with demo_stack(work / "demo", port=harness.free_port()) as url:
            print(f"demo and Prometheus {url} up; drawing in {args.warm_up:g} s", flush=True)
            time.sleep(args.warm_up)
            status = render(url, work / "out", args.range)
        if status != 0:
            print(f"make dashboards-render exited {status}: docs left as they were", file=sys.stderr)
            return status
        rendered = {}
        for out in sorted((work / "out").iterdir()):
            rendered[out.name] = json.loads((out / "displayed.json").read_text())
            target = IMAGES / out.name
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
            for png in sorted(out.glob("row-*.png")):
                shutil.copy(png, target / png.name)
    text = DOC.read_text()
    if START not in text or END not in text:
        print(f"{DOC}: the markers {START!r} and {END!r} are missing", file=sys.stderr)
        return 2
    DOC.write_text(text[:text.index(START)] + section(rendered, args.range, args.warm_up) + text[text.index(END) + len(END):])
    print(f"wrote {IMAGES} and the rendered rows of {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
