"""Resume is a contract: a run directory records what defines its results (config.yaml: the resolved
settings; identity.json: the content hash of every prompt it uses, the model's weights, the code's
commit and uncommitted changes), and a resume either continues exactly that or refuses in one line
naming what differs, before anything is written. bench.report counts a run's records by the same
rule. Runs here are in-process (runner.run) on tiny-random, a few seconds each."""
import json
import shutil

import pytest
import torch
from hydra import compose, initialize_config_dir

from bench import report, rundir, runner
from bench.errors import BenchError
from bench.models import TinyRandomModel
from bench.records import RecordLog
from bench.registry import CONF_DIR
from helpers import FAST_PATH, SESSION_TOKENIZER

TINY = ["model=tiny-random", "gen.max_new_tokens=4", "quality=false", "progress=false", "warmup=false",
        "device=cpu", f"model.fast_path={FAST_PATH}", *SESSION_TOKENIZER]


def config(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose("config", overrides=[*TINY, *overrides])


def records(run) -> list[dict]:
    return [json.loads(x) for x in (run / "records.jsonl").read_text().splitlines()]


def refused(run, cfg, message: str) -> None:
    """A resume refused in one line naming `message`, the run directory left byte for byte."""
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(BenchError) as e:
        runner.run(cfg, run)
    assert "\n" not in str(e.value) and message in str(e.value), str(e.value)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def drop_last(run) -> dict:
    """The run's last record taken out, as a run killed before it would leave it; returned."""
    lines = (run / "records.jsonl").read_text().splitlines(keepends=True)
    (run / "records.jsonl").write_text("".join(lines[:-1]))
    return json.loads(lines[-1])


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Count to {i}."}) + "\n" for i in range(3)))
    return path


def test_a_run_records_what_defines_it(tmp_path, prompts):
    run = tmp_path / "run"
    runner.run(config("dataset=jsonl", f"dataset.path={prompts}"), run)
    identity = json.loads((run / rundir.IDENTITY).read_text())
    assert sorted(identity) == ["code", "dataset", "model"]
    assert sorted(identity["dataset"]["prompts"]) == ["q0", "q1", "q2"] and len(identity["dataset"]["sha256"]) == 64
    assert identity["model"]["name"] == "tiny-random" and identity["model"]["weights"].startswith("sha256:")
    assert set(identity["code"]) == {"commit", "dirty", "changes_sha256"}
    assert all(r["prompt_sha256"] == identity["dataset"]["prompts"][r["prompt_id"]] for r in records(run))
    drop_last(run)
    runner.run(config("dataset=jsonl", f"dataset.path={prompts}", "resume=true"), run)  # the same: continued
    assert [r["prompt_id"] for r in records(run)] == ["q0", "q1", "q2"]


def test_resume_refuses_a_prompt_whose_text_changed(tmp_path, prompts):
    """A prompt of dataset.path edited, the last record dropped: the resume kept the edited prompt's
    old record beside new ones made from the new text."""
    run = tmp_path / "run"
    cfg = config("dataset=jsonl", f"dataset.path={prompts}")
    runner.run(cfg, run)
    drop_last(run)
    prompts.write_text(prompts.read_text().replace("Count to 1.", "Count to one hundred."))
    refused(run, config("dataset=jsonl", f"dataset.path={prompts}", "resume=true"),
            "holds records of prompt 'q1' made from other text than the dataset's now")


@pytest.mark.parametrize("copy", ["identical", "edited"])
def test_resume_from_another_copy_of_the_data_continues_only_the_same_prompts(tmp_path, copy):
    """data_dir (BENCH_DATA_DIR) may move between a run and its resume: a copy of the same prompts
    continues it; a copy whose question 82 differs mixed 81 from one and 82 from the other in one
    summary. It is refused."""
    from helpers import DATA_DIR

    first, second = tmp_path / "a" / "mt_bench", tmp_path / "b" / "mt_bench"
    for d in (first, second):
        d.mkdir(parents=True)
        shutil.copy(DATA_DIR / "mt_bench" / "question.jsonl", d)
    if copy == "edited":
        rows = [json.loads(x) for x in (second / "question.jsonl").read_text().splitlines()]
        rows[1]["turns"][0] += " Answer in French."
        (second / "question.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    common = ["dataset=mt_bench", "dataset.limit=2", "gen.max_new_tokens=2"]
    runner.run(config(*common, f"data_dir={first.parent}"), run)
    while drop_last(run)["prompt_id"] != "82":
        pass
    again = config(*common, f"data_dir={second.parent}", "resume=true")
    if copy == "edited":
        refused(run, again, "holds records of prompt '82' made from other text")
    else:
        runner.run(again, run)
        assert sorted({r["prompt_id"] for r in records(run)}) == ["81", "82"]


@pytest.mark.parametrize("part, change, message", [
    ("code", {"commit": "0" * 40, "dirty": False, "changes_sha256": None}, "made by code 000000000000; this is "),
    ("code", "same commit, other changes", "with uncommitted changes"),
    ("model", {"name": "tiny-random", "weights": "sha256:" + "0" * 64}, "of model tiny-random with weights sha256:000"),
])
def test_resume_refuses_other_code_or_other_weights(tmp_path, prompts, part, change, message):
    """A resume after a new commit was neither refused nor recorded (provenance.json named the new
    commit for the old records too): the run records the commit, whether the tree was dirty and the
    hash of its changes, and its weights' hash; a resume by other code or with other weights is
    refused."""
    run = tmp_path / "run"
    runner.run(config("dataset=jsonl", f"dataset.path={prompts}"), run)
    drop_last(run)
    identity = json.loads((run / rundir.IDENTITY).read_text())
    if change == "same commit, other changes":
        change = {**identity["code"], "dirty": True, "changes_sha256": "f" * 64}
    identity[part] = change
    (run / rundir.IDENTITY).write_text(json.dumps(identity))
    refused(run, config("dataset=jsonl", f"dataset.path={prompts}", "resume=true"), message)


def test_resume_refuses_weights_that_changed_under_the_same_settings(tmp_path, prompts, monkeypatch):
    """The same config, other weights (a checkpoint rewritten in place; here tiny-random drawn
    otherwise): the weights' hash differs, the resume is refused before the directory is touched."""
    run = tmp_path / "run"
    runner.run(config("dataset=jsonl", f"dataset.path={prompts}"), run)
    drop_last(run)
    build = TinyRandomModel.build

    def other(self, *args, **kwargs):
        model = build(self, *args, **kwargs)
        with torch.no_grad():
            model.lm_head.weight[0, 0] += 1
        return model

    monkeypatch.setattr(TinyRandomModel, "build", other)
    refused(run, config("dataset=jsonl", f"dataset.path={prompts}", "resume=true"), "with weights sha256:")


@pytest.mark.parametrize("damage, message", [
    ("missing", "but no identity.json saying what made them"), ("damaged", "identity.json is damaged")])
def test_resume_refuses_a_run_that_does_not_say_what_made_it(tmp_path, prompts, damage, message):
    run = tmp_path / "run"
    runner.run(config("dataset=jsonl", f"dataset.path={prompts}"), run)
    drop_last(run)
    if damage == "missing":
        (run / rundir.IDENTITY).unlink()
    else:
        (run / rundir.IDENTITY).write_text('{"dataset": ')
    refused(run, config("dataset=jsonl", f"dataset.path={prompts}", "resume=true"), message)


def test_resume_sets_aside_a_record_made_from_other_text(tmp_path, prompts):
    """A line copied in from a run whose prompt q1 read otherwise: valid, of this decoder and key, but
    not made from this run's prompt; resume sets it aside and runs q1 again."""
    run = tmp_path / "run"
    runner.run(config("dataset=jsonl", f"dataset.path={prompts}"), run)
    lines = (run / "records.jsonl").read_text().splitlines()
    stranger = {**json.loads(lines[1]), "prompt_sha256": "0" * 64, "text": "from elsewhere"}
    (run / "records.jsonl").write_text("\n".join([lines[0], json.dumps(stranger), lines[2]]) + "\n")
    runner.run(config("dataset=jsonl", f"dataset.path={prompts}", "resume=true"), run)
    assert [r["text"] != "from elsewhere" for r in records(run)] == [True] * 3
    rejected = (run / "records.rejected.jsonl").read_text()
    assert "from elsewhere" in rejected


@pytest.mark.parametrize("change, why", [
    ({"decoder": "lookahead"}, "a record of decoder 'lookahead', where this run's is 'autoregressive'"),
    ({"prompt_sha256": "0" * 64}, "a record of prompt 'q1' made from other text"),
    ({"key": "q9#0", "prompt_id": "q9"}, "a record of prompt 'q9', which this run does not list"),
])
def test_report_counts_only_the_runs_own_records(tmp_path, prompts, capsys, change, why):
    """bench.report counted a record whose decoder differs from its run's (a lookahead row inside an
    autoregressive run), which resume sets aside: it applies the same rule, with a warning."""
    run = tmp_path / "run"
    runner.run(config("dataset=jsonl", f"dataset.path={prompts}"), run)
    capsys.readouterr()
    lines = (run / "records.jsonl").read_text().splitlines()
    stranger = {**json.loads(lines[1]), **change}
    (run / "records.jsonl").write_text("\n".join([lines[0], lines[2], json.dumps(stranger)]) + "\n")
    table, _ = report.report([str(run)])
    assert table.loc[0, "records"] == 2 and list(table["decoder"]) == ["autoregressive"]
    assert why in capsys.readouterr().err
    rule = rundir.record_rule(run)
    log = RecordLog(run / "records.jsonl", resume=True, keys={"q0#0", "q1#0", "q2#0"}, settings=rule["settings"],
                    prompts=rule["prompts"])
    log.close()
    assert len(log.records) == 2  # resume's rule: the same two
