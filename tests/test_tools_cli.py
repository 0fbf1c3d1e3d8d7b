"""What the command lines share (cellcache._cli), seen through the tools: a Ctrl-C is one
line and exit code 130, a reader of stdout that went away (``| head``) a quiet exit code 141,
and a file to write at the end of a run (``--json``) is checked before the run starts."""

from __future__ import annotations

import argparse
import os

import pytest

from cellcache._cli import INTERRUPTED_EXIT, PIPE_CLOSED_EXIT, Parser, output_file, run_main

from .helpers import load_tool


def test_ctrl_c_is_one_line_and_exit_130(capsys):
    def main() -> int:
        raise KeyboardInterrupt

    assert run_main("bench", main) == INTERRUPTED_EXIT == 130
    assert capsys.readouterr() == ("", "bench: interrupted\n")


def test_a_closed_stdout_is_a_quiet_exit_141(capsys):
    def main() -> int:
        raise BrokenPipeError(32, "Broken pipe")

    assert run_main("bench", main) == PIPE_CLOSED_EXIT == 141
    assert capsys.readouterr() == ("", "")


def test_the_exit_code_of_main_is_kept():
    assert run_main("bench", lambda: 3) == 3


def parse_json(*argv: str) -> argparse.Namespace:
    p = Parser(prog="bench")
    p.add_argument("--json", type=output_file)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("where, says", [
    ("", "an empty path"),
    ("{tmp}", "is a directory"),
    ("{tmp}/a-file/result.json", "a-file is not a directory"),
    ("/proc/cellcache-result.json", "cannot create a file in /proc"),
    ("/proc/no-such-folder/result.json", "cannot create a file in /proc"),
])
def test_a_json_that_cannot_be_written_is_refused_before_the_run(tmp_path, capsys, where, says):
    (tmp_path / "a-file").write_text("")
    if where.startswith("/proc") and not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    with pytest.raises(SystemExit) as e:
        parse_json("--json", where.format(tmp=tmp_path))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and says in err[0], err
    assert err[0].startswith("bench: error: argument --json:")


def test_a_json_in_folders_still_missing_is_taken_and_nothing_is_made(tmp_path):
    path = tmp_path / "new" / "folders" / "result.json"
    assert parse_json("--json", str(path)).json == path
    assert not (tmp_path / "new").exists()                       # made when it is written
    (tmp_path / "old.json").write_text("{}")
    assert parse_json("--json", str(tmp_path / "old.json")).json == tmp_path / "old.json"


@pytest.mark.parametrize("tool, argv", [
    ("mutate", ["--only", "clone-one-short", "--json", "/proc/mutate.json"]),
    ("profile_serve", ["--steps", "3", "--json", "{tmp}"]),
    ("bench_sampler", ["--device", "cpu", "--json", "{tmp}"]),
])
def test_tools_refuse_a_json_they_could_not_write_before_they_run(tmp_path, capsys, tool, argv):
    if "/proc/mutate.json" in argv and not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    mod = load_tool(tool)
    with pytest.raises(SystemExit) as e:
        mod.main([a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith(f"{tool}: error: argument --json:"), err


@pytest.mark.parametrize("argv, says", [
    (["--rows", "0"], "argument --rows: 0 is outside [1, 4096]"),
    (["--steps", "nan"], "argument --steps: 'nan' is not an int"),
    (["--prompt-len", str(10**30)], "argument --prompt-len"),
    (["--cprofile", "-1"], "argument --cprofile: -1 is outside"),
    (["--model", "nope"], "--model 'nope': one of"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_profile_serve_usage_errors_are_one_line_and_exit_2(capsys, argv, says):
    mod = load_tool("profile_serve")
    with pytest.raises(SystemExit) as e:
        mod.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and says in err[0], err
    assert err[0].startswith("profile_serve: error:")


def test_profile_serve_turns_a_cache_too_large_into_one_line(monkeypatch, capsys):
    from cellcache.errors import OutOfMemory

    mod = load_tool("profile_serve")

    def too_large(*args, **kwargs):
        raise OutOfMemory("could not allocate 230457876480 bytes for the cell table's owner bitsets")

    monkeypatch.setattr(mod, "profile", too_large)
    assert mod.main(["--rows", "4096", "--steps", "100000", "--prompt-len", "8192"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("profile_serve: error: OutOfMemory:")
    assert "lower --rows, --steps or --prompt-len" in err


def test_tools_exit_through_run_main():
    """Each tool's ``__main__`` goes through run_main (Ctrl-C and ``| head`` without a
    traceback); not build_ptx, which runs before the package is built (no cellcache to import)."""
    from .helpers import TOOLS

    for path in sorted(TOOLS.glob("*.py")):
        text = path.read_text()
        if 'if __name__ == "__main__":' not in text or path.stem in ("build_ptx",):
            continue
        assert f'sys.exit(run_main("{path.stem}", main))' in text, path.name


@pytest.mark.parametrize("argv, says", [
    (["--nvrtc", "{tmp}"], "--nvrtc {tmp}: cannot load it"),
    (["--nvrtc", "{tmp}/libnvrtc.so.12"], "--nvrtc {tmp}/libnvrtc.so.12: cannot load it"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_build_ptx_usage_errors_are_one_line_and_exit_2(tmp_path, capsys, argv, says):
    """build_ptx keeps a parser of its own (no cellcache to import where it runs); an --nvrtc
    that is not a library was an OSError traceback from ctypes."""
    mod = load_tool("build_ptx")
    with pytest.raises(SystemExit) as e:
        mod.main([a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and says.format(tmp=tmp_path) in err[0], err
    assert err[0].startswith("build_ptx: error:")


@pytest.mark.parametrize("section", ["gpu", "growth", "attention", "all-gpu"])
def test_bench_gpu_sections_without_a_gpu_say_so_and_exit_3(capsys, section):
    """They imported the CUDA backend regardless: a DynamicLibNotFoundError traceback, exit 1."""
    mod = load_tool("bench")
    assert mod.main(["--section", section], probe=lambda: (False, "no CUDA driver")) == 3
    out, err = capsys.readouterr()
    assert out == "bench: no CUDA driver; this tool needs a GPU (exit 3)\n" and err == ""
