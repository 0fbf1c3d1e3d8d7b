"""What the command lines share (cellcache._cli), seen through the tools: a Ctrl-C is one
line and exit code 130, a reader of stdout that went away (``| head``) a quiet exit code 141."""

from __future__ import annotations

from cellcache._cli import INTERRUPTED_EXIT, PIPE_CLOSED_EXIT, run_main


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


def test_tools_exit_through_run_main():
    """Each tool's ``__main__`` goes through run_main (Ctrl-C and ``| head`` without a
    traceback); not build_ptx, which runs before the package is built (no cellcache to import)."""
    from .helpers import TOOLS

    for path in sorted(TOOLS.glob("*.py")):
        text = path.read_text()
        if 'if __name__ == "__main__":' not in text or path.stem in ("build_ptx", "profile_serve"):
            continue
        assert f'sys.exit(run_main("{path.stem}", main))' in text, path.name
