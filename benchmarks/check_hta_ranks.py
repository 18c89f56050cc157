"""HolisticTraceAnalysis reads a folder of ppetrace rank files as ranks {0, 1}.

HolisticTraceAnalysis needs jupyterlab, plotly, networkx and pydot (about 500 MB
installed), too heavy for the ``test`` extra, so this is a scripted check instead of a
test. Install it in a venv of its own (``pip install -e '.[hta]'``, or
``HolisticTraceAnalysis`` in any venv) and run::

    python benchmarks/check_hta.py [--hta-python PATH] [--folder RANKS_FOLDER]

Without ``--folder`` it first runs ``torchrun --standalone --nproc_per_node 2
examples/quickstart.py`` (gloo, CPU, loopback) into a temporary folder and checks its
``trace.ranks/``. ``--hta-python`` is the interpreter that has HolisticTraceAnalysis
(default: this one). Exit code 0 when HTA finds exactly the ranks of the files' own
``distributedInfo`` and a non-empty trace for each, else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_PROBE = """
import json, sys, logging
logging.disable(logging.WARNING)
from hta.trace_analysis import TraceAnalysis
analysis = TraceAnalysis(trace_dir=sys.argv[1])
ranks = sorted(analysis.t.traces)
print(json.dumps({"ranks": ranks, "events": {r: len(analysis.t.get_trace(r)) for r in ranks}}))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hta-python", default=sys.executable)
    parser.add_argument("--folder", default=None, help="a folder of rank files to check")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.folder) if args.folder else Path(tmp) / "trace.ranks"
        if args.folder is None:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
            subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc_per_node", "2", str(ROOT / "examples" / "quickstart.py"),
                 "--epochs", "1", "--samples", "512", "--trace", str(Path(tmp) / "trace.json")],
                env=env, check=True, stdout=subprocess.DEVNULL,
            )  # fmt: skip
        expected = sorted(
            json.loads(p.read_text())["distributedInfo"]["rank"] for p in folder.glob("*.json")
        )
        probe = subprocess.run(
            [args.hta_python, "-c", _PROBE, str(folder)], capture_output=True, text=True
        )
        if probe.returncode != 0:
            print(f"HolisticTraceAnalysis failed on {folder}:\n{probe.stderr[-3000:]}")
            return 1
        found = json.loads(probe.stdout.strip().splitlines()[-1])
    ok = found["ranks"] == expected and all(n > 0 for n in found["events"].values())
    print(
        f"HolisticTraceAnalysis read ranks {found['ranks']} (files: {expected}), events per "
        f"rank {found['events']}: {'PASS' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
