"""The proof, in CI, for every chapter with solution regions (course/proof.py):
(1) the student edition builds and imports; (2) grading it fails every task; (3) putting one
task's reference back makes exactly that task pass; (4) the reference passes every task.
On each task's `fast` tests (course/tasks.toml), in parallel on the CI machine's cores."""
import json
import os

from course.manifest import chapters_with_regions, load
from course.proof import proof


def test_the_assignments_prove_out_for_every_chapter(tmp_path):
    folders = [c.folder for c in chapters_with_regions()]
    report = proof([], fast=True, jobs=max(2, min(4, os.cpu_count() or 2)), out_json=tmp_path / "proof.json",
                   verbose=True)
    failures = [r for r in report["configs"] if not r["ok"]]
    assert not report["step1_errors"], report["step1_errors"]
    assert not failures, json.dumps(failures, indent=1)[:6000]
    assert report["chapters"] == folders
    manifest = load()
    assert len(report["configs"]) == sum(len(manifest.of_chapter(f)) + 2 for f in folders)
    assert report["ok"]
