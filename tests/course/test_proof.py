"""The proof, in CI (course/proof.py), on the FULL student edition — every task of every
chapter stubbed: (1) the edition builds, imports, holds no solution and every task's marker
collects its public tests; (2) graded stubbed, every task scores 0 (not one test passing); (3)
putting one task's reference back makes that task pass with everything else still stubbed — its
full test set (public and hidden) for a rotating share of the tasks each day, its fast tests for the
rest; (4) every region of a rotating share is graded: stubbed alone, it fails a test of its task
(`python -m course proof --full`: every task's full set, every region). Gradings (2) and (3) are
judged, as a student's are. And the proof a course runs: a scripted student solving chapter 03 task
by task, the score rising by exactly that task (`python -m course proof --walk NN` walks any chapter;
03's four tasks grade in a fraction of 02's seven)."""
import json
import os

from course.manifest import load
from course.proof import ROTATION, proof, rotating_share, walk


def test_the_full_edition_proves_out(tmp_path):
    manifest = load()
    report = proof([], fast=True, jobs=max(2, min(4, os.cpu_count() or 2)), out_json=tmp_path / "proof.json",
                   verbose=True)
    failures = [r for r in report["configs"] if not r["ok"]]
    assert not report["step1_errors"], report["step1_errors"]
    assert not failures, json.dumps(failures, indent=1)[:6000]
    assert report["edition"] == "full" and report["num_tasks"] == len(manifest.tasks)
    stripped = [r for r in report["configs"] if r["config"].startswith("stripped")]
    only = [r for r in report["configs"] if r["config"].startswith("only ")]
    regions = [r for r in report["configs"] if r.get("region")]
    assert len(only) == len(manifest.tasks)                                # one per task
    assert sorted(t for r in stripped for t in r["graded"]) == sorted(t.id for t in manifest.tasks)
    assert all(r["passed"] == [] for r in stripped)
    assert set(report["stubbed_scores"]) == {t.id for t in manifest.tasks}
    assert report["stubbed_above_zero"] == [] and all(v == 0 for v in report["stubbed_scores"].values())
    assert set(report["full_sets"]) == rotating_share([t.id for t in manifest.tasks])
    assert report["full_sets"]                                            # some full sets every run
    assert regions and {r["region"] for r in regions} == set(report["regions_checked"])
    assert report["ungraded_regions"] == [] and all(r["caught_by"] for r in regions)
    assert report["ok"]


def test_the_rotation_covers_every_task():
    ids = [t.id for t in load().tasks]
    covered = set().union(*(rotating_share(ids, day) for day in range(ROTATION)))
    assert covered == set(ids)
    assert all(len(rotating_share(ids, day)) <= len(ids) // ROTATION + 1 for day in range(ROTATION))


def test_a_student_solving_chapter_03_in_order(tmp_path):
    report = walk("03", fast=True, tmp_parent=tmp_path)
    steps = report["steps"]
    assert steps[0]["passed"] == []
    assert [s["solved"] for s in steps[1:]] == [t.id for t in load().of_chapter("03_scheduler")]
    bad = [s for s in steps[1:] if not s["ok"]]
    assert not bad, bad
    scores = [s["score"] for s in steps[1:]]
    assert scores == sorted(scores) and len(set(scores)) == len(scores)
    assert report["ok"]
