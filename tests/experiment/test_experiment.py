"""Experiments: file validation, run configs, the report's numbers, and a real two-variant, two-seed run."""

from __future__ import annotations

import csv
import json
import shutil
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from cli_helpers import CONFIGS, REPO, TINY

from rlm.cli import main as rlm_main
from rlm.experiment.check import check_experiment
from rlm.experiment.report import PLOTS, write_report
from rlm.experiment.spec import ExperimentError, load_experiment, run_config
from rlm.experiment.timing import TrainClock

PNG = b"\x89PNG\r\n\x1a\n"


def write_experiment(path: Path, **fields) -> Path:
    """An experiment file on the tiny test setup (absolute base paths), with ``fields`` on top."""
    spec = {
        "name": "tiny",
        "base": [str(p) for p in TINY],
        "seeds": [0],
        "variants": {"baseline": {}},
        **fields,
    }
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


# ----- validation -----------------------------------------------------------------------------------------


def test_broken_experiment_lists_every_problem(tmp_path, capsys):
    tokenid = str(CONFIGS / "plugins" / "tokenid.yaml")
    path = write_experiment(
        tmp_path / "broken.yaml",
        seeds=[0, 0],
        baseline="nope",
        colour="red",
        common={"trainer": {"max_stepz": 4}},
        variants={
            "baseline": {},
            "mystery": {"set": {"model": {"plugins": {"mystery": {}}}}},
            "bad_option": {"configs": [tokenid], "set": {"model": {"plugins": {"tokenid": {"rnk": 1}}}}},
            "bad_layer": {"configs": [tokenid], "set": {"model": {"plugins": {"tokenid": {"layers": [7]}}}}},
            "missing": {"configs": ["nothere.yaml"], "set": {"trainer": {"max_steps": "abc"}}},
            "bad_heads": {"set": {"model": {"model": {"n_heads": 3}}}},
            "bad key": {},
        },
    )
    with pytest.raises(ExperimentError) as info:
        check_experiment(path)
    expected = [
        "unknown top-level key(s) ['colour']",
        "seeds: [0, 0] repeats a seed",
        "baseline: 'nope' is not one of the variants",
        "variant 'bad key': names must be letters",
        "variant 'missing'.configs: config file 'nothere.yaml' does not exist",
        "common.trainer.max_stepz = 4: Group 'trainer' does not accept option 'max_stepz'",
        "variant 'mystery': unknown plugin 'mystery'; known plugins: [",
        "variant 'bad_option': plugin 'tokenid': unknown option(s) ['rnk']",
        "variant 'bad_layer': plugin 'tokenid': layer 7 is out of range for a model of 2 layers",
        "variant 'missing': set.trainer.max_steps = 'abc': trainer.max_steps: must be an integer, got 'abc'",
        "variant 'bad_heads': model.n_heads=3 must divide model.d_model=64",
    ]
    problems = info.value.problems
    for text in expected:
        assert sum(text in p for p in problems) == 1, f"{text!r} not reported once in {problems}"
    assert len(problems) == len(expected)
    with pytest.raises(ExperimentError) as info:
        check_experiment(
            path, sets=["trainer.max_steps=abc", "oops", "trainer.limit_val_batches=2"], seeds=[1, 1]
        )
    extra = [p for p in info.value.problems if p not in problems]
    assert len(extra) == 3, extra
    assert extra[0].startswith("--set 'oops': expected KEY=VALUE")
    assert extra[1] == "seeds: [1, 1] repeats a seed"
    assert extra[2].startswith(
        "common.trainer.max_steps = 'abc': trainer.max_steps: must be an integer, got 'abc'"
    )
    # Through the command line: exit code 2, every problem printed, nothing trained.
    assert rlm_main(["experiment", "run", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"has {len(expected)} problems" in err and all(text in err for text in expected)
    assert not (tmp_path / "out").exists()


def test_subcommand_table_is_pinned():
    from rlm.cli.commands import function_parser, typed_argv
    from rlm.experiment.cli import COMMANDS

    assert list(COMMANDS) == ["run", "check", "report", "status"]
    args = ["x.yaml", "--set", "a.b=1", "--seeds", "3", "4", "--set=c=[1, 2]", "--variants", "v"]
    got = function_parser("rlm experiment check", COMMANDS["check"]).parse_args(
        typed_argv(COMMANDS["check"], args)
    )
    assert got.as_dict() == {"file": "x.yaml", "out": None, "variants": ["v"], "seeds": [3, 4], "base": None,
                             "set": ["a.b=1", "c=[1, 2]"]}  # fmt: skip


def test_structure_errors_without_a_parser(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("variants: [a, b]\nseeds: two\n")
    with pytest.raises(ExperimentError) as info:
        load_experiment(path)
    assert any(p.startswith("base: name at least one config file") for p in info.value.problems)
    assert any(p.startswith("variants: expected a non-empty mapping") for p in info.value.problems)
    assert any(p.startswith("seeds: expected a non-empty list of integers") for p in info.value.problems)


@pytest.mark.parametrize("path", sorted((CONFIGS / "experiments").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_experiment_files_validate(path):
    exp, counts = check_experiment(path)
    assert exp.baseline in counts and counts[exp.baseline].added == 0
    assert exp.description, "the header/description must say what the paper found"


# ----- run configs and the clock --------------------------------------------------------------------------


def test_run_config_points_logs_and_checkpoints_into_the_run(tmp_path):
    from rlm.experiment.spec import merge

    cfg = run_config(merge(TINY), 3, tmp_path / "v" / "seed3")
    run = str((tmp_path / "v" / "seed3").resolve())
    assert cfg["seed_everything"] == 3 and cfg["trainer"]["default_root_dir"] == run
    (logger,) = cfg["trainer"]["logger"]  # fast.yaml's CSV logger, moved into the run
    assert logger["init_args"] == {"save_dir": run, "name": "logs", "version": 0}
    ckpt, lr_monitor, clock = cfg["trainer"]["callbacks"]
    assert ckpt["init_args"]["dirpath"] == run + "/ckpt" and ckpt["init_args"]["save_last"] is True
    assert ckpt["init_args"]["every_n_train_steps"] == 3  # the base's own settings are kept
    assert lr_monitor["class_path"].endswith("LearningRateMonitor")
    assert clock == {"class_path": "rlm.experiment.timing.TrainClock"}
    assert run_config(cfg, 3, tmp_path / "v" / "seed3") == cfg  # idempotent: no second clock


def test_run_config_keeps_every_configured_logger(tmp_path):
    wandb = {"class_path": "pytorch_lightning.loggers.WandbLogger", "init_args": {"project": "rlm"}}
    mlflow = {"class_path": "pytorch_lightning.loggers.MLFlowLogger", "init_args": {"run_name": "mine"}}
    tb = {"class_path": "pytorch_lightning.loggers.TensorBoardLogger"}
    cfg = run_config({"trainer": {"logger": [wandb, tb, mlflow]}}, 0, tmp_path / "moe" / "seed0")
    run = str((tmp_path / "moe" / "seed0").resolve())
    csv_, wandb_, tb_, mlflow_ = cfg["trainer"]["logger"]
    assert csv_ == {
        "class_path": "pytorch_lightning.loggers.CSVLogger",
        "init_args": {"save_dir": run, "name": "logs", "version": 0},
    }
    assert wandb_["init_args"] == {"project": "rlm", "name": "moe/seed0"}  # one W&B run per variant and seed
    assert tb_["init_args"] == {"save_dir": run, "name": "logs", "version": 0}
    assert mlflow_["init_args"] == {"run_name": "mine"}  # a name given in the config is kept
    # `logger: true` is Lightning's default TensorBoard logger, kept beside the runner's CSV one.
    default = run_config({"trainer": {"logger": True}}, 0, tmp_path / "v" / "seed0")["trainer"]["logger"]
    assert [lg["class_path"].rsplit(".", 1)[1] for lg in default] == ["CSVLogger", "TensorBoardLogger"]


def test_train_clock_excludes_validation_and_survives_resume(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("rlm.experiment.timing.time.perf_counter", lambda: now[0])
    clock = TrainClock()
    clock.on_train_start(None, None)
    now[0] = 110.0
    clock.on_validation_start(None, None)
    now[0] = 130.0  # 20 s of validation
    clock.on_validation_end(None, None)
    now[0] = 135.0
    assert clock.elapsed() == pytest.approx(15.0)
    resumed = TrainClock()
    resumed.load_state_dict(clock.state_dict())
    resumed.on_train_start(None, None)
    now[0] = 140.0
    assert resumed.elapsed() == pytest.approx(20.0)
    logged = {}
    monkeypatch.setattr("rlm.experiment.timing.os.getloadavg", lambda: (3.5, 2.0, 1.0))
    resumed.on_train_batch_end(None, SimpleNamespace(log=logged.__setitem__))
    assert logged == {"time/train_s": pytest.approx(20.0), "time/load": 3.5}  # the 1-minute load


def test_unfinished_run_resumes_from_its_checkpoint_only_under_the_same_config(tmp_path):
    import torch

    from rlm.experiment.runner import _prepare_dir
    from rlm.experiment.runs import Run

    run = Run("v", 0, tmp_path / "v" / "seed0", {"trainer": {"max_steps": 10}})
    assert _prepare_dir(run) == []  # fresh
    (run.dir / "ckpt").mkdir()
    torch.save({"global_step": 1}, run.dir / "ckpt" / "last.ckpt")  # unloadable ones: test_experiment_resume
    assert _prepare_dir(run) == ["--ckpt_path", str((run.dir / "ckpt" / "last.ckpt").resolve())]
    changed = Run("v", 0, run.dir, {"trainer": {"max_steps": 20}})
    assert _prepare_dir(changed) == [] and not (run.dir / "ckpt").exists()  # another config: start afresh


def test_a_failing_run_is_reported_and_the_others_go_on(tmp_path, monkeypatch, capsys):
    from rlm.experiment import runner

    exp = load_experiment(
        write_experiment(tmp_path / "e.yaml", seeds=[0, 1], variants={"good": {}, "bad": {}})
    )

    def fake_train(run):
        (run.dir).mkdir(parents=True, exist_ok=True)
        (run.dir / "fit.log").write_text("Traceback ...\nRuntimeError: boom\n")
        return run.variant == "good", 1.5

    monkeypatch.setattr(runner, "train", fake_train)
    monkeypatch.setattr(runner, "summarize", lambda run, wall, jobs: {"val_loss": 1.0})
    monkeypatch.setattr(runner, "evaluate_test", lambda run: True)
    failed = runner.run_experiment(exp, tmp_path / "out")
    assert failed == ["bad/seed0", "bad/seed1"]
    assert sorted(p.parent.name for p in (tmp_path / "out").glob("*/seed*/summary.json")) == [
        "seed0",
        "seed1",
    ]
    assert not list((tmp_path / "out" / "bad").glob("*/summary.json"))
    out = capsys.readouterr().out
    assert "bad/seed0: rlm fit failed" in out and "RuntimeError: boom" in out


def test_the_end_of_an_experiment_run_names_each_run_and_the_next_commands(tmp_path, monkeypatch, capsys):
    from rlm.experiment import runner

    exp = write_experiment(tmp_path / "e.yaml", variants={"baseline": {}, "other": {}})

    def fake_train(run):
        run.dir.mkdir(parents=True, exist_ok=True)
        return True, 1.0

    losses = {"baseline": 3.5, "other": 3.25}
    monkeypatch.setattr(runner, "train", fake_train)
    monkeypatch.setattr(
        runner, "summarize", lambda run, wall, jobs: {"val_loss": losses[run.variant], "test_loss": 3.0}
    )
    monkeypatch.setattr(runner, "evaluate_test", lambda run: True)
    monkeypatch.setattr("rlm.experiment.cli.write_report", lambda out: [out / "results.md"])
    monkeypatch.chdir(tmp_path)
    assert rlm_main(["experiment", "run", str(exp), "--out", "out"]) == 0
    text = capsys.readouterr().out
    block = text[text.index("rlm experiment: 2 finished run(s) in out") :]
    assert "baseline/seed0" in block and "out/other/seed0  (val loss 3.2500, test loss 3.0000)" in block
    assert "rlm eval --ckpt out/other/seed0/ckpt/last.ckpt" in block  # the lowest validation loss
    assert "rlm export --ckpt out/other/seed0/ckpt/last.ckpt --out out/other/seed0/export" in block
    assert "report" in block and "out/results.md" in block


# ----- the report's numbers, from hand-made runs ----------------------------------------------------------


def fake_run(
    out: Path, variant: str, seed: int, loss: float, added: int, speed: float, clock: float = 0.5, **extra
) -> None:
    """A finished run directory with a summary (``extra`` added to it) and a metrics.csv of three validations,
    after 10, 20 and 30 steps of ``clock`` seconds each, with losses loss + 1, loss + 0.5, loss."""
    run = out / variant / f"seed{seed}"
    (run / "logs" / "version_0").mkdir(parents=True)
    rows = ["epoch,step,time/train_s,val/loss,val/moe_load_max/l1"]
    for i, step in enumerate((9, 19, 29)):
        rows += [f"0,{step},{(step + 1) * clock},,", f"0,{step},,{loss + 1.0 - 0.5 * i},0.5"]
    (run / "logs" / "version_0" / "metrics.csv").write_text("\n".join(rows) + "\n")
    summary = {
        "variant": variant, "seed": seed, "fingerprint": "x", "val_loss": loss, "val_ppl": 2.718281828**loss,
        "best_val_loss": loss, "steps": 30, "params_total": 1000 + added, "params_added": added,
        "params_active": 1000, "tokens_per_s": speed, "train_s": 15.0, "wall_s": 20.0, "val_batches": 25,
        "metrics": {"val/moe_load_max/l1": 0.5, "train/moe_load/l1_e0": 0.25}, **extra,
    }  # fmt: skip
    (run / "summary.json").write_text(json.dumps(summary))


def test_report_sorts_by_loss_marks_the_baseline_and_computes_deltas(tmp_path):
    info = {"name": "fake", "base": ["default.yaml"], "baseline": "base", "report_metrics": ["val/*"],
            "variants": {"base": {"description": ""}, "moe": {"description": "8 experts"}, "big": {"description": ""}}}  # fmt: skip
    (tmp_path / "experiment.json").write_text(json.dumps(info))
    runs = {"base": [(0, 3.0, 0, 100.0), (1, 3.2, 0, 110.0)], "moe": [(0, 2.9, 500, 80.0), (1, 2.95, 500, 90.0)],
            "big": [(0, 3.5, 2000, 50.0)]}  # fmt: skip
    for variant, seeds in runs.items():
        for seed, loss, added, speed in seeds:
            fake_run(tmp_path, variant, seed, loss, added, speed, clock=0.25 if variant == "big" else 0.5)
    paths = write_report(tmp_path)
    assert [p.name for p in paths] == ["results.csv", "results.md", *PLOTS]
    for name in PLOTS:
        assert (tmp_path / name).read_bytes().startswith(PNG)
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["variant"], r["seed"], r["baseline"]) for r in rows] == [
        ("base", "0", "True"), ("base", "1", "True"),
        ("moe", "0", "False"), ("moe", "1", "False"), ("big", "0", "False"),
    ]  # fmt: skip
    assert rows[0]["val/moe_load_max/l1"] == "0.5" and rows[0]["train/moe_load/l1_e0"] == "0.25"
    md = (tmp_path / "results.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("| ")]
    main_rows = [line.split(" | ") for line in table[1:4]]
    assert [r[0].strip("| ") for r in main_rows] == ["moe", "**base** (baseline)", "big"]
    mean = {v: statistics.fmean(s[1] for s in seeds) for v, seeds in runs.items()}
    sd_moe = statistics.stdev([2.9, 2.95])
    assert main_rows[0][1] == f"{mean['moe']:.3f} ± {sd_moe:.3f}"
    assert main_rows[0][2] == f"{mean['moe'] - mean['base']:+.3f}"
    assert main_rows[2][1] == f"{mean['big']:.3f}" and main_rows[2][2] == f"{mean['big'] - mean['base']:+.3f}"
    assert main_rows[1][2] == "—"
    assert (
        main_rows[0][-1].rstrip(" |") == f"{85.0 / 105.0:.2f}x"
    )  # tokens/s against the baseline's, last column
    assert main_rows[0][9] == "500" and main_rows[2][9] == "2.00k"
    assert main_rows[0][6] == main_rows[0][7] == "—"  # no test evaluation in these hand-made runs
    # Equal time: 'big' ran 30 steps in 7.5 s; the others are read at 7.5 s on their (5 s, 10 s) segment,
    # a quarter of the way from loss + 1 to loss + 0.5.
    assert "| val loss at 8s train |" in table[0]
    # trainer.limit_val_batches: the validation loss is a subset's, and the header and the note say so
    assert table[0].startswith("| variant | val loss (25 batches) | Δ loss |")
    assert "over the first 25 batches of the validation split (trainer.limit_val_batches" in md
    assert main_rows[0][3] == f"{mean['moe'] + 0.75:.3f}" and main_rows[1][3] == f"{mean['base'] + 0.75:.3f}"
    assert main_rows[2][3] == f"{mean['big']:.3f}"
    assert "`moe`: 8 experts" in md
    assert "val/moe_load_max/l1" in md and "train/moe_load/l1_e0" not in md  # report_metrics: val/* only
    assert "Warning" not in md
    summary = json.loads((tmp_path / "big/seed0/summary.json").read_text())
    (tmp_path / "big/seed0/summary.json").write_text(json.dumps({**summary, "val_step": 20}))
    write_report(tmp_path)
    assert "Warning: the last validation of big/seed0 came before" in (tmp_path / "results.md").read_text()


def test_the_throughput_carries_the_machines_load_and_an_overloaded_run_is_named(tmp_path):
    info = {"name": "fake", "base": ["default.yaml"], "baseline": "base", "variants": {"base": {}, "moe": {}}}
    (tmp_path / "experiment.json").write_text(json.dumps(info))
    fake_run(tmp_path, "base", 0, 3.0, 0, 100.0, load=1.2, cores=2, jobs=1)
    fake_run(tmp_path, "moe", 0, 2.9, 500, 40.0, load=3.5, cores=2, jobs=2)
    fake_run(tmp_path, "moe", 1, 2.9, 500, 90.0, load=0.5, cores=2, jobs=2)
    write_report(tmp_path)
    md = (tmp_path / "results.md").read_text()
    header, _, *rows = md.split("\n\n")[2].splitlines()  # the main table: the third paragraph
    col = {name.strip("| "): i for i, name in enumerate(header.split(" | "))}
    cells = {row.split(" | ")[0].strip("| "): row.split(" | ") for row in rows}
    assert cells["moe"][col["load / cores"]] == "2.0 / 2" and cells["moe"][col["jobs"]] == "2"
    assert cells["**base** (baseline)"][col["load / cores"]] == "1.2 / 2"
    assert "exceeded the core count during moe/seed0 (3.5 on 2 cores): their tokens/s" in md
    assert "moe/seed1" not in md and "base/seed0 (" not in md
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["load"], r["cores"], r["jobs"]) for r in rows] == [
        ("1.2", "2", "1"),
        ("3.5", "2", "2"),
        ("0.5", "2", "2"),
    ]


# ----- end to end -----------------------------------------------------------------------------------------


# slow: a real experiment run: trains and evaluates each variant
@pytest.mark.slow
def test_two_variants_two_seeds_run_resume_and_report(tmp_path, rlm_cache, monkeypatch, capsys):
    # The runner in-process (its rlm fit runs are subprocesses anyway): two interpreter start-ups fewer.
    monkeypatch.chdir(tmp_path)
    for key, value in {"RLM_CACHE": str(rlm_cache), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}.items():
        monkeypatch.setenv(key, value)
    path = write_experiment(
        tmp_path / "exp.yaml",
        description="Token-ID tables against the plain model.",
        common={"trainer": {"max_steps": 4, "val_check_interval": 2, "limit_val_batches": 1}},
        seeds=[0, 1],
        variants={"baseline": {}, "tokenid": {"configs": [str(REPO / "configs/plugins/tokenid.yaml")]}},
    )
    out = tmp_path / "out"
    assert rlm_main(["experiment", "run", str(path), "--out", str(out)]) == 0
    summaries = {p.parent.relative_to(out).as_posix(): p for p in sorted(out.glob("*/seed*/summary.json"))}
    assert list(summaries) == ["baseline/seed0", "baseline/seed1", "tokenid/seed0", "tokenid/seed1"]
    base, tok = (json.loads(summaries[f"{v}/seed0"].read_text()) for v in ("baseline", "tokenid"))
    vocab, d = 1024, 64  # configs/data/tiny.yaml, configs/model/tiny.yaml
    assert base["params_added"] == 0 and tok["params_added"] == vocab * d  # one rank-0 table at layer 0
    assert tok["params_total"] == base["params_total"] + vocab * d
    assert tok["params_active"] == base["params_active"] + d  # a token reads one row of the table
    for s in (base, tok):
        assert s["val_batches"] == 1  # common: limit_val_batches 1, for the loss's label
        assert (
            s["steps"] == 4 and s["val_loss"] > 0 and s["tokens_per_s"] > 0 and 0 < s["train_s"] < s["wall_s"]
        )
        assert s["load"] >= 0 and s["cores"] >= 1 and s["jobs"] == 1  # beside the throughput, in results.md
        # The whole test split, once at the end, with the run's own tokenizer (rlm eval).
        test = json.loads((out / f"{s['variant']}/seed0/test.json").read_text())
        assert (
            s["test_loss"] == test["loss"] > 0
            and s["test_bpb"] == test["bpb"] > 0
            and test["split"] == "test"
        )
    config = yaml.safe_load((out / "tokenid/seed1/config.yaml").read_text())
    assert config["seed_everything"] == 1 and config["model"]["plugins"] == {
        "tokenid": {"layers": [0], "rank": 0}
    }
    with open(out / "results.csv") as f:
        assert len(list(csv.DictReader(f))) == 4
    assert "| **baseline** |" in (out / "results.md").read_text()  # not "baseline (baseline)"
    assert "| val loss (1 batch) |" in (out / "results.md").read_text()
    assert "test bits/byte" in (out / "results.md").read_text()
    for name in PLOTS:
        assert (out / name).read_bytes().startswith(PNG)

    # Resume: only the deleted run trains again.
    stamps = {k: p.stat().st_mtime_ns for k, p in summaries.items()}
    shutil.rmtree(out / "tokenid/seed1")
    capsys.readouterr()
    assert rlm_main(["experiment", "run", str(path), "--out", str(out)]) == 0
    assert capsys.readouterr().out.count("finished earlier, skipped") == 3
    for key, stamp in stamps.items():
        if key != "tokenid/seed1":
            assert summaries[key].stat().st_mtime_ns == stamp, f"{key} was retrained"
    assert (out / "tokenid/seed1/summary.json").is_file()

    # The report alone rebuilds the tables and plots.
    for name in ("results.csv", "results.md", *PLOTS):
        (out / name).unlink()
    assert rlm_main(["experiment", "report", str(out)]) == 0
    assert all((out / name).is_file() for name in ("results.csv", "results.md", *PLOTS))


def test_a_run_equal_to_a_finished_run_of_another_experiment_is_reused(tmp_path, monkeypatch, capsys):
    """The same merged config and seed in a sibling experiment directory is taken from there, not trained."""
    from rlm.experiment import runner

    first = load_experiment(write_experiment(tmp_path / "a.yaml", seeds=[0], variants={"base": {}}))
    second = load_experiment(
        write_experiment(
            tmp_path / "b.yaml",
            seeds=[0, 1],
            variants={"plain": {}, "longer": {"set": {"trainer": {"max_steps": 7}}}},
        )
    )
    trained: list[str] = []

    def fake_train(run):
        trained.append(run.label)
        run.dir.mkdir(parents=True, exist_ok=True)
        (run.dir / "fit.log").write_text(f"trained {run.label}\n")
        return True, 2.0

    monkeypatch.setattr(runner, "train", fake_train)
    monkeypatch.setattr(runner, "evaluate_test", lambda run: True)
    monkeypatch.setattr(
        runner,
        "summarize",
        lambda run, wall, jobs: {"variant": run.variant, "fingerprint": run.fingerprint, "val_loss": 1.0},
    )
    runner.run_experiment(first, tmp_path / "runs" / "a")
    assert trained == ["base/seed0"]
    runner.run_experiment(second, tmp_path / "runs" / "b")
    # plain/seed0 equals a's base/seed0; seed 1 and the other variant differ, so they train
    assert trained == ["base/seed0", "plain/seed1", "longer/seed0", "longer/seed1"]
    copied = tmp_path / "runs" / "b" / "plain" / "seed0"
    summary = json.loads((copied / "summary.json").read_text())
    assert summary["variant"] == "plain"
    assert summary["reused_from"] == str((tmp_path / "runs" / "a" / "base" / "seed0").resolve())
    assert (copied / "fit.log").read_text() == "trained base/seed0\n"
    assert "plain/seed0: same config and seed as" in capsys.readouterr().out
    runner.run_experiment(second, tmp_path / "runs" / "c", reuse_equal=False)
    assert trained[-4:] == ["plain/seed0", "plain/seed1", "longer/seed0", "longer/seed1"]


# slow: a real experiment run: trains and evaluates each variant
@pytest.mark.slow
def test_a_knnlm_variant_reuses_the_trained_model_and_reports_its_datastore(
    tmp_path, rlm_cache, monkeypatch, capsys
):
    """A variant that only adds a kNN-LM stage trains nothing: it takes the base model's run, builds a datastore
    over that run's training split, and its test loss is `rlm eval --datastore`'s kNN-LM loss, with the model's
    own beside it; the datastore is removed afterwards, and a second `run` repeats nothing."""
    monkeypatch.chdir(tmp_path)
    for key, value in {"RLM_CACHE": str(rlm_cache), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}.items():
        monkeypatch.setenv(key, value)
    knn = {"factory": "SQfp16", "k": 8, "tune_tokens": 512, "max_documents": 6}
    path = write_experiment(
        tmp_path / "exp.yaml",
        common={"trainer": {"max_steps": 4, "val_check_interval": 2, "limit_val_batches": 1}},
        variants={
            "baseline": {},
            "baseline_knnlm": {"knnlm": knn},
            "baseline_joint": {"knnlm": {**knn, "rule": "joint"}},
        },  # fmt: skip
    )
    out = tmp_path / "out"
    assert rlm_main(["experiment", "run", str(path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "baseline_knnlm/seed0: same config and seed as" in printed and "(kNN-LM)" in printed
    base = json.loads((out / "baseline/seed0/summary.json").read_text())
    knn_run = out / "baseline_knnlm/seed0"
    summary = json.loads((knn_run / "summary.json").read_text())
    scored = json.loads((knn_run / "test_knnlm.json").read_text())
    assert scored["split"] == "test" and scored["k"] == 8
    assert summary["test_loss"] == scored["knnlm"]["loss"] and summary["test_bpb"] == scored["knnlm"]["bpb"]
    # the same model: its own test loss is the baseline's, scored again in the kNN-LM pass
    assert summary["lm_test"]["loss"] == pytest.approx(base["test_loss"], rel=1e-5)
    assert summary["val_loss"] == base["val_loss"] and "knnlm" not in base
    meta = json.loads((knn_run / "datastore_meta.json").read_text())
    assert summary["knnlm"]["keys"] == meta["entries"] > 0 and summary["knnlm"]["options"] == knn
    assert summary["knnlm"]["build_s"] == pytest.approx(sum(meta["seconds"].values()))
    assert summary["knnlm"]["build_s"] > 0
    assert not (knn_run / "datastore").exists()
    report = (out / "results.md").read_text()
    assert "| baseline_knnlm | " in report and "with datastore" in report
    random_cost = scored["random_neighbours"]["knnlm"]["loss"] - scored["knnlm"]["loss"]
    assert f"| {random_cost:+.3f} |" in report  # the random-neighbour ablation, by seed
    joint = json.loads((out / "baseline_joint/seed0/summary.json").read_text())
    scored_joint = json.loads((out / "baseline_joint/seed0/test_knnlm.json").read_text())
    assert joint["test_loss"] == scored_joint["joint"]["loss"] and joint["knnlm"]["rule"] == "joint"
    assert joint["knnlm"]["interpolate_loss"] == scored_joint["knnlm"]["loss"]
    assert rlm_main(["experiment", "run", str(path), "--out", str(out)]) == 0
    assert capsys.readouterr().out.count("finished earlier, skipped") == 3


def test_a_run_reusing_a_knnlm_run_gets_the_models_own_test_loss():
    from rlm.experiment.runner import without_knnlm

    knn = {"variant": "b", "test_loss": 3.0, "test_ppl": 20.0, "test_bpb": 1.0, "knnlm": {"lam": 0.2},
           "lm_test": {"loss": 3.5, "ppl": 33.1, "bpb": 1.2}}  # fmt: skip
    assert without_knnlm(knn) == {"variant": "b", "test_loss": 3.5, "test_ppl": 33.1, "test_bpb": 1.2}
    plain = {"variant": "a", "test_loss": 3.5}
    assert without_knnlm(plain) == plain


@pytest.mark.parametrize(
    ("knnlm", "message"),
    [
        ({"layers": "final"}, "unknown option 'layers'"),
        ({"k": 0}, r"knnlm.k: got 0; accepted: a positive integer"),
        ({"layer": "middle"}, "accepted: 'final', 'ffn_input' or 'attn_input'"),
        ({"target_recall": 1.5}, r"accepted: a number in \(0, 1\]"),
        ({"cache": "yes"}, "accepted: true or false"),
        ({"rule": "blend"}, "knnlm.rule: got 'blend'; accepted: 'interpolate'"),
        ("everything", "expected true or a mapping of"),
    ],
)
def test_bad_knnlm_options_are_listed(tmp_path, knnlm, message):
    path = write_experiment(tmp_path / "exp.yaml", variants={"baseline": {}, "knn": {"knnlm": knnlm}})
    with pytest.raises(ExperimentError, match=message):
        load_experiment(path)


def test_duration_columns_that_all_read_zero_seconds_are_dropped():
    from rlm.experiment.report import _without_zero_seconds

    header = ["variant", "val loss", "train time", "test loss"]
    rows = [["a", "3.000", "0s", "—"], ["b", "2.900", "—", "—"]]
    assert _without_zero_seconds(header, rows) == (
        ["variant", "val loss", "test loss"],
        [["a", "3.000", "—"], ["b", "2.900", "—"]],
    )
    rows[1][2] = "12s"
    assert _without_zero_seconds(header, rows) == (header, rows)
