"""``ppetrace run``: a script or module as __main__, traced; its exit code; the trace on every
way out (an exception, sys.exit, Ctrl-C, SIGTERM); bad input in one line."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from import_probe import loaded_after

from exporters import read_chrome_trace
from ppetrace.cli import main
from ppetrace.integrations._ranks import rank_info, rank_trace_path
from ppetrace.integrations._run import RunOptions, default_trace_path, run

LOOP = """
import json, sys
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,))), batch_size=4)
for x, y in data:
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
with open({out!r}, "w") as f:
    json.dump({{"argv": sys.argv, "name": __name__, "path0": sys.path[0]}}, f)
"""


def _script(folder: Path, body: str, name: str = "train.py") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(body))
    return path


def _run(*argv: str) -> tuple[int, str]:
    err = io.StringIO()
    code = main(["run", *argv], stdout=io.StringIO(), stderr=err)
    return code, err.getvalue()


def test_a_plain_loop_runs_as_main_with_its_argv_and_gets_a_trace_and_a_report(
    tmp_path: Path,
) -> None:
    out = tmp_path / "seen.json"
    script = _script(tmp_path, LOOP.format(out=str(out)))
    trace = tmp_path / "traces" / "t.json"
    script_args = ["--lr", "0.1", "-m", "x", "--", "--trace", "y"]  # all the script's
    code, err = _run("--trace", str(trace), str(script), *script_args)
    assert code == 0, err
    seen = json.loads(out.read_text())
    assert seen == {
        "argv": [str(script), *script_args],
        "name": "__main__",
        "path0": str(tmp_path),
    }
    frame = read_chrome_trace(trace)
    assert frame["name"].value_counts()["trainer.step"] == 4
    assert f"ppetrace: wrote {trace}" in err
    assert "ppetrace step report" in err and "trainer.optimizer_step" in err
    assert f"Device: cpu, torch threads: {torch.get_num_threads()}" in err  # the environment
    # a -- before the script ends ppetrace's options and is not the script's
    code, err = _run("--no-report", "--trace", str(trace), "--", str(script), "c")
    assert code == 0 and "step report" not in err
    assert json.loads(out.read_text())["argv"] == [str(script), "c"]


def test_a_module_runs_with_dash_m_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "seen.json"
    pkg = tmp_path / "runpkg_dash_m"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    _script(pkg, LOOP.format(out=str(out)), "train.py")
    monkeypatch.chdir(tmp_path)
    trace = tmp_path / "m.json"
    script_args = ["--epochs", "1", "-m", "a", "--", "--trace", "b"]  # all the module's
    code, err = _run(
        "--trace", str(trace), "--module-depth", "0", "-m", "runpkg_dash_m.train", *script_args
    )
    assert code == 0, err
    seen = json.loads(out.read_text())
    assert seen["argv"] == [str(pkg / "train.py"), *script_args] and seen["name"] == "__main__"
    counts = read_chrome_trace(trace)["name"].value_counts()
    assert counts["trainer.step"] == 4 and "module.forward" not in counts


def test_a_script_that_raises_exits_1_with_its_traceback_and_the_trace_written(
    tmp_path: Path,
) -> None:
    script = _script(
        tmp_path, LOOP.format(out=str(tmp_path / "o.json")) + "\nraise ValueError('boom')\n"
    )
    trace = tmp_path / "t.json"
    code, err = _run("--trace", str(trace), str(script))
    assert code == 1
    assert "ValueError: boom" in err and f'File "{script}"' in err
    assert "runpy" not in err  # the traceback is the script's, as python prints it
    assert read_chrome_trace(trace)["name"].value_counts()["trainer.step"] == 4
    # raised inside a step (after its forward): that step is in the trace, with ERROR
    inside = LOOP.replace("for x, y in data:", "for i, (x, y) in enumerate(data):").replace(
        "    nn.functional.cross_entropy(model(x), y).backward()",
        "    loss = nn.functional.cross_entropy(model(x), y)\n"
        "    if i == 1:\n"
        "        raise ValueError('boom')\n"
        "    loss.backward()",
    )
    script = _script(tmp_path, inside.format(out=str(tmp_path / "o.json")), "inside.py")
    code, err = _run("--trace", str(tmp_path / "in.json"), str(script))
    assert code == 1 and "ValueError: boom" in err
    frame = read_chrome_trace(tmp_path / "in.json")
    steps = frame[frame["name"] == "trainer.step"].sort_values("start_ns")
    assert list(steps["status"]) == ["UNSET", "ERROR"]
    assert steps["error"].iloc[1].startswith("ValueError: boom")


def test_sys_exit_3_gives_exit_3_with_the_trace_written(tmp_path: Path) -> None:
    body = LOOP.format(out=str(tmp_path / "o.json")) + "\nsys.exit(3)\n"
    trace = tmp_path / "t.json"
    assert _run("--no-report", "--trace", str(trace), str(_script(tmp_path, body)))[0] == 3
    assert len(read_chrome_trace(trace)) > 0
    message = _script(tmp_path, "import sys\nsys.exit('stopped here')\n", "msg.py")
    code, err = _run("--trace", str(tmp_path / "m.json"), str(message))
    assert code == 1 and "stopped here" in err
    assert "no spans were recorded" in err and (tmp_path / "m.json").exists()


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = _script(tmp_path, "print('never runs')\n")
    blocker = tmp_path / "a_file"  # the trace's folder would have to be made inside a file
    blocker.write_text("")
    cases = [
        (["no_such_script.py"], "Expected a Python script at no_such_script.py, but no such"),
        (["no_such_script.py"], "file exists. Check the path; a relative one starts at"),
        ([str(tmp_path)], "folder without __main__.py. Name the script inside it, or add"),
        (["-m", "no_such_module_xyz"], "no module named 'no_such_module_xyz' was found"),
        (["-m", "no_such_pkg_xyz.train"], "no module named 'no_such_pkg_xyz.train' was found"),
        (["-m", "json.no_such_xyz"], "no module named 'json.no_such_xyz' was found. Check"),
        (
            ["--trace", str(tmp_path), str(script)],
            f"Expected a file path for --trace, but {tmp_path} is a folder. Pass a file path "
            f"such as {tmp_path / 'trace.json'}.",
        ),
        (["-m", "json"], "'json' is a package without one"),
        ([], "Expected a script to run"),
        ([], "but received neither. Name the script, or -m and a module, after the options."),
        (["--schedule", "1,2", "--profile", "torch", "x.py"], "four integers wait,warmup"),
        (
            ["--schedule", "1,1,0,1", "--profile", "torch", "x.py"],
            "Expected a valid --schedule wait,warmup,active,repeat, but '1,1,0,1' is not: "
            "Expected a positive int for active (recorded steps in each window), but received "
            "0. Give wait, warmup and repeat >= 0 and active >= 1, e.g. 1,1,3,1.",
        ),
        (
            ["--trace", str(blocker / "t.json"), str(script)],
            "Expected a folder for the trace that can be created, but making",
        ),
        (["--trace", str(blocker / "t.json"), str(script)], "in a folder you can write to."),
        (["--schedule", "0,1,3,1", "x.py"], "--profile pyinstrument or --profile torch with"),
        (["--module-depth", "-1", "x.py"], "non-negative integer for --module-depth"),
        (["--profile", "perf", "x.py"], "invalid choice: 'perf'"),
    ]
    for argv, message in cases:
        code, err = _run(*argv)
        assert code == 2, argv
        assert err.count("\n") == 1 and message in err, (argv, err)
    monkeypatch.setenv("RANK", "one")
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, err = _run(str(script))
    assert code == 2 and "RANK='one', WORLD_SIZE='2'. Start the script with torchrun, or" in err
    monkeypatch.delenv("RANK")
    broken = tmp_path / "broken_pkg_xyz"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise RuntimeError('cannot import me')\n")
    monkeypatch.chdir(tmp_path)
    code, err = _run("-m", "broken_pkg_xyz.train")
    assert (
        code == 2 and "importing 'broken_pkg_xyz.train' failed: RuntimeError: cannot import" in err
    )
    assert "cannot import me. Fix the error that importing it raises." in err
    # a module that is there but imports a missing one: that import is the error
    (broken / "__init__.py").write_text("import no_such_dependency_xyz\n")
    code, err = _run("-m", "broken_pkg_xyz.train")
    assert code == 2 and "failed: ModuleNotFoundError: No module named 'no_such_dependency" in err


def test_the_default_trace_name_and_the_per_rank_layout(tmp_path: Path) -> None:
    import datetime as dt

    when = dt.datetime(2026, 1, 2, 3, 4, 5)
    assert default_trace_path("/x/train.py", None, when) == Path(
        "ppetrace-train-20260102-030405.json"
    )
    assert default_trace_path("pkg.mod", None, when).name == "ppetrace-mod-20260102-030405.json"
    assert rank_trace_path("out/trace.json", 3) == Path("out/trace.ranks/rank3.json")
    assert rank_trace_path("t.json.gz", 0) == Path("t.ranks/rank0.json")
    assert rank_info({"RANK": "1", "WORLD_SIZE": "2"}).rank == 1  # type: ignore[union-attr]
    assert rank_info({"RANK": "1"}) is None
    assert rank_info({"RANK": "0", "WORLD_SIZE": "1"}) is None  # alone: not distributed
    with pytest.raises(ValueError, match="RANK and WORLD_SIZE to be non-negative integers"):
        rank_info({"RANK": "one", "WORLD_SIZE": "2"})
    with pytest.raises(
        ValueError,
        match=r"Expected a non-negative int for rank, but received -1\. Pass this process's rank",
    ):
        rank_trace_path("t.json", -1)


def test_under_torchrun_each_rank_writes_its_file_and_only_rank_0_reports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = _script(tmp_path, LOOP.format(out=str(tmp_path / "o.json")))
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in (1, 0):
        monkeypatch.setenv("RANK", str(rank))
        code, err = _run("--trace", str(tmp_path / "trace.json"), str(script))
        assert code == 0
        written = tmp_path / "trace.ranks" / f"rank{rank}.json"
        assert read_chrome_trace(written)["name"].value_counts()["trainer.step"] == 4
        assert ("step report" in err) == (rank == 0)
    assert not (tmp_path / "trace.json").exists()  # merging the ranks is not run's job
    # torchrun --nproc-per-node 1: one process, its trace where asked (no rank folder)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    code, err = _run("--trace", str(tmp_path / "alone.json"), str(script))
    assert code == 0 and "step report" in err
    assert read_chrome_trace(tmp_path / "alone.json")["name"].value_counts()["trainer.step"] == 4
    assert not (tmp_path / "alone.ranks").exists()


def test_profilers_on_a_schedule_write_their_windows(tmp_path: Path) -> None:
    # each step spends some milliseconds in Python, so the 1 ms sampler catches the
    # window however fast the machine is (the plain LOOP's two steps can take under 1 ms)
    body = LOOP.format(out=str(tmp_path / "o.json")).replace(
        "    opt.step()\n",
        "    opt.step()\n    busy_python_work = sum(i * i for i in range(200_000))\n",
    )
    assert "busy_python_work" in body
    script = _script(tmp_path, body)
    trace = tmp_path / "p.json"
    code, err = _run(
        "--trace", str(trace), "--profile", "pyinstrument", "--schedule", "0,1,2,1", str(script)
    )
    assert code == 0, err
    pages = sorted(p.name for p in (tmp_path / "p_profiles").iterdir())
    assert "pyinstrument_steps1-2.html" in pages
    assert "top_functions" in err  # the report shows the sampled functions
    assert "<genexpr>" in err  # among them the busy generator of each step


# -- signals: in process (the run reports the signal), and once from outside --------------

SIGNALLED = """
import os, signal, torch
from torch import nn
model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.ones(1, 4)).sum().backward(); opt.step()
{end}
"""


@pytest.mark.parametrize(
    ("end", "sig"),
    [
        ("os.kill(os.getpid(), signal.SIGTERM)", signal.SIGTERM),
        ("raise KeyboardInterrupt", signal.SIGINT),
    ],
    ids=["SIGTERM", "Ctrl-C"],
)
def test_a_signal_or_ctrl_c_writes_the_trace_and_is_reported(
    tmp_path: Path, end: str, sig: signal.Signals
) -> None:
    script = _script(tmp_path, SIGNALLED.format(end=end))
    trace = tmp_path / "sig.json"
    err = io.StringIO()
    before = signal.getsignal(signal.SIGTERM)
    result = run(RunOptions(script=str(script), trace=str(trace), report=False), err=err)
    assert (result.code, result.signal) == (128 + sig, sig)
    assert signal.getsignal(signal.SIGTERM) is before  # ppetrace's handler is gone again
    assert read_chrome_trace(trace)["name"].value_counts()["trainer.step"] == 3


WAIT = """
import time, torch
from torch import nn
model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.ones(1, 4)).sum().backward(); opt.step()
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


def test_sigterm_from_outside_writes_the_trace_and_ends_the_process_by_it(
    tmp_path: Path,
) -> None:
    script = _script(tmp_path, WAIT)
    trace = tmp_path / "sig.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ppetrace",
            "run",
            "--no-report",
            "--trace",
            str(trace),
            str(script),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM, err
    assert read_chrome_trace(trace)["name"].value_counts()["trainer.step"] == 3
    assert f"ppetrace: wrote {trace}" in err


def test_a_script_that_changes_directory_and_threads_gets_its_trace_and_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Relative paths are taken before the script runs; the environment is taken again
    when the trace's header is written, after the script set its threads."""
    (tmp_path / "sub").mkdir()
    body = "import os, torch\nos.chdir('sub')\ntorch.set_num_threads(1)\n" + LOOP.format(
        out="seen.json"
    )
    script = _script(tmp_path, body)
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # what instrument() sees when it starts
    try:
        code, err = _run("--trace", "rel.json", str(script))
    finally:
        torch.set_num_threads(threads)
    assert code == 0, err
    assert (tmp_path / "rel.json").is_file() and not (tmp_path / "sub" / "rel.json").exists()
    assert "ppetrace step report" in err and "torch threads: 1" in err
    frame = read_chrome_trace(tmp_path / "rel.json")
    assert frame.attrs["metadata"]["environment"]["torch_threads"] == 1


def test_runs_that_start_in_the_same_second_get_their_own_default_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ppetrace.integrations._run import reserve_trace_path

    monkeypatch.chdir(tmp_path)
    name = default_trace_path("train.py", None)
    first, second = reserve_trace_path(name), reserve_trace_path(name)
    assert first == name and second != first and first.exists() and second.exists()
    assert second.name.startswith(name.name[: -len(".json")]) and second.suffix == ".json"


def test_the_run_command_loads_no_pandas_or_scipy_before_the_script() -> None:
    """What `ppetrace run` imports before the script starts (its start-up budget, issue
    14): the instrumentation, without pandas or SciPy (a constant once pulled in pandas,
    and the start-up grew by about 0.3 s)."""
    imports = "ppetrace.cli, ppetrace.integrations._run, ppetrace.integrations._instrument"
    assert loaded_after(imports, ("pandas", "scipy")) == []
