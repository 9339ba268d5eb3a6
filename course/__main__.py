"""python -m course {build,grade,proof,check,tests,notebooks,discover} — see README "Course assignments"."""
from __future__ import annotations

import argparse
import pathlib
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("build", help="write the student edition")
    p.add_argument("chapters", nargs="*", help="chapters to strip (02, ch02, kvcache, cuda...); default: all marked")
    p.add_argument("--out", default=None, help="default: build/student (the full edition), build/student-ch02 (CH=02's)")
    p.add_argument("--force", action="store_true", help="replace the folder even if it holds changes the build did not write")

    p = sub.add_parser("grade", help="grade a student tree")
    p.add_argument("student")
    p.add_argument("--chapters", nargs="*", default=None)
    p.add_argument("--task", dest="tasks", action="append", help="grade only this task (repeatable)")
    p.add_argument("--fast", action="store_true", help="only each task's fast tests (what the CI proof runs)")
    p.add_argument("--json", default=None, help="report path (default: STUDENT/grade_report.json)")

    p = sub.add_parser("proof", help="prove the assignments on the full edition (or CHAPTERS' edition): "
                                      "stripped fails, each task alone passes")
    p.add_argument("chapters", nargs="*")
    p.add_argument("--full", action="store_true",
                   help="every task's full test set (CI: a rotating share), and its chapter's others still fail")
    p.add_argument("--walk", metavar="CHAPTER", default=None,
                   help="instead: a scripted student solving CHAPTER task by task, grading after each")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--no-zygote", action="store_true", help="start each grading process afresh (slower)")

    sub.add_parser("check", help="check course/tasks.toml against the marked tree")

    p = sub.add_parser("notebooks", help="execute notebooks/*.ipynb in place")
    p.add_argument("names", nargs="*")

    p = sub.add_parser("tests", help="instructor tool: regenerate the test lists of course/tasks.toml")
    p.add_argument("--from", dest="from_json", default=None, help="reuse this discovery JSON instead of running one")
    p.add_argument("--again", nargs="+", default=[], metavar="TEST_FILE",
                   help="with --from: discover these test files again (new or changed) and update the JSON")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--jobs", type=int, default=2)

    p = sub.add_parser("discover", help="instructor tool: which tests run which regions")
    p.add_argument("chapters", nargs="*")
    p.add_argument("--out", default="build/discover.json")
    p.add_argument("--jobs", type=int, default=2)

    args = parser.parse_args(argv)
    if args.cmd == "build":
        from course.build import build
        info = build(args.chapters, pathlib.Path(args.out) if args.out else None, force=args.force)
        print(f"{info['edition']} edition: {len(info['assigned'])} tasks assigned ({', '.join(info['chapters'])}), "
              f"{len(info['solved'])} given solved, {len(info['later'])} stubbed for later -> {info['out']}")
        return 0
    if args.cmd == "grade":
        from course.grade import main as grade_main
        return grade_main(args.student, chapters=args.chapters, task_ids=args.tasks, fast=args.fast,
                          json_path=args.json)
    if args.cmd == "proof":
        if args.walk:
            from course.proof import walk
            report = walk(args.walk, fast=not args.full, use_zygote=not args.no_zygote)
            print(f"walk through {args.walk}: {'PASSED' if report['ok'] else 'FAILED'}")
        else:
            from course.proof import proof
            report = proof(args.chapters, fast=not args.full, jobs=args.jobs, use_zygote=not args.no_zygote,
                           out_json=pathlib.Path(args.json) if args.json else None)
        return 0 if report["ok"] else 1
    if args.cmd == "check":
        from course.manifest import load, problems
        errors = problems(load())
        for e in errors:
            print(e)
        print("course/tasks.toml: " + ("consistent with the marked tree" if not errors else f"{len(errors)} problems"))
        return 1 if errors else 0
    if args.cmd == "notebooks":
        from course.notebooks import execute_all
        report = execute_all(args.names)
        return 1 if any(isinstance(v, str) for v in report.values()) else 0
    if args.cmd == "tests":
        from course.testgen import main as tests_main
        return tests_main(args.from_json, args.dry_run, args.jobs, again=args.again)
    if args.cmd == "discover":
        from course.discover import discover
        data = discover(args.chapters, pathlib.Path(args.out), jobs=args.jobs)
        print(f"{len(data)} tests -> {args.out}")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
