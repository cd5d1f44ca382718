"""A battery of bad command-line inputs, each run as its own process.

Every case must exit with code 2, print one line naming the parameter, show no
traceback, and change no file. Most fail before any model loads (that is the
point: check first, then work); the few that need the model's limits use a
tiny random Llama saved to a folder.

Starting Python and importing torch and transformers takes seconds per
process, so the cases do not each start an interpreter: one server process
imports the command line once, then forks a fresh child per case, which runs
``scissorhands.tools.cli.main`` with its own argv, working folder, stdout and stderr,
and exits with main's return code (an uncaught exception prints its
traceback and exits 1, as the interpreter would). A sample of cases is also
run through ``python -m scissorhands.tools.cli`` to show the two agree.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import scissorhands
from conftest import save_tiny_model

SRC = str(Path(scissorhands.__file__).resolve().parents[1])

SERVER = r"""
import json, os, sys, traceback
import torch, transformers  # noqa: F401  (imported once, before the forks)
import scissorhands.tools.cli as cli
import scissorhands.tools.analysis.cli, scissorhands.tools.eval  # noqa: F401
import scissorhands.tools.generation, scissorhands.tools.models  # noqa: F401

cases = json.load(sys.stdin)
codes = []
for case in cases:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(case["cwd"])
            for fd, name in ((1, case["stdout"]), (2, case["stderr"])):
                target = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(target, fd)
                os.close(target)
            sys.argv = ["scissorhands", *case["argv"]]
            code = cli.main(case["argv"])
        except SystemExit as e:
            if isinstance(e.code, int):
                code = e.code
            elif e.code is None:
                code = 0
            else:
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    codes.append(os.waitstatus_to_exitcode(status))
print(json.dumps(codes))
"""


def _env(tmp: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=SRC, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               SCISSORHANDS_CACHE=str(tmp / "model-cache"), TOKENIZERS_PARALLELISM="false")
    return env


def make_inputs(folder: Path) -> None:
    """The files the cases refer to (relative to their working folder)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "prompt.txt").write_text("The quick brown fox jumps over the lazy dog. " * 4)
    (folder / "long.txt").write_text("All work and no play makes Jack a dull boy. " * 60)  # > 1024 byte tokens
    (folder / "big.txt").write_text("Now is the winter of our discontent made glorious summer. " * 250)
    (folder / "empty.txt").write_text("  \n\n ")
    rng = __import__("random").Random(0)
    (folder / "binary.bin").write_bytes(bytes(rng.randrange(256) for _ in range(4000)) + b"\0")
    (folder / "binary_nonul.bin").write_bytes(bytes(rng.randrange(1, 256) for _ in range(4000)))
    (folder / "random.json").write_bytes(bytes(rng.randrange(128, 256) for _ in range(300)))
    (folder / "bool_schedule.json").write_text(json.dumps({"budgets": [True, 40]}))
    (folder / "afile").write_text("a regular file\n")
    q = {"context": "The sun rises in the", "choices": [" east", " west"]}
    (folder / "nolabel.jsonl").write_text(json.dumps(q) + "\n")
    (folder / "badlabel.jsonl").write_text(json.dumps({**q, "label": 0}) + "\n" + json.dumps({**q, "label": 5}) + "\n")
    (folder / "boollabel.jsonl").write_text(json.dumps({**q, "label": True}) + "\n")
    (folder / "notjson.jsonl").write_text(json.dumps({**q, "label": 0}) + "\n{not json\n" + json.dumps(q) + "\n")
    (folder / "foreign").mkdir()
    (folder / "foreign" / "results.jsonl").write_text('{"name": "someone else\'s data", "rows": 3}\n')
    (folder / "summary_is_dir" / "summary.md").mkdir(parents=True)
    (folder / "centres_str.json").write_text(json.dumps({"format": "scissorhands-key-centers/1", "signature": {},
                                                         "layers": "not a table"}))
    (folder / "big.json").write_text("Now is the winter of our discontent. " * 40)
    (folder / "sched.json").write_text(json.dumps({"budgets": [20, 20]}))
    (folder / "evalout").mkdir()
    (folder / "evalout" / "summary.md").write_text("Now is the winter of our discontent. " * 40)
    (folder / "aout2").mkdir()
    (folder / "aout2" / "tables.md").write_text("Now is the winter of our discontent. " * 40)
    (folder / "benchdone").mkdir()
    (folder / "benchdone" / "bench.json").write_text('{"config": {}}')
    (folder / "benchsched").mkdir()
    (folder / "benchsched" / "bench.json").write_text(json.dumps({"budgets": [20, 20]}))


def snapshot(*folders: Path) -> dict:
    """Every file and folder under ``folders``: kind, size, modification time and content digest."""
    out = {}
    for root in folders:
        for path in sorted([root, *root.rglob("*")]):
            st = path.lstat()
            digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
            out[str(path)] = (path.is_dir(), st.st_size if path.is_file() else None, st.st_mtime_ns
                              if path.is_file() else None, digest)
    return out


G = ["generate", "--model", "{tiny}"]
D = ["demo", "--model", "{tiny}"]
E = ["eval", "--model", "{tiny}", "--out", "out", "--text", "prompt.txt"]
A = ["analyze", "--model", "{tiny}", "--out", "aout", "--text", "prompt.txt"]
P = ["--prompt", "hi"]
B = ["bench", "--model", "{tiny}", "--out", "bout"]

CASES = [
    # memory= with a setting it would override (reliability round 3): refused in one line naming memory
    ("gen-memory-with-dense-store", [*G, "--memory", "0.2", "--kv-store", "dense", *P], "memory"),
    ("gen-memory-with-kv-bits", [*G, "--memory", "0.2", "--kv-bits", "2", *P], "memory"),
    ("gen-memory-with-kv-demote", [*G, "--memory", "0.2", "--kv-bits", "4", "--kv-demote", "8:0.3", *P], "memory"),
    ("gen-memory-with-schedule-list", [*G, "--memory", "0.2", "--schedule", "20,20", *P], "memory"),
    ("eval-memory-with-kv-bits", [*E, "--memory", "0.2", "--kv-bits", "2", "--methods", "scissorhands", "--seq-len",
                                  "32", "--num-samples", "2"], "memory"),
    # stores and bits agree; widths are integers
    ("gen-kv-bits-with-dense-store", [*G, "--budget", "50", "--kv-bits", "4", "--kv-store", "dense", *P],
     "kv-store"),
    ("gen-kv-demote-float-width", [*G, "--budget", "50", "--kv-bits", "4", "--kv-demote", "8.7:0.3", *P],
     "kv-demote"),
    # generate: cache settings
    ("gen-budget-below-recent", [*G, "--budget", "5", "--recent", "10", *P], "budget"),
    ("gen-budget-not-int", [*G, "--budget", "x", *P], "budget"),
    ("gen-budget-nan", [*G, "--budget", "nan", *P], "budget"),
    ("gen-recent-negative", [*G, "--budget", "50", "--recent", "-1", *P], "recent"),
    ("gen-recent-nan", [*G, "--budget", "50", "--recent", "nan", *P], "recent"),
    ("gen-recent-inf", [*G, "--budget", "50", "--recent", "1e400", *P], "recent"),
    ("gen-recent-fraction-1.5", [*G, "--budget", "50", "--recent", "1.5", *P], "recent"),
    ("gen-window-0", [*G, "--budget", "50", "--window", "0", *P], "window"),
    ("gen-window-text", [*G, "--budget", "50", "--window", "wide", *P], "window"),
    ("gen-window-buckets-negative", [*G, "--budget", "50", "--window-buckets", "-2", *P], "window-buckets"),
    ("gen-drop-count-too-big", [*G, "--budget", "50", "--drop", "50", *P], "drop"),
    ("gen-drop-fraction-1.5", [*G, "--budget", "50", "--drop", "1.5", *P], "drop"),
    ("gen-drop-nan", [*G, "--budget", "50", "--drop", "nan", *P], "drop"),
    ("gen-sinks-negative", [*G, "--budget", "50", "--sinks", "-1", *P], "sinks"),
    ("gen-observe-0", [*G, "--budget", "50", "--observe", "0", *P], "observe"),
    ("gen-importance", [*G, "--budget", "50", "--importance", "max", *P], "importance"),
    ("gen-prefill", [*G, "--budget", "50", "--prefill", "later", *P], "prefill"),
    ("gen-preset", [*G, "--budget", "50", "--preset", "fastest", *P], "preset"),
    ("gen-schedule-name", [*G, "--budget", "50", "--schedule", "zigzag", *P], "schedule"),
    ("gen-schedule-random-bytes", [*G, "--budget", "50", "--schedule", "random.json", *P], "schedule"),
    ("gen-schedule-bools", [*G, "--budget", "50", "--schedule", "bool_schedule.json", *P], "schedule"),
    ("gen-schedule-missing", [*G, "--budget", "50", "--schedule", "missing.json", *P], "schedule"),
    ("gen-schedule-list-text", [*G, "--budget", "50", "--schedule", "40,x", *P], "schedule"),
    ("gen-schedule-list-length", [*G, "--budget", "50", "--schedule", "40,40,40", *P], "schedule"),
    ("gen-method-unknown", [*G, "--budget", "50", "--method", "magic", *P], "method"),
    ("gen-method-full", [*G, "--budget", "50", "--method", "full", *P], "method"),
    # generate: generation settings and prompt
    ("gen-max-new-tokens-0", [*G, "--budget", "50", "--max-new-tokens", "0", *P], "max-new-tokens"),
    ("gen-max-new-tokens-negative", [*G, "--budget", "50", "--max-new-tokens", "-5", *P], "max-new-tokens"),
    ("gen-max-new-tokens-float", [*G, "--budget", "50", "--max-new-tokens", "1e9", *P], "max-new-tokens"),
    ("gen-max-new-tokens-past-positions", [*G, "--budget", "50", "--max-new-tokens", "1000000000", *P],
     "max-new-tokens"),
    ("gen-prompt-past-positions", [*G, "--budget", "50", "--prompt-file", "long.txt"], "prompt-file"),
    ("gen-temperature-0", [*G, "--budget", "50", "--sample", "--temperature", "0", *P], "temperature"),
    ("gen-temperature-nan", [*G, "--budget", "50", "--temperature", "nan", *P], "temperature"),
    ("gen-temperature-inf", [*G, "--budget", "50", "--temperature", "inf", *P], "temperature"),
    ("gen-top-p-2", [*G, "--budget", "50", "--top-p", "2", *P], "top-p"),
    ("gen-top-p-0", [*G, "--budget", "50", "--top-p", "0", *P], "top-p"),
    ("gen-top-p-nan", [*G, "--budget", "50", "--top-p", "nan", *P], "top-p"),
    ("gen-seed-negative", [*G, "--budget", "50", "--seed", "-1", *P], "seed"),
    ("gen-seed-huge", [*G, "--budget", "50", "--seed", str(2**70), *P], "seed"),
    ("gen-dtype", [*G, "--budget", "50", "--dtype", "int8", *P], "dtype"),
    ("gen-prompt-blank", [*G, "--budget", "50", "--prompt", "   "], "prompt"),
    ("gen-prompt-file-missing", [*G, "--budget", "50", "--prompt-file", "missing.txt"], "prompt-file"),
    ("gen-prompt-file-empty", [*G, "--budget", "50", "--prompt-file", "empty.txt"], "prompt-file"),
    ("gen-prompt-file-binary", [*G, "--budget", "50", "--prompt-file", "binary.bin"], "prompt-file"),
    ("gen-prompt-file-binary-no-nul", [*G, "--budget", "50", "--prompt-file", "binary_nonul.bin"], "prompt-file"),
    ("gen-prompt-file-folder", [*G, "--budget", "50", "--prompt-file", "foreign"], "prompt-file"),
    ("gen-model-missing", ["generate", "--model", "/no/such/model", "--budget", "50", *P], "model"),
    ("gen-model-not-a-model", ["generate", "--model", "afile", "--budget", "50", *P], "model"),
    # demo
    ("demo-budget", [*D, "--budget", "5", "--recent", "10"], "budget"),
    ("demo-top-p", [*D, "--top-p", "2"], "top-p"),
    ("demo-max-new-tokens", [*D, "--max-new-tokens", "0"], "max-new-tokens"),
    ("demo-temperature", [*D, "--temperature", "-1"], "temperature"),
    ("demo-seed-nan", [*D, "--seed", "nan"], "seed"),
    ("demo-prompt-past-positions", [*D, "--max-new-tokens", "5"], "prompt"),
    # eval
    ("eval-budgets-nan", [*E, "--budgets", "nan"], "budgets"),
    ("eval-budgets-inf", [*E, "--budgets", "inf"], "budgets"),
    ("eval-budgets-overflow", [*E, "--budgets", "1e400"], "budgets"),
    ("eval-budgets-text", [*E, "--budgets", "0.2,x"], "budgets"),
    ("eval-budgets-negative", [*E, "--budgets", "-1"], "budgets"),
    ("eval-budgets-zero", [*E, "--budgets", "0"], "budgets"),
    ("eval-budgets-fractional-count", [*E, "--budgets", "2.5"], "budgets"),
    ("eval-budgets-twice", [*E, "--budgets", "0.2,0.2"], "budgets"),
    ("eval-budgets-empty", [*E, "--budgets", ","], "budgets"),
    ("eval-budget-count-below-recent", [*E, "--budgets", "50", "--recent", "80"], "budgets"),
    ("eval-budgets-clamped-to-one-row", [*E, "--budgets", "0.2,0.5", "--recent", "80", "--seq-len", "96",
                                         "--num-samples", "1", "--text", "big.txt"], "budgets"),
    ("eval-drop-above-budget", [*E, "--budgets", "0.5", "--drop", "100", "--seq-len", "96", "--num-samples", "1",
                                "--text", "big.txt"], "drop"),
    ("eval-seq-len-past-positions", [*E, "--seq-len", "5000", "--num-samples", "1", "--text", "big.txt"],
     "seq-len"),
    ("eval-methods-unknown", [*E, "--methods", "magic"], "methods"),
    ("eval-methods-empty", [*E, "--methods", ","], "methods"),
    ("eval-methods-twice", [*E, "--methods", "full,h2o,full"], "methods"),
    ("eval-tasks-unknown", [*E, "--tasks", "nope"], "tasks"),
    ("eval-tasks-twice", [*E, "--tasks", "ppl,ppl"], "tasks"),
    ("eval-tasks-missing-file", [*E, "--tasks", "missing.jsonl"], "tasks"),
    ("eval-tasks-missing-label", [*E, "--tasks", "nolabel.jsonl"], "tasks"),
    ("eval-tasks-label-out-of-range", [*E, "--tasks", "badlabel.jsonl"], "tasks"),
    ("eval-tasks-label-bool", [*E, "--tasks", "boollabel.jsonl"], "tasks"),
    ("eval-tasks-line-not-json", [*E, "--tasks", "notjson.jsonl"], "tasks"),
    ("eval-limit-0", [*E, "--limit", "0"], "limit"),
    ("eval-seq-len-0", [*E, "--seq-len", "0"], "seq-len"),
    ("eval-seq-len-1", [*E, "--seq-len", "1"], "seq-len"),
    ("eval-num-samples-0", [*E, "--num-samples", "0"], "num-samples"),
    ("eval-seed-negative", [*E, "--seed", "-1"], "seed"),
    ("eval-text-missing", [*E, "--text", "/no/such/dir"], "text"),
    ("eval-text-binary", [*E, "--text", "binary.bin"], "text"),
    ("eval-text-empty", [*E, "--text", "empty.txt"], "text"),
    ("eval-recent-negative", [*E, "--recent", "-1"], "recent"),
    ("eval-window-0", [*E, "--window", "0"], "window"),
    ("eval-schedule-random-bytes", [*E, "--schedule", "random.json"], "schedule"),
    ("eval-dtype", [*E, "--dtype", "float64"], "dtype"),
    ("eval-out-is-file", [*E[:4], "afile", *E[5:]], "out"),
    ("eval-out-under-file", [*E[:4], "afile/sub", *E[5:]], "out"),
    ("eval-out-foreign-results", [*E[:4], "foreign", *E[5:]], "out"),
    ("eval-out-summary-is-folder", [*E[:4], "summary_is_dir", *E[5:]], "out"),
    # analyze
    ("analyze-seq-len-nan", [*A, "--seq-len", "nan"], "seq-len"),
    ("analyze-seq-len-short", [*A, "--seq-len", "8"], "seq-len"),
    ("analyze-budget-inf", [*A, "--budget", "inf"], "budget"),
    ("analyze-budget-nan", [*A, "--budget", "nan"], "budget"),
    ("analyze-thresholds-inf", [*A, "--thresholds", "1,inf"], "thresholds"),
    ("analyze-ratios-2", [*A, "--ratios", "2"], "ratios"),
    ("analyze-calib-fraction-1", [*A, "--calib-fraction", "1"], "calib-fraction"),
    ("analyze-topk-0", [*A, "--topk", "0"], "topk"),
    ("analyze-num-samples-0", [*A, "--num-samples", "0"], "num-samples"),
    ("analyze-seed-negative", [*A, "--seed", "-1"], "seed"),
    ("analyze-parts", [*A, "--parts", "everything"], "parts"),
    ("analyze-weight-floor-nan", [*A, "--weight-floor", "nan"], "weight-floor"),
    ("analyze-compressions", [*A, "--compressions", "0.5"], "compressions"),
    ("analyze-text-missing", [*A[:5], "--text", "/no/such/text"], "text"),
    ("analyze-text-binary", [*A[:5], "--text", "binary.bin"], "text"),
    ("analyze-text-empty", [*A[:5], "--text", "empty.txt"], "text"),
    # outputs never overwrite inputs or each other; every length is checked first (issue: reliability round 2)
    ("gen-audit-over-prompt-file", [*G, "--budget", "50", "--prompt-file", "prompt.txt", "--audit",
                                    "prompt.txt"], "audit"),
    ("gen-audit-png", [*G, "--budget", "50", *P, "--audit", "x.png"], "audit"),
    ("gen-audit-over-schedule", [*G, "--budget", "50", *P, "--schedule", "sched.json", "--audit", "sched.json"],
     "audit"),
    ("gen-kv-bits-float", [*G, "--budget", "50", *P, "--kv-bits", "4.0"], "kv-bits"),
    ("gen-centres-holding-a-string", [*G, "--budget", "50", *P, "--kv-bits", "4", "--kv-key-centers",
                                      "centres_str.json"], "kv-key-centers"),
    ("eval-schedule-list-two-budgets", [*E, "--budgets", "0.25,0.75", "--schedule", "20,20", "--seq-len", "64",
                                        "--num-samples", "1"], "schedule"),
    ("analyze-seq-len-past-positions", [*A, "--seq-len", "2000"], "seq-len"),
    ("analyze-text-too-short", [*A, "--seq-len", "512", "--parts", "persistence"], "seq-len"),
    ("calibrate-tokens-past-positions", ["calibrate", "--model", "{tiny}", "--text", "big.txt", "--tokens", "5000",
                                         "--out", "c.json"], "tokens"),
    ("calibrate-out-over-text", ["calibrate", "--model", "{tiny}", "--text", "big.json", "--out", "big.json"],
     "out"),
    ("analyze-out-is-file", [*A[:4], "afile", *A[5:]], "out"),
    ("analyze-out-under-file", [*A[:4], "afile/sub", *A[5:]], "out"),
    ("analyze-from-json-random-bytes", [*A, "--from-json", "random.json"], "from-json"),
    ("analyze-from-json-missing", [*A, "--from-json", "missing.json"], "from-json"),
    ("eval-out-over-text", [*E[:4], "evalout", "--text", "evalout/summary.md"], "out"),
    ("analyze-out-over-text", [*A[:4], "aout2", "--text", "aout2/tables.md"], "out"),
    ("bench-out-holds-an-earlier-run", [*B, "--out", "benchdone"], "out"),
    ("bench-out-over-schedule", [*B, "--out", "benchsched", "--schedule", "benchsched/bench.json"], "out"),
    ("bench-cap-prompt-past-positions", [*B, "--cap-memory", "1GiB", "--cap-prompt", "9000", "--parts", "maxbatch"],
     "cap-prompt"),
    ("bench-seq-len-past-positions", [*B, "--seq-len", "5000", "--parts", "decode"], "seq-len"),
]


@pytest.fixture(scope="module")
def battery(tmp_path_factory):
    """Run every case in its own forked process; returns {case id: (code, stdout, stderr, changed files)}."""
    root = tmp_path_factory.mktemp("battery")
    tiny = save_tiny_model(root / "tiny")
    logs = root / "logs"
    logs.mkdir()
    cases, folders = [], {}
    for case_id, argv, _ in CASES:
        cwd = root / "cases" / case_id
        make_inputs(cwd)
        folders[case_id] = cwd
        cases.append({"cwd": str(cwd), "argv": [a.replace("{tiny}", str(tiny)) for a in argv],
                      "stdout": str(logs / f"{case_id}.out"), "stderr": str(logs / f"{case_id}.err")})
    before = {cid: snapshot(folder) for cid, folder in folders.items()}
    tiny_before = snapshot(tiny)
    proc = subprocess.run([sys.executable, "-c", SERVER], input=json.dumps(cases), capture_output=True, text=True,
                          env=_env(root), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert snapshot(tiny) == tiny_before
    out = {}
    for (case_id, _, _), code in zip(CASES, codes):
        after = snapshot(folders[case_id])
        changed = sorted(set(before[case_id].items()) ^ set(after.items()))
        out[case_id] = (code, (logs / f"{case_id}.out").read_text(), (logs / f"{case_id}.err").read_text(),
                        changed)
    return out


def test_the_battery_is_large_enough():
    assert len(CASES) >= 60
    assert len({c[0] for c in CASES}) == len(CASES)
    for command in ("generate", "demo", "eval", "analyze"):
        assert sum(c[1][0] == command for c in CASES) >= 5


def assert_one_line_error(code: int, stderr: str, param: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2, stderr
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1, stderr
    line = lines[0]
    assert line.startswith("scissorhands") and "error:" in line, line
    # our messages start with the parameter; argparse's name the option
    assert f"error: {param}:" in line or f"argument --{param.replace('_', '-')}" in line, line


@pytest.mark.parametrize("case_id,param", [(c[0], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_changes_nothing(battery, case_id, param):
    code, stdout, stderr, changed = battery[case_id]
    assert_one_line_error(code, stderr, param)
    assert stdout == ""
    assert changed == [], changed


SAMPLE = ["gen-top-p-2", "eval-budgets-nan", "eval-out-under-file", "analyze-text-binary"]


@pytest.mark.parametrize("case_id", SAMPLE)
def test_the_real_entry_point_agrees(tmp_path, case_id):
    """The same cases through ``python -m scissorhands.tools.cli``: same exit code, same message."""
    argv, param = next((c[1], c[2]) for c in CASES if c[0] == case_id)
    make_inputs(tmp_path)
    before = snapshot(tmp_path)
    argv = [a.replace("{tiny}", str(tmp_path / "no-model-needed")) for a in argv]
    proc = subprocess.run([sys.executable, "-m", "scissorhands.tools.cli", *argv], cwd=tmp_path, capture_output=True,
                          text=True, env=_env(tmp_path), timeout=300)
    assert_one_line_error(proc.returncode, proc.stderr, param)
    assert snapshot(tmp_path) == before
