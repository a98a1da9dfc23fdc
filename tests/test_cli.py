"""The `remat` command: plan with --json round-tripping, errors, and the demo (slow)."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from remat.planner.cli import load_factory, main, parse_training
from remat.planner.training import Optimizer, Precision

ROOT = Path(__file__).resolve().parents[1]


def test_json_round_trips(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = main(["-q", "plan", "tests.models:gpt", "--activation-budget", "2MB",
                 "--solver", "checkpoint_blocks", "--training", "optimizer=sgd,reserve=0",
                 "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    data = json.loads(out.read_text())
    assert json.loads(json.dumps(data)) == data
    plan = data["plan"]
    report = plan["report"]
    assert report["memory"][0]["memory"]["total"] == plan["peak"] == plan["memory"]["total"]
    assert plan["schedule"]["peak"] == plan["memory"]["simulated_peak"]
    assert plan["memory"]["activation_peak"] == (plan["memory"]["simulated_peak"]
                                                 - plan["memory"]["graph_gradients"])
    assert plan["memory"]["activation_peak"] <= 2 * 10**6  # the activation budget given
    assert plan["schedule"]["recompute_flops"] == report["price"]["recompute_flops"]
    assert plan["training"]["optimizer"] == "sgd"
    assert plan["memory"]["state"]["optimizer"] == 0
    assert "Memory of one step" in printed and f"plan written to {out}" in printed


def test_sweep_and_plot(tmp_path, capsys):
    png = tmp_path / "curve.png"
    code = main(["-q", "plan", "tests.models:gpt", "--budget", "1.2GiB", "--solver",
                 "checkpoint_blocks", "--sweep", "--plot", str(png), "--json",
                 str(tmp_path / "p.json")])
    printed = capsys.readouterr().out
    assert code == 0
    assert "The trade-off curve" in printed and "smallest budget that fits" in printed
    data = json.loads((tmp_path / "p.json").read_text())
    assert len(data["sweep"]["points"]) >= 2
    assert png.exists() or "matplotlib is not installed" in printed


def test_errors_exit_2_with_a_message(capsys):
    assert main(["-q", "plan", "tests.models:gpt", "--budget", "sixty"]) == 2
    assert "cannot read 'sixty'" in capsys.readouterr().err
    assert main(["-q", "plan", "tests.models:nothing", "--budget", "1GB"]) == 2
    assert "no callable 'nothing'" in capsys.readouterr().err
    code = main(["-q", "plan", "tests.models:gpt", "--budget", "1MB", "--solver", "save_all"])
    err = capsys.readouterr().err
    assert code == 2 and "BudgetError" in err and "the smallest budget that fits" in err


def test_parse_training_and_factories():
    training = parse_training("precision=bf16-mixed,optimizer=adam8bit,zero_stage=2,"
                              "data_parallel=4,reserve=512MiB,fragmentation=0.2,frozen=a.*+b")
    assert training.precision is Precision.BF16_MIXED
    assert training.optimizer is Optimizer.ADAM8BIT
    assert (training.zero_stage, training.data_parallel) == (2, 4)
    assert training.reserve == 512 * 2**20 and training.frozen == frozenset({"a.*", "b"})
    with pytest.raises(ValueError):
        parse_training("precision")
    with pytest.raises(ValueError):
        parse_training("colour=blue")
    assert callable(load_factory(f"{ROOT / 'examples' / 'llama.py'}:llama"))
    with pytest.raises(ValueError):
        load_factory("no-colon")


@pytest.mark.slow
def test_demo_prints_predicted_and_measured_within_5_percent():
    result = subprocess.run([sys.executable, "-m", "remat.planner.cli", "demo"], cwd=ROOT,
                            capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "Llama 7B" in out and "Memory of one step" in out
    match = re.search(r"predicted live bytes of the step's graph: (\d+) bytes "
                      r".*measured: (\d+) bytes", out)
    assert match, out[-2000:]
    predicted, measured = map(int, match.groups())
    assert abs(measured - predicted) <= 0.05 * predicted
