"""``cellcache generate`` at its edges: a checkpoint it cannot use, memory that runs out,
torchrun's parser, Ctrl-C, a missing ``hf`` extra. Each failure is one line and an exit code,
and nothing else happens: no model loaded past a bad config, nothing on stdout, no other
line on stderr."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cellcache.generate import cli

ROOT = Path(__file__).resolve().parents[1]


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    """``cli.main(argv)`` in this process: (exit code, stdout, stderr)."""
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


# -- a checkpoint the command cannot use ------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """llama-tiny saved as a Hugging Face checkpoint (config.json, model.safetensors)."""
    path = tmp_path_factory.mktemp("ckpt") / "llama-tiny"
    cli.random_model("llama-tiny").save_pretrained(path)
    return path


def copy_with_config(checkpoint: Path, dest: Path, config: object) -> Path:
    """A copy of ``checkpoint`` whose config.json is ``config`` (a dict, or raw text)."""
    shutil.copytree(checkpoint, dest)
    text = config if isinstance(config, str) else json.dumps(config)
    (dest / "config.json").write_text(text)
    return dest


@pytest.fixture
def no_loading(monkeypatch):
    """Records every call of transformers' model loader (and loads nothing)."""
    import transformers

    calls: list = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: calls.append((a, k)) or pytest.fail("the model was loaded"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return calls


BAD_CONFIGS = [
    ({"num_attention_heads": 0}, "config.json has num_attention_heads=0; it must be an int >= 1"),
    ({"hidden_size": "big"}, "config.json has hidden_size='big'; it must be an int >= 1"),
    ({"num_attention_heads": 0, "head_dim": None}, "config.json has num_attention_heads=0; it must be "
                                                   "an int >= 1"),
    ({"num_hidden_layers": -1}, "config.json has num_hidden_layers=-1; it must be an int >= 1"),
    ({"intermediate_size": 12.5}, "config.json has intermediate_size=12.5; it must be an int >= 1"),
    ({"vocab_size": True}, "config.json has vocab_size=True; it must be an int >= 1"),
    ({"num_key_value_heads": 3}, "config.json has num_attention_heads=4, not a multiple of "
                                 "num_key_value_heads=3"),
    ({"text_config": {"num_attention_heads": 0}}, "config.json has text_config.num_attention_heads=0; "
                                                  "it must be an int >= 1"),
]


@pytest.mark.parametrize("patch,problem", BAD_CONFIGS, ids=[str(p) for p, _ in BAD_CONFIGS])
def test_a_bad_config_value_is_one_line_and_exit_2(checkpoint, tmp_path, capsys, no_loading, patch, problem):
    config = {**json.loads((checkpoint / "config.json").read_text()), **patch}
    path = copy_with_config(checkpoint, tmp_path / "ckpt", config)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    code, out, err = run_main(["--model", str(path), "--device", "cpu", "1 2 3"], capsys)
    assert code == 2 and out == ""
    assert err == f"cellcache generate: error: cannot load the model {path}: {problem} (see --help)\n"
    assert no_loading == [] and {p.name: p.read_bytes() for p in path.iterdir()} == before


def test_a_config_that_is_not_json_is_one_line_and_exit_2(checkpoint, tmp_path, capsys, no_loading):
    path = copy_with_config(checkpoint, tmp_path / "ckpt", "{not json")
    code, out, err = run_main(["--model", str(path), "--device", "cpu", "1 2 3"], capsys)
    assert code == 2 and out == "" and no_loading == []
    assert err == (f"cellcache generate: error: cannot load the model {path}: config.json cannot be "
                   "read: Expecting property name enclosed in double quotes: line 1 column 2 (char 1) "
                   "(see --help)\n")


def test_the_checkpoint_itself_serves(checkpoint, capsys, monkeypatch):
    """The control of the refusals above: the unchanged checkpoint loads and serves what its
    weights as random_model gives."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out, err = run_main(["--model", str(checkpoint), "--device", "cpu", "--max-new-tokens", "4",
                               "--json", "--quiet", "1 2 3"], capsys)
    assert code == 0, err
    ref_code, ref_out, ref_err = run_main(["--random", "llama-tiny", "--device", "cpu", "--max-new-tokens",
                                           "4", "--json", "--quiet", "1 2 3"], capsys)
    assert ref_code == 0, ref_err
    got, want = json.loads(out), json.loads(ref_out)
    assert got["results"][0]["outputs"] == want["results"][0]["outputs"]
    assert got["summary"]["interrupted"] is False


@pytest.mark.parametrize("name,line", [
    ("/nonexistent/model", "--model /nonexistent/model: the directory does not exist (nothing is "
                           "downloaded: give a local checkpoint)"),
    ("Nobody/no-such-model", "--model Nobody/no-such-model: the directory does not exist (nothing is "
                             "downloaded: give a local checkpoint)"),
    ("FILE", "--model FILE is a file, not a checkpoint directory"),
])
def test_a_missing_model_directory_is_named(tmp_path, capsys, monkeypatch, no_loading, name, line):
    """Not a hub repo-id problem: the directory is not there (the command downloads nothing)."""
    monkeypatch.chdir(tmp_path)
    if name == "FILE":
        (tmp_path / "FILE").write_text("{}")
    code, out, err = run_main(["--model", name, "--device", "cpu", "1 2 3"], capsys)
    assert (code, out, err) == (2, "", f"cellcache generate: error: {line} (see --help)\n")
    assert no_loading == [] and sorted(p.name for p in tmp_path.iterdir()) == (["FILE"] if name == "FILE"
                                                                              else [])


# -- memory that runs out ---------------------------------------------------------------------

CUDA_OOM = ("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 139.72 GiB "
            "of which 3.12 GiB is free. Of the allocated memory 130.2 GiB is allocated by PyTorch. If "
            "reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF")
CPU_OOM = ("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: you "
           "tried to allocate 1073741824 bytes.")
LOAD_ADVICE = ("a device with more free memory (--tp does not help: every rank loads the whole model "
               "before sharding it)")


def raiser(exc: BaseException):
    def fail(*args, **kwargs):
        raise exc
    return fail


@pytest.mark.parametrize("exc,size", [(torch.OutOfMemoryError(CUDA_OOM), "20.00 GiB"),
                                      (RuntimeError(CPU_OOM), "1073741824 bytes"),
                                      (MemoryError(), "")], ids=["cuda", "cpu-allocator", "MemoryError"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_random_model_too_large_is_one_out_of_memory_line(monkeypatch, capsys, exc, size, dtype):
    monkeypatch.setattr(cli, "random_model", raiser(exc))
    built = []
    monkeypatch.setattr(cli, "Generator", lambda *a, **k: built.append(a) or pytest.fail("served"))
    code, out, err = run_main(["--random", "qwen2-7b", "--device", "cpu", "--dtype", dtype, "1 2 3"], capsys)
    half = "--dtype bfloat16 or float16 (half of float32's memory), or " if dtype == "float32" else ""
    failed = f" (an allocation of {size} failed)" if size else ""
    assert (code, out) == (2, "") and built == []
    assert err == (f"cellcache generate: error: OutOfMemory: loading qwen2-7b ({dtype}) on cpu ran out of "
                   f"memory{failed}; give {half}a smaller --random model, or {LOAD_ADVICE}\n")


def test_a_checkpoint_too_large_to_move_is_one_out_of_memory_line(checkpoint, monkeypatch, capsys):
    """The failure comes while the loaded model moves to its device (``.to()``)."""
    import transformers

    class Loaded:
        def to(self, place):
            raise RuntimeError(CPU_OOM)

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: Loaded())
    code, out, err = run_main(["--model", str(checkpoint), "--device", "cpu", "1 2 3"], capsys)
    assert (code, out) == (2, "")
    assert err == (f"cellcache generate: error: OutOfMemory: loading {checkpoint} (float32) on cpu ran "
                   "out of memory (an allocation of 1073741824 bytes failed); give --dtype bfloat16 or "
                   f"float16 (half of float32's memory), or a smaller model, or {LOAD_ADVICE}\n")


def test_a_cache_too_large_for_torch_is_one_out_of_memory_line(monkeypatch, capsys):
    monkeypatch.setattr(cli, "Generator", raiser(torch.OutOfMemoryError(CUDA_OOM)))
    code, out, err = run_main(["--random", "tiny", "--device", "cpu", "--capacity", "4096", "1 2 3"], capsys)
    assert (code, out) == (2, "")
    assert err == ("cellcache generate: error: OutOfMemory: building the cache and step buffers "
                   "(--capacity 4096, --max-batch-tokens 512) on cpu ran out of memory (an allocation of "
                   "20.00 GiB failed); give a smaller --capacity or --max-batch-tokens\n")


def test_a_step_too_large_is_one_out_of_memory_line(monkeypatch, capsys):
    monkeypatch.setattr(cli.Generator, "run", raiser(torch.OutOfMemoryError(CUDA_OOM)))
    code, out, err = run_main(["--random", "tiny", "--device", "cpu", "--max-batch-tokens", "256",
                               "1 2 3"], capsys)
    assert (code, out) == (2, "")
    assert err == ("cellcache generate: error: OutOfMemory: a step of at most --max-batch-tokens 256 on "
                   "cpu ran out of memory (an allocation of 20.00 GiB failed); give a smaller "
                   "--max-batch-tokens\n")


def test_a_checkpoint_that_does_not_load_is_one_line(checkpoint, monkeypatch, capsys):
    """Any other failure of transformers' loader (weights that do not match config.json, say)
    is the checkpoint's: one line, exit 2."""
    import transformers

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", raiser(RuntimeError(
        "You set `ignore_mismatched_sizes` to `False`, thus raising an error.")))
    code, out, err = run_main(["--model", str(checkpoint), "--device", "cpu", "1 2 3"], capsys)
    assert (code, out) == (2, "")
    assert err == (f"cellcache generate: error: cannot load the model {checkpoint}: You set "
                   "`ignore_mismatched_sizes` to `False`, thus raising an error. (see --help)\n")


@pytest.mark.parametrize("where", ["random_model", "Generator", "run"])
def test_any_other_runtime_error_is_not_called_out_of_memory(monkeypatch, capsys, where):
    """Only an allocation that failed is OutOfMemory: a bug keeps its traceback."""
    bug = RuntimeError("shape mismatch in some kernel")
    monkeypatch.setattr(cli.Generator if where == "run" else cli, where, raiser(bug))
    with pytest.raises(RuntimeError) as raised:
        cli.main(["--random", "tiny", "--device", "cpu", "1 2 3"])
    assert raised.value is bug and capsys.readouterr() == ("", "")


# -- torchrun's parser ------------------------------------------------------------------------

def every_flag(equals: bool) -> list[str]:
    """Every option of ``cellcache generate`` by each of its names but ``--n``, with a value
    where it takes one (``FLAG VALUE``, or ``FLAG=VALUE``); ``--model`` and ``--random`` both:
    torchrun only passes them on."""
    argv = []
    for action in cli.build_parser()._actions:
        for flag in action.option_strings:
            if flag == "--n":
                continue
            if action.nargs == 0:
                argv.append(flag)
                continue
            value = str(action.choices[0]) if action.choices else "1"
            argv += [f"{flag}={value}"] if equals else [flag, value]
    return argv


@pytest.mark.parametrize("equals", [False, True], ids=["FLAG VALUE", "FLAG=VALUE"])
def test_torchrun_passes_every_flag_on_untouched(equals):
    """torchrun's parser classifies every argument, the script's too, and stops at any that
    abbreviates more than one of its own options (``--n``: --nnodes, --nproc-per-node, ...);
    one abbreviating a single option of its would be read as it. None of generate's does."""
    from torch.distributed.run import get_args_parser

    flags = every_flag(equals)
    assert {"--num-samples=1" if equals else "--num-samples", "--tp=1" if equals else "--tp"} <= set(flags)
    args = get_args_parser().parse_args(["--standalone", "--nproc-per-node", "2", "-m", "cellcache",
                                         "generate", *flags])
    assert args.training_script == "cellcache" and args.module and args.standalone
    assert args.training_script_args == ["generate", *flags]
    assert args.nproc_per_node == "2"                                  # torchrun's own, unchanged


def test_num_samples_and_n_are_one_flag():
    p = cli.build_parser()
    base = ["--random", "tiny"]
    assert p.parse_args(base + ["--num-samples", "3"]) == p.parse_args(base + ["--n", "3"])
    assert p.parse_args(base + ["--num-samples=3"]).n == 3 and p.parse_args(base).n == 1


def test_num_samples_works_under_torchrun(tmp_path):
    """Two ranks under torchrun with --num-samples 2 serve what one process serves with --n 2."""
    from tests.helpers_tp import run_cli

    args = ["--random", "tiny", "--device", "cpu", "--random-prompts", "2", "--max-new-tokens", "5",
            "--temperature", "1.0", "--seed", "7", "--json", "--quiet"]
    one = run_cli(args + ["--n", "2"], False, tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_cli(args + ["--num-samples", "2", "--tp", "2"], True, tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = json.loads(one.stdout), json.loads(two.stdout)
    assert b["summary"]["tp"] == 2 and [len(r["outputs"]) for r in b["results"]] == [2, 2]
    assert [r["outputs"] for r in b["results"]] == [r["outputs"] for r in a["results"]]


# -- Ctrl-C -----------------------------------------------------------------------------------

INTERRUPTED_RUN = ["--random", "tiny", "--device", "cpu", "--random-prompts", "2", "--prompt-len", "8",
                   "--max-new-tokens", "600", "--num-samples", "2"]
PROGRESS = re.compile(r"^generate: (\d+) tokens out")


@pytest.fixture(scope="module")
def uninterrupted() -> dict:
    r = subprocess.run([sys.executable, "-m", "cellcache", "generate", *INTERRUPTED_RUN, "--json", "--quiet"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def interrupt_after_progress(extra: list[str]) -> subprocess.CompletedProcess:
    """``cellcache generate`` sent SIGINT once its second progress line is out (tokens were
    generated, most are still to come). The child gets Python's own SIGINT handler even when
    this test runs in the background (where SIGINT is ignored, and so inherited)."""
    proc = subprocess.Popen([sys.executable, "-m", "cellcache", "generate", *INTERRUPTED_RUN, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stderr is not None
    seen = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if sum(1 for s in seen if PROGRESS.match(s)) == 2:
                proc.send_signal(signal.SIGINT)
                break
        else:
            pytest.fail(f"it ended before a second progress line: {''.join(seen)}")
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "".join(seen) + err)


def test_ctrl_c_writes_the_json_of_what_was_generated(uninterrupted):
    r = interrupt_after_progress(["--json"])
    assert r.returncode == 130, r.stderr
    err = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr and all(PROGRESS.match(s) for s in err[:-1])
    got = json.loads(r.stdout)
    tokens = got["summary"]["tokens_out"]
    assert err[-1] == f"cellcache generate: interrupted after {tokens} tokens; what was generated is above"
    assert got["summary"]["interrupted"] is True and uninterrupted["summary"]["interrupted"] is False
    assert tokens == sum(len(o) for r in got["results"] for o in r["outputs"]) > 0
    assert tokens < uninterrupted["summary"]["tokens_out"] == 2 * 2 * 600
    assert [r["id"] for r in got["results"]] == [r["id"] for r in uninterrupted["results"]]
    for cut, whole in zip(got["results"], uninterrupted["results"]):
        assert cut["prompt_tokens"] == whole["prompt_tokens"]
        for out, reason, full in zip(cut["outputs"], cut["finish_reasons"], whole["outputs"]):
            assert out == full[:len(out)]                             # greedy: what it would have said
            assert reason == ("length" if out == full else "interrupted")
    assert "interrupted" in {f for r in got["results"] for f in r["finish_reasons"]}
    assert set(got["summary"]) == set(uninterrupted["summary"])


def test_ctrl_c_prints_what_was_generated(uninterrupted):
    r = interrupt_after_progress([])
    assert r.returncode == 130, r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stdout.splitlines()
    outputs = [line for line in lines if line.startswith("[")]
    whole = [o for item in uninterrupted["results"] for o in item["outputs"]]
    assert len(outputs) == len(whole) == 4
    total = 0
    for line, full, (i, k) in zip(outputs, whole, [(0, 0), (0, 1), (1, 0), (1, 1)]):
        m = re.fullmatch(rf"\[{i}\.{k}\]( \[interrupted\])? \[(.*)\]", line)
        assert m, line
        ids = [int(t) for t in m.group(2).split(", ")] if m.group(2) else []
        assert ids == full[:len(ids)] and bool(m.group(1)) == (ids != full)
        total += len(ids)
    assert 0 < total < len(whole) * 600
    assert lines[len(outputs)].startswith(f"generate: interrupted: 0 of 2 requests done, {total} tokens in ")
    assert r.stderr.strip().splitlines()[-1] == (f"cellcache generate: interrupted after {total} tokens; "
                                                 "what was generated is above")


# -- without the hf extra ---------------------------------------------------------------------

def without(module: str, *argv: str) -> subprocess.CompletedProcess:
    """``python -m cellcache ARGV`` where importing ``module`` fails as if it were not installed."""
    launcher = (f"import runpy, sys; sys.modules[{module!r}] = None; "
                f"sys.argv = ['cellcache', *{list(argv)!r}]; "
                "runpy.run_module('cellcache', run_name='__main__', alter_sys=True)")
    return subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


@pytest.mark.parametrize("module", ["torch", "transformers", "torch._C"])
def test_generate_without_the_hf_extra_is_one_line(module):
    r = without(module, "generate", "--random", "tiny", "--device", "cpu", "1 2 3")
    assert (r.returncode, r.stdout) == (2, ""), r.stderr
    assert r.stderr == (f"cellcache generate: error: needs the 'hf' extra (no module named {module!r}): "
                        "pip install 'cellcache[hf]'\n")


def test_the_rest_of_the_cli_runs_without_torch():
    demo = without("torch", "demo", "--backend", "host", "--steps", "5", "--seqs", "4", "--quiet")
    assert demo.returncode == 0 and "0 mismatches" in demo.stdout and demo.stderr == "", demo.stderr
    usage = without("torch", "--help")
    assert usage.returncode == 0 and "pip install 'cellcache[hf]'" in usage.stdout


def record_keyword(monkeypatch, name: str) -> list:
    """The value of the Generator keyword ``name`` of each Generator the CLI builds from now
    on, in order (the CLI's Generator replaced by a recording subclass)."""
    made: list = []

    class Recording(cli.Generator):
        def __init__(self, *args, **kwargs):
            made.append(kwargs.get(name))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(cli, "Generator", Recording)
    return made


# -- --native --------------------------------------------------------------------------------

def test_native_reaches_the_generator_and_serves_the_same_tokens(monkeypatch, capsys):
    """``--native`` reaches the Generator (``native=True``; False without it), its greedy
    outputs are the modules' forward's, and ``--tp 2`` with it is bad usage."""
    made = record_keyword(monkeypatch, "native")
    base = ["--random", "llama-tiny", "--device", "cpu", "--max-new-tokens", "8", "--json", "--quiet",
            "5 6 7 8", "--random-prompts", "3"]
    code, out, err = run_main([*base, "--native"], capsys)
    assert code == 0, err
    native = [r["outputs"] for r in json.loads(out)["results"]]
    code, out, err = run_main(base, capsys)
    assert code == 0, err
    assert [r["outputs"] for r in json.loads(out)["results"]] == native
    assert made == [True, False]
    code, out, err = run_main([*base, "--native", "--tp", "2"], capsys)
    assert code == 2 and out == "" and "--native does not run with --tp" in err


# -- --deterministic ---------------------------------------------------------------------------

def test_deterministic_serves_each_prompt_as_it_would_be_alone(monkeypatch, capsys):
    """``--deterministic`` reaches the Generator (``deterministic=True``; False without the
    flag) and a prompt's outputs do not depend on the prompts beside it."""
    made = record_keyword(monkeypatch, "deterministic")
    base = ["--random", "tiny", "--device", "cpu", "--max-new-tokens", "6", "--json", "--quiet",
            "--temperature", "0.8", "--seed", "3"]
    code, out, err = run_main([*base, "--deterministic", "5 6 7 8", "--random-prompts", "3"], capsys)
    assert code == 0, err
    batched = json.loads(out)["results"][0]["outputs"]
    code, out, err = run_main([*base, "--deterministic", "5 6 7 8"], capsys)
    assert code == 0, err
    assert json.loads(out)["results"][0]["outputs"] == batched
    code, out, err = run_main([*base, "5 6 7 8"], capsys)
    assert code == 0, err
    assert made == [True, True, False]


def test_a_closed_stdout_is_not_a_traceback(monkeypatch, capsys):
    """Started with stdout closed (``>&-``) Python's sys.stdout is None: print() writes
    nothing, and the report's last flush must not raise on it."""
    monkeypatch.setattr(sys, "stdout", None)
    assert cli.main(["--random", "tiny", "--device", "cpu", "--quiet", "--max-new-tokens", "2", "1 2 3"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("prompt", ["", "  "])
def test_an_empty_prompt_is_called_empty(capsys, prompt):
    """It was "token ids must lie in [0, 512)", about ids it does not have."""
    code, out, err = run_main(["--random", "tiny", "--device", "cpu", "--quiet", prompt], capsys)
    assert code == 2 and out == ""
    assert err == (f"cellcache generate: error: prompt {prompt!r} is empty: give at least one token id "
                   "(see --help)\n")
