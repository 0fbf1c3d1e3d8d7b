"""``cellcache serve`` at its edges, before any model loads: --help, bad usage, a directory
that is not there, a port already taken, a missing ``serve`` extra. Each failure is one line
on stderr and exit code 2, and nothing is served. And one option that only a loaded model
shows: ``--native`` reaches the Generator the engine serves."""

from __future__ import annotations

import importlib.util
import socket

import pytest

from cellcache.__main__ import main


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    """``cellcache ARGV`` in this process: (exit code, stdout, stderr)."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_the_options(capsys):
    code, out, _ = run(["serve", "--help"], capsys)
    assert code == 0
    for flag in ("--host", "--port", "--served-model-name", "--max-waiting", "--dtype", "--device",
                 "--capacity", "--max-seqs", "--max-batch-tokens", "--prefill-chunk", "--no-prefix-cache",
                 "--graphs", "--compile", "--attention", "--async-steps", "--tp", "--log-level",
                 "--shutdown-timeout", "--default-max-tokens", "--enable-sleep", "--spill-gib",
                 "--spill-prefixes", "--kv-dtype", "--native"):
        assert flag in out, flag
    code, out, _ = run(["--help"], capsys)
    assert code == 0 and "serve" in out


@pytest.mark.parametrize("argv,says", [
    (["serve"], "MODEL_DIR"),
    (["serve", "DIR", "--port", "70000"], "--port"),
    (["serve", "DIR", "--port", "x"], "--port"),
    (["serve", "DIR", "--max-waiting", "-1"], "--max-waiting"),
    (["serve", "DIR", "--max-waiting", "0"], "--max-waiting"),         # every request refused
    (["serve", "DIR", "--dtype", "int8"], "--dtype"),
    (["serve", "DIR", "--capacity", "128", "--max-batch-tokens", "256"], "--max-batch-tokens"),
    (["serve", "DIR", "--shutdown-timeout", "nan"], "--shutdown-timeout"),
    (["serve", "DIR", "--bogus"], "--bogus"),
    (["serve", "DIR", "--enable-sleep", "--tp", "2"], "--enable-sleep"),
    (["serve", "DIR", "--spill-gib", "-1"], "--spill-gib"),
    (["serve", "DIR", "--spill-gib", "1e-12"], "--spill-gib"),          # 0 bytes: off, silently
    (["serve", "DIR", "--spill-prefixes"], "give --spill-gib"),
    (["serve", "DIR", "--spill-gib", "1", "--spill-prefixes", "--no-prefix-cache"],
     "leave the prefix cache on"),
    (["serve", "DIR", "--spill-gib", "1", "--tp", "2"], "does not serve under --tp"),
    (["serve", "DIR", "--native", "--tp", "2"], "--native does not serve under --tp"),
])
def test_bad_usage_is_one_line_and_exit_2(argv, says, capsys):
    code, out, err = run(argv, capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and says in err, err
    assert err.startswith("cellcache serve: error:")


def test_a_missing_directory_is_one_line(tmp_path, capsys):
    code, out, err = run(["serve", str(tmp_path / "nope")], capsys)
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        f"cellcache serve: error: MODEL_DIR {tmp_path / 'nope'}: not a directory (nothing is "
        "downloaded: give a local checkpoint) (see --help)"]


def test_cuda_without_a_device_is_one_line(tmp_path, capsys):
    import torch

    code, out, err = run(["serve", str(tmp_path), "--device", "cuda"], capsys)
    if torch.cuda.is_available():                 # (a GPU machine: the empty directory fails)
        assert code == 2 and "cannot serve" in err
        return
    assert code == 2 and out == ""
    assert err.strip().splitlines() == ["cellcache serve: error: --device cuda: torch sees no CUDA device "
                                        "(torch.cuda.is_available() is False) (see --help)"]


def test_an_unloadable_directory_is_one_line(tmp_path, capsys):
    code, out, err = run(["serve", str(tmp_path), "--device", "cpu", "--port", "0"], capsys)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"cellcache serve: error: cannot serve {tmp_path}"), err


def test_a_port_in_use_is_one_line(tmp_path, capsys):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        code, out, err = run(["serve", str(tmp_path), "--port", str(port), "--device", "cpu"], capsys)
    finally:
        taken.close()
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[0], err


def test_without_the_serve_extra_it_names_the_extra(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "fastapi" else real(name, *a))
    code, out, err = run(["serve", str(tmp_path)], capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "pip install 'cellcache[serve]'" in err and "fastapi" in err


@pytest.mark.parametrize("family,host", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")])
def test_the_banner_url_is_one_a_client_can_use(family, host):
    from cellcache.serve.cli import _url

    if family == socket.AF_INET6 and not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    try:
        sock = socket.socket(family)
        sock.bind((host, 0))
    except OSError:
        pytest.skip(f"cannot bind {host} here")
    with sock:
        port = sock.getsockname()[1]
        assert _url(sock) == (f"http://[{host}]:{port}" if family == socket.AF_INET6 else f"http://{host}:{port}")


def test_sigusr1_prints_every_threads_stack_and_the_process_goes_on(capsys):
    import subprocess
    import sys

    from cellcache._cli import stacks_on_sigusr1

    assert stacks_on_sigusr1() is False                   # capsys's stderr: no descriptor
    code = ("import os, signal, threading\n"
            "from cellcache._cli import stacks_on_sigusr1\n"
            "assert stacks_on_sigusr1()\n"
            "threading.Thread(target=threading.Event().wait, name='idle', daemon=True).start()\n"
            "os.kill(os.getpid(), signal.SIGUSR1)\n"
            "print('still here')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "still here"
    assert "Current thread" in done.stderr and done.stderr.count("Thread 0x") >= 1


def test_native_reaches_the_generator_the_server_loads(tmp_path):
    """``--native``: the engine's Generator runs the native forward (and without it, the
    model's modules)."""
    pytest.importorskip("transformers")
    from cellcache.native import NativeLM
    from cellcache.serve.cli import build_parser, load_generator
    from tests.helpers_text import save_model_and_tokenizer

    model_dir = save_model_and_tokenizer(tmp_path / "tiny", "bytelevel")
    base = [str(model_dir), "--device", "cpu", "--dtype", "float32", "--capacity", "1024"]
    native = load_generator(build_parser().parse_args([*base, "--native"]), "cpu")
    plain = load_generator(build_parser().parse_args(base), "cpu")
    assert isinstance(native.runner.model, NativeLM) and not isinstance(plain.runner.model, NativeLM)
