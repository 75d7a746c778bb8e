"""The command line: the main job runs on the CPU and prints what the README promises."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from replayssm import cli, formats

ROOT = Path(__file__).resolve().parents[1]


def test_demo_prints_each_family(capsys):
    assert cli.main(["demo", "--steps", "20", "--heads", "2", "--device", "cpu", "--no-models"]) == 0
    out = capsys.readouterr().out
    assert "Tiny hybrid models" not in out
    for fam in ("mamba2", "gdn", "kda"):
        row = next(line for line in out.splitlines() if line.startswith(fam))
        fields = row.split()
        worst, conv_b, rep_b, lstar = float(fields[3]), float(fields[6]), float(fields[7]), float(fields[9])
        conv_err, rep_err = float(fields[4]), float(fields[5])
        assert worst < 1e-5                 # fp32 replay vs fp32 conventional
        assert 0 < rep_err <= 1.5 * conv_err  # against float64: replay no less exact than conventional
        assert rep_b < conv_b               # replay moves fewer state bytes per token
        assert lstar > 1


@pytest.mark.parametrize("shipped", [True, False], ids=["trained", "random-weights"])
def test_demo_generates_with_tiny_models(shipped, capsys, monkeypatch, tmp_path):
    pytest.importorskip("transformers")
    from replayssm.integrations.hf import configs
    if not shipped:              # a family without trained models falls back to its random tiny model
        monkeypatch.setattr(configs, "TRAINED_DIR", tmp_path)
    assert cli.main(["demo", "--steps", "2", "--heads", "2", "--device", "cpu", "--new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert "12 new tokens" in out
    names = ("trained-nemotron-h", "trained-qwen3-5", "trained-kimi-linear") if shipped else \
        ("tiny_nemotron_h", "tiny_qwen3_5", "tiny_kimi_linear")
    rows = [line.split() for line in out.splitlines()
            if line.startswith(names[0][:5]) and line.split()[1] in ("mamba2", "gdn", "kda")]
    runs = ["stock", "conventional", "replay", "spec-lookup", "spec-draft"]
    assert [(r[0], r[2]) for r in rows] == [(m, run) for m in names for run in runs]
    assert ("continues the Python prompt" in out) == shipped
    assert ("perturbed output head" in out) != shipped
    for r in rows:
        assert float(r[3]) > 0                                       # tokens per second
        assert r[4] == ("(reference)" if r[2] == "stock" else "yes"), r
        if r[2].startswith("spec"):
            accepted, proposed = map(int, r[5].split("/"))
            assert 0 <= accepted <= proposed and proposed > 0
    assert "all runs' tokens agree with stock: yes" in out


def test_demo_without_transformers_says_so_in_one_line(capsys, monkeypatch):
    import importlib.util
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else find(name, *a))
    assert cli.main(["demo", "--steps", "2", "--heads", "2", "--device", "cpu", "--family", "gdn"]) == 0
    out = capsys.readouterr().out
    assert next(line for line in out.splitlines() if line.startswith("gdn"))      # the table still runs
    (line,) = [line for line in out.splitlines() if "transformers" in line]
    assert "skipped, transformers is not installed" in line
    assert not any(line.startswith("tiny_") for line in out.splitlines())


def test_traffic_table_has_paper_figures(capsys):
    assert cli.main(["traffic"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("nemotron3-super"))
    fields = row.split()
    assert fields[4] == "84.5" and fields[5] == "12.9" and fields[6] == "23.7"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_bench_needs_cuda():
    with pytest.raises(SystemExit, match="CUDA"):
        cli.main(["bench", "decode", "--shapes", "nemotron3-super"])


# --- help texts, user errors, the set-up script and the licence --------------------------------

def _exit(argv, capsys):
    """Run the CLI on `argv` expecting it to exit; (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def _user_error(argv, capsys, *needles):
    """`argv` is an argparse error: exit status 2, no traceback, the message names `needles`."""
    code, _, err = _exit(argv, capsys)
    assert code == 2
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("replayssm")
    for n in needles:
        assert n in last


def test_help_says_how_to_run_the_tests(capsys):
    code, out, _ = _exit(["--help"], capsys)
    assert code == 0
    assert out.startswith("usage: replayssm ")
    assert "./run.sh test [pytest args]" in out


def test_test_is_pointed_to_run_sh(capsys):
    _user_error(["test"], capsys, "./run.sh test")


def test_demo_and_traffic_options_have_help(capsys):
    _, out, _ = _exit(["demo", "--help"], capsys)
    assert "decode steps per family" in out
    assert "window L" in out
    assert "cpu, cuda or cuda:N" in out
    assert "--no-models" in out and "tiny hybrid models" in out
    assert "--new-tokens" in out
    _, out, _ = _exit(["traffic", "--help"], capsys)
    assert "{" + ",".join(formats.FORMATS) + "}" in out
    assert "storage format" in out


def test_bench_without_a_name_lists_the_benchmarks(capsys):
    code, _, err = _exit(["bench"], capsys)
    assert code == 2
    assert "choose a benchmark: decode, model, precision, records, verify" in err
    assert "required" not in err


@pytest.mark.parametrize("which", ["decode", "model", "precision", "records", "verify"])
def test_bench_help_names_the_command(which, capsys):
    code, out, _ = _exit(["bench", which, "--help"], capsys)
    assert code == 0
    assert out.startswith(f"usage: replayssm bench {which} ")


def test_help_prog_when_run_as_a_module():
    # the path users take (`./run.sh bench decode --help`): sys.argv[0] is then cli.py
    r = subprocess.run([sys.executable, "-m", "replayssm.cli", "bench", "decode", "--help"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: replayssm bench decode ")


@pytest.mark.parametrize("argv, value", [
    (["demo", "--steps", "0"], "0"),
    (["demo", "--steps", "many"], "'many'"),
    (["demo", "--window", "0"], "0"),
    (["demo", "--window", "-4"], "-4"),
    (["demo", "--heads", "0"], "0"),
    (["demo", "--new-tokens", "0"], "0"),
])
def test_demo_rejects_non_positive_counts(argv, value, capsys):
    _user_error(argv, capsys, argv[1], "positive integer", value)


def test_traffic_rejects_an_unknown_format(capsys):
    _user_error(["traffic", "--format", "fp7"], capsys, "--format", "'fp7'")


@pytest.mark.parametrize("device", ["foo", "meta", "cuda:x"])
def test_demo_rejects_an_unknown_device(device, capsys):
    _user_error(["demo", "--device", device], capsys, "--device", repr(device))


def test_demo_on_cuda_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="CUDA is not available on this machine"):
        cli.main(["demo", "--device", "cuda", "--steps", "1"])


@pytest.mark.parametrize("which", ["decode", "model", "precision", "records", "verify"])
def test_bench_without_cuda_is_one_message(which, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match=f"replayssm bench {which}: error: .*CUDA") as exc:
        cli.main(["bench", which])
    assert "\n" not in str(exc.value)


def test_demo_turns_library_value_errors_into_one_line():
    # 5 GDN value heads get 2 key heads (Qwen3.5's ratio), which SlotPool rejects
    with pytest.raises(SystemExit, match="gdn .*--heads 5.*num_k_heads 2 must divide the 5 value heads"):
        cli.main(["demo", "--family", "gdn", "--heads", "5", "--steps", "1", "--device", "cpu"])


def test_runtime_error_is_one_line_on_stderr():
    r = subprocess.run([sys.executable, "-m", "replayssm.cli", "demo", "--family", "gdn", "--heads", "5",
                        "--steps", "1", "--device", "cpu"], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("replayssm: error: "), r.stderr


# run.sh is exercised with a stub `python3`: creating a real venv and installing torch takes minutes.

def _run_sh_dir(tmp_path, python3_stub):
    """A copy of run.sh in `tmp_path` and a bin folder holding only `python3_stub` (None: no
    python3) and the tools the script needs; returns the function that runs it."""
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("needs bash")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname", "grep", "mkdir", "chmod", "rm", "cat"):
        path = shutil.which(tool)
        if path:
            (bin_dir / tool).symlink_to(path)
    log = tmp_path / "python3.log"
    if python3_stub is not None:
        stub = bin_dir / "python3"
        stub.write_text("#!" + bash + "\n" + f'echo "$*" >> "{log}"\n' + python3_stub)
        stub.chmod(0o755)
    shutil.copy(ROOT / "run.sh", tmp_path / "run.sh")

    def run(env=None):
        """(completed process, the stub's call log so far)"""
        r = subprocess.run([bash, str(tmp_path / "run.sh"), "traffic"], capture_output=True, text=True,
                           cwd=tmp_path, timeout=60, env={"PATH": str(bin_dir), **(env or {})})
        return r, (log.read_text() if log.exists() else "")
    return run


def _run_sh(tmp_path, python3_stub, env=None):
    return _run_sh_dir(tmp_path, python3_stub)(env)


# a python3 >= 3.10 whose `-m venv` makes a .venv/bin/python that accepts everything
_GOOD_PYTHON3 = f"""\
if [ "$1" = -m ] && [ "$2" = venv ]; then
  mkdir -p .venv/bin && printf '#!/bin/sh\\nexit 0\\n' > .venv/bin/python && chmod +x .venv/bin/python
  exit 0
fi
exec "{sys.executable}" "$@"
"""


def test_run_sh_venv_does_not_see_system_site_packages(tmp_path):
    r, log = _run_sh(tmp_path, _GOOD_PYTHON3)
    assert r.returncode == 0, r.stderr
    venv_calls = [line for line in log.splitlines() if line.startswith("-m venv")]
    assert venv_calls == ["-m venv .venv"]


def test_run_sh_system_torch_opt_in(tmp_path):
    run = _run_sh_dir(tmp_path, _GOOD_PYTHON3)
    r, log = run({"REPLAYSSM_SYSTEM_TORCH": "1"})
    assert r.returncode == 0, r.stderr
    assert "-m venv --system-site-packages .venv" in log.splitlines()
    # what the real venv module writes; the stub does not
    (tmp_path / ".venv" / "pyvenv.cfg").write_text("include-system-site-packages = true\n")
    r, _ = run()                 # later calls need not repeat the variable, and get no note
    assert r.returncode == 0 and "note" not in r.stderr, r.stderr


def test_run_sh_notes_an_old_venv_that_sees_the_system(tmp_path):
    run = _run_sh_dir(tmp_path, _GOOD_PYTHON3)
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / ".venv" / "bin" / "python").chmod(0o755)
    (tmp_path / ".venv" / "pyvenv.cfg").write_text("include-system-site-packages = true\n")
    r, log = run()
    assert r.returncode == 0
    assert "-m venv" not in log
    assert "sees the system site-packages" in r.stderr and "remove .venv" in r.stderr


def test_run_sh_documents_system_torch():
    head = [line for line in (ROOT / "run.sh").read_text().splitlines() if line.startswith("#")]
    assert any("REPLAYSSM_SYSTEM_TORCH=1" in line for line in head)


def test_run_sh_without_python3(tmp_path):
    r, _ = _run_sh(tmp_path, None)
    assert r.returncode == 1
    assert r.stderr.strip() == "run.sh: python3 not found on PATH; replayssm needs Python >= 3.10"
    assert not (tmp_path / ".venv").exists()


def test_run_sh_with_an_old_python3(tmp_path):
    old = 'case "$*" in *platform*) echo 3.9.18 ;; -c*) exit 1 ;; *) exit 0 ;; esac\n'
    r, log = _run_sh(tmp_path, old)
    assert r.returncode == 1
    assert "python3 is 3.9.18" in r.stderr and "needs Python >= 3.10" in r.stderr
    assert "-m venv" not in log


def test_test_tools_are_pinned():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["test"] == ["pytest==9.0.3", "pytest-xdist==3.8.0", "hypothesis==6.155.2", "transformers==5.17.0"]
    assert extras["bench"] == ["matplotlib>=3.7"]
    assert extras["hf"] == ["transformers==5.17.0"]


def test_license_is_apache_2():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("Copyright 2026 The replayssm authors\n")
    for needle in ("Apache License", "Version 2.0, January 2004", "TERMS AND CONDITIONS FOR USE",
                   "9. Accepting Warranty or Additional Liability.", "END OF TERMS AND CONDITIONS",
                   "http://www.apache.org/licenses/LICENSE-2.0"):
        assert needle in text
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == {"text": "Apache-2.0"}


def test_train_writes_a_model_folder(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "m"
    assert cli.main(["train", "--family", "gdn", "--draft", "--out", str(out), "--steps", "2", "--batch", "2",
                     "--context", "16", "--eval-bytes", "256", "--device", "cpu", "--no-progress"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("trained-qwen3-5-draft:") and "unigram" in line
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "README.md"):
        assert (out / name).exists(), name
    assert f"replayssm train --family gdn --draft --out {out} --steps 2" in (out / "README.md").read_text()


def test_train_rejects_an_unknown_family(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--family", "mamba3", "--out", "x"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err
