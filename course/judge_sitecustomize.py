"""Copied into grading workspaces as sitecustomize.py (course/judge.py): every process a test
starts (a subprocess, a forkserver, a spawned process) is set up as the test's own is
(course/judge_runtime.py: early), and one the test started is judged like it (start_child).
Python imports it at start-up from PYTHONPATH."""
import os

if os.environ.get("COURSE_JUDGE_MODE"):
    import _course_judge
    _course_judge.early()
    if os.environ.get("COURSE_JUDGE_CHILD"):
        _course_judge.start_child(os.environ.pop("COURSE_JUDGE_CHILD"))
